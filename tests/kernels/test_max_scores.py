"""``return_aux=AuxRequest(max_scores=True)``: each row's largest score_mod(q.k * scale) over
the keys its mask keeps, from both bf16 templates (Ampere-class and Hopper, under the
interpreter), against the float64 reference; no gradient, and out / lse / gradients as without
it."""
import math

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest

import flexfa
from flexfa.errors import InputError
from flexfa.reference import attention_reference
from kernels.forward_utils import TEMPLATES, make_qkv


@pytest.fixture(params=sorted(TEMPLATES))
def template(request):
    return request.param


def late_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx + 20  # rows 0..19 attend to nothing


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def alibi(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * 0.25 * (q_idx - kv_idx)


CASES = {  # name: (score_mod, mask_mod, scale, Hq, Hkv, L, S, dtype)
    "plain_ragged": (None, None, None, 2, 2, 40, 56, torch.bfloat16),
    "softcap_late_causal": (softcap, late_causal, None, 2, 2, 64, 64, torch.bfloat16),
    "alibi_gqa_fp32": (alibi, late_causal, 0.3, 4, 2, 48, 64, torch.float32),
    # no score_mod and scale <= 0: the scores are formed before the softmax (scores_first)
    "negative_scale": (None, None, -0.2, 1, 1, 32, 48, torch.float32),
}


@pytest.mark.parametrize("name", CASES)
def test_max_scores_match_the_reference(template, name):
    score_mod, mask_mod, scale, Hq, Hkv, L, S, dtype = CASES[name]
    q, k, v = make_qkv(1, Hq, Hkv, L, S, 32, dtype=dtype, seed=3)
    block_mask = (flexfa.create_block_mask(mask_mod, 1, Hq, L, S, device="cpu", BLOCK_SIZE=32)
                  if mask_mod else None)
    options = TEMPLATES[template]

    def call(**aux):
        return flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                     scale=scale, enable_gqa=Hq != Hkv, kernel_options=options,
                                     return_aux=AuxRequest(**aux))
    if template == "hopper" and dtype == torch.float32:  # the Ampere family's case
        with pytest.raises(InputError, match="BACKEND='HOPPER' cannot run this call.*fp16/bf16"):
            call(lse=True, max_scores=True)
        return
    # the first launch, then the cached one (the plan's launch)
    (out, aux), (_, again) = [call(lse=True, max_scores=True) for _ in range(2)]
    assert torch.equal(aux.max_scores, again.max_scores)
    _, lse64, max64 = attention_reference(q, k, v, score_mod, mask_mod, scale=scale,
                                          enable_gqa=Hq != Hkv, return_lse=True,
                                          return_max=True)
    maxs = aux.max_scores
    assert maxs.dtype == torch.float32 and maxs.shape == (1, Hq, L)
    empty = torch.isinf(max64) & (max64 < 0)
    assert torch.equal(torch.isneginf(maxs), empty)  # -inf exactly for the empty rows
    assert (mask_mod is late_causal) == bool(empty.any())
    # float32 scores of the same products: a few ulps of the largest score
    torch.testing.assert_close(maxs.double()[~empty], max64[~empty], rtol=1e-5, atol=1e-5)
    assert (maxs.double()[~empty] <= lse64[~empty] + 1e-5).all()  # max <= logsumexp
    assert (lse64[~empty] - maxs.double()[~empty] <= math.log(S) + 1e-5).all()
    # the same output and lse as a call without max_scores
    out_only, aux_lse = call(lse=True)
    assert aux_lse.max_scores is None
    assert torch.equal(out, out_only) and torch.equal(aux.lse, aux_lse.lse)


def test_max_scores_without_lse_and_without_gradient(template):
    """max_scores alone; under autograd it has no gradient, and out's gradients are those of
    a call without it (float32 for the Ampere family, bfloat16 for the Hopper one)."""
    dtype = torch.bfloat16 if template == "hopper" else torch.float32
    options = TEMPLATES[template]
    q, k, v = make_qkv(1, 2, 2, 32, 48, 16, dtype=dtype, seed=5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, aux = flexfa.flex_attention(*leaves, score_mod=softcap, kernel_options=options,
                                     return_aux=AuxRequest(max_scores=True))
    assert aux.lse is None and not aux.max_scores.requires_grad
    max64 = attention_reference(q, k, v, softcap, return_max=True)[1]
    torch.testing.assert_close(aux.max_scores.double(), max64, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    plain = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_grads = torch.autograd.grad(
        flexfa.flex_attention(*plain, score_mod=softcap, kernel_options=options).square().sum(),
        plain)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)

