"""Guards of the trace memo: the Python state a mod's trace may depend on, as a fingerprint.

A mod is ordinary Python. Besides its arguments its trace may depend on closure cells,
globals, defaults and keyword-only defaults, attributes of ``self`` and of anything else it
reaches (instances, classes, modules), the items of tuples, lists and dicts, and the code of
the functions and methods it calls, which reach more; the special methods of the classes it
reaches count as called (``obj(...)``, ``obj[i]``, operators and an ``nn.Module``'s
``forward`` run them without naming them; a class the code may call adds ``__init__`` and
``__new__``); a class's metaclass, a module's ``__getattr__``, the modules the code imports
itself (``import cfg`` inside a mod), and the class and attributes of a user's subclass of a
type walked by value (a float subclass, a dict subclass, an enum). ``guard(fn)`` walks all of
that and
returns a ``Guard`` whose ``fingerprint`` is equal on a later call only if none of it changed:
scalars and strings by value (floats by their bits: ``-0.0`` is not ``0.0``), tensors
(identity, shape, dtype, device, requires_grad), code,
classes, modules and library functions by identity, containers and objects by content.

Attributes are read only under the names that the code reached by the walk uses
(``co_names`` and string constants, nested code included), so a large ``nn.Module`` costs
only what the mod touches. Reaching new code (``self.helper()``) adds names, so the walk
repeats until the names are stable; ``Guard.names`` seeds the next call's walk.

What the walk cannot see through makes the mod unguarded (``guard`` returns None) and it is
traced again on every call, never reused stale: objects of C types it does not know,
dynamic lookups (``getattr``, ``vars``, ``eval``, ``globals``, ``import_module``... anywhere in
the reached code), relative imports, custom ``__getattr__``/``__getattribute__`` (of a class or
its metaclass), and more than ``MAX_STEPS`` values.
A kept guard (``Guard.keep``: the trace memo's) holds the objects it compares by identity by
weak reference where possible, so it never keeps a mod's objects alive; comparing two guards
is one tuple comparison (ids, values, types) and a flag that the kept one's objects live.
"""
from __future__ import annotations

import abc
import builtins
import collections
import dis
import enum
import functools
import numbers
import operator
import re
import struct
import sys
import types
import typing
import weakref

import torch

MAX_STEPS = 4096  # values visited per walk
MAX_ITEMS = 1024  # items of one container
# library code: its functions, classes and modules count by identity and are not walked
LIBRARIES = ("torch", "math", "cmath", "numpy", "triton", "builtins", "functools", "operator",
             "numbers", "typing", "collections", "enum", "abc", "itertools", "sympy")
# names whose use means attributes may be read by computed names: not guardable
DYNAMIC_NAMES = frozenset({"getattr", "hasattr", "vars", "eval", "exec", "globals", "locals",
                           "__dict__", "__getattribute__", "attrgetter", "compile",
                           "__import__", "import_module"})
_MISSING = object()
_ABSENT = ("absent",)


