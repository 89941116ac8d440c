"""The Gluon forward family on an sm_90 GPU, forced with BACKEND="GLUON": against the float64
reference and the Hopper family on the benchmark's variants (dense, causal, sliding window,
softcap, ALiBi, document), ragged lengths, GQA, fully masked rows and captured tensors; each
also with the consumers' ping-pong (GLUON_PINGPONG: one tile, odd and even tile counts, a
row block with no tile), some with out through a TMA store (GLUON_TMA_STORE), each and
cases of many heads (several work tiles per program, some with no key tile) on the persistent
grid (GLUON_PERSISTENT; True and "DYNAMIC", its tiles from an atomic counter, also with the
heads in groups of HEAD_GROUP), also with ping-pong, all bit-equal to the plain kernel.

A barrier-phase mistake hangs the GPU instead of failing: a tiny call runs first in a
subprocess under a time limit, and every other test needs it to pass. Run the file itself
under a limit too:
    timeout 600 python -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gluon_gpu.py
"""
from __future__ import annotations


import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.runtime import plans

from kernels.backward_utils import check_backward
from gpu.gluon_safety import case_inputs, run_safely
from kernels.forward_utils import check_forward, make_qkv

pytestmark = pytest.mark.gpu
FORCED = {"BACKEND": "GLUON"}
OPTIONS = {"plain": FORCED, "pingpong": {**FORCED, "GLUON_PINGPONG": True},
           "tma_store": {**FORCED, "GLUON_TMA_STORE": True},
           "pingpong_tma_store": {**FORCED, "GLUON_PINGPONG": True, "GLUON_TMA_STORE": True},
           "persistent": {**FORCED, "GLUON_PERSISTENT": True},
           "persistent_tma_store": {**FORCED, "GLUON_PERSISTENT": True, "GLUON_TMA_STORE": True},
           "persistent_pingpong": {**FORCED, "GLUON_PERSISTENT": True, "GLUON_PINGPONG": True},
           # the work tiles from an atomic counter
           "dynamic": {**FORCED, "GLUON_PERSISTENT": "DYNAMIC"},
           "dynamic_pingpong_tma_store": {**FORCED, "GLUON_PERSISTENT": "DYNAMIC",
                                          "GLUON_PINGPONG": True, "GLUON_TMA_STORE": True},
           # the dynamic order's heads one and three at a time (three: a smaller last group)
           "dynamic_group1": {**FORCED, "GLUON_PERSISTENT": "DYNAMIC", "HEAD_GROUP": 1},
           "dynamic_group3": {**FORCED, "GLUON_PERSISTENT": "DYNAMIC", "HEAD_GROUP": 3},
           "static_max": {**FORCED, "GLUON_STATIC_MAX": True},
           "pingpong_static_max": {**FORCED, "GLUON_PINGPONG": True, "GLUON_STATIC_MAX": True},
           # the static max is on by default: the running row max of a bounded score_mod
           "running_max": {**FORCED, "GLUON_STATIC_MAX": False},
           # Q K^T over E's 32-column slices alone: the same wgmma k-steps less the zero ones
           "qk_trim": {**FORCED, "GLUON_QK_TRIM": True},
           "padded": {**FORCED, "GLUON_QK_TRIM": False}}
SAFETY = """
import torch, flexfa
mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, 384, 384, device="cuda")
# 3 tiles per row block, 1, 2 and 3 with the mask; 96 heads: 288 work tiles, 2 or 3 for each
# persistent program
for heads, options in ((2, ("GLUON_PINGPONG", "GLUON_TMA_STORE")),
                       (96, ("GLUON_PERSISTENT", "GLUON_PINGPONG")),
                       (96, ("GLUON_PERSISTENT",))):
    q, k, v = (torch.randn(1, heads, 384, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    for block_mask in (None, mask):
        for on in (False, True):
            # the last entry's persistent grid takes its tiles from the atomic counter
            dynamic = len(options) == 1 and on
            out = flexfa.flex_attention(q, k, v, block_mask=block_mask, kernel_options={
                "BACKEND": "GLUON", **{key: "DYNAMIC" if dynamic else on for key in options}})
            torch.cuda.synchronize()
            print("ok", bool(torch.isfinite(out).all()))
"""


