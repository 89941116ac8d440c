"""The Gluon forward and backward families on CPU tensors, through flexfa's emulator
(kernel_options GLUON_EMULATE; runtime.gluon_emulator): the sm_90 source the GPU compiles,
its index arithmetic, shared-memory data flow and barrier protocol run against the float64
reference, on the GPU tests' variants scaled down (tests/gpu/test_gluon_gpu.py,
test_gluon_bwd_gpu.py): dense, causal, sliding window, softcap, ALiBi, document, ragged
lengths, GQA, empty rows, head dims 48 to 256, every forward option (ping-pong, TMA store,
persistent and dynamic grids, static max) bit-equal to the plain kernel, and the backward's
dropout, ring depths, accumulator parts and early dP^T. Registers, layouts, wgmma's
asynchrony and speed stay the GPU tests' to check."""
from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.bench_cases import learnable_mod
from flexfa.errors import InputError
from flexfa.runtime import plans

from gpu.gluon_safety import case_inputs
from gpu.test_gluon_bwd_gpu import (_alibi_causal, _empty_rows, assert_same_non_finite,
                                    gluon_backward_plans, non_finite_results)
from gpu.test_gluon_gpu import _empty_prefix
from kernels.backward_utils import check_backward
from kernels.forward_utils import check_forward, make_qkv

EMULATE = {"GLUON_EMULATE": True}
FORCED = {**EMULATE, "BACKEND": "GLUON"}
BACKWARD = {**FORCED, "GLUON_BACKWARD": True}
OPTIONS = {"plain": FORCED, "pingpong": {**FORCED, "GLUON_PINGPONG": True},
           "tma_store": {**FORCED, "GLUON_TMA_STORE": True},
           "pingpong_tma_store": {**FORCED, "GLUON_PINGPONG": True, "GLUON_TMA_STORE": True},
           "persistent": {**FORCED, "GLUON_PERSISTENT": True},
           "persistent_pingpong": {**FORCED, "GLUON_PERSISTENT": True, "GLUON_PINGPONG": True},
           "dynamic": {**FORCED, "GLUON_PERSISTENT": "DYNAMIC"},
           "dynamic_tma_store": {**FORCED, "GLUON_PERSISTENT": "DYNAMIC",
                                 "GLUON_TMA_STORE": True},
           "dynamic_group1": {**FORCED, "GLUON_PERSISTENT": "DYNAMIC", "HEAD_GROUP": 1},
           "static_max": {**FORCED, "GLUON_STATIC_MAX": True},
           "running_max": {**FORCED, "GLUON_STATIC_MAX": False},
           "qk_trim": {**FORCED, "GLUON_QK_TRIM": True},
           "padded": {**FORCED, "GLUON_QK_TRIM": False}}


def _none(heads, device):
    return None, None


def _causal(heads, device):
    return None, mods.causal


def _softcap_causal(heads, device):
    return mods.softcap(30.0), mods.causal


def _document(heads, device):
    return None, mods.document([100, 60, 140], device=device)