def _autocast_state() -> tuple:
    return tuple((torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                 for device in ("cpu", "cuda"))


def _cuda_device():
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


# torch's global state a mod may read by calling these (``if torch.is_grad_enabled(): ...``):
# no captured value holds it, so where the reached code names one, the trace memo compares
# its value (``torch_state``) besides the guard
STATE_READERS = {
    "is_grad_enabled": torch.is_grad_enabled,
    "is_inference_mode_enabled": torch.is_inference_mode_enabled,
    "are_deterministic_algorithms_enabled": torch.are_deterministic_algorithms_enabled,
    "is_deterministic_algorithms_warn_only_enabled":
        torch.is_deterministic_algorithms_warn_only_enabled,
    "get_default_dtype": torch.get_default_dtype,
    "get_default_device": getattr(torch, "get_default_device", lambda: None),
    "get_float32_matmul_precision": torch.get_float32_matmul_precision,
    "is_anomaly_enabled": torch.is_anomaly_enabled,
    "is_warn_always_enabled": torch.is_warn_always_enabled,
    "get_num_threads": torch.get_num_threads,
    "current_device": _cuda_device,
    **dict.fromkeys(("is_autocast_enabled", "get_autocast_dtype", "is_autocast_cpu_enabled",
                     "get_autocast_cpu_dtype", "get_autocast_gpu_dtype",
                     "is_autocast_cache_enabled"), _autocast_state),
    "initial_seed": torch.initial_seed,
    "get_deterministic_debug_mode": torch.get_deterministic_debug_mode,
    "is_anomaly_check_nan_enabled": torch.is_anomaly_check_nan_enabled,
    # a compiled call's mods are traced while Dynamo runs (``compiled.describe``): a mod
    # branching on these gets one trace eagerly and another compiled
    "is_compiling": torch.compiler.is_compiling,
    "is_dynamo_compiling": torch.compiler.is_dynamo_compiling,
    "is_exporting": torch.compiler.is_exporting,
    "is_tracing": torch.jit.is_tracing,
}
try:  # numpy's error state (np.geterr() / np.errstate): global, read by name
    import numpy as _numpy
    STATE_READERS["geterr"] = _numpy.geterr
except ImportError:
    pass
# names of torch functions that read the default dtype and device without naming them
# (``torch.finfo()``, a factory without dtype=): where the reached code names one, those two
# are compared as for their readers
_IMPLICIT_READERS = dict.fromkeys(
    ("finfo", "tensor", "as_tensor", "asarray", "scalar_tensor", "zeros", "ones", "full",
     "empty", "empty_strided", "arange", "range", "linspace", "logspace", "eye", "Tensor",
     "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window"),
    ("get_default_dtype", "get_default_device"))
# id(a reader function) -> its name: the walk adds the name where it meets the function
# under another one (``from torch import is_grad_enabled as grad_on``)
_READER_IDS = {id(getattr(torch, name)): name for name in STATE_READERS if hasattr(torch, name)}
_READER_IDS.update({id(STATE_READERS[name]): name for name in (
    "is_compiling", "is_dynamo_compiling", "is_exporting", "is_tracing")})
_READER_IDS[id(torch.cuda.current_device)] = "current_device"
_READER_IDS.update({id(getattr(torch, name)): name for name in _IMPLICIT_READERS
                    if hasattr(torch, name)})  # (``from torch import finfo as fi``)


def torch_state(names) -> tuple:
    """(name, value) of the torch global state ``STATE_READERS`` reads under ``names`` (the
    names a mod's reached code uses, with those of the readers the walk met under other
    names; usually none: an empty tuple)."""
    if names.isdisjoint(STATE_READERS) and names.isdisjoint(_IMPLICIT_READERS):
        return ()
    wanted = (names & STATE_READERS.keys()).union(
        *(_IMPLICIT_READERS[name] for name in names & _IMPLICIT_READERS.keys()))
    return tuple((name, STATE_READERS[name]()) for name in sorted(wanted))


def torch_state_holds(state: tuple) -> bool:
    """Whether each value ``torch_state`` read is still the same."""
    return all(STATE_READERS[name]() == value for name, value in state)


class Unguardable(Exception):
    """The walk met state it cannot fingerprint."""


class Guard:
    """The fingerprint of one walk and the attribute names it used.

    The fingerprint names an object compared by identity by its id (``("id", n)``), and the
    guard holds each such object (``identities``): strongly while it is a walk's result, by
    weak reference once it is kept (``keep``). A kept guard whose object died compares unequal
    to every guard, so an id reused by a new object never matches it: two guards are equal
    only if their fingerprints are and both still hold every object they name."""

    __slots__ = ("fingerprint", "names", "tensors", "_held", "_live", "__weakref__")

    def __init__(self, fingerprint: tuple, names: frozenset, tensors: tuple, identities: list):
        self.fingerprint = fingerprint
        self.names = names
        self.tensors = tensors  # every tensor reached (the trace's checks), until kept
        self._held = identities
        self._live = True

    def keep(self) -> "Guard":
        """This guard, from now on holding the objects it names by weak reference where they
        allow one (builtins and code objects of some kinds are held; they own no user data).
        ``tensors`` served the trace's checks and is emptied: a kept guard held every tensor
        its walk reached (one read as a number, ``float(self.t)``, or one of a branch not
        taken), so a tensor the mod's state let go of stayed alive until its next call."""
        self.tensors = ()
        me = weakref.ref(self)

        def dead(_) -> None:
            kept = me()
            if kept is not None:
                kept._live = False
        held = []
        for obj in self._held:
            try:
                held.append(weakref.ref(obj, dead))
            except TypeError:
                held.append(obj)
        self._held = held
        return self

    def __eq__(self, other):
        return (isinstance(other, Guard) and self._live and other._live
                and self.fingerprint == other.fingerprint)

    __hash__ = None


_BUILTIN_NAMES = vars(builtins)
# C functions that give another answer each call (clocks, the OS's randomness and state),
# by their module: a mod calling one is traced again on every call
_CLOCKS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
           "process_time", "process_time_ns", "thread_time", "thread_time_ns", "clock_gettime",
           "clock_gettime_ns", "localtime", "gmtime", "ctime", "asctime", "strftime")
_OS_STATE = ("urandom", "getrandom", "times", "getpid", "getppid", "getloadavg", "getcwd",
             "listdir", "scandir", "stat", "lstat", "getenv", "get_terminal_size")
_IMPURE_FUNCTIONS = {"time": frozenset(_CLOCKS), "os": frozenset(_OS_STATE),
                     "posix": frozenset(_OS_STATE), "nt": frozenset(_OS_STATE),
                     "datetime": frozenset({"now", "utcnow", "today"}),
                     "_datetime": frozenset({"now", "utcnow", "today"}),
                     "_thread": frozenset({"get_ident", "get_native_id"})}


def _impure(owner, name: str) -> bool:
    """Whether ``owner.name`` (a builtin's module or class) answers anew each call."""
    module = owner.__name__ if isinstance(owner, types.ModuleType) else owner.__module__
    return name in _IMPURE_FUNCTIONS.get(module, ())
_LIBRARY_MODULES = frozenset({"torch", "math", "numpy", "triton", "torch.nn.functional",
                              "torch.special", "operator", "functools"})


@functools.lru_cache(maxsize=4096)
def is_library_name(module: str) -> bool:
    return module.partition(".")[0] in LIBRARIES


def library_function(fn: types.FunctionType) -> bool:
    """Whether ``fn``'s code is a library's: by the module whose globals it runs with
    (``functools.wraps`` copies a library function's ``__module__`` onto a user's wrapper).
    A library's closure (torch's ``and_masks``) may still hold the user's functions."""
    return is_library_name(fn.__globals__.get("__name__") or "")


def _is_library_type(cls: type) -> bool:
    # by the module's name, not the class: a cache of classes would keep the user's alive
    return is_library_name(getattr(cls, "__module__", "") or "")


