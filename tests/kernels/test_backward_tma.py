"""The backward's tensor-descriptor (TMA) path, forced under the interpreter with
FLEXFA_BACKWARD_TMA=1 (it is the default on sm_90): Q/dO tiles of the dK/dV kernel and K/V
tiles of the dQ kernel come from [B * H * n, d] descriptors, so tiles past a head's end read
the next head's rows and must be masked."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from flexfa.errors import InputError
from flexfa.runtime import backward as backward_runtime
from backward_utils import check_backward, record_backward_specs
from forward_utils import make_qkv


@pytest.fixture
def spy_specs(monkeypatch):
    """Force the TMA path and record the BackwardSpec of every backward pass."""
    monkeypatch.setenv("FLEXFA_BACKWARD_TMA", "1")
    return record_backward_specs(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tma_backward_ragged_gqa_bias_and_block_mask(spy_specs, dtype):
    # L, S not multiples of the 64-row tiles nor of the 128-token blocks; E = 48 (descriptor
    # blocks 64 wide: zero fill); GQA 2; a learnable bias; causal block mask with full blocks
    B, Hq, Hkv, L, S, E, Ev = 2, 4, 2, 200, 136, 48, 32
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype=dtype, seed=21)
    bias = (0.2 * torch.randn(Hq, generator=torch.Generator().manual_seed(3))).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx) / 64.0

    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=128)
    check_backward(q, k, v, score_mod, mods.causal, block_mask, enable_gqa=True,
                   buffers=(bias,), with_lse=True, kernel_options={"BLOCK_M": 64, "BLOCK_N": 64})
    assert spy_specs and all(s.use_tma for s in spy_specs)


def test_tma_backward_without_block_mask(spy_specs):
    q, k, v = make_qkv(1, 2, 2, 72, 100, 16, dtype=torch.bfloat16, seed=22)
    check_backward(q, k, v, mods.softcap(5.0), kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    assert all(s.use_tma for s in spy_specs)


def test_tma_falls_back_to_pointer_loads_for_strided_inputs(spy_specs):
    # [B, L, H, E] memory viewed as [B, H, L, E]: no [B * H * L, E] matrix, so no descriptors
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.bfloat16, seed=23))
    check_backward(q, k, v, None, kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    assert spy_specs and not any(s.use_tma for s in spy_specs)


def test_bad_backward_tma_setting_is_named(monkeypatch):
    monkeypatch.setenv("FLEXFA_BACKWARD_TMA", "yes")
    q = torch.zeros(1, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="FLEXFA_BACKWARD_TMA must be auto, 0 or 1, got 'yes'"):
        backward_runtime.use_backward_tma("cuda:90", q, q, q, q)


def test_tma_is_the_sm90_default_and_off_elsewhere(monkeypatch):
    monkeypatch.delenv("FLEXFA_BACKWARD_TMA", raising=False)
    q = torch.zeros(1, 2, 64, 64, dtype=torch.bfloat16)
    assert backward_runtime.use_backward_tma("cuda:90", q, q, q, q)
    assert not backward_runtime.use_backward_tma("cuda:80", q, q, q, q)
    assert not backward_runtime.use_backward_tma("cuda:90", *[q.float()] * 4)
    monkeypatch.setenv("FLEXFA_BACKWARD_TMA", "0")
    assert not backward_runtime.use_backward_tma("cuda:90", q, q, q, q)


def test_backward_plans_are_reused_per_signature_and_mask(monkeypatch):
    """The second backward of the same signature and block mask skips backward_spec (the
    plan memo); another mask object or another FLEXFA_BACKWARD_TMA makes a new plan."""
    calls = []
    original = backward_runtime.backward_spec
    monkeypatch.setattr(backward_runtime, "backward_spec",
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
    monkeypatch.setenv("FLEXFA_BACKWARD_TMA", "0")
    check_backward(q, k, v, None, mods.causal, first)
    assert len(calls) == 3


def test_tma_rows_of_other_heads_cannot_leak_inf(spy_specs):
    """With descriptors, the tiles past L and S read the next head's rows; an inf there (in
    the second head's q, k or upstream gradient) must not turn this head's gradients NaN."""
    L = S = 40
    q, k, v = make_qkv(1, 2, 2, L, S, 16, dtype=torch.bfloat16, seed=25)
    grad_out = torch.randn(1, 2, L, 16).to(torch.bfloat16)
    q[0, 1, 0, 0] = k[0, 1, 0, 0] = grad_out[0, 1, 0, 0] = float("inf")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flexfa.flex_attention(q, k, v, kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    out.backward(grad_out)
    assert spy_specs and all(s.use_tma for s in spy_specs)
    for name, g in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(g[0, 0]).all(), f"{name} of head 0 has non-finite values"


def test_a_cached_plans_launches_equal_freshly_built_ones(monkeypatch):
    """A cached plan launches with its stored constants (grids, constexprs, options, descriptor
    geometry) and descriptors whose checks are skipped: the same launches as built from
    scratch with checked descriptors."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flexfa.runtime.forward import AttentionCall
    from flexfa.runtime.launch import TrustedDescriptor
    from flexfa.runtime.options import KernelOptions
    from flexfa.runtime.pipeline import prepare_mask

    monkeypatch.setenv("FLEXFA_BACKWARD_TMA", "1")
    q, k, v = make_qkv(1, 4, 2, 200, 136, 48, 32, dtype=torch.bfloat16, seed=26)
    block_mask = create_block_mask(mods.causal, None, None, 200, 136, device="cpu")
    call = AttentionCall(None, prepare_mask(block_mask), block_mask, 0.25, KernelOptions(), 2)
    spec = backward_runtime.backward_spec(q, k, v, call, has_dlse=False)
    module, name = backward_runtime.get_backward_module(spec, None, None, call.mask)
    out, lse, grad_out = torch.zeros(1, 4, 200, 32, dtype=q.dtype), torch.zeros(1, 4, 200), \
        torch.randn(1, 4, 200, 32).to(q.dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = (spec, module, name, q, k, v, out, lse, grad_out, None, call, None, {}, dq, dk, dv)
    fresh = backward_runtime.backward_launches(*common)
    statics = backward_runtime.launch_statics(spec, q, k, v, grad_out, None)
    cached = backward_runtime.backward_launches(*common, statics=statics, trusted=True)
    # dQ (storing delta), dK/dV; the plan keeps one direct-launch state per launch
    assert spec.use_tma and len(fresh) == len(cached) == len(statics.grids) == 2
    descriptors = 0
    for a, b in zip(fresh, cached):
        assert (a.kernel, a.grid, a.constexprs, a.options) == (b.kernel, b.grid, b.constexprs,
                                                              b.options)
        assert len(a.args) == len(b.args)
        for x, y in zip(a.args, b.args):
            if isinstance(x, TensorDescriptor):
                descriptors += 1
                assert type(x) is TensorDescriptor and type(y) is TrustedDescriptor
                assert x.base is y.base
                assert (x.shape, x.strides, x.block_shape) == (y.shape, y.strides, y.block_shape)
            elif isinstance(x, torch.Tensor):
                # the kernels' own scratch (delta) is allocated per call
                assert x is y or (x.shape == y.shape and x.dtype == y.dtype)
            else:
                assert x == y
    assert descriptors == 4  # q, dO in dK/dV; k, v in dQ
