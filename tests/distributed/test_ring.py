"""Ring attention (flexfa.distributed) with 2 and 3 gloo processes on the CPU, kernels under
the Triton interpreter: outputs, lse and gradients (q, k, v, a learned bias) of the gathered
shards equal single-process flex_attention on the whole sequence and the float64 reference,
with and without load balancing, and with grouped-query attention (fewer key/value heads);
fully masked ring steps launch no kernel."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

import flexfa
from flexfa.distributed import positions, shard_sequence, unshard
from flexfa.errors import InputError, InputTypeError
from reference import assert_close_to_reference, reference_attention
from .ring_cases import CASES, HEADS, LENGTH, heads, inputs, mods, sinks
from .ring_workers import free_port, result_name, run_rank, spawn_ranks

TIMEOUT_S = 240
# (case, load_balance, variant): the ring for every case; on two ranks also the all-gather
# exchange, a 1-D DeviceMesh group with method "auto" (which picks all-gather for these
# small shards) and a 2-D mesh's "cp" dimension, and grouped-query attention through both
# exchanges (balanced causal on the ring; the learned bias unbalanced on the ring and the
# all-gather); attention sinks through both exchanges and with GQA; 3 and 4 ranks for the
# ring alone
RUNS = {2: [(case, lb, "ring") for case in CASES for lb in (False, True)]
        + [("causal", True, "allgather"), ("learned_bias", False, "mesh"),
           ("causal", False, "mesh2d"), ("gqa_causal", True, "ring"),
           ("gqa_learned_bias", False, "ring"), ("gqa_learned_bias", False, "allgather"),
           ("sinks", True, "allgather"), ("gqa_sinks", False, "ring")],
        3: [("causal", False, "ring"), ("causal", True, "ring"), ("document", True, "ring"),
            ("sinks", True, "ring")],
        4: [("causal", True, "ring")]}
# runs of their own after those (ring_workers._one_run's special cases)
EXTRA_RUNS = {2: [("refused_options", False, "ring"), ("disagreeing_ranks", False, "ring"),
                  ("short_captured", False, "ring"), ("limit_sinks", True, "ring"),
                  ("gaps", True, "ring")]}


def _spawn(world: int, out_dir: str) -> None:
    """Run every case of RUNS[world] on ``world`` ranks; fail on an error or a hang."""
    runs = RUNS[world] + EXTRA_RUNS.get(world, [])
    spawn_ranks(run_rank, (world, free_port(), runs, out_dir), world, out_dir, TIMEOUT_S)


@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory):
    """world -> the folder of every rank's results (each world spawned once, on first use)."""
    done = {}

    def get(world: int):
        if world not in done:
            done[world] = str(tmp_path_factory.mktemp(f"ring{world}"))
            _spawn(world, done[world])
        return done[world]
    return get


def _load(out_dir: str, case: str, load_balance: bool, variant: str, rank: int) -> dict:
    return torch.load(os.path.join(out_dir, result_name(case, load_balance, variant, rank)))


def _gathered(out_dir: str, case: str, load_balance: bool, variant: str, world: int) -> dict:
    shards = [_load(out_dir, case, load_balance, variant, rank) for rank in range(world)]
    result = {name: unshard([s[name] for s in shards], load_balance, dim=2)
              for name in ("out", "lse", "dq", "dk", "dv")}
    result["dlearned"] = shards[0]["dlearned"]
    result["dsinks"] = shards[0]["dsinks"]
    result["ranks"] = shards
    return result


