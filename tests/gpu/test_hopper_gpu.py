"""Hopper-specific GPU checks: the template is chosen on sm_90, the direct (planned) launch
equals Triton's, fast tanh stays accurate, dispatch is cheap, tuning persists."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

import flexfa
from flexfa.runtime import autotune, plans
from flexfa.runtime.families.hopper import HOPPER

pytestmark = pytest.mark.gpu


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def _plans(family_name: str) -> list:
    return [p for p in plans.PLANS.values() if p.family.name == family_name]


@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_hopper_template_is_used_and_planned_launch_matches_first_launch():
    q, k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plans.PLANS.clear()
    mask = flexfa.create_block_mask(causal, 2, None, 1000, 1000, device="cuda")
    first = flexfa.flex_attention(q, k, v, score_mod=softcap, block_mask=mask)
    (plan,) = plans.PLANS.values()
    assert plan.family is HOPPER  # the default on sm_90
    # the next call launches the compiled kernel directly
    assert plan.steps[0].direct is not None
    out = torch.full_like(first, float("nan"))
    out.copy_(flexfa.flex_attention(q, k, v, score_mod=softcap, block_mask=mask))
    torch.testing.assert_close(out, first, atol=0, rtol=0)
    other = torch.randn_like(q)  # new data through the same plan
    ampere = flexfa.flex_attention(other, k, v, score_mod=softcap, block_mask=mask,
                                   kernel_options={"BACKEND": "AMPERE"})
    assert len(_plans("ampere")) == 1
    hop = flexfa.flex_attention(other, k, v, score_mod=softcap, block_mask=mask)
    assert float((hop.float() - ampere.float()).norm() / ampere.float().norm()) < 5e-3


@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_direct_c_launch_encodes_descriptors_per_address():
    """Cached plans call Triton's C launch function with TMA descriptors kept per base
    address (flexfa.runtime.launch): new tensors, reused addresses and repeated tensors all
    give what a fresh plan (Triton's own launcher) gives, forward and backward."""
    def step(q, k, v, do):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flexfa.flex_attention(q, k, v, score_mod=softcap, block_mask=mask)
        out.backward(do)
        return [out.detach(), q.grad, k.grad, v.grad]

    def fresh(*tensors):  # no plans: Triton's JIT launch path
        plans.PLANS.clear()
        return step(*tensors)
    mask = flexfa.create_block_mask(causal, 2, None, 512, 512, device="cuda")
    inputs = [[torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(4)] for _ in range(2)]
    expected = [fresh(*tensors) for tensors in inputs]
    step(*inputs[0])  # makes the plans; from here on the direct launches
    (plan,) = _plans("hopper")
    direct = plan.steps[0].direct
    assert direct.c_launch is not None and len(direct.descriptors) == 3
    (bplan,) = _plans("triton_bwd")
    assert all(step.direct.c_launch is not None for step in bplan.steps)
    for i in (0, 1, 0, 1):
        for got, want in zip(step(*inputs[i]), expected[i]):
            torch.testing.assert_close(got, want, atol=0, rtol=0)
    # the same addresses with new contents: the kept descriptors still read the new data
    for t, new in zip(inputs[0], inputs[1]):
        t.copy_(new)
    for got, want in zip(step(*inputs[0]), expected[1]):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_fast_tanh_is_accurate():
    q, k, v = (torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.float16) * 3 for _ in range(3))
    out = flexfa.flex_attention(q, k, v, score_mod=softcap)
    from flexfa.reference import attention_reference
    ref = attention_reference(q, k, v, softcap)
    # tanh.approx.f32 (relative error ~2**-11) next to fp16 rounding of P and out
    assert float((out.double() - ref).norm() / ref.norm()) < 3e-3


