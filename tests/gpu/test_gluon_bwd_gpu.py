"""The Gluon backward family (gluon_bwd, opt-in: GLUON_BACKWARD=True) on an sm_90 GPU:
dq, dk, dv against the float64 reference on the benchmark's variants (dense, causal, softcap,
ALiBi, document, sliding window, prefix LM), ragged lengths, GQA, rows whose lse is -inf and
lse gradients; the plan must be the Gluon one.

It has never run before this file: a barrier-phase mistake hangs the GPU instead of failing,
so a tiny forward + backward runs first in a subprocess under a time limit, and every other
test needs it to pass. Run the file itself under a limit too:
    timeout 300 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gluon_bwd_gpu.py
"""
from __future__ import annotations


import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.bench_cases import learnable_mod
from flexfa.runtime import plans
from flexfa.runtime.families.gluon_bwd import DQ_CHUNKS, dq_slots

from kernels.backward_utils import check_backward
from gpu.gluon_safety import case_inputs, run_safely
from kernels.forward_utils import make_qkv

pytestmark = pytest.mark.gpu
FORCED = {"BACKEND": "GLUON", "GLUON_BACKWARD": True}
SAFETY = """
import torch, flexfa
for L, mask_mod in ((256, None), (300, flexfa.mods.causal)):
    q, k, v = (torch.randn(1, 2, L, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    mask = None if mask_mod is None else flexfa.create_block_mask(mask_mod, None, None, L, L,
                                                                  device="cuda")
    options = {"BACKEND": "GLUON", "GLUON_BACKWARD": True}
    for p in (0.0, 0.2):  # and the keep mask drawn again
        out = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=options,
                                    dropout_p=p)
        out.sum().backward()
    torch.cuda.synchronize()
    print("ok", all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v)))
    # E = 256: bwd_gluon_wide.tmpl's barriers
    q, k, v = (torch.randn(1, 2, L, 256, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=options)
    out.sum().backward()
    torch.cuda.synchronize()
    print("ok", all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v)))
"""


@pytest.fixture(scope="module")
def safe():
    """A tiny dense and causal call in a subprocess that is killed after 150 s."""
    run_safely(SAFETY, 150, "backward")


def _alibi_causal(heads, device):
    return mods.alibi(heads, device=device), mods.causal


def _document(heads, device):
    return None, mods.document([300, 200, 500], device=device)


def _sliding_256(b, h, q_idx, kv_idx):  # the benchmark's sliding window, scaled down
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)


def _prefix_300(b, h, q_idx, kv_idx):  # the benchmark's prefix LM, scaled down
    return (kv_idx < 300) | (q_idx >= kv_idx)


def _empty_rows(score, b, h, q_idx, kv_idx):
    # every fifth query row scores -inf everywhere: its lse is -inf, which the kernel must
    # read as +inf (P = 0, no NaN) in full blocks and without a block mask too
    return torch.where(q_idx % 5 == 2, float("-inf"), score)


