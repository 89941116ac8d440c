"""Mods defined inside the compiled function (``def`` in ``forward``, a factory such as
``flexfa.mods.alibi`` called there) under ``torch.compile(fullgraph=True)``: Dynamo has no
Python function for them, and until flexfa.made_inside one that closed over a tensor, a
module or a nested helper stopped Dynamo with ``ClosureConversionError`` (torch's
FlexAttention takes them). Each compiled result and gradient equals eager flexfa's on the
same call, captured tensors are read afresh on every run, and a changed Python value
compiles again."""
import collections
import functools
import enum
import re
import sys
import types
import warnings
import weakref

import numpy as np
import pytest
import torch
from numpy import sqrt as np_sqrt

import flexfa
from flexfa import mods

from compile_utils import assert_same, make_inputs, run_step

GLOBAL_BIAS = torch.tensor([0.25, -0.5])


def _compiled(fn, **options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True, **options)


def _frames() -> int:
    """Frames Dynamo compiled so far (recompiles included)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_a_closure_over_a_learnable_argument_gets_its_gradient_and_fresh_values():
    def layer(q, k, v, bias):
        def biased(score, b, h, q_idx, kv_idx):
            return score + bias[h] * (q_idx - kv_idx)
        return flexfa.flex_attention(q, k, v, biased) * 2

    bias = torch.tensor([0.1, -0.2], requires_grad=True)
    inputs = make_inputs(40, seed=1)
    compiled = _compiled(layer)
    for step in range(2):
        assert_same(run_step(lambda *a: compiled(*a, bias), inputs, [bias]),
                    run_step(lambda *a: layer(*a, bias), inputs, [bias]))
        with torch.no_grad():
            bias.mul_(-3.0)  # changed in place: read afresh by the same graph
    graphs = _frames()
    other = torch.tensor([0.4, 0.3], requires_grad=True)  # another tensor of the same shape
    assert_same(run_step(lambda *a: compiled(*a, other), inputs, [other]),
                run_step(lambda *a: layer(*a, other), inputs, [other]))
    assert _frames() == graphs


class _Relative(torch.nn.Module):
    """Mods defined in forward over the module (a learnable table, a window in Python)."""

    def __init__(self, window: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.linspace(-0.5, 0.5, 79))
        self.window = window

    def forward(self, q, k, v):
        def relative(score, b, h, q_idx, kv_idx):
            return score + self.table[q_idx - kv_idx + 39]

        def banded(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx).abs() < self.window

        mask = flexfa.create_block_mask(banded, None, None, q.shape[2], k.shape[2],
                                        device=q.device, BLOCK_SIZE=16)
        return flexfa.flex_attention(q, k, v, relative, mask)


def test_methods_state_in_a_mod_defined_in_forward():
    """A closure over ``self``: the parameter is an operator input with its gradient, the
    window a guarded Python value (changed: compiled again, the new mask)."""
    model = _Relative(window=12)
    compiled = _compiled(model)
    inputs = make_inputs(40, seed=2)
    narrow = run_step(compiled, inputs, [model.table])
    assert_same(narrow, run_step(model, inputs, [model.table]))
    model.window = 30
    wide = run_step(compiled, inputs, [model.table])
    assert_same(wide, run_step(model, inputs, [model.table]))
    assert not torch.allclose(narrow[0], wide[0], rtol=1e-3, atol=1e-3)


def test_a_tensor_computed_in_the_graph_a_helper_and_a_global():
    """A cell holding a graph intermediate (its gradient flows back to what it was computed
    from), one holding a nested helper that closes over a tensor, and a global tensor read by
    a mod defined there (refused with an InputError before)."""
    def layer(q, k, v, slopes):
        doubled = slopes * 2.0

        def distance(h, q_idx, kv_idx):
            return (q_idx - kv_idx) * doubled[h]

        def mod(score, b, h, q_idx, kv_idx):
            return score + distance(h, q_idx, kv_idx) + GLOBAL_BIAS[h] - doubled[1 - h]
        return flexfa.flex_attention(q, k, v, mod)

    slopes = torch.tensor([0.05, -0.1], requires_grad=True)
    inputs = make_inputs(40, seed=3)
    assert_same(run_step(lambda *a: _compiled(layer)(*a, slopes), inputs, [slopes]),
                run_step(lambda *a: layer(*a, slopes), inputs, [slopes]))


def test_a_ready_mod_built_inside_the_compiled_function():
    """``mods.alibi(H)`` called in the compiled function (its slopes made in the graph) and a
    document mask over a local tensor of ids, built there."""
    def layer(q, k, v, ids):
        def same_document(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
        mask = flexfa.create_block_mask(same_document, None, None, q.shape[2], k.shape[2],
                                        device=q.device, BLOCK_SIZE=16)
        return flexfa.flex_attention(q, k, v, mods.alibi(q.shape[1]), mask)

    inputs = make_inputs(48, seed=4)
    compiled = _compiled(layer)
    for ids in (torch.arange(48) // 20, torch.arange(48) // 7):  # new contents, same graph
        assert_same(run_step(lambda *a: compiled(*a, ids), inputs, [inputs[0]]),
                    run_step(lambda *a: layer(*a, ids), inputs, [inputs[0]]))


def _two_biases(first, second, score, b, h, q_idx, kv_idx, *, scale):
    return score + (first[h] - 2.0 * second[h]) * scale


def test_a_partial_of_a_partial_made_inside_reads_each_bound_tensor():
    """functools.partial merges a partial of a partial (its args first): the rebuilt one's
    args must line up with Dynamo's, or a bound tensor's path would reach the other one."""
    import functools

    def layer(q, k, v, first, second):
        inner = functools.partial(_two_biases, first, scale=0.5)
        return flexfa.flex_attention(q, k, v, functools.partial(inner, second, scale=0.25))

    first = torch.tensor([0.3, -0.1], requires_grad=True)
    second = torch.tensor([-0.2, 0.4], requires_grad=True)
    inputs = make_inputs(40, seed=8)
    assert_same(run_step(lambda *a: _compiled(layer)(*a, first, second), inputs, [first, second]),
                run_step(lambda *a: layer(*a, first, second), inputs, [first, second]))


def test_dynamic_lengths_with_a_mask_defined_inside():
    """Symbolic lengths: a closure over a number computed from one (a symbolic int to Dynamo)
    is specialized, with a guard, as the trace's constant."""
    def layer(q, k, v, ids):
        window = q.shape[2] // 3

        def same_document(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & ((q_idx - kv_idx).abs() < window)
        mask = flexfa.create_block_mask(same_document, None, None, q.shape[2], k.shape[2],
                                        device=q.device, BLOCK_SIZE=16)
        return flexfa.flex_attention(q, k, v, block_mask=mask)

    compiled = _compiled(layer, dynamic=True)
    for length in (40, 56):
        inputs = make_inputs(length, seed=length)
        ids = torch.arange(length) // 13
        assert_same(run_step(lambda *a: compiled(*a, ids), inputs, [inputs[0]]),
                    run_step(lambda *a: layer(*a, ids), inputs, [inputs[0]]))


def test_decode_with_a_mod_defined_inside():
    def step(q, k, v, bias):
        def biased(score, b, h, q_idx, kv_idx):
            return score + bias[h]
        return flexfa.flex_decode(q, k, v, biased)

    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 1, 16, generator=generator)
    k, v = (torch.randn(1, 2, 40, 16, generator=generator) for _ in range(2))
    bias = torch.tensor([0.3, -0.3])
    compiled = _compiled(step)
    torch.testing.assert_close(compiled(q, k, v, bias), step(q, k, v, bias), rtol=1e-5,
                               atol=1e-5)