CASES = {  # name: (B, Hq, Hkv, L, S, E, mods(heads, device)); bf16 unless the name ends fp16
    "dense": (1, 2, 2, 200, 300, 128, _none),
    "dense_even": (1, 2, 2, 256, 256, 64, _none),
    "dense_fp16": (1, 2, 2, 128, 200, 64, _none),
    "causal": (2, 2, 2, 300, 300, 64, _causal),
    "sliding": (1, 2, 2, 384, 384, 64, lambda h, d: (None, mods.sliding_window(100))),
    "softcap_causal": (1, 2, 2, 256, 256, 128, _softcap_causal),
    "alibi_causal": (1, 2, 2, 256, 200, 64, _alibi_causal),
    "document": (1, 2, 2, 300, 300, 64, _document),
    "gqa_causal": (1, 4, 2, 256, 256, 64, _causal),
    "empty_rows": (1, 2, 2, 256, 256, 64, lambda h, d: (None, _empty_prefix)),
    "softcap_empty_rows": (1, 2, 2, 256, 256, 64,
                           lambda h, d: (mods.softcap(30.0), _empty_prefix)),
    "dense_d256": (1, 1, 1, 200, 150, 256, _none),
    "causal_d256": (1, 1, 1, 256, 256, 256, _causal),
    "causal_d192_ev128": (1, 1, 1, 200, 200, (192, 128), _causal),
    "dense_d80": (1, 1, 1, 200, 130, 80, _none),
    # the backward's E = 256 kernel (bwd_gluon_wide.tmpl): 64-key programs, dK / dV / dQ split
    # along E between the consumers; 192 and 160 pad to it
    "softcap_d256": (1, 2, 2, 200, 200, 256, lambda h, d: (mods.softcap(30.0), None)),
    "softcap_causal_d256": (1, 2, 2, 256, 256, 256, _softcap_causal),
    "gqa_causal_d256": (1, 4, 1, 300, 300, 256, _causal),
    "gqa_dense_d256": (1, 4, 2, 200, 260, 256, _none),
    "alibi_causal_d256": (1, 2, 2, 256, 200, 256, _alibi_causal),
    "dense_d192": (1, 1, 1, 200, 130, 192, _none),
    "softcap_causal_d96": (1, 2, 2, 200, 200, 96, _softcap_causal),
    # three slices of Q K^T under GLUON_QK_TRIM (128 + 64 + 32)
    "causal_d224": (1, 1, 1, 200, 200, 224, _causal),
    "document_d160": (1, 1, 1, 300, 300, 160, _document),
    # DeepSeek's MLA shape (E = 192, Ev = 128) and 256 / 128: dV's columns 64 a consumer
    "softcap_d256_ev128": (1, 2, 2, 200, 260, (256, 128),
                           lambda h, d: (mods.softcap(30.0), None)),
    "gqa_alibi_causal_d192_ev128": (1, 4, 2, 256, 256, (192, 128), _alibi_causal),
    "document_d48": (1, 1, 1, 300, 300, 48, _document),
}
# more work tiles (B * Hq * q tiles: 140) than the 132 SMs a CPU plan assumes: some persistent
# programs walk two, some static-grid tiles have no key tile under the prefix mask
MANY = {"many_empty_rows": (1, 70, 70, 256, 128, 64, lambda h, d: (None, _empty_prefix))}

FORWARD_CASES = ([(name, "plain") for name in CASES]
                 + [(name, "pingpong") for name in ("dense", "causal", "softcap_causal",
                                                    "document", "empty_rows", "causal_d256")]
                 + [(name, "tma_store") for name in ("dense", "dense_fp16",
                                                     "causal_d192_ev128", "dense_d80")]
                 + [(name, "pingpong_tma_store") for name in ("causal", "gqa_causal")]
                 + [(name, "persistent") for name in ("dense", "causal", "document",
                                                      "many_empty_rows")]
                 + [(name, "dynamic") for name in ("causal", "sliding", "gqa_causal",
                                                   "many_empty_rows")]
                 + [("dense", "dynamic_tma_store")]
                 + [(name, "dynamic_group1") for name in ("causal", "gqa_causal")]
                 + [(name, "static_max") for name in ("softcap_causal", "softcap_empty_rows")]
                 + [(name, "running_max") for name in ("softcap_causal", "softcap_empty_rows")]
                 + [(name, "qk_trim") for name in ("dense_d80", "document_d160",
                                                   "causal_d192_ev128", "dense_d192",
                                                   "causal_d224", "causal_d256")]
                 + [(name, "padded") for name in ("dense_d80", "causal_d192_ev128")])


def _inputs(name: str):
    return case_inputs({**CASES, **MANY}[name], name, device="cpu")


def _families() -> list[str]:
    return sorted({p.family.name for p in plans.PLANS.values()})


@pytest.mark.parametrize("name, option", FORWARD_CASES)
def test_gluon_forward_emulated_matches_reference(name, option):
    forced = OPTIONS[option]
    q, k, v, score_mod, mask_mod, block_mask = _inputs(name)
    gqa = q.shape[1] != k.shape[1]
    plans.PLANS.clear()
    out, lse = check_forward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=gqa,
                             kernel_options=forced)
    assert _families() == ["gluon"]
    if name.endswith("empty_rows"):
        assert bool((out[:, :, :130] == 0).all()) and bool((lse[:, :, :130] == -torch.inf).all())
    found = [p for p in plans.PLANS.values() if p.family.name == "gluon"]
    if "static_max" in option:
        assert all(p.spec.static_max is not None for p in found)
    elif option == "running_max":
        assert all(p.spec.static_max is None for p in found)
    elif option == "qk_trim":  # set only where E's 32-column slices are fewer than E_PAD's
        assert all(p.spec.qk_trim == (q.shape[3] != 256) for p in found)
    elif option == "padded":  # Q K^T over E_PAD's columns (the default trims at 80 and 192)
        assert found and not any(p.spec.qk_trim for p in found)
    elif option != "plain":  # when GEMMs issue and how out is stored, not what is computed
        plain = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      enable_gqa=gqa, kernel_options=FORCED)
        torch.testing.assert_close(out, plain, atol=0, rtol=0)


