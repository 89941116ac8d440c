"""Every benchmark case on the GPU: against the float64 reference at small shapes, and against
SDPA / FlexAttention at benchmark shapes (bf16, H=16). Run on the H200 with
``python -m pytest -m gpu tests/gpu``; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flexfa
from flexfa.bench_cases import VARIANTS, bench_variants
from reference import assert_close_to_reference, reference_pair

pytestmark = pytest.mark.gpu


def _qkv(B, H, S, D, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=generator)
            .requires_grad_() for _ in range(3)]


def _run(q, k, v, score_mod, mask_mod):
    B, _, S, _ = q.shape
    mask = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
    out = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)
    do = torch.randn_like(out)
    out.backward(do)
    return out, [t.grad for t in (q, k, v)], do


def _relerr(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_float64_reference_small(variant, D):
    L = 1000  # not a tile multiple
    score_mod, mask_mod = bench_variants(L, 4, "cuda")[variant]
    q, k, v = _qkv(1, 4, L, D, seed=D)
    out, grads, do = _run(q, k, v, score_mod, mask_mod)
    (out64, _), (out_bf16, _) = reference_pair(q.detach(), k.detach(), v.detach(), score_mod,
                                               mask_mod)
    assert_close_to_reference(out, out64, out_bf16, name=f"{variant} out")
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    from flexfa.reference import attention_reference
    attention_reference(qd, kd, vd, score_mod, mask_mod).backward(do.double())
    for name, got, want in zip("qkv", grads, (qd.grad, kd.grad, vd.grad)):
        assert _relerr(got, want) < 1.5e-2, f"{variant} d{name}: {_relerr(got, want):.2e}"


def _dense_mask(mask_mod, S):
    idx = torch.arange(S, device="cuda")
    return mask_mod(0, 0, idx[:, None], idx[None, :])


@pytest.mark.parametrize("S, D", [(8192, 128), (2048, 64)])
@pytest.mark.parametrize("variant", ["full", "causal"])
def test_matches_sdpa_at_benchmark_shapes(variant, S, D):
    B = 16384 // S
    q, k, v = _qkv(B, 16, S, D, seed=S + D)
    score_mod, mask_mod = bench_variants(S, 16, "cuda")[variant]
    out, grads, do = _run(q, k, v, score_mod, mask_mod)
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=variant == "causal")
    ref.backward(do)
    assert _relerr(out, ref) < 1e-2
    for name, got, want in zip("qkv", grads, (qs.grad, ks.grad, vs.grad)):
        assert _relerr(got, want) < 2e-2, f"d{name}: {_relerr(got, want):.2e}"


@pytest.mark.parametrize("variant", ["sliding", "alibi", "document", "prefix"])
def test_matches_sdpa_with_dense_mask(variant):
    S, D, H = 2048, 128, 16
    q, k, v = _qkv(1, H, S, D, seed=7)
    score_mod, mask_mod = bench_variants(S, H, "cuda")[variant]
    out, grads, do = _run(q, k, v, score_mod, mask_mod)
    keep = _dense_mask(mask_mod, S)
    bias = torch.zeros(1, H, S, S, device="cuda")
    if score_mod is not None:  # alibi: score + slope[h] * (kv - q), an additive bias
        idx = torch.arange(S, device="cuda")
        heads = torch.arange(H, device="cuda")[:, None, None]
        bias = score_mod(torch.zeros(()), 0, heads, idx[:, None], idx[None, :])[None] * 1.0
    bias = bias.masked_fill(~keep, float("-inf")).to(torch.float32)
    qs, ks, vs = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias)
    ref.backward(do.float())
    assert _relerr(out, ref) < 1e-2
    for name, got, want in zip("qkv", grads, (qs.grad, ks.grad, vs.grad)):
        assert _relerr(got, want) < 2e-2, f"d{name}: {_relerr(got, want):.2e}"


def softcap_against_torch_flex(device: str, S: int, D: int, backward: bool = True) -> None:
    """flexfa's softcap+causal fwd+bwd against torch's flex_attention run eagerly (its math
    reference: no Inductor, so no Triton compile in a process that imported Triton with
    TRITON_INTERPRET=1, as tests/conftest.py does; compiling it there failed on the H200
    with Inductor CompilationError, benchmarks/results/raw/run6_softcap_test.log). The
    benchmark compares against the compiled FlexAttention on every run. torch's eager
    flex_attention has no backward on the CPU: ``backward=False`` there."""
    import warnings

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    generator = torch.Generator(device=device).manual_seed(11)
    q, k, v = (torch.randn(2, 4, S, D, device=device, dtype=torch.bfloat16, generator=generator)
               .requires_grad_(backward) for _ in range(3))
    score_mod, mask_mod = bench_variants(S, 4, device)["softcap"]
    mask = flexfa.create_block_mask(mask_mod, 2, None, S, S, device=device)
    out = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)
    qs, ks, vs = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))
    torch_mask = create_block_mask(mask_mod, 2, None, S, S, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that eager flex_attention is slow
        ref = flex_attention(qs, ks, vs, score_mod=score_mod, block_mask=torch_mask)
    assert _relerr(out, ref) < 1e-2
    if not backward:
        return
    do = torch.randn_like(out)
    out.backward(do)
    ref.backward(do)
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), (qs.grad, ks.grad, vs.grad)):
        assert _relerr(got, want) < 2e-2, f"d{name}: {_relerr(got, want):.2e}"


def test_softcap_matches_flex_attention():
    softcap_against_torch_flex("cuda", 2048, 128)