def test_what_cannot_be_followed_is_refused_by_name():
    """An object made inside the compiled function in a mod's cell has no state flexfa can
    read at trace time; a mod reading a captured tensor's value in Python is refused as one
    defined outside."""
    class Holder:
        def __init__(self, bias):
            self.bias = bias

    def with_object(q, k, v, bias):
        holder = Holder(bias)

        def biased(score, b, h, q_idx, kv_idx):
            return score + holder.bias[h]
        return flexfa.flex_attention(q, k, v, biased)

    def with_read(q, k, v, bias):
        def biased(score, b, h, q_idx, kv_idx):
            return score + float(bias[0])
        return flexfa.flex_attention(q, k, v, biased)

    class Scaled:
        factor = 1.0  # the class's default, which the instance made below overrides

        def __init__(self, factor):
            self.factor = factor

        def __call__(self, score, b, h, q_idx, kv_idx):
            return score * self.factor

    def with_callable(q, k, v):
        return flexfa.flex_attention(q, k, v, Scaled(0.5))

    q, k, v = (t.detach() for t in make_inputs(40, seed=6))
    bias = torch.tensor([0.1, 0.2])
    with pytest.raises(flexfa.InputError, match="closes over 'holder'"):
        _compiled(with_object)(q, k, v, bias)
    # (torch 2.11's id() of it was an empty stand-in of its class: traced with factor 1.0)
    with pytest.raises(flexfa.InputError, match="Scaled made inside the compiled function"):
        _compiled(with_callable)(q, k, v)
    with pytest.raises(flexfa.InputError, match="Scaled made inside the compiled function"):
        _compiled(lambda q, k, v: flexfa.flex_attention(q, k, v, Scaled(0.5).__call__))(q, k, v)
    with pytest.raises(Exception):  # Dynamo or flexfa: never a silent constant
        _compiled(with_read)(q, k, v, bias)


