"""What ``torch.compile`` traces of ``flex_attention``, ``flex_decode`` and
``create_block_mask``: the ``flexfa::`` operators (``flexfa.ops``), with no graph break.

Dynamo traces the functions here like user code. One step is opaque to it: ``describe``
runs at trace time on the real mods (Dynamo calls it with constants, a module or other object
as its class and id, and keeps its result as a constant, as for
``torch._dynamo.assume_constant_result``): it traces the mods with
flexfa's tracer, registers them (``flexfa.ops.register_mods``) and returns their key with
the path from each mod to each of its captured tensors. Dynamo then follows those paths
(closure cells, globals, attributes, items), so the captured tensors enter the graph as
Dynamo sees them: guarded, lifted as graph inputs, read fresh on every run. A closure cell is
read by calling a one-line function that closes over the same cell (``CELL_READERS`` on the
function): Dynamo reads cells only through free variables (``fn.__closure__[i]`` becomes a cell
object Dynamo cannot take ``cell_contents`` of once it has inlined ``fn``, and the reverse). A
global is read by a one-line function of the same globals (``GLOBAL_READERS``), so that a
global the compiled code assigned before the call reads as Dynamo's new value (through
``fn.__globals__`` it read the real module's old one). The mods are also
called once on one-element tensors (dead code in the graph) so that Dynamo guards on every Python
value they read (``self.window``), as it would for torch's FlexAttention.

A mod made inside the compiled code (a ``def`` there, a closure a factory returns there, a
``functools.partial``) has no Python object at trace time: ``flexfa.made_inside`` rebuilds it
from Dynamo's values for ``describe`` and hands the traced code the values its paths start at.
"""
from __future__ import annotations

import collections
import ctypes
import enum
import functools
import inspect
import operator
import sys
import types
import weakref

import torch

from .blockmask.block_mask import BlockMask, TracedMaskMod
from .blockmask.checks import batch_size, block_size_pair, default_device
from .eager import in_graph
from .errors import FlexFAError, InputError, InputTypeError, check_bool, dims
from .features import check_sinks, prepare_dropout
from .frontend.guards import (DYNAMIC_NAMES, LIBRARY_CONTAINERS, code_imports, code_names, filled,
                              global_names, implicit_methods, is_library_name,
                              library_function)
from .frontend.grad import mask_mod_grad_error
from .frontend.trace import MASK_MOD, SCORE_MOD, mod_name, trace_entry
from .decode import check_no_grad as check_decode_no_grad
from .inputs import (autocast_inputs, broadcast_batch, check_aux, check_block_mask,
                     check_block_mask_type, check_scale, check_shapes, check_tensors)
from .made_inside import MADE_INSIDE, SLOT, Inside, made_inside, pending_assignments
from .blockmask.validate import TABLES
from .runtime.options import parse_kernel_options

MAX_VISITS = 4096  # objects a path search visits
CELL_READERS = "_flexfa_cell_readers"  # function attribute: {free variable: reader}
GLOBAL_READERS = "_flexfa_global_readers"  # function attribute: {global name: reader}


def describe(score_mod, score_class, score_id, mask_mod, mask_class, mask_id,
             enable_gqa: bool, kernel_options) -> tuple:
    """(mods key, paths to the score_mod's captured tensors (then to those its trace removed:
    ``buffer_paths``' ``unread``), paths to the mask_mod's, then for each mod the (path,
    shape) of the captured tensors whose sizes its trace read: ``sized_paths``); runs
    at Dynamo's trace time on the real objects. Each mod comes as ``unbound`` takes it apart:
    Dynamo hands an assume-constant function only what it can turn into constants."""
    try:
        return _described(score_mod, score_class, score_id, mask_mod, mask_class, mask_id,
                          enable_gqa, kernel_options)
    except FlexFAError as error:  # raised here, outside Dynamo's tracing: passed as it is
        raise_through(type(error), str(error))


def _described(score_mod, score_class, score_id, mask_mod, mask_class, mask_id,
               enable_gqa: bool, kernel_options) -> tuple:
    score_inside = Inside(*score_id) if score_class == MADE_INSIDE else None
    mask_inside = Inside(*mask_id) if mask_class == MADE_INSIDE else None
    score_mod = score_inside.function if score_inside else _rebound(score_mod, score_class,
                                                                     score_id)
    mask_mod = mask_inside.function if mask_inside else _rebound(mask_mod, mask_class, mask_id)
    if score_mod is not None and not callable(score_mod):
        raise InputTypeError(f"score_mod must be callable or None, got {type(score_mod).__name__}")
    from .ops import class_pins, register_mods, watched  # (registers the operators: first call)
    score, score_sized = _traced(score_mod, SCORE_MOD)
    mask, mask_sized = _traced(mask_mod, MASK_MOD)
    score_run, mask_run = functions_run(score_mod), functions_run(mask_mod)
    _refuse_unfollowed(score, score_run)
    _refuse_unfollowed(mask, mask_run)
    pending = pending_assignments()
    if pending:
        _refuse_pending(score, score_run, pending)
        _refuse_pending(mask, mask_run, pending)
    key = register_mods(score, mask, parse_kernel_options(kernel_options), bool(enable_gqa))
    # the class attributes the mods read, checked on every run (ops.check_unchanged): torch
    # 2.11's Dynamo does not guard them
    key = watched(key, class_pins(score_mod, score_run[0]) + class_pins(mask_mod, mask_run[0]))
    described = (key, buffer_paths(score_mod, score, unread=True, inside=score_inside),
                 buffer_paths(mask_mod, mask, inside=mask_inside),
                 sized_paths(score_mod, score_sized, score_inside)
                 + number_paths(score_mod, score_run[1], score_inside),
                 sized_paths(mask_mod, mask_sized, mask_inside)
                 + number_paths(mask_mod, mask_run[1], mask_inside))
    for inside in (score_inside, mask_inside):
        if inside is not None:
            inside.export()  # (after every path is rewritten: the slots are complete)
    return described


# what torch._dynamo.assume_constant_result sets, without importing Dynamo at import time
describe._dynamo_marked_constant = True