@pytest.fixture(scope="module")
def safe():
    """Tiny dense and causal calls in a subprocess that is killed after 180 s."""
    run_safely(SAFETY, 180, "forward")


def _alibi_causal(heads, device):
    return mods.alibi(heads, device=device), mods.causal


def _document(lengths):
    def make(heads, device):
        return None, mods.document(lengths, device=device)
    return make


def _empty_prefix(b, h, q_idx, kv_idx):
    # rows before 130 attend to nothing: out 0, lse -inf
    return (q_idx >= 130) & (kv_idx <= q_idx)


CASES = {  # name: (B, Hq, Hkv, L, S, E, mods(heads, device) -> (score_mod, mask_mod)); bf16
    "dense": (2, 4, 4, 1000, 1000, 128, lambda h, d: (None, None)),
    "dense_fp16": (1, 4, 4, 1024, 1024, 128, lambda h, d: (None, None)),
    "dense_d64": (1, 4, 4, 512, 512, 64, lambda h, d: (None, None)),
    "causal": (2, 4, 4, 1000, 1000, 128, lambda h, d: (None, mods.causal)),
    "sliding": (1, 4, 4, 2048, 2048, 128, lambda h, d: (None, mods.sliding_window(256))),
    "softcap_causal": (1, 4, 4, 1024, 1024, 128, lambda h, d: (mods.softcap(30.0), mods.causal)),
    "alibi_causal": (1, 4, 4, 768, 768, 128, _alibi_causal),
    "document": (1, 4, 4, 1000, 1000, 64, _document([300, 200, 500])),
    "ragged": (1, 4, 4, 300, 1100, 128, lambda h, d: (None, None)),
    "gqa_causal": (1, 8, 2, 640, 640, 128, lambda h, d: (None, mods.causal)),
    "empty_rows": (1, 2, 2, 384, 384, 128, lambda h, d: (None, _empty_prefix)),
    "softcap_empty_rows": (1, 2, 2, 384, 384, 128,
                           lambda h, d: (mods.softcap(30.0), _empty_prefix)),
    # E = 256: 64-key tiles, a 64 x 256 accumulator per consumer warpgroup
    "dense_d256": (1, 4, 4, 1000, 1000, 256, lambda h, d: (None, None)),
    "causal_d256": (2, 4, 4, 1024, 1024, 256, lambda h, d: (None, mods.causal)),
    "softcap_causal_d256": (1, 4, 4, 768, 768, 256,
                            lambda h, d: (mods.softcap(30.0), mods.causal)),
    "document_d256": (1, 4, 4, 1000, 1000, 256, _document([300, 200, 500])),
    # padded head dims: TMA fills the columns past E with zeros; Ev < EV_PAD stores masked
    "causal_d192_ev128": (2, 4, 4, 1000, 1000, (192, 128), lambda h, d: (None, mods.causal)),
    "softcap_causal_d192_ev128": (1, 4, 4, 1024, 1024, (192, 128),
                                  lambda h, d: (mods.softcap(30.0), mods.causal)),
    "causal_d96": (1, 4, 4, 1000, 1000, 96, lambda h, d: (None, mods.causal)),
    "dense_d80": (1, 4, 4, 1024, 1024, 80, lambda h, d: (None, None)),
    "document_d48": (1, 4, 4, 1000, 1000, 48, _document([300, 200, 500])),
}
# more work tiles than the H200's 132 SMs: each persistent program walks several (plain and
# ping-pong run them too)
MANY_TILES = {
    "many_causal": (2, 16, 16, 2048, 2048, 128, lambda h, d: (None, mods.causal)),
    "many_ragged": (2, 16, 16, 1000, 1100, 128, lambda h, d: (None, None)),
    "many_document": (1, 64, 64, 1000, 1000, 64, _document([300, 200, 500])),
    "many_empty_rows": (4, 16, 16, 384, 384, 128, lambda h, d: (None, _empty_prefix)),
}
CASES.update(MANY_TILES)


