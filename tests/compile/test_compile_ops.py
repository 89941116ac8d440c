"""The flexfa:: operators on their own: torch.library.opcheck (schema, fake tensors, autograd
registration, AOT dispatch), the registry holding no tensors, and import cost."""
import gc
import subprocess
import sys
import types
import weakref

import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask.validate import TABLES
from flexfa.compiled import describe, unbound


def _case():
    bias = torch.randn(2, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    mask = flexfa.create_block_mask(mods.causal, 1, None, 40, 40, device="cpu",
                                    BLOCK_SIZE=32)
    key, score_paths, mask_paths, *_ = describe(*unbound(biased), *unbound(mask.mask_mod), False,
                                            None)
    assert score_paths == ((("cell", "bias"),),) and mask_paths == ()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=generator) for _ in range(3))
    return bias, key, q, k, v, [getattr(mask, n) for n in TABLES]


def test_opcheck_forward_and_backward():
    bias, key, q, k, v, tables = _case()
    args = (q.requires_grad_(), k, v, key, None, True, [bias], [], tables, [32, 32])
    torch.library.opcheck(torch.ops.flexfa.flex_attention.default, args)
    out, lse, maxs = torch.ops.flexfa.flex_attention(q.detach(), k, v, key, None, True,
                                                    [bias.detach()], [], tables, [32, 32])
    assert maxs.shape == lse.shape == (1, 2, 40)
    # a captured tensor past the read ones (one the trace removed) gets a zero gradient
    unread = torch.randn(3, requires_grad=True)
    args = (q, k, v, key, None, False, [bias, unread], [], tables, [32, 32])
    torch.library.opcheck(torch.ops.flexfa.flex_attention.default, args)
    out_unread = torch.ops.flexfa.flex_attention(*args)[0]
    grads = torch.autograd.grad(out_unread.sum(), (bias, unread))
    assert torch.equal(grads[1], torch.zeros(3)) and grads[0].abs().sum() > 0
    grad_out = torch.randn_like(out)
    torch.library.opcheck(torch.ops.flexfa.flex_attention_backward.default,
                          (q.detach(), k, v, out, lse, grad_out, None, key, None,
                           [bias.detach()], [], tables, [32, 32], [0], True, True))


def test_opcheck_block_mask_tables():
    key, *_ = describe(*unbound(None), *unbound(mods.causal), False, None)
    for separate in (True, False):
        tables = torch.ops.flexfa.block_mask_tables(key, 1, 2, 100, 64, [32, 16], separate, [],
                                                    torch.device("cpu"))
        assert len(tables) == (8 if separate else 4)
        torch.library.opcheck(torch.ops.flexfa.block_mask_tables.default,
                              (key, 1, 2, 100, 64, [32, 16], separate, [], torch.device("cpu")))


def test_operator_output_in_query_stride_order():
    _, key, q, k, v, tables = _case()
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # memory [B, L, H, E]
    out, _, _ = torch.ops.flexfa.flex_attention(q_t, k, v, key, None, False, [torch.randn(2)],
                                                [], tables, [32, 32])
    assert out.stride() == q_t.stride()
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake_mode:
        fakes = [fake_mode.from_tensor(t) for t in (q_t, k, v)]
        fake_out, lse, maxs = torch.ops.flexfa.flex_attention(
            *fakes, key, None, False, [fake_mode.from_tensor(torch.randn(2))],
            [], [fake_mode.from_tensor(t) for t in tables], [32, 32])
    assert fake_out.stride() == out.stride() and maxs.numel() == 0


def test_registry_keeps_no_captured_tensor_alive():
    bias, key, q, k, v, tables = _case()
    torch.ops.flexfa.flex_attention(q, k, v, key, None, False, [bias.detach()], [], tables,
                                    [32, 32])
    ref = weakref.ref(bias)
    del bias
    gc.collect()
    assert ref() is None


class _Limit:
    value = 20  # a class attribute, which torch 2.11's Dynamo reads unguarded


def _below_limit(b, h, q_idx, kv_idx):
    return kv_idx < _Limit.value