@pytest.mark.parametrize("name, option", [
    ("causal", "plain"), ("empty_rows", "plain"), ("softcap_causal", "static_max"),
    ("gqa_causal", "pingpong"), ("dense", "tma_store"), ("document", "dynamic"),
    ("causal_d256", "plain"), ("causal_d192_ev128", "persistent"),
    # persistent programs walking tiles of several heads: each tile's own head's sink
    ("many_empty_rows", "persistent")])
def test_gluon_forward_emulated_sinks(name, option):
    """HAS_SINKS: each row's head's sink joins its denominator in the epilogue (out = acc /
    (l + exp(sink - m)), lse = logaddexp(lse, sink); a row with nothing to attend gets out 0
    and lse = the sink), under the static max, ping-pong, the TMA store, the persistent
    grids and the wide head dims; the row max stays the scores' own (the interpreted
    Ampere-class family's, which folds the sink the same way)."""
    from kernels.test_sinks import reference_pair
    from reference import assert_close_to_reference

    q, k, v, score_mod, mask_mod, block_mask = _inputs(name)
    gqa = q.shape[1] != k.shape[1]
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(7)) * 2
    if option == "pingpong":  # sinks in the query's dtype (read as such, folded in float32)
        sinks = sinks.to(q.dtype)
    with_max = option != "static_max"  # (the static max holds no row max)
    aux = flexfa.AuxRequest(lse=True, max_scores=with_max)
    plans.PLANS.clear()
    out, got = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                     enable_gqa=gqa, sinks=sinks, return_aux=aux,
                                     kernel_options=OPTIONS[option])
    assert _families() == ["gluon"]
    found = [p for p in plans.PLANS.values() if p.family.name == "gluon"]
    want_dtype = "fp32" if sinks.dtype == torch.float32 else "bf16"
    assert all(p.spec.sinks_dtype == want_dtype for p in found)
    assert all((p.spec.static_max is not None) == (option == "static_max") for p in found)
    exact, eager = reference_pair(q, k, v, sinks, mask_mod, score_mod)
    assert_close_to_reference(out, exact[0], eager[0], fudge=4.0, name="out")
    assert_close_to_reference(got.lse, exact[1], eager[1], fudge=4.0, name="lse")
    if name == "empty_rows":  # the sink alone
        assert bool((out[:, :, :130] == 0).all())
        torch.testing.assert_close(got.lse[:, :, :130],
                                   sinks.view(1, -1, 1).expand_as(got.lse[:, :, :130]))
    if with_max:
        _, want = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                        enable_gqa=gqa, sinks=sinks, return_aux=aux)
        torch.testing.assert_close(got.max_scores, want.max_scores, atol=1e-4, rtol=1e-4)


def test_gluon_forward_emulated_row_max_and_pinned_tiles():
    q, k, v = make_qkv(1, 2, 2, 256, 256, 128, dtype=torch.bfloat16)
    mask = flexfa.create_block_mask(mods.causal, None, None, 256, 256, device="cpu",
                                    BLOCK_SIZE=(128, 64))
    aux = flexfa.AuxRequest(lse=True, max_scores=True)
    out, got = flexfa.flex_attention(q, k, v, block_mask=mask, return_aux=aux,
                                     kernel_options={**FORCED, "BLOCK_N": 64, "num_stages": 3})
    ref, want = flexfa.flex_attention(q, k, v, block_mask=mask, return_aux=aux)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.max_scores, want.max_scores, atol=1e-4, rtol=1e-4)