CASES = {  # name: (B, Hq, Hkv, L, S, E, mods(heads, device) -> (score_mod, mask_mod)); bf16
    "dense": (2, 4, 4, 1024, 1024, 128, lambda h, d: (None, None)),
    "dense_d64_fp16": (1, 4, 4, 512, 512, 64, lambda h, d: (None, None)),
    "causal": (2, 4, 4, 1000, 1000, 128, lambda h, d: (None, mods.causal)),
    "softcap_causal": (1, 4, 4, 1024, 1024, 128, lambda h, d: (mods.softcap(30.0), mods.causal)),
    "alibi_causal": (1, 4, 4, 768, 768, 128, _alibi_causal),
    "document": (1, 4, 4, 1000, 1000, 64, _document),
    "ragged": (1, 4, 4, 300, 1100, 128, lambda h, d: (None, None)),
    "gqa_causal": (1, 8, 2, 640, 640, 128, lambda h, d: (None, mods.causal)),
    "sliding": (1, 4, 4, 1500, 1500, 128, lambda h, d: (None, _sliding_256)),
    "prefix": (1, 4, 4, 1200, 1200, 128, lambda h, d: (None, _prefix_300)),
    "empty_rows": (1, 4, 4, 700, 700, 128, lambda h, d: (_empty_rows, None)),
    "empty_rows_causal": (2, 4, 2, 600, 600, 128, lambda h, d: (_empty_rows, mods.causal)),
    # head dims padded to 128 / 64 (TMA's zero fill past E; stores and reduce-adds cut at E)
    "causal_d96": (2, 4, 4, 1000, 1000, 96, lambda h, d: (None, mods.causal)),
    "softcap_causal_d80": (1, 4, 4, 700, 700, 80,
                           lambda h, d: (mods.softcap(30.0), mods.causal)),
    "dense_d48_fp16": (1, 4, 4, 500, 600, 48, lambda h, d: (None, None)),
    "gqa_alibi_causal_d96": (1, 8, 2, 640, 640, 96, _alibi_causal),
    # E = 256 (bwd_gluon_wide.tmpl: 64-key programs, dK / dV / dQ split along E; dQ by atomic
    # adds), and 192 padded to it
    "dense_d256": (1, 4, 4, 1000, 1100, 256, lambda h, d: (None, None)),
    "causal_d256": (2, 4, 4, 1024, 1024, 256, lambda h, d: (None, mods.causal)),
    "softcap_causal_d256": (1, 4, 4, 1000, 1000, 256,
                            lambda h, d: (mods.softcap(30.0), mods.causal)),
    "gqa_alibi_causal_d256": (1, 8, 2, 640, 640, 256, _alibi_causal),
    "document_d256": (1, 4, 4, 1000, 1000, 256, _document),
    "empty_rows_causal_d256": (1, 4, 2, 600, 600, 256, lambda h, d: (_empty_rows, mods.causal)),
    "causal_d192": (1, 4, 4, 1000, 1000, 192, lambda h, d: (None, mods.causal)),
    # DeepSeek's MLA shape: E = 192 with Ev = 128 (dV's columns 64 a consumer)
    "causal_d192_ev128": (2, 4, 4, 1000, 1000, (192, 128), lambda h, d: (None, mods.causal)),
    "softcap_causal_d192_ev128": (1, 4, 4, 1024, 1024, (192, 128),
                                  lambda h, d: (mods.softcap(30.0), mods.causal)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gluon_backward_matches_reference(safe, name):
    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES[name], name)
    Hq, Hkv = q.shape[1], k.shape[1]
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv,
                   kernel_options=FORCED, with_lse=name == "causal")
    assert "gluon_bwd" in [p.family.name for p in plans.PLANS.values()]


DROPOUT_CASES = ("causal", "ragged", "gqa_causal", "softcap_causal", "document",
                 "dense_d64_fp16", "causal_d96", "empty_rows_causal",
                 # the wide kernel's keep mask, drawn in each consumer's [queries, keys] tile
                 "dense_d256", "softcap_causal_d256", "gqa_alibi_causal_d256",
                 "causal_d192_ev128")


@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_gluon_backward_dropout_matches_the_reference_and_triton(safe, name):
    """dropout_p on the Gluon backward: the consumers draw the forward's keep mask again (dq,
    dk, dv against the float64 reference fed flexfa.dropout_mask)
    and agree with the Triton backward's gradients for the same seed."""
    from flexfa.reference import attention_reference

    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES[name], name)
    B, Hq, L, _ = q.shape
    S, Hkv = k.shape[2], k.shape[1]
    p, seed = 0.3, (20261203, 7)
    grad = torch.randn(B, Hq, L, v.shape[3], device="cuda", dtype=q.dtype)
    found = {}
    for label, options in (("gluon", FORCED), ("triton", {"GLUON_BACKWARD": False})):
        plans.PLANS.clear()
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flexfa.flex_attention(*inputs, score_mod=score_mod, block_mask=block_mask,
                                    enable_gqa=Hq != Hkv, dropout_p=p, dropout_seed=seed,
                                    kernel_options=options)
        found[label] = torch.autograd.grad(out, inputs, grad)
        families = [pl.family.name for pl in plans.PLANS.values()]
        assert ("gluon_bwd" in families) == (label == "gluon"), (label, families)
    keep = flexfa.dropout_mask(seed, B, Hq, L, S, p, device="cuda")
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = attention_reference(*ref, score_mod, mask_mod, enable_gqa=Hq != Hkv,
                               dropout_mask=keep, dropout_p=p)
    wanted = torch.autograd.grad(want, ref, grad.double())
    for label, got, triton_, w in zip(("dq", "dk", "dv"), found["gluon"], found["triton"],
                                      wanted):
        bound = 8e-2 * max(w.abs().max().item(), 1.0)
        assert (got.double() - w).abs().max().item() <= bound, label
        error = (got.float() - triton_.float()).norm() / triton_.float().norm().clamp_min(1e-6)
        assert float(error) < 1e-2, (label, float(error))