def test_operators_refuse_a_mod_whose_trace_changed_since_the_graph(monkeypatch):
    """A graph's operators check that each mod from outside still traces to the graph's IR
    (ops.check_unchanged): where Dynamo installed no guard for a value the mod reads, the
    graph would otherwise run the old mod (torch 2.11 and class attributes:
    tests/compile/test_compile_guards.py runs it compiled)."""
    key, *_ = describe(*unbound(None), *unbound(_below_limit), False, None)
    cpu = torch.device("cpu")
    tables = torch.ops.flexfa.block_mask_tables(key, 1, 1, 40, 40, [16, 16], True, [], cpu)
    q, k, v = (t.detach() for t in _case()[2:5])
    args = (q, k, v, key, None, False, [], [], tables, [16, 16])
    before = torch.ops.flexfa.flex_attention(*args)[0]
    monkeypatch.setattr(_Limit, "value", 30)
    for call in (lambda: torch.ops.flexfa.flex_attention(*args),
                 lambda: torch.ops.flexfa.block_mask_tables(key, 1, 1, 40, 40, [16, 16], True,
                                                            [], cpu),
                 lambda: torch.ops.flexfa.flex_decode(q[:, :, :1], k, v, key, None, [], [],
                                                      tables, [16, 16], [40, 40], None, None,
                                                      None, None, True)):
        with pytest.raises(flexfa.InputError, match="reads _Limit.value, which changed since"):
            call()
    monkeypatch.setattr(_Limit, "value", 20)  # the traced state again: runs
    assert torch.equal(torch.ops.flexfa.flex_attention(*args)[0], before)


class _Config:
    window, step, label = 8, 0, "x"


def pinned(mod) -> tuple:
    """The class pins the compiled operators check for ``mod``."""
    from flexfa.compiled import functions_run
    from flexfa.ops import class_pins
    return class_pins(mod, functions_run(mod)[0])


def test_class_pins_are_the_attributes_read_from_a_class():
    """Only ``Class.attribute`` loads are pinned (a name the code uses otherwise is not, so a
    changed attribute the mod never reads refuses nothing), through a closure too, and in
    code nested in the mod."""
    def windowed(b, h, q_idx, kv_idx):
        step = 4  # a local of the same name as an attribute of _Config: not pinned
        return (q_idx - kv_idx).abs() < _Config.window + step

    def factory(config):
        def labelled(b, h, q_idx, kv_idx):
            name = (lambda: _Config.label)()  # nested code: its globals
            return (q_idx - kv_idx).abs() < config.window + len(name)
        return labelled

    assert [(p.ref(), p.name, p.value) for p in pinned(windowed)] == [(_Config, "window", 8)]
    got = {(p.ref(), p.name) for p in pinned(factory(_Config))}
    assert got == {(_Config, "window"), (_Config, "label")}
    assert pinned(flexfa.mods.causal) == () and pinned(None) == ()
    # a helper the mod calls: its loads count (torch 2.11 folds them into the graph too)
    assert [(p.ref(), p.name) for p in pinned(_through_a_helper)] == [(_Config, "step")]


def _helper_step(q_idx):
    return q_idx + _Config.step


def _through_a_helper(b, h, q_idx, kv_idx):
    return _helper_step(q_idx) >= kv_idx


class _Near:
    def near(self, q_idx, kv_idx):  # a method of another object the mod calls
        return (q_idx - kv_idx).abs() <= _Config.window

    def unused(self, q_idx):  # a method the mod never names: not pinned
        return q_idx < _Config.label

    @staticmethod
    def shifted(q_idx):
        return q_idx + _Config.step


