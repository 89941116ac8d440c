"""The fused dK/dV + dQ backward (FLEXFA_BACKWARD_FUSED=1 forces it under the interpreter):
the dK/dV kernel adds each tile's dS @ K into a float32 dQ accumulator, which the delta
kernel zeroes and a convert kernel scales into dq. On sm_90 the additions are TMA
reduce-adds (compile-checked in tests/kernels/test_backward_compile.py); here they are
per-element atomics, the same kernel otherwise."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from flexfa.errors import InputError
from flexfa.runtime import backward as backward_runtime
from flexfa.runtime.forward import AttentionCall
from flexfa.runtime.options import KernelOptions
from backward_utils import check_backward, check_ragged_gqa_alibi_causal, record_backward_specs
from forward_utils import make_qkv


@pytest.fixture
def spy_specs(monkeypatch):
    """Force the fused path and record the BackwardSpec of every backward pass."""
    monkeypatch.setenv("FLEXFA_BACKWARD_FUSED", "1")
    return record_backward_specs(monkeypatch)


@pytest.mark.parametrize("tma", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_backward_ragged_gqa_alibi_block_mask(spy_specs, monkeypatch, dtype, tma):
    # GQA 2: each kv program adds into the dQ rows of both its query heads
    monkeypatch.setenv("FLEXFA_BACKWARD_TMA", tma)
    check_ragged_gqa_alibi_causal(dtype, seed=31, block_size=128, tile=64)
    assert spy_specs and all(s.fused_dq and s.use_tma == (tma == "1") for s in spy_specs)


def test_fused_backward_softcap_without_block_mask(spy_specs):
    # d score_mod / d score is not 1 (the guarded dS), no mask: every q tile from every kv tile
    q, k, v = make_qkv(1, 2, 2, 72, 100, 16, dtype=torch.bfloat16, seed=32)
    check_backward(q, k, v, mods.softcap(5.0), kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    assert spy_specs and all(s.fused_dq for s in spy_specs)


def test_fused_backward_float32_and_empty_rows(spy_specs):
    # a mask that leaves some query rows without any key: their dq must be exactly 0
    q, k, v = make_qkv(1, 2, 2, 64, 48, 16, dtype=torch.float32, seed=33)

    def late_start(b, h, q_idx, kv_idx):
        return (q_idx >= 20) & (kv_idx <= q_idx)

    block_mask = create_block_mask(late_start, None, None, 64, 48, device="cpu", BLOCK_SIZE=16)
    dq, _, _ = check_backward(q, k, v, None, late_start, block_mask,
                              kernel_options={"BLOCK_M": 16, "BLOCK_N": 16})
    assert spy_specs and all(s.fused_dq for s in spy_specs)
    assert torch.equal(dq[:, :, :20], torch.zeros_like(dq[:, :, :20]))


def test_fused_is_not_used_where_it_cannot_be(spy_specs):
    """Deterministic gradients, captured tensors that need a gradient, or no dK/dV wanted:
    the two kernels, with the same results."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.bfloat16, seed=34)
    check_backward(q, k, v, None, kernel_options={"BLOCK_M": 32, "BLOCK_N": 32,
                                                  "deterministic": True})
    bias = torch.zeros(2, requires_grad=True)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    check_backward(q, k, v, learnable, buffers=(bias,),
                   kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    assert len(spy_specs) == 2 and not any(s.fused_dq for s in spy_specs)
    qg = q.detach().clone().requires_grad_()
    out = flexfa.flex_attention(qg, k.detach(), v.detach(),
                                kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    out.sum().backward()
    assert not spy_specs[-1].fused_dq and torch.isfinite(qg.grad).all()


def test_fused_matches_the_two_kernels(monkeypatch):
    """Both paths on the same inputs agree to float32 summation order."""
    q, k, v = make_qkv(1, 2, 2, 96, 80, 32, dtype=torch.float32, seed=35)
    block_mask = create_block_mask(mods.causal, None, None, 96, 80, device="cpu", BLOCK_SIZE=32)
    results = []
    for setting in ("0", "1"):
        monkeypatch.setenv("FLEXFA_BACKWARD_FUSED", setting)
        results.append(check_backward(q, k, v, mods.softcap(8.0), mods.causal, block_mask,
                                      kernel_options={"BLOCK_M": 32, "BLOCK_N": 32}))
    for name, a, b in zip(("dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_bad_fused_setting_is_named(monkeypatch):
    monkeypatch.setenv("FLEXFA_BACKWARD_FUSED", "on")
    call = AttentionCall(None, None, None, 0.25, KernelOptions(), 1)
    with pytest.raises(InputError, match="FLEXFA_BACKWARD_FUSED must be auto, 0 or 1, got 'on'"):
        backward_runtime.fused_modes(call, True)


def test_fused_modes(monkeypatch):
    call = AttentionCall(None, None, None, 0.25, KernelOptions(), 1)
    deterministic = AttentionCall(None, None, None, 0.25, KernelOptions(deterministic=True), 1)
    monkeypatch.delenv("FLEXFA_BACKWARD_FUSED", raising=False)
    assert backward_runtime.fused_modes(call, True) == (False,)  # measured slower: opt-in
    assert backward_runtime.fused_modes(call, False) == (False,)
    assert backward_runtime.fused_modes(deterministic, True) == (False,)
    monkeypatch.setenv("FLEXFA_BACKWARD_FUSED", "1")
    assert backward_runtime.fused_modes(call, True) == (True,)
    assert backward_runtime.fused_modes(deterministic, True) == (False,)
    monkeypatch.setenv("FLEXFA_BACKWARD_FUSED", "0")
    assert backward_runtime.fused_modes(call, True) == (False,)