_CODE_NAMES: dict[int, tuple] = {}  # id -> (code, names, imports, global names)


def _code_facts(code: types.CodeType) -> tuple:
    """(names and string constants, modules imported: (name, level) pairs, the names looked
    up as globals or imported) of ``code`` and of the code nested in it."""
    known = _CODE_NAMES.get(id(code))
    if known is not None and known[0] is code:
        return known[1:]
    names = set(code.co_names)
    imports = {(ins.argval, level) for ins, level in _import_levels(code)}
    loaded = {ins.argval.partition(".")[0] for ins in dis.get_instructions(code)
              if ins.opcode in _GLOBAL_OPS and isinstance(ins.argval, str)}
    if _MATCH_CLASS in code.co_code[::2]:  # class patterns read ``__match_args__``'s names
        names.add("__match_args__")
    for const in code.co_consts:
        if isinstance(const, str) and const.isidentifier():
            names.add(const)
        elif isinstance(const, str) and "{" in const:  # str.format's fields: "{0.window}"
            names.update(_FORMAT_ATTRIBUTE.findall(const))
        elif isinstance(const, tuple):  # a class pattern's keywords: ("window",)
            names.update(c for c in const if isinstance(c, str) and c.isidentifier())
        elif isinstance(const, types.CodeType):
            nested_names, nested_imports, nested_loaded = _code_facts(const)
            names |= nested_names
            imports.update(nested_imports)
            loaded |= nested_loaded
    facts = frozenset(names), tuple(sorted(imports, key=repr)), frozenset(loaded)
    if len(_CODE_NAMES) > 4096:
        _CODE_NAMES.clear()
    _CODE_NAMES[id(code)] = (code, *facts)
    return facts  # (not read back: another thread may clear the memo meanwhile)


# the instructions that name a global (or a module's name an import binds)
_GLOBAL_OPS = frozenset(op for name, op in dis.opmap.items()
                        if "GLOBAL" in name or name in (
                            "LOAD_NAME", "STORE_NAME", "DELETE_NAME", "IMPORT_NAME",
                            "IMPORT_FROM", "LOAD_FROM_DICT_OR_GLOBALS"))
_IMPORT_NAME = dis.opmap["IMPORT_NAME"]
_MATCH_CLASS = dis.opmap["MATCH_CLASS"]
# an attribute a format field reads: ``{0.window}``, ``{cfg.a.b}``
_FORMAT_ATTRIBUTE = re.compile(r"\.([A-Za-z_][A-Za-z_0-9]*)")


def _import_levels(code: types.CodeType):
    """(IMPORT_NAME instruction, its relative level) pairs of ``code`` (not of nested code);
    the level is the constant the compiler loads two instructions before."""
    if _IMPORT_NAME not in code.co_code[::2]:
        return
    before: list = [None, None]
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            level = before[0].argval if before[0] is not None else None
            yield ins, level if type(level) is int else None
        before = [before[1], ins]


def code_names(code: types.CodeType) -> frozenset:
    """Names and string constants of ``code`` and of the code nested in it."""
    return _code_facts(code)[0]


def code_imports(code: types.CodeType) -> tuple:
    """The modules ``code`` (and the code nested in it) imports: (name, level) pairs."""
    return _code_facts(code)[1]


def global_names(code: types.CodeType) -> frozenset:
    """The globals ``code`` (and the code nested in it) may read: the names it looks up as
    globals or imports, or every name and string constant (``code_names``) where it looks
    names up by computed strings (``globals()[name]``, ``eval``: ``DYNAMIC_NAMES``)."""
    names, _, loaded = _code_facts(code)
    return loaded if names.isdisjoint(DYNAMIC_NAMES) else names


# compared by value
_VALUE_TYPES = frozenset({type(None), type(NotImplemented), type(Ellipsis), bool, int, float,
                          complex, str, bytes, torch.dtype, torch.device, torch.layout,
                          torch.memory_format})


_ORDERED: dict[frozenset, list] = {}  # names -> sorted (a repeated walk reuses its names)


def _ordered(names: frozenset) -> list:
    ordered = _ORDERED.get(names)
    if ordered is None:
        if len(_ORDERED) > 4096:
            _ORDERED.clear()
        ordered = _ORDERED[names] = sorted(names)
    return ordered