def test_another_dynamo_leaves_mods_from_outside_working(monkeypatch):
    """made_inside reads Dynamo's internals; where they differ (simulated: reading a local
    fails) it answers False and a mod from outside compiles as before."""
    import flexfa.made_inside as made_inside

    def broken(tx, name):
        raise AttributeError("symbolic_locals")
    monkeypatch.setattr(made_inside, "_local", broken)
    q, k, v = (t.detach() for t in make_inputs(40, seed=7))
    capped = mods.softcap(20.0)  # made outside
    layer = lambda q, k, v: flexfa.flex_attention(q, k, v, capped)  # noqa: E731
    torch.testing.assert_close(_compiled(layer)(q, k, v), layer(q, k, v), rtol=0, atol=0)


class _Assigning(torch.nn.Module):
    """forward assigns attributes the mask reads: a number (refused), a tensor (works)."""

    def __init__(self):
        super().__init__()
        self.window, self.ids = 40, torch.zeros(64, dtype=torch.long)

    def banded(self, b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() < self.window) & (self.ids[q_idx] == self.ids[kv_idx])

    def forward(self, q, k, v, window, ids, inside):
        if window is not None:
            self.window = window
        self.ids = ids
        if inside:
            def mask_mod(b, h, q_idx, kv_idx):
                return self.banded(b, h, q_idx, kv_idx)
        else:
            mask_mod = self.banded
        mask = flexfa.create_block_mask(mask_mod, None, None, 64, 64, device="cpu",
                                        BLOCK_SIZE=16)
        return flexfa.flex_attention(q, k, v, block_mask=mask)


@pytest.mark.parametrize("inside", [False, True], ids=["method", "defined_inside"])
def test_an_attribute_assigned_in_forward_before_the_call(inside):
    """Dynamo applies ``self.window = 4`` in forward only after the graph, so a mod's trace
    saw the old window: the compiled result differed from eager's silently. Such a number is
    refused now; a tensor assigned so is read as the new one (its path is Dynamo's)."""
    q, k, v = (t.detach() for t in make_inputs(64, seed=9))
    ids = torch.arange(64) // 20
    with pytest.raises(flexfa.InputError, match="reads _Assigning.window, which the compiled"):
        _compiled(_Assigning())(q, k, v, 4, ids, inside)
    torch.testing.assert_close(_compiled(_Assigning())(q, k, v, None, ids, inside),
                               _Assigning()(q, k, v, None, ids, inside), rtol=0, atol=0)


_SETTINGS = {"window": 4}
_WINDOWS = [4]
_WINDOW = 4
_SHIFT = torch.zeros(64)
_CONFIG = types.ModuleType("flexfa_test_window_config")  # a module the mods read from
_CONFIG.window = 4
sys.modules[_CONFIG.__name__] = _CONFIG


def _by_dict(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx).abs() <= _SETTINGS["window"], score, score - 5.0)


def _by_list(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx).abs() <= _WINDOWS[0], score, score - 5.0)


def _by_global(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx).abs() <= _WINDOW, score, score - 5.0)


def _by_module(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx).abs() <= _CONFIG.window, score, score - 5.0)


def _by_global_tensor(score, b, h, q_idx, kv_idx):
    return score + _SHIFT[kv_idx]


class _Window:
    """A class whose attributes the mods read (``_Window.size``, ``_Window.table["size"]``)."""
    size = 4
    table = {"size": 4}


class _Slotted:
    __slots__ = ("table",)

    def __init__(self):
        self.table = {"size": 4}


_SLOTTED = _Slotted()


