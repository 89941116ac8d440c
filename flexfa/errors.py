"""flexfa's exception types.

Every error flexfa raises on bad input subclasses one of the builtin types a caller would
catch (ValueError, TypeError, NotImplementedError), so ``except ValueError`` keeps working.
"""


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


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool, else an InputTypeError naming ``name`` and the value (no
    truthiness: 1, "no" or None are refused)."""
    if not isinstance(value, bool):
        raise InputTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value
