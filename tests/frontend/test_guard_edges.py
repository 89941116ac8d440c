"""Edges of the trace memo's guards (flexfa/frontend/guards.py), from the fiftieth
session's audit: state a mod reads that the fingerprint missed (slots beside a __dict__,
private and string __slots__, ABC registrations, a mod constructing its own class, container
subclasses overriding their iteration, format fields and class patterns, torch.backends
flags, numpy's global generator, a defaultdict's factory, a pinned tensor's new attribute,
``t.data = other`` under a value read while tracing, set order, scalars' bits) and a kept
guard holding user classes; the rest kill mutants of guards.py that the other guard tests
let through. Each case traces, changes the state, traces again and compares with a fresh
trace."""
import abc
import builtins
import collections
import enum
import functools
import gc
import math
import weakref

import numpy as np
import pytest
import torch

from flexfa.frontend.guards import guard
from flexfa.frontend.trace import TRACE_MEMO, trace, trace_entry
from trace_checks import assert_follows, values_of

def test_bool_and_int_of_equal_value_are_different_state():
    """True == 1, but a mod can tell them apart (type(), isinstance, repr)."""
    flags = [True]

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < (2 if type(flags[0]) is bool else 5)
    assert_follows(mask, lambda: flags.__setitem__(0, 1))


def test_which_earlier_object_a_repeated_reference_is():
    """[a, b, a] and [a, b, b]: the repeated reference must name the object it repeats."""
    a, b = {"w": 2}, {"w": 5}
    table = [a, b, a]

    def mask(b_, h, q_idx, kv_idx):
        return q_idx - kv_idx < table[2]["w"]
    assert_follows(mask, lambda: table.__setitem__(2, b))


def test_requires_grad_of_a_captured_tensor_is_state():
    bias = torch.zeros(8, dtype=torch.float64)

    def mod(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx]
    TRACE_MEMO.clear()
    first = trace(mod)
    bias.requires_grad_(True)
    assert trace(mod) is not first, "a trace made for a tensor without grad was reused"


@pytest.mark.parametrize("make", [np.float64, np.float32])
def test_sign_of_a_zero_numpy_scalar_is_state(make):
    """np.float64 is a float subclass and np.float32 a numbers.Real: both take number(), and
    -0.0 == 0.0, so only exact() (bits) tells them apart."""
    box = [make(0.0)]

    def mod(score, b, h, q_idx, kv_idx):
        return score * box[0]
    TRACE_MEMO.clear()
    trace(mod)
    box[0] = make(-0.0)
    got = values_of(trace(mod))
    assert torch.signbit(got).all(), "the +0.0 trace was reused for -0.0"


def test_a_partial_positional_argument_is_state():
    window = [2]

    def base(b, h, q_idx, kv_idx, w):
        return q_idx - kv_idx < w[0]

    bound = functools.partial(lambda w, b, h, q, k: base(b, h, q, k, w), window)
    assert_follows(bound, lambda: window.__setitem__(0, 5))


def test_a_staticmethod_replaced_on_the_class():
    class Config:
        @staticmethod
        def width():
            return 2

        def mask(self, b, h, q_idx, kv_idx):
            return q_idx - kv_idx < self.width()
    config = Config()
    assert_follows(config.mask, lambda: setattr(Config, "width", staticmethod(lambda: 5)))


def test_a_builtin_replaced_in_builtins(monkeypatch):
    class Config:  # a method: the full guard, not the pins
        def mask(self, b, h, q_idx, kv_idx):
            return q_idx - kv_idx < divmod(7, 3)[0]
    config = Config()
    assert_follows(config.mask,
                    lambda: monkeypatch.setattr(builtins, "divmod", lambda a, b: (5, 0)))


def test_lengths_of_nested_containers_are_state():
    """[(2,), 3] and [(2, 3)] walk the same items in the same order."""
    table = [(2,), 3]

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 3 * len(table[0])
    assert_follows(mask, lambda: table.__setitem__(slice(None), [(2, 3)]))


def test_a_tuple_and_a_list_of_the_same_items_differ():
    holder = [(2,)]

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < (5 if type(holder[0]) is list else 2)
    assert_follows(mask, lambda: holder.__setitem__(0, [2]))


def test_dict_keys_are_state():
    config = {"window": 2}

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < config.get("window", 5)
    assert_follows(mask, lambda: (config.pop("window"), config.__setitem__("other", 2)))