BACKWARD_CASES = ["dense", "dense_even", "dense_fp16", "causal", "sliding", "softcap_causal",
                  "alibi_causal", "document", "gqa_causal", "dense_d80", "document_d48",
                  "dense_d256", "causal_d256", "softcap_d256", "softcap_causal_d256",
                  "gqa_causal_d256", "gqa_dense_d256", "alibi_causal_d256", "dense_d192",
                  "document_d160", "causal_d192_ev128", "softcap_d256_ev128",
                  "gqa_alibi_causal_d192_ev128", "causal_d224"]


@pytest.mark.parametrize("name", BACKWARD_CASES + ["empty_rows_score"])
def test_gluon_backward_emulated_matches_reference(name):
    if name == "empty_rows_score":
        q, k, v = make_qkv(1, 2, 2, 300, 300, 64, dtype=torch.bfloat16)
        score_mod, mask_mod = _empty_rows, mods.causal
        block_mask = flexfa.create_block_mask(mods.causal, None, None, 300, 300, device="cpu")
    else:
        q, k, v, score_mod, mask_mod, block_mask = _inputs(name)
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=q.shape[1] != k.shape[1],
                   kernel_options=BACKWARD, with_lse=name in ("causal", "causal_d256"))
    assert _families() == ["gluon", "gluon_bwd"]
    found = [p for p in plans.PLANS.values() if p.family.name == "gluon_bwd"]
    wide = q.shape[3] > 128  # bwd_gluon_wide.tmpl's 64-key programs
    assert all(p.spec.wide == wide and p.spec.block_n == (64 if wide else 128) for p in found)


@pytest.mark.parametrize("name, options", [
    (name, {}) for name in ("causal", "gqa_causal", "document", "dense_fp16", "causal_d256",
                            "softcap_d256_ev128", "gqa_alibi_causal_d192_ev128")]
    + [("softcap_causal_d96", {"GLUON_BWD_QK_TRIM": True})])
def test_gluon_backward_emulated_dropout(name, options):
    """The consumers draw the forward's keep mask again: in the transposed tile at E <= 128,
    in the [queries, keys] tile of each consumer's 32 keys at the wide head dims (the mask
    kept in P's sign until dP is back), ragged S and v's head dim 128 among them."""
    q, k, v, score_mod, mask_mod, block_mask = _inputs(name)
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=q.shape[1] != k.shape[1],
                   kernel_options={**BACKWARD, **options}, dropout=(0.3, (20261205, 3)))
    assert _families() == ["gluon", "gluon_bwd"]
    wide = q.shape[3] > 128
    assert all(p.spec.dropout and p.spec.wide == wide
               for p in plans.PLANS.values() if p.family.name == "gluon_bwd")


@pytest.mark.parametrize("name", ["causal", "gqa_causal", "empty_rows", "causal_d256",
                                  "gqa_alibi_causal_d192_ev128"])
def test_gluon_backward_emulated_sinks(name):
    """Attention sinks on the Gluon backward: its kernels run as without them, since the
    forward's lse holds each row's sink and P is the keys' share alone; d sinks comes from
    lse and delta after them, delta kept apart from dQ's memory (row_buffers). With rows
    that attend to nothing (lse = the sink: P = 0, d sink = the row's dlse), lse gradients,
    GQA and the wide kernel; the forward on the Gluon family (HAS_SINKS) or, as a call that
    only takes the Gluon backward does, the interpreted Ampere-class one."""
    q, k, v, score_mod, mask_mod, block_mask = _inputs(name)
    sinks = (torch.randn(q.shape[1], generator=torch.Generator().manual_seed(5)) * 2
             ).requires_grad_()
    for options, families in ((BACKWARD, ["gluon", "gluon_bwd"]),
                              ({**EMULATE, "GLUON_BACKWARD": True}, ["ampere", "gluon_bwd"])):
        plans.PLANS.clear()
        check_backward(q, k, v, score_mod, mask_mod, block_mask,
                       enable_gqa=q.shape[1] != k.shape[1], kernel_options=options,
                       sinks=sinks, with_lse=True)
        assert _families() == families


@pytest.mark.parametrize("name, dropout", [
    ("causal_d256", None), ("gqa_dense_d256", None), ("gqa_causal_d256", (0.3, (7, 2))),
    ("causal_d192_ev128", (0.3, (7, 2))), ("dense_d192", None), ("alibi_causal_d256", None)])
