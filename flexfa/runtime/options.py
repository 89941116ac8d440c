"""``kernel_options``: every per-call choice of which kernel runs and how it is tiled.

Keys follow torch's ``FlexKernelOptions`` where torch has one; a key may carry a ``fwd_`` or
``bwd_`` prefix to apply to one pass only (the prefixed value wins over the bare one).
Unknown keys and wrong types are an ``InputError`` naming the key; a value None is the key's
default, as if the key were absent. Keys torch documents that
change nothing in flexfa are checked alike, accepted and logged once (``HINTS``). The parsed
``KernelOptions`` is frozen and hashable: it is part of every plan's key, so two calls that
differ in an option never share a kernel or a plan. ``docs/kernel-options.md`` is the
reference.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import numbers

import torch

from .. import config
from ..errors import InputError, InputTypeError, check_bool, is_bool
from ..memo import BoundedMemo

log = logging.getLogger("flexfa")

TILES = (16, 32, 64, 128, 256)
BACKENDS = ("AUTO", "TRITON", "AMPERE", "HOPPER", "DECODE", "GLUON", "TRITON_DECODE", "FLASH")
# torch's backends that flexfa does not have: accepted, run flexfa's choice, logged once
FOREIGN_BACKENDS = {"TRITON_DECODE": "flexfa chooses its decode family itself (BACKEND='DECODE' "
                                     "forces it)",
                    "FLASH": "flexfa runs its own kernels, not FlashAttention's CuTe ones"}


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """The options of one pass (forward or backward); None: flexfa's choice."""

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_registers: int | None = None  # 0: no cap
    use_tma: bool | None = None
    # the backward's two tilings (torch's names): dK/dV walks BLOCK_M1 rows in a program of
    # BLOCK_N1 keys, dQ walks BLOCK_N2 keys in a program of BLOCK_M2 rows
    block_m1: int | None = None
    block_n1: int | None = None
    block_m2: int | None = None
    block_n2: int | None = None

    @property
    def pins_tiles(self) -> bool:
        return any(v is not None for v in (self.block_m, self.block_n, self.num_warps,
                                           self.num_stages, self.block_m1, self.block_n1,
                                           self.block_m2, self.block_n2))


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    backend: str = "AUTO"  # a family name (AMPERE, HOPPER) forces that family
    deterministic: bool = False
    fp32_precision: str = "ieee"
    # forward: None the family's choice (the decode and Hopper families split by occupancy,
    # the Ampere family never), 0 never, n about n splits (the decode and Hopper families:
    # exactly n), "AUTO" by occupancy
    split_kv: int | str | None = None
    # the decode family's block-mask walk where a GQA group's rows span several (table head,
    # q block) members: "AUTO"/"UNION" the union of their blocks (each K/V tile once),
    # "MEMBERS" each member's blocks in turn (the walk before the union; kept for comparison)
    decode_walk: str = "AUTO"
    ds_workspace: bool | None = None  # backward dS workspace (L x S): only when True
    ds_max_bytes: int | None = None  # its budget (None: 8 GiB, a quarter of the GPU at most)
    # the Triton backward walks a call without a block mask through the tables of one whose
    # every block is full (families.backward.full_walk): True wherever there is no block
    # mask, None ('AUTO', default) where measured faster (sm_90, head dims 256 / 256, no
    # dropout: the dK/dV kernel's one loop with dP^T split between the warpgroups), False
    # never
    bwd_full_walk: bool | None = None
    # the Gluon backward family (sm_90): True where it applies, False never, None (default)
    # where it measured faster (runtime.families.gluon_bwd.AUTO_CLASSES)
    gluon_backward: bool | None = None
    # the Gluon forward's consumer warpgroups take turns issuing their GEMMs (ping-pong); off
    # until measured on the H200
    gluon_pingpong: bool = False
    # the Gluon forward stores out through shared memory and TMA; off until measured
    gluon_tma_store: bool = False
    # the Gluon forward on a persistent grid (one program per SM walking work tiles, longest
    # first): False, True (each program's tiles fixed), "DYNAMIC" (from an atomic counter) or
    # None (default): "DYNAMIC" under a block mask, else off (docs/gluon.md, measured)
    gluon_persistent: bool | str | None = None
    # under a block mask the forward's work (the Hopper family's grid, the Gluon forward's
    # dynamic tiles) takes the heads this many at a time (each group's q tiles longest first,
    # then the next group's), so the programs running together share few heads' K and V in
    # L2; 0 (default): runtime.outputs.head_group's choice
    head_group: int = 0
    # the Gluon forward subtracts the score_mod's proven bound instead of a running row max
    # (softcap); on: with the softcap's constants folded (codegen/fold.py) 1.05-1.15x faster
    # on softcap forwards on the H200, 5 rounds (docs/gluon.md, "Static max")
    gluon_static_max: bool = True
    # the Gluon forward runs Q K^T over E's 32-column slices only, not the zero columns
    # padding E to a power of two (where they are fewer: E = 80, 96, 160, 192, 224); None
    # ('AUTO'): at the head dims where it measured faster (families.gluon.QK_TRIM_MEASURED)
    gluon_qk_trim: bool | None = None
    # the Gluon backward (its E <= 128 kernel) runs S^T and dP^T over E's 32-column slices
    # only (E = 80, 96); None ('AUTO'): there (measured faster at both)
    gluon_bwd_qk_trim: bool | None = None
    # the Gluon backward's Q/dO ring depth; 0: its default per head dim
    gluon_bwd_stages: int = 0
    # the Gluon backward issues dP^T with S^T (FA3's order); off: 1-5% faster at full and
    # causal, 7-9% slower with a softcap or a document mask on the H200 (docs/gluon.md)
    gluon_bwd_early_dp: bool = False
    # the Gluon backward's dQ accumulator holds 1 / this of the (batch, kv head) pairs at a
    # time (one launch per part); 0: its default (4)
    gluon_bwd_dq_chunks: int = 0
    # the Gluon backward's parts run on two streams, each into half the accumulator (a
    # part's programs fill the SMs the one before it leaves idle at its end)
    gluon_bwd_overlap: bool = True
    # the Gluon families on CPU tensors: their sm_90 source run by runtime.gluon_emulator
    # (tests and debugging; the families choose as on sm_90, BACKEND/GLUON_BACKWARD force)
    gluon_emulate: bool = False
    fwd: PassOptions = PassOptions()
    bwd: PassOptions = PassOptions()

    # the forward's fields, as the forward families read them
    block_m = property(lambda self: self.fwd.block_m)
    block_n = property(lambda self: self.fwd.block_n)
    num_warps = property(lambda self: self.fwd.num_warps)
    num_stages = property(lambda self: self.fwd.num_stages)
    max_registers = property(lambda self: self.fwd.max_registers)


