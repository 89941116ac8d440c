"""The shared test reference and the one tolerance helper (DESIGN.md's oracle).

``reference_attention`` is dense attention computed through ``flexfa.frontend.evaluate`` on
``[B, H, L, S]`` grids (it wraps ``flexfa.reference.attention_reference``): differentiable in
q, k, v and captured tensors, so ``torch.autograd`` on it gives reference gradients. A row
with nothing to attend gives out = 0 and lse = -inf, never NaN. Each float64 call also runs
the mods as torch does on the same scores and index grids and fails where that differs from
the traced evaluation (``_mod_as_torch_runs_it``): the frontend the kernels are generated
from is not the oracle's only source.

``assert_close_to_reference(actual, ref64, eager)``: the error of flexfa against the float64
reference must be at most ``fudge`` times the error of the same computation done eagerly in
the kernel's dtype (against ``eager_against``, by default the same reference), plus a
``floor``. Infinite entries (lse of an empty row) must match
exactly, and flexfa must not produce NaN where the reference has none.
"""
from __future__ import annotations

import math

import torch

from flexfa.frontend import dense_mask, evaluate, index_grids, trace
from flexfa.reference import attention_reference, max_error

# per input dtype: the floor added to the bound (float32 accumulation in another order)
FLOORS = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 2e-5, torch.float64: 1e-10}
# bf16 results on the CPU (the interpreter, the Gluon emulator): at least two units in the
# last place of the largest value. Triton 3.6's interpreter casts float32 to bf16 by
# truncation, not to nearest as the GPU and torch do: one ulp, twice where a cast P feeds a
# product cast again (dV of a row with one key, whose eager error is 0)
BF16_CPU_ULPS = 2 * 2.0 ** -7


def reference_attention(q, k, v, score_mod=None, mask_mod=None, scale=None, enable_gqa=False,
                        dtype=torch.float64, **features):
    """(out, lse) of dense attention in ``dtype``; lse is natural-log, -inf for empty rows;
    ``features``: attention_reference's sinks, dropout_mask, dropout_p."""
    if dtype == torch.float64:  # (reference_pair's same-dtype call would repeat it exactly)
        _mod_as_torch_runs_it(q, k, score_mod, mask_mod, scale)
    return attention_reference(q, k, v, score_mod, mask_mod, scale=scale, enable_gqa=enable_gqa,
                               return_lse=True, dtype=dtype, **features)


def _mod_as_torch_runs_it(q, k, score_mod, mask_mod, scale) -> None:
    """The reference's scores come from flexfa's own frontend (trace, simplify, evaluate), as
    the kernels' do: a wrong rewrite or evaluator rule moves kernel and reference together.
    So every float64 reference also runs the mods as torch does, on the same scores and index
    grids, and fails where the two differ beyond the rounding of captured low-precision
    tensors (torch computes in their dtype, flexfa in float32: 2e-2 relative covers bf16),
    NaN and infinities (signed) matching exactly. A mod torch cannot run on tensors (Python
    control flow on values) is checked by its trace alone."""
    if score_mod is None and mask_mod is None:
        return
    try:
        B, Hq, L, E = q.shape
        S, Hkv = k.shape[2], k.shape[1]
        keys = k.detach().double().repeat_interleave(Hq // Hkv, dim=1)
        scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
        scores = q.detach().double() @ keys.transpose(-1, -2) * scale
    except Exception:  # bad inputs: attention_reference's checks name them
        return
    grids = index_grids(B, Hq, L, S, device=q.device)
    if score_mod is not None:
        try:
            direct = torch.as_tensor(score_mod(scores, *grids)).double()
        except Exception:  # not runnable by torch on tensors: the trace stands alone
            direct = None
        if direct is not None:
            traced = evaluate(trace(score_mod), score=scores, b=grids[0], h=grids[1],
                              q_idx=grids[2], kv_idx=grids[3], float_dtype=torch.float64)
            traced, direct = traced.expand(B, Hq, L, S), direct.expand(B, Hq, L, S)
            same = torch.isclose(traced, direct, rtol=2e-2, atol=1e-6, equal_nan=True)
            assert same.all(), (
                f"reference: score_mod {getattr(score_mod, '__name__', score_mod)} traced gives "
                f"{traced[~same][:4].tolist()} where torch running it gives "
                f"{direct[~same][:4].tolist()}")
    if mask_mod is not None:
        try:
            direct = torch.as_tensor(mask_mod(*grids)).bool()
        except Exception:
            return
        traced = dense_mask(trace(mask_mod), B, Hq, L, S, device=q.device)
        assert torch.equal(traced, direct.expand(B, Hq, L, S)), (
            f"reference: mask_mod {getattr(mask_mod, '__name__', mask_mod)} traced keeps "
            f"{int(traced.sum())} pairs where torch running it keeps "
            f"{int(direct.expand(B, Hq, L, S).sum())}")


def reference_pair(q, k, v, score_mod=None, mask_mod=None, **kwargs):
    """(float64 reference, same-dtype eager reference), each an (out, lse) pair."""
    exact = reference_attention(q, k, v, score_mod, mask_mod, dtype=torch.float64, **kwargs)
    eager = reference_attention(q, k, v, score_mod, mask_mod, dtype=q.dtype, **kwargs)
    return exact, eager


def assert_close_to_reference(actual: torch.Tensor, ref64: torch.Tensor,
                              eager_same_dtype: torch.Tensor, fudge: float = 4.0,
                              floor: float | None = None, name: str = "output",
                              eager_against: torch.Tensor | None = None) -> None:
    """error(actual, ref64) <= fudge * error(eager_same_dtype, eager_against) + floor, where
    eager_against is ref64 unless given (a float64 reference of what eager computes, where
    ref64 is that of what the kernels compute: check_backward's)."""
    assert actual.shape == ref64.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(ref64.shape)}"
    actual64, ref64 = actual.detach().double().cpu(), ref64.detach().double().cpu()
    eager64 = eager_same_dtype.detach().double().cpu()
    against64 = ref64 if eager_against is None else eager_against.detach().double().cpu()
    finite = ~torch.isinf(ref64) & ~torch.isnan(ref64)
    if floor is None:
        floor = FLOORS.get(actual.dtype, FLOORS.get(eager_same_dtype.dtype, 2e-3))
        if actual.dtype == torch.bfloat16 and actual.device.type == "cpu" and finite.any():
            floor = max(floor, BF16_CPU_ULPS * ref64[finite].abs().max().item())
    new_nans = torch.isnan(actual64) & ~torch.isnan(ref64)
    assert not new_nans.any(), f"{name}: {int(new_nans.sum())} NaN where the reference has none"
    infinite = torch.isinf(ref64)
    assert torch.equal(torch.isinf(actual64), infinite), (
        f"{name}: infinite entries differ from the reference (e.g. lse of empty rows)")
    assert torch.equal(actual64[infinite], ref64[infinite]), f"{name}: wrong sign of infinity"
    error = max_error(actual64[finite], ref64[finite])
    eager_finite = finite & torch.isfinite(eager64) & torch.isfinite(against64)
    eager_error = max_error(eager64[eager_finite], against64[eager_finite])
    bound = fudge * eager_error + floor
    assert error <= bound, (f"{name}: max error {error:.3e} vs float64 exceeds {fudge} x eager "
                            f"{actual.dtype} error {eager_error:.3e} + {floor:.1e} = {bound:.3e}")
