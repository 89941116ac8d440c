"""What a compiled call must see again when it changes between calls: the mod given as a
``functools.partial`` (its bound numbers, tensors and function), and mods made inside the
compiled function (a partial of constants works; an object has no Python object to trace and
is refused by name), and a block mask's mask_mod whose Python state changed after the mask
was built (run as it is now, as torch does). Each compiled result equals eager flexfa's on the
same call."""
import functools

import pytest
import torch

import flexfa

from compile_utils import make_inputs


_SLOPES = torch.tensor([0.5, -0.5])


def _biased(score, b, h, q_idx, kv_idx, slope):
    return score + slope * (q_idx - kv_idx)


def _slope_first(slope, score, b, h, q_idx, kv_idx):
    return score + slope * (q_idx - kv_idx)


def _per_head(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (q_idx - kv_idx)


def _scaled(score, b, h, q_idx, kv_idx, slope):
    return score * slope


def _given(q, k, v, mod):
    return flexfa.flex_attention(q, k, v, mod)


def _partials():
    """(name, the partials passed one per call) of partials whose bound values change."""
    return [
        ("float", [functools.partial(_biased, slope=s) for s in (0.1, 0.5, -0.3)]),
        ("int", [functools.partial(_biased, slope=s) for s in (1, 2, 3)]),
        ("positional", [functools.partial(_slope_first, s) for s in (0.2, -0.2)]),
        ("tensor", [functools.partial(_per_head, slopes=torch.tensor([s, -s]))
                    for s in (0.1, 0.5)]),
        ("function", [functools.partial(f, slope=0.7) for f in (_biased, _scaled)]),
    ]


@pytest.mark.parametrize("case", range(len(_partials())), ids=[c[0] for c in _partials()])
def test_a_partial_with_other_bound_values_gives_the_new_result(case):
    """A partial's bound number that changed between calls became symbolic in the recompiled
    frame and a bound tensor is no constant at all: both stopped Dynamo with
    "assume_constant_result argument conversion failed". Partials now go by identity (as an
    nn.Module does) and their bound values are guarded."""
    _, partials = _partials()[case]
    q, k, v = (t.detach() for t in make_inputs(40, seed=1))
    torch._dynamo.reset()
    compiled = torch.compile(_given, backend="aot_eager", fullgraph=True)
    for mod in partials:
        torch.testing.assert_close(compiled(q, k, v, mod), _given(q, k, v, mod), rtol=0, atol=0)


def test_a_partial_over_a_learnable_tensor_reads_it_fresh_and_gets_its_gradient():
    slopes = torch.tensor([0.1, -0.2], requires_grad=True)
    mod = functools.partial(_per_head, slopes=slopes)
    inputs = make_inputs(40, seed=2)
    torch._dynamo.reset()
    compiled = torch.compile(_given, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        results = []
        for fn in (compiled, _given):
            out = fn(*inputs, mod)
            out.sum().backward()
            results.append((out.detach(), slopes.grad))
            slopes.grad = None
        torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
        assert results[1][1].abs().sum() > 0
        with torch.no_grad():
            slopes.mul_(3.0)  # changed in place: the next call reads the new values


def test_mods_made_inside_the_compiled_function():
    """A partial of constants made inside the compiled function is traced as before; a
    callable object made there has no Python object while Dynamo traces: a flexfa error that
    says so (an AssertionError about a VariableTracker before); a function defined there that
    reads a global tensor works (tests/compile/test_compile_made_inside.py has the rest)."""
    class Scaled:
        def __call__(self, score, b, h, q_idx, kv_idx):
            return score * 0.5

    def with_partial(q, k, v):
        return flexfa.flex_attention(q, k, v, functools.partial(_biased, slope=0.3))

    def with_object(q, k, v):
        return flexfa.flex_attention(q, k, v, Scaled())

    def with_function(q, k, v):
        def biased(score, b, h, q_idx, kv_idx):
            return score + _SLOPES[h]
        return flexfa.flex_attention(q, k, v, biased)

    q, k, v = (t.detach() for t in make_inputs(40, seed=3))
    torch._dynamo.reset()
    torch.testing.assert_close(
        torch.compile(with_partial, backend="aot_eager", fullgraph=True)(q, k, v),
        with_partial(q, k, v), rtol=0, atol=0)
    with pytest.raises(flexfa.InputError, match="Scaled made inside the compiled function"):
        torch.compile(with_object, backend="aot_eager", fullgraph=True)(q, k, v)
    # a function defined there reading a global tensor: Dynamo has no __globals__ for it (an
    # InputError until flexfa.made_inside, which reads the global as Dynamo does); with and
    # without fullgraph
    for fullgraph in (True, False):
        torch._dynamo.reset()
        torch.testing.assert_close(
            torch.compile(with_function, backend="aot_eager", fullgraph=fullgraph)(q, k, v),
            with_function(q, k, v), rtol=0, atol=0)



class _Window:
    size = 10  # the Python state a mask_mod reads


def _windowed(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() < _Window.size


def _closed_window(size):
    def windowed(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < size

    def resize(new):
        nonlocal size
        size = new
    return windowed, resize


_DOCUMENTS = {"ids": torch.arange(64) // 20}


def _document(b, h, q_idx, kv_idx):
    return _DOCUMENTS["ids"][q_idx] == _DOCUMENTS["ids"][kv_idx]


def _masked(q, k, v, block_mask):
    return flexfa.flex_attention(q, k, v, block_mask=block_mask)


class _Probe:
    value = 1


def _dynamo_guards_class_attributes() -> bool:
    """Whether this torch's Dynamo guards a number read from a class attribute (2.13 does,
    2.11 folds it into the graph unguarded)."""
    compiled = torch.compile(lambda x: x * _Probe.value, backend="eager", fullgraph=True)
    try:
        compiled(torch.ones(1))
        _Probe.value = 2
        return compiled(torch.ones(1)).item() == 2.0
    finally:
        _Probe.value = 1


def test_a_mask_mod_whose_state_changed_runs_its_new_state_compiled_as_eagerly(monkeypatch):
    """torch's semantics (BlockMask.traced_mask): a mask built before its mask_mod's Python
    state changed (a window in a class attribute or a closure cell, a captured tensor
    rebound) applies the mod as it is now on its old tables, eagerly and compiled, whether
    the graph was compiled before the change or after it. The new masks are within the old
    tables' partial blocks (no full block changes), so the float64 reference of the new mod
    is the expected result; it differs from the old one. Where Dynamo does not guard the
    class attribute (torch 2.11) the graph compiled before the change is refused by flexfa's
    operator instead of running the old mod silently."""
    from flexfa.reference import attention_reference
    monkeypatch.setattr(_Window, "size", 10)
    monkeypatch.setitem(_DOCUMENTS, "ids", torch.arange(64) // 20)
    closed, resize = _closed_window(10)

    def rebind_documents(step):  # the documents move by 4: pairs only in the old partial blocks
        _DOCUMENTS["ids"] = (torch.arange(64) + 4 * step) // 20
    cases = [(_windowed, lambda step: setattr(_Window, "size", 10 - 3 * step)),
             (closed, lambda step: resize(10 - 3 * step)), (_document, rebind_documents)]
    q, k, v = (t.detach() for t in make_inputs(64, seed=5))
    for mod, change in cases:
        block_mask = flexfa.create_block_mask(mod, None, None, 64, 64, BLOCK_SIZE=16)
        before = _masked(q, k, v, block_mask)
        for compile_first in (True, False):  # a graph compiled before the change, or after
            change(0)
            torch._dynamo.reset()
            compiled = torch.compile(_masked, backend="aot_eager", fullgraph=True)
            if compile_first:
                torch.testing.assert_close(compiled(q, k, v, block_mask), before,
                                           rtol=0, atol=0)
            change(1)
            if compile_first and mod is _windowed and not _dynamo_guards_class_attributes():
                # torch 2.11: no guard, the graph would run the old mod; flexfa's operator
                # finds the mod's trace changed (ops.check_unchanged) and refuses
                with pytest.raises(flexfa.InputError, match="reads _Window.size, which changed since"):
                    compiled(q, k, v, block_mask)
                continue
            got = compiled(q, k, v, block_mask)
            torch.testing.assert_close(got, _masked(q, k, v, block_mask), rtol=0, atol=0)
            want = attention_reference(q, k, v, mask_mod=mod).to(got.dtype)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert (got - before).abs().max() > 0.1, mod


class _Band:
    width = 4


class _BandHelper:
    def near(self, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= _Band.width


class _HelpedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.helper = _BandHelper()

    def score(self, score, b, h, q_idx, kv_idx):
        return torch.where(self.helper.near(q_idx, kv_idx), score, score - 5.0)

    def forward(self, q, k, v):
        return flexfa.flex_attention(q, k, v, score_mod=self.score)


def test_a_class_attribute_read_in_a_method_of_another_object(monkeypatch):
    """A score_mod calling a method of another object (``self.helper.near``) that reads a
    class attribute: after the attribute changed the compiled model runs the new mod (torch
    2.13 guards it and compiles again) or is refused (torch 2.11 folds it unguarded; flexfa's
    operator checks it): under 2.11 it ran the old mod silently (compiled and eager differed
    by 1.4)."""
    monkeypatch.setattr(_Band, "width", 4)
    q, k, v = (t.detach() for t in make_inputs(32, seed=6))
    model = _HelpedModel()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    before = compiled(q, k, v)
    torch.testing.assert_close(before, model(q, k, v), rtol=0, atol=0)
    _Band.width = 20
    if not _dynamo_guards_class_attributes():
        with pytest.raises(flexfa.InputError,
                           match=r"reads _Band.width \(in 'near'\), which"):
            compiled(q, k, v)
        return
    got = compiled(q, k, v)
    torch.testing.assert_close(got, model(q, k, v), rtol=0, atol=0)
    assert (got - before).abs().max() > 0.1


class _Config:
    def __init__(self, window):
        self.window = window


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("holder", ["cell", "list", "dict", "attribute", "mask"])
def test_an_int_the_mod_reads_is_seen_at_every_change(holder, dynamic):
    """Regression (an audit's find): an int a mod reads that changed between calls compiled
    again once, but Dynamo's automatic dynamic shapes made it symbolic at that recompile, and
    every later value (with dynamic=True: every value after the first) ran the trace of that
    recompile's value: 0.7-2.6 off eager, silently. Each value compiles again now."""
    torch._dynamo.reset()
    window, box, cfg, config = 4, [4], {"w": 4}, _Config(4)
    read = {"cell": lambda: window, "list": lambda: box[0], "dict": lambda: cfg["w"],
            "attribute": lambda: config.window}

    def bias(score, b, h, q_idx, kv_idx):
        if holder == "cell":
            w = window
        elif holder == "list":
            w = box[0]
        elif holder == "dict":
            w = cfg["w"]
        else:
            w = config.window
        return score - 0.1 * w * (q_idx - kv_idx).abs()

    def masked(q, k, v, mask):
        return flexfa.flex_attention(q, k, v, block_mask=mask)

    def scored(q, k, v):
        return flexfa.flex_attention(q, k, v, bias)
    step = masked if holder == "mask" else scored
    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=dynamic)
    q, k, v = (t.detach() for t in make_inputs(32))
    with torch.no_grad():
        for w in (4, 12, 30, 2):
            window, box[0], cfg["w"], config.window = w, w, w, w
            if holder == "mask":
                args = (q, k, v, flexfa.create_block_mask(flexfa.mods.sliding_window(w), None,
                                                          None, 32, 32, device="cpu",
                                                          BLOCK_SIZE=16))
            else:
                assert read[holder]() == w
                args = (q, k, v)
            torch.testing.assert_close(compiled(*args), step(*args), rtol=1e-5, atol=1e-5,
                                       msg=f"{holder} = {w}")
    torch._dynamo.reset()


def test_a_mask_for_other_lengths_is_flexfas_error_under_dynamic_shapes():
    """Regression (an audit's find): under dynamic=True the mismatch message's sizes were
    symbolic and Dynamo failed building it ("BUILD_STRING type error") instead of raising
    flexfa's InputError, which it raises eagerly and in a static compile."""
    torch._dynamo.reset()
    mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, 32, 32, device="cpu",
                                    BLOCK_SIZE=16)

    def step(q, k, v):
        return flexfa.flex_attention(q, k, v, block_mask=mask)
    q, k, v = (t.detach() for t in make_inputs(48))
    compiled = torch.compile(step, backend="eager", fullgraph=True, dynamic=True)
    with pytest.raises(flexfa.InputError, match=r"built for .*Q_LEN=32.* got .*Q_LEN=48"):
        compiled(q, k, v)
    torch._dynamo.reset()


def _tripled_when_compiling(score, b, h, q_idx, kv_idx):
    return score * 3.0 if torch.compiler.is_compiling() else score


def _tripled(score, b, h, q_idx, kv_idx):
    return score * 3.0


@pytest.mark.parametrize("eager_first", [True, False])
def test_a_mod_branching_on_is_compiling_gets_each_trace(eager_first):
    """Eager and compiled calls shared one trace memo entry with no compile-mode key: a mod
    branching on torch.compiler.is_compiling() ran whichever trace came first (2.16 off in an
    audit's probe)."""
    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, _tripled_when_compiling)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    q, k, v = (t.detach() for t in make_inputs(32, seed=7))
    plain, tripled = flexfa.flex_attention(q, k, v), flexfa.flex_attention(q, k, v, _tripled)
    calls = [(layer, plain), (compiled, tripled)]
    for fn, want in (calls if eager_first else calls[::-1]) * 2:
        torch.testing.assert_close(fn(q, k, v), want)


import collections  # noqa: E402
import enum  # noqa: E402
import types  # noqa: E402
import weakref  # noqa: E402


class _Mode(enum.Enum):
    A = 1


class _Lookup:  # read through __getitem__, which the mod's code never names
    def __init__(self):
        self._values = {"c": 0.1}

    def __getitem__(self, key):
        return self._values[key]


class _Slope(torch.nn.Module):
    def forward(self, score, b, h, q_idx, kv_idx):
        return score


_ENUM_KEYED = {_Mode.A: 0.1}
_QUEUE = collections.deque([0.1])
_PROXIED = {"c": 0.1}
_PROXY = types.MappingProxyType(_PROXIED)
_DEFAULT = {"c": 0.1}
_LOOKUP = _Lookup()
_CHAINED = collections.ChainMap({"c": 0.1})
_HOOKED_VALUE = {"c": 0.1}
_HOOKED = _Slope()
_HOOKED.register_forward_hook(
    lambda module, args, out: out + _HOOKED_VALUE["c"] * (args[3] - args[4]))


def _by_enum(score, b, h, q_idx, kv_idx):
    return score + _ENUM_KEYED[_Mode.A] * (q_idx - kv_idx)


def _by_deque(score, b, h, q_idx, kv_idx):
    return score + _QUEUE[0] * (q_idx - kv_idx)


def _by_proxy(score, b, h, q_idx, kv_idx):
    return score + _PROXY["c"] * (q_idx - kv_idx)


def _by_default(score, b, h, q_idx, kv_idx, cfg=_DEFAULT):
    return score + cfg["c"] * (q_idx - kv_idx)


def _by_getitem(score, b, h, q_idx, kv_idx):
    return score + _LOOKUP["c"] * (q_idx - kv_idx)


def _by_chain(score, b, h, q_idx, kv_idx):
    return score + _CHAINED["c"] * (q_idx - kv_idx)


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = 0.1


class _Settings(collections.UserDict):
    pass


_LAYERS = torch.nn.ModuleList([_Scale()])
_SETTINGS = _Settings(c=0.1)


def _by_module_list(score, b, h, q_idx, kv_idx):
    return score + _LAYERS[0].c * (q_idx - kv_idx)


def _by_user_dict(score, b, h, q_idx, kv_idx):
    return score + _SETTINGS["c"] * (q_idx - kv_idx)


_ROUTES = {
    "ModuleList item": (_by_module_list, lambda x: setattr(_LAYERS[0], "c", x)),
    "UserDict subclass": (_by_user_dict, lambda x: _SETTINGS.__setitem__("c", x)),
    "enum key": (_by_enum, lambda x: _ENUM_KEYED.__setitem__(_Mode.A, x)),
    "deque": (_by_deque, lambda x: _QUEUE.__setitem__(0, x)),
    "mapping proxy": (_by_proxy, lambda x: _PROXIED.__setitem__("c", x)),
    "default argument": (_by_default, lambda x: _DEFAULT.__setitem__("c", x)),
    "__getitem__": (_by_getitem, lambda x: _LOOKUP._values.__setitem__("c", x)),
    "ChainMap": (_by_chain, lambda x: _CHAINED.maps[0].__setitem__("c", x)),
    "forward hook": (_HOOKED, lambda x: _HOOKED_VALUE.__setitem__("c", x)),
}


@pytest.mark.parametrize("route", list(_ROUTES))
def test_a_float_read_through_any_route_follows_its_changes(route):
    """Dynamo makes a float symbolic at its first change and stops guarding it; flexfa's trace
    holds it as a constant, so only its pin (number_paths) recompiles. Floats read through
    an enum- or tuple-keyed dict, a deque, a MappingProxyType, a default argument, a special
    method (__getitem__, __call__), a ChainMap (a KeyError inside Dynamo) or a module's forward
    hook were not pinned: from the third value on the compiled call ran the second's (0.46
    and 0.76 off in an audit's probes)."""
    mod, set_value = _ROUTES[route]
    q, k, v = (t.detach() for t in make_inputs(24, seed=2))
    torch._dynamo.reset()
    compiled = torch.compile(_given, backend="eager", fullgraph=True)
    try:
        for value in (0.1, 0.2, 0.3, 0.4):
            set_value(value)
            torch.testing.assert_close(compiled(q, k, v, mod), _given(q, k, v, mod))
    finally:
        set_value(0.1)


class _Holder:
    c = 0.1


_HOLDER = _Holder()
_WEAK = weakref.ref(_HOLDER)


def _by_weakref(score, b, h, q_idx, kv_idx):
    return score + _WEAK().c * (q_idx - kv_idx)


def _by_import(score, b, h, q_idx, kv_idx):
    import compile_utils  # a user module imported in the mod's body
    return score + compile_utils.__name__.count("_") * (q_idx - kv_idx)


@pytest.mark.parametrize("mod, message", [
    (_by_weakref, "reads through a weak reference"),
    (_by_import, "imports 'compile_utils' in its body")])
def test_routes_no_path_reaches_are_refused(mod, message):
    """Through a weak reference, or a module imported in the mod's body, no path from the
    mod reaches the value for torch.compile's guards (a float there ran stale): refused."""
    q, k, v = (t.detach() for t in make_inputs(24, seed=2))
    torch._dynamo.reset()
    with pytest.raises(flexfa.InputError, match=message):
        torch.compile(_given, backend="eager", fullgraph=True)(q, k, v, mod)


def _bad_calls() -> dict:
    """name: (function, arguments) of calls flexfa refuses, whose messages show a tensor's
    shape (symbolic under dynamic=True)."""
    q = torch.randn(1, 4, 32, 16)
    pages = torch.randn(4, 16, 2, 16)
    table = torch.zeros(1, 4, dtype=torch.int32)

    def attention(q, k, v, sinks=None):
        return flexfa.flex_attention(q, k, v, sinks=sinks)

    def decode(q, k, v, kv_lens=None, page_table=None):
        return flexfa.flex_decode(q, k, v, kv_lens=kv_lens, page_table=page_table)
    return {
        "sinks": (attention, (q, q, q, torch.zeros(3))),
        "three_dims": (attention, (q[0], q[0], q[0])),
        "decode_value": (decode, (q[:, :, :2], q, q[:, :2])),
        "decode_kv_lens": (decode, (q[:, :, :2], q, q, torch.zeros(3, dtype=torch.int32))),
        "paged_value": (decode, (q[:, :, :2], pages, pages[:, :8], None, table)),
    }


@pytest.mark.parametrize("name", sorted(_bad_calls()))
@pytest.mark.parametrize("dynamic", [None, True])
def test_shapes_in_error_messages_under_dynamic_shapes(name, dynamic):
    """Regression (a carried gap): under dynamic=True an error message that showed a tensor's
    shape as a tuple of symbolic sizes failed inside Dynamo ("assume_constant_result argument
    conversion failed") instead of raising flexfa's error, as an eager call and a static
    compile do: the same type and message now."""
    function, args = _bad_calls()[name]
    with pytest.raises(flexfa.FlexFAError) as eager:
        function(*args)
    torch._dynamo.reset()
    compiled = torch.compile(function, backend="eager", fullgraph=True, dynamic=dynamic)
    with pytest.raises(type(eager.value)) as got:
        compiled(*args)
    assert str(got.value).split("\n")[0] == str(eager.value), (str(got.value), str(eager.value))
    torch._dynamo.reset()


@pytest.mark.parametrize("shape", [(), (3,), (0,), (1, 2), (4, 0, 3), (2, 3, 4, 5, 6)])
def test_dims_shows_a_shape_as_a_tuple_does(shape):
    """The messages' ``errors.dims`` (sizes formatted one by one, for Dynamo) reads as
    ``tuple(tensor.shape)`` did eagerly."""
    from flexfa.errors import dims
    assert dims(torch.empty(shape)) == str(tuple(shape))