class _Walk:
    def __init__(self, names: frozenset):
        self.names = set(names)
        self.ordered = _ORDERED.get(names) or _ordered(names)
        self.parts: list = []
        self.seen: dict[int, int] = {}
        self.keep: list = []  # objects whose ids are in ``seen``: alive for the walk
        self.tensors: list = []
        self.identities: list = []  # objects the fingerprint names by id
        self.metaclasses: list = []  # user metaclasses walked (as a class's, not as values)
        self.grew = False

    def identity(self, obj) -> None:
        self.parts.append(("id", id(obj)))
        self.identities.append(obj)

    def kind(self, cls: type) -> None:
        """The type of a value walked by content: a user's class by identity (a kept guard
        holds it weakly), a C or library type held."""
        if cls.__flags__ & _HEAP_TYPE and not _is_library_type(cls):
            self.identity(cls)
        else:
            self.parts.append(cls)

    def accessor(self, value) -> None:
        """A slot's or __dict__'s C accessor: by id, with its class (held weakly; the
        accessor, which cannot be weakly referenced, holds that class)."""
        owner = getattr(value, "__objclass__", None)
        if owner is None:  # (a namedtuple's field accessor holds no class)
            self.identity(value)
            return
        self.parts.append(("accessor", id(value)))
        self.identity(owner)

    def add_code(self, code: types.CodeType) -> frozenset:
        """Record ``code`` and add its names to the walk's; returns them. The modules it
        imports (``import cfg`` inside a mod: no global names them) are walked too."""
        names, imports, loaded = _code_facts(code)
        if not names.isdisjoint(DYNAMIC_NAMES):
            raise Unguardable(f"code {code.co_name!r} looks attributes up dynamically")
        if "type" in loaded:  # ``type(self)()`` reaches a class to call as ``__class__`` does
            names = names | _CLASS_OF
        if not names <= self.names:
            self.names |= names
            self.grew = True
        self.parts.append(code)
        for name, level in imports:
            self.imported(name, level)
        return names

    def imported(self, name: str, level) -> None:
        """A module the code imports (and its top package, which ``import a.b`` binds), as
        ``sys.modules`` holds it now; a relative or not yet loaded one cannot be told."""
        if level != 0:
            raise Unguardable(f"a relative import of {name!r}")
        for module in dict.fromkeys((name.partition(".")[0], name)):
            found = sys.modules.get(module)
            if found is None:
                raise Unguardable(f"an import of {module!r}, not loaded yet")
            self.value(found)

    def value(self, value) -> None:
        cls = type(value)
        if cls in _VALUE_TYPES:
            self.parts.append(value if cls is not float and cls is not complex
                              else exact(value))
            self.parts.append(cls)
            return
        if len(self.parts) > MAX_STEPS:
            raise Unguardable("too much state")
        seen = self.seen.get(id(value))
        if seen is not None:
            self.parts.append(("seen", seen))
            return
        self.seen[id(value)] = len(self.seen)
        self.keep.append(value)
        if cls is torch.Tensor:  # the common captured value: no handler call
            self.tensor(value)
            return
        known = _HANDLERS.get(id(cls))
        handler = known[1] if known is not None and known[0]() is cls else _handler(cls)
        handler(self, value)

    def tensor(self, value: torch.Tensor) -> None:
        self.tensors.append(value)
        self.identities.append(value)
        self.parts += (("id", id(value)), value.shape, value.dtype, value.device,
                       value.requires_grad)
        # Python attributes set on it (``table.temperature``; Dynamo, when it steps into
        # this walk, fails inside on a tensor's ``__dict__``)
        if not torch.compiler.is_compiling() and value.__dict__:
            self.attributes(value, value.__dict__)

    def number(self, value) -> None:
        self.kind(type(value))
        self.parts.append(exact(value))

    def enum_member(self, value: enum.Enum) -> None:
        """A member by its class and name, and its value's contents (which may be mutable)."""
        self.kind(type(value))
        self.parts.append(value._name_)
        self.value(value._value_)

    def method(self, value: types.MethodType) -> None:
        self.parts.append("method")
        self.value(value.__func__)
        self.value(value.__self__)

    def partial(self, value: functools.partial) -> None:
        self.parts.append("partial")
        self.value(value.func)
        self.value(value.args)
        self.value(value.keywords)

    def library_module(self, value: types.ModuleType) -> None:
        """A library module: by identity; torch.backends' flags (``cudnn.deterministic``)
        by value under the walk's names; numpy's global generator refused."""
        self.parts.append(value)  # modules live as long as the process: held, compared
        name = value.__name__
        if name == "torch" and "backends" in self.names:
            self.value(torch.backends)
        elif name.startswith("torch.backends"):
            for attribute in self.ordered:
                found = _flag(value, attribute)
                if type(found) in _VALUE_TYPES:
                    self.parts += (attribute, found)
                elif isinstance(found, types.ModuleType):
                    if found.__name__.startswith("torch.backends"):
                        self.value(found)
                elif found is not _MISSING and type(found).__module__.startswith("torch.backends"):
                    # (cuda.matmul: an object whose properties read C flags)
                    for flag in self.ordered:
                        inner = _MISSING if flag.startswith("_") else _flag(found, flag)
                        if type(inner) in _VALUE_TYPES:
                            self.parts += (attribute, flag, inner)
        elif name.partition(".")[0] == "numpy" and "random" in self.names:
            raise Unguardable("numpy's global random generator: a draw would be kept")

    def module(self, value: types.ModuleType) -> None:
        if is_library_name(value.__name__):
            self.library_module(value)
            return
        self.identity(value)
        namespace = vars(value)
        if "__getattr__" in namespace:  # a missing attribute is its result (PEP 562)
            self.add_names(("__getattr__",))
        self.attributes(value, namespace)

    def builtin(self, value) -> None:
        owner = getattr(value, "__self__", None)
        if owner is not None and not isinstance(owner, (types.ModuleType, type)):
            raise Unguardable(f"a method bound to a {type(owner).__name__}")
        if owner is not None and _impure(owner, value.__name__):
            # a clock, the OS's random bytes: a trace would hold one answer as a constant
            raise Unguardable(f"{owner.__name__}.{value.__name__}, which answers anew each call")
        self.parts.append(value)  # library code: held, compared by identity
        self.reader(value)

    def reader(self, value) -> None:
        """A torch function that reads global state (``STATE_READERS``), met under any name:
        its own name joins the walk's, so that ``torch_state`` compares the state."""
        name = _READER_IDS.get(id(value))
        if name is not None and name not in self.names:
            self.names.add(name)
            self.grew = True

    def wrapped(self, value) -> None:  # staticmethod, classmethod
        self.parts.append(type(value))
        self.value(value.__func__)

    def property_(self, value: property) -> None:
        self.parts.append("property")
        self.value(value.fget)
        self.value(value.fset)

    def function(self, fn: types.FunctionType) -> None:
        if library_function(fn):
            self.identity(fn)
            self.reader(fn)
            if fn.__closure__:  # (torch's and_masks: the user's masks in its closure)
                self.cells(fn)
            return
        names = self.add_code(fn.__code__)
        if fn.__closure__:
            self.cells(fn)
        if fn.__defaults__:
            self.value(fn.__defaults__)
        if fn.__kwdefaults__:
            self.value(fn.__kwdefaults__)
        globals_, parts = fn.__globals__, self.parts
        for name in names:
            found = globals_.get(name, _MISSING)
            if found is _MISSING:
                found = _BUILTIN_NAMES.get(name, _MISSING)
                if found is _MISSING:
                    continue
            parts.append(name)
            if type(found) is types.ModuleType and found.__name__ in _LIBRARY_MODULES:
                self.library_module(found)  # the common ``torch``: compared by identity
            else:
                self.value(found)
        if fn.__dict__:
            self.attributes(fn, fn.__dict__)

    def cells(self, fn: types.FunctionType) -> None:
        """A function's closure cells' values."""
        try:
            cells = tuple(map(_cell_contents, fn.__closure__))
        except ValueError:  # an empty cell
            cells = tuple(_cell(c) for c in fn.__closure__)
        self.value(cells)

    def items(self, value) -> None:
        # the base type's iteration, not a subclass's __iter__ / __len__; a set in its own
        # order (the order the mod iterates it in), not sorted by repr()
        cls = type(value)
        base = next(b for b in (tuple, list, set, frozenset) if isinstance(value, b))
        if base.__len__(value) > MAX_ITEMS:  # (before a copy of a large one)
            raise Unguardable(f"a {cls.__name__} of {base.__len__(value)} items")
        items = list(base.__iter__(value))
        self.kind(cls)
        self.parts.append(len(items))
        for item in items:
            self.value(item)

    def mapping(self, value: dict) -> None:
        # a copy first (one C call): walking the items runs Python code, during which another
        # thread may add or remove a key, which stops a dict's own iteration with RuntimeError
        # (dict's own items(), not a user subclass's; a library one's: an OrderedDict's order)
        if dict.__len__(value) > MAX_ITEMS:  # (before a copy of a large one)
            raise Unguardable(f"a dict of {dict.__len__(value)} items")
        entries = list(value.items() if _is_library_type(type(value)) else dict.items(value))
        self.kind(type(value))
        self.parts.append(len(entries))
        if isinstance(value, collections.defaultdict):  # its missing keys' values
            self.value(value.default_factory)
        for key, item in entries:
            self.value(key)
            self.value(item)

    def attributes(self, owner, namespace: dict, whole: bool = False) -> None:
        """The entries of ``namespace`` under the walk's names (absent ones as absent), or
        all of them (``whole``)."""
        if whole:
            self.mapping(namespace)
            return
        for name in self.ordered:
            found = namespace.get(name, _MISSING)
            if found is _MISSING:
                continue
            self.parts.append(name)
            self.value(found)

    def add_names(self, names) -> None:
        if not self.names.issuperset(names):
            self.names.update(names)
            self.grew = True

    def klass(self, cls: type, constructed: bool = True) -> None:
        """A class by identity and its entries under the walk's names; the special methods
        Python calls without their names in the code (``obj(...)``, ``obj[i]``, ``a + obj``,
        ``len(obj)``...) join the names, and, for a class reached as a value (which the code
        may call: ``constructed``), ``__init__`` and ``__new__`` too."""
        self.identity(cls)
        if _is_library_type(cls):
            self.reader(cls)  # (``torch.finfo()`` under another name)
            return
        meta = type(cls)  # ``cls.name`` also finds the metaclass's entries and hooks
        if meta is not type and not _is_library_type(meta) and meta not in self.metaclasses:
            self.metaclasses.append(meta)
            _refuse_lookup_hooks(meta)
            self.klass(meta, constructed=False)
        if isinstance(cls, abc.ABCMeta):  # isinstance() reads its registry (register())
            self.parts.append(("abc", abc.get_cache_token()))
        self.add_names(implicit_methods(cls, constructed))
        for name in self.ordered:
            for base in cls.__mro__:
                if name in base.__dict__:
                    self.parts.append(name)
                    self.identity(base)
                    entry = base.__dict__[name]
                    self.value(entry)
                    if name == "__match_args__" and type(entry) is tuple:
                        self.add_names(tuple(n for n in entry if type(n) is str))
                    break

    def instance(self, obj, container: bool = False) -> None:
        """An object: its class's entries and its attributes under the walk's names; for a
        ``container`` (``LIBRARY_CONTAINERS``: their ``__getitem__`` reads what the code
        does not name) also a UserDict's or UserList's ``data``, a container module's every
        item."""
        cls = type(obj)
        is_module = isinstance(obj, torch.nn.Module)
        if _is_library_type(cls) and not is_module:
            raise Unguardable(f"an object of type {cls.__module__}.{cls.__qualname__}")
        if is_module:  # calling it runs its forward and hooks
            self.add_names(_MODULE_CALL)
        elif container:
            self.add_names(("data",))
        namespace = self.object_state(obj, is_module)
        if namespace is None:
            raise Unguardable(f"an object of type {cls.__qualname__} without attributes")
        if is_module:  # parameters, buffers and submodules live in their own dicts
            for table in ("_parameters", "_buffers", "_modules"):
                self.attributes(obj, namespace.get(table) or {}, container)

    def object_state(self, obj, is_module: bool = False) -> dict | None:
        """What an object's attribute reads and special methods may see beyond its value: its
        class's entries and its own attributes (``__dict__`` or slots) under the walk's names.
        Returns its attributes, None if it has no attribute storage."""
        cls = type(obj)
        _refuse_lookup_hooks(cls, torch.nn.Module if is_module else None)
        self.klass(cls, constructed=not self.names.isdisjoint(_CLASS_OF))
        namespace = getattr(obj, "__dict__", None)
        # slots (beside a __dict__ too), under their attribute names (mangled ones included,
        # ``__slots__ = "name"`` too): the member descriptors in the classes' dicts
        known = _SLOTS.get(id(cls))
        every = known[1] if known is not None and known[0]() is cls else _keep_per_type(
            _SLOTS, id(cls), cls, tuple(name for base in cls.__mro__
                                        for name, entry in vars(base).items()
                                        if type(entry) is types.MemberDescriptorType))
        if namespace is None and not every:
            return None
        for name in every:
            if name in self.names:
                self.parts.append(("slot", name))
                found = _slot_value(obj, cls, name)
                if found is _MISSING:
                    self.parts.append(_UNSET_SLOT)
                else:
                    self.value(found)
        self.attributes(obj, namespace if namespace is not None else {})
        return namespace if namespace is not None else {}

    def subclassed(self, value, handler) -> None:
        """A value of a user's subclass of a type the walk knows (a float, dict or tuple
        subclass, an enum, a module whose class was replaced): its value as the base type's,
        then its class and attributes as an object's (``x.offset`` on a float subclass, a
        dict subclass's ``__getitem__``, an enum's methods)."""
        handler(self, value)
        self.object_state(value)