def raise_through(error_type: type, message: str):
    """Raise ``error_type(message)`` (a flexfa error) so that torch.compile passes it to the
    caller as that error, where Dynamo would report one raised in traced code as
    ``Unsupported: Observed exception`` (``fullgraph=True``) and one raised in ``describe``
    as an ``InternalTorchDynamoError``. Dynamo runs this function without tracing it (an
    assume-constant function) and re-raises its ``Unsupported`` errors as they are: the error
    is also one (``_raised_through``), which without ``fullgraph`` is a graph break, so the
    call runs eagerly and raises eager flexfa's error."""
    raise _raised_through(error_type)(message) from None


raise_through._dynamo_marked_constant = True


@functools.lru_cache(maxsize=64)
def _raised_through(error_type: type) -> type:
    """``error_type`` that is also Dynamo's ``Unsupported``, under the same name."""
    from torch._dynamo.exc import Unsupported  # loaded: this runs inside torch.compile

    def __init__(self, message):
        Unsupported.__init__(self, message)  # (its other arguments differ between releases)
    return type(error_type.__name__, (error_type, Unsupported),
                {"__init__": __init__, "__module__": error_type.__module__,
                 "__qualname__": error_type.__qualname__, "__doc__": error_type.__doc__})


def _raised_as_eagerly(fn):
    """``fn`` (a function traced by Dynamo) raising flexfa's errors through ``raise_through``:
    the same type and message as eagerly, ``fullgraph=True`` included."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FlexFAError as error:
            raise_through(type(error), error.args[0])
    return traced


def unbound(mod) -> tuple:
    """(function, class, id) of ``mod`` as ``describe`` takes it (traced by Dynamo): a
    function is itself; a bound method is its function and its instance's class and id;
    another object (an ``nn.Module``, a callable instance) is its class and id. torch 2.11's
    Dynamo turns an ``nn.Module`` or other object into no constant (2.13 does, with an
    identity guard), but it folds ``id(obj)`` and ``type(obj)`` of an object from outside the
    compiled code into constants on both, guarding on the object's identity. Mods made inside
    the compiled code and partials never come here (``flexfa.made_inside``)."""
    if mod is None or isinstance(mod, types.FunctionType):
        return mod, None, None
    if isinstance(mod, types.MethodType):
        return mod.__func__, type(mod.__self__), id(mod.__self__)
    return None, type(mod), id(mod)


def _rebound(function, cls, object_id):
    """The mod ``unbound`` took apart."""
    if object_id is None:
        return function
    instance = _live_object(cls, object_id)
    return instance if function is None else types.MethodType(function, instance)


def _live_object(cls, object_id: int):
    """The object ``id(obj) == object_id``. Safe only while the object is alive, as it is
    here: ``describe`` runs while Dynamo traces the frame that holds it, a few bytecodes
    after Dynamo took its id (its variable holds the object). Objects made inside the
    compiled function go through ``flexfa.made_inside`` (Dynamo's ``id`` of one is a
    stand-in's); one that still comes here is refused unless its stand-in converts."""
    instance = ctypes.cast(object_id, ctypes.py_object).value
    if type(instance) is cls:
        return instance
    try:
        instance = instance.as_python_constant()
    except Exception:  # any failure of the stand-in's conversion: no object to trace
        instance = None
    if type(instance) is not cls:
        raise InputError(f"a mod of type {cls.__qualname__} made inside the compiled function "
                         "has no Python object while torch.compile traces it; make it outside "
                         "(an argument, a global, a module attribute)")
    return instance


def _traced(mod, kind) -> tuple:
    """(the trace of ``mod``, the captured tensors whose sizes Python read while tracing)."""
    if mod is None:
        return None, ()
    if isinstance(mod, TracedMaskMod):
        return mod.traced, ()
    entry = trace_entry(mod, kind)
    if entry.reads:
        raise InputError(f"the {kind} {entry.traced.name!r} reads the values of captured tensors "
                         "in Python while traced (float(t), if t.sum() > 0): under "
                         "torch.compile its trace could not follow their changes; index them "
                         f"with the mod's arguments instead{_parametrized(mod)}")
    sized = tuple(t for t in (ref() for ref in entry.sized) if t is not None)
    return entry.traced, sized


def _checked_scale_and_mod(scale, score_mod, head_dim: int):
    """``scale`` checked (None stays None) and ``score_mod`` checked callable, as the eager
    entry points check them, in a form Dynamo traces."""
    if isinstance(scale, torch.Tensor):  # (check_scale's message has its repr: not traceable)
        raise InputTypeError("scale must be a float or None, got Tensor")
    if scale is not None:
        scale = check_scale(scale, head_dim)
    if score_mod is not None and not callable(score_mod):
        raise InputTypeError(f"score_mod must be callable or None, got {type(score_mod).__name__}")
    return scale


def _plain_option(name: str, value):
    """``value`` of kernel option ``name`` (a str, float or None: ``parse_kernel_options``
    checks it), or an InputTypeError for another type, such as a NumPy scalar, which Dynamo
    cannot hand to ``describe`` (it failed there, inside Dynamo)."""
    if not isinstance(value, (str, float, type(None))):
        raise InputTypeError(f"kernel_options[{name!r}] must be a Python int, bool, str, "
                             "float or None under torch.compile (a NumPy scalar is none of "
                             "them: pass int(x) or bool(x))")
    return value


def _refuse_pending(traced, run: tuple, pending: dict) -> None:
    """Refuse a mod that reads what the compiled code changed before this call
    (``made_inside.pending_assignments``): an attribute assigned (``self.window = 4`` then a
    mask over ``self.window``), a global or closure variable assigned, a container changed in
    place (``cfg["w"] = 9``). Its trace saw the old value, which the real object still holds
    until the graph ends. An attribute, global or cell assigned a tensor is no problem: the
    operator takes the one Dynamo follows, the new one (``follow`` reads a global through a
    reader function, as a cell: Dynamo's pending store, not the real module's old value).
    ``run``: ``functions_run`` of the mod."""
    if traced is None or not pending:
        return
    functions, names, objects = run
    # (object, what a changed name of it is called in the error, the names read of it)
    where = [(obj, lambda name, obj=obj: f"{_named(obj)}.{name}", names) for obj in objects]
    for function in functions:
        where.append((function.__globals__, lambda name: f"the global {name!r}",
                      names if names is EVERY_NAME else code_names(function.__code__)))
        where += [(cell, lambda _, free=free, function=function:
                   f"the closure variable {free!r} of {function.__name__!r}", {"cell_contents"})
                  for free, cell in zip(function.__code__.co_freevars, function.__closure__ or ())]
    for obj, what, used in where:
        obj_pending = pending.get(id(obj))
        if obj_pending is None:
            continue
        if obj_pending[1] is None:
            raise InputError(
                f"the {traced.kind} {traced.name!r} reads a {type(obj).__name__} that the "
                "compiled function changed in place before this call: torch.compile applies "
                "that change after the graph, so flexfa would trace the old contents; change "
                "it outside the compiled function, or pass the value in a closure or an "
                "argument")
        for name, value in obj_pending[1].items():
            if name not in used:
                continue
            if value.is_tensor():
                if _holds_tensor(obj, name):
                    continue  # followed: the operator reads the tensor Dynamo holds now
                raise InputError(
                    f"the {traced.kind} {traced.name!r} reads {what(name)}, to which the "
                    "compiled function assigned a tensor before this call where it held a "
                    "number or other object: the mod's trace holds the old value, and "
                    "torch.compile applies the assignment after the graph; assign it outside "
                    "the compiled function, or give it a tensor from the start")
            raise InputError(
                f"the {traced.kind} {traced.name!r} reads {what(name)}, which "
                "the compiled function assigned before this call: torch.compile applies "
                "that assignment after the graph, so flexfa would trace the old value; "
                "assign it outside the compiled function, or pass the value in a closure "
                "or an argument")


def _holds_tensor(obj, name: str) -> bool:
    """Whether ``obj``'s ``name`` (a dict's item: globals; else an attribute, a cell's
    ``cell_contents``) holds a tensor now (before Dynamo applies its pending assignment)."""
    try:
        value = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    except Exception:  # (a property that fails outside its call: not a tensor)
        return False
    return isinstance(value, torch.Tensor)


def _named(obj) -> str:
    """A module's name, a class's own, else the object's type's."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    return obj.__qualname__ if isinstance(obj, type) else type(obj).__name__


def buffer_paths(mod, traced, unread: bool = False, inside: Inside | None = None) -> tuple:
    """The path from ``mod`` to each of ``traced``'s captured tensors, by identity: tuples of
    steps ``("attr", name)``, ``("item", key)``, ``("cell", free variable)``, ``("global", name)``.
    ``unread``: then the paths of the captured tensors the trace removed
    (``TracedMod.dropped``) that can be reached; the operator takes them after the others so
    that they get torch's zero gradient (one that requires grad and cannot be reached fails
    as a read one does)."""
    if traced is None:
        return ()
    read = len(traced.buffers)
    tensors = (*traced.buffers, *(traced.dropped if unread else ()))
    if not tensors:
        return ()
    found = _find_paths(mod, tensors, inside)
    missing = [s for s in range(len(tensors))
               if s not in found and (s < read or tensors[s].requires_grad)]
    if missing:
        shapes = ", ".join(str(tuple(tensors[s].shape)) for s in missing)
        what = ("reads captured tensors" if missing[0] < read else
                "has tensors that require grad in a branch its trace removes (their gradient "
                "is zeros)")
        raise InputError(
            f"the {traced.kind} {traced.name!r} {what} of shape {shapes} that torch.compile "
            "cannot reach from it (tensors computed inside the mod, or held by an object "
            "flexfa does not walk); compute them outside the mod and capture them in a "
            f"closure, a global, a functools.partial or a module attribute{_parametrized(mod)}")
    return tuple(found[s] for s in range(len(tensors)) if s in found)


def _parametrized(mod) -> str:
    """A hint naming the parametrized attributes of the modules ``mod`` reaches
    (``torch.nn.utils.parametrize``: each read computes a new tensor), or ''."""
    from torch.nn.utils import parametrize
    names = [f"{type(obj).__name__}.{name}" for obj, _ in _reachable(mod)
             if isinstance(obj, torch.nn.Module) and parametrize.is_parametrized(obj)
             for name in obj.parametrizations]
    if not names:
        return ""
    return (f"; {', '.join(names)} is parametrized (torch.nn.utils.parametrize): each read "
            "computes a new tensor, so read it in forward (bias = self.bias) and define the "
            "mod there, capturing that tensor")


def sized_paths(mod, tensors, inside: Inside | None = None) -> tuple:
    """(path, shape) of each of ``tensors`` (captured tensors whose sizes the trace of ``mod``
    read, so that its IR may hold them as constants: ``t[q_idx - kv_idx + t.shape[0] // 2]``)
    that can be reached from ``mod``; ``pin_sizes`` guards them."""
    found = _find_paths(mod, tensors, inside)
    return tuple((found[s], tuple(tensors[s].shape)) for s in sorted(found))


MAX_PINNED = 4096  # Python numbers number_paths pins per mod


def number_paths(mod, names, inside: Inside | None = None) -> tuple:
    """(path, value) of the Python ints and floats (not bools) ``mod`` may read: in its
    closures and globals, in attributes its code names (``functions_run``'s ``names``) and in
    the items of containers met there. Their values are in the mod's trace as constants;
    ``pin_sizes`` compares each with its value in the traced code, which under Dynamo's
    automatic dynamic shapes specializes an int that changed between calls (it became
    symbolic at the recompile, and without the comparison every later value ran the trace
    of that recompile's value, silently). A superset of what the mod reads: an unread number
    beside a read one (another item of a dict the mod reads) compiles again when it
    changes."""
    if mod is None:
        return ()
    found = []
    for obj, path in _reachable(mod, names):
        if type(obj) in (int, float) and obj == obj:  # (a NaN equals nothing: not pinned)
            found.append((path, obj))
        elif isinstance(obj, torch.Tensor) and obj.__dict__ and \
                any(n in names for n in obj.__dict__):  # (names may be EVERY_NAME)
            raise InputError(
                f"the mod {mod_name(mod)!r} may read Python attributes set on a captured tensor "
                f"({', '.join(sorted(n for n in obj.__dict__ if n in names))}), which "
                "torch.compile does not guard: a changed value would run the old one; hold "
                "the value in a closure, a module attribute or a tensor")
    if len(found) > MAX_PINNED:
        raise InputError(
            f"the mod {mod_name(mod)!r} may read {len(found)} Python numbers (its closures, "
            f"globals, the attributes it names and their containers' items); torch.compile's "
            f"guards on them are limited to {MAX_PINNED}: hold them in a tensor")
    for path, _ in found:
        _add_cell_readers(mod, path)
    if inside is not None:  # (its own defaults are the Dynamo values made_inside takes)
        found = [(inside.rewrite(path), value) for path, value in found
                 if path[0] not in (("attr", "__defaults__"), ("attr", "__kwdefaults__"))]
    return tuple(found)


def _find_paths(mod, tensors, inside: Inside | None = None) -> dict:
    """{slot: path} of the ``tensors`` reachable from ``mod`` (by identity, shortest paths);
    gives the functions on the paths their cell readers. For a mod made inside the compiled
    function, the paths start at the Dynamo values ``inside`` hands the traced code."""
    wanted = {id(t): slot for slot, t in enumerate(tensors)}
    found: dict[int, tuple] = {}
    for obj, path in _reachable(mod):
        slot = wanted.get(id(obj)) if isinstance(obj, torch.Tensor) else None
        if slot is not None and slot not in found:
            found[slot] = path
            if len(found) == len(wanted):
                break
    for path in found.values():
        _add_cell_readers(mod, path)
    if inside is not None:
        found = {slot: inside.rewrite(path) for slot, path in found.items()}
    return found


def _reachable(mod, names=None):
    """(object, path) of what paths from ``mod`` reach, breadth first (so each first met by a
    shortest path): every tensor met (not walked into), every Python number at each path
    met (equal ones may be one object), and every other object once, until MAX_VISITS
    objects were seen. ``names`` (``functions_run``'s: the walk of what a mod may read, for
    ``number_paths``): ``_children``' reads and, of an object's attributes (not a bound
    method's, a partial's or an enum member's), only those under these names."""
    reads = names is not None
    queue, seen = collections.deque([(mod, ())]), {id(mod)}
    yield mod, ()
    while queue and len(seen) < MAX_VISITS:
        obj, path = queue.popleft()
        taken = _taken(obj) if reads else EVERY_NAME
        for step, child in _children(obj, reads):
            if reads and step[0] == "attr" and step[1] not in names and step[1] not in taken:
                continue
            if isinstance(child, (torch.Tensor, int, float)):
                yield child, (*path, step)
            elif not isinstance(child, _UNCHANGING) and id(child) not in seen:
                seen.add(id(child))
                yield child, (*path, step)
                queue.append((child, (*path, step)))


MAX_RUN_FUNCTIONS = 256  # user functions functions_run collects per mod
MAX_RUN_VISITS = 1 << 16  # objects it visits (once per mod and trace; scalars not counted)
_UNCHANGING = (int, float, complex, str, bytes, type(None))  # no attributes a mod could change


class _EveryName(frozenset):
    """The names of a walk whose code looks attributes up by computed names (``getattr``,
    ``vars``, ``__dict__``...): every name may be read."""

    def __contains__(self, name) -> bool:
        return True


EVERY_NAME = _EveryName()
# stands in ``functions_run``'s objects for a weak reference reached: its target is unknown
UNFOLLOWED = object()
_WEAK_REFERENCES = (*weakref.ProxyTypes, weakref.ReferenceType)
# the special methods Python runs on an attribute lookup without naming them
_LOOKUP_HOOKS = ("__getattr__", "__getattribute__")


def functions_run(mod) -> tuple[list, frozenset, list]:
    """(the user functions ``mod`` may run, the names their code uses, the other objects it
    may read): from ``mod`` (its own code, a callable object's ``__call__`` and ``forward``,
    a bound method's object, a partial's function and arguments) through closures, the
    globals and the attributes its code names (an object's attribute, dicts included, is
    taken once some code uses its name), items of containers, a user class's attributes
    (its objects' class's too), an enum member's value, the state of ``collections``'
    containers (a ChainMap's maps), and the methods, static and class methods, property
    getters, descriptors' ``__get__`` and lookup hooks (``__getattr__``, a module's too) of
    the objects, classes and modules met under the names that code uses
    (``self.helper.near(...)`` runs ``Helper.near``), to a fixed point. A superset of what a
    call runs and reads (a method of a name the code uses on another object counts too).
    Where some code reached looks attributes up by computed names (``guards.DYNAMIC_NAMES``:
    ``getattr(cfg, name)``, a ``__getattr__`` alias map) every attribute but functions is
    taken and the names are ``EVERY_NAME``; a weak reference met adds ``UNFOLLOWED`` to the
    objects. A mod reaching more than ``MAX_RUN_FUNCTIONS`` functions or ``MAX_RUN_VISITS``
    objects is an InputError: what it reads past them could not be checked."""
    functions, names, objects = [], set(), []
    if mod is None:
        return functions, frozenset(), objects
    seen, queue = set(), collections.deque()
    owners: dict[int, object] = {}  # id -> class or module whose namespace methods come from
    looked: set[tuple[int, str]] = set()
    deferred = collections.defaultdict(list)  # attribute name -> values not yet taken
    every = []  # [True] once some code looks attributes up by computed names
    owned: set[int] = set()  # ids of the containers a library module holds

    def method(owner, name: str) -> None:
        if (id(owner), name) in looked:
            return
        looked.add((id(owner), name))
        found = (owner.__dict__.get(name) if isinstance(owner, types.ModuleType)
                 else inspect.getattr_static(owner, name, None))
        if isinstance(found, (staticmethod, classmethod)):
            found = found.__func__
        elif isinstance(found, property):
            found = found.fget
        elif found is not None and not isinstance(found, types.FunctionType) and \
                hasattr(type(found), "__get__") and \
                not is_library_name(type(found).__module__ or ""):
            visit(found)  # a descriptor: its __get__ runs on the lookup
            found = inspect.getattr_static(type(found), "__get__", None)
        if isinstance(found, types.FunctionType):
            visit(found)

    numpy = sys.modules.get("numpy")  # (a NumPy value exists only once it is loaded)
    numpy_values = () if numpy is None else (numpy.ndarray, numpy.generic)

    def take(used) -> None:
        """The names some reached code uses: their methods and deferred attributes too."""
        if not every and not used.isdisjoint(DYNAMIC_NAMES):
            every.append(True)
            for name, values in list(deferred.items()):  # (code stays taken by name)
                deferred[name] = [value for value in values if _is_code(value)]
                for value in values:
                    if not _is_code(value):
                        visit(value)
        new = sorted(used - names)
        names.update(new)
        for name in new:
            for owner in list(owners.values()):
                method(owner, name)
            for value in deferred.pop(name, ()):
                visit(value)

    def visit(obj) -> None:
        if isinstance(obj, numpy_values):
            _numpy_read(mod, obj)
        if isinstance(obj, (torch.Tensor, *_UNCHANGING)) or id(obj) in seen:
            return
        if len(seen) >= MAX_RUN_VISITS:
            _too_much(mod, f"{MAX_RUN_VISITS} objects")
        seen.add(id(obj))
        if isinstance(obj, _WEAK_REFERENCES):
            objects.append(UNFOLLOWED)
            return
        queue.append(obj)
        if isinstance(obj, types.FunctionType):
            if library_function(obj):
                return  # (its closure's values are walked: _children)
            if len(functions) >= MAX_RUN_FUNCTIONS:
                _too_much(mod, f"{MAX_RUN_FUNCTIONS} functions")
            functions.append(obj)
            _refuse_imports(mod, obj)
            take(code_names(obj.__code__))
            return
        objects.append(obj)
        if isinstance(obj, torch.nn.Module):  # calling it runs its hooks
            take(_MODULE_HOOKS)
        owner = obj if isinstance(obj, (type, types.ModuleType)) else type(obj)
        module = owner.__name__ if isinstance(owner, types.ModuleType) else owner.__module__
        if is_library_name(module or "") or id(owner) in owners:
            return
        owners[id(owner)] = owner
        # (the special methods Python runs unnamed: cfg["c"], helper(x), float(obj)...)
        implicit = implicit_methods(owner, owner is obj) if isinstance(owner, type) else ()
        for name in (*sorted(names), *_LOOKUP_HOOKS, *sorted(implicit)):
            method(owner, name)
        if owner is not obj and isinstance(owner, type):
            visit(owner)  # its class's attributes too (self.table, a class attribute)

    visit(mod)
    if not isinstance(mod, (types.FunctionType, types.MethodType, functools.partial)):
        for name in ("__call__", "forward"):  # a callable object runs these unnamed
            method(type(mod), name)
    while queue:
        obj = queue.popleft()
        taken = _taken(obj)
        # (a library module's own weak references, nn.LSTM's _flat_weight_refs, held in its
        # containers: not the mod's reads)
        library = id(obj) in owned or (isinstance(obj, torch.nn.Module)
                                       and is_library_name(type(obj).__module__))
        for (kind, arg), child in _children(obj, reads=True):
            if library and isinstance(child, _WEAK_REFERENCES):
                continue
            if library and isinstance(child, (list, tuple, dict)):
                owned.add(id(child))
            if kind == "attr" and arg not in names and arg not in taken and \
                    (not every or _is_code(child)):
                deferred[arg].append(child)  # taken if some code uses the name
            else:
                visit(child)
    return functions, EVERY_NAME if every else frozenset(names), objects


# the attributes an nn.Module's call reads its hooks from
_MODULE_HOOKS = frozenset({"_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                           "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"})


def _refuse_imports(mod, function) -> None:
    """Refuse a function reached from ``mod`` that imports a user module (not a library's or
    the standard library's) in its body: no path
    from the mod reaches that module's values for torch.compile's guards (a float it holds
    ran the old value from its second change on, silently)."""
    for name, level in code_imports(function.__code__):
        top = name.partition(".")[0]
        if level != 0 or not (is_library_name(name) or top in sys.stdlib_module_names):
            raise InputError(
                f"the mod {mod_name(mod)!r} runs {function.__name__!r}, which imports {name!r} "
                "in its body: under torch.compile flexfa cannot follow what it reads there; "
                "import it at module level (a global the mod reads)")


def _refuse_unfollowed(traced, run: tuple) -> None:
    """Refuse a mod reaching a weak reference (``weakref.ref``, ``weakref.proxy``): flexfa
    cannot follow its object for torch.compile's guards (a float read through one ran the
    old value from its second change on, silently)."""
    if traced is not None and any(obj is UNFOLLOWED for obj in run[2]):
        raise InputError(
            f"the {traced.kind} {traced.name!r} reads through a weak reference (weakref.ref or "
            "weakref.proxy), whose object flexfa cannot follow under torch.compile; read the "
            "object itself (a closure, a global, a module attribute)")


def _is_code(value) -> bool:
    """A function or method wrapper: what a class holds to be called by its name (taken by
    name even where other attributes are taken whole: a class's unused methods stay out)."""
    return isinstance(value, (types.FunctionType, staticmethod, classmethod, property))


def _numpy_read(mod, value):
    """Refuse a mod reading a NumPy array or scalar under torch.compile: Dynamo passes it to
    the graph as an input without guarding its value, while the mod's trace holds the value
    as a constant, so a changed one (``W[0] = 9``, or a global ``np.int64`` rebound) was run
    stale."""
    raise InputError(
        f"the mod {mod_name(mod)!r} reads a NumPy {type(value).__name__} ({value!r:.40}): "
        "torch.compile does not guard NumPy values, so flexfa could not see it change; use "
        "a Python number (float(x), int(x)) or a tensor, or call flexfa.flex_attention "
        "outside torch.compile")


def _too_much(mod, what: str):
    raise InputError(
        f"the mod {mod_name(mod)!r} reaches more than {what} through its code, closures, "
        "globals and attributes: under torch.compile flexfa checks that none of what it reads "
        "changed unseen (class attributes, values the compiled function assigned before the "
        "call), and cannot check past that; give the mod only what it needs (a closure over "
        "the few values it reads), or call flexfa.flex_attention outside torch.compile")


def _children(obj, reads: bool = False):
    """(step, value) pairs of what a path may go through from ``obj``; with ``reads`` (the
    walk of what a mod may read, ``functions_run``) also an object's attributes that hold
    dicts, its ``__slots__`` attributes and a user class's attributes."""
    if isinstance(obj, types.MethodType):
        return [(("attr", "__self__"), obj.__self__), (("attr", "__func__"), obj.__func__)]
    if isinstance(obj, functools.partial):
        return [(("attr", "func"), obj.func), (("attr", "args"), obj.args),
                (("attr", "keywords"), obj.keywords)]
    if isinstance(obj, types.FunctionType):
        cells = [(("cell", n), c.cell_contents)
                 for n, c in zip(obj.__code__.co_freevars, obj.__closure__ or ()) if filled(c)]
        if library_function(obj):  # (torch's and_masks: the user's masks in its closure)
            return cells
        names = [(("global", n), obj.__globals__[n])
                 for n in sorted(global_names(obj.__code__)) if n in obj.__globals__]
        defaults = [(("attr", n), getattr(obj, n)) for n in ("__defaults__", "__kwdefaults__")
                    if getattr(obj, n)]  # (``def mod(..., cfg=CFG)``)
        return cells + names + defaults
    if isinstance(obj, (tuple, list, collections.deque)):
        return [(("item", i), v) for i, v in enumerate(obj)]
    if isinstance(obj, (dict, types.MappingProxyType)):
        return [(("item", k), v) for k, v in obj.items() if _constant_key(k)]
    if isinstance(obj, types.ModuleType):  # a user module's tensors (config.TABLE)
        return [] if is_library_name(obj.__name__) else [
            (("attr", n), v) for n, v in vars(obj).items() if isinstance(v, torch.Tensor)]
    if isinstance(obj, type):  # with ``reads``: a user class's attributes (Config.table[...])
        return _class_children(obj) if reads else []
    if is_library_name(type(obj).__module__ or "") and not isinstance(obj, torch.nn.Module):
        if reads and type(obj).__module__ == "collections":  # a ChainMap's maps, a UserDict's
            return [(("attr", n), v) for n, v in getattr(obj, "__dict__", {}).items()]
        return []
    namespace = getattr(obj, "__dict__", None) or {}
    children = [(("attr", n), v) for n, v in namespace.items() if not n.startswith("__")
                and v is not None and (reads or not isinstance(v, dict))]
    if reads:
        children += _slot_children(obj)
    if isinstance(obj, torch.nn.Module):
        for table in ("_parameters", "_buffers", "_modules"):
            children += [(("attr", n), v) for n, v in namespace.get(table, {}).items()
                         if v is not None]
    return children


def _constant_key(key) -> bool:
    """Whether a dict key is one a path may name (Dynamo looks it up as a constant): a str,
    number, bool, None, bytes, enum member, or a tuple of them."""
    if isinstance(key, tuple):
        return all(_constant_key(k) for k in key)
    return isinstance(key, (str, int, float, bytes, enum.Enum, type(None))) and key == key


def _taken(obj):
    """The names of ``obj``'s attributes the walks take whatever names the code uses: every
    one of a function (its defaults), a bound method, a partial, an enum member and
    ``collections``' own containers (a ChainMap's maps); a library container's items, read
    by its own ``__getitem__`` (a UserDict's or UserList's ``data``, a container module's
    modules and parameters, a user subclass's too: ``cfg["c"]``, ``layers[0].c``)."""
    if isinstance(obj, (types.FunctionType, types.MethodType, functools.partial, enum.Enum)) \
            or type(obj).__module__ == "collections":
        return EVERY_NAME
    if isinstance(obj, LIBRARY_CONTAINERS):
        if isinstance(obj, torch.nn.Module):
            return frozenset(obj._modules).union(obj._parameters)
        return frozenset({"data"})
    return frozenset()


def _user_classes(cls: type):
    """The classes of ``cls``'s method resolution order that are not a library's."""
    return (klass for klass in cls.__mro__ if not is_library_name(klass.__module__ or ""))


def _class_children(cls: type) -> list:
    """(step, value) of the attributes a user class holds or inherits from a user class (the
    first definition along the method resolution order), none of a library's class."""
    children, taken = [], set()
    for klass in _user_classes(cls):
        for name, value in vars(klass).items():
            if not name.startswith("__") and value is not None and name not in taken:
                taken.add(name)
                children.append((("attr", name), value))
    return children


def _slot_children(obj) -> list:
    """(step, value) of ``obj``'s ``__slots__`` attributes that are set (a user class's)."""
    children = []
    for klass in _user_classes(type(obj)):
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if not name.startswith("__"):
                value = getattr(obj, name, None)
                if value is not None:
                    children.append((("attr", name), value))
    return children


def _add_cell_readers(mod, path: tuple) -> None:
    """Give each function on ``path`` whose cell it goes through a reader of that cell (a
    function closing over the same cell: the cell's live contents, never a copy)."""
    obj = mod
    for kind, arg in path:
        if kind == "cell":
            readers = obj.__dict__.setdefault(CELL_READERS, {})
            if arg not in readers:
                cell = obj.__closure__[obj.__code__.co_freevars.index(arg)]
                readers[arg] = types.FunctionType(_reader_code(arg), globals(), f"read_{arg}",
                                                  None, (cell,))
        elif kind == "global":
            readers = obj.__dict__.setdefault(GLOBAL_READERS, {})
            if arg not in readers:
                readers[arg] = types.FunctionType(_global_reader_code(arg), obj.__globals__,
                                                  f"read_{arg}")
        obj = _step(obj, kind, arg)


@functools.lru_cache(maxsize=256)
def _global_reader_code(name: str) -> types.CodeType:
    """The code of ``lambda: name`` with ``name`` a global."""
    return compile(f"lambda: {name}", "<flexfa global reader>", "eval").co_consts[0]


@functools.lru_cache(maxsize=256)
def _reader_code(name: str) -> types.CodeType:
    """The code of ``lambda: name`` with ``name`` a free variable."""
    namespace: dict = {}
    exec(f"def outer():\n    {name} = None\n    return lambda: {name}\n", namespace)
    code = namespace["outer"]().__code__
    assert code.co_freevars == (name,), code.co_freevars
    return code


def _step(obj, kind: str, arg):
    """One path step in plain Python (the search's side; ``follow`` is Dynamo's)."""
    if kind == "attr":
        return getattr(obj, arg)
    if kind == "item":
        return obj[arg]
    if kind == "cell":
        return obj.__closure__[obj.__code__.co_freevars.index(arg)].cell_contents
    return obj.__globals__[arg]


def follow(obj, path: tuple, cells: tuple = ()):
    """The object at ``path`` from ``obj`` (traced by Dynamo: each step is guarded); a path
    of a mod made inside the compiled function starts at one of ``cells`` (``Inside``)."""
    for kind, arg in path:
        if kind == SLOT:
            obj = cells[arg]
        elif kind == "attr":
            obj = getattr(obj, arg)
        elif kind == "item":
            obj = obj[arg]
        else:
            try:  # Dynamo has neither for a function defined inside the compiled function
                found = getattr(obj, CELL_READERS if kind == "cell" else GLOBAL_READERS)
            except AttributeError:
                raise InputError(
                    f"a mod defined inside the compiled function reads {arg!r} through its "
                    f"{'closure' if kind == 'cell' else 'globals'}, which torch.compile does not "
                    "let flexfa follow there; define the mod outside the compiled function (a "
                    "module-level function, a factory's closure, a module's method)") from None
            obj = found[arg]()
    return obj


def pin_sizes(mod, sized: tuple, cells: tuple = ()) -> None:
    """Guard the sizes of the captured tensors whose sizes the trace of ``mod`` read, and the
    Python numbers it may read (``number_paths``: a number's entry holds it where a tensor's
    holds a shape), traced by Dynamo: comparing a dynamic size or int specializes it, so that
    under dynamic shapes another size or value compiles again, tracing the mod again, instead
    of running an IR that holds the old one as a constant."""
    for path, shape in sized:
        if not isinstance(shape, tuple):
            if follow(mod, path, cells) != shape:
                raise AssertionError(f"a number the mod reads is not {shape!r}, the value it "
                                     "was traced with")  # the graph is traced for this one
            continue
        tensor = follow(mod, path, cells)
        # (size by size: torch 2.11's Dynamo fails on != of a shape tuple and a constant one)
        if tensor.dim() != len(shape) or any(tensor.shape[d] != n for d, n in enumerate(shape)):
            raise AssertionError(f"captured tensor of shape {dims(tensor)}, traced with "
                                 f"{shape}")  # the graph is traced for this shape only


def _guard_mod(mod, kind: str, device: torch.device) -> None:
    """Call ``mod`` on one-element tensors on ``device`` (zero-dim integer indices would be
    read as Python ints; another device than the captured tensors' fails in fake-tensor
    propagation) so that Dynamo guards on what it reads; the result is dead code."""
    if mod is None or isinstance(mod, TracedMaskMod):
        return
    index = torch.zeros(1, dtype=torch.int64, device=device)
    if kind == SCORE_MOD:
        mod(torch.zeros(1, device=device), index, index, index, index)
    else:
        mod(index, index, index, index)


@_raised_as_eagerly
def attention(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
              kernel_options, return_aux, sinks=None, dropout_p=0.0, dropout_seed=None) -> tuple:
    """(out, lse, max scores or None, whether return_aux asks for lse) of ``flex_attention``
    as torch.compile captures it: one ``flexfa::flex_attention`` operator (its autograd
    formula runs the backward operator). The sinks are an operator input (so they get their
    gradient); dropout's seed tensor is drawn here, in the graph, from torch's generator
    (``prepare_dropout``), so the operator stays functional and the backward reuses it.
    Checks the arguments as the eager call does, before anything reads them; an error
    reaches the caller as eager flexfa's (``_raised_as_eagerly``)."""
    query, key, value = autocast_inputs(query, key, value)
    check_tensors(query, key, value)
    enable_gqa = check_bool("enable_gqa", enable_gqa)  # (a SymBool: specialized there)
    return_lse = check_bool("return_lse", return_lse)
    aux_lse, aux_max = check_aux(return_aux, return_lse)
    check_shapes(query, key, value, enable_gqa)
    scale = _checked_scale_and_mod(scale, score_mod, query.shape[3])
    sinks = check_sinks(sinks, query.shape[1], query.dtype, query.device)
    dropout = prepare_dropout(dropout_p, dropout_seed, query.device)
    dropout_p, seed = (0.0, None) if dropout is None else (dropout.p, dropout.seed)
    check_block_mask(block_mask, query, key)
    mods, score_buffers, mask_buffers, tables, block = _operator_mods(
        score_mod, block_mask, enable_gqa, kernel_options, query.device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in mask_buffers):
        # as eager flexfa: the backward operator gives a mask's captured tensors no gradient
        raise mask_mod_grad_error(mod_name(block_mask.mask_mod), mask_buffers)
    key, value = broadcast_batch(query, key, value)
    out, lse, maxs = torch.ops.flexfa.flex_attention(
        query, key, value, mods, scale, aux_max, score_buffers, mask_buffers, tables, block,
        sinks, dropout_p, seed)
    return out, lse, (maxs if aux_max else None), aux_lse


@in_graph("flex_decode")
@_raised_as_eagerly
def flex_decode(query, key, value, score_mod=None, block_mask=None, scale=None, *, kv_lens=None,
                q_offsets=None, page_table=None, return_lse=False, kernel_options=None,
                workspace=None, validate=True, sinks=None):
    """``flex_decode`` as torch.compile captures it: one ``flexfa::flex_decode`` operator
    (inference only). ``kv_lens``, ``q_offsets`` and the page table are operator inputs, so
    new contents need no recompile; the output comes from the graph's allocator (under CUDA
    graphs, their pool), not from a ``DecodeWorkspace``."""
    query, key, value = autocast_inputs(query, key, value)
    check_tensors(query, key, value)  # (the checks the operator's schema would fail on
    # first, inside Dynamo; shapes and values: the operator's, which raise flexfa's errors)
    return_lse, validate = check_bool("return_lse", return_lse), check_bool("validate", validate)
    _checked_scale_and_mod(scale, score_mod, query.shape[3])
    if block_mask is not None:
        check_block_mask_type(block_mask)
    for name, tensor in (("kv_lens", kv_lens), ("q_offsets", q_offsets),
                         ("page_table", page_table), ("sinks", sinks)):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise InputTypeError(f"{name} must be a torch.Tensor or None, got "
                                 f"{type(tensor).__name__}")
    if workspace is not None:
        raise InputError("flex_decode: workspace is not supported inside torch.compile (the "
                         "compiled graph allocates the output, from the CUDA graph's pool "
                         "with mode='reduce-overhead'); pass workspace=None")
    mods, score_buffers, mask_buffers, tables, block = _operator_mods(
        score_mod, block_mask, True, kernel_options, query.device)
    check_decode_no_grad(query, key, value, sinks, score_buffers, mask_buffers)
    lengths = [] if block_mask is None else list(block_mask.seq_lengths)
    out, lse = torch.ops.flexfa.flex_decode(
        query, key, value, mods, scale, score_buffers, mask_buffers, tables, block, lengths,
        kv_lens, q_offsets, page_table, sinks, validate)
    return (out, lse) if return_lse else out


def _operator_mods(score_mod, block_mask, enable_gqa: bool, kernel_options, device) -> tuple:
    """(mods key, the score_mod's captured tensors, the mask_mod's, the block mask's tables,
    its block size) as the operators take them."""
    mask_mod = None if block_mask is None else block_mask.mask_mod
    if isinstance(kernel_options, dict):
        # every item read here, so that Dynamo guards on the keys too (as ``describe``'s
        # argument the dict had guards on its values only: a key added to it, or a dict
        # passed in with one more key, ran the options compiled first), and ints specialized
        # (an int that changed between calls becomes symbolic, which ``describe`` cannot take)
        # (bools by a branch, as check_bool: bool() would keep a SymBool symbolic)
        # (an int subclass, an IntEnum, as its int: operator.index of one recursed in Dynamo)
        kernel_options = {name: (True if value else False) if isinstance(value, bool) else
                          operator.index(value) if type(value) is int else
                          int(value) if isinstance(value, int) else
                          _plain_option(name, value) for name, value in kernel_options.items()}
    score_cells = mask_cells = ()  # (set by describe for mods made inside: made_inside.py)
    score_parts = ((None, MADE_INSIDE, ("score_mod", "score_cells"))
                   if made_inside("score_mod") else unbound(score_mod))
    mask_parts = ((None, MADE_INSIDE, ("mask_mod", "mask_cells"))
                  if made_inside("mask_mod") else unbound(mask_mod))
    mods, score_paths, mask_paths, score_sized, mask_sized = describe(
        *score_parts, *mask_parts, enable_gqa, kernel_options)
    _guard_mod(score_mod, SCORE_MOD, device)
    _guard_mod(mask_mod, MASK_MOD, device)
    pin_sizes(score_mod, score_sized, score_cells)
    pin_sizes(mask_mod, mask_sized, mask_cells)
    score_buffers = [follow(score_mod, p, score_cells) for p in score_paths]
    mask_buffers = [follow(mask_mod, p, mask_cells) for p in mask_paths]
    tables, block = [], []
    if block_mask is not None:
        tables = [getattr(block_mask, n) for n in TABLES]
        block = list(block_mask.BLOCK_SIZE)
    return mods, score_buffers, mask_buffers, tables, block


def tables_of(tables: list, separate_full_blocks: bool) -> list:
    """The eight BlockMask tables from ``block_mask_tables``' list (None for the full ones
    when ``separate_full_blocks`` is False)."""
    if separate_full_blocks:
        return list(tables)
    kv, kv_i, q, q_i = tables
    return [kv, kv_i, None, None, q, q_i, None, None]


@in_graph("create_block_mask")
@_raised_as_eagerly
def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128,
                      _compile=False, separate_full_blocks=True, compute_dq_write_order=False,
                      dq_kv_order=True) -> BlockMask:
    """``flexfa.create_block_mask`` as torch.compile captures it: the tables come from one
    ``flexfa::block_mask_tables`` operator (its sizes may be symbolic under dynamic shapes)."""
    func = "create_block_mask"
    if compute_dq_write_order:
        raise InputError(f"{func}: compute_dq_write_order=True is not supported inside "
                         "torch.compile; build such a mask outside the compiled function")
    block = block_size_pair(func, BLOCK_SIZE)
    B, H = batch_size(func, "B", B), batch_size(func, "H", H)
    device = default_device() if device is None else torch.device(device)
    mask_cells = ()  # (set by describe for a mask_mod made inside: made_inside.py)
    mask_parts = ((None, MADE_INSIDE, ("mask_mod", "mask_cells"))
                  if made_inside("mask_mod") else unbound(mask_mod))
    mods, _, mask_paths, _, mask_sized = describe(*unbound(None), *mask_parts, False, None)
    _guard_mod(mask_mod, MASK_MOD, device)
    pin_sizes(mask_mod, mask_sized, mask_cells)
    mask_buffers = [follow(mask_mod, p, mask_cells) for p in mask_paths]
    tables = torch.ops.flexfa.block_mask_tables(mods, B, H, Q_LEN, KV_LEN, list(block),
                                                bool(separate_full_blocks), mask_buffers, device)
    return BlockMask.from_graph((Q_LEN, KV_LEN), tables_of(tables, separate_full_blocks), block,
                                mask_mod)