SINKS_CASES = ("causal", "gqa_causal", "empty_rows_causal", "dense_d64_fp16", "causal_d96",
               "causal_d256", "gqa_alibi_causal_d256", "causal_d192_ev128")


@pytest.mark.parametrize("name", SINKS_CASES)
def test_gluon_backward_with_sinks_matches_reference(safe, name):
    """Attention sinks on the Gluon backward (the forward as 'AUTO' chooses it): dq, dk, dv,
    d sinks and (causal) the lse gradient's path against the float64 reference; the kernels
    are the ones without sinks, d sinks comes from lse and delta."""
    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES[name], name)
    Hq, Hkv = q.shape[1], k.shape[1]
    sinks = (torch.randn(Hq, device="cuda") * 2).requires_grad_()
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv,
                   kernel_options={"GLUON_BACKWARD": True}, sinks=sinks,
                   with_lse=name == "causal")
    assert "gluon_bwd" in [p.family.name for p in plans.PLANS.values()]


@pytest.mark.parametrize("name", ["causal_d256", "dense_d256", "document_d256",
                                  "gqa_alibi_causal_d256", "causal_d192_ev128", "causal_d192"])
def test_gluon_backward_captured_tensor_gradients_match_reference(safe, name):
    """Learnable captured tensors on the Gluon backward (GLUON_BACKWARD=True, head dims
    padding to 256): the five tensors of bench_cases.learnable_mod (a relative bias, a
    head scale, a 0-d gain, a row bias row[h, q_idx] and a key bias col[kv_idx]: sums along
    one axis of the tile) with the case's mask_mod, every gradient against the float64
    reference, lse's gradient in (without it a row bias's exact gradient is 0). (E <= 128,
    whose kernel then passed the shared memory, takes the Triton backward.)"""
    q, k, v, _, mask_mod, block_mask = case_inputs(CASES[name], name)
    Hq, Hkv = q.shape[1], k.shape[1]
    score_mod, buffers = learnable_mod(Hq, q.shape[2], k.shape[2], seed=4, device="cuda")
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv,
                   kernel_options=FORCED, buffers=buffers, with_lse=True)
    assert "gluon_bwd" in [p.family.name for p in plans.PLANS.values()]


@pytest.mark.parametrize("name, options", [
    ("causal_d96", {}), ("softcap_causal_d80", {}), ("gqa_alibi_causal_d96", {}),
    ("causal_d96", {"GLUON_BWD_EARLY_DP": True})])
def test_gluon_backward_qk_trim_matches_reference(safe, name, options):
    """GLUON_BWD_QK_TRIM: S^T and dP^T over E's 64 + 32 columns at 96 and 80, against the
    float64 reference and the padded kernel's gradients: dK and dV bit for bit (the zero
    columns' wgmma k-steps add exact zeros), dQ up to the order of its fp32 reduce-adds."""
    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES[name], name)
    Hq, Hkv = q.shape[1], k.shape[1]
    trim = {**FORCED, **options, "GLUON_BWD_QK_TRIM": True}
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv,
                   kernel_options=trim)
    assert all(p.spec.qk_trim for p in gluon_backward_plans(trim, k))
    grad = torch.randn(q.shape[:3] + (v.shape[3],), device="cuda", dtype=q.dtype)
    found = []
    for opts in ({**FORCED, **options, "GLUON_BWD_QK_TRIM": False}, trim):
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flexfa.flex_attention(*inputs, score_mod=score_mod, block_mask=block_mask,
                                    enable_gqa=Hq != Hkv, kernel_options=opts)
        found.append(torch.autograd.grad(out, inputs, grad))
    (dq0, dk0, dv0), (dq1, dk1, dv1) = found
    torch.testing.assert_close(dk1, dk0, atol=0, rtol=0)
    torch.testing.assert_close(dv1, dv0, atol=0, rtol=0)
    error = (dq1.float() - dq0.float()).norm() / dq0.float().norm().clamp_min(1e-6)
    assert float(error) < 1e-3, float(error)