def _int_in(choices, meaning: str):
    def check(key: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InputTypeError(f"kernel_options[{key!r}] must be an int, got "
                                 f"{type(value).__name__} {value!r}")
        if int(value) not in choices:
            raise InputError(f"kernel_options[{key!r}] = {value} is not allowed; {meaning}")
        return int(value)
    return check


def _flag(key: str, value) -> bool:
    return check_bool(f"kernel_options[{key!r}]", value)


def _flag_or(word: str):
    """True, False, ``word`` (any case), or "AUTO" for flexfa's choice (None)."""
    def check(key: str, value) -> bool | str | None:
        if isinstance(value, str):
            if value.upper() not in (word, "AUTO"):
                raise InputError(f"kernel_options[{key!r}] must be True, False, {word!r} or "
                                 f"'AUTO', got {value!r}")
            return word if value.upper() == word else None
        if not is_bool(value):
            raise InputTypeError(f"kernel_options[{key!r}] must be True, False, {word!r} or "
                                 f"'AUTO', got {type(value).__name__} {value!r}")
        return bool(value)
    return check


def _auto_flag(key: str, value) -> bool | None:
    """True, False, or "AUTO" for flexfa's choice (None)."""
    if isinstance(value, str) and value.upper() == "AUTO":
        return None
    if not is_bool(value):
        raise InputTypeError(f"kernel_options[{key!r}] must be True, False or 'AUTO', got "
                             f"{type(value).__name__} {value!r}")
    return bool(value)


def _choice(choices):
    def check(key: str, value) -> str:
        if not isinstance(value, str):
            raise InputTypeError(f"kernel_options[{key!r}] must be a str, one of "
                                 f"{list(choices)}, got {type(value).__name__} {value!r}")
        text = value.upper()
        if text not in choices:
            raise InputError(f"kernel_options[{key!r}] must be one of {list(choices)}, got "
                             f"{value!r}")
        return text
    return check


def _split_kv(key: str, value) -> int | str:
    if isinstance(value, str) and value.upper() == "AUTO":
        return "AUTO"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"kernel_options[{key!r}] must be an int or 'AUTO', got "
                             f"{type(value).__name__} {value!r}")
    return _int_in(range(0, 1025), "0 (never), a number of splits up to 1024, or 'AUTO'")(
        key, value)