class _Bands(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.helper = _Near()

    def mask(self, b, h, q_idx, kv_idx):
        return self.helper.near(_Near.shifted(q_idx), kv_idx) & self.lower(q_idx, kv_idx)

    @property
    def lower(self):
        return _lower


def _lower(q_idx, kv_idx):
    return kv_idx <= q_idx + _Limit.value


def test_class_pins_follow_methods_of_other_objects_and_modules():
    """torch 2.11's Dynamo folds a class attribute read in a method of another object the mod
    calls (``self.helper.near(...)`` reading ``Config.window``) unguarded too: compiled and
    eager differed silently after a change (probe under 2.11). The pins follow methods,
    static methods, property getters and the functions they return, and a module's
    functions, named by the code that runs; a method of a name no code uses is not pinned."""
    got = {(p.ref(), p.name, p.where) for p in pinned(_Bands().mask)}
    assert got == {(_Config, "window", "near"), (_Config, "step", "shifted"),
                   (_Limit, "value", "_lower")}
    helpers = types.ModuleType("user_helpers")
    exec("class Cfg:\n    band = 3\n\ndef band(q, k):\n    return (q - k).abs() < Cfg.band\n",
         helpers.__dict__)
    with_module = lambda b, h, q_idx, kv_idx: helpers.band(q_idx, kv_idx)
    assert [(p.ref(), p.name, p.mod) for p in pinned(with_module)] == [
        (helpers.Cfg, "band", "<lambda>")]


def test_a_mod_reaching_more_than_the_walk_checks_is_refused(monkeypatch):
    """What a mod may run is walked for its class pins and the compiled function's pending
    changes; past the walk's limits it stopped silently, so a class attribute read by a
    function past the 64th was neither pinned nor checked. Past them now the walk is an
    InputError (limits lowered here); scalars are not counted, and a class's attributes
    under the names the code uses are walked (``_Config.window`` of ``_Near.near``)."""
    from flexfa import compiled
    chain = {"_Config": _Config, "__name__": "user_chain"}
    exec("def f0(q, k):\n    return (q - k).abs() <= _Config.window\n"
         + "".join(f"def f{i}(q, k):\n    return f{i - 1}(q, k)\n" for i in range(1, 6)),
         chain)
    top = chain["f5"]
    mask = lambda b, h, q_idx, kv_idx: top(q_idx, kv_idx)
    assert [(p.ref(), p.name, p.where) for p in pinned(mask)] == [(_Config, "window", "f0")]
    monkeypatch.setattr(compiled, "MAX_RUN_FUNCTIONS", 4)
    with pytest.raises(flexfa.InputError, match="reaches more than 4 functions"):
        pinned(mask)
    monkeypatch.setattr(compiled, "MAX_RUN_FUNCTIONS", 256)
    table = [float(i) for i in range(100)]  # scalars: not counted
    scaled = lambda score, b, h, q_idx, kv_idx: score * table[3]
    monkeypatch.setattr(compiled, "MAX_RUN_VISITS", 8)
    assert pinned(scaled) == ()
    nested = [[i] for i in range(10)]
    listed = lambda score, b, h, q_idx, kv_idx: score * nested[3][0]
    with pytest.raises(flexfa.InputError, match="reaches more than 8 objects"):
        pinned(listed)


def test_a_lookup_hook_takes_every_attribute_but_not_every_method(monkeypatch):
    """Where reached code looks names up dynamically (a ``__getattr__`` alias map, as Hugging
    Face configs have) the walk takes every attribute of what it reaches, but a class's
    methods still only under names its code uses: taking them all counted a config class's
    hundreds of methods against the walk's limit and refused the mod."""
    from flexfa import compiled
    namespace = {"__name__": "user_config"}
    exec("class Config:\n"
         "    aliases = {'window': 'sliding_window'}\n"
         "    def __init__(self):\n"
         "        self.sliding_window, self.extra = 4, {'x': 1}\n"
         "    def __getattr__(self, name):\n"
         "        return getattr(self, type(self).aliases[name])\n"
         + "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(20)), namespace)
    config = namespace["Config"]()
    mask = lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() <= config.window
    monkeypatch.setattr(compiled, "MAX_RUN_FUNCTIONS", 8)
    functions, names, objects = compiled.functions_run(mask)
    assert [f.__name__ for f in functions] == ["<lambda>", "__getattr__"]
    assert names is compiled.EVERY_NAME and "sliding_window" in names
    assert any(obj is config.extra for obj in objects)  # an attribute no code names


def test_an_attribute_named_like_a_global_function_is_not_a_global(monkeypatch):
    """The walk of what a mod may run took every name in its code as a possible global: a
    mod reading ``self.cfg.t`` in a module with a global function ``t`` walked ``t`` and all
    it calls, and past the limit the compiled call was refused, though the mod reads one
    number. Globals are the names the code looks up as globals (or imports); names looked
    up by computed strings still take every name."""
    from flexfa import compiled
    namespace = {"__name__": "user_layers"}
    exec("def helper(x):\n    return x\n"
         "def t(x):\n    return helper(x)\n"
         "class Cfg:\n    t = 0.5\n"
         "cfg = Cfg()\n"
         "def scaled(score, b, h, q_idx, kv_idx):\n    return score * cfg.t\n"
         "def looked_up(score, b, h, q_idx, kv_idx):\n    return score * globals()['t'](1)\n"
         "def imported(score, b, h, q_idx, kv_idx):\n"
         "    from math import pi\n    return score * pi\n"
         "def by_global(score, b, h, q_idx, kv_idx):\n"
         "    return score * [lambda: t(1) for _ in '.'][0]()\n", namespace)
    monkeypatch.setattr(compiled, "MAX_RUN_FUNCTIONS", 2)
    functions, names, objects = compiled.functions_run(namespace["scaled"])
    assert [f.__name__ for f in functions] == ["scaled"]
    assert "t" in names and any(obj is namespace["cfg"] for obj in objects)
    monkeypatch.setattr(compiled, "MAX_RUN_FUNCTIONS", 8)
    for name in ("looked_up", "by_global"):  # by a computed name; in nested code
        functions = compiled.functions_run(namespace[name])[0]
        assert {"t", "helper"} <= {f.__name__ for f in functions}, name
    assert "math" in compiled.global_names(namespace["imported"].__code__)


def test_import_does_not_load_dynamo_or_triton():
    code = "import flexfa, sys; print('torch._dynamo' in sys.modules, 'triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.stdout.split() == ["False", "False"], result.stderr[-2000:]


def test_python_attributes_of_a_captured_tensor_are_refused_under_compile():
    """A mod reading a Python attribute set on a captured tensor (``table.width``): Dynamo
    does not guard it, so a changed value ran the old one (1.15 off in a probe); eager
    flexfa follows it (the trace memo's guard reads it), torch.compile refuses it."""
    table = torch.zeros(8)
    table.width = 2.0

    def scaled(score, b, h, q_idx, kv_idx):
        return score * table.width

    q = torch.randn(1, 1, 16, 16)
    torch._dynamo.reset()
    compiled_call = torch.compile(lambda q: flexfa.flex_attention(q, q, q, scaled),
                                  backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="Python attributes set on a captured tensor"):
        compiled_call(q)
    table.other = 1.0  # an attribute no code names: not refused
    del table.width
    table_free = torch.zeros(8)
    table_free.note = "unread"

    def plain(score, b, h, q_idx, kv_idx):
        return score + table_free[kv_idx % 8]

    torch._dynamo.reset()
    out = torch.compile(lambda q: flexfa.flex_attention(q, q, q, plain), backend="eager",
                        fullgraph=True)(q)
    torch.testing.assert_close(out, flexfa.flex_attention(q, q, q, plain))


def test_a_numpy_kernel_option_is_a_clear_error_under_compile():
    """A NumPy int option (np.int64(16)) runs eagerly; under torch.compile it failed inside
    Dynamo (assume_constant_result's argument conversion). It is an InputTypeError naming
    the key there, and a Python int runs."""
    numpy = pytest.importorskip("numpy")
    q = torch.randn(1, 1, 32, 16)

    def call(q, options):
        return flexfa.flex_attention(q, q, q, kernel_options=options)

    torch._dynamo.reset()
    compiled_call = torch.compile(call, backend="eager", fullgraph=True)
    with pytest.raises(flexfa.errors.InputTypeError,
                       match=r"kernel_options\['BLOCK_M'\] must be a Python int"):
        compiled_call(q, {"BLOCK_M": numpy.int64(16)})
    torch.testing.assert_close(compiled_call(q, {"BLOCK_M": 16}), call(q, {"BLOCK_M": 16}))
    import enum

    class Warps(enum.IntEnum):  # an int subclass runs (the first form of the check refused it)
        FOUR = 4

    torch.testing.assert_close(compiled_call(q, {"num_warps": Warps.FOUR}),
                               call(q, {"num_warps": 4}))


def test_a_library_objects_own_weak_references_are_not_the_mods_reads():
    """Under a computed-name walk (getattr) every attribute is taken, a library module's
    too: nn.LSTM's weak references to its weights made a mod refused under torch.compile."""
    from flexfa import compiled

    class WithLstm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.use = torch.nn.LSTM(2, 2), 1.0

        def score(self, s, b, h, q_idx, kv_idx):
            return s * getattr(self, "use")

    run = compiled.functions_run(WithLstm().score)
    assert not any(obj is compiled.UNFOLLOWED for obj in run[2])


def test_a_container_modules_items_are_pinned_not_its_other_state():
    """Under torch.compile the numbers a mod reads through a container module's item are
    pinned (compiled again when they change); an unread counter on a Sequential subclass is
    not (it would compile again at every step)."""
    from flexfa import compiled

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = 0.5

    class Steps(torch.nn.Sequential):
        def __init__(self):
            super().__init__(Scale())
            self.step = 7

    steps = Steps()

    def scaled(score, b, h, q_idx, kv_idx):
        return score * steps[0].c

    values = [value for _, value in compiled.number_paths(
        scaled, compiled.functions_run(scaled)[1])]
    assert 0.5 in values and 7 not in values
