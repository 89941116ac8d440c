"""``KernelSpec``: everything besides the mods' IR that selects and names a kernel."""
from __future__ import annotations

import dataclasses
import hashlib

import torch

# torch dtype <-> the short names used in specs, kernel names and Triton signatures
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
INTERPRET = "interpret"  # the target of kernels run by the Triton interpreter on CPU tensors
# the target prefix of a Gluon kernel's sm_90 source run on CPU tensors by
# runtime.gluon_emulator ("emulate:90"; kernel_options GLUON_EMULATE): rendered as for
# "cuda:90", cached apart from it
EMULATE = "emulate"


def load_mode(spec) -> bool | str:
    """How a spec's module is loaded: True interpreted, False compiled, EMULATE emulated."""
    if getattr(spec, "target", "").startswith(EMULATE + ":"):
        return EMULATE
    return spec.interpret


def next_power_of_two(n: int, minimum: int = 16) -> int:
    """Padded head dim: tl.arange needs powers of two, tl.dot needs >= 16."""
    p = minimum
    while p < n:
        p *= 2
    return p


def head_dim_blocks(n: int) -> tuple[int, int]:
    """The column blocks (E_A, E_B) in which the backward holds a q/k head dim ``n``: one
    block of ``next_power_of_two(n)`` columns (E_B = 0), or, where n is not a power of two
    and two powers of two cover it in fewer columns, the largest power of two below n and the
    smallest one (at least 16) that covers the rest: 192 -> 128 + 64 (not 256), 96 -> 64 + 32,
    80 -> 64 + 16, 160 -> 128 + 32; 200 (128 + 128) and 24 (16 + 16) stay one block."""
    padded = next_power_of_two(n)
    first = padded // 2
    if first < 16 or n <= first:
        return padded, 0
    second = next_power_of_two(n - first)
    return (first, second) if first + second < padded else (padded, 0)


class PaddedDims:
    """The padded head dims and the interpreter target of a spec with ``head_dim``,
    ``head_dim_v`` and ``target`` fields (kernels tile powers of two)."""

    @property
    def head_dim_pad(self) -> int:
        return next_power_of_two(self.head_dim)

    @property
    def head_dim_v_pad(self) -> int:
        return next_power_of_two(self.head_dim_v)

    @property
    def interpret(self) -> bool:
        return self.target == INTERPRET