# (case, options): every case plain, with ping-pong and on the persistent grid; the TMA store
# on even lengths (all rows by TMA) and ragged ones (the last row block's plain stores), alone
# and with ping-pong or the persistent grid
OPTION_CASES = ([(name, "plain") for name in CASES] + [(name, "pingpong") for name in CASES]
                + [(name, "tma_store") for name in ("dense", "dense_fp16", "ragged",
                                                    "causal_d192_ev128", "dense_d80")]
                + [(name, "pingpong_tma_store") for name in (
                    "dense_d64", "causal", "softcap_causal", "document", "gqa_causal",
                    "empty_rows")]
                + [(name, "persistent") for name in CASES]
                + [(name, "persistent_tma_store") for name in (
                    "dense", "ragged", "many_causal", "many_ragged", "many_empty_rows")]
                + [(name, "persistent_pingpong") for name in (
                    "causal", "softcap_causal", "document", "many_causal", "many_document",
                    "many_empty_rows")]
                + [(name, "dynamic") for name in CASES]
                + [(name, "dynamic_pingpong_tma_store") for name in (
                    "causal", "ragged", "many_causal", "many_ragged", "many_document",
                    "many_empty_rows")]
                + [(name, group) for group in ("dynamic_group1", "dynamic_group3")
                   for name in ("causal", "sliding", "gqa_causal", "many_causal",
                                "many_document", "many_empty_rows")]
                # GLUON_STATIC_MAX: softcap's bound subtracted (empty rows: sum 0)
                + [(name, "static_max") for name in (
                    "softcap_causal", "softcap_empty_rows", "softcap_causal_d256",
                    "softcap_causal_d192_ev128")]
                + [("softcap_causal", "pingpong_static_max")]
                + [(name, "running_max") for name in ("softcap_causal", "softcap_empty_rows")]
                + [(name, "qk_trim") for name in ("causal_d192_ev128", "softcap_causal_d192_ev128",
                                                  "causal_d96", "dense_d80")])


@pytest.mark.parametrize("name, option", OPTION_CASES)
def test_gluon_matches_reference_and_hopper(safe, name, option):
    forced = OPTIONS[option]
    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES[name], name)
    Hq, Hkv = q.shape[1], k.shape[1]
    plans.PLANS.clear()
    out, lse = check_forward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv,
                             kernel_options=forced)
    assert [p.family.name for p in plans.PLANS.values()] == ["gluon"]
    hopper = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                   enable_gqa=Hq != Hkv, kernel_options={"BACKEND": "HOPPER"})
    error = (out.float() - hopper.float()).norm() / hopper.float().norm().clamp_min(1e-6)
    assert float(error) < 5e-3, float(error)
    if name.endswith("empty_rows"):
        assert bool((out[:, :, :130] == 0).all()) and bool((lse[:, :, :130] == -torch.inf).all())
    # the cached plan gives the same result
    again = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                  enable_gqa=Hq != Hkv, kernel_options=forced)
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    found = [p for p in plans.PLANS.values() if p.family.name == "gluon"]
    if "static_max" in option:  # the bound, not the row max, subtracted: rounding differs
        assert found and all(p.spec.static_max is not None for p in found)
    elif option == "running_max":
        assert found and all(p.spec.static_max is None for p in found)
    elif option != "plain":  # when GEMMs issue and how out is stored, not what is computed
        # (the trim against the padded kernel: the zero columns' k-steps add exact zeros)
        base = OPTIONS["padded" if option == "qk_trim" else "plain"]
        plain = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      enable_gqa=Hq != Hkv, kernel_options=base)
        torch.testing.assert_close(out, plain, atol=0, rtol=0)