@pytest.mark.parametrize("name", ["causal", "gqa_causal", "softcap_causal"])
def test_gluon_backward_three_stage_ring_matches_reference(safe, name):
    """GLUON_BWD_STAGES=3 at E = 128 (226 KB of shared memory, the deepest that fits): its
    ring counts (it % 3 and the dS pairs' it % 2 together) over a walk longer than 12 tiles."""
    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES[name], name)
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=q.shape[1] != k.shape[1],
                   kernel_options={**FORCED, "GLUON_BWD_STAGES": 3})
    found = [p for p in plans.PLANS.values() if p.family.name == "gluon_bwd"]
    assert found and all(p.spec.stages == 3 for p in found)


@pytest.mark.parametrize("name, options", [
    ("dense", {"GLUON_BWD_DQ_CHUNKS": 1}),   # the whole accumulator, one launch
    # B = 2, Hkv = 4: 3 pairs' room, 2 slots of one pair on two streams (8 parts)
    ("dense", {"GLUON_BWD_DQ_CHUNKS": 3}),
    # ... one after another: parts of 3 heads and 1
    ("dense", {"GLUON_BWD_DQ_CHUNKS": 3, "GLUON_BWD_OVERLAP": False}),
    ("dense", {"GLUON_BWD_DQ_CHUNKS": 8}),   # one (batch, head) pair per launch
    # the default chunks at B = 2, Hkv = 4 (2 pairs' room), on two streams or one
    ("causal", {}),
    ("causal", {"GLUON_BWD_OVERLAP": False}),
    ("gqa_causal", {"GLUON_BWD_DQ_CHUNKS": 1}),
    ("causal", {"GLUON_BWD_EARLY_DP": True}),
    ("dense", {"GLUON_BWD_EARLY_DP": True, "GLUON_BWD_STAGES": 3}),
    ("softcap_causal", {"GLUON_BWD_EARLY_DP": True}),
])
def test_gluon_backward_options_match_reference(safe, name, options):
    """The accumulator in parts of the (batch, kv head) pairs (launches from B0 / HKV0 that
    are never specialized: the later parts reuse the first launch's compiled kernel; by
    default on two streams, each into its own slot of the accumulator) and dP^T issued with
    S^T."""
    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES[name], name)
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=q.shape[1] != k.shape[1],
                   kernel_options={**FORCED, **options})
    gluon_backward_plans(options, k)


def gluon_backward_plans(options: dict, k) -> list:
    """The Gluon backward's plans of the call just made (at least one), each with the
    accumulator slots ``options`` ask for at k's batch and kv heads."""
    found = [p for p in plans.PLANS.values() if p.family.name == "gluon_bwd"]
    assert found
    B, Hkv = k.shape[:2]
    chunks = options.get("GLUON_BWD_DQ_CHUNKS", DQ_CHUNKS)
    want = dq_slots(B, Hkv, chunks, options.get("GLUON_BWD_OVERLAP", True))
    assert all(p.fixed["slots"] == want for p in found)
    return found


@pytest.mark.parametrize("mask_mod, E, family", [
    (None, 128, "gluon_bwd"), (mods.causal, 128, "gluon_bwd"), (mods.causal, 96, "gluon_bwd"),
    (None, 256, "triton_bwd"), (mods.causal, 256, "triton_bwd")])