def _positive_int(key: str, value) -> int:
    return _int_in(range(1, 2 ** 62), "a positive number of bytes")(key, value)


def _precision(key: str, value) -> str:
    # lower case only, as torch.backends.cuda.matmul.fp32_precision ('IEEE' is an error there)
    if not isinstance(value, str):
        raise InputTypeError(f"kernel_options[{key!r}] must be 'ieee' or 'tf32', got "
                             f"{type(value).__name__} {value!r}")
    if value not in ("ieee", "tf32"):
        case = (" (lower case, as torch.backends.cuda.matmul.fp32_precision takes them)"
                if value.lower() in ("ieee", "tf32") else "")
        raise InputError(f"kernel_options[{key!r}] must be 'ieee' or 'tf32'{case}, got "
                         f"{value!r}")
    return str(value)


_TILE = _int_in(TILES, "a power of two, 16..256")
# key -> (field, passes it may apply to ("fwd", "bwd", or () for the whole call), check, meaning)
SCHEMA = {
    "BLOCK_M": ("block_m", ("fwd", "bwd"), _TILE, "forward query tile; bounds the backward's"),
    "BLOCK_N": ("block_n", ("fwd", "bwd"), _TILE, "forward key tile; bounds the backward's"),
    "BLOCK_M1": ("block_m1", ("bwd",), _TILE, "backward dK/dV kernel: query rows per step"),
    "BLOCK_N1": ("block_n1", ("bwd",), _TILE, "backward dK/dV kernel: keys per program"),
    "BLOCK_M2": ("block_m2", ("bwd",), _TILE, "backward dQ kernel: query rows per program"),
    "BLOCK_N2": ("block_n2", ("bwd",), _TILE, "backward dQ kernel: keys per step"),
    "num_warps": ("num_warps", ("fwd", "bwd"), _int_in((1, 2, 4, 8, 16), "1, 2, 4, 8 or 16"),
                  "warps per program"),
    "num_stages": ("num_stages", ("fwd", "bwd"), _int_in(range(1, 9), "1..8"),
                   "software-pipelining stages"),
    "maxnreg": ("max_registers", ("fwd",),
                _int_in((0, *range(64, 249, 8)), "0 for none, or a multiple of 8, 64..248"),
                "register cap per thread of the forward kernel"),
    "USE_TMA": ("use_tma", ("fwd", "bwd"), _auto_flag,
                "tiles through tensor descriptors (TMA, sm_90): True, False or 'AUTO'"),
    "BACKEND": ("backend", (), _choice(BACKENDS),
                "AUTO/TRITON (flexfa's choice), AMPERE, HOPPER, DECODE or GLUON (force that "
                "forward family; the backward's family is GLUON_BACKWARD's choice)"),
    "deterministic": ("deterministic", (), _flag,
                      "bit-identical gradients, captured-tensor gradients included"),
    "fp32_precision": ("fp32_precision", (), _precision, "fp32 dots: 'ieee' or 'tf32'"),
    "SPLIT_KV": ("split_kv", (), _split_kv,
                 "split-KV decoding: 0 (never), n splits, or 'AUTO' (default: the family's "
                 "choice)"),
    "DECODE_WALK": ("decode_walk", (), _choice(("AUTO", "UNION", "MEMBERS")),
                    "the decode family's walk of a GQA group's block masks: 'AUTO' or 'UNION' "
                    "(each K/V tile read once), 'MEMBERS' (each head's and q block's blocks in "
                    "turn)"),
    "BWD_FULL_WALK": ("bwd_full_walk", (), _auto_flag,
                      "the Triton backward walks a call without a block mask through the "
                      "tables of a mask whose every block is full (at head dims padding to 256 "
                      "its dK/dV kernel then splits S^T and dP^T between its warpgroups): "
                      "True (any call without a block mask), 'AUTO' (on sm_90 at padded head "
                      "dims 256 / 256 without dropout, the default: 0.77-0.83x the fwd+bwd "
                      "time of the unmasked walk on an H200) or False"),
    "DS_WORKSPACE": ("ds_workspace", (), _auto_flag,
                     "backward dQ from a stored dS (memory L x S): True (opt in), False or 'AUTO' "
                     "(default: off)"),
    "DS_MAX_BYTES": ("ds_max_bytes", (), _positive_int, "the dS workspace's budget in bytes"),
    "GLUON_BACKWARD": ("gluon_backward", (), _auto_flag,
                       "the Gluon backward on sm_90: True (where it applies), False (never) "
                       "or 'AUTO' (default: where it measured faster than the Triton "
                       "backward, docs/gluon.md)"),
    "GLUON_PINGPONG": ("gluon_pingpong", (), _flag,
                       "the Gluon forward's two consumer warpgroups take turns on the tensor "
                       "cores (FlashAttention-3's ping-pong): True or False (default)"),
    "GLUON_TMA_STORE": ("gluon_tma_store", (), _flag,
                        "the Gluon forward writes out through shared memory and a TMA store: "
                        "True or False (default)"),
    "GLUON_PERSISTENT": ("gluon_persistent", (), _flag_or("DYNAMIC"),
                         "the Gluon forward on a persistent grid (one program per SM walking "
                         "work tiles, longest first): True (each program's tiles fixed), "
                         "'DYNAMIC' (each program takes the next tile from an atomic counter "
                         "when it is done with one), False, or 'AUTO' (default: 'DYNAMIC' "
                         "under a block mask, else False)"),
    "HEAD_GROUP": ("head_group", (), _int_in(range(0, 2 ** 31),
                                             "0 (default) or a number of heads"),
                   "under a block mask the forward (Hopper family, Gluon forward) goes through "
                   "the heads this many at a time, each group's longest q tiles first (K and V "
                   "of few heads in L2); 0 (default): as many heads as share 16 MiB of K and "
                   "V, every head at once under a sparse mask"),
    "GLUON_STATIC_MAX": ("gluon_static_max", (), _flag,
                         "the Gluon forward subtracts the score_mod's proven upper bound instead "
                         "of a running row max where its output range is bounded (softcap; "
                         "bf16, no max_scores): True (default) or False"),
    "GLUON_QK_TRIM": ("gluon_qk_trim", (), _auto_flag,
                      "the Gluon forward runs Q K^T over E's 32-column slices only, not the "
                      "zero columns padding E to a power of two (0.75x its work at E = 96 "
                      "and 80, 0.75x at 192, 0.625x at 160): True, False or 'AUTO' (default: "
                      "at E = 80, 96, 160 and 192, measured 0.87-0.99x the padded kernel's "
                      "time; not at 224, never timed)"),
    "GLUON_BWD_QK_TRIM": ("gluon_bwd_qk_trim", (), _auto_flag,
                          "the Gluon backward runs S^T = K Q^T and dP^T = V dO^T over E's "
                          "32-column slices only, not the zero columns padding E to 128 (E = 80 "
                          "and 96: 0.75x those two GEMMs' work): True, False or 'AUTO' "
                          "(default: on, measured 0.95-1.01x the padded kernel's fwd+bwd "
                          "time)"),
    "GLUON_BWD_STAGES": ("gluon_bwd_stages", (), _int_in((0, 2, 3, 4), "0 (default), 2, 3 or 4"),
                         "the Gluon backward's Q/dO ring depth (stages that do not fit sm_90's "
                         "shared memory fail before compiling); 0 (default): its choice per "
                         "head dim"),
    "GLUON_BWD_EARLY_DP": ("gluon_bwd_early_dp", (), _flag,
                           "the Gluon backward issues dP^T with S^T, in flight through the "
                           "mods (FlashAttention-3's order; more registers): True or False "
                           "(default)"),
    "GLUON_BWD_DQ_CHUNKS": ("gluon_bwd_dq_chunks", (), _int_in(range(0, 65), "0..64"),
                            "the Gluon backward's fp32 dQ accumulator holds about 1 / n of the "
                            "(batch, kv head) pairs, one launch per part (memory against "
                            "launches): 1 all at once; 0 (default): 4"),
    "GLUON_BWD_OVERLAP": ("gluon_bwd_overlap", (), _flag,
                          "the Gluon backward's accumulator parts run on two streams, each "
                          "into half the accumulator, so a part's programs start while the "
                          "one before it finishes: True (default) or False (one after "
                          "another)"),
    "GLUON_EMULATE": ("gluon_emulate", (), _flag,
                      "CPU tensors only: the Gluon forward and backward run their sm_90 source "
                      "in flexfa's emulator (runtime.gluon_emulator: tests and debugging, "
                      "slow), choosing as on sm_90; True or False (default)"),
}
# torch's documented keys that change nothing here: their check (a wrong type is still an
# error, as for flexfa's own keys) and the reason logged once
_ROCM = _int_in(range(0, 2 ** 31), "a non-negative int (a ROCm option)")
HINTS = {
    "PRESCALE_QK": (_flag, "flexfa folds the scale into the softmax already"),
    "ROWS_GUARANTEED_SAFE": (_flag, "flexfa's empty-row handling costs nothing to skip"),
    "BLOCKS_ARE_CONTIGUOUS": (_flag, "flexfa walks the block tables as they are"),
    "WRITE_DQ": (_flag, "flexfa's captured-tensor gradients are always accumulated in the dQ "
                 "kernel"),
    "FORCE_USE_FLEX_ATTENTION": (_flag, "flexfa chooses its decode family itself "
                                 "(BACKEND='AMPERE' or 'HOPPER' avoids it)"),
    "kpack": (_ROCM, "a ROCm option"), "matrix_instr_nonkdim": (_ROCM, "a ROCm option"),
    "waves_per_eu": (_ROCM, "a ROCm option"),
}
_LOGGED: set[str] = set()