def _by_slot_dict(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx).abs() <= _SLOTTED.table["size"], score, score - 5.0)


def _by_class_dict(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx).abs() <= _Window.table["size"], score, score - 5.0)


def _near(q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= _Window.size


def _by_class(score, b, h, q_idx, kv_idx):
    return torch.where(_near(q_idx, kv_idx), score, score - 5.0)


class _Shared:
    """A class attribute its subclasses' objects read as their own (``self.shared``)."""
    shared = {"window": 4}


class _Changing(torch.nn.Module, _Shared):
    """forward changes, before the call, what the score_mod reads."""

    def __init__(self):
        super().__init__()
        self.settings, self.log = {"window": 4}, []

    def by_own_dict(self, score, b, h, q_idx, kv_idx):
        return torch.where((q_idx - kv_idx).abs() <= self.settings["window"], score, score - 5.0)

    def by_shared_dict(self, score, b, h, q_idx, kv_idx):
        return torch.where((q_idx - kv_idx).abs() <= self.shared["window"], score, score - 5.0)

    def plain(self, score, b, h, q_idx, kv_idx):
        return torch.where((q_idx - kv_idx).abs() <= 3, score, score - 5.0)

    def forward(self, q, k, v, case):
        global _WINDOW, _SHIFT
        if case == "dict item":
            _SETTINGS["window"] = 9
            score_mod = _by_dict
        elif case == "list item":
            _WINDOWS[0] = 9
            score_mod = _by_list
        elif case == "global":
            _WINDOW = 9
            score_mod = _by_global
        elif case == "global number to a tensor":
            _WINDOW = torch.tensor(9)
            score_mod = _by_global
        elif case == "own dict":
            self.settings["window"] = 9
            score_mod = self.by_own_dict
        elif case == "made inside over a global dict":
            _SETTINGS["window"] = 9

            def score_mod(score, b, h, q_idx, kv_idx):
                return _by_dict(score, b, h, q_idx, kv_idx)
        elif case == "module attribute":
            _CONFIG.window = 9
            score_mod = _by_module
        elif case == "class attribute":  # read in a function the mod calls
            _Window.size = 9
            score_mod = _by_class
        elif case == "class's dict item":
            _Window.table["size"] = 9
            score_mod = _by_class_dict
        elif case == "dict item in a slot":
            _SLOTTED.table["size"] = 9
            score_mod = _by_slot_dict
        elif case == "inherited class dict item":  # through self, defined in a base class
            self.shared["window"] = 9
            score_mod = self.by_shared_dict
        elif case == "class attribute, made inside":
            _Window.size = 9

            def score_mod(score, b, h, q_idx, kv_idx):
                return torch.where(_near(q_idx, kv_idx), score, score - 5.0)
        elif case == "global tensor":  # followed: the operator reads the new tensor
            _SHIFT = torch.linspace(-1.0, 1.0, 64)
            score_mod = _by_global_tensor
        elif case == "global tensor, made inside":
            _SHIFT = torch.linspace(-1.0, 1.0, 64)

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + _SHIFT[kv_idx]
        else:  # a list the mod never reads: works
            self.log.append(len(self.log))
            score_mod = self.plain
        return flexfa.flex_attention(q, k, v, score_mod)


def _unchanged(module: _Changing) -> None:
    global _WINDOW, _SHIFT
    _SETTINGS["window"], _WINDOWS[0], _WINDOW, _SHIFT = 4, 4, 4, torch.zeros(64)
    _CONFIG.window = _Window.size = _Window.table["size"] = _Shared.shared["window"] = 4
    _SLOTTED.table["size"] = 4
    module.settings["window"] = 4
    module.log.clear()


def test_what_forward_changed_before_the_call_is_refused_not_read_stale():
    """A dict or list item, a global, a module's or a class's attribute, a closure variable
    changed in the compiled function before the call: Dynamo applies the change after the
    graph, so the mod's trace read the old value and compiled differed from eager by up to
    1.2 with no error (as for an attribute
    assigned so, which was refused since the thirty-eighth session; until the fortieth a
    class's attribute read in a function the mod calls, 1.95 apart, and a dict held by a
    class or in an object's ``__slots__``, 1.59-1.96 apart, and a number rebound to a tensor,
    traced as the number, 1.64 apart, were not). Refused now, naming what changed. A global
    tensor rebound to another tensor there is followed (the operator reads the new tensor; it
    read the old one, 0.41 apart, and a mod made inside did too), and a list the mod never
    reads may change."""
    q, k, v = (t.detach() for t in make_inputs(64, seed=10))
    module = _Changing()
    refused = {"dict item": "reads a dict that the compiled function changed in place",
               "list item": "reads a list that the compiled function changed in place",
               "global": "reads the global '_WINDOW', which the compiled function assigned",
               "global number to a tensor": "reads the global '_WINDOW', to which the "
                                            "compiled function assigned a tensor",
               "own dict": "reads a dict that the compiled function changed in place",
               "module attribute": "reads flexfa_test_window_config.window, which the",
               "made inside over a global dict": "reads a dict that the compiled function",
               "class attribute": "reads _Window.size, which the compiled function assigned",
               "class attribute, made inside": "reads _Window.size, which the compiled",
               "class's dict item": "reads a dict that the compiled function changed",
               "dict item in a slot": "reads a dict that the compiled function changed",
               "inherited class dict item": "reads a dict that the compiled function changed"}
    for case, message in refused.items():
        _unchanged(module)
        with pytest.raises((flexfa.InputError, torch._dynamo.exc.Unsupported)) as raised:
            _compiled(module)(q, k, v, case)
        if case.startswith("class") and not isinstance(raised.value, flexfa.InputError):
            assert "setattr" in str(raised.value)  # torch 2.11: no class setattr in a graph
        else:
            assert isinstance(raised.value, flexfa.InputError), raised.value
            assert re.search(message, str(raised.value)), raised.value
    window = 4

    def by_cell(score, b, h, q_idx, kv_idx):
        return torch.where((q_idx - kv_idx).abs() <= window, score, score - 5.0)

    def step(q, k, v):
        nonlocal window
        window = 9
        return flexfa.flex_attention(q, k, v, by_cell)
    with pytest.raises(flexfa.InputError, match="reads the closure variable 'window' of 'by_cell'"):
        _compiled(step)(q, k, v)
    shift = torch.zeros(64)

    def shifted(score, b, h, q_idx, kv_idx):
        return score + shift[kv_idx]

    def shifting(q, k, v, new):
        nonlocal shift
        shift = new  # a tensor: followed
        return flexfa.flex_attention(q, k, v, shifted)
    new = torch.linspace(-1.0, 1.0, 64)
    got = _compiled(shifting)(q, k, v, new)
    shift = torch.zeros(64)
    torch.testing.assert_close(got, shifting(q, k, v, new), rtol=0, atol=1e-6)
    for case in ("global tensor", "global tensor, made inside", "unread list"):
        _unchanged(module)
        got = _compiled(module)(q, k, v, case)
        _unchanged(module)
        want = module(q, k, v, case)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        if case != "unread list":  # (the new tensor changes the result)
            _unchanged(module)
            assert (want - module(q, k, v, "unread list")).abs().max() > 0.1
    _unchanged(module)


def _by_module_tensor(score, b, h, q_idx, kv_idx):
    return score + _CONFIG.shift[kv_idx]


def test_a_tensor_read_through_a_module_attribute():
    """A mod reading a tensor as a module's attribute (``config.SHIFT[kv_idx]``) was refused
    under torch.compile ("cannot reach": the path search did not enter modules); now its path
    goes through the module: outputs and the tensor's gradient equal eager's, a tensor
    rebound outside between calls or assigned in the compiled function before the call is
    the one read."""
    q, k, v = (t.detach() for t in make_inputs(64, seed=11))

    def attend(q, k, v, new=None):
        if new is not None:
            _CONFIG.shift = new
        return flexfa.flex_attention(q, k, v, _by_module_tensor)
    compiled = _compiled(attend)
    try:
        for step in range(2):
            _CONFIG.shift = torch.linspace(-1.0, 1.0, 64).mul(step + 1).requires_grad_()
            got = compiled(q, k, v)
            got_grad, = torch.autograd.grad(got.sum(), _CONFIG.shift)
            want = attend(q, k, v)
            want_grad, = torch.autograd.grad(want.sum(), _CONFIG.shift)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
        new = torch.linspace(1.0, -1.0, 64)
        _CONFIG.shift = torch.zeros(64)
        got = compiled(q, k, v, new)
        _CONFIG.shift = torch.zeros(64)
        torch.testing.assert_close(got, attend(q, k, v, new), rtol=0, atol=1e-6)
    finally:
        del _CONFIG.shift


def test_unreadable_pending_changes_warn(monkeypatch):
    """Where Dynamo's internals differ (another torch), what the compiled function changed
    before the call cannot be read: said once with a RuntimeWarning, not silently."""
    from flexfa import made_inside

    def broken(tx):
        raise AttributeError("no side_effects here")
    monkeypatch.setattr(made_inside, "_pending", broken)
    monkeypatch.setattr(made_inside, "_caller_tx", lambda: object())
    monkeypatch.setattr(made_inside, "_WARNED", [])
    with pytest.warns(RuntimeWarning, match="could not read what this torch's Dynamo"):
        assert made_inside.pending_assignments() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert made_inside.pending_assignments() == {}  # once


_NP_WINDOW = np.array([4])
_NP_SCALE = np.float64(1.0)


def _by_numpy_array(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx).abs() <= _NP_WINDOW[0], score, score - 5.0)


