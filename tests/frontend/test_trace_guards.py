"""The trace memo never returns a stale trace: every Python value a mod can read is guarded.

Each test traces a mod, changes one piece of state the mod reads, and traces again: the
second trace must equal a fresh trace of the mod under the new state (before the guards, each
of these returned the first trace).
"""
import abc
import collections
import dataclasses
import enum
import functools
import gc
import sys
import threading
import types
import weakref

import pytest
import torch
from hypothesis import given, strategies as st

from flexfa.frontend.guards import guard
from flexfa.frontend.trace import TRACE_MEMO, trace, trace_entry
from threads import run_in_threads
from trace_checks import GRID, assert_follows, values_of

class Window:
    window = 2

    def __init__(self):
        self.offset = 0

    def mask(self, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < self.window) & (q_idx >= kv_idx + self.offset)

    def helper(self):
        return self.offset

    def via_helper(self, b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 2 + self.helper()

    @property
    def doubled(self):
        return 2 * self.offset

    def via_property(self, b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 2 + self.doubled


def test_instance_attribute_of_a_stored_bound_method():
    m = Window()
    mask = m.mask  # one bound-method object, called again
    assert_follows(mask, lambda: setattr(m, "window", 5))


def test_instance_attribute_of_fresh_bound_methods():
    m = Window()
    first = values_of(trace(m.mask))
    m.offset = 1
    assert not torch.equal(first, values_of(trace(m.mask)))


def test_class_attribute():
    m = Window()
    mask = m.mask
    old = Window.window
    try:
        assert_follows(mask, lambda: setattr(Window, "window", 6))
    finally:
        Window.window = old


def test_state_read_through_a_helper_method_and_a_property():
    m = Window()
    assert_follows(m.via_helper, lambda: setattr(m, "offset", 3))
    m = Window()
    assert_follows(m.via_property, lambda: setattr(m, "offset", 2))


def test_module_attribute():
    config = types.ModuleType("config")
    config.WINDOW = 2

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < config.WINDOW
    assert_follows(mask, lambda: setattr(config, "WINDOW", 6))


LIMIT = 2


def test_global_read_by_a_nested_function():
    def mask(b, h, q_idx, kv_idx):
        limit = (lambda: LIMIT)()
        return q_idx - kv_idx < limit

    def change():
        global LIMIT
        LIMIT = 5
    try:
        assert_follows(mask, change)
    finally:
        globals()["LIMIT"] = 2


def test_functools_wraps_wrapper_and_list_contents():
    factor = [2.0]

    def base(score, b, h, q_idx, kv_idx):
        return score + q_idx

    @functools.wraps(base)
    def wrapped(score, b, h, q_idx, kv_idx):
        return base(score, b, h, q_idx, kv_idx) * factor[0]
    assert_follows(wrapped, lambda: factor.__setitem__(0, 5.0))


def test_keyword_only_and_positional_defaults():
    def kw(score, b, h, q_idx, kv_idx, *, scale=2.0):
        return score * scale + q_idx
    assert_follows(kw, lambda: kw.__kwdefaults__.__setitem__("scale", 3.0))

    def positional(score, b, h, q_idx, kv_idx, scale=2.0):
        return score * scale + q_idx
    assert_follows(positional, lambda: setattr(positional, "__defaults__", (7.0,)))


def test_dict_config_and_dataclass_and_partial():
    config = {"window": 2}

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < config["window"]
    assert_follows(mask, lambda: config.__setitem__("window", 4))

    @dataclasses.dataclass
    class Cfg:
        window: int = 2
    cfg = Cfg()

    def by_dataclass(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < cfg.window
    assert_follows(by_dataclass, lambda: setattr(cfg, "window", 5))

    def windowed(b, h, q_idx, kv_idx, window):
        return q_idx - kv_idx < window[0]
    window = [2]
    assert_follows(functools.partial(windowed, window=window),
                    lambda: window.__setitem__(0, 6))


def test_nn_module_attribute_and_callable_object():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.limit = 2

        def forward(self, b, h, q_idx, kv_idx):
            return q_idx - kv_idx < self.limit

    gate = Gate()
    assert_follows(gate, lambda: setattr(gate, "limit", 5))


def test_function_attribute():
    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < mask.limit
    mask.limit = 2
    assert_follows(mask, lambda: setattr(mask, "limit", 6))


def test_captured_tensor_values_read_while_tracing():
    """Python read the tensor's values (an ``if`` on it): an in-place change must retrace."""
    flag = torch.tensor([1.0])

    def mod(score, b, h, q_idx, kv_idx):
        return score * 2 if flag.sum() > 0 else score - 1
    assert_follows(mod, lambda: flag.mul_(-1))


def test_captured_tensor_values_read_by_printing_it():
    """Formatting a tensor reads its values: float(f"{t}") was taken for a metadata query,
    so an in-place change gave the old trace."""
    scale = torch.tensor(2.0)
    assert_follows(lambda score, b, h, q_idx, kv_idx: score * float(f"{scale}"),
                    lambda: scale.fill_(5.0))
    assert_follows(lambda score, b, h, q_idx, kv_idx: score * len(repr(scale)),
                    lambda: scale.fill_(-15.0))


def test_captured_tensor_read_in_kernel_needs_no_retrace():
    """A tensor the kernel reads (``bias[q_idx]``) keeps the trace: its new values are read
    at launch. A replaced tensor object retraces."""
    bias = torch.arange(8.0)
    holder = {"bias": bias}

    def mod(score, b, h, q_idx, kv_idx):
        return score + holder["bias"][q_idx]
    entry = trace_entry(mod)
    bias.add_(1)
    assert trace_entry(mod) is entry
    holder["bias"] = torch.arange(8.0)
    assert trace_entry(mod) is not entry


def test_dynamic_attribute_lookup_is_never_memoized():
    m = Window()

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < getattr(m, "win" + "dow")
    assert guard(mask) is None
    assert_follows(mask, lambda: setattr(m, "window", 6))


@given(st.lists(st.integers(-4, 8), min_size=2, max_size=6))
def test_any_sequence_of_window_values(windows):
    m = Window()
    mask = m.mask
    for window in windows:
        m.window = window
        b, h, q, k = GRID
        expected = (q - k < window) & (q >= k)
        assert torch.equal(values_of(trace(mask)), expected)


def test_dropping_a_mod_drops_its_trace_and_captured_tensors():
    bias = torch.randn(8)
    ref = weakref.ref(bias)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx]
    trace(mod)
    count = len(TRACE_MEMO)
    del mod, bias
    gc.collect()
    assert ref() is None
    assert len(TRACE_MEMO) < count


def test_dropping_a_mod_of_a_class_made_per_call_drops_its_captured_tensors():
    """The guard's cache of handlers per type held the class of every object it walked, and
    so the class's methods, their closures and the tensors they capture (a mod made by a
    factory that defines its class inside lived on after the mod was dropped)."""
    def make():
        bias = torch.randn(8)

        class Biased:
            def mod(self, score, b, h, q_idx, kv_idx):
                return score + bias[q_idx]
        return Biased().mod, weakref.ref(bias)
    mod, ref = make()
    trace(mod)
    del mod
    gc.collect(), gc.collect()  # the second frees the class, a cycle the first released
    assert ref() is None


def test_a_kept_guard_holds_no_object_and_dies_with_one():
    """A kept guard names classes, modules and library functions by id and holds them weakly:
    once one dies (and a new object may take its id) the guard equals no guard."""
    holder = [type("Config", (), {"factor": 2.0})]
    config = weakref.ref(holder[0])

    def mod(score, b, h, q_idx, kv_idx):
        return score * holder[0].factor
    kept = guard(mod).keep()
    assert guard(mod) == kept
    holder[0] = type("Config", (), {"factor": 2.0})  # equal contents, another class
    gc.collect()
    assert config() is None, "the kept guard must not hold the class"
    assert guard(mod) != kept and kept != kept


def test_fresh_lambdas_do_not_grow_the_memo():
    TRACE_MEMO.clear()
    for i in range(200):
        trace(lambda score, b, h, q_idx, kv_idx: score + i)
    gc.collect()
    assert len(TRACE_MEMO) <= 1


def test_memo_is_bounded_when_mods_stay_alive():
    mods = [lambda score, b, h, q_idx, kv_idx, i=i: score + i for i in range(1100)]
    for mod in mods:
        trace(mod)
    assert TRACE_MEMO.owner_count() <= 1024


@pytest.mark.parametrize("value", [float("nan"), -0.0, 0.0])
def test_special_float_state(value):
    cell = [value]

    def mod(score, b, h, q_idx, kv_idx):
        return score + cell[0]
    first = trace(mod)
    cell[0] = 1.5
    assert trace(mod) is not first


class _Scaler:
    def __init__(self, w):
        self.w = w

    def __call__(self, score):
        return score * self.w


class _Config:
    def __init__(self):
        self._values = {"w": 2.0}

    def __getitem__(self, key):
        return self._values[key]


class _Offset:
    def __init__(self, offset):
        self.offset = offset

    def __add__(self, other):
        return other + self.offset


class _Slope(torch.nn.Module):
    def __init__(self, slope):
        super().__init__()
        self.slope = slope

    def forward(self, score, q_idx, kv_idx):
        return score + self.slope * (kv_idx - q_idx)


class _Made:
    def __init__(self, score):
        self.value = score * _MADE_SCALE[0]


_MADE_SCALE = [2.0]


def test_state_read_by_special_methods_python_calls_implicitly():
    """obj(s), obj[key], obj + s and an nn.Module called inside a mod run __call__,
    __getitem__, __add__ and forward without naming them in the mod's code: the state they
    read is guarded like named attributes (it was not: the old trace came back, a wrong
    output)."""
    scaler, config, offset, slope = _Scaler(2.0), _Config(), _Offset(1.0), _Slope(0.5)
    assert_follows(lambda score, b, h, q_idx, kv_idx: scaler(score),
                    lambda: setattr(scaler, "w", -3.0))
    assert_follows(lambda score, b, h, q_idx, kv_idx: score * config["w"],
                    lambda: config._values.__setitem__("w", -1.0))
    assert_follows(lambda score, b, h, q_idx, kv_idx: offset + score,
                    lambda: setattr(offset, "offset", 4.0))
    assert_follows(lambda score, b, h, q_idx, kv_idx: slope(score, q_idx, kv_idx),
                    lambda: setattr(slope, "slope", -0.25))
    # a class the mod constructs: its __init__'s state too
    assert_follows(lambda score, b, h, q_idx, kv_idx: _Made(score).value,
                    lambda: _MADE_SCALE.__setitem__(0, 5.0))


def test_a_float_sign_is_state():
    """0.0 == -0.0 in Python, but copysign and 1 / x tell them apart: the guard compares
    floats by their bits."""
    import math
    cell = [0.0]

    def mod(score, b, h, q_idx, kv_idx):
        return score * math.copysign(2.0, cell[0])
    assert_follows(mod, lambda: cell.__setitem__(0, -0.0))
    cell[0] = 0.0
    guarded = guard(mod)
    cell[0] = -0.0
    assert guard(mod) != guarded


def test_a_module_closed_over_as_self_stays_guarded():
    """A mod closing over an nn.Module whose __init__ looks names up dynamically
    (getattr(config, ...)) is still memoized: construction's methods are guarded only for a
    class the code may call, not for the type of an instance it reads."""
    class Attention(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.window = getattr(config, "window", 4)

        def mask(self):
            def mod(b, h, q_idx, kv_idx):
                return q_idx - kv_idx < self.window
            return mod

    module = Attention(types.SimpleNamespace(window=3))
    mod = module.mask()
    assert guard(mod) is not None
    assert trace(mod) is trace(mod)
    assert_follows(mod, lambda: setattr(module, "window", 6))


_SUBCLASS_SCALE = [2.0]


class _Tagged(float):
    """A float that carries an attribute."""


class _Window(list):
    """A list that carries an attribute."""


class _ScaledDict(dict):
    def __getitem__(self, key):
        return dict.__getitem__(self, key) * _SUBCLASS_SCALE[0]


class _Mode(enum.Enum):
    SCALED = 1
    TABLE = [2.0]  # a mutable value

    def apply(self, score):
        return score * _SUBCLASS_SCALE[0]


class _Pair(collections.namedtuple("_Pair", "low high")):
    @property
    def width(self):
        return self.high - self.low + _SUBCLASS_SCALE[0]


class _WindowModule(types.ModuleType):
    """A module whose class was replaced to give it a property."""

    @property
    def window(self):
        return self.base + int(_SUBCLASS_SCALE[0])


def test_state_of_subclasses_of_numbers_containers_enums_and_modules():
    """A user's subclass of a type the guard walks by value (float, list, dict, tuple, an
    enum, a module) also has a class and attributes: an attribute set on the value, a
    __getitem__ or method reading a global, an enum member's mutable value. Each came back
    stale: only the base type's value was fingerprinted."""
    _SUBCLASS_SCALE[0] = 2.0
    tagged = _Tagged(2.0)
    tagged.offset = 1.0
    assert_follows(lambda score, b, h, q_idx, kv_idx: score * tagged + tagged.offset,
                    lambda: setattr(tagged, "offset", 7.0))
    window = _Window([0])
    window.size = 2
    assert_follows(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < window.size,
                    lambda: setattr(window, "size", 5))
    scaled = _ScaledDict(w=1.0)
    assert_follows(lambda score, b, h, q_idx, kv_idx: score * scaled["w"],
                    lambda: _SUBCLASS_SCALE.__setitem__(0, 3.0))
    mode = _Mode.SCALED
    assert_follows(lambda score, b, h, q_idx, kv_idx: mode.apply(score),
                    lambda: _SUBCLASS_SCALE.__setitem__(0, 5.0))
    table = _Mode.TABLE
    assert_follows(lambda score, b, h, q_idx, kv_idx: score * table.value[0],
                    lambda: table.value.__setitem__(0, -1.0))
    pair = _Pair(0, 1)
    assert_follows(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < pair.width,
                    lambda: _SUBCLASS_SCALE.__setitem__(0, 4.0))
    module = types.ModuleType("flexfa_test_window_module")
    module.base = 1
    module.__class__ = _WindowModule
    assert_follows(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < module.window,
                    lambda: _SUBCLASS_SCALE.__setitem__(0, 2.0))


def test_common_subclasses_stay_guarded():
    """Namedtuple fields, an attribute dict (__getattr__ = dict.__getitem__) and enum values
    are read without a retrace per call."""
    Config = collections.namedtuple("Config", "window")
    config, attrs, mode = Config(2), _AttrDict(window=2), _Mode.SCALED
    mods = [lambda b, h, q_idx, kv_idx: q_idx - kv_idx < config.window,
            lambda b, h, q_idx, kv_idx: q_idx - kv_idx < attrs.window,
            lambda b, h, q_idx, kv_idx: q_idx - kv_idx < mode.value]
    for mod in mods:
        assert guard(mod) is not None
        assert trace(mod) is trace(mod)
    assert_follows(mods[1], lambda: attrs.__setitem__("window", 5))


class _AttrDict(dict):
    __getattr__ = dict.__getitem__


_CLASS_CONFIG = {"window": 2}


class _PropertyMeta(type):
    @property
    def window(cls):
        return _CLASS_CONFIG["window"]


class _LookupMeta(type):
    def __getattr__(cls, name):
        return _CLASS_CONFIG[name]


def test_class_attributes_a_metaclass_provides():
    """Cls.window found on the metaclass (a property, or its __getattr__) reads what the
    metaclass reads; the class's own entries were walked, not its metaclass's (stale)."""
    by_property = _PropertyMeta("ByProperty", (), {})
    by_lookup = _LookupMeta("ByLookup", (), {})
    assert_follows(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < by_property.window,
                    lambda: _CLASS_CONFIG.__setitem__("window", 5))
    assert_follows(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < by_lookup.window,
                    lambda: _CLASS_CONFIG.__setitem__("window", 1))


def test_module_getattr_and_modules_imported_inside_the_mod(monkeypatch):
    """A module attribute its __getattr__ makes (PEP 562), and a module the mod imports
    itself (no global names it): both came back stale."""
    lazy = types.ModuleType("flexfa_test_lazy_config")
    exec("_VALUES = {'window': 2}\ndef __getattr__(name):\n    return _VALUES[name]\n",
         vars(lazy))
    assert_follows(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < lazy.window,
                    lambda: lazy._VALUES.__setitem__("window", 5))
    config = types.ModuleType("flexfa_test_imported_config")
    config.WINDOW = 2
    monkeypatch.setitem(sys.modules, config.__name__, config)

    def imports(b, h, q_idx, kv_idx):
        import flexfa_test_imported_config
        return q_idx - kv_idx < flexfa_test_imported_config.WINDOW

    def imports_from(b, h, q_idx, kv_idx):
        from flexfa_test_imported_config import WINDOW
        return q_idx - kv_idx < WINDOW
    assert_follows(imports, lambda: setattr(config, "WINDOW", 5))
    assert_follows(imports_from, lambda: setattr(config, "WINDOW", 1))


class _Slotted:
    __slots__ = ("window",)

    def __init__(self, window):
        self.window = window


def test_dataclass_and_slots_configs_are_guarded_not_retraced():
    """A dataclass config (plain, slots=True, frozen) and a __slots__ object were unguarded,
    so every call traced the mod again (milliseconds): the dataclass' generated __eq__ names
    NotImplemented, and the walk met the classes' __dict__ / slot accessors (C descriptors).
    Guarded now, and a change of their state still gives the new trace."""
    @dataclasses.dataclass
    class Plain:
        window: int = 2

    @dataclasses.dataclass(slots=True)
    class Slots:
        window: int = 2

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        window: int = 2
    holders = {"plain": Plain(), "slots": Slots(), "frozen": Frozen(), "__slots__": _Slotted(2)}
    for name, holder in holders.items():
        def mask(b, h, q_idx, kv_idx, holder=holder):
            return q_idx - kv_idx < holder.window
        assert guard(mask) is not None, name
        assert trace(mask) is trace(mask), name
        assert_follows(mask, lambda holder=holder: object.__setattr__(holder, "window", 5))


def test_threads_walking_more_code_than_the_memo_keeps_do_not_fail():
    """The memo of code objects' names is emptied when full; a thread reading back its own
    entry after another emptied it raised KeyError out of the guard (every traced call)."""
    from flexfa.frontend.guards import code_names

    codes = [compile(f"lambda: a{i} + b", "<mods>", "eval").co_consts[0] for i in range(4500)]
    errors = []

    def walk(start: int) -> None:
        try:
            for _ in range(12):  # past the bound about a dozen times
                for code in codes[start:] + codes[:start]:
                    code_names(code)
        except Exception as exc:  # reported below
            errors.append(exc)

    run_in_threads(walk, [(500 * i,) for i in range(8)])
    assert not errors, errors[:3]
    assert code_names(codes[7]) >= {"a7", "b"}


_SETTINGS = {"scale": 2.0}


def test_a_dict_another_thread_edits_does_not_fail_the_guard():
    """The guard walks a dict the mod reads (here a module global) while another thread adds
    and removes keys of it: the walk reads a copy, never the dict's own iteration, which
    raised RuntimeError out of the call ("dictionary keys changed during iteration")."""
    def mod(score, b, h, q_idx, kv_idx):
        return score * _SETTINGS["scale"]

    stop, errors = threading.Event(), []

    def edit() -> None:
        i = 0
        while not stop.is_set():
            _SETTINGS[f"k{i % 50}"] = i
            _SETTINGS.pop(f"k{(i + 25) % 50}", None)
            i += 1

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    editor = threading.Thread(target=edit)
    editor.start()
    try:
        for _ in range(20000):
            try:
                guard(mod)
            except RuntimeError as exc:  # reported below
                errors.append(exc)
    finally:
        stop.set()
        editor.join()
        sys.setswitchinterval(previous)
        for name in [n for n in _SETTINGS if n != "scale"]:
            del _SETTINGS[name]
    assert not errors, f"{len(errors)} walks failed: {errors[0]!r}"
    assert guard(mod) is not None


# ---- the pinned fast path (guards.pins): plain functions reaching only identities ----------

PIN_WINDOW = 2
PIN_TABLE = torch.tensor([0.0, 1.0, 2.0, 3.0])


def _pinned_mods():
    """Plain functions whose trace the memo checks by pins, each with a change of state."""
    window = 3

    def closure(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window

    def change_closure():
        nonlocal window
        window = 5

    def global_scalar(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < PIN_WINDOW

    def change_global():
        globals()["PIN_WINDOW"] = 4

    def global_tensor(score, b, h, q_idx, kv_idx):
        return score + PIN_TABLE[q_idx % 4]

    def rebind_tensor():
        globals()["PIN_TABLE"] = torch.tensor([5.0, 1.0, 2.0, 3.0])

    def resize_tensor():  # the same object, another shape: shapes may be constants in a trace
        PIN_TABLE.resize_(2).copy_(torch.tensor([7.0, 8.0]))

    def code_swap(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 2

    def other(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 6

    def swap_code():
        code_swap.__code__ = other.__code__

    def shadowed(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) < 2

    def shadow_builtin():  # a global of the builtin's name now answers the lookup
        globals()["abs"] = lambda x: x + 3

    return [(closure, change_closure), (global_scalar, change_global),
            (global_tensor, rebind_tensor), (code_swap, swap_code), (shadowed, shadow_builtin),
            (lambda s, b, h, q, k: s * PIN_TABLE.shape[0], resize_tensor)]


@pytest.mark.parametrize("index", range(6))
def test_pinned_plain_functions_follow_their_state(index):
    """Each mod is traced twice first: the second lookup is served by its pins (checked);
    after the change the lookup gives the new behaviour, as a fresh trace."""
    saved = dict(PIN_WINDOW=PIN_WINDOW, PIN_TABLE=PIN_TABLE.clone())
    fn, change = _pinned_mods()[index]
    try:
        trace(fn)
        assert trace_entry(fn).pins is not None, "the mod should be served by its pins"
        assert_follows(fn, change)
    finally:
        globals().update(saved)
        globals().pop("abs", None)


def test_pins_are_not_taken_for_state_beyond_identities():
    """Methods, partials, defaults, user functions or objects in globals take the full guard."""
    from flexfa.frontend.guards import pins

    def with_default(b, h, q_idx, kv_idx, w=2):
        return q_idx - kv_idx < w

    def calls_user_function(b, h, q_idx, kv_idx):
        return with_default(b, h, q_idx, kv_idx)

    config = {"w": 2}

    def reads_dict(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < config["w"]

    assert pins(with_default) is None
    assert pins(calls_user_function) is None
    assert pins(reads_dict) is None
    assert pins(Window().mask) is None
    assert pins(functools.partial(with_default, w=3)) is None


PIN_SCALE = 1.0


@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.5, 2, -3, "table", "other table"]),
                min_size=2, max_size=6))
def test_any_sequence_of_a_pinned_global(values):
    """A plain function over a global (served by its pins between changes) follows any
    sequence of rebindings: floats of equal value and other sign, ints, tensors."""
    tables = {"table": torch.tensor(2.0, dtype=torch.float64),
              "other table": torch.tensor(-0.5, dtype=torch.float64)}  # 0-d: read as values

    def mod(score, b, h, q_idx, kv_idx):
        return score * PIN_SCALE

    try:
        for value in values:
            globals()["PIN_SCALE"] = tables.get(value, value) if isinstance(value, str) else value
            got = values_of(trace(mod))
            assert torch.equal(got, torch.ones(1, 1, 8, 8, dtype=torch.float64) * PIN_SCALE)
            if isinstance(value, float):  # the sign of a zero is state too
                assert torch.equal(torch.signbit(got), torch.signbit(torch.tensor(value)).expand(
                    got.shape))
    finally:
        globals()["PIN_SCALE"] = 1.0


def _grad_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < (2 if torch.is_grad_enabled() else 5)


def _dtype_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < (2 if torch.get_default_dtype() is torch.float32 else 5)


def _deterministic_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < (5 if torch.are_deterministic_algorithms_enabled() else 2)


def _helper_reads_grad_mode():
    return torch.is_grad_enabled()


class _GradWindow:
    def mask(self, b, h, q_idx, kv_idx):  # through a helper function (the full guard)
        return q_idx - kv_idx < (2 if _helper_reads_grad_mode() else 5)


def _assert_follows_grad_off(fn):
    try:
        assert_follows(fn, lambda: torch.set_grad_enabled(False))
    finally:
        torch.set_grad_enabled(True)


def _assert_follows_float64(fn):
    before = torch.get_default_dtype()
    try:
        assert_follows(fn, lambda: torch.set_default_dtype(torch.float64))
    finally:
        torch.set_default_dtype(before)


from torch import is_grad_enabled as _grad_on  # noqa: E402  (a reader under another name)


def _renamed_grad_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < (2 if _grad_on() else 5)


def _finfo_window(b, h, q_idx, kv_idx):  # torch.finfo() reads the default dtype
    return q_idx - kv_idx < (5 if torch.finfo().bits == 64 else 2)


def _compiling_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < (5 if torch.compiler.is_compiling() else 2)


def test_torch_global_state_read_under_another_name_or_implicitly():
    """A reader imported under another name, and torch.finfo() (the default dtype, unnamed),
    kept the trace of the first state (0.86 and 1.15 off in an audit's probes): the walk
    adds a reader's own name where it meets the function, and factories and finfo count as
    reading the default dtype and device. torch.compiler.is_compiling() is state too: eager
    and compiled calls shared one trace, whichever came first."""
    _assert_follows_grad_off(_renamed_grad_window)
    _assert_follows_float64(_finfo_window)
    assert ("is_compiling", False) in trace_entry(_compiling_window).state


def test_torch_global_state_a_mod_reads():
    """A mod reading torch's global state (grad mode, the default dtype, deterministic
    algorithms) got the trace of the state it was first traced under, as its guard and pins
    hold no such value: eager and compiled flexfa ran the old mod (1.64 apart in a probe).
    The trace memo compares those values now where the reached code names their reader."""
    def set_grad():
        torch.set_grad_enabled(False)
    try:
        assert_follows(_grad_window, set_grad)
        torch.set_grad_enabled(True)
        assert torch.equal(values_of(trace(_grad_window)), values_of(trace(_grad_window)))
        assert_follows(_GradWindow().mask, set_grad)
    finally:
        torch.set_grad_enabled(True)
    _assert_follows_float64(_dtype_window)
    try:
        assert_follows(_deterministic_window,
                        lambda: torch.use_deterministic_algorithms(True, warn_only=True))
    finally:
        torch.use_deterministic_algorithms(False)
    assert trace_entry(_grad_window).state == (("is_grad_enabled", True),)
    assert trace_entry(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx).state == ()


from torch import finfo as _fi  # noqa: E402  (a class that reads the default dtype, renamed)
from torch import asarray as _asarray  # noqa: E402


def _renamed_finfo_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < (5 if _fi().bits == 64 else 2)


def _asarray_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < (5 if _asarray(1.0).dtype == torch.float64 else 2)


def _debug_mode_window(b, h, q_idx, kv_idx):
    return q_idx - kv_idx < (5 if torch.get_deterministic_debug_mode() else 2)


def test_more_readers_of_torch_state():
    """torch.finfo imported under another name, torch.asarray (the default dtype) and
    torch.get_deterministic_debug_mode() kept the first state's trace (an audit's probes:
    2.1 off)."""
    _assert_follows_float64(_renamed_finfo_window)
    _assert_follows_float64(_asarray_window)
    try:
        assert_follows(_debug_mode_window, lambda: torch.set_deterministic_debug_mode(1))
    finally:
        torch.set_deterministic_debug_mode(0)


def test_a_library_closure_and_a_wrapper_named_like_a_library_function():
    """A function whose __module__ names a library was compared by identity alone, its
    closure not walked: torch's own and_masks (a torch closure over the user's masks) and a
    user's wrapper made with functools.wraps(<a torch function>) kept the first trace (1.9
    and 2.1 off in an audit's probes). Library code is told by the globals it runs with,
    and a library function's closure is walked."""
    from torch.nn.attention.flex_attention import and_masks as torch_and_masks
    window = [4]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window[0]

    combined = torch_and_masks(causal, near)
    assert combined.__module__.startswith("torch")
    assert_follows(combined, lambda: window.__setitem__(0, 2))
    scale = [1.0]

    @functools.wraps(torch.nn.attention.flex_attention._identity)
    def wrapped(score, b, h, q_idx, kv_idx):
        return score * scale[0]

    assert wrapped.__module__.startswith("torch")
    assert_follows(wrapped, lambda: scale.__setitem__(0, 3.0))


def test_objects_keeping_state_outside_their_attributes_are_not_fingerprinted():
    """Objects of C types outside the libraries (ctypes values, io.StringIO) were walked as
    plain objects, their state (held in C) unseen: the first trace was kept (an audit's
    probes). Their mods are traced again on every call, as the docs promise."""
    import ctypes
    import io
    value, text = ctypes.c_double(2.0), io.StringIO("2")

    def from_ctypes(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < int(value.value)

    def from_text(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < int(text.getvalue())

    assert_follows(from_ctypes, lambda: setattr(value, "value", 5.0))
    assert_follows(from_text, lambda: (text.seek(0), text.write("5")))
    assert guard(from_ctypes) is None and guard(from_text) is None


def test_python_attributes_of_captured_tensors():
    """Attributes set on a captured tensor or Parameter (``table.temperature``) were not in
    the fingerprint (identity, shape, dtype, device, requires_grad): the first trace was
    kept. The pins fast path takes no tensor with attributes."""
    table = torch.zeros(8)
    table.width = 2
    weight = torch.nn.Parameter(torch.zeros(8))
    weight.width = 2

    def from_tensor(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < table.width

    def from_parameter(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < weight.width

    assert_follows(from_tensor, lambda: setattr(table, "width", 5))
    assert_follows(from_parameter, lambda: setattr(weight, "width", 5))


class _Width(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.width = width


class _Widths(collections.UserList):
    pass


class _Settings(collections.UserDict):
    pass


def test_state_read_by_library_base_classes_methods():
    """A library base class's methods read attributes the mod's code does not name:
    nn.ModuleList / nn.Sequential's __getitem__ reads _modules['0'], UserList's and
    UserDict's read .data. Replacing an item kept the first trace (2.1 off in an audit's
    probes). Objects with such bases are walked whole."""
    layers, sequential = torch.nn.ModuleList([_Width(2)]), torch.nn.Sequential(_Width(2))
    widths, config = _Widths([2]), _Settings(width=2)
    mods = [lambda b, h, q_idx, kv_idx: q_idx - kv_idx < layers[0].width,
            lambda b, h, q_idx, kv_idx: q_idx - kv_idx < sequential[0].width,
            lambda b, h, q_idx, kv_idx: q_idx - kv_idx < widths[0],
            lambda b, h, q_idx, kv_idx: q_idx - kv_idx < config["width"]]
    changes = [lambda: layers.__setitem__(0, _Width(5)),
               lambda: sequential.__setitem__(0, _Width(5)),
               lambda: widths.__setitem__(0, 5), lambda: config.__setitem__("width", 5)]
    for mod, change in zip(mods, changes):
        assert_follows(mod, change)


def test_clocks_and_os_randomness_are_traced_again_each_call():
    """time.time_ns(), os.urandom() (C functions of modules that answer anew each call) were
    compared by identity as pure functions: a trace held one answer for good. A mod calling
    one is traced on every call, as one calling random.random() is."""
    import os
    import time

    def clocked(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < time.time_ns() % 7

    def random_bytes(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < os.urandom(1)[0] % 7

    for mod in (clocked, random_bytes):
        assert guard(mod) is None
        assert trace_entry(mod, "mask_mod") is not trace_entry(mod, "mask_mod")


class _Flag:
    pass


def test_a_special_method_added_to_a_class_later():
    """The special methods each class defines were kept per class from the first walk: one
    added later (``Flag.__bool__ = ...``) went unseen and the first trace was kept. They are
    taken anew when a base's entries change."""
    flag = _Flag()

    def flagged(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < (2 if flag else 5)

    try:
        assert_follows(flagged, lambda: setattr(_Flag, "__bool__", lambda self: False))
    finally:
        del _Flag.__bool__


class _AbstractConfig(abc.ABC):
    @abc.abstractmethod
    def width(self):
        ...


class _LockedConfig(_AbstractConfig):
    def __init__(self):
        self.lock, self.calls, self.w = threading.Lock(), 0, 2

    def width(self):
        return self.w


class _Steps(torch.nn.Sequential):
    def __init__(self):
        super().__init__(_Width(2))
        self.step = 0


def test_unread_state_of_library_based_objects_keeps_the_memo():
    """Objects with a library base class (abc.ABC, an nn.Sequential subclass) are walked
    under the names their code uses, as any object: an unread lock made the mod unguardable
    and an unread counter bumped between calls traced it again on every call (the first
    form of the library-base walk took every attribute). Pure C functions of os, sys, time
    and datetime stay guardable; clocks do not."""
    import datetime
    import os
    import time
    config, steps = _LockedConfig(), _Steps()

    def by_config(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < config.width()

    def by_steps(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < steps[0].width

    for mod, bump in ((by_config, lambda: setattr(config, "calls", config.calls + 1)),
                      (by_steps, lambda: setattr(steps, "step", steps.step + 1))):
        first = trace_entry(mod, "mask_mod")
        bump()
        assert guard(mod) is not None and trace_entry(mod, "mask_mod") is first
    pure = [lambda b, h, q_idx, kv_idx: q_idx < len(os.path.join("a", "bc")),
            lambda b, h, q_idx, kv_idx: q_idx < os.cpu_count() + sys.getrecursionlimit(),
            lambda b, h, q_idx, kv_idx: q_idx < datetime.timedelta(seconds=3).seconds]
    for mod in pure:
        assert guard(mod) is not None
    assert guard(lambda b, h, q_idx, kv_idx: q_idx < time.perf_counter()) is None