def _refuse_lookup_hooks(cls: type, allowed: type | None = None) -> None:
    """Unguardable if ``cls`` computes attributes by name (``__getattr__``,
    ``__getattribute__``) other than as the types the walk knows do (their C lookups, and
    ``allowed``'s: nn.Module finds parameters, buffers and submodules, which are walked),
    or by a C method of its own base as ``__getattr__`` (an attribute dict's
    ``__getattr__ = dict.__getitem__`` reads the items, which the walk reads)."""
    known = _HOOKS.get((id(cls), allowed))
    reason = known[1] if known is not None and known[0]() is cls else \
        _keep_per_type(_HOOKS, (id(cls), allowed), cls, _lookup_hook(cls, allowed))
    if reason is not None:
        raise Unguardable(reason)


# (id(type), allowed) -> (weak reference to the type, why it is refused or None)
_HOOKS: dict[tuple, tuple] = {}


def _keep_per_type(table: dict, key, cls: type, value):
    """``value`` kept in ``table`` (``_HOOKS``, ``_HANDLERS``) under ``key``, which holds
    ``id(cls)``, beside a weak reference to ``cls`` that tells a reused id apart: a type held
    here would keep its methods' closures, and the tensors they capture, alive after the mod
    is dropped. The table is emptied past 4096 entries. Returns ``value``."""
    if len(table) > 4096:
        table.clear()
    table[key] = (weakref.ref(cls), value)
    return value


