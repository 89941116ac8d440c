"""The host work of a cached backward (issue 22): what ``FlexAttentionFunction.backward`` runs
once its plan exists. On a GPU each torch op there is host time before the first backward
kernel, and a sync (``.item()``, ``.tolist()``, ``.cpu()``, a data-dependent shape) stalls
the step: the block-mask checks, the dS bands and the plan are worked out once, so a cached
backward allocates its outputs and launches, nothing else. The ops are recorded with a
TorchDispatchMode and Tensor methods that would copy to the host are made to raise; the
gradients are checked against torch's autograd of the float64 reference."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flexfa
from flexfa.autograd import FlexAttentionFunction
from flexfa.reference import attention_reference
from flexfa.runtime.launch import Step

# ops that wait for the device on a GPU: scalar reads and data-dependent shapes
SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique")
HOST_COPIES = ("item", "tolist", "cpu", "numpy")
# views and saved-tensor unpacking cost no device work
VIEWS = ("detach", "view", "alias")
# uninitialized allocations, counted together (however torch names the factory)
ALLOCATIONS = ("empty", "empty_like", "new_empty", "empty_strided")


class OpLog(TorchDispatchMode):
    """The ops run outside kernel launches (the interpreter's own are not the backward's)."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.paused = [], 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def sliding():
    return flexfa.create_block_mask(flexfa.mods.sliding_window(32), 1, None, 128, 128,
                                    BLOCK_SIZE=32)


