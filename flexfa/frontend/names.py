"""What a mod's errors call things: the public names of torch functions (``torch.exp``,
``torch.Tensor.exp``, ``torch.nn.functional.relu``), the list of supported ones, and the
messages for functions that are not supported, in place or reductions.

``TORCH_FUNCTIONS`` is the registry of handlers (torch function or method -> a handler taking
the same arguments), filled by torch_functions.py.
"""
from __future__ import annotations

import functools

import torch

from ..errors import TraceError, UnsupportedOpError

TORCH_FUNCTIONS: dict = {}


@functools.lru_cache(maxsize=None)
def public_names() -> dict[int, str]:
    """id(function) -> the public name users write (torch.exp, torch.Tensor.exp, F.relu)."""
    names: dict[int, str] = {}
    spaces = (("torch.nn.functional", torch.nn.functional), ("torch.special", torch.special),
              ("torch.Tensor", torch.Tensor), ("torch", torch))
    for prefix, space in spaces:  # later spaces win: torch.erf over torch.special.erf
        for attr in dir(space):
            if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
                continue
            obj = getattr(space, attr, None)
            if callable(obj):
                names[id(obj)] = f"{prefix}.{attr}"
    return names


def func_name(func) -> str:
    """The name a user would write for ``func`` (torch._C internals print as torch.<name>)."""
    public = public_names().get(id(func))
    if public is not None:
        return public
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if module.startswith("torch") or name.startswith(("_VariableFunctionsClass.", "TensorBase.")):
        return "torch." + name.split(".")[-1]
    return f"{module}.{name}" if module else name


def supported_functions() -> list[str]:
    """Public names of the torch functions and tensor methods a mod may call."""
    names = {func_name(f) for f in TORCH_FUNCTIONS}
    names = {n for n in names if "__" not in n}
    # torch.Tensor.exp is listed as torch.exp; methods with no function form stay
    return sorted(n for n in names
                  if not (n.startswith("torch.Tensor.") and "torch." + n[13:] in names))


# torch functions that reduce over dimensions (by their last name): a mod has none
REDUCTIONS = frozenset({
    "sum", "nansum", "mean", "nanmean", "prod", "any", "all", "amax", "amin", "aminmax",
    "argmax", "argmin", "max", "min", "logsumexp", "softmax", "log_softmax", "softmin", "norm",
    "normalize", "std", "var", "std_mean", "var_mean", "median", "nanmedian", "mode",
    "quantile", "nanquantile", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
    "count_nonzero", "topk", "sort", "argsort", "kthvalue", "dot", "vdot", "matmul", "mm",
    "bmm", "einsum", "trace", "dist", "cdist", "cosine_similarity", "layer_norm",
    "group_norm", "rms_norm"})


def reduction_error(tracer, name: str) -> TraceError:
    """The error for a reduction called on traced values (``name`` as the user wrote it)."""
    bare = name.split()[0].rsplit(".", 1)[-1]
    hint = ""
    if bare in ("max", "min", "amax", "amin"):
        pair = "maximum" if "max" in bare else "minimum"
        hint = f": use torch.{pair}(a, b) for the {pair} of two values"
    return tracer.error(
        f"{name} is a reduction; a mod computes one scalar per (b, h, q_idx, kv_idx), so there "
        f"is no dimension to reduce{hint}. To reduce over a dimension of a captured tensor, "
        "index each element and combine them in Python, e.g. sum(t[q_idx, d] * t[kv_idx, d] "
        "for d in range(t.shape[1]))", UnsupportedOpError)


def unsupported(tracer, func) -> TraceError:
    """The error for a torch function with no handler: a reduction, in place, or the list."""
    name = func_name(func)
    bare = name.rsplit(".", 1)[-1]
    if bare in REDUCTIONS:
        return reduction_error(tracer, name)
    if (bare.endswith("_") and not bare.startswith("_")) or bare.startswith("__i"):
        return tracer.error(
            f"in-place {name} is not allowed in a mod: mods must be pure, so neither a "
            "captured tensor nor a traced value may be modified; compute a new value instead "
            "(x = x + 1)")
    return tracer.error(
        f"torch function {name} is not supported in mods; supported: "
        + ", ".join(supported_functions()) + "; operators + - * / // % ** < <= == != >= > "
        "& | ^ ~ << >> and abs()", UnsupportedOpError)
