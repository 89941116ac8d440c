"""``kernel_options``: the validated knobs a caller may set for the generated kernels."""
from __future__ import annotations

import dataclasses
import numbers

from ..errors import InputError, InputTypeError, check_bool

# key -> (KernelOptions field, one-line meaning)
ALLOWED = {
    "BLOCK_M": ("block_m", "query rows per tile: a power of two, 16..256"),
    "BLOCK_N": ("block_n", "key columns per tile: a power of two, 16..256"),
    "num_warps": ("num_warps", "warps per program: 1, 2, 4, 8 or 16"),
    "num_stages": ("num_stages", "software-pipelining stages: 1..8"),
    "maxnreg": ("max_registers", "register cap per thread of the forward kernel (Triton's "
                "maxnreg): 0 for none, or a multiple of 8 from 64 to 248"),
    "fp32_precision": ("fp32_precision", "tl.dot precision of fp32 inputs: 'ieee' or 'tf32'"),
    "deterministic": ("deterministic", "bit-identical gradients across runs (fixed-point "
                      "atomics for captured-tensor gradients)"),
}


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """None means: pick a default for the inputs and the target."""

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_registers: int | None = None  # 0: no cap
    fp32_precision: str = "ieee"
    deterministic: bool = False


DEFAULT_OPTIONS = KernelOptions()


def _int_option(key: str, value, choices) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"kernel_options[{key!r}] must be an int, got "
                             f"{type(value).__name__} {value!r}")
    if int(value) not in choices:
        raise InputError(f"kernel_options[{key!r}] = {value} is not allowed; "
                         f"{ALLOWED[key][1]}")
    return int(value)


_CHECKS = {
    "BLOCK_M": lambda key, v: _int_option(key, v, (16, 32, 64, 128, 256)),
    "BLOCK_N": lambda key, v: _int_option(key, v, (16, 32, 64, 128, 256)),
    "num_warps": lambda key, v: _int_option(key, v, (1, 2, 4, 8, 16)),
    "num_stages": lambda key, v: _int_option(key, v, range(1, 9)),
    "maxnreg": lambda key, v: _int_option(key, v, (0, *range(64, 249, 8))),
}


def _precision(key, value) -> str:
    if value not in ("ieee", "tf32"):
        raise InputError(f"kernel_options[{key!r}] must be 'ieee' or 'tf32', got {value!r}")
    return value


def _flag(key, value) -> bool:
    return check_bool(f"kernel_options[{key!r}]", value)


_CHECKS.update(fp32_precision=_precision, deterministic=_flag)


def parse_kernel_options(options) -> KernelOptions:
    """Validate a ``kernel_options`` dict (None = defaults) into ``KernelOptions``."""
    if options is None:
        return DEFAULT_OPTIONS
    if isinstance(options, KernelOptions):
        return options
    if not isinstance(options, dict):
        raise InputTypeError(f"kernel_options must be a dict or None, got "
                             f"{type(options).__name__} {options!r:.60}")
    unknown = sorted(str(k) for k in options if k not in ALLOWED)
    if unknown:
        allowed = "; ".join(f"{k}: {meaning}" for k, (_, meaning) in ALLOWED.items())
        raise InputError(f"kernel_options has unknown keys {unknown}; allowed keys are {allowed}")
    values = {ALLOWED[k][0]: _CHECKS[k](k, v) for k, v in options.items()}
    return KernelOptions(**values)