# benchmarks/dispatch_overhead.py at 4acea5d and a7d1ac9 (flexfa.api keeps call objects and
# their plans): 27-38 us dense, 31-35 us causal on two H200 machines (SDPA 19-28 us); eb9e67a took
# 46-62 / 52-56 us on the same host (benchmarks/results/gpu_checks/4acea5d/dispatch_ab.log).
# H100 hosts switch between a fast and a slow state for seconds at a time: one process read a
# causal call at 33-35 us in one state and 51-57 us in the other, for 2af40a6's tree and
# 010b3c7's alike (benchmarks/results/gpu_2026-12-06/dispatch_010b3c7/), with SDPA 16 against
# 25-27 us. So flexfa and SDPA run in alternating rounds: the fastest flexfa round must be under
# 50 us, or, on a host that stayed slow, flexfa's rounds within 2.5x the SDPA round beside each
# (the median of those ratios; 1.3-2.1 measured there). A cost added to dispatch fails both.
def test_dispatch_of_a_cached_call_is_under_50_us():
    import statistics

    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = flexfa.create_block_mask(causal, 1, None, 128, 128, device="cuda")

    def round_us(fn, calls=400):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    def call():
        return flexfa.flex_attention(q, k, v, block_mask=mask)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with torch.no_grad():
        warm_until = time.perf_counter() + 0.5
        while time.perf_counter() < warm_until:
            call()
            sdpa()
        rounds = [(round_us(call), round_us(sdpa)) for _ in range(12)]
    fastest = min(flexfa_us for flexfa_us, _ in rounds)
    ratio = statistics.median(flexfa_us / sdpa_us for flexfa_us, sdpa_us in rounds)
    text = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in rounds)
    assert fastest < 50 or ratio < 2.5, f"flexfa/SDPA us per cached call by round: {text}"


@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_tuned_config_is_reused_by_a_new_process(tmp_path):
    code = """
import torch, flexfa
q, k, v = (torch.randn(4, 16, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flexfa.flex_attention(q, k, v)
torch.cuda.synchronize()
"""
    env = {**os.environ, "FLEXFA_CACHE_DIR": str(tmp_path), "FLEXFA_AUTOTUNE": "1"}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    # the key names the GPU timed (autotune.device_tag), not only its architecture
    props = torch.cuda.get_device_properties(0)
    key = (f"fwd_hopper|cuda:90/{props.name}/{props.multi_processor_count}sm|e64|ev64|bf16|dense"
           f"|short|{autotune.toolchain()}")
    assert f"flexfa: tuned {key}" in first.stderr
    stored = json.loads((tmp_path / "autotune.json").read_text())
    assert key in stored and "fwd_hopper|cuda:90|e64|ev64|bf16|dense|short" not in stored
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert "tuning" not in second.stderr


@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_max_scores_match_flexattention_on_gpu():
    """AuxRequest(max_scores=True) on the GPU: the Hopper template's row maxima (planned
    launch included) against torch FlexAttention's and the float32 scores, lse unchanged."""
    from torch.nn.attention import flex_attention as torch_flex

    AuxRequest = getattr(torch_flex, "AuxRequest", None)
    if AuxRequest is None:
        pytest.skip("this torch has no AuxRequest")
    B, H, L, E = 2, 4, 1000, 128
    q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = flexfa.create_block_mask(causal, B, None, L, L, device="cuda")
    request = AuxRequest(lse=True, max_scores=True)
    for _ in range(2):  # the first launch, then the cached plan
        out, aux = flexfa.flex_attention(q, k, v, score_mod=softcap, block_mask=mask,
                                         return_aux=request)
    scores = softcap(q.float() @ k.float().transpose(-1, -2) / E ** 0.5, None, None, None, None)
    keep = torch.ones(L, L, device="cuda", dtype=torch.bool).tril()
    want = scores.masked_fill(~keep, float("-inf")).amax(-1)
    torch.testing.assert_close(aux.max_scores, want, rtol=1e-4, atol=1e-4)
    _, plain = flexfa.flex_attention(q, k, v, score_mod=softcap, block_mask=mask, return_lse=True)
    torch.testing.assert_close(aux.lse, plain, rtol=0, atol=0)
    # torch's eager flex_attention (its math path): this process has TRITON_INTERPRET=1 from
    # tests/conftest.py, under which Inductor's compiled kernels cannot run
    theirs_mask = torch_flex.create_block_mask(causal, B, None, L, L, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that eager flex_attention is slow
        _, theirs = torch_flex.flex_attention(q, k, v, score_mod=softcap, block_mask=theirs_mask,
                                              return_aux=request)
    torch.testing.assert_close(aux.max_scores, theirs.max_scores, rtol=1e-3, atol=1e-3)
