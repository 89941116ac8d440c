"""The backward with dQ from a stored dS (``BackwardSpec.ds_dq``; FLEXFA_BACKWARD_DS=1 forces
it under the interpreter): delta kernel, dK/dV storing each tile's dS in a workspace, dQ =
dS @ K from it. On sm_90 at head dim 128 it is the default (``use_ds_dq``); the stores and
loads go through tensor descriptors there (FLEXFA_BACKWARD_TMA=1 here) or pointers."""
import pytest
import torch

from flexfa import mods
from flexfa.blockmask import create_block_mask
from flexfa.errors import InputError
from flexfa.runtime import backward as backward_runtime
from backward_utils import check_backward, record_backward_specs
from forward_utils import make_qkv


@pytest.fixture
def spy_specs(monkeypatch):
    """Force the dS path and record the BackwardSpec of every backward pass."""
    monkeypatch.setenv("FLEXFA_BACKWARD_DS", "1")
    return record_backward_specs(monkeypatch)


@pytest.mark.parametrize("tma", ["0", "1"])
def test_ds_backward_ragged_gqa_alibi_causal(spy_specs, monkeypatch, tma):
    # L, S not multiples of the tiles nor of the blocks (workspace rows past S never written,
    # columns past L garbage for rows that are not stored); GQA 2; full and partial blocks; a
    # captured tensor without gradient; lse gradient (delta from the delta kernel)
    monkeypatch.setenv("FLEXFA_BACKWARD_TMA", tma)
    B, Hq, Hkv, L, S, E, Ev = 2, 4, 2, 200, 136, 48, 32
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype=torch.bfloat16, seed=41)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs() / 16.0

    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=64)
    check_backward(q, k, v, alibi, mods.causal, block_mask, enable_gqa=True, with_lse=True,
                   kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    assert spy_specs and all(s.ds_dq and s.use_tma == (tma == "1") for s in spy_specs)


def test_ds_backward_softcap_dense_and_empty_rows(spy_specs):
    # no block mask (dense walks, a ragged last kv tile); then a mask leaving rows empty,
    # whose dq must be exactly 0
    q, k, v = make_qkv(1, 2, 2, 72, 100, 16, dtype=torch.float16, seed=42)
    check_backward(q, k, v, mods.softcap(5.0), kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    q, k, v = make_qkv(1, 2, 2, 64, 48, 16, dtype=torch.float32, seed=43)

    def late_start(b, h, q_idx, kv_idx):
        return (q_idx >= 20) & (kv_idx <= q_idx)
    block_mask = create_block_mask(late_start, None, None, 64, 48, device="cpu", BLOCK_SIZE=16)
    dq, _, _ = check_backward(q, k, v, None, late_start, block_mask,
                              kernel_options={"BLOCK_M": 16, "BLOCK_N": 16, "deterministic": True})
    assert spy_specs and all(s.ds_dq for s in spy_specs)  # deterministic: no atomics here
    assert torch.equal(dq[:, :, :20], torch.zeros_like(dq[:, :, :20]))


def test_ds_matches_the_two_kernels(monkeypatch):
    """Both paths on the same float32 inputs give the same gradients (dS is the same tile,
    stored in float32 here)."""
    q, k, v = make_qkv(1, 2, 2, 96, 80, 32, dtype=torch.float32, seed=44)
    block_mask = create_block_mask(mods.causal, None, None, 96, 80, device="cpu", BLOCK_SIZE=32)
    specs = record_backward_specs(monkeypatch)
    results = []
    for setting in ("0", "1"):
        monkeypatch.setenv("FLEXFA_BACKWARD_DS", setting)
        results.append(check_backward(q, k, v, mods.softcap(8.0), mods.causal, block_mask,
                                      kernel_options={"BLOCK_M": 32, "BLOCK_N": 32}))
    assert [s.ds_dq for s in specs] == [False, True]
    for name, a, b in zip(("dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_ds_is_not_used_where_it_cannot_be(spy_specs):
    """A captured tensor that needs a gradient (the dQ kernel computes it from P): the two
    kernels, correct gradients."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.bfloat16, seed=45)
    bias = torch.zeros(2, requires_grad=True)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    check_backward(q, k, v, learnable, buffers=(bias,),
                   kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    assert spy_specs and not any(s.ds_dq for s in spy_specs)


def test_use_ds_dq_rule_and_budget(monkeypatch):
    use = backward_runtime.use_ds_dq
    cpu = torch.device("cpu")
    monkeypatch.delenv("FLEXFA_BACKWARD_DS", raising=False)
    monkeypatch.delenv("FLEXFA_BACKWARD_DS_MAX_BYTES", raising=False)
    assert use(True, "cuda:90", True, 128, 1 << 30, cpu)  # auto: sm_90, descriptors, E 128
    assert not use(True, "cuda:90", True, 64, 1 << 20, cpu)  # E = 64 measured slower
    assert not use(True, "cuda:90", False, 128, 1 << 20, cpu)  # no descriptors
    assert not use(True, "cuda:80", True, 128, 1 << 20, cpu)
    assert not use(True, "interpret", True, 128, 1 << 20, cpu)
    assert not use(False, "cuda:90", True, 128, 1 << 20, cpu)  # captured grads / no dK, dV
    monkeypatch.setenv("FLEXFA_BACKWARD_DS_MAX_BYTES", str(1 << 20))
    assert use(True, "cuda:90", True, 128, 1 << 20, cpu)
    assert not use(True, "cuda:90", True, 128, (1 << 20) + 1, cpu)  # over the budget
    monkeypatch.setenv("FLEXFA_BACKWARD_DS", "1")
    assert use(True, "interpret", False, 64, 1 << 20, cpu)
    assert not use(False, "interpret", False, 64, 1 << 20, cpu)
    monkeypatch.setenv("FLEXFA_BACKWARD_DS", "0")
    assert not use(True, "cuda:90", True, 128, 1 << 20, cpu)
    monkeypatch.setenv("FLEXFA_BACKWARD_DS", "yes")
    with pytest.raises(InputError, match="FLEXFA_BACKWARD_DS must be auto, 0 or 1, got 'yes'"):
        use(True, "cuda:90", True, 128, 1 << 20, cpu)


def test_workspace_shape_covers_every_walked_tile():
    spec = backward_runtime.BackwardSpec(
        dtype="bf16", head_dim=64, head_dim_v=64, block_m1=32, block_n1=64, block_m2=64,
        block_n2=32, num_warps=4, num_stages=2, has_block_mask=True, has_full_blocks=True,
        sparse_q=128, sparse_kv=128, even_l1=False, even_s1=False, even_l2=False,
        even_s2=False, gqa_group=1, deterministic=False, has_dlse=False,
        input_precision="ieee", target="cuda:90", ds_dq=True)
    assert spec.ds_shape(200, 136) == (256, 256)  # keys (rows) and queries padded to 128


@pytest.mark.parametrize("which", ["dkdv", "dq"])
def test_ds_kernels_compile_for_sm90_with_tma(which):
    """The dS store (dK/dV) and load (dQ) go through tensor descriptors on sm_90: TMA bulk
    copies and wgmma in both kernels."""
    from flexfa.codegen import compile_check

    name = f"bwd_ds_{which}_d128_bf16_causal"
    result = compile_check.compile_job(name, 90, compile_check.REGISTRY[name])
    assert result.ok, result.error
    assert result.wgmma and "cp.async.bulk.tensor" in result.ptx
    if which == "dkdv":  # the store of dS: a bulk copy from shared to global memory
        assert "cp.async.bulk.tensor.2d.global.shared" in result.ptx


def test_out_of_memory_for_the_workspace_falls_back_to_the_recomputing_kernels(monkeypatch):
    """The workspace fit the budget when the signature was planned but cannot be allocated
    now: the call runs the dQ kernel that recomputes P and dP, with correct gradients."""
    monkeypatch.setenv("FLEXFA_BACKWARD_DS", "1")
    specs = record_backward_specs(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, dtype=torch.float32, seed=46)
    workspace = 1 * 2 * 64 * 64  # B * Hq * keys * queries, padded to the 64-wide tiles
    real_empty = torch.empty
    failed = []

    def empty(*shape, **kwargs):
        if shape == (workspace,):
            failed.append(shape)
            raise torch.cuda.OutOfMemoryError("no room for the dS workspace (test)")
        return real_empty(*shape, **kwargs)
    monkeypatch.setattr(torch, "empty", empty)
    check_backward(q, k, v, mods.softcap(4.0), kernel_options={"BLOCK_M": 64, "BLOCK_N": 64})
    assert failed and [s.ds_dq for s in specs] == [True, False]


@pytest.mark.parametrize("tma", ["0", "1"])
def test_unwritten_workspace_entries_never_reach_the_gradients(monkeypatch, tma):
    """On a GPU the workspace holds whatever the allocator's memory held: here it starts as
    NaN. Keys past S (the last block's padding, never written by dK/dV) are masked when read;
    queries past L only reach dq rows that are not stored; tiles the mask skips are never read."""
    monkeypatch.setenv("FLEXFA_BACKWARD_DS", "1")
    monkeypatch.setenv("FLEXFA_BACKWARD_TMA", tma)
    specs = record_backward_specs(monkeypatch)
    # S = 40: the dK/dV programs (32 keys each) write key rows 0..63, the dQ kernel walks the
    # whole 128-key block, so rows 64..127 are read unwritten
    B, H, L, S, E = 1, 2, 90, 40, 16
    q, k, v = make_qkv(B, H, H, L, S, E, dtype=torch.bfloat16, seed=47)
    workspace = B * H * 128 * 128  # keys and queries padded to the 128-token blocks
    real_empty = torch.empty
    poisoned = []

    def empty(*shape, **kwargs):
        if shape == (workspace,):
            poisoned.append(shape)
            return torch.full(shape, float("nan"), **kwargs)
        return real_empty(*shape, **kwargs)
    monkeypatch.setattr(torch, "empty", empty)
    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=128)
    dq, dk, dv = check_backward(q, k, v, mods.softcap(6.0), mods.causal, block_mask,
                                kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    assert poisoned and specs and all(s.ds_dq for s in specs)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