def test_default_backward_is_gluon_past_4096(safe, mask_mod, E, family):
    """GLUON_BACKWARD's default ('AUTO') takes the Gluon backward for dense and masked calls
    with L and S past 4096 (runtime.families.gluon_bwd.AUTO_CLASSES) at head dims 64, 80 to
    128; at 256 the Triton backward (its one-loop dK/dV tiles under a block mask, or without
    one through the full-block walk, faster there): no kernel_options, a ragged length
    (the bounds-checked code), the accumulator in its default parts (B * Hkv = 4: one pair
    per part)."""
    from flexfa import create_block_mask
    q, k, v = make_qkv(2, 2, 2, 4160, 4160, E, dtype=torch.bfloat16, device="cuda")
    block_mask = (create_block_mask(mask_mod, None, None, 4160, 4160, device="cuda")
                  if mask_mod else None)
    plans.PLANS.clear()
    check_backward(q, k, v, None, mask_mod, block_mask)
    assert family in [p.family.name for p in plans.PLANS.values()]


@pytest.mark.parametrize("E, Ev, L, mask_mod, dropout, options", [
    (192, 128, 4160, mods.causal, None, None),      # the MLA shape at a ragged length
    (192, 128, 8192, mods.causal, (0.1, 7), None),  # the MLA shape with dropout
    # dropout at 256 without a block mask from 1024, at ragged lengths from 1000 (under one
    # the Triton backward's one loop since wb_38feb86)
    (256, 256, 2048, None, (0.1, 7), None), (256, 256, 1000, None, (0.1, 7), None),
    (192, 128, 2048, mods.causal, (0.1, 7), None),  # the MLA shape with dropout from 2048
    # with the full-block walk off: no block mask from 2048, at ragged lengths from 1000
    (256, 256, 2048, None, None, {"BWD_FULL_WALK": False}),
    (256, 256, 1000, None, None, {"BWD_FULL_WALK": False}),
])
def test_default_backward_takes_the_wide_kernel_where_measured(safe, E, Ev, L, mask_mod,
                                                               dropout, options):
    """'AUTO' (no GLUON_BACKWARD) takes the wide Gluon backward where the twenty-seventh
    session's H200 A/B (we_001b317) and the thirtieth's H100 A/B (dr_32693bf) measured it
    faster: every gradient against the float64 reference there."""
    from flexfa import create_block_mask
    q, k, v = make_qkv(1, 2, 2, L, L, E, Ev, dtype=torch.bfloat16, device="cuda")
    block_mask = (create_block_mask(mask_mod, None, None, L, L, device="cuda")
                  if mask_mod else None)
    plans.PLANS.clear()
    check_backward(q, k, v, None, mask_mod, block_mask, dropout=dropout, kernel_options=options)
    assert "gluon_bwd" in [p.family.name for p in plans.PLANS.values()]


def test_learnable_bias_falls_back_to_the_triton_backward(safe):
    q, k, v = make_qkv(1, 2, 2, 512, 512, 128, dtype=torch.bfloat16, device="cuda")
    bias = torch.zeros(2, device="cuda", requires_grad=True)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    plans.PLANS.clear()
    check_backward(q, k, v, head_bias, None, None, kernel_options=FORCED, buffers=(bias,))
    assert "triton_bwd" in [p.family.name for p in plans.PLANS.values()]


def test_parts_on_two_streams_replay_in_a_cuda_graph(safe):
    """The accumulator's parts on two streams fork from the capturing stream and join it: a
    captured forward + backward (B = 2, Hkv = 4: two slots, eight parts) replays on new
    inputs to what an eager call gives."""
    import flexfa
    B, H, L, E = 2, 4, 1024, 128
    q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)
    mask = flexfa.create_block_mask(mods.causal, None, None, L, L, device="cuda")

    def step():
        out = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=FORCED)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))
    plans.PLANS.clear()
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # compiles and plans outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(warm)
    found = [p for p in plans.PLANS.values() if p.family.name == "gluon_bwd"]
    assert found and all(p.fixed["slots"] == 2 and len(p.fixed["parts"]) == 8 for p in found)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (1, 2):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        with torch.no_grad():
            for t in (q, k, v, grad):
                t.copy_(torch.randn(t.shape, device="cuda", generator=generator))
        graph.replay()
        want = step()
        for name, got, expected in zip(("out", "dq", "dk", "dv"), captured, want):
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2,
                                       msg=lambda m: f"replay {seed} {name}: {m}")


