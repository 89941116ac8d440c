"""flexfa's exception types.

Every error flexfa raises on bad input subclasses one of the builtin types a caller would
catch (ValueError, TypeError, NotImplementedError), so ``except ValueError`` keeps working.
"""
import numbers
import sys


class FlexFAError(Exception):
    """Base class of every flexfa error."""


class TraceError(FlexFAError, TypeError):
    """A mod could not be traced: unsupported construct, control flow on a traced value, ..."""


class UnsupportedOpError(TraceError, NotImplementedError):
    """A mod called a torch function or operator flexfa cannot trace or render."""


class CodegenError(FlexFAError, RuntimeError):
    """A generated kernel source that Python could not compile or import (a flexfa bug or
    limit): the message names the mods and the generated file."""


class InputError(FlexFAError, ValueError):
    """Bad arguments to a public function (shapes, lengths, block sizes, options)."""


class InputTypeError(FlexFAError, TypeError):
    """Arguments of the wrong type to a public function."""


def check_int(func: str, name: str, value, minimum: int | None = 1) -> int:
    """``value`` as an int if it is one (not a bool) of at least ``minimum`` (None: any),
    else an InputTypeError / InputError naming ``func``, ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"{func}: {name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise InputError(f"{func}: {name} must be >= {minimum}, got {value}")
    return int(value)


def is_bool(value) -> bool:
    """True for a Python bool or a numpy bool (``np.bool_``, what indexing a numpy bool array
    gives; it is no int, so no int option takes it either). numpy is looked up, not imported:
    it is no dependency of flexfa, and a numpy bool exists only where numpy was imported."""
    if type(value) is bool:
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.bool_)


def check_bool(name: str, value) -> bool:
    """``value`` as a Python bool if it is a bool (numpy's too), else an InputTypeError naming
    ``name`` and the value (no truthiness: 1, "no" or None are refused)."""
    if type(value) is bool:  # the common case first: checked on every flex_attention call
        # (a branch, not ``value``: under torch.compile a bool computed from symbolic shapes
        # is a SymBool, which Dynamo reports as a bool; the branch guards on its value)
        return True if value else False
    if not is_bool(value):
        raise InputTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def shown(values, limit: int = 12) -> str:
    """A tensor's or array's values for an error message: all of them, or the first ``limit``
    and the count."""
    values = values.tolist()
    return str(values) if len(values) <= limit else f"{values[:limit]}... ({len(values)} entries)"


def dims(tensor) -> str:
    """A tensor's shape for an error message, as ``tuple(tensor.shape)`` shows it. Under
    torch.compile with dynamic shapes its sizes are symbolic: Dynamo makes a constant string of
    each size formatted alone, but not of a tuple of them, and a message that is not a
    constant cannot reach the caller as flexfa's error (compiled.raise_through)."""
    sizes = [f"{size}" for size in tensor.shape]
    return "(" + ", ".join(sizes) + ("," if len(sizes) == 1 else "") + ")"