def case(name):
    """(q, k, v, flex_attention kwargs, captured leaves); B=1 H=2 S=128 E=16 float32."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 128, 16, requires_grad=True)
    hkv = 1 if name == "gqa" else 2
    k, v = (torch.randn(1, hkv, 128, 16, requires_grad=True) for _ in range(2))
    kwargs, leaves = {}, []
    if name == "gqa":
        kwargs["enable_gqa"] = True
    if name in ("sliding", "ds_workspace", "learnable_deterministic"):
        kwargs["block_mask"] = sliding()
    if name == "ds_workspace":
        kwargs["kernel_options"] = {"DS_WORKSPACE": True}
    if name in ("alibi", "learnable_deterministic"):
        slopes = torch.rand(2, requires_grad=name == "learnable_deterministic")
        leaves = [slopes] if slopes.requires_grad else []

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
        kwargs["score_mod"] = alibi
    if name == "learnable_deterministic":
        kwargs["kernel_options"] = {"deterministic": True}
    if name == "frozen_kv":  # no dK/dV wanted: no dk, dv allocated, one kernel
        k.requires_grad_(False)
        v.requires_grad_(False)
    if name == "dropout":  # the backward draws the forward's keep mask from its seed tensor
        kwargs["dropout_p"] = 0.25
    if name == "sinks":
        kwargs["sinks"] = torch.randn(2, requires_grad=True)
        leaves = [kwargs["sinks"]]
    return q, k, v, kwargs, leaves


def recorded_backward(monkeypatch, q, k, v, kwargs, grad_out) -> OpLog:
    """One fwd+bwd whose backward (only) runs under ``OpLog`` with host copies raising
    (kernel launches apart: they run, unrecorded and unpatched, and are counted)."""
    log, original, launch = OpLog(), FlexAttentionFunction.backward, Step.launch
    real = {method: getattr(torch.Tensor, method) for method in HOST_COPIES}

    def backward(ctx, *grads):
        with monkeypatch.context() as patch:
            for method in HOST_COPIES:
                patch.setattr(torch.Tensor, method, _raising(method))
            patch.setattr(Step, "launch", counted_launch)
            with log:
                results = original(ctx, *grads)
        log.returned = [t.data_ptr() for t in results if t is not None]
        return results

    def counted_launch(step, args, device, grid=None, stream=None):
        log.launches += 1
        log.paused = True
        with monkeypatch.context() as patch:
            for method in HOST_COPIES:  # the interpreter's own copies
                patch.setattr(torch.Tensor, method, real[method])
            try:
                launch(step, args, device, grid, stream)
            finally:
                log.paused = False
    monkeypatch.setattr(FlexAttentionFunction, "backward", staticmethod(backward))
    flexfa.flex_attention(q, k, v, **kwargs).backward(grad_out)
    monkeypatch.setattr(FlexAttentionFunction, "backward", staticmethod(original))
    return log


def _raising(method):
    def raising(*args, **kwargs):
        raise AssertionError(f"Tensor.{method}() in a cached backward (a device sync)")
    return raising


# (kernel launches, what a cached backward may run besides views): allocations of dq, dk,
# dv and delta (and the dS workspace, with three kernels); a captured tensor's gradient adds
# its accumulator (deterministic: value, rest and bound words, the kernels binding the
# first) and its fixed-point conversion with the bound's check (unbind, >>, ==, where)
EXPECTED = {
    "dense": (2, {"allocation": 4}),
    "sliding": (2, {"allocation": 4}),
    "gqa": (2, {"allocation": 4}),
    "alibi": (2, {"allocation": 4}),
    "ds_workspace": (3, {"allocation": 5}),
    "learnable_deterministic": (2, {"allocation": 4, "zeros": 1, "select": 1, "unbind": 1,
                                    "__rshift__": 1, "eq": 1, "_to_copy": 3, "div": 2,
                                    "add": 1, "where": 1, "scalar_tensor": 1}),
    "dropout": (2, {"allocation": 4}),
    "frozen_kv": (1, {"allocation": 2}),
    # the lse of +inf sinks' heads (sink_limit_lse: ==, clamp, where) and the sinks'
    # gradient from lse and delta (sinks_grad)
    "sinks": (2, {"allocation": 4, "eq": 1, "clamp": 2, "where": 1, "sub": 1, "exp": 1,
                  "nan_to_num": 1, "mul": 1, "sum": 1, "neg": 1}),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_cached_backward_allocates_and_launches_only(monkeypatch, name):
    q, k, v, kwargs, leaves = case(name)
    grad_out = torch.randn(1, 2, 128, 16)
    flexfa.flex_attention(q, k, v, **kwargs).backward(grad_out)  # makes the plans
    for t in (q, k, v, *leaves):
        t.grad = None
    log = recorded_backward(monkeypatch, q, k, v, kwargs, grad_out)
    assert not [op for op in log.ops if op in SYNC_OPS], log.ops
    work = {}
    for op in log.ops:
        if op not in VIEWS:
            op = "allocation" if op in ALLOCATIONS else op
            work[op] = work.get(op, 0) + 1
    assert (log.launches, work) == EXPECTED[name], log.ops
    # AccumulateGrad took the returned gradients as they are: nothing in flexfa kept a
    # reference (which would make it copy each one on the device)
    for t in (q, k, v, *leaves):
        if t.requires_grad:
            assert t.grad.data_ptr() in log.returned, "a gradient was copied by AccumulateGrad"
    if name == "dropout":  # its gradients: tests/kernels/test_dropout.py
        return
    # the cached backward's gradients are right (a stale plan binding would show here)
    q64, k64, v64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v))
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    slopes = leaves64[0] if leaves else None
    if "score_mod" in kwargs and not leaves:  # a captured tensor without grad
        slopes = kwargs["score_mod"].__closure__[0].cell_contents

    def alibi64(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    score_mod = alibi64 if "score_mod" in kwargs else None
    mask_mod = flexfa.mods.sliding_window(32) if "block_mask" in kwargs else None
    sinks = leaves64[0] if name == "sinks" else None
    attention_reference(q64, k64, v64, score_mod, mask_mod, enable_gqa=name == "gqa",
                        sinks=sinks).backward(grad_out.double())
    for got, want in zip((q, k, v, *leaves), (q64, k64, v64, *leaves64)):
        if got.requires_grad:
            torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-4, rtol=2e-4)
        else:
            assert got.grad is None


def test_a_plan_made_without_dkdv_serves_calls_that_want_them():
    # with a captured tensor needing grad both calls take the same plan (not fusable): the
    # first (k, v frozen) makes it with real dk, dv, whose strides it fixes; the second,
    # wanting dK/dV, gets right gradients from it
    q, k, v, kwargs, (slopes,) = case("learnable_deterministic")
    k_strided, v_strided = (t.detach().transpose(1, 2).contiguous().transpose(1, 2)
                            for t in (k, v))  # [B, S, H, E] memory: not what dk, dv get
    grad_out = torch.randn(1, 2, 128, 16)
    flexfa.flex_attention(q, k_strided, v_strided, **kwargs).backward(grad_out)
    for t in (k_strided, v_strided):
        t.requires_grad_()
    q.grad = slopes.grad = None
    flexfa.flex_attention(q, k_strided, v_strided, **kwargs).backward(grad_out)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k_strided, v_strided, slopes)]

    def alibi64(score, b, h, q_idx, kv_idx):
        return score + leaves64[3][h] * (kv_idx - q_idx)
    attention_reference(*leaves64[:3], alibi64, flexfa.mods.sliding_window(32)
                        ).backward(grad_out.double())
    for got, want in zip((q, k_strided, v_strided, slopes), leaves64):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=2e-4, rtol=2e-4)
