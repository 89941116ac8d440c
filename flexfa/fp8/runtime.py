"""Running the FP8 forward kernel on validated ``FP8Inputs``: tiles, spec, cache, launch."""
from __future__ import annotations

import os

import torch
import triton

from ..codegen.fp8 import FP8_MIN_DIM, FP8KernelSpec, fp8_forward_kernel, quantize_kernel
from ..codegen.spec import DTYPE_NAMES, INTERPRET, next_power_of_two
from ..errors import InputError
from ..frontend.trace import TracedMod
from ..runtime.autotune import Pinned
from ..memo import BoundedMemo
from ..runtime.launch import cdiv
from ..runtime.forward import (AttentionCall, _table_args, buffer_launch_args,
                               call_int64_nodes, forward_grid, load_generated, target_of)
from .quantize import FP8Inputs


def default_fp8_tiles(head_dim_pad: int, target: str, use_tma: bool = False
                      ) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg); 64 x 64 under the interpreter.

    E = 128 with tensor descriptors (USE_TMA, the sm_90 default): 64 x 128 tiles, 4 warps,
    2 stages, capped at 168 registers, which fits three programs on an SM (about 72 KB of
    shared memory each), so one program's softmax overlaps the others' e4m3 GEMMs. On the H200
    (``benchmarks/tile_sweep.py --fp8``, S = 16384, B = 1, H = 16): causal 1.52 ms and full
    2.83 ms against 2.10 / 3.79 ms for the previous 128 x 128, 8 warps, 3 stages (one
    program per SM); 20-32 bytes spilled (296 with ALiBi + document). Other choices from sm_90
    compile checks (ptxas spills, causal mask): with pointer loads 128 x 128 at E <= 64 spills
    nothing, at E = 128 it spills ~400 B and 128 x 64 nothing; E = 256 spills at any tile.
    """
    if target == INTERPRET:
        return 64, 64, 4, 1, 0
    if use_tma and 64 < head_dim_pad <= 128:
        return 64, 128, 4, 2, 168
    if head_dim_pad <= 64 or (use_tma and head_dim_pad <= 128):
        return 128, 128, 8, 3, 0
    if head_dim_pad <= 128:
        return 128, 64, 8, 3, 0
    return 128, 64, 8, 2, 0


def _largest_pow2_divisor(n: int, cap: int) -> int:
    tile = cap
    while tile > 1 and n % tile:
        tile //= 2
    return tile


def _fit(name: str, default: int, pinned: int | None, blocks: dict[str, int], minimum: int) -> int:
    """A tile dividing every block in ``blocks`` (the pinned one, or the largest <= default)."""
    tile = pinned or default
    if pinned is None:
        for block in blocks.values():
            tile = _largest_pow2_divisor(block, tile)
    bad = {what: block for what, block in blocks.items() if block % tile}
    if bad or tile < minimum:
        raise InputError(
            f"FP8 kernel tile {name}={tile} must be >= {minimum} and divide the "
            f"{', '.join(f'{w} block {b}' for w, b in blocks.items())}; choose block sizes "
            f"that are multiples of {minimum} or pass a fitting kernel_options {name!r}")
    return tile


TMA_TARGETS = ("cuda:90",)


def tma_requested(target: str) -> bool:
    """Load tiles through tensor descriptors? ``FLEXFA_FP8_TMA``: ``1`` always (also under the
    interpreter, which is how CI tests that path), ``0`` never, unset/``auto`` on sm_90, where
    the H200 measured it 1.12x (full) and 1.25x (causal) faster than pointer loads at E = 128,
    S = 16384 (docs/fp8.md)."""
    mode = os.environ.get("FLEXFA_FP8_TMA", "auto")
    return mode == "1" or (mode == "auto" and target in TMA_TARGETS)


EXP_F16_TARGETS: tuple[str, ...] = ()


def exp_f16_requested(target: str) -> bool:
    """P's exp2 in float16, two per instruction? ``FLEXFA_FP8_EXP16``: ``1`` always (under the
    interpreter too, with an exact float16 fallback), ``0`` never, unset/``auto`` on the
    targets in ``EXP_F16_TARGETS``."""
    mode = os.environ.get("FLEXFA_FP8_EXP16", "auto")
    if mode not in ("auto", "0", "1"):
        raise InputError(f"FLEXFA_FP8_EXP16 must be auto, 0 or 1, got {mode!r}")
    return mode == "1" or (mode == "auto" and target in EXP_F16_TARGETS)


def tma_layout_ok(x: FP8Inputs) -> bool:
    """Tensor descriptors need unit stride along the loaded rows' last dim (E for Q and K, S
    for V) and 16-byte aligned bases and row strides (e4m3: one byte per element)."""
    unit = (x.q.stride(3), x.k.stride(3), x.v.stride(2)) == (1, 1, 1)
    strides = (*x.q.stride()[:3], *x.k.stride()[:3], x.v.stride(0), x.v.stride(1), x.v.stride(3))
    aligned = all(t.data_ptr() % 16 == 0 for t in (x.q, x.k, x.v))
    return unit and aligned and all(s % 16 == 0 for s in strides)


def fp8_spec(x: FP8Inputs, call: AttentionCall, return_lse: bool) -> FP8KernelSpec:
    L, E = x.q.shape[2], x.q.shape[3]
    S, Ev = x.k.shape[2], x.v.shape[3]
    target = target_of(x.q.device)
    use_tma = tma_requested(target) and tma_layout_ok(x)
    block_m, block_n, warps, stages, cap = default_fp8_tiles(
        next_power_of_two(E, FP8_MIN_DIM), target, use_tma)
    q_blocks, kv_blocks = {"Q scale": x.block_q}, {"K/V scale": x.block_kv}
    mask = call.block_mask
    if mask is not None:
        sparse_q, sparse_kv = (int(b) for b in mask.BLOCK_SIZE)
        q_blocks["block_mask q"], kv_blocks["block_mask kv"] = sparse_q, sparse_kv
    options = call.options
    # the forward's rule: pinned tiles, warps or stages drop the default cap, a pinned cap wins
    cap = Pinned.of(options).apply((block_m, block_n, warps, stages, cap))[4]
    block_m = _fit("BLOCK_M", block_m, options.block_m, q_blocks, 16)
    block_n = _fit("BLOCK_N", block_n, options.block_n, kv_blocks, 16)
    if mask is None:
        sparse_q, sparse_kv = block_m, block_n
    return FP8KernelSpec(
        out_dtype=DTYPE_NAMES[x.dtype], head_dim=E, head_dim_v=Ev, block_m=block_m,
        block_n=block_n, num_warps=options.num_warps or warps,
        num_stages=options.num_stages or stages, max_registers=cap,
        has_block_mask=mask is not None,
        has_full_blocks=mask is not None and getattr(mask, "full_kv_num_blocks", None) is not None,
        sparse_q=sparse_q, sparse_kv=sparse_kv, scale_q=x.block_q, scale_kv=x.block_kv,
        even_l=L % block_m == 0, even_s=S % block_n == 0 and S % sparse_kv == 0,
        return_lse=return_lse,
        gqa_group=call.gqa_group, target=target, use_tma=use_tma,
        exp_f16=exp_f16_requested(target),
        fold_qk_scale=call.score is None and call.scale > 0 and x.positive_scales,
        wide_ints=call_int64_nodes(x.q, x.k, call))


_KERNELS = BoundedMemo(256, "fp8 kernels")


def _memoized(memo_key: tuple, interpret: bool, generate):
    """The launchable kernel of ``generate()`` (a GeneratedKernel), memoized per signature."""
    kernel = _KERNELS.get(memo_key)
    if kernel is None:
        generated = generate()
        module = load_generated(generated, interpret)
        kernel = _KERNELS[memo_key] = getattr(module, generated.name)
    return kernel


def get_fp8_kernel(spec: FP8KernelSpec, score: TracedMod | None, mask: TracedMod | None):
    return _memoized((spec, score.key if score else None, mask.key if mask else None),
                     spec.interpret, lambda: fp8_forward_kernel(spec, score, mask))


def run_fp8_forward(x: FP8Inputs, call: AttentionCall, return_lse: bool):
    """(out [B, Hq, L, Ev] in ``x.dtype``, lse [B, Hq, L] float32 or None)."""
    B, Hq, L, _ = x.q.shape
    S, Ev = x.k.shape[2], x.v.shape[3]
    device = x.q.device
    out = torch.empty(B, Hq, L, Ev, dtype=x.dtype, device=device)
    lse = torch.empty(B, Hq, L, dtype=torch.float32, device=device) if return_lse else None
    if out.numel() == 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse
    spec = fp8_spec(x, call, return_lse)
    kernel = get_fp8_kernel(spec, call.score, call.mask)
    grid = forward_grid(B * Hq, cdiv(L, spec.block_m), spec.has_block_mask)
    assert x.k_scale.stride() == x.v_scale.stride(), "K and V scales must share strides"
    args = [x.q, x.k, x.v, x.q_scale, x.k_scale, x.v_scale, out, lse if lse is not None else out,
            *x.q.stride(), *x.k.stride(), *x.v.stride(), *out.stride(),
            *x.q_scale.stride()[:2], *x.k_scale.stride()[:2],
            *_table_args(call.block_mask, device), Hq, L, S, float(call.scale),
            *buffer_launch_args(call.score), *buffer_launch_args(call.mask)]
    launch = dict(spec.constexprs(call.score is not None), **spec.launch_options())
    if spec.use_tma:  # device-side descriptors live in a scratch buffer from this allocator
        triton.set_allocator(lambda size, alignment, stream: torch.empty(
            size, dtype=torch.int8, device=device))
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **launch)
    else:
        kernel[grid](*args, **launch)
    return out, lse


def quantize_rows(x: torch.Tensor, block: int, signed_h: torch.Tensor | None,
                  out: torch.Tensor) -> torch.Tensor:
    """One fused pass: rotate (``x @ signed_h / sqrt(d)``, ``signed_h`` from
    ``hadamard.signed_hadamard``; None: no rotation), per-block amax, e4m3 values into ``out``
    (any strides, ``[B, H, N, d or E]``); returns the descales ``[B, H, nb]``."""
    B, H, N, E = x.shape
    rotate = signed_h is not None
    e_pad = signed_h.shape[0] if rotate else next_power_of_two(E, 16)
    scale = torch.empty(B, H, cdiv(N, block), dtype=torch.float32, device=x.device)
    if scale.numel() == 0:
        return scale
    if not rotate:
        signed_h = scale  # a placeholder pointer
    interpret = x.device.type == "cpu"
    rows = min(block, 64 if e_pad >= 256 else 128)
    kernel = _memoized(("quantize", interpret), interpret, quantize_kernel)
    args = [x, out, scale, signed_h, *x.stride(), *out.stride(), *scale.stride()[:2], H, N,
            1.0 / e_pad ** 0.5]
    launch = dict(E=E, E_PAD=e_pad, E_OUT=out.shape[-1], BLOCK=block, ROWS=rows,
                  ROTATE=rotate, DOT_IN_FP32=interpret or x.dtype == torch.float32,
                  EMULATE_FP8_CAST=interpret, num_warps=8 if e_pad >= 128 else 4)
    grid = (scale.shape[2], B * H)
    if interpret:
        kernel[grid](*args, **launch)
    else:
        with torch.cuda.device(x.device):
            kernel[grid](*args, **launch)
    return scale