def _lookup_hook(cls: type, allowed: type | None) -> str | None:
    """Why ``_refuse_lookup_hooks`` refuses ``cls``, or None."""
    for hook in ("__getattr__", "__getattribute__"):
        defined = next((base.__dict__[hook] for base in cls.__mro__ if hook in base.__dict__),
                       None)
        if defined is None or (allowed is not None and defined is allowed.__dict__.get(hook)):
            continue
        owner = getattr(defined, "__objclass__", None) if isinstance(defined, _BUILTINS) \
            else None
        if owner in _GENERIC_LOOKUP or (hook == "__getattr__" and owner in cls.__mro__):
            continue
        return f"{cls.__qualname__} defines {hook}"
    return None


# C types whose attribute lookup is Python's generic one (a module's also runs its
# ``__getattr__``, which the walk reads): a user's subclass may inherit it
_GENERIC_LOOKUP = frozenset({object, type, int, float, complex, str, bytes, tuple, list, dict,
                             set, frozenset, types.ModuleType, functools.partial,
                             torch._C.TensorBase})


_BUILTINS = (types.BuiltinFunctionType, types.BuiltinMethodType, types.WrapperDescriptorType,
             types.MethodDescriptorType, types.MethodWrapperType,
             types.ClassMethodDescriptorType)
# a namedtuple's field accessor (reads an item), a __slots__ entry's (reads the slot) and a
# class's __dict__ / __weakref__ accessors: C code whose reads the walk reads as the object's
# state (code naming __dict__ is unguardable anyway)
_ACCESSORS = (type(collections.namedtuple("_Pair", "first").first), types.MemberDescriptorType,
              types.GetSetDescriptorType)
# (base type, handler) in the order they are tried; _handler caches the answer per type
_DISPATCH = ((torch.Tensor, _Walk.tensor), (enum.Enum, _Walk.enum_member),
             (numbers.Number, _Walk.number),
             (types.FunctionType, _Walk.function), (types.MethodType, _Walk.method),
             (functools.partial, _Walk.partial), ((tuple, list, set, frozenset), _Walk.items),
             (dict, _Walk.mapping), (types.ModuleType, _Walk.module), (type, _Walk.klass),
             (_BUILTINS, _Walk.builtin), ((staticmethod, classmethod), _Walk.wrapped),
             ((property, types.DynamicClassAttribute), _Walk.property_),
             (_ACCESSORS, _Walk.accessor))
