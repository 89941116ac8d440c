"""The FP8 forward family (``fwd_fp8.tmpl``: e4m3 Q, K, V with per-block scales), and the
fused quantize-and-rotate kernel that feeds it (``fwd_fp8_quantize.tmpl``).

Takes an ``FP8Inputs``-like object (``flexfa.fp8.quantize``): ``q, k, v`` (e4m3, V stored
sequence-contiguous), their scales, the scale blocks ``block_q`` / ``block_kv``, the output
dtype and whether every scale is positive. Tiles through tensor descriptors (kernel_options
``USE_TMA``) by default on sm_90, where the H200 measured them faster (docs/fp8.md).
"""
from __future__ import annotations

import torch

from ...codegen.fp8 import (FOLD_MIN_SCALE, FP8_MIN_DIM, FP8KernelSpec, fp8_forward_kernel,
                            quantize_kernel)
from ...codegen.spec import DTYPE_NAMES, next_power_of_two
from ...errors import InputError
from .. import autotune, binding, plans
from ..call import AttentionCall
from ..kernels import ModeSpec, generated_module
from ..launch import Step, cdiv
from ..layout import int32_addressable, output_like
from ..outputs import forward_grid, head_group, out_strides
from ..registry import KernelFamily, register
from ..tables import mask_blocks
from ..target import Target
from .ampere import int64_nodes