@pytest.mark.parametrize("option", ["plain", "pingpong_tma_store", "persistent_tma_store"])
def test_gluon_row_max_and_pinned_tiles(safe, option):
    forced = OPTIONS[option]
    q, k, v = make_qkv(1, 2, 2, 512, 512, 128, dtype=torch.bfloat16, device="cuda")
    mask = flexfa.create_block_mask(mods.causal, None, None, 512, 512, device="cuda",
                                    BLOCK_SIZE=(128, 64))
    options = {**forced, "BLOCK_N": 64, "num_stages": 3}
    out, aux = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=options,
                                     return_aux=flexfa.AuxRequest(lse=True, max_scores=True))
    ref, ref_aux = flexfa.flex_attention(q, k, v, block_mask=mask,
                                         kernel_options={"BACKEND": "HOPPER"},
                                         return_aux=flexfa.AuxRequest(lse=True, max_scores=True))
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(aux.lse, ref_aux.lse, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(aux.max_scores, ref_aux.max_scores, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("S, E, mask_mod, family", [
    (2048, 128, None, "gluon"), (8192, 128, mods.causal, "gluon"),
    (8192, 128, mods.sliding_window(512), "gluon"),
    (2048, 128, mods.causal, "gluon"), (8192, 64, mods.causal, "gluon"),
    (4096, 64, mods.causal, "hopper"), (8192, 256, mods.causal, "gluon"),
    (2048, 256, None, "gluon"), (4096, (192, 128), mods.causal, "gluon"),
    (2048, 96, None, "gluon")])
def test_auto_takes_gluon_where_measured_faster_and_trains(safe, S, E, mask_mod, family):
    """By default (no BACKEND) E=128 dense, sparse and masked calls, E = 64 masked calls of long
    keys, and E=256, 192 / 128 and 96 calls from L = S = 2048, run the Gluon forward, the
    Triton backward takes its out and lse: forward and gradients against the reference."""
    E, Ev = E if isinstance(E, tuple) else (E, E)
    q, k, v = make_qkv(1, 2, 2, S, S, E, Ev=Ev, dtype=torch.bfloat16, device="cuda")
    mask = None if mask_mod is None else flexfa.create_block_mask(mask_mod, None, None, S, S,
                                                                  device="cuda")
    plans.PLANS.clear()
    check_forward(q, k, v, None, mask_mod, mask)
    assert [p.family.name for p in plans.PLANS.values()] == [family]
    check_backward(q, k, v, None, mask_mod, mask)


def test_auto_takes_gluon_for_chunked_prefill_and_trains(safe):
    """512 queries at the end of 8192 keys, 32 query heads over 8 (128 programs on the H200's
    132 SMs): by default the Gluon forward, unsplit; forward and gradients against the
    reference. With 8 query heads (32 programs) the Hopper family splits the keys instead."""
    L, S = 512, 8192

    def causal_at_offset(b, h, q_idx, kv_idx):
        return q_idx + (S - L) >= kv_idx
    mask = flexfa.create_block_mask(causal_at_offset, None, None, L, S, device="cuda")
    for heads, family in ((32, "gluon"), (8, "hopper")):
        q, k, v = make_qkv(1, heads, 8, L, S, 128, dtype=torch.bfloat16, device="cuda")
        plans.PLANS.clear()
        check_forward(q, k, v, None, causal_at_offset, mask, enable_gqa=heads != 8)
        assert [p.family.name for p in plans.PLANS.values()] == [family]
        if family == "gluon":  # the Triton backward from the Gluon forward's out and lse
            check_backward(q, k, v, None, causal_at_offset, mask, enable_gqa=True)


def test_gluon_static_max_trains(safe):
    """The backward reads the static forward's lse (the bound + log2 of the row sum): softcap
    + causal gradients against the float64 reference."""
    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES["softcap_causal"],
                                                           "softcap_causal")
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask,
                   kernel_options=OPTIONS["static_max"])
    assert any(p.family.name == "gluon" and p.spec.static_max is not None
               for p in plans.PLANS.values())


SINKS_CASES = [("causal", "plain"), ("ragged", "tma_store"), ("gqa_causal", "pingpong"),
               ("document", "dynamic"), ("softcap_causal", "static_max"),
               ("causal_d256", "plain"), ("causal_d192_ev128", "persistent_pingpong"),
               ("many_empty_rows", "persistent"), ("empty_rows", "plain")]