# id(type) -> (weak reference to the type, its handler): see _keep_per_type
_HANDLERS: dict[int, tuple] = {}
# id(type) -> (weak reference to the type, its slots' attribute names): see _keep_per_type
_SLOTS: dict[int, tuple] = {}


def _handler(cls: type):
    """The walk's handler for values of type ``cls`` (instances of anything else: objects)."""
    handler = next((h for base, h in _DISPATCH if issubclass(cls, base)), _Walk.instance)
    if handler not in (_Walk.instance, _Walk.klass) and not _is_library_type(cls):
        handler = functools.partial(_Walk.subclassed, handler=handler)
    elif handler is _Walk.instance:
        hidden = next((base for base in cls.__mro__ if not base.__flags__ & _HEAP_TYPE
                       and base not in _ATTRIBUTE_STATE), None)
        if hidden is not None:
            handler = functools.partial(_refuse, reason=(
                f"an object of type {cls.__qualname__}, whose base "
                f"{hidden.__module__}.{hidden.__qualname__} keeps state outside its attributes"))
        elif issubclass(cls, LIBRARY_CONTAINERS):
            handler = functools.partial(_Walk.instance, container=True)
    return _keep_per_type(_HANDLERS, id(cls), cls, handler)


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement (not C)
# library classes whose methods read what the code does not name (``cfg["c"]`` reads a
# UserDict's ``data``, ``layers[0]`` a ModuleList's ``_modules["0"]``), subclasses too
LIBRARY_CONTAINERS = (collections.UserDict, collections.UserList, collections.UserString,
                      torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict,
                      torch.nn.ParameterList, torch.nn.ParameterDict)
# C types whose objects keep their whole state in their attributes
_ATTRIBUTE_STATE = frozenset({object, types.SimpleNamespace, typing.Generic})  # (C on 3.12)


def _refuse(walk, value, reason: str):
    raise Unguardable(reason)


_cell_contents = operator.attrgetter("cell_contents")


def _cell(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _ABSENT


def filled(cell) -> bool:
    """Whether a closure cell holds a value (a variable assigned later has an empty one)."""
    return _cell(cell) is not _ABSENT


def _flag(owner, name: str):
    """``owner.name`` for a torch.backends module or object (a property reading a C flag),
    _MISSING where it has none or reading it fails (a backend this build lacks)."""
    try:
        return getattr(owner, name)
    except Exception:  # noqa: BLE001 (AttributeError, or a backend's RuntimeError)
        return _MISSING


def _slot_value(obj, cls: type, name: str):
    """The value of slot ``name`` (an attribute name: mangled for ``__name``) through its
    member descriptor, not ``getattr``: a subclass's property of that name is not called;
    _MISSING when unset."""
    for base in cls.__mro__:
        entry = vars(base).get(name)
        if type(entry) is types.MemberDescriptorType:
            try:
                return entry.__get__(obj, cls)
            except AttributeError:
                return _MISSING
    return _MISSING


_UNSET_SLOT = object()  # an unset slot's part: equal to no value's
# the name by which code reaches an object's class to call it (``self.__class__()``; code
# calling the builtin ``type`` adds it: ``type(self)()``; not a ``.type`` attribute)
_CLASS_OF = frozenset({"__class__"})
_MODULE_CALL = frozenset({"forward", "_forward_hooks", "_forward_pre_hooks"})
# special methods no mod invokes implicitly while tracing (printing, pickling, copying,
# attribute stores); construction's are added only for a class the code may call
_NOT_IMPLICIT = frozenset({"__repr__", "__str__", "__format__", "__del__", "__reduce__",
                           "__reduce_ex__", "__getstate__", "__setstate__", "__copy__",
                           "__deepcopy__", "__sizeof__", "__dir__", "__init_subclass__",
                           "__class_getitem__", "__subclasshook__", "__set_name__",
                           "__setattr__", "__delattr__", "__init__", "__new__"})
# class -> (its bases' entry names, its implicit names, with construction's); weakly keyed:
# keeps no class alive
_IMPLICIT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def implicit_methods(cls: type, constructed: bool) -> frozenset:
    """The special methods (``__call__``, ``__getitem__``, ``__add__``...) that ``cls`` or a
    base outside the libraries defines: Python calls them on operators and calls without
    naming them in the code, so the walk must read them like named attributes. Kept per
    class with the names of its bases' entries: one added later (``Flag.__bool__ = ...``)
    or a base changed is taken anew."""
    bases = tuple(base for base in cls.__mro__ if not _is_library_type(base))
    entries = (tuple(map(id, bases)), tuple(tuple(vars(base)) for base in bases))  # (no refs)
    try:
        known = _IMPLICIT.get(cls)
    except TypeError:  # a metaclass without weak references or hashing
        known = None
    if known is None or known[0] != entries:
        found = {name for base in bases for name, entry in vars(base).items()
                 if name.startswith("__") and name.endswith("__") and (
                     entry is None or callable(entry)
                     or isinstance(entry, (staticmethod, classmethod, property)))}
        if any("keys" in vars(base) for base in bases):  # dict(obj), f(**obj) call keys()
            found.add("keys")
        implicit = frozenset(found - _NOT_IMPLICIT)
        known = (entries, implicit, implicit | (found & {"__init__", "__new__"}))
        try:
            if len(_IMPLICIT) > 4096:
                _IMPLICIT.clear()
            _IMPLICIT[cls] = known
        except TypeError:
            pass
    return known[2] if constructed else known[1]


def exact(value):
    """A number as the fingerprint compares it: floats by their bits (0.0 == -0.0, but
    ``1 / x`` and ``copysign`` tell them apart)."""
    if isinstance(value, float):
        return value.hex() if value == value else struct.pack("<d", value)  # NaN: its bits
    if isinstance(value, complex):
        return exact(value.real), exact(value.imag)
    if isinstance(value, int) and type(value) is not int and type(value) is not bool:
        return int.__int__(value)  # an int subclass: a plain int (its __eq__ is the user's)
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return value, float(value).hex()  # numpy's float32, fractions: the value and its sign
    return value


def guard(fn, names: frozenset = frozenset()) -> Guard | None:
    """The guard of ``fn`` (a function, bound method, partial or callable object), or None
    when some of its state cannot be fingerprinted. ``names``: a previous guard's names."""
    if isinstance(fn, torch.nn.Module):  # its __call__ runs the hooks and forward
        names = names | _MODULE_CALL
    elif not isinstance(fn, (types.FunctionType, types.MethodType, functools.partial)):
        names = names | {"__call__"}
    for _ in range(8):
        walk = _Walk(names)
        try:
            walk.value(fn)
        except (Unguardable, RecursionError):
            return None
        if not walk.grew:  # its names are the ones it started from
            return Guard(tuple(walk.parts), names, tuple(walk.tensors), walk.identities)
        names = frozenset(walk.names)
    return None


# ---- pins: the guard of a plain function that reaches only identities, checked cheaply ----
#
# A function with no defaults or attributes, no imports, whose closure cells and global names
# hold only values the walk compares by identity (library modules and functions, builtins,
# immutable scalars, strings) or tensors (identity and metadata), has a fingerprint that
# changes only if one of those bindings does. ``pins`` records the bindings and
# ``pins_hold`` compares them (a few identity tests: ``causal``, a softcap, a mod over a
# captured table), so the trace memo need not walk such a mod on every call. Anything else
# (methods, partials, objects, containers, user functions or modules) takes the full guard.

_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes})