def _by_numpy_scalar(score, b, h, q_idx, kv_idx):
    return score * _NP_SCALE + np_sqrt(4.0)


def test_a_mod_reading_numpy_values_is_refused():
    """Dynamo passes a NumPy array or scalar to the graph as an input without guarding its
    value, while the mod's trace held it as a constant: after ``_NP_WINDOW[0] = 9`` or a
    rebound ``np.float64`` global the compiled call ran the old mod (1.3-1.9 apart, no
    error). Refused now; a NumPy function (``np.sqrt`` on Python numbers) is no value."""
    q, k, v = (t.detach() for t in make_inputs(64, seed=12))
    for mod, what in ((_by_numpy_array, "ndarray"), (_by_numpy_scalar, "float64")):
        with pytest.raises(flexfa.InputError, match=f"reads a NumPy {what}"):
            _compiled(lambda q, k, v: flexfa.flex_attention(q, k, v, mod))(q, k, v)
    plain = lambda score, b, h, q_idx, kv_idx: score + np_sqrt(4.0)
    got = _compiled(lambda q, k, v: flexfa.flex_attention(q, k, v, plain))(q, k, v)
    torch.testing.assert_close(got, flexfa.flex_attention(q, k, v, plain), rtol=0, atol=1e-6)


class _Aliased:
    """A config whose ``window`` is another attribute's alias (Hugging Face's attribute_map)."""
    attribute_map = {"window": "sliding_window"}

    def __init__(self):
        self.sliding_window = 4

    def __getattr__(self, name):
        if name in type(self).attribute_map:
            return getattr(self, type(self).attribute_map[name])
        raise AttributeError(name)


