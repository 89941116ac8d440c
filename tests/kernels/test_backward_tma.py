"""The backward's tensor-descriptor (TMA) path, forced under the interpreter with
kernel_options ``bwd_USE_TMA=True`` (it is the default on sm_90): Q/dO tiles of the dK/dV
kernel come from [B * H * L, d] descriptors where L is a multiple of the tile and from
[B * H, L, d] ones otherwise (zeros past L: never the next head's rows); K/V tiles of the dQ
kernel from [B * H, S, d] descriptors (zeros past S), and dQ is stored through a
[B * H, L, E] one (rows past L dropped)."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from flexfa.errors import InputTypeError
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families import backward as backward_family
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.pipeline import prepare_mask
from flexfa.runtime.target import INTERPRETER, Target
from backward_utils import check_backward, record_backward_specs
from forward_utils import make_qkv

TMA = {"bwd_USE_TMA": True}


@pytest.fixture
def spy_specs(monkeypatch):
    """Record the BackwardSpec of every backward pass."""
    return record_backward_specs(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tma_backward_ragged_gqa_bias_and_block_mask(spy_specs, dtype):
    # L, S not multiples of the 64-row tiles nor of the 128-token blocks; E = 56 (descriptor
    # blocks 64 wide: zero fill; no column blocks); GQA 2; a learnable bias; causal block
    # mask with full blocks
    B, Hq, Hkv, L, S, E, Ev = 2, 4, 2, 200, 136, 56, 32
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype=dtype, seed=21)
    bias = (0.2 * torch.randn(Hq, generator=torch.Generator().manual_seed(3))).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx) / 64.0

    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=128)
    check_backward(q, k, v, score_mod, mods.causal, block_mask, enable_gqa=True,
                   buffers=(bias,), with_lse=True,
                   kernel_options={"BLOCK_M": 64, "BLOCK_N": 64, **TMA})
    assert spy_specs and all(s.use_tma for s in spy_specs)


def test_tma_backward_without_block_mask(spy_specs):
    q, k, v = make_qkv(1, 2, 2, 72, 100, 16, dtype=torch.bfloat16, seed=22)
    check_backward(q, k, v, mods.softcap(5.0),
                   kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, **TMA})
    assert spy_specs and all(s.use_tma for s in spy_specs)


def test_tma_falls_back_to_pointer_loads_for_strided_inputs(spy_specs):
    # [B, L, H, E] memory viewed as [B, H, L, E]: no [B * H * L, E] matrix, so no descriptors
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.bfloat16, seed=23))
    check_backward(q, k, v, None, kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, **TMA})
    assert spy_specs and not any(s.use_tma for s in spy_specs)


def test_bad_backward_tma_setting_is_named():
    q = torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(InputTypeError,
                       match=r"kernel_options\['bwd_USE_TMA'\] must be True, False or 'AUTO', got str 'yes'"):
        flexfa.flex_attention(q, q, q, kernel_options={"bwd_USE_TMA": "yes"})


def _call(options=None) -> AttentionCall:
    return AttentionCall(None, None, None, 0.125, parse_kernel_options(options), 1)


def test_tma_is_the_sm90_default_and_off_elsewhere():
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    sm90, sm80, sm100 = Target("cuda", 9, 0), Target("cuda", 8, 0), Target("cuda", 10, 0)
    use_tma = backward_family.use_tma
    assert use_tma(_call(), sm90, q, q, q, q)
    assert not use_tma(_call(), sm80, q, q, q, q)
    assert not use_tma(_call(), sm100, q, q, q, q)  # not an sm_90 GPU
    assert not use_tma(_call(), INTERPRETER, q, q, q, q)
    assert not use_tma(_call(), sm90, *[q.float()] * 4)
    for off in ({"bwd_USE_TMA": False}, {"USE_TMA": False}):
        assert not use_tma(_call(off), sm90, q, q, q, q)
    for on in ({"bwd_USE_TMA": True}, {"USE_TMA": True}):
        assert use_tma(_call(on), sm80, q, q, q, q) and use_tma(_call(on), INTERPRETER, q, q, q, q)
        assert not use_tma(_call(on), sm90, *[q.float()] * 4)  # the layout still decides
    # the forward's option does not reach the backward
    assert not use_tma(_call({"fwd_USE_TMA": True}), INTERPRETER, q, q, q, q)
    assert use_tma(_call({"fwd_USE_TMA": False}), sm90, q, q, q, q)


def test_backward_plans_are_reused_per_signature_and_mask(monkeypatch):
    """The second backward of the same signature and block mask skips backward_spec (the
    plan cache); another mask object or another bwd_USE_TMA makes a new plan."""
    calls = []
    original = backward_family.backward_spec
    monkeypatch.setattr(backward_family, "backward_spec",
                        lambda *a, **kw: calls.append(1) or original(*a, **kw))
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, seed=24)

    def mask():
        return create_block_mask(mods.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    first = mask()
    grads = [check_backward(q, k, v, None, mods.causal, first) for _ in range(2)]
    assert len(calls) == 1
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    check_backward(q, k, v, None, mods.causal, mask())
    assert len(calls) == 2
    check_backward(q, k, v, None, mods.causal, first, kernel_options={"bwd_USE_TMA": False})
    assert len(calls) == 3


@pytest.mark.parametrize("E", [16, 48])  # 48: q, k in column blocks of 32 and 16
def test_tma_rows_of_other_heads_cannot_leak_inf(spy_specs, E):
    """With descriptors, the tiles past L and S read the next head's rows; an inf there (in
    the second head's q, k or upstream gradient) must not turn this head's gradients NaN."""
    L = S = 40
    q, k, v = make_qkv(1, 2, 2, L, S, E, 16, dtype=torch.bfloat16, seed=25)
    grad_out = torch.randn(1, 2, L, 16).to(torch.bfloat16)
    q[0, 1, 0, 0] = k[0, 1, 0, 0] = grad_out[0, 1, 0, 0] = float("inf")
    q[0, 1, 0, -1] = k[0, 1, 0, -1] = float("inf")  # the last column block's too
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flexfa.flex_attention(q, k, v, kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, **TMA})
    out.backward(grad_out)
    assert spy_specs and all(s.use_tma for s in spy_specs)
    for name, g in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(g[0, 0]).all(), f"{name} of head 0 has non-finite values"


@pytest.mark.parametrize("L,heads", [(200, True), (256, False)])
def test_dkdv_reads_q_and_do_per_head_where_l_is_ragged(L, heads):
    """At a ragged L the dK/dV kernel's Q and dO descriptors cover [B * H, L, d] (zeros past
    L, no bounds select in the kernel); at a multiple of the tile the [B * H * L, d] rows. The
    kernel's signature follows (rank-3 blocks), and both give the reference's gradients."""
    q, k, v = make_qkv(1, 2, 2, L, 136, 48, 32, dtype=torch.bfloat16, seed=27)
    block_mask = create_block_mask(mods.causal, None, None, L, 136, device="cpu")
    call = AttentionCall(None, prepare_mask(block_mask), block_mask, 0.25,
                         parse_kernel_options(TMA), 1)
    spec = backward_family.backward_spec(q, k, v, call, has_dlse=False, target=INTERPRETER)
    grad_out = torch.randn(1, 2, L, 32).to(q.dtype)
    x = backward_family.Inputs(q, k, v, torch.zeros_like(grad_out), torch.zeros(1, 2, L),
                               grad_out, None, torch.empty_like(q), torch.empty_like(k),
                               torch.empty_like(v), {})
    geometry = backward_family.descriptor_geometry(spec, x)
    assert spec.even_l1 is not heads
    for name, cols in (("q", 32), ("q_b", 16), ("do", 32)):
        shape, strides, block = geometry[name]
        if heads:
            assert (shape, block) == ([2, L, 48 if name != "do" else 32], [1, spec.block_m1, cols])
        else:
            assert (shape, block) == ([2 * L, 48 if name != "do" else 32], [spec.block_m1, cols])
    check_backward(q, k, v, None, mods.causal, block_mask, kernel_options=TMA)


def test_a_cached_plans_launches_equal_freshly_built_ones():
    """A cached plan launches with its stored steps (kernels, grids, constexprs, options) and
    descriptor geometry, and descriptors whose checks are skipped once its first launch ran:
    the same launches as a plan built from scratch with checked descriptors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flexfa.runtime.launch import TrustedDescriptor

    q, k, v = make_qkv(1, 4, 2, 200, 136, 48, 32, dtype=torch.bfloat16, seed=26)
    block_mask = create_block_mask(mods.causal, None, None, 200, 136, device="cpu")
    call = AttentionCall(None, prepare_mask(block_mask), block_mask, 0.25,
                         parse_kernel_options(TMA), 2)
    spec = backward_family.backward_spec(q, k, v, call, has_dlse=False, target=INTERPRETER)
    out, lse, grad_out = torch.zeros(1, 4, 200, 32, dtype=q.dtype), torch.zeros(1, 4, 200), \
        torch.randn(1, 4, 200, 32).to(q.dtype)
    x = backward_family.Inputs(q, k, v, out, lse, grad_out, None, torch.empty_like(q),
                               torch.empty_like(k), torch.empty_like(v), {})
    plan = backward_family.BACKWARD.make_plan(spec, call, x, None)
    fresh = backward_family.step_args(plan, call, x)
    plan.steps[0].launched = True  # what the first launch leaves
    cached = backward_family.step_args(plan, call, x)
    rebuilt = backward_family.BACKWARD.make_plan(spec, call, x, None)
    # dQ (storing delta), dK/dV
    assert spec.use_tma and len(fresh) == len(cached) == len(plan.steps) == 2
    for a, b in zip(plan.steps, rebuilt.steps):
        assert (a.kernel, a.grid, a.constexprs, a.options) == (b.kernel, b.grid, b.constexprs,
                                                              b.options)
    descriptors = 0
    for fresh_args, cached_args in zip(fresh, cached):
        assert len(fresh_args) == len(cached_args)
        for x_, y in zip(fresh_args, cached_args):
            if isinstance(x_, TensorDescriptor):
                descriptors += 1
                assert type(x_) is TensorDescriptor and type(y) is TrustedDescriptor
                assert x_.base is y.base
                assert (x_.shape, x_.strides, x_.block_shape) == (y.shape, y.strides,
                                                                  y.block_shape)
            elif isinstance(x_, torch.Tensor):
                # the kernels' own scratch (delta) is allocated per call
                assert x_ is y or (x_.shape == y.shape and x_.dtype == y.dtype)
            else:
                assert x_ == y
    # q, dO in dK/dV; k, v, dq in dQ; E = 48 in column blocks of 32 and 16: q, k and dq twice
    assert descriptors == 8
