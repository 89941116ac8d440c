"""Mods defined inside a function that ``torch.compile`` traces.

Dynamo runs a compiled function's code symbolically: a ``def`` inside it (or a closure that
a factory such as ``flexfa.mods.alibi`` returns when called there) has no Python function
object, only Dynamo's stand-in, whose closure cells hold Dynamo's values (a tensor of the
graph, a module of the frame). ``describe`` cannot be handed such a function as a constant
(Dynamo stops with ``ClosureConversionError``), and traced code cannot read its
``__closure__``. So these mods take another route, at trace time, through the translator
running the caller's frame (``_caller_tx``):

- ``made_inside(name)``: whether the caller's local ``name`` is such a function, or a
  ``functools.partial`` (any: torch 2.11's ``id()`` of one is a stand-in's), or a callable
  object made there (refused: it has no state Dynamo can give at trace time);
- ``Inside(name, cells_name)``: rebuilds it as a real function from its code, its globals and
  its cells' real values (a captured tensor's real value, the module a method reads, a nested
  helper rebuilt in turn), which flexfa's tracer traces as any other mod; the path to each
  captured tensor starts at the Dynamo value of the cell (or global) it goes through, which
  ``export`` puts in the caller's local ``cells_name`` (a tuple) for ``compiled.follow``: so the
  operator takes the graph's own tensors, read afresh on every run.

Dynamo's translator, values and side effects are internals of torch; what is used here is
the same on torch 2.11 and 2.13 (``tests/compile/test_compile_made_inside.py``). On a torch
where they differ, ``made_inside`` answers False (mods from outside work as before) and
``Inside`` raises an InputError that says so. Anything else in such a cell (an object made
inside the compiled function, a lambda over a generator) is refused with an InputError that
names the free variable.
"""
from __future__ import annotations

import functools
import sys
import types

from .errors import InputError

SLOT = "slot"  # path step: the n-th value ``export`` handed to the traced code
MADE_INSIDE = "made inside"  # describe's class argument for such a mod (its id: Inside's names)


def _caller_tx():
    """The translator that runs the traced frame calling the assume-constant function we
    are in (the nearest Python frame of Dynamo's with a translator as ``tx`` or ``self``), or
    None when no Dynamo frame is on the stack (the caller runs eagerly: after a graph break,
    or called directly)."""
    if "torch._dynamo.symbolic_convert" not in sys.modules:
        return None
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase
    frame = sys._getframe(2)
    while frame is not None:
        for name in ("tx", "self"):
            value = frame.f_locals.get(name)
            if isinstance(value, InstructionTranslatorBase):
                return value
        frame = frame.f_back
    return None


def _is_nested(value) -> bool:
    from torch._dynamo.variables import NestedUserFunctionVariable
    return isinstance(value, NestedUserFunctionVariable)


def _is_cell(value) -> bool:
    """Whether a traced frame's local is a cell (a variable a nested function or, before
    Python 3.12, a comprehension of the frame reads)."""
    from torch._dynamo.variables.misc import CellVariable
    return isinstance(value, CellVariable)


def _local(tx, name: str):
    """The Dynamo value of the traced frame's local ``name`` (through its cell if it is one)."""
    value = tx.symbolic_locals.get(name)
    return tx.output.side_effects.load_cell(value) if _is_cell(value) else value


def _is_made_inside(value) -> bool:
    """A function defined inside the compiled code, or any ``functools.partial``: one made
    there has no Python object, and torch 2.11's ``id()`` of one from outside is that of a
    stand-in (its bound values are guarded as Dynamo reads them here)."""
    from torch._dynamo.variables.functions import FunctoolsPartialVariable
    from torch._dynamo.variables.lazy import LazyVariableTracker
    if isinstance(value, LazyVariableTracker):
        value = value.realize()
    return (_is_nested(value) or isinstance(value, FunctoolsPartialVariable)
            or _is_new_object(value) or _is_new_object(_method_owner(value)))


def _method_owner(value):
    """The instance of a bound method's Dynamo value (None for anything else)."""
    from torch._dynamo.variables import UserMethodVariable
    return value.obj if isinstance(value, UserMethodVariable) else None


def _is_new_object(value) -> bool:
    """A callable object made inside the compiled code: no real state while Dynamo traces
    (torch 2.11's ``id()`` of one is that of an empty stand-in of its class)."""
    from torch._dynamo.variables import UserDefinedObjectVariable
    return isinstance(value, UserDefinedObjectVariable) and value.source is None