class _Alias:
    def __get__(self, obj, owner=None):
        return obj.sliding


class _Described:
    window = _Alias()

    def __init__(self):
        self.sliding = 4


class _Member(enum.Enum):
    WINDOW = {"size": 4}


_NAME = "size"


class _Named:
    size = 4


def _indirect_cases():
    """case -> (the window's reader, the change forward makes, a part of the refusal)."""
    aliased, described, named = _Aliased(), _Described(), _Named()
    chained = collections.ChainMap({"size": 4})
    target = _Named()
    proxy = weakref.proxy(target)
    return {
        "computed name": (lambda: getattr(named, _NAME), lambda: setattr(named, "size", 9),
                          "reads _Named.size, which the compiled function assigned"),
        "__getattr__ alias": (lambda: aliased.window,
                              lambda: setattr(aliased, "sliding_window", 9),
                              "reads _Aliased.sliding_window, which the compiled"),
        "descriptor": (lambda: described.window, lambda: setattr(described, "sliding", 9),
                       "reads _Described.sliding, which the compiled function"),
        "ChainMap": (lambda: chained["size"], lambda: chained.__setitem__("size", 9),
                     "reads a dict that the compiled function changed in place"),
        "enum value": (lambda: _Member.WINDOW.value["size"],
                       lambda: _Member.WINDOW.value.__setitem__("size", 9),
                       "reads a dict that the compiled function changed in place"),
        "weakref.proxy": (lambda: proxy.size, lambda: setattr(target, "size", 9),
                          "reads through a weak reference"),
    }, (target,)


@pytest.mark.parametrize("case", ["computed name", "__getattr__ alias", "descriptor",
                                  "ChainMap", "enum value", "weakref.proxy"])