def default_tiles(head_dim_pad: int, target: Target, use_tma: bool = False,
                  head_dim_v_pad: int | None = None) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg); 64 x 64 under the interpreter.
    E = 128 with tensor descriptors: 64 x 128 tiles, 4 warps, 2 stages, capped at 168
    registers (three programs per SM, so one program's softmax overlaps the others' GEMMs);
    the others from sm_90 compile checks without spills (docs/fp8.md). Ev = 256 (padded
    ``head_dim_v_pad``, default E's): 64 rows over 8 warps (128 rows spill 1400..4400 bytes on
    sm_89 and sm_90)."""
    if target.interpret:
        return 64, 64, 4, 1, 0
    if (head_dim_v_pad or head_dim_pad) > 128:
        return (64, 64, 8, 2, 0) if use_tma else (64, 32, 8, 2, 0)
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


def tma_layout_ok(x) -> bool:
    """Tensor descriptors need unit stride along the loaded rows' last dim (E for Q and K, S
    for V) and 16-byte aligned bases and row strides (e4m3: one byte per element)."""
    unit = (x.q.stride(3), x.k.stride(3), x.v.stride(2)) == (1, 1, 1)
    strides = (*x.q.stride()[:3], *x.k.stride()[:3], x.v.stride(0), x.v.stride(1), x.v.stride(3))
    aligned = all(t.data_ptr() % 16 == 0 for t in (x.q, x.k, x.v))
    return unit and aligned and all(s % 16 == 0 for s in strides)


def use_tma(call: AttentionCall, target: Target, x) -> bool:
    """USE_TMA=True wherever the layout allows (the interpreter too: how CI tests it),
    False never, by default on sm_90."""
    setting = call.options.fwd.use_tma
    wanted = setting if setting is not None else target.is_sm90
    return bool(wanted) and tma_layout_ok(x)


def fp8_spec(x, call: AttentionCall, target: Target, return_lse: bool) -> FP8KernelSpec:
    L, E = x.q.shape[2], x.q.shape[3]
    S, Ev = x.k.shape[2], x.v.shape[3]
    tma = use_tma(call, target, x)
    block_m, block_n, warps, stages, cap = default_tiles(
        next_power_of_two(E, FP8_MIN_DIM), target, tma, next_power_of_two(Ev, FP8_MIN_DIM))
    q_blocks, kv_blocks = {"Q scale": x.block_q}, {"K/V scale": x.block_kv}
    mask = call.block_mask
    if mask is not None:
        sparse_q, sparse_kv = mask_blocks(mask)
        q_blocks["block_mask q"], kv_blocks["block_mask kv"] = sparse_q, sparse_kv
    options = call.options.fwd
    # the forward's rule: pinned tiles, warps or stages drop the default cap, a pinned cap wins
    cap = autotune.Pinned.of(options).apply((block_m, block_n, warps, stages, cap))[4]
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
        return_lse=return_lse, gqa_group=call.gqa_group, target=target.name, use_tma=tma,
        # (a smaller scale could take the folded factor to 0: -inf * 0 at masked scores)
        fold_qk_scale=(call.score is None and call.scale >= FOLD_MIN_SCALE
                       and bool(x.positive_scales)),
        wide_ints=int64_nodes(x.q, x.k, call), sinks_dtype=call.sinks_dtype)


class FP8Forward(KernelFamily):
    name = "fp8"
    direction = "fp8"
    features = frozenset({"sinks"})  # forward-only: no dropout

    def first_call(self, key, target: Target, call, x, return_lse: bool):
        spec = fp8_spec(x, call, target, return_lse)
        B, Hq, L, _ = x.q.shape
        loaded = generated_module(fp8_forward_kernel, spec, call.score, call.mask)
        fixed = {**binding.strides("q", "bhmd", x.q.stride()),
                 **binding.strides("k", "bhnd", x.k.stride()),
                 **binding.strides("v", "bhnd", x.v.stride()),
                 **binding.strides("o", "bhmd", out_strides(x.q, x.v)),
                 **binding.strides("qs_", "bh", x.q_scale.stride()[:2]),
                 **binding.strides("kvs_", "bh", x.k_scale.stride()[:2]),
                 **binding.tables("KV", "m", "n", call.block_mask, "kv", x.q.device),
                 "HQ": Hq, "L": L, "S": x.k.shape[2],
                 "HEAD_GROUP": head_group(call, x.q, x.k, x.v),
                 **binding.buffer_layout(call.score, call.mask)}
        step = Step(loaded.kernel(), forward_grid(B * Hq, cdiv(L, spec.block_m),
                                                  spec.has_block_mask),
                    spec.constexprs(call.score is not None), spec.launch_options(),
                    binding.Binder(loaded.names(), fixed))
        plan = plans.Plan(self, spec, (step,))
        plans.keep(call, key, plan)
        return self.run(plan, call, x, return_lse)

    def run(self, plan, call, x, return_lse: bool):
        B, Hq, L, _ = x.q.shape
        out = output_like(x.q, x.v.shape[3], dtype=x.dtype)
        lse = torch.empty(B, Hq, L, dtype=torch.float32, device=x.q.device) if return_lse \
            else None
        assert x.k_scale.stride() == x.v_scale.stride(), "K and V scales must share strides"
        plan.steps[0].launch_with(
            {"Q": x.q, "K": x.k, "V": x.v, "Q_SCALE": x.q_scale, "K_SCALE": x.k_scale,
             "V_SCALE": x.v_scale, "OUT": out, "LSE": lse if lse is not None else out,
             "sm_scale": float(call.scale), **binding.call_values(call)}, x.q.device)
        return out, lse


FP8 = register(FP8Forward())


def quantize_rows(x: torch.Tensor, block: int, signed_h: torch.Tensor | None,
                  out: torch.Tensor) -> torch.Tensor:
    """One fused pass: rotate (``x @ signed_h / sqrt(d)``; None: no rotation), per-block amax,
    e4m3 values into ``out`` (any strides, ``[B, H, N, d or E]``); returns the descales
    ``[B, H, nb]``."""
    B, H, N, _ = x.shape
    scale = torch.empty(B, H, cdiv(N, block), dtype=torch.float32, device=x.device)
    x = int32_addressable(x, "the tensor to quantize")  # (a copy where its rows lie far apart)
    if scale.numel() == 0:
        return scale
    interpret = x.device.type == "cpu"
    loaded = _quantize_module(interpret)
    args, launch = quantize_launch(loaded.names(), x, block, signed_h, out, scale, interpret)
    Step(loaded.kernel(), (scale.shape[2], B * H), {}, launch).launch(args, x.device)
    return scale


def quantize_launch(names, x: torch.Tensor, block: int, signed_h: torch.Tensor | None,
                    out: torch.Tensor, scale: torch.Tensor, interpret: bool
                    ) -> tuple[list, dict]:
    """``quantize_rows``'s launch of the kernel with parameters ``names``: its positional
    arguments and its constexprs with the launch options (the compile check builds the
    same launch)."""
    _, H, N, E = x.shape
    rotate = signed_h is not None
    e_pad = signed_h.shape[0] if rotate else next_power_of_two(E, 16)
    args = binding.Binder(names, {}).bind({  # without a rotation SCALE is SIGNED_H's placeholder
        "X": x, "X8": out, "SCALE": scale, "SIGNED_H": signed_h if rotate else scale,
        **binding.strides("x", "bhnd", x.stride()), **binding.strides("o", "bhnd", out.stride()),
        **binding.strides("s", "bh", scale.stride()[:2]), "H": H, "N": N,
        "inv_sqrt_d": 1.0 / e_pad ** 0.5})
    launch = dict(E=E, E_PAD=e_pad, E_OUT=out.shape[-1], BLOCK=block,
                  ROWS=min(block, 64 if e_pad >= 256 else 128), ROTATE=rotate,
                  DOT_IN_FP32=interpret or x.dtype == torch.float32,
                  EMULATE_FP8_CAST=interpret, num_warps=8 if e_pad >= 128 else 4)
    return args, launch


def _generate_quantize(spec: ModeSpec):
    return quantize_kernel()


def _quantize_module(interpret: bool):
    return generated_module(_generate_quantize, ModeSpec("quantize", interpret))
