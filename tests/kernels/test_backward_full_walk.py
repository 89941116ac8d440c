"""kernel_options BWD_FULL_WALK: the Triton backward walks a call without a block mask through
the tables of a mask whose every block is full (``flexfa.runtime.families.backward.full_walk``;
on sm_90 at head dims padding to 256 by default ('AUTO'), where its dK/dV kernel then splits
S^T and dP^T between the warpgroups). In the interpreter under ``True``: gradients against the
float64 reference (dense, softcap, GQA, ragged lengths, the lse's gradient, a learnable bias,
sinks), the plan's tables, where 'AUTO' takes it, and a broadcast dO copied for the
descriptors' tiles."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.runtime import plans
from flexfa.runtime.call import AttentionCall, Dropout
from flexfa.runtime.families import backward as family
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.target import Target
from backward_utils import check_backward
from forward_utils import make_qkv

WALK = {"BWD_FULL_WALK": True}
AUTO = {"BWD_FULL_WALK": "AUTO"}
SM90 = Target("cuda", 9, 0)


def _walks() -> list:
    """The full masks of the backward plans in the cache."""
    return [p.fixed["walk"] for p in plans.PLANS.values() if p.fixed.get("walk") is not None]


@pytest.mark.parametrize("E, L, S, gqa, score", [
    (64, 256, 256, 1, None),                    # tile multiples, no score_mod
    (64, 200, 136, 2, mods.softcap(20.0)),      # ragged lengths (a partial last block), GQA
    (32, 100, 300, 1, mods.alibi(2)),           # L < S, one q block
    (256, 136, 136, 1, mods.softcap(30.0)),     # E = 256: the one loop's tiles
])
def test_full_walk_matches_the_reference(E, L, S, gqa, score):
    plans.PLANS.clear()
    q, k, v = make_qkv(1, 2, 2 // gqa, L, S, E, dtype=torch.bfloat16, device="cpu")
    check_backward(q, k, v, score, None, None, enable_gqa=gqa > 1, kernel_options=WALK,
                   with_lse=True)
    (walk,) = _walks()
    assert walk.seq_lengths == (L, S) and walk.BLOCK_SIZE == (128, 128)
    rows, cols = -(-L // 128), -(-S // 128)
    # every block full, none partial, on both sides
    assert walk.kv_num_blocks.sum() == 0 and walk.q_num_blocks.sum() == 0
    assert walk.full_kv_num_blocks.flatten().tolist() == [cols] * rows
    assert walk.full_q_num_blocks.flatten().tolist() == [rows] * cols
    assert walk.to_dense().all()


def test_full_walk_with_a_learnable_bias_and_sinks():
    q, k, v = make_qkv(1, 2, 2, 160, 160, 64, dtype=torch.bfloat16, device="cpu")
    bias = (0.1 * torch.randn(2 * 160 - 1)).requires_grad_()
    sinks = torch.randn(2).requires_grad_()

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx - kv_idx + 159]
    check_backward(q, k, v, relative, None, None, kernel_options=WALK, buffers=(bias,),
                   sinks=sinks)


def test_full_walk_plan_is_cached_with_its_mask():
    """A second call of the same signature runs the cached plan under the same full mask;
    with the option off the unmasked walk, to the same gradients."""
    plans.PLANS.clear()
    family._FULL_WALKS.clear()
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 192, 192, 32,
                                                     dtype=torch.bfloat16, device="cpu"))
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        flexfa.flex_attention(q, k, v, kernel_options=WALK).sum().backward()
    first = _walks()
    assert len(first) == 1 and family._FULL_WALKS.get((192, 192, q.device)) is first[0]
    expected = (q.grad.clone(), k.grad.clone(), v.grad.clone())
    for t in (q, k, v):
        t.grad = None
    flexfa.flex_attention(q, k, v, kernel_options={"BWD_FULL_WALK": False}).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), expected):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert len(_walks()) == 1


def _call(options=None, block_mask=None, dropout=None) -> AttentionCall:
    return AttentionCall(None, None, block_mask, 0.125, parse_kernel_options(options), 1,
                         dropout=dropout)


@pytest.mark.parametrize("E, Ev, dtype, options, dropout, masked, taken", [
    (256, 256, torch.bfloat16, AUTO, False, False, True),    # measured (wn_b990bbf)
    (224, 224, torch.float16, AUTO, False, False, True),     # one column block of 256
    (256, 256, torch.bfloat16, None, False, False, True),    # 'AUTO' is the default
    (256, 256, torch.bfloat16, {"BWD_FULL_WALK": False}, False, False, False),
    (256, 256, torch.bfloat16, WALK, True, False, True),     # forced
    (256, 256, torch.bfloat16, AUTO, True, False, False),    # dropout: not measured
    (256, 256, torch.bfloat16, AUTO, False, True, False),    # a block mask of its own
    (256, 256, torch.bfloat16, WALK, False, True, False),    # ... even forced
    (192, 192, torch.bfloat16, AUTO, False, False, False),   # 128 + 64 column blocks
    (256, 128, torch.bfloat16, AUTO, False, False, False),   # v pads to 128
    (128, 128, torch.bfloat16, AUTO, False, False, False),   # no one loop there
    (256, 256, torch.float32, AUTO, False, False, False),    # pointer-load tiles
])
def test_where_auto_takes_the_full_walk(E, Ev, dtype, options, dropout, masked, taken):
    q = torch.empty(1, 2, 1024, E, dtype=dtype)
    k = torch.empty(1, 2, 1024, E, dtype=dtype)
    v = torch.empty(1, 2, 1024, Ev, dtype=dtype)
    mask = flexfa.create_block_mask(mods.causal, None, None, 1024, 1024, device="cpu") \
        if masked else None
    drop = Dropout(0.1, torch.zeros(2, dtype=torch.int64)) if dropout else None
    call = _call(options, mask, drop)
    assert family.full_walk(call, SM90, q, k, v, q) is taken
    # elsewhere than sm_90 'AUTO' never takes it
    assert not family.full_walk(_call(AUTO), Target("cuda", 8, 0), q, k, v, q)


def _broadcast_grad(out: torch.Tensor) -> torch.Tensor:
    """The upstream gradient of ``out.sum()``: ones, every stride 0."""
    return torch.ones((), dtype=out.dtype).expand(out.shape)


def test_dense_grad_out_where_descriptors_need_it():
    """The Triton backward copies dO where q, k, v take the descriptors' tiles and dO alone
    fails their layout check (``out.sum()``'s broadcast ones), nowhere else."""
    q, k, v = (torch.empty(1, 2, 256, 256, dtype=torch.bfloat16) for _ in range(3))

    def inputs(grad_out, q=q):
        return family.Inputs(q, k, v, q, None, grad_out, None, q, k, v, {})
    broadcast = _broadcast_grad(q)
    assert family.dense_grad_out(_call(), SM90, inputs(broadcast))
    assert not family.dense_grad_out(_call(), SM90, inputs(torch.empty_like(q)))
    # no descriptors: not sm_90 by default, USE_TMA off, or q itself fails the check
    assert not family.dense_grad_out(_call(), Target("cuda", 8, 0), inputs(broadcast))
    assert not family.dense_grad_out(_call({"USE_TMA": False}), SM90, inputs(broadcast))
    strided = torch.empty(1, 256, 2, 256, dtype=torch.bfloat16).transpose(1, 2)[..., :200]
    assert not family.dense_grad_out(_call(), SM90, inputs(broadcast, q=strided))


@pytest.mark.parametrize("E, options", [(64, {}), (256, WALK)])
def test_broadcast_grad_out_takes_the_descriptor_tiles(E, options):
    """``out.sum().backward()`` under descriptors (USE_TMA forced, as sm_90's default): the
    plan copies dO and keeps the descriptor tiles, its first and cached calls alike, to the
    float64 reference's gradients."""
    plans.PLANS.clear()
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 136, 136, E,
                                                     dtype=torch.bfloat16, device="cpu"))
    opts = {"USE_TMA": True, **options}
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref).sum().backward()
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        out = flexfa.flex_attention(q, k, v, kernel_options=opts)
        assert out.grad_fn is not None
        out.sum().backward()
        for got, want in zip((q.grad, k.grad, v.grad), ref):
            torch.testing.assert_close(got.double(), want.grad, atol=3e-2, rtol=3e-2)
    (plan,) = [p for p in plans.PLANS.values() if p.family.name == "triton_bwd"]
    assert plan.fixed["dense_grad_out"] and plan.spec.use_tma


def test_bad_option_value_is_named():
    with pytest.raises(TypeError, match="BWD_FULL_WALK"):
        parse_kernel_options({"BWD_FULL_WALK": "sometimes"})