def test_what_forward_changed_read_indirectly_is_refused(case):
    """A value forward changed before the call that the mod reads under another name than its
    code's (a computed name, a ``__getattr__`` alias map as Hugging Face configs have, a
    descriptor's ``__get__``) or through a library object the walk did not enter (a ChainMap,
    an enum member's value, a weakref.proxy): compiled ran the old mod, 1.64 apart, with no
    error. Refused now."""
    q, k, v = (t.detach() for t in make_inputs(64, seed=13))
    cases, _alive = _indirect_cases()
    read, change, message = cases[case]

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where((q_idx - kv_idx).abs() <= read(), score, score - 5.0)

    def step(q, k, v):
        change()
        return flexfa.flex_attention(q, k, v, score_mod)
    try:
        got = _compiled(step)(q, k, v)
    except flexfa.InputError as error:
        assert re.search(message, str(error)), error
    else:  # torch 2.11's Dynamo drops the change to an enum member's value: nothing is stale
        assert case == "enum value" and _Member.WINDOW.value["size"] == 4
        torch.testing.assert_close(got, flexfa.flex_attention(q, k, v, score_mod), rtol=0,
                                   atol=1e-6)
    _Member.WINDOW.value["size"] = 4


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_default_argument_binding_a_number_of_the_frame(dynamic):
    """``lambda ..., w=w: ...`` made inside: the default's Dynamo value was taken as a
    constant, which a symbolic int is not (from its second value on, or at once with
    dynamic=True): an InputError blaming torch's Dynamo. Now it is specialized as a cell's
    number is, and each value runs its own trace."""
    def layer(q, k, v, w):
        near = lambda s, b, h, q_idx, kv_idx, w=w: s - 0.05 * w * (q_idx - kv_idx).abs()  # noqa: E731
        return flexfa.flex_attention(q, k, v, near)

    compiled = _compiled(layer, dynamic=dynamic)
    q, k, v = make_inputs(32, seed=4)
    for w in (2, 3, 7):
        torch.testing.assert_close(compiled(q, k, v, w), layer(q, k, v, w))


def _dict_biased(score, b, h, q_idx, kv_idx, cfg):
    return score * cfg["t"] + cfg["bias"][h] - 0.05 * cfg["w"] * (q_idx - kv_idx).abs()


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_partial_binding_a_dict_of_numbers_and_a_tensor(dynamic):
    """A functools.partial (from outside: partials take the made-inside route) binding a dict
    was refused as 'a mod defined inside the compiled function closes over score_mod'. Its
    numbers now compile again when they change, its tensor is read afresh and gets its
    gradient."""
    bias = torch.tensor([0.25, -0.5], requires_grad=True)
    cfg = {"t": 1.0, "w": 3, "bias": bias}
    mod = functools.partial(_dict_biased, cfg=cfg)

    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, mod)

    compiled = _compiled(layer, dynamic=dynamic)
    inputs = make_inputs(32, seed=5)
    for t, w in ((1.0, 3), (0.5, 3), (0.5, 5)):
        cfg["t"], cfg["w"] = t, w
        assert_same(run_step(compiled, inputs, [bias]), run_step(layer, inputs, [bias]))
    with torch.no_grad():
        bias.mul_(-3.0)  # read afresh, not the value traced
    assert_same(run_step(compiled, inputs, [bias]), run_step(layer, inputs, [bias]))


@pytest.mark.parametrize("dynamic", [None, True])
def test_softcap_of_a_symbolic_cap_and_masks_combined_inside(dynamic):
    """mods.softcap(cap) of a float Dynamo made symbolic stopped Dynamo (math.isfinite and
    the name's formatting of a symbolic float), and and_masks / or_masks of a mask made inside
    stopped it too (inspect.signature of a function Dynamo has no Python object for)."""
    documents = mods.document([10, 10, 12])  # (its lengths are read on the host: outside)

    def layer(q, k, v, cap, w):
        near = lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < w) & (q_idx >= kv_idx)  # noqa: E731
        keep = flexfa.or_masks(flexfa.and_masks(documents, near), mods.sliding_window(1))
        mask = flexfa.create_block_mask(keep, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
        return flexfa.flex_attention(q, k, v, mods.softcap(cap), block_mask=mask)

    compiled = _compiled(layer, dynamic=dynamic)
    q, k, v = (t.detach() * 4 for t in make_inputs(32, seed=6))
    for cap, w in ((20.0, 3), (5.0, 3), (5.0, 7)):
        torch.testing.assert_close(compiled(q, k, v, cap, w), layer(q, k, v, cap, w))