@functools.cache  # a case's results serve each (world, load balance, exchange) it runs on
def _single_process(case: str, length: int, dtype_reference: bool):
    """(out, lse, dq, dk, dv, dlearned) on the whole sequence: flexfa, or the reference in
    float64 / float32 (``dtype_reference`` None: flexfa)."""
    q, k, v, grad_out, grad_lse = inputs(length, case)
    score_mod, mask_mod, learned = mods(case, length)
    case_sinks = sinks(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if dtype_reference is None:
        mask = None if mask_mod is None else flexfa.create_block_mask(
            mask_mod, None, None, length, length, device="cpu", BLOCK_SIZE=16)
        out, lse = flexfa.flex_attention(q, k, v, score_mod, mask, enable_gqa=gqa,
                                         return_lse=True, sinks=case_sinks)
    else:
        out, lse = reference_attention(q, k, v, score_mod, mask_mod, enable_gqa=gqa,
                                       dtype=dtype_reference, sinks=case_sinks)
    ((out * grad_out.to(out.dtype)).sum() + (lse * grad_lse.to(lse.dtype)).sum()).backward()
    return {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dlearned": [t.grad for t in learned],
            "dsinks": None if case_sinks is None else case_sinks.grad}


def test_options_a_step_refuses_leave_nothing_in_flight(ranks_dir):
    """Options only the first step's kernel choice refuses raise on every rank after the K/V
    shift in flight completes: the group's next collective runs (it timed out before)."""
    for rank in range(2):
        result = _load(ranks_dir(2), "refused_options", False, "ring", rank)
        assert len(result["errors"]) == 2, result["errors"]
        assert "BACKEND='DECODE'" in result["errors"][0]
        assert "BLOCK_N=128" in result["errors"][1]
        assert result["all_reduce"] == 2.0


def test_ranks_that_disagree_are_refused(ranks_dir):
    """Ranks calling with different mods, windows, load_balance, method, shard lengths, sinks
    or values of a captured tensor (document ids): an InputError on every rank naming what
    differs (silently wrong results, a hang or an abort inside gloo before), before any K/V
    transfer: the group's next calls run."""
    for rank in range(2):
        result = _load(ranks_dir(2), "disagreeing_ranks", False, "ring", rank)
        shown = {"mask_mod": "mask_mod", "window": "mask_mod", "load_balance": "load_balance",
                 "method": "method", "length": "query shape", "sinks": "sinks",
                 "sinks' values": "sinks' values",
                 "captured values": "the captured tensors' values"}
        assert sorted(result["errors"]) == sorted(shown)
        for name, field in shown.items():
            assert f"rank {rank} and rank {1 - rank} of the group disagree on {field} " in \
                result["errors"][name]
        assert f"(this rank's: [0.5, {0.5 * rank}])" in result["errors"]["sinks' values"]
        assert result["all_reduce"] == 2.0 and result["agreed"].shape == (1, 2, 12, 16)


def test_captured_tensors_read_past_their_size_at_global_positions(ranks_dir):
    """A captured tensor read out of range at the global positions the mods see: an
    InputError naming the user's mod and the global domain on every rank, before any K/V
    transfer (each step's check named the internal wrapper and the shard's domain; where
    one rank's values were out of range, that rank raised inside its steps alone)."""
    results = [_load(ranks_dir(2), "short_captured", False, "ring", rank) for rank in range(2)]
    for result in results:
        assert sorted(result["errors"]) == ["one_rank", "short"]
        short = result["errors"]["short"]
        assert short.startswith("ring_attention: the score_mod 'short_bias' reads a captured "
                                "tensor of shape (20,)") and "q_idx < 24, kv_idx < 24" in short
        assert "global positions" in short and "global_" not in short
        assert result["all_reduce"] == 2.0
    assert "indices" in results[1]["errors"]["one_rank"] and \
        "(size 24)" in results[1]["errors"]["one_rank"]
    assert "rank 0 and rank 1 of the group disagree on the captured tensors' indices" in \
        results[0]["errors"]["one_rank"]


def test_sinks_of_plus_and_minus_infinity(ranks_dir):
    """Sinks of +inf and -inf through the ring: head 0 takes the limit (out 0, lse +inf, no
    gradient into q, k, v from its rows, d sink = the sum of its rows' dlse), as
    single-process flex_attention gives it; head 1 is bit for bit the call without sinks."""
    limits = _gathered(ranks_dir(2), "limit_sinks", True, "ring", 2)
    none = _gathered(ranks_dir(2), "gaps", True, "ring", 2)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.equal(limits[name][:, 1], none[name][:, 1]), name
    assert torch.equal(limits["out"][:, 0], torch.zeros_like(limits["out"][:, 0]))
    assert torch.equal(limits["lse"][:, 0], torch.full_like(limits["lse"][:, 0], float("inf")))
    assert torch.equal(limits["dq"][:, 0], torch.zeros_like(limits["dq"][:, 0]))
    single = _single_process("limit_sinks", LENGTH, None)
    for name in ("out", "lse", "dq", "dk", "dv"):
        torch.testing.assert_close(limits[name], single[name].detach(), atol=2e-5, rtol=2e-5)
    for shard in limits["ranks"]:
        assert torch.equal(shard["dsinks"], limits["dsinks"])
        torch.testing.assert_close(shard["dsinks"], single["dsinks"], atol=1e-5, rtol=1e-5)
    grad_lse = inputs(LENGTH, "limit_sinks")[4]
    assert torch.equal(single["dsinks"][0], grad_lse[:, 0].sum())


@pytest.mark.parametrize("world,case,load_balance,variant",
                         [(w, *run) for w, runs in RUNS.items() for run in runs])
def test_ring_matches_single_process_and_reference(ranks_dir, world, case, load_balance,
                                                   variant):
    ring = _gathered(ranks_dir(world), case, load_balance, variant, world)
    length = LENGTH
    single = _single_process(case, length, None)
    exact = _single_process(case, length, torch.float64)
    eager = _single_process(case, length, torch.float32)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert_close_to_reference(ring[name], exact[name], eager[name], name=f"ring {name}")
        torch.testing.assert_close(ring[name], single[name].detach(), atol=2e-5, rtol=2e-5,
                                   msg=lambda m: f"ring vs single-process {name}: {m}")
    for ours, ref64, ref32 in zip(ring["dlearned"], exact["dlearned"], eager["dlearned"]):
        assert_close_to_reference(ours, ref64, ref32, name="ring learned-bias grad")
    assert (ring["dsinks"] is None) == (exact["dsinks"] is None)
    if ring["dsinks"] is not None:
        assert_close_to_reference(ring["dsinks"], exact["dsinks"], eager["dsinks"],
                                  name="ring sinks grad")
        torch.testing.assert_close(ring["dsinks"], single["dsinks"], atol=2e-5, rtol=2e-5)
    for shard in ring["ranks"][1:]:  # summed over the group: every rank has the same
        for ours, first in zip(shard["dlearned"], ring["dlearned"]):
            assert torch.equal(ours, first)
        if ring["dsinks"] is not None:
            assert torch.equal(shard["dsinks"], ring["dsinks"])


@pytest.mark.parametrize("world", [2, 3])
def test_fully_masked_steps_launch_no_kernel(ranks_dir, world):
    """Causal without load balancing: rank r's q shard precedes every kv shard of a later
    rank, so it runs r + 1 of the W steps, in the forward and in the backward's recompute.
    With load balancing every step has unmasked pairs (each shard holds a tail chunk)."""
    out_dir = ranks_dir(world)
    for rank in range(world):
        plain = _load(out_dir, "causal", False, "ring", rank)
        assert (plain["forward_calls"], plain["backward_calls"]) == (rank + 1, rank + 1)
        balanced = _load(out_dir, "causal", True, "ring", rank)
        assert (balanced["forward_calls"], balanced["backward_calls"]) == (world, world)


@pytest.mark.parametrize("case,load_balance,variant", [run for run in RUNS[2]])
def test_kernels_get_the_shards_key_value_heads(ranks_dir, case, load_balance, variant):
    """With GQA every step's kernel (forward and recompute) gets K/V of Hkv heads, as they
    travelled, and enable_gqa; without it Hq heads and enable_gqa False."""
    q_heads, kv_heads = heads(case)
    for rank in range(2):
        result = _load(ranks_dir(2), case, load_balance, variant, rank)
        assert result["kernel_kv_heads"] == [(kv_heads, q_heads != kv_heads)]
        assert result["dk"].shape[1] == result["dv"].shape[1] == kv_heads


@pytest.mark.parametrize("case,load_balance,variant",
                         [run for run in RUNS[2] if run[2] != "ring"])
def test_allgather_and_mesh_match_the_ring(ranks_dir, case, load_balance, variant):
    """The all-gather exchange and the DeviceMesh group give the ring's results: the same
    kernels on the same shards; only the order in which dK/dV contributions are summed
    differs (reduce-scatter against the travelling accumulators)."""
    ring = _gathered(ranks_dir(2), case, load_balance, "ring", 2)
    other = _gathered(ranks_dir(2), case, load_balance, variant, 2)
    for name in ("out", "lse", "dq"):
        assert torch.equal(other[name], ring[name]), f"{variant} {name} differs from the ring"
    for name in ("dk", "dv"):
        torch.testing.assert_close(other[name], ring[name], atol=1e-6, rtol=1e-6)
    for ours, theirs in zip(other["dlearned"], ring["dlearned"]):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    if ring["dsinks"] is not None:
        torch.testing.assert_close(other["dsinks"], ring["dsinks"], atol=1e-6, rtol=1e-6)
    for rank, shard in enumerate(other["ranks"]):  # the same steps skipped
        plain = ring["ranks"][rank]
        assert (shard["forward_calls"], shard["backward_calls"]) == \
            (plain["forward_calls"], plain["backward_calls"])
        assert plain["method"] == ["ring"]
        assert shard["method"] == ["ring" if variant == "mesh2d" else "allgather"]
        if variant == "mesh2d":
            assert "2-D DeviceMesh" in shard["mesh_error"] and "mesh_dim=" in shard["mesh_error"]


@pytest.mark.parametrize("world,load_balance", [(2, False), (3, True), (4, True), (4, False)])
def test_shard_unshard_round_trip(world, load_balance):
    x = torch.arange(2 * 3 * 8 * world * 2).reshape(2, 3, 8 * world, 2)
    shards = [shard_sequence(x, r, world, load_balance) for r in range(world)]
    assert torch.equal(unshard(shards, load_balance), x)
    if load_balance:  # rank 0 holds the first and the last chunk
        chunk = x.shape[2] // (2 * world)
        assert torch.equal(shards[0][:, :, :chunk], x[:, :, :chunk])
        assert torch.equal(shards[0][:, :, chunk:], x[:, :, -chunk:])


def test_shard_rejects_lengths_that_do_not_split():
    with pytest.raises(InputError, match="multiple of 4"):
        shard_sequence(torch.zeros(1, 1, 6, 2), 0, 2, load_balance=True)
    with pytest.raises(InputError, match="rank must be in 0..world-1"):
        shard_sequence(torch.zeros(1, 1, 8, 2), 2, 2, load_balance=False)


@pytest.mark.parametrize("lengths,load_balance", [((5, 5), True), ((4, 6), False),
                                                  ((4, 6), True)])
def test_unshard_rejects_shards_shard_sequence_cannot_cut(lengths, load_balance):
    """Shards of unequal lengths, or odd ones with load balancing, were put back in a wrong
    order without an error ([0, 1, 2, 0, 1, 2, 3, 4, 3, 4] from two shards of 5)."""
    shards = [torch.arange(n) for n in lengths]
    with pytest.raises(InputError) as caught:
        unshard(shards, load_balance, dim=0)
    assert "one length along dim 0" in str(caught.value)
    assert f"got lengths {list(lengths)}" in str(caught.value)


def test_steps_reuse_one_trace_and_one_kernel():
    """Moving the mods to another kv shard rewrites the captured positions in place: the trace
    and the kernel of the first step serve the next (no retrace, no new kernel source)."""
    from flexfa.distributed.sharding import positions
    from flexfa.distributed.steps import RingMods
    from flexfa.runtime.cache import STATS

    world, length = 2, 24
    ring_mods = RingMods(None, mods("sliding_window", 2 * length)[1],
                         positions(1, world, length, True), length, 1, HEADS, 16)
    first = flexfa.trace(ring_mods.mask_mod)
    q, k, v = (torch.randn(1, HEADS, length, 16) for _ in range(3))
    loads = []
    for source in (1, 0):
        runs, mask = ring_mods.at_step(positions(source, world, length, True))
        assert runs and flexfa.trace(ring_mods.mask_mod) is first
        before = STATS.codegen + STATS.disk_hits
        out = flexfa.flex_attention(q, k, v, block_mask=mask)
        loads.append(STATS.codegen + STATS.disk_hits - before)
        dense = flexfa.create_mask(ring_mods.mask_mod, 1, 1, length, length, device="cpu")
        exact, _ = reference_attention(q, k, v, mask_mod=lambda b, h, i, j: dense[0, 0, i, j])
        torch.testing.assert_close(out, exact.float(), atol=2e-5, rtol=2e-5)
    assert loads[1] == 0, f"the second step loaded {loads[1]} kernel(s)"


def test_ring_attention_rejects_bad_shards_before_communicating():
    from flexfa.distributed import ring_attention
    from flexfa.errors import InputTypeError

    q = torch.zeros(1, 2, 6, 16)
    with pytest.raises(InputError, match="its length 5 is odd"):
        ring_attention(q[:, :, :5], q[:, :, :5], q[:, :, :5])
    with pytest.raises(InputError, match="one length; got 6, 4, 4"):
        ring_attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(InputError, match=r"\[B, H, S_local, E\], got shape \(2, 6, 16\)"):
        ring_attention(q[0], q, q)
    # what each step's flex_attention refuses, refused before any transfer is posted
    with pytest.raises(InputTypeError, match="key has dtype torch.float64"):
        ring_attention(q, q.double(), q)
    with pytest.raises(InputError, match="key has head_dim 8 but query has 16"):
        ring_attention(q, q[..., :8], q)
    with pytest.raises(InputError, match="scale must be finite"):
        ring_attention(q, q, q, scale=float("nan"))
    with pytest.raises(InputError, match="NO_SUCH_OPTION"):
        ring_attention(q, q, q, kernel_options={"NO_SUCH_OPTION": 1})
    # attention sinks as flex_attention checks them, named ring_attention's
    with pytest.raises(InputError, match=r"ring_attention: sinks has shape \(3,\) but query "
                                         r"has 2 heads"):
        ring_attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(InputTypeError, match="ring_attention: sinks has dtype torch.float64"):
        ring_attention(q, q, q, sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(InputTypeError, match="ring_attention: sinks must be a torch.Tensor"):
        ring_attention(q, q, q, sinks=[0.0, 0.0])
    # the steps' block masks refused it inside the first step, naming create_block_mask's
    # BLOCK_SIZE, after the first K/V transfer was posted
    with pytest.raises(InputError, match="ring_attention: block_size must be positive, got "
                                         "block_size=0"):
        ring_attention(q, q, q, block_size=0)
    with pytest.raises(InputTypeError, match="ring_attention: block_size must be an int"):
        ring_attention(q, q, q, block_size=None)
    with pytest.raises(InputTypeError, match="load_balance must be a bool, got int 1"):
        ring_attention(q, q, q, load_balance=1)
    with pytest.raises(InputError, match="torch.distributed is not initialized"):
        ring_attention(q, q, q)
    # a numpy bool is a bool, as shard_sequence takes it (it was refused here)
    with pytest.raises(InputError, match="torch.distributed is not initialized"):
        ring_attention(q, q, q, load_balance=np.True_)


def test_ring_attention_rejects_bad_head_counts_before_communicating():
    from flexfa.distributed import ring_attention
    from flexfa.errors import InputTypeError

    q, kv = torch.zeros(1, 6, 8, 16), torch.zeros(1, 4, 8, 16)
    with pytest.raises(InputError, match="query has 6 heads but key has 4; query heads must "
                                         "be a multiple of key heads"):
        ring_attention(q, kv, kv, enable_gqa=True)
    with pytest.raises(InputError, match="query has 6 heads but key has 3; pass "
                                         "enable_gqa=True"):
        ring_attention(q, kv[:, :3], kv[:, :3])
    with pytest.raises(InputError, match="value has 2 heads but key has 3"):
        ring_attention(q, kv[:, :3], kv[:, :2], enable_gqa=True)
    with pytest.raises(InputTypeError, match="enable_gqa must be a bool, got int 1"):
        ring_attention(q, kv[:, :3], kv[:, :3], enable_gqa=1)
    with pytest.raises(InputError, match="torch.distributed is not initialized"):
        ring_attention(q, kv[:, :3], kv[:, :3], enable_gqa=True)  # heads fine: on to the group


def test_ring_attention_rejects_bad_mods_before_communicating():
    """As flex_attention refuses them: a mask_mod reading a tensor that requires grad (its
    gradient stayed None), mods that are not callable (a TraceError naming 'global_int'),
    return_lse that is not a bool (taken by its truthiness)."""
    from flexfa.distributed import ring_attention
    from flexfa.errors import InputTypeError

    q = torch.zeros(1, 2, 8, 16)
    learnable = torch.zeros(16, requires_grad=True)

    def learnable_mask(b, h, q_idx, kv_idx):
        return learnable[kv_idx] >= 0

    with pytest.raises(InputError, match="'learnable_mask' reads captured tensors that "
                                         "require grad"):
        ring_attention(q, q, q, mask_mod=learnable_mask)
    with pytest.raises(InputTypeError, match="score_mod must be callable or None, got int"):
        ring_attention(q, q, q, 3)
    with pytest.raises(InputTypeError, match="mask_mod must be callable or None, got int"):
        ring_attention(q, q, q, mask_mod=3)
    with pytest.raises(InputTypeError, match="return_lse must be a bool, got str 'y'"):
        ring_attention(q, q, q, return_lse="y")
    with torch.no_grad(), pytest.raises(InputError, match="not initialized"):
        ring_attention(q, q, q, mask_mod=learnable_mask)  # no gradient asked: on to the group


def test_a_learnable_tensor_the_trace_removed_gets_zeros():
    """A score_mod reading a learnable tensor in a branch its trace proves dead: on one rank
    ring_attention gives it zeros, as flex_attention does (it gave None)."""
    import torch.distributed as dist
    from flexfa.distributed import ring_attention

    gain = torch.ones(HEADS, requires_grad=True)

    def dead_gain(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx < q_idx, score * gain[h], score)

    q = torch.randn(1, HEADS, 16, 16, requires_grad=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        ring_attention(q, q, q, dead_gain).sum().backward()
    finally:
        dist.destroy_process_group()
    assert gain.grad is not None and torch.equal(gain.grad, torch.zeros(HEADS))
    want = flexfa.flex_attention(q, q, q, dead_gain)
    (grad,) = torch.autograd.grad(want.sum(), gain)
    assert torch.equal(grad, torch.zeros(HEADS))


@pytest.mark.parametrize("batch, rows", [(2, 0), (0, 16)])
def test_an_empty_sequence_gives_empty_results_with_a_mask_mod(batch, rows):
    """Shards of no rows, or of no batch, give flex_attention's empty results with a mask_mod
    too (the steps' create_block_mask refused Q_LEN=0 and B=0), and zero-size gradients."""
    import torch.distributed as dist
    from flexfa.distributed import ring_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    q = torch.randn(batch, HEADS, rows, 16, requires_grad=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        out, lse = ring_attention(q, q, q, mask_mod=causal, return_lse=True)
        out.sum().backward()
    finally:
        dist.destroy_process_group()
    want, want_lse = flexfa.flex_attention(q, q, q, return_lse=True)
    assert out.shape == want.shape and lse.shape == want_lse.shape == (batch, HEADS, rows)
    assert q.grad is not None and q.grad.shape == q.shape


def test_a_gradient_penalty_raises_instead_of_losing_its_term():
    """Gradients taken with create_graph=True raise when differentiated, as flex_attention's
    do; they were constants, so a gradient penalty added to a loss silently added nothing to
    its gradients. First-order gradients are unchanged."""
    import torch.distributed as dist
    from flexfa.distributed import ring_attention

    bias = torch.linspace(-1, 1, 16).requires_grad_()

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    q, k, v = (torch.randn(1, HEADS, 16, 16, requires_grad=True) for _ in range(3))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        out = ring_attention(q, k, v, add_bias)
        plain = torch.autograd.grad(out.square().sum(), (q, k, v, bias), retain_graph=True)
        graphed = torch.autograd.grad(out.square().sum(), (q, k, v, bias), create_graph=True)
        for a, b in zip(plain, graphed):
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
        for grad in graphed:  # a penalty on any of them, beside a loss that needs no penalty
            loss = out.sum() + grad.square().sum()
            with pytest.raises(RuntimeError, match="does not support double backward"):
                loss.backward(retain_graph=True)
    finally:
        dist.destroy_process_group()


def test_compiled_autograd_over_the_ring_backward():
    """Compiled autograd has Dynamo trace ring_attention's backward: Dynamo went down into
    the mods' trace check and failed there (an Unsupported error). The backward runs outside
    its graph, with the eager backward's gradients."""
    import torch.distributed as dist
    from torch._dynamo import compiled_autograd
    from flexfa.distributed import ring_attention

    bias = torch.linspace(-1, 1, 16).requires_grad_()

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    q, k, v = (torch.randn(1, HEADS, 16, 16, requires_grad=True) for _ in range(3))

    def grads(compiled: bool):
        for t in (q, k, v, bias):
            t.grad = None
        out = ring_attention(q, k, v, add_bias)
        torch._dynamo.reset()
        if compiled:
            with compiled_autograd._enable(torch.compile(backend="eager")):
                out.square().sum().backward()
        else:
            out.square().sum().backward()
        return [t.grad.clone() for t in (q, k, v, bias)]

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        wanted = grads(False)  # first: the mods' trace memo then has an entry to check
        for got, want in zip(grads(True), wanted):
            torch.testing.assert_close(got, want)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("edited", ["score_mod", "mask_mod"])
def test_a_captured_tensor_edited_before_the_backward_is_refused(edited):
    """The backward recomputes the ring's steps with the mods' captured tensors as they are
    then: a table of the score_mod (no gradient, so not saved) or the mask_mod's document ids
    edited in place between the forward and the backward gave the gradients of another
    forward (dq 523 and 5.4 apart in the probe), where flex_attention's backward raises."""
    import torch.distributed as dist
    from flexfa.distributed import ring_attention

    length = 32
    table = torch.randn(2 * length)
    docs = torch.tensor([0] * 10 + [1] * 22)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + length]

    def same_document(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    q, k, v = (torch.randn(1, HEADS, length, 16, requires_grad=True) for _ in range(3))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        out = ring_attention(q, k, v, relative, same_document, load_balance=False)
        ring_attention(q, k, v, relative, same_document, load_balance=False).sum().backward()
        (table if edited == "score_mod" else docs).add_(1)
        with pytest.raises(InputError, match=f"the {edited} captures .* edited in place"):
            out.sum().backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("changed", ["score_mod", "mask_mod"])
def test_a_mods_state_changed_before_the_backward_is_refused(changed):
    """Regression (an audit's find): a Python value a mod reads (a schedule in a dict)
    changed, or a captured name rebound to another tensor, between the forward and the
    backward: the recomputed steps traced the mods again and gave another forward's
    gradients (4.5e4 and 5 apart in the probe; flex_attention keeps the forward's mods).
    An InputError now; an unchanged state still runs."""
    import torch.distributed as dist
    from flexfa.distributed import ring_attention

    length = 32
    config = {"temperature": 1.0}
    state = {"docs": torch.tensor([0] * 10 + [1] * 22)}

    def tempered(score, b, h, q_idx, kv_idx):
        return score * config["temperature"]

    def same_document(b, h, q_idx, kv_idx):
        docs = state["docs"]
        return docs[q_idx] == docs[kv_idx]

    q, k, v = (torch.randn(1, HEADS, length, 16, requires_grad=True) for _ in range(3))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        ring_attention(q, k, v, tempered, same_document, load_balance=False).sum().backward()
        out = ring_attention(q, k, v, tempered, same_document, load_balance=False)
        if changed == "score_mod":
            config["temperature"] = 3.0
        else:
            state["docs"] = torch.zeros(length, dtype=torch.long)
        with pytest.raises(InputError, match=f"the {changed} changed between the forward"):
            out.sum().backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("inference", [False, True])
def test_sinks_edited_before_the_backward_are_refused(inference):
    """The backward forms d sinks from the forward's lse, which holds the sinks' values then:
    sinks edited in place between the forward and the backward are an InputError there (by
    their version, or for inference-mode sinks, which have none, by the forward's copy), as
    flex_attention's backward refuses them. Inference-mode sinks failed in the forward
    ("Inference tensors cannot be saved for backward"), where flex_attention takes them."""
    import torch.distributed as dist
    from flexfa.distributed import ring_attention

    with torch.inference_mode(inference):
        sinks = torch.tensor([0.5, -1.0])
    q, k, v = (torch.randn(1, HEADS, 32, 16, requires_grad=True) for _ in range(3))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        ring_attention(q, k, v, load_balance=False, sinks=sinks).sum().backward()
        out = ring_attention(q, k, v, load_balance=False, sinks=sinks)
        with torch.inference_mode(inference):
            sinks.add_(1.0)
        with pytest.raises(InputError, match=r"sinks \(an inference tensor, shape \(2,\)\) "
                           "was edited" if inference else "sinks .*edited in place"):
            out.sum().backward()
    finally:
        dist.destroy_process_group()


def test_an_inference_tensor_edited_before_the_backward_is_refused():
    """An inference tensor has no version counter: a score_mod table made under
    inference_mode and edited inside it between the forward and the backward went unseen by
    the version check, and the recomputed steps gave another forward's gradients. The
    forward keeps a copy and the backward compares."""
    import torch.distributed as dist
    from flexfa.distributed import ring_attention

    length = 32
    with torch.inference_mode():
        table = torch.randn(length)

    def biased(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    q, k, v = (torch.randn(1, HEADS, length, 16, requires_grad=True) for _ in range(3))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        ring_attention(q, k, v, biased, load_balance=False).sum().backward()
        out = ring_attention(q, k, v, biased, load_balance=False)
        with torch.inference_mode():
            table.add_(1.0)
        with pytest.raises(InputError, match="an inference tensor, shape .* was edited"):
            out.sum().backward()
    finally:
        dist.destroy_process_group()


def test_under_autocast_as_flex_attention():
    """Under torch.autocast the shards are cast as flex_attention casts its inputs: out comes
    in the autocast dtype (it was float32), and the backward recomputes the steps from the
    forward's bfloat16 inputs (it recomputed them in float32, outside the autocast)."""
    import torch.distributed as dist
    from flexfa.distributed import ring_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    full = [torch.randn(1, HEADS, 32, 16) for _ in range(3)]
    ring_inputs = [t.clone().requires_grad_() for t in full]
    flex_inputs = [t.clone().requires_grad_() for t in full]
    mask = flexfa.create_block_mask(causal, None, None, 32, 32, device="cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ring_attention(*ring_inputs, mask_mod=causal)
            want = flexfa.flex_attention(*flex_inputs, block_mask=mask)
        grad_out = torch.randn(out.shape)
        out.float().backward(grad_out)
    finally:
        dist.destroy_process_group()
    want.float().backward(grad_out)
    assert out.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for got, expected in zip(ring_inputs, flex_inputs):
        assert got.grad.dtype == torch.float32
        torch.testing.assert_close(got.grad, expected.grad, rtol=0, atol=1e-6)


def test_method_choice_by_shard_size():
    from flexfa.distributed.group import ALLGATHER_MAX_BYTES, choose_method

    small = torch.zeros(1, 2, 24, 16)
    rows = ALLGATHER_MAX_BYTES // (2 * 4 * 16) + 1  # K + V float32 just over the threshold
    large = torch.zeros(1, 1, rows, 16)
    assert choose_method("auto", small, small) == "allgather"
    assert choose_method("auto", large, large) == "ring"
    assert choose_method("ring", small, small) == "ring"
    assert choose_method("allgather", large, large) == "allgather"
    with pytest.raises(InputError, match="method must be one of .* got 'nccl'"):
        choose_method("nccl", small, small)


def test_group_rejects_mesh_dim_without_a_mesh_and_other_types():
    from flexfa.distributed.group import resolve_group
    from flexfa.errors import InputTypeError

    assert resolve_group(None, None) is None
    with pytest.raises(InputError, match="mesh_dim=0 needs group to be a DeviceMesh, got "
                                         "NoneType"):
        resolve_group(None, 0)
    with pytest.raises(InputTypeError, match="ProcessGroup, a DeviceMesh or None, got int"):
        resolve_group(3, None)


def test_a_process_outside_the_group_is_told_so(monkeypatch):
    """A rank that is not in ``group`` (new_group gives it NON_GROUP_MEMBER, get_rank -1)
    would wait on transfers no one sends, or compute with rank -1: an InputError first."""
    import torch.distributed as dist

    from flexfa.distributed.comm import Ring
    from flexfa.distributed.group import resolve_group

    with pytest.raises(InputError, match="not a member of group"):
        resolve_group(dist.GroupMember.NON_GROUP_MEMBER, None)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: -1)
    with pytest.raises(InputError, match="not a member of group"):
        Ring(None)


X8 = torch.arange(16.0).reshape(1, 1, 8, 2)
BAD_SHARDING_CALLS = [
    # positions returned wrong rows without an error: 4 for a shard of 5 rows, negative or
    # past-the-end positions for a rank out of range, a truthy string taken for load_balance
    (lambda: positions(0, 2, 5, True), InputError, "local_length=5 is odd"),
    (lambda: positions(-1, 2, 8, True), InputError, "rank must be in 0..world-1"),
    (lambda: positions(2, 2, 8, False), InputError, "rank must be in 0..world-1"),
    (lambda: positions(0, 0, 8, False), InputError, "rank must be in 0..world-1"),
    (lambda: positions(0, 2, 8, "no"), InputTypeError, "load_balance must be a bool"),
    (lambda: positions(0.0, 2, 8, True), InputTypeError, "rank must be an int"),
    (lambda: positions(0, True, 8, True), InputTypeError, "world must be an int"),
    (lambda: positions(0, 2, -1, False), InputError, "local_length must be >= 0"),
    (lambda: positions(0, 2, 8.0, False), InputTypeError, "local_length must be an int"),
    # a bad dim or shard failed inside Python's tuple indexing or torch
    (lambda: shard_sequence(X8, 0, 2, True, dim=None), InputTypeError, "dim must be an int"),
    (lambda: shard_sequence(X8, 0, 2, True, dim=4), InputError, "dim=4 is out of range"),
    (lambda: shard_sequence(X8, 0, 2, True, dim=2 ** 70), InputError, "out of range"),
    (lambda: shard_sequence(X8[0, 0, 0, 0], 0, 2, True), InputError, "out of range"),
    (lambda: unshard([X8, X8], True, dim=1.5), InputTypeError, "dim must be an int"),
    (lambda: unshard([X8, X8], True, dim=-5), InputError, "dim=-5 is out of range"),
    (lambda: unshard(None), InputTypeError, "shards must be a list"),
    (lambda: unshard(X8), InputTypeError, "shards must be a list"),
    (lambda: unshard(["ab", "cd"]), InputTypeError, "shards[0] must be a tensor"),
    (lambda: unshard([X8, X8[0]]), InputError, "shards[1] has 3 dims"),
]


@pytest.mark.parametrize("call,error,words", BAD_SHARDING_CALLS,
                         ids=[f"{i}-{case[2]}" for i, case in enumerate(BAD_SHARDING_CALLS)])
def test_sharding_helpers_refuse_bad_arguments(call, error, words):
    with pytest.raises(error) as caught:
        call()
    assert words in str(caught.value)


def test_positions_of_a_valid_layout():
    assert positions(1, 2, 4, True).tolist() == [2, 3, 4, 5]
    assert positions(1, 2, 3, False).tolist() == [3, 4, 5]