def _log_once(key: str, why: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("flexfa: kernel_options[%r] changes nothing here: %s", key, why)


def _split_prefix(key: str) -> tuple[str | None, str]:
    for prefix in ("fwd", "bwd"):
        if key.startswith(prefix + "_") and len(key) > 4:
            return prefix, key[4:]
    return None, key


def _unknown(key) -> InputError:
    names = [*SCHEMA, *HINTS]  # suggest only spellings that parse: a prefix where it applies
    names += [f"{p}_{n}" for n, (_, scope, _, _) in SCHEMA.items() for p in scope]
    by_lower = {n.lower(): n for n in names}
    close = difflib.get_close_matches(str(key).lower(), list(by_lower), n=1)
    close = [by_lower[c] for c in close]
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    allowed = "; ".join(f"{k}: {v[3]}" for k, v in SCHEMA.items())
    return InputError(f"kernel_options has an unknown key {key!r}{hint}; the keys are {allowed}; "
                      f"torch's {sorted(HINTS)} are accepted and change nothing; BLOCK_*, "
                      "num_warps, num_stages, maxnreg and USE_TMA take a fwd_ or bwd_ prefix")


_PARSED = BoundedMemo(256, "parsed kernel_options")


def parse_kernel_options(options) -> KernelOptions:
    """Validate a ``kernel_options`` dict (None = defaults) into ``KernelOptions``; a dict
    seen before (same items, same FLEXFA_BACKEND) costs one lookup."""
    if isinstance(options, KernelOptions):
        return options
    # torch.use_deterministic_algorithms(True) asks every op for its deterministic algorithm:
    # the ``deterministic`` option then (_parse; it was ignored)
    strict = torch.are_deterministic_algorithms_enabled()
    if not options and (options is None or type(options) is dict):
        options = {}  # the common call: the memo below without building its key's frozenset
        memo_key = (config.default_backend(), strict)
        parsed = _PARSED.get(memo_key)
        if parsed is None:
            parsed = _PARSED[memo_key] = _parse(options, strict)
        return parsed
    if not isinstance(options, dict):
        raise InputTypeError(f"kernel_options must be a dict or None, got "
                             f"{type(options).__name__} {options!r:.60}")
    try:
        # with the values' types: True == 1 and 32 == 32.0 hash alike, and only one is valid
        memo_key = (config.default_backend(), strict,
                    frozenset((k, type(v), v) for k, v in options.items()))
    except TypeError:  # an unhashable value: validated below, not memoized
        memo_key = None
    parsed = _PARSED.get(memo_key) if memo_key is not None else None
    if parsed is None:
        parsed = _parse(options, strict)
        if memo_key is not None:
            _PARSED[memo_key] = parsed
    return parsed


def _parse(options: dict, strict: bool = False) -> KernelOptions:
    """``options`` validated; ``strict``: torch's deterministic algorithms are on, so
    ``deterministic`` is True whatever the dict says."""
    call: dict = {}
    passes: dict = {"fwd": {}, "bwd": {}}
    prefixed: set = set()
    for key, value in options.items():
        if not isinstance(key, str):
            raise _unknown(key)
        prefix, base = _split_prefix(key)
        if base in HINTS:
            check, why = HINTS[base]
            if value is not None:
                check(key, value)
                _log_once(key, why)
            continue
        if base not in SCHEMA:
            raise _unknown(key)
        field, scope, check, _ = SCHEMA[base]
        if prefix is not None and prefix not in scope:
            where = "the whole call" if not scope else f"the {scope[0]} pass only"
            raise InputError(f"kernel_options[{key!r}]: {base} applies to {where}; write "
                             f"{(scope[0] + '_' + base) if scope else base!r}")
        if value is None:  # the default, as if the key were absent ({"SPLIT_KV": args.split})
            continue
        checked = check(key, value)
        if not scope:
            call[field] = checked
            continue
        for name in ((prefix,) if prefix else scope):
            if prefix or (name, field) not in prefixed:  # a prefixed key wins
                passes[name][field] = checked
            if prefix:
                prefixed.add((name, field))
    if "backend" in call and call["backend"] in FOREIGN_BACKENDS:
        _log_once(f"BACKEND={call['backend']}", FOREIGN_BACKENDS[call["backend"]])
        call["backend"] = "AUTO"
    if "backend" not in call:
        call["backend"] = _default_backend()
    if call["backend"] == "TRITON":
        call["backend"] = "AUTO"  # every flexfa kernel is a Triton kernel
    if strict:
        call["deterministic"] = True
    return KernelOptions(fwd=PassOptions(**passes["fwd"]), bwd=PassOptions(**passes["bwd"]),
                         **call)


def _default_backend() -> str:
    backend = config.default_backend()
    if backend not in BACKENDS:
        raise InputError(f"FLEXFA_BACKEND={backend!r} must be one of {list(BACKENDS)}")
    return "AUTO" if backend in FOREIGN_BACKENDS or backend == "TRITON" else backend


DEFAULT_OPTIONS = KernelOptions()