def _pin(value):
    """(what a later binding must be, or its tensor's weak reference and metadata) for a
    value the walk compares by identity or as a tensor; None for any other value."""
    cls = type(value)
    if cls is torch.Tensor:
        if value.__dict__:  # Python attributes: the full guard reads them
            return None
        return (weakref.ref(value), value.shape, value.dtype, value.device, value.requires_grad)
    if cls in _SCALARS:
        return (value,)
    if cls is types.ModuleType and is_library_name(value.__name__):
        return (value,)
    if cls is types.FunctionType and library_function(value) and value.__closure__ is None:
        return (value,)
    if cls is types.BuiltinFunctionType:
        owner = getattr(value, "__self__", None)
        if owner is None or isinstance(owner, types.ModuleType) and \
                not _impure(owner, value.__name__):
            return (value,)
    return None


def _pinned(value, pin) -> bool:
    if len(pin) == 1:
        return value is pin[0]
    return (pin[0]() is value and not value.__dict__ and value.shape == pin[1]
            and value.dtype is pin[2]
            and value.device == pin[3] and value.requires_grad == pin[4])


def pins(fn) -> tuple | None:
    """The bindings ``fn``'s guard depends on, where it is a plain function whose every
    binding ``_pin`` takes (else None: the full guard). Taken before the trace it serves and
    kept only if ``pins_hold`` still after (the state did not change meanwhile)."""
    if type(fn) is not types.FunctionType or fn.__defaults__ is not None or \
            fn.__kwdefaults__ is not None or fn.__dict__ or library_function(fn):
        return None
    names, imports, _ = _code_facts(fn.__code__)
    if imports or not names.isdisjoint(DYNAMIC_NAMES) or "backends" in names:
        return None  # (torch.backends' flags: the full guard compares them)
    cells = []
    for cell in fn.__closure__ or ():
        try:
            pin = _pin(cell.cell_contents)
        except ValueError:  # an empty cell
            return None
        if pin is None:
            return None
        cells.append(pin)
    globals_, bound = fn.__globals__, []
    for name in names:
        found = globals_.get(name, _MISSING)
        pin = (_MISSING, _BUILTIN_NAMES.get(name, _MISSING)) if found is _MISSING else _pin(found)
        if pin is None:
            return None
        bound.append((name, pin))
    return fn.__code__, tuple(cells), tuple(bound)


def pins_hold(fn, pinned: tuple) -> bool:
    """Whether every binding ``pins`` recorded for ``fn`` is still the same (then its full
    guard would compare equal)."""
    code, cells, bound = pinned
    if fn.__code__ is not code or fn.__defaults__ is not None or \
            fn.__kwdefaults__ is not None or fn.__dict__:
        return False
    for cell, pin in zip(fn.__closure__ or (), cells):
        try:
            if not _pinned(cell.cell_contents, pin):
                return False
        except ValueError:
            return False
    globals_ = fn.__globals__
    for name, pin in bound:
        found = globals_.get(name, _MISSING)
        if pin[0] is _MISSING:
            if found is not _MISSING or _BUILTIN_NAMES.get(name, _MISSING) is not pin[1]:
                return False
        elif found is _MISSING or not _pinned(found, pin):
            return False
    return True