@pytest.mark.parametrize("name, option", SINKS_CASES)
def test_gluon_sinks_match_the_reference_and_hopper(safe, name, option):
    """Attention sinks on the Gluon forward (HAS_SINKS: each row's sink joins its
    denominator in the epilogue): out and lse against the float64 reference (rows with
    nothing to attend: out 0, lse = the sink), the row max the scores' own as the Hopper
    family's, and out close to the Hopper family's."""
    from flexfa.reference import attention_reference

    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES[name], name)
    Hq, Hkv = q.shape[1], k.shape[1]
    sinks = torch.randn(Hq, device="cuda") * 2
    with_max = option != "static_max"
    aux = flexfa.AuxRequest(lse=True, max_scores=with_max)
    plans.PLANS.clear()
    out, got = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                     enable_gqa=Hq != Hkv, sinks=sinks, return_aux=aux,
                                     kernel_options=OPTIONS[option])
    assert [pl.family.name for pl in plans.PLANS.values()] == ["gluon"]
    want, want_lse = attention_reference(q.double(), k.double(), v.double(), score_mod,
                                         mask_mod, enable_gqa=Hq != Hkv, return_lse=True,
                                         sinks=sinks.double())
    assert (out.double() - want).abs().max().item() <= 4e-2 * max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got.lse.double(), want_lse, atol=2e-3, rtol=2e-3)
    hopper, stats = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                          enable_gqa=Hq != Hkv, sinks=sinks, return_aux=aux,
                                          kernel_options={"BACKEND": "HOPPER"})
    error = (out.float() - hopper.float()).norm() / hopper.float().norm().clamp_min(1e-6)
    assert float(error) < 5e-3, float(error)
    if with_max:
        torch.testing.assert_close(got.max_scores, stats.max_scores, atol=1e-3, rtol=1e-3)


DROPOUT_CASES = [("causal", "plain"), ("ragged", "plain"), ("gqa_causal", "pingpong"),
                 ("document", "persistent"), ("softcap_causal", "static_max"),
                 ("causal_d256", "plain"), ("causal_d192_ev128", "persistent_pingpong"),
                 ("many_causal", "persistent"), ("empty_rows", "plain")]


@pytest.mark.parametrize("name, option", DROPOUT_CASES)
def test_gluon_dropout_matches_the_reference_and_hopper(safe, name, option):
    """dropout_p on the Gluon forward: its keep mask is flexfa.dropout_mask's (out against
    the float64 reference fed that mask), the Hopper family's (out close to its out with the
    same seed), the same on a second call, and the Triton backward draws it again (gradients
    of the first cases against the reference)."""
    from flexfa.reference import attention_reference

    q, k, v, score_mod, mask_mod, block_mask = case_inputs(CASES[name], name)
    B, Hq, L, _ = q.shape
    S, Hkv = k.shape[2], k.shape[1]
    p, seed = 0.3, (20261203, 7)
    plans.PLANS.clear()
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flexfa.flex_attention(*inputs, score_mod=score_mod, block_mask=block_mask,
                                     enable_gqa=Hq != Hkv, return_lse=True, dropout_p=p,
                                     dropout_seed=seed, kernel_options=OPTIONS[option])
    assert [pl.family.name for pl in plans.PLANS.values()] == ["gluon"]
    keep = flexfa.dropout_mask(seed, B, Hq, L, S, p, device="cuda")
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want, want_lse = attention_reference(*ref_inputs, score_mod, mask_mod, enable_gqa=Hq != Hkv,
                                         return_lse=True, dropout_mask=keep, dropout_p=p)
    scale = want.abs().max().item()
    assert (out.double() - want).abs().max().item() <= 4e-2 * max(scale, 1.0)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=2e-3)
    hopper = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                   enable_gqa=Hq != Hkv, dropout_p=p, dropout_seed=seed,
                                   kernel_options={"BACKEND": "HOPPER"})
    error = ((out.detach().float() - hopper.detach().float()).norm()
             / hopper.detach().float().norm().clamp_min(1e-6)).item()
    assert error < 5e-3, error
    again = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                  enable_gqa=Hq != Hkv, dropout_p=p, dropout_seed=seed,
                                  kernel_options=OPTIONS[option])
    torch.testing.assert_close(again, out.detach(), atol=0, rtol=0)
    if name in ("causal", "ragged", "gqa_causal", "causal_d256"):
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs, grad)
        wanted = torch.autograd.grad(want, ref_inputs, grad.double())
        for label, g, w in zip(("dq", "dk", "dv"), got, wanted):
            bound = 8e-2 * max(w.abs().max().item(), 1.0)
            assert (g.double() - w).abs().max().item() <= bound, label