@dataclasses.dataclass(frozen=True)
class KernelSpec(PaddedDims):
    """A forward-kernel variant. Rendering is a pure function of (mods' IR, spec).

    ``target`` is ``"interpret"``, ``"cuda:<capability>"`` (e.g. ``"cuda:90"``) or, for the
    Gluon forward on CPU tensors, ``"emulate:90"``; the source is the same, but the spec keeps
    them apart in caches.
    """

    dtype: str  # "fp16" | "bf16" | "fp32": q, k and v share it
    head_dim: int  # E
    head_dim_v: int  # Ev
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    has_block_mask: bool
    has_full_blocks: bool
    sparse_q: int  # block-mask block sizes; equal to block_m / block_n when dense
    sparse_kv: int
    even_l: bool
    even_s: bool
    return_lse: bool
    gqa_group: int
    input_precision: str  # "ieee" | "tf32"
    target: str
    template: str = "fwd"
    # Triton's maxnreg (0: none): a cap of 128 lets two 8-warp programs share an SM (H200:
    # 65536 registers), so one program's softmax overlaps the other's GEMMs
    max_registers: int = 0
    # also write each row's max score (natural units) to MAXS: AuxRequest(max_scores=True)
    return_max: bool = False
    # split-KV decoding (Ampere template only): keys per split, 0 = no split
    split_keys: int = 0
    # split-KV (Hopper template only): the grid's third axis splits each row's live blocks
    # (SPLIT_KV), the runtime combines the splits' float32 slices
    split_kv: bool = False
    # keys of the mods' INT nodes computed in int64 (codegen.ranges.int64_nodes): their values
    # may leave int32 at this call's lengths; empty in the common case; and the marks
    # (ranges.FLOAT_CAST + key) of the casts of index math computed in float32 there
    wide_ints: tuple[str, ...] = ()
    # Hopper template only: q, k, v read through descriptors over their strided matrices,
    # each (batch, head) at a row and column origin (runtime/families/hopper.py), instead of
    # [B * H * len, dim] matrices
    strided_qkv: bool = False
    # attention sinks (HAS_SINKS): the element type of the per-head sink logits ("fp32", or
    # q's dtype), "" for none
    sinks_dtype: str = ""
    # dropout on the probabilities (DROPOUT)
    dropout: bool = False
    # Gluon template only: the consumer warpgroups issue their GEMMs in turn (PINGPONG); out
    # goes through shared memory and a TMA store (TMA_STORE); one program per SM walks work
    # tiles (PERSISTENT)
    pingpong: bool = False
    tma_store: bool = False
    persistent: bool = False
    # Gluon template only, with persistent: the work tiles come from an atomic counter
    # (DYNAMIC) instead of a fixed walk
    dynamic: bool = False
    # Gluon template only: the score_mod's output is at most this (natural units) over a range
    # at most ranges.STATIC_SPAN wide (codegen.ranges.static_score_max): the softmax
    # subtracts it instead of a running row max (STATIC_MAX); None: the running max
    static_max: float | None = None
    # Gluon template only: Q K^T over E's 32-column slices alone, not E_PAD's (QK_TRIM; set
    # only where they differ)
    qk_trim: bool = False

    def __post_init__(self):
        assert self.dtype in TORCH_DTYPES, f"dtype {self.dtype!r} not in {sorted(TORCH_DTYPES)}"
        assert self.sparse_q % self.block_m == 0 and self.sparse_kv % self.block_n == 0, (
            f"block-mask blocks ({self.sparse_q}, {self.sparse_kv}) must be multiples of the "
            f"tiles ({self.block_m}, {self.block_n})")
        assert self.input_precision in ("ieee", "tf32"), self.input_precision


    @property
    def dot_in_fp32(self) -> bool:
        """bf16 dots run on fp32 copies under the interpreter (its bf16 tl.dot is wrong)."""
        return self.interpret and self.dtype == "bf16"

    def constexprs(self, has_score_mod: bool) -> dict[str, object]:
        """The template's constexpr arguments."""
        constexprs = dict(forward_constexprs(self, has_score_mod), RETURN_MAX=self.return_max,
                          INPUT_PRECISION=self.input_precision, DOT_IN_FP32=self.dot_in_fp32)
        if self.template in ("fwd", "fwd_hopper"):  # the templates with sinks and dropout
            constexprs.update(HAS_SINKS=bool(self.sinks_dtype), DROPOUT=self.dropout)
        if self.template == "fwd":  # the Ampere template's split-KV decoding
            constexprs["SPLIT_KEYS"] = self.split_keys
        if self.template == "fwd_hopper":
            constexprs.update(STRIDED_QKV=self.strided_qkv, SPLIT_KV=self.split_kv)
        return constexprs

    def launch_options(self) -> dict[str, int]:
        return launch_options(self)


def launch_options(spec) -> dict[str, int]:
    """Triton compile options of a forward spec: warps, stages and, on a GPU, the register cap
    (``max_registers``; the interpreter has no registers to cap)."""
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    if spec.max_registers and not spec.interpret:
        options["maxnreg"] = spec.max_registers
    return options


def forward_constexprs(spec, has_score_mod: bool) -> dict[str, object]:
    """The constexpr arguments every forward template takes (the bf16 ones and the FP8 one),
    from a spec with the fields of ``KernelSpec``'s tile, mask and length part."""
    return dict(
        BLOCK_M=spec.block_m, BLOCK_N=spec.block_n, E=spec.head_dim, E_PAD=spec.head_dim_pad,
        EV=spec.head_dim_v, EV_PAD=spec.head_dim_v_pad, HAS_SCORE_MOD=has_score_mod,
        HAS_BLOCK_MASK=spec.has_block_mask, HAS_FULL_BLOCKS=spec.has_full_blocks,
        SPARSE_Q=spec.sparse_q, SPARSE_KV=spec.sparse_kv, EVEN_L=spec.even_l,
        EVEN_S=spec.even_s, RETURN_LSE=spec.return_lse, GQA_GROUP=spec.gqa_group)


def kernel_name(spec: KernelSpec, key: str) -> str:
    """Readable and unique: ``flexfa_fwd_d128_bf16_<first 12 hex of the cache key>``."""
    return f"flexfa_{spec.template}_d{spec.head_dim}_{spec.dtype}_{key[:12]}"


def spec_key(spec: KernelSpec, *parts: str) -> str:
    """sha256 over the spec and extra parts (IR keys, versions, template hashes)."""
    digest = hashlib.sha256(repr(dataclasses.astuple(spec)).encode())
    for part in parts:
        digest.update(b"|" + part.encode())
    return digest.hexdigest()