def test_gluon_backward_emulated_captured_tensor_gradients(name, dropout):
    """Learnable captured tensors on the Gluon backward (GLUON_BACKWARD=True; the wide
    template's HAS_BUFFER_GRADS): every gradient, the five captured tensors' among them (a
    relative bias, a head scale, a 0-d gain times the bias: a full tile of atomics, a sum to
    one value twice; row and key biases: sums along one axis), against the float64
    reference, with lse gradients, GQA, dropout (P before the keep mask times the dropped
    dP's) and E = 192 / Ev = 128."""
    q, k, v, _, mask_mod, block_mask = _inputs(name)
    Hq, L, S = q.shape[1], q.shape[2], k.shape[2]
    score_mod, buffers = learnable_mod(Hq, L, S, seed=3)
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != k.shape[1],
                   kernel_options=BACKWARD, buffers=buffers, dropout=dropout, with_lse=True)
    assert _families() == ["gluon", "gluon_bwd"]


def test_gluon_backward_emulated_captured_gradients_of_a_poisoned_call_are_nan():
    """The wide kernel's captured-tensor gradients cannot tell a +inf row's entries from
    masked ones (runtime.families.gluon_bwd.poison_buffer_grads): a row with a +inf score
    makes them wholly NaN (never finite where torch's are NaN); without one they are finite."""
    q, k, v, _, _, block_mask = _inputs("causal_d256")
    bias = torch.zeros(q.shape[2], requires_grad=True)
    for row, finite in ((None, True), (5, False)):
        def biased(score, b, h, q_idx, kv_idx):
            return torch.where(q_idx == (-1 if row is None else row), float("inf"),
                               score + bias[q_idx])
        plans.PLANS.clear()
        out = flexfa.flex_attention(q, k, v, biased, block_mask, kernel_options=BACKWARD)
        (grad,) = torch.autograd.grad(out.float().sum(), [bias])
        assert "gluon_bwd" in _families()
        assert bool(grad.isfinite().all()) is finite and bool(grad.isnan().all()) is not finite


@pytest.mark.parametrize("name", ["gqa_causal", "causal_d256"])
def test_gluon_emulated_sinks_with_dropout(name):
    """Sinks and dropout together on both Gluon families: the keep mask drops keys'
    probabilities after the row sum (the sink's term is in it, never dropped)."""
    q, k, v, score_mod, mask_mod, block_mask = _inputs(name)
    sinks = (torch.randn(q.shape[1], generator=torch.Generator().manual_seed(9))
             ).requires_grad_()
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=q.shape[1] != k.shape[1],
                   kernel_options=BACKWARD, sinks=sinks, dropout=(0.3, (20261205, 4)))
    assert _families() == ["gluon", "gluon_bwd"]


def test_gluon_wide_backward_emulated_dropout_close_to_one():
    """p = 0.99 in the wide kernel: the few kept elements carry P / (1 - p) = 100 P into dV
    and dP, the dropped ones -delta alone into dS."""
    q, k, v, score_mod, mask_mod, block_mask = _inputs("causal_d256")
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, kernel_options=BACKWARD,
                   dropout=(0.99, (20261205, 9)))
    assert _families() == ["gluon", "gluon_bwd"]