def made_inside(name: str) -> bool:
    """Whether the caller's local ``name`` holds a mod made inside the compiled code (runs at
    Dynamo's trace time; a constant in the graph)."""
    try:
        tx = _caller_tx()
        return tx is not None and _is_made_inside(_local(tx, name))
    except Exception:  # (another torch's Dynamo internals: the mod goes the usual way)
        return False


# what torch._dynamo.assume_constant_result sets, without importing Dynamo at import time
made_inside._dynamo_marked_constant = True


def pending_assignments() -> dict:
    """{id(object): (object, {name: Dynamo value} or None)} of what the compiled code changed
    so far in objects from outside it, which Dynamo applies only after the graph (the real
    objects hold the old values while flexfa traces a mod): attributes assigned
    (``self.window = 4`` in ``forward``, ``Config.window = 4`` of a class), globals assigned
    (``global W; W = 4``, or ``module.W = 4``: under the module's globals dict, their names),
    a closure cell assigned (``nonlocal w``: under the cell, name ``cell_contents``), and
    containers changed in place (``cfg["w"] = 9``, ``lst.append(x)``, a dict subclass's
    items: None, any item). Empty outside Dynamo's tracing; where its internals differ, empty
    with a RuntimeWarning (once)."""
    try:
        tx = _caller_tx()
        if tx is None:
            return {}
        return _pending(tx)
    except Exception as error:  # (another torch's Dynamo internals: nothing known)
        _warn_unchecked(f"{type(error).__name__}: {error}")
        return {}


_WARNED = []  # [True] once _warn_unchecked has warned


def _warn_unchecked(why: str) -> None:
    """Say once a process that the pending changes could not be read (not silently)."""
    import warnings
    if _WARNED:
        return
    _WARNED.append(True)
    warnings.warn(f"flexfa could not read what this torch's Dynamo applies after the graph "
                  f"({why}): a value the compiled function assigns before a flexfa call, "
                  "which a mod reads, is not refused and the mod's trace sees the old one; "
                  "assign such values outside the compiled function", RuntimeWarning,
                  stacklevel=3)


def _pending(tx) -> dict:
    from torch._dynamo import variables
    from torch._dynamo.variables import (NNModuleVariable, UserDefinedClassVariable,
                                         UserDefinedObjectVariable)
    from torch._dynamo.variables.misc import CellVariable

    # (each a class of torch 2.11's and 2.13's Dynamo; an absent one matches nothing)
    NewGlobalVariable = getattr(variables.misc, "NewGlobalVariable", ())
    PythonModuleVariable = getattr(variables, "PythonModuleVariable", ())
    side_effects = tx.output.side_effects
    pending = {}

    def add(obj, assigned) -> None:
        old = pending.get(id(obj), (obj, {}))[1]
        pending[id(obj)] = (obj, None if assigned is None or old is None
                            else {**old, **assigned})

    for value, assigned in side_effects.store_attr_mutations.items():
        if not assigned:
            continue
        if isinstance(value, NNModuleVariable):
            add(tx.output.get_submodule(value.module_key), dict(assigned))
        elif isinstance(value, NewGlobalVariable):  # the root frame's globals
            add(tx.output.global_scope, dict(assigned))
        elif isinstance(value, PythonModuleVariable):  # (read as module.W or as a global)
            add(value.value, dict(assigned))
            add(vars(value.value), dict(assigned))
        elif isinstance(value, (UserDefinedObjectVariable, UserDefinedClassVariable)) \
                and value.source is not None:  # an object's or a class's (Config.window = 9)
            add(value.value, dict(assigned))
    alive = {id(obj): obj for obj in side_effects.keepalive}  # the tracked real objects
    for key, value in side_effects.id_to_variable.items():
        obj = alive.get(key)
        kind = type(value.mutation_type).__name__
        if obj is None or kind not in ("AttributeMutationExisting", "ValueMutationExisting"):
            continue  # (made inside the compiled code: rebuilt from Dynamo's values)
        assigned = side_effects.store_attr_mutations.get(value)
        if isinstance(value, CellVariable) and assigned:
            add(obj, dict(assigned))
        elif kind == "ValueMutationExisting" and side_effects.is_modified(value):
            add(obj, None)
        elif isinstance(value, UserDefinedObjectVariable):  # a dict or list subclass's items
            modified = getattr(value, "is_base_vt_modified", None)  # (not in torch 2.11)
            if modified is not None and modified(side_effects):
                add(obj, None)
    return pending