def test_a_relative_import_inside_the_mod_is_followed(tmp_path, monkeypatch):
    """``from . import cfg`` inside a mod: the walk cannot tell which package it is, so the
    mod must be traced again each call (refused), never walked without the module."""
    package = tmp_path / "relpkg_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cfg.py").write_text("WINDOW = 2\n")
    (package / "mods.py").write_text(
        "def mask(b, h, q_idx, kv_idx):\n"
        "    from . import cfg\n"
        "    return q_idx - kv_idx < cfg.WINDOW\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    mods = importlib.import_module("relpkg_probe.mods")
    cfg = importlib.import_module("relpkg_probe.cfg")
    assert_follows(mods.mask, lambda: setattr(cfg, "WINDOW", 5))


class _Width:
    def __init__(self):
        self.w = 2

    def width(self):
        return self.w


def test_a_method_named_by_a_string_constant():
    """operator.methodcaller("width") calls a method whose name is only a string constant."""
    import operator
    config = _Width()

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < operator.methodcaller("width")(config)
    assert_follows(mask, lambda: setattr(config, "w", 5))


def test_a_c_method_bound_to_a_container():
    """A builtin method bound to a list reads the list: the mod is traced again each call."""
    windows = [2]
    get = windows.__getitem__

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < get(0)
    assert_follows(mask, lambda: windows.__setitem__(0, 5))


def test_an_empty_closure_cell_beside_a_filled_one():
    def outer():
        window = 2

        def mask(b, h, q_idx, kv_idx):
            if window > 100:
                return later  # noqa: F821  (a cell still empty)
            return q_idx - kv_idx < window

        def set_window(value):
            nonlocal window
            window = value
        return mask, set_window
        later = 0  # noqa  (makes ``later`` a cell that is never filled)
    mask, set_window = outer()
    assert_follows(mask, lambda: set_window(5))


@pytest.mark.parametrize("hook", ["__getattr__", "__getattribute__"])
def test_objects_computing_attributes_by_name_are_unguarded(hook):
    """The module docstring: custom __getattr__/__getattribute__ make the mod unguarded."""
    def lookup(self, name):  # (no dynamic name in its code: the hook alone refuses it)
        return 2
    config = type("Config", (), {hook: lookup})()

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < config.w
    assert guard(mask) is None



class _Base:
    pass


class _Mixed(_Base):
    __slots__ = ("window",)


class _WithDict:
    __slots__ = ("window", "__dict__")


class _StrSlot:
    __slots__ = "window"


@pytest.mark.parametrize("cls", [_Mixed, _WithDict, _StrSlot])
def test_slots_beside_a_dict_and_slots_named_by_a_string(cls):
    obj = cls()
    obj.window = 2

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < obj.window
    assert_follows(mask, lambda: setattr(obj, "window", 5))


class _Private:
    __slots__ = ("__window", "__weakref__")

    def __init__(self):
        self.__window = 2

    def set(self, value):
        self.__window = value

    def mask(self, b, h, q_idx, kv_idx):
        return q_idx - kv_idx < self.__window


def test_a_private_slot():
    obj = _Private()
    assert_follows(obj.mask, lambda: obj.set(5))


def test_an_abc_registered_after_the_trace():
    class Windowed(abc.ABC):
        pass

    class Config:
        pass
    config = Config()

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < (5 if isinstance(config, Windowed) else 2)
    assert_follows(mask, lambda: Windowed.register(Config))


_WINDOW = [2]


class _Rebuilt:
    def __init__(self):
        self.w = _WINDOW[0]

    def mask(self, b, h, q_idx, kv_idx):
        return q_idx - kv_idx < type(self)().w


def test_a_mod_constructing_its_own_class():
    _WINDOW[0] = 2
    assert_follows(_Rebuilt().mask, lambda: _WINDOW.__setitem__(0, 5))


def test_containers_whose_iteration_a_subclass_overrides():
    class PublicItems(dict):
        def items(self):
            return [(k, v) for k, v in super().items() if not k.startswith("_")]

    class Lazy(list):
        def __iter__(self):
            return iter(())
    cfg, windows = PublicItems(_window=2), Lazy([2])

    def from_dict(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < cfg["_window"]

    def from_list(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < windows[0]
    assert_follows(from_dict, lambda: cfg.__setitem__("_window", 5))
    assert_follows(from_list, lambda: windows.__setitem__(0, 5))


class _Holder:
    __match_args__ = ("window",)


def test_attributes_read_by_format_fields_and_class_patterns():
    a, c, d = _Holder(), _Holder(), _Holder()
    a.window = c.window = d.window = 2

    def formatted(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < int("{0.window}".format(a))

    def keyword(b, h, q_idx, kv_idx):
        match c:
            case _Holder(window=w):
                return q_idx - kv_idx < w

    def positional(b, h, q_idx, kv_idx):
        match d:
            case _Holder(w):
                return q_idx - kv_idx < w
    assert_follows(formatted, lambda: setattr(a, "window", 5))
    assert_follows(keyword, lambda: setattr(c, "window", 5))
    assert_follows(positional, lambda: setattr(d, "window", 5))


def test_library_flags_read_through_torch_backends():
    old = torch.backends.cudnn.deterministic

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < (5 if torch.backends.cudnn.deterministic else 2)
    try:
        assert_follows(mask, lambda: setattr(torch.backends.cudnn, "deterministic", not old))
    finally:
        torch.backends.cudnn.deterministic = old


def test_a_defaultdict_factory():
    table = collections.defaultdict(lambda: 2)

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < table.default_factory()
    assert_follows(mask, lambda: setattr(table, "default_factory", lambda: 5))


_TABLE = torch.zeros(8)


def test_an_attribute_set_later_on_a_pinned_tensor():
    def mask(b, h, q_idx, kv_idx):
        try:
            width = _TABLE.width
        except AttributeError:
            width = 2
        return q_idx - kv_idx < width

    def change():
        trace(mask)
        assert trace_entry(mask).pins is not None
        _TABLE.width = 5
    try:
        assert_follows(mask, change)
    finally:
        del _TABLE.width


def test_a_tensor_value_read_while_tracing_after_data_is_replaced():
    t = torch.tensor(2.0)

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < int(t.item())
    assert_follows(mask, lambda: setattr(t, "data", torch.tensor(5.0)))


def test_set_order_is_state_and_items_need_no_repr():
    holder = [{1, 9}]
    assert list({1, 9}) != list({9, 1})

    def first(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < next(iter(holder[0]))
    assert_follows(first, lambda: holder.__setitem__(0, {9, 1}))

    class NoRepr:
        def __repr__(self):
            raise RuntimeError("no repr")
    tags = frozenset({NoRepr()})

    def mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 2 + 0 * len(tags)
    trace(mask)


def test_scalars_by_bits():
    box = [complex(0.0, 0.0)]

    def mod(score, b, h, q_idx, kv_idx):
        return score * math.copysign(1.0, box[0].real)
    assert_follows(mod, lambda: box.__setitem__(0, complex(-0.0, 0.0)))


def test_kept_guards_hold_no_user_class():
    holder = [None]

    def mod(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < holder[0].width()

    def make(kind):
        big = torch.zeros(16)

        def width(self):
            return 2 + 0 * big.shape[0]
        if kind == "enum":
            cls = enum.Enum("E", {"A": 1})
            cls.width = width
            return cls.A, weakref.ref(big)
        return type("F", (float,), {"width": width})(1.0), weakref.ref(big)
    for kind in ("enum", "float subclass"):
        TRACE_MEMO.clear()
        holder[0], ref = make(kind)
        trace(mod)
        holder[0] = None
        gc.collect(), gc.collect()
        assert ref() is None, kind


def test_numpy_global_random_draws_are_drawn_again_each_call():
    def mod(score, b, h, q_idx, kv_idx):
        return score * float(np.random.rand())
    TRACE_MEMO.clear()
    assert guard(mod) is None
    assert not torch.equal(values_of(trace(mod)), values_of(trace(mod)))


class _Built:
    def __init__(self):
        self.w = 2 if hasattr(self, "unused") else 2  # (a dynamic lookup: unguardable code)

    def cast(self, score, b, h, q_idx, kv_idx):
        return score.type(torch.float32) * self.w

    def rebuilt(self, score, b, h, q_idx, kv_idx):
        return score * type(self)().w


def test_only_a_call_of_type_walks_the_constructor():
    """``type(self)()`` runs ``__init__`` (walked: here a dynamic lookup, so the mod is traced
    each call); a ``.type(...)`` method call does not (the mod stays guarded)."""
    obj = _Built()
    assert guard(obj.cast) is not None
    assert guard(obj.rebuilt) is None
