"""Helpers shared by the backward-kernel tests: one check of flexfa's output and gradients
(q, k, v, the score_mod's captured tensors that require grad, optionally through lse)
against the float64 dense reference and autograd of it, with the shared error oracle."""
from __future__ import annotations

import torch

import flexfa
from reference import assert_close_to_reference, reference_attention

# gradients sum over a row or a column: a little more rounding than out itself
GRAD_FUDGE = 6.0


def flexfa_grads(q, k, v, score_mod=None, block_mask=None, *, grad_out, grad_lse=None,
                 enable_gqa=False, kernel_options=None, buffers=(), scale=None,
                 with_out=False):
    """(dq, dk, dv, *buffer grads) of flexfa for the given upstream gradients (``with_out``:
    and the forward's out, as (grads, out))."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = flexfa.flex_attention(q, k, v, score_mod, block_mask, scale=scale,
                                     enable_gqa=enable_gqa, return_lse=True,
                                     kernel_options=kernel_options)
    outputs, grads = [out], [grad_out]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse)
    found = torch.autograd.grad(outputs, [q, k, v, *buffers], grads, allow_unused=True)
    return (found, out.detach()) if with_out else found


def reference_grads(q, k, v, score_mod=None, mask_mod=None, *, grad_out, grad_lse=None,
                    enable_gqa=False, buffers=(), dtype=torch.float64, scale=None):
    """The same gradients from autograd through the dense reference computed in ``dtype``."""
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out, lse = reference_attention(q, k, v, score_mod, mask_mod, scale=scale,
                                   enable_gqa=enable_gqa, dtype=dtype)
    outputs, grads = [out], [grad_out.to(dtype)]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse.to(dtype))
    result = torch.autograd.grad(outputs, [q, k, v, *buffers], grads, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(result, [q, k, v, *buffers])]


def check_backward(q, k, v, score_mod=None, mask_mod=None, block_mask=None, *,
                   enable_gqa=False, kernel_options=None, buffers=(), with_lse=False,
                   scale=None, seed=0, fudge=GRAD_FUDGE):
    """flexfa's out, dq, dk, dv and buffer gradients vs the float64 reference (oracle: error
    <= fudge x the same-dtype eager reference's error + the dtype's floor). Returns flexfa's
    gradients.

    The backward (FlashAttention's) forms dS = P * (dP - delta) + P * dlse with delta =
    rowsum(dO * out) from the forward's out, rounded to q's dtype, where the exact gradient
    has the exact out: the two differ by P * (delta_exact - delta) in every dS, which sums
    to rowsum(dO * (out_exact - out)) per row in a captured tensor's gradient that every
    score of a row reads (a score_mod adding a learnable constant: 26x the eager bf16
    error found by a random hypothesis run, where the dS terms otherwise cancel). So the
    gradients are compared with the float64 gradients of the kernels' own out, which are
    the exact ones with the lse's upstream gradient shifted by that difference (P * dlse
    is where it enters), and out itself with the float64 out; the eager error they are
    allowed a multiple of stays measured against the exact gradients."""
    generator = torch.Generator().manual_seed(seed)
    B, Hq, L, _ = q.shape
    grad_out = torch.randn(B, Hq, L, v.shape[3], generator=generator).to(q.device, q.dtype)
    grad_lse = torch.randn(B, Hq, L, generator=generator).to(q.device) if with_lse else None
    kwargs = dict(grad_out=grad_out, grad_lse=grad_lse, enable_gqa=enable_gqa,
                  buffers=buffers, scale=scale)
    got, out = flexfa_grads(q, k, v, score_mod, block_mask, kernel_options=kernel_options,
                            with_out=True, **kwargs)
    exact_out, _ = reference_attention(q, k, v, score_mod, mask_mod, scale=scale,
                                       enable_gqa=enable_gqa)
    eager_out, _ = reference_attention(q, k, v, score_mod, mask_mod, scale=scale,
                                       enable_gqa=enable_gqa, dtype=q.dtype)
    assert_close_to_reference(out, exact_out, eager_out, name="out")
    shift = (grad_out.double() * (exact_out - out.double())).sum(-1)
    shifted = dict(kwargs, grad_lse=shift if grad_lse is None else grad_lse.double() + shift)
    of_out = reference_grads(q, k, v, score_mod, mask_mod, **shifted)
    exact = reference_grads(q, k, v, score_mod, mask_mod, **kwargs)
    eager = reference_grads(q, k, v, score_mod, mask_mod, dtype=q.dtype, **kwargs)
    names = ["dq", "dk", "dv"] + [f"grad of captured tensor {i}" for i in range(len(buffers))]
    for name, g, want, exact_g, same_dtype, like in zip(names, got, of_out, exact, eager,
                                                        [q, k, v, *buffers]):
        assert g is not None, f"{name}: no gradient"
        assert g.shape == like.shape and g.dtype == like.dtype, (
            f"{name}: {tuple(g.shape)} {g.dtype}, expected {tuple(like.shape)} {like.dtype}")
        # a buffer's gradient has the buffer's dtype whatever q's: its oracle takes q's dtype
        # floor, or one unit in the last place of its own dtype at its size if that is more
        # (a float16 buffer's gradient near 3 cannot be closer than 2e-3)
        floor = None if name.startswith("d") else max(
            _floor(q.dtype), torch.finfo(g.dtype).eps * float(want.abs().max()))
        assert_close_to_reference(g, want, same_dtype, fudge=fudge, floor=floor, name=name,
                                  eager_against=exact_g)
    return got


def _floor(dtype):
    from reference import FLOORS
    return FLOORS[dtype]


def record_backward_specs(monkeypatch) -> list:
    """Record the BackwardSpec of every backward pass from now on (the list is returned)."""
    from flexfa.runtime.families import backward as backward_family

    specs = []
    original = backward_family.backward_spec

    def recording(*args, **kwargs):
        specs.append(original(*args, **kwargs))
        return specs[-1]
    monkeypatch.setattr(backward_family, "backward_spec", recording)
    return specs


def check_ragged_gqa_alibi_causal(dtype, *, seed: int, block_size: int, tile: int,
                                  kernel_options=None):
    """The backward of a hard case against the reference: L, S not multiples of the tiles nor
    of the blocks (with 64-token blocks: two on each side, the second ragged); E = 48 (padded
    to 64), Ev = 32; GQA 2 (each kv program serves two query heads); two batches; a causal
    block mask with full and partial blocks; an ALiBi score_mod reading a captured tensor that
    needs no gradient; a gradient through lse. ``kernel_options`` add to the tiles."""
    from flexfa import mods
    from flexfa.blockmask import create_block_mask
    from forward_utils import make_qkv

    B, Hq, Hkv, L, S, E, Ev = 2, 4, 2, 100, 72, 48, 32
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype=dtype, seed=seed)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs() / 16.0

    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu",
                                   BLOCK_SIZE=block_size)
    check_backward(q, k, v, alibi, mods.causal, block_mask, enable_gqa=True, with_lse=True,
                   kernel_options={"BLOCK_M": tile, "BLOCK_N": tile, **(kernel_options or {})})