def _flattened(partial):
    """A partial's Dynamo value with a partial as its function merged into one, as
    ``functools.partial`` merges them (its args first, keywords updated by the outer's), so
    that the rebuilt partial's ``args`` and ``keywords`` line up with the value's."""
    from torch._dynamo.variables.functions import FunctoolsPartialVariable
    while isinstance(partial.func.realize(), FunctoolsPartialVariable):
        inner = partial.func.realize()
        partial = FunctoolsPartialVariable(inner.func, [*inner.args, *partial.args],
                                           {**inner.keywords, **partial.keywords})
    return partial


class Inside:
    """A mod made inside the compiled function, rebuilt for flexfa's tracer (see the module
    docstring). ``function`` is the real mod; ``rewrite`` turns a path from it into one from
    the values ``export`` hands to the traced code."""

    def __init__(self, name: str, cells_name: str):
        try:
            self._rebuild(name, cells_name)
        except InputError:
            raise
        except Exception as error:  # (another torch's Dynamo internals)
            raise InputError(f"flexfa could not rebuild the mod made inside the compiled "
                             f"function with this torch's Dynamo ({type(error).__name__}: "
                             f"{error}); define it outside the compiled function") from None

    def _rebuild(self, name: str, cells_name: str) -> None:
        self.tx = _caller_tx()
        self.cells_name = cells_name
        self.slots: list = []  # Dynamo values the rewritten paths start at
        # id(an object rebuilt here: function, partial, list, tuple, a partial's keywords):
        # (the object, kept alive while its id is a key; its Dynamo value)
        self.rebuilt: dict[int, tuple] = {}
        self.globals: dict[str, object] = {}  # global name: its Dynamo value
        value = _local(self.tx, name).realize()
        owner = _method_owner(value)
        if _is_new_object(owner) or _is_new_object(value):
            value = owner if _is_new_object(owner) else value
            raise InputError(f"a mod of type {value.python_type().__qualname__} made inside "
                             "the compiled function has no Python object while torch.compile "
                             "traces it; make it outside (an argument, a global, a module "
                             "attribute)")
        self.function = self._real(name, value)

    def _keep(self, obj, value):
        self.rebuilt[id(obj)] = (obj, value)
        return obj

    def _function(self, value) -> types.FunctionType:
        code = value.code.as_python_constant()
        cells = tuple(types.CellType(self._real(code.co_freevars[i], self._cell(cell)))
                      for i, cell in enumerate(value.closure.items if value.closure else ()))
        function = types.FunctionType(code, value.f_globals, code.co_name, None, cells or None)
        function.__qualname__ = getattr(code, "co_qualname", code.co_name)
        if value.defaults is not None:  # (each as a cell's value: a symbolic int specialized)
            items = getattr(value.defaults, "items", None)  # (a tuple's Dynamo value)
            function.__defaults__ = value.defaults.as_python_constant() if items is None else \
                tuple(self._real(f"{code.co_name}'s default argument", d) for d in items)
        if value.kwdefaults is not None:
            function.__kwdefaults__ = value.kwdefaults.as_python_constant()
        return self._keep(function, value)

    def _cell(self, cell):
        """The Dynamo value a closure cell holds now (its latest store replayed)."""
        return self.tx.output.side_effects.load_cell(cell)

    def _real(self, name: str, value):
        """The Python object behind a Dynamo value of a cell (``name`` for errors)."""
        from torch._dynamo.variables import (NNModuleVariable, SymNodeVariable,
                                             UserDefinedObjectVariable, UserFunctionVariable)
        from torch._dynamo.variables.dicts import ConstDictVariable
        from torch._dynamo.variables.functions import FunctoolsPartialVariable
        from torch._dynamo.variables.lists import BaseListVariable
        value = value.realize()
        if _is_nested(value):
            return self._function(value)
        if isinstance(value, FunctoolsPartialVariable):
            value = _flattened(value)  # (as functools.partial flattens a partial of a partial)
            partial = functools.partial(self._real(name, value.func),
                                        *(self._real(name, a) for a in value.args),
                                        **{k: self._real(name, v) for k, v in value.keywords.items()})
            self._keep(partial.keywords, value.keywords)
            self._keep(partial.args, value.args)
            return self._keep(partial, value)
        if value.is_tensor():
            return value.get_real_value()
        if isinstance(value, SymNodeVariable):  # a number Dynamo made symbolic: specialized
            return value.evaluate_expr(self.tx.output)  # (guarded), as the trace's constant
        if isinstance(value, NNModuleVariable):
            return self.tx.output.get_submodule(value.module_key)
        if isinstance(value, UserDefinedObjectVariable) and value.source is not None:
            return value.value  # (one made inside the compiled function has no real state)
        if isinstance(value, UserFunctionVariable):
            return value.fn
        if isinstance(value, BaseListVariable) and value.python_type() in (list, tuple):
            items = value.python_type()(self._real(name, item) for item in value.items)
            return self._keep(items, value.items)
        if isinstance(value, ConstDictVariable) and value.python_type() is dict:
            values = value.keys_as_python_constant()  # {key: Dynamo value} (keys guarded)
            return self._keep({key: self._real(name, item) for key, item in values.items()},
                              values)
        try:
            return value.as_python_constant()
        except Exception:  # any value Dynamo cannot give as a Python object
            raise InputError(
                f"a mod defined inside the compiled function closes over {name!r} (Dynamo's "
                f"{type(value).__name__}), which flexfa cannot follow there; capture tensors, "
                "numbers, modules and functions, or define the mod outside the compiled "
                "function") from None

    def _step(self, obj, kind: str, arg):
        """(object, Dynamo value) one path step from a rebuilt ``obj``, or None where the
        traced code takes the step itself (``compiled.follow``)."""
        if id(obj) not in self.rebuilt:
            return None
        value = self.rebuilt[id(obj)][1]
        if isinstance(obj, types.FunctionType) and kind == "cell":
            index = obj.__code__.co_freevars.index(arg)
            return obj.__closure__[index].cell_contents, self._cell(value.closure.items[index])
        if isinstance(obj, types.FunctionType) and kind == "global":
            if arg not in self.globals:
                self.globals[arg] = self._global(value, arg)
            return obj.__globals__[arg], self.globals[arg]
        if isinstance(obj, functools.partial) and kind == "attr":
            return getattr(obj, arg), {"func": value.func, "args": value.args,
                                       "keywords": value.keywords}[arg]
        if isinstance(obj, (list, tuple, dict)) and kind == "item":
            return obj[arg], value[arg]
        return None

    def rewrite(self, path: tuple) -> tuple:
        """``path`` (from ``function``, as ``compiled._find_paths`` gives it) from the Dynamo
        value of the first step that leaves the rebuilt objects: ``(("slot", n), *rest)``."""
        from torch._dynamo.variables.base import VariableTracker
        obj, value, taken = self.function, self.rebuilt[id(self.function)][1], 0
        for kind, arg in path:
            step = self._step(obj, kind, arg)
            if step is None:
                break
            (obj, value), taken = step, taken + 1
        if isinstance(value, VariableTracker):
            value = value.realize()
        else:  # (a rebuilt container's items: every path steps past it to a tensor)
            raise InputError(f"flexfa: a captured tensor's path {path} of a mod made inside "
                             "the compiled function ends in a container")
        slot = next((n for n, v in enumerate(self.slots) if v is value), None)
        if slot is None:
            slot = len(self.slots)
            self.slots.append(value)
        return ((SLOT, slot), *path[taken:])

    def _global(self, function_value, name: str):
        """The Dynamo value of the global ``name`` of a rebuilt function (guarded and lifted
        as Dynamo does for the frame's own globals)."""
        from torch._dynamo.source import GlobalSource
        from torch._dynamo.variables.builder import VariableBuilder
        root = self.tx.output.root_tx
        if function_value.f_globals is not root.f_globals:
            raise InputError(
                f"a mod defined inside the compiled function reads the global {name!r} of "
                "another module than the compiled function's, which flexfa cannot follow "
                "there; capture it in a closure or define the mod outside the compiled function")
        if name in root.symbolic_globals:  # assigned in the compiled code: its new value
            variable = root.output.side_effects[root.symbolic_globals[name]]
            return root.output.side_effects.load_global(variable, name)
        return VariableBuilder(self.tx, GlobalSource(name))(function_value.f_globals[name])

    def export(self) -> None:
        """Hand the slots' Dynamo values to the traced caller, as its local ``cells_name``."""
        from torch._dynamo.variables import TupleVariable
        cells = TupleVariable(list(self.slots))
        local = self.tx.symbolic_locals.get(self.cells_name)
        if _is_cell(local):
            self.tx.output.side_effects.store_cell(local, cells)
        else:
            self.tx.symbolic_locals[self.cells_name] = cells