def non_finite_positions(length: int) -> tuple:
    """(inf row, NaN row, both row, inf key, NaN key, both's inf key, both's NaN key) at L = S
    = ``length``: the third row's two keys in two key tiles (1024: rows 300, 309, 917, keys 7,
    11, 5 and 700; 256: rows 100, 109, 217, keys 7, 11, 5 and 200)."""
    if length == 1024:
        return 300, 309, 917, 7, 11, 5, 700
    return length // 2 - 28, length // 2 - 19, length - 39, 7, 11, 5, length - 56


def _non_finite_mod(length: int):
    inf_row, nan_row, both_row, inf_key, nan_key, both_inf, both_nan = \
        non_finite_positions(length)

    def non_finite(score, b, h, q_idx, kv_idx):
        score = torch.where((q_idx == inf_row) & (kv_idx == inf_key), float("inf"), score)
        score = torch.where((q_idx == nan_row) & (kv_idx == nan_key), float("nan"), score)
        score = torch.where((q_idx == both_row) & (kv_idx == both_inf), float("inf"), score)
        return torch.where((q_idx == both_row) & (kv_idx == both_nan), float("nan"), score)
    return non_finite


def non_finite_results(options: dict, device: str = "cuda", dtype=torch.bfloat16,
                       length: int = 1024) -> dict:
    """out, lse, dq, dk, dv of a causal call at L = S = ``length``, E = 128 whose score_mod
    puts a +inf, a NaN and both into three rows (``non_finite_positions``), under
    ``options``."""
    generator = torch.Generator(device=device).manual_seed(20261204)
    q, k, v, grad = (torch.randn(1, 2, length, 128, device=device, dtype=dtype,
                                 generator=generator) for _ in range(4))
    inputs = [t.requires_grad_() for t in (q, k, v)]
    mask = flexfa.create_block_mask(mods.causal, None, None, length, length, device=device)
    out, lse = flexfa.flex_attention(*inputs, score_mod=_non_finite_mod(length),
                                     block_mask=mask, return_lse=True, kernel_options=options)
    return dict(zip(("out", "lse", "dq", "dk", "dv"),
                    (out, lse, *torch.autograd.grad(out, inputs, grad))))


def assert_same_non_finite(found: dict, want: dict, length: int = 1024) -> None:
    """The same NaN and +-inf pattern in every tensor, the finite values close; the rows of
    non_finite_results as docs/training.md has them (torch's)."""
    for name, got in found.items():
        got, expected = got.detach().float().cpu(), want[name].detach().float().cpu()
        assert torch.equal(got.isnan(), expected.isnan()), name
        assert torch.equal(got.isinf(), expected.isinf()), name
        assert torch.equal(got[got.isinf()], expected[expected.isinf()]), name
        finite = expected.isfinite()
        error = (got[finite] - expected[finite]).norm() / expected[finite].norm().clamp_min(1e-6)
        assert float(error) < 2e-2, (name, float(error))
    inf_row, nan_row, both_row = non_finite_positions(length)[:3]
    lse, dv = want["lse"][0, 0].cpu(), want["dv"].cpu()
    assert lse[inf_row] == float("inf") and lse[nan_row].isnan() and lse[both_row].isnan()
    # dv: NaN for every key the NaN rows visit (causal: 0..both_row), finite past them
    assert dv[:, :, :both_row + 1].isnan().all() and dv[:, :, both_row + 1:].isfinite().all()
    assert want["dq"][0, 0].cpu().isnan().any(-1).nonzero().flatten().tolist() == [
        inf_row, nan_row, both_row]


def test_gluon_non_finite_rows_follow_the_triton_families(safe):
    """A +inf score, a NaN score and both in one row (in two key tiles): the Gluon forward
    and backward give the Hopper forward's and Triton backward's NaN and inf pattern."""
    plans.PLANS.clear()
    found = non_finite_results(FORCED)
    families = {p.family.name for p in plans.PLANS.values()}
    assert {"gluon", "gluon_bwd"} <= families, families
    plans.PLANS.clear()
    want = non_finite_results({"BACKEND": "HOPPER", "GLUON_BACKWARD": False})
    assert "gluon_bwd" not in {p.family.name for p in plans.PLANS.values()}
    assert_same_non_finite(found, want)