@pytest.mark.parametrize("name, options", [
    ("causal", {"GLUON_BWD_STAGES": 3}),
    ("softcap_causal", {"GLUON_BWD_STAGES": 3}),
    ("causal", {"GLUON_BWD_DQ_CHUNKS": 1}),
    # B = 2, Hkv = 2: one pair per part, two slots on "two streams" (run in turn on a CPU)
    ("causal", {"GLUON_BWD_DQ_CHUNKS": 4}),
    ("causal", {"GLUON_BWD_DQ_CHUNKS": 4, "GLUON_BWD_OVERLAP": False}),
    ("gqa_causal", {"GLUON_BWD_DQ_CHUNKS": 2}),
    ("causal", {"GLUON_BWD_EARLY_DP": True}),
    ("softcap_causal", {"GLUON_BWD_EARLY_DP": True, "GLUON_BWD_STAGES": 3}),
    ("causal_d256", {"GLUON_BWD_DQ_CHUNKS": 1}),
    ("gqa_causal_d256", {"GLUON_BWD_DQ_CHUNKS": 4, "GLUON_BWD_OVERLAP": False}),
    # EARLY_DP changes nothing at 256 (its dP is issued after the mods)
    ("causal_d256", {"GLUON_BWD_EARLY_DP": True}),
    # S^T and dP^T over E's 32-column slices (64 + 32), with dP^T early too
    ("dense_d80", {"GLUON_BWD_QK_TRIM": True}),
    ("softcap_causal_d96", {"GLUON_BWD_QK_TRIM": True}),
    ("softcap_causal_d96", {"GLUON_BWD_QK_TRIM": True, "GLUON_BWD_EARLY_DP": True}),
    # changes nothing where E fills its power of two, nor in the wide kernel
    ("causal", {"GLUON_BWD_QK_TRIM": True}),
    ("document_d160", {"GLUON_BWD_QK_TRIM": True}),
    # the padded S^T and dP^T (the default trims at 80 and 96)
    ("softcap_causal_d96", {"GLUON_BWD_QK_TRIM": False}),
])
def test_gluon_backward_emulated_options(name, options):
    q, k, v, score_mod, mask_mod, block_mask = _inputs(name)
    plans.PLANS.clear()
    check_backward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=q.shape[1] != k.shape[1],
                   kernel_options={**BACKWARD, **options})
    found = gluon_backward_plans(options, k)
    if "GLUON_BWD_STAGES" in options:
        assert all(p.spec.stages == options["GLUON_BWD_STAGES"] for p in found)
    if q.shape[3] > 128:
        assert all(not p.spec.early_dp for p in found)
    trimmed = options.get("GLUON_BWD_QK_TRIM") is not False and q.shape[3] in (80, 96)
    assert found and all(p.spec.qk_trim == trimmed for p in found)


def test_gluon_backward_emulated_e256_limits():
    """At E = 256 a Q/dO ring of 3 stages does not fit sm_90's shared memory (an error naming
    the bytes and the depths that fit), raised by the forward of a call that needs a
    gradient (since the forty-fourth session; it came at the backward)."""
    q, k, v, score_mod, mask_mod, block_mask = _inputs("causal_d256")
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    with pytest.raises(InputError, match=r"GLUON_BWD_STAGES=3.*head dim 256.*fit: \[2\]"):
        flexfa.flex_attention(*inputs, block_mask=block_mask,
                              kernel_options={**BACKWARD, "GLUON_BWD_STAGES": 3})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, on the inf and NaN rows
def test_gluon_emulated_non_finite_rows_follow_the_interpreted_families():
    """A +inf score, a NaN score and both in one row (in two key tiles): the Gluon forward
    and backward give the interpreted Ampere forward's and Triton backward's NaN and inf
    pattern (torch's: docs/training.md)."""
    plans.PLANS.clear()
    found = non_finite_results(BACKWARD, device="cpu", length=256)
    assert {"gluon", "gluon_bwd"} <= set(_families())
    plans.PLANS.clear()
    want = non_finite_results({}, device="cpu", length=256)
    assert "gluon" not in _families()
    assert_same_non_finite(found, want, length=256)


def test_gluon_emulate_takes_cpu_tensors_only():
    """GLUON_EMULATE on a CUDA target is an input error naming the option (the check, with
    the target a CUDA call would have)."""
    from flexfa.runtime.call import AttentionCall
    from flexfa.runtime.families.gluon import why_not_gluon
    from flexfa.runtime.options import KernelOptions
    from flexfa.runtime.target import INTERPRETER, Target

    q, k, v = make_qkv(1, 1, 1, 128, 128, 64, dtype=torch.bfloat16)

    def call(**options):
        return AttentionCall(None, None, None, 0.125, KernelOptions(**options), 1)
    with pytest.raises(InputError, match="GLUON_EMULATE=True runs the Gluon kernels on CPU"):
        why_not_gluon(Target("cuda", 9, 0), call(gluon_emulate=True), q, k, v, (128, 64))
    assert "GLUON_EMULATE" in why_not_gluon(INTERPRETER, call(), q, k, v, (128, 64))
    assert why_not_gluon(INTERPRETER, call(gluon_emulate=True), q, k, v, (128, 64)) is None
