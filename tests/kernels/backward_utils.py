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
                 with_out=False, sinks=None, dropout=None):
    """(dq, dk, dv, *buffer grads[, dsinks]) of flexfa for the given upstream gradients;
    ``sinks``: [Hq] logits (their gradient last); ``dropout``: (p, seed). ``with_out``: and
    the forward's (out, lse), as (grads, (out, lse))."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    targets, features = [q, k, v, *buffers], {}
    if sinks is not None:
        features["sinks"] = sinks.detach().requires_grad_(True)
        targets.append(features["sinks"])
    if dropout is not None:
        features["dropout_p"], features["dropout_seed"] = dropout
    out, lse = flexfa.flex_attention(q, k, v, score_mod, block_mask, scale=scale,
                                     enable_gqa=enable_gqa, return_lse=True,
                                     kernel_options=kernel_options, **features)
    outputs, grads = [out], [grad_out]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse)
    found = torch.autograd.grad(outputs, targets, grads, allow_unused=True)
    return (found, (out.detach(), lse.detach())) if with_out else found


def reference_run(q, k, v, score_mod=None, mask_mod=None, *, enable_gqa=False, buffers=(),
                  dtype=torch.float64, scale=None, sinks=None, keep=None, dropout_p=0.0):
    """The dense reference computed in ``dtype``, kept differentiable: (out, lse, grads),
    where grads(grad_out, grad_lse) gives (dq, dk, dv, *buffer grads[, dsinks]) by autograd
    through it (zeros where a target is unused), as often as asked (``keep``: the dropout
    mask flexfa.dropout_mask draws, with ``dropout_p``)."""
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    targets = [q, k, v, *buffers]
    if sinks is not None:
        sinks = sinks.detach().clone().requires_grad_(True)
        targets.append(sinks)
    out, lse = reference_attention(q, k, v, score_mod, mask_mod, scale=scale,
                                   enable_gqa=enable_gqa, dtype=dtype, sinks=sinks,
                                   dropout_mask=keep, dropout_p=dropout_p)

    def grads(grad_out, grad_lse=None):
        outputs, upstream = [out], [grad_out.to(dtype)]
        # (an lse that depends on no input, a constant score_mod's, adds no gradient)
        if grad_lse is not None and lse.requires_grad:
            outputs.append(lse)
            upstream.append(grad_lse.to(dtype))
        result = torch.autograd.grad(outputs, targets, upstream, allow_unused=True,
                                     retain_graph=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(result, targets)]
    return out.detach(), lse.detach(), grads


def check_backward(q, k, v, score_mod=None, mask_mod=None, block_mask=None, *,
                   enable_gqa=False, kernel_options=None, buffers=(), with_lse=False,
                   scale=None, seed=0, fudge=GRAD_FUDGE, sinks=None, dropout=None):
    """flexfa's out, lse and dq, dk, dv, buffer (and ``sinks``') gradients vs the float64
    reference (oracle: error <= fudge x the same-dtype eager reference's error + the dtype's
    floor); ``dropout``: (p, seed), the reference fed flexfa.dropout_mask. Returns flexfa's
    gradients.

    The backward (FlashAttention's) forms dS = P * (dP - delta) + P * dlse with delta =
    rowsum(dO * out) from the forward's out, rounded to q's dtype, where the exact gradient
    has the exact out: the two differ by P * (delta_exact - delta) in every dS, which sums
    to rowsum(dO * (out_exact - out)) per row in the gradient of a captured tensor that
    every score of a row reads, where the dS terms otherwise cancel (docs/training.md,
    "Precision of row-wide shifts"). So the gradients are compared with the float64
    gradients of the kernels' own out, which are the exact ones with the lse's upstream
    gradient shifted by that difference (P * dlse is where it enters; the sinks' term too),
    and out itself with the float64 out; the eager error they are allowed a multiple of
    stays measured against the exact gradients."""
    generator = torch.Generator().manual_seed(seed)
    B, Hq, L, _ = q.shape
    grad_out = torch.randn(B, Hq, L, v.shape[3], generator=generator).to(q.device, q.dtype)
    grad_lse = torch.randn(B, Hq, L, generator=generator).to(q.device) if with_lse else None
    kwargs = dict(grad_out=grad_out, grad_lse=grad_lse, enable_gqa=enable_gqa,
                  buffers=buffers, scale=scale)
    got, (out, lse) = flexfa_grads(q, k, v, score_mod, block_mask, kernel_options=kernel_options,
                                   with_out=True, sinks=sinks, dropout=dropout, **kwargs)
    keep = dropout_p = None
    if dropout is not None:
        dropout_p = dropout[0]
        keep = flexfa.dropout_mask(dropout[1], B, Hq, L, k.shape[2], dropout_p, device=q.device)
    reference = dict(enable_gqa=enable_gqa, buffers=buffers, scale=scale, sinks=sinks,
                     keep=keep, dropout_p=dropout_p or 0.0)
    exact_out, exact_lse, exact_grads = reference_run(q, k, v, score_mod, mask_mod, **reference)
    eager_out, eager_lse, eager_grads = reference_run(q, k, v, score_mod, mask_mod,
                                                      dtype=q.dtype, **reference)
    # the gradients' fudge: a guard that no forward error hides in the shifted reference
    assert_close_to_reference(out, exact_out, eager_out, fudge=fudge, name="out")
    assert_close_to_reference(lse, exact_lse, eager_lse, fudge=fudge, name="lse")
    shift = (grad_out.double() * (exact_out - out.double())).sum(-1)
    of_out = exact_grads(grad_out, shift if grad_lse is None else grad_lse.double() + shift)
    exact = exact_grads(grad_out, grad_lse)
    eager = eager_grads(grad_out, grad_lse)
    names = (["dq", "dk", "dv"] + [f"grad of captured tensor {i}" for i in range(len(buffers))]
             + (["dsinks"] if sinks is not None else []))
    likes = [q, k, v, *buffers] + ([sinks] if sinks is not None else [])
    for name, g, want, exact_g, same_dtype, like in zip(names, got, of_out, exact, eager, likes):
        assert g is not None, f"{name}: no gradient"
        assert g.shape == like.shape and g.dtype == like.dtype, (
            f"{name}: {tuple(g.shape)} {g.dtype}, expected {tuple(like.shape)} {like.dtype}")
        # a buffer's gradient has the buffer's dtype whatever q's: its oracle takes q's dtype
        # floor, or one unit in the last place of its own dtype at its size if that is more
        # (a float16 buffer's gradient near 3 cannot be closer than 2e-3)
        floor = None if name.startswith("d") and name != "dsinks" else max(
            _floor(q.dtype), torch.finfo(g.dtype).eps * float(want.abs().max()))
        assert_close_to_reference(g, want, same_dtype, fudge=fudge, floor=floor, name=name,
                                  eager_against=exact_g)
    return got


def draw_problem(draw, *, groups, max_len, head_dims, head_dims_v, blocks) -> dict:
    """The shapes, dtype, mods and block size of a random backward problem (a hypothesis
    composite's ``draw``): GQA groups, lengths 1..max_len, head dims and mask block sizes
    from the given choices; random smooth score_mods with learnable captured tensors and
    random mask_mods. The caller draws the options, lse gradient and seed (and features)."""
    from hypothesis import strategies as st

    from strategies import mask_mods, score_mods
    B = draw(st.sampled_from([1, 2]))
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from(groups))
    L, S = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    E, Ev = draw(st.sampled_from(head_dims)), draw(st.sampled_from(head_dims_v))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    score_mod = draw(st.none() | score_mods(B, Hq, L, S, smooth=True, grad_buffers=True,
                                            max_depth=3, max_buffers=2))
    mask_mod = draw(st.none() | mask_mods(B, Hq, L, S, max_depth=2, max_buffers=1))
    return dict(B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype, score_mod=score_mod,
                mask_mod=mask_mod, block=draw(st.sampled_from(blocks)))


def check_drawn_problem(p: dict):
    """check_backward on a drawn problem (test_backward_random's, test_feature_combinations'):
    B, Hq, Hkv, L, S, E, Ev, dtype, score_mod, mask_mod (a block mask of BLOCK_SIZE block),
    options, with_lse, seed, and optionally sinks and dropout; its shapes are noted for
    hypothesis's report."""
    from hypothesis import note

    from flexfa.blockmask import create_block_mask
    from forward_utils import make_qkv
    note(f"B={p['B']} Hq={p['Hq']} Hkv={p['Hkv']} L={p['L']} S={p['S']} E={p['E']} "
         f"Ev={p['Ev']} {p['dtype']} block={p['block']} options={p['options']} "
         f"lse={p['with_lse']} sinks={p.get('sinks')} dropout={p.get('dropout')}")
    q, k, v = make_qkv(p["B"], p["Hq"], p["Hkv"], p["L"], p["S"], p["E"], Ev=p["Ev"],
                       dtype=p["dtype"], seed=p["seed"])
    block_mask = None
    if p["mask_mod"] is not None:
        block_mask = create_block_mask(p["mask_mod"], p["B"], p["Hq"], p["L"], p["S"],
                                       device="cpu", BLOCK_SIZE=p["block"])
    score_mod = p["score_mod"]
    buffers = tuple(t for t in getattr(score_mod, "captured", {}).values() if t.requires_grad)
    return check_backward(q, k, v, score_mod, p["mask_mod"], block_mask, buffers=buffers,
                          enable_gqa=p["Hq"] != p["Hkv"], kernel_options=p["options"],
                          with_lse=p["with_lse"], seed=p["seed"], sinks=p.get("sinks"),
                          dropout=p.get("dropout"))


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
