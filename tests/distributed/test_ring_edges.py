"""Edges of ring_attention from a mutation audit (the forty-ninth session's): each test fails
under a rule changed with every other test of tests/distributed passing (the user's scale,
head- and batch-dependent masks, sinks without grad and their gradient over a batch, strided
shards, the agreement check's scale and captured values), or under the defect it found:
ranks that disagreed on whether a score_mod's captured tensor requires grad were not refused,
and the backward's all_reduce of its gradient paired with another rank's next collective.

As tests/distributed/test_ring.py does: one module-scoped fixture spawns 2 gloo ranks on the
CPU (kernels under the Triton interpreter), each rank runs every case of CASES and saves its
shards; each test gathers the shards (``unshard``) and compares them against an independent
float64 reference written here in plain torch (dense scores on the whole, unsharded
sequence; no flexfa helper is used for the reference)."""
from __future__ import annotations

import math
import os
import traceback

import pytest
import torch

from .ring_workers import free_port, rank_group, spawn_ranks

WORLD = 2
TIMEOUT_S = 300
BLOCK = 16


# ---------------------------------------------------------------- the cases (every process)
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def head_dependent(b, h, q_idx, kv_idx):
    # head 0: causal; head 1: causal and only even keys. A block that is full for head 0 is
    # partial for head 1: a block mask built for one head (H=None) attends to odd keys there
    return (q_idx >= kv_idx) & ((h == 0) | (kv_idx % 2 == 0))


def batch_dependent(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & ((b == 0) | (kv_idx % 3 != 0))


def first_half_only(b, h, q_idx, kv_idx):
    # rows of the second half of the sequence attend to nothing (out 0, lse -inf)
    return (q_idx >= kv_idx) & (q_idx < 32)


def case(name: str) -> dict:
    """The full-sequence inputs and the call's arguments of ``name`` (the same in every
    process: seeded)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    spec = dict(B=1, Hq=2, Hkv=2, L=64, E=16, Ev=16, kvB=None, dtype=torch.float32,
                score_mod=None, mask_mod=causal, scale=None, sinks=None, load_balance=True,
                method="ring", layout="bhse", learned=())
    if name == "scale":
        spec.update(scale=0.3)
    elif name == "head_mask":
        spec.update(mask_mod=head_dependent, load_balance=False)
    elif name == "batch_mask":
        spec.update(B=2, mask_mod=batch_dependent, load_balance=False)
    elif name == "batch_sinks":
        spec.update(B=2, sinks=torch.tensor([0.7, -0.4]).requires_grad_())
    elif name == "sinks_no_grad":
        spec.update(sinks=torch.tensor([1.5, 0.5]))
    elif name in ("noncontig_ring", "noncontig_allgather"):
        spec.update(layout="bshe", method=name.split("_")[1])
    elif name == "bf16":
        spec.update(dtype=torch.bfloat16, L=128, E=32, Ev=32)
    elif name == "empty_rank":
        spec.update(mask_mod=first_half_only, load_balance=False)
    elif name == "kv_batch1":
        spec.update(B=2, kvB=1)
    elif name == "value_dim":
        spec.update(Ev=8)
    elif name == "gqa_index_bias":
        qb = (0.05 * torch.randn(64, generator=g)).requires_grad_()
        kb = (0.05 * torch.randn(64, generator=g)).requires_grad_()

        def index_bias(score, b, h, q_idx, kv_idx):
            return score + qb[q_idx] * (h + 1) - kb[kv_idx] + 0.01 * (q_idx - 2 * kv_idx)
        spec.update(Hq=4, Hkv=2, score_mod=index_bias, learned=(qb, kb))
    else:
        raise ValueError(name)
    B, Hq, Hkv, L, E, Ev = (spec[k] for k in ("B", "Hq", "Hkv", "L", "E", "Ev"))
    kvB = spec["kvB"] or B
    q = torch.randn(B, Hq, L, E, generator=g)
    k = torch.randn(kvB, Hkv, L, E, generator=g)
    v = torch.randn(kvB, Hkv, L, Ev, generator=g)
    gout = torch.randn(B, Hq, L, Ev, generator=g)
    glse = torch.randn(B, Hq, L, generator=g)
    spec.update(q=q.to(spec["dtype"]), k=k.to(spec["dtype"]), v=v.to(spec["dtype"]),
                gout=gout, glse=glse)
    return spec


CASES = ("scale", "head_mask", "batch_mask", "batch_sinks", "sinks_no_grad", "noncontig_ring",
         "noncontig_allgather", "bf16", "empty_rank", "kv_batch1", "value_dim",
         "gqa_index_bias")


# ---------------------------------------------------------------- the rank side
def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    with rank_group(rank, world, port, out_dir):
        for name in CASES:
            try:
                result = _one_case(name, rank, world)
            except Exception:  # one case's failure must not hide the others'
                result = {"error": traceback.format_exc()}
            torch.save(result, os.path.join(out_dir, f"{name}_{rank}.pt"))
        torch.save(_disagreements(rank), os.path.join(out_dir, f"disagree_{rank}.pt"))


def _one_case(name: str, rank: int, world: int) -> dict:
    from flexfa.distributed import ring_attention, shard_sequence

    c = case(name)
    lb = c["load_balance"]
    if c["layout"] == "bshe":  # shards of [B, S, H, E] tensors seen as [B, H, S, E] views
        q, k, v = (shard_sequence(t.transpose(1, 2).contiguous(), rank, world, lb, dim=1)
                   .transpose(1, 2) for t in (c["q"], c["k"], c["v"]))
        assert not q.is_contiguous()
    else:
        q, k, v = (shard_sequence(t, rank, world, lb, dim=2) for t in (c["q"], c["k"], c["v"]))
    gout, glse = (shard_sequence(t, rank, world, lb, dim=2) for t in (c["gout"], c["glse"]))
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = ring_attention(q, k, v, c["score_mod"], c["mask_mod"], load_balance=lb,
                              scale=c["scale"], block_size=BLOCK, return_lse=True,
                              method=c["method"], enable_gqa=c["Hq"] != c["Hkv"],
                              sinks=c["sinks"])
    torch.autograd.backward((out, lse), (gout.to(out.dtype), glse))
    sinks = c["sinks"]
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
            "dlearned": [t.grad for t in c["learned"]],
            "dsinks": None if sinks is None or not sinks.requires_grad else sinks.grad}


def _disagreements(rank: int) -> dict:
    """Calls whose ranks disagree on the scale, or hold a captured tensor whose values are a
    permutation of the other rank's (same sum): each must be an InputError on every rank."""
    import torch.distributed as dist
    from flexfa.distributed import ring_attention
    from flexfa.errors import InputError

    docs = torch.tensor([0] * 10 + [1] * 14)
    if rank == 1:
        docs[9], docs[10] = 1, 0  # a permutation: the values' sum is the same

    def same_document(b, h, i, j):
        return docs[i] == docs[j]

    bias = torch.linspace(-1, 1, 24).requires_grad_(rank == 0)

    def add_bias(score, b, h, i, j):
        return score + bias[j]

    q = torch.randn(1, 2, 12, 16)
    errors = {}
    # (forward only: with a disagreement not refused the backward would hang the group)
    for name, kwargs in (("scale", dict(mask_mod=causal, scale=0.25 * (rank + 1))),
                         ("permuted_documents", dict(mask_mod=same_document)),
                         ("bias_requires_grad", dict(score_mod=add_bias))):
        try:
            ring_attention(q, q, q, **kwargs)
        except InputError as error:
            errors[name] = str(error)
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"errors": errors, "all_reduce": total.item()}


# ---------------------------------------------------------------- the reference (float64)
def reference(c: dict):
    """(out, lse, dq, dk, dv, dlearned, dsinks) of dense attention over the whole sequence in
    float64, plain torch: a row with nothing to attend gives out 0 and lse -inf."""
    q, k, v = (c[n].detach().double().requires_grad_() for n in ("q", "k", "v"))
    learned = [t.detach().double().requires_grad_() for t in c["learned"]]
    sinks = c["sinks"]
    sinks64 = None if sinks is None else sinks.detach().double().requires_grad_()
    B, Hq, L, E = q.shape
    group = Hq // k.shape[1]
    kk = k.expand(B, *k.shape[1:]).repeat_interleave(group, dim=1)
    vv = v.expand(B, *v.shape[1:]).repeat_interleave(group, dim=1)
    scale = 1 / math.sqrt(E) if c["scale"] is None else c["scale"]
    s = q @ kk.transpose(-1, -2) * scale
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(Hq).view(1, Hq, 1, 1)
    qi = torch.arange(L).view(1, 1, L, 1)
    ki = torch.arange(L).view(1, 1, 1, L)
    if c["score_mod"] is not None:  # the mods are plain torch on broadcast index grids here
        swapped = {id(t): t64 for t, t64 in zip(c["learned"], learned)}
        s = _call_with(c["score_mod"], swapped, s, b, h, qi, ki)
    if c["mask_mod"] is not None:
        keep = c["mask_mod"](b, h, qi, ki).expand_as(s)
        s = s.masked_fill(~keep, float("-inf"))
    if sinks64 is not None:
        s = torch.cat([s, sinks64.view(1, Hq, 1, 1).expand(B, Hq, L, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - finite.unsqueeze(-1))[..., :L]
    out = p @ vv
    inputs = [q, k, v, *learned] + ([sinks64] if sinks64 is not None else [])
    grads = torch.autograd.grad((out, lse), inputs, (c["gout"].double(), c["glse"].double()),
                                allow_unused=True)
    n = len(learned)
    return {"out": out.detach(), "lse": lse.detach(), "dq": grads[0], "dk": grads[1],
            "dv": grads[2], "dlearned": list(grads[3:3 + n]),
            "dsinks": grads[3 + n] if sinks64 is not None and sinks.requires_grad else None}


def _call_with(mod, replacements, *args):
    """``mod`` with its captured learnable tensors replaced by float64 copies."""
    if not replacements:
        return mod(*args)
    import types
    cells = tuple(types.CellType(replacements.get(id(cell.cell_contents), cell.cell_contents))
                  for cell in mod.__closure__)
    return types.FunctionType(mod.__code__, mod.__globals__, mod.__name__, mod.__defaults__,
                              cells)(*args)


# ---------------------------------------------------------------- the process side
@pytest.fixture(scope="module")
def ranks_dir(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("proposed_ring"))
    spawn_ranks(run_rank, (WORLD, free_port(), out_dir), WORLD, out_dir, TIMEOUT_S)
    return out_dir


def _gathered(out_dir: str, name: str) -> dict:
    from flexfa.distributed import unshard

    shards = [torch.load(os.path.join(out_dir, f"{name}_{r}.pt")) for r in range(WORLD)]
    for s in shards:
        if "error" in s:
            pytest.fail(f"case {name} raised on a rank:\n{s['error']}")
    lb = case(name)["load_balance"]
    result = {n: unshard([s[n] for s in shards], lb, dim=2) for n in ("out", "lse", "dq")}
    result.update({n: unshard([s[n] for s in shards], lb, dim=2) for n in ("dk", "dv")})
    result["dlearned"] = [s["dlearned"] for s in shards]
    result["dsinks"] = [s["dsinks"] for s in shards]
    return result


TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _check(out_dir: str, name: str) -> None:
    c = case(name)
    ring, ref = _gathered(out_dir, name), reference(c)
    tol = TOL[c["dtype"]]
    assert ring["lse"].dtype == torch.float32, "lse must be float32 (flex_attention's)"
    assert ring["out"].dtype == c["dtype"]
    for n in ("out", "lse", "dq", "dk", "dv"):
        got = ring[n].double()
        assert not got.isnan().any(), f"{name}: NaN in ring {n}"
        torch.testing.assert_close(got, ref[n].to(got.dtype), **tol,
                                   msg=lambda m: f"{name}: ring {n} vs float64 reference: {m}")
    for per_rank in ring["dlearned"]:  # summed over the group: every rank has the sum
        for got, want in zip(per_rank, ref["dlearned"]):
            torch.testing.assert_close(got.double(), want, **tol)
    if ref["dsinks"] is not None:
        for got in ring["dsinks"]:
            torch.testing.assert_close(got.double(), ref["dsinks"], **tol)


def test_ring_scale_is_used(ranks_dir):
    """A non-default scale reaches every step's kernel (mutant r10: the steps used 1/sqrt(E))."""
    _check(ranks_dir, "scale")


def test_ring_head_dependent_mask(ranks_dir):
    """A mask_mod reading h: each step's block mask has one table per head (mutant s06: a
    block full for head 0 was taken as full for head 1)."""
    _check(ranks_dir, "head_mask")


def test_ring_batch_dependent_mask(ranks_dir):
    """A mask_mod reading b with B=2 (mutant s07: one block mask for every batch entry)."""
    _check(ranks_dir, "batch_mask")


def test_ring_sinks_gradient_with_batch_two(ranks_dir):
    """d sinks sums the rows of every batch entry (mutant k01: batch 0's only)."""
    _check(ranks_dir, "batch_sinks")


def test_ring_sinks_without_grad_still_count(ranks_dir):
    """Sinks that do not require grad still join every row's denominator (mutant r06)."""
    _check(ranks_dir, "sinks_no_grad")


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_ring_non_contiguous_shards(ranks_dir, method):
    """Shards that are [B, S, H, E] tensors transposed to [B, H, S, E] (a common layout): the
    ring exchange sends contiguous copies (mutant c03: gloo refused the non-contiguous
    send). (The all-gather exchange's .contiguous(), mutant c06, is not observable under
    gloo, which accepts a non-contiguous input.)"""
    _check(ranks_dir, f"noncontig_{method}")


def test_ring_bfloat16_keeps_float32_accumulators(ranks_dir):
    """bf16 shards on 2 ranks against the float64 reference: out within bf16 tolerance, lse
    float32 and accurate (mutant r02, a bf16 lse accumulator; the existing suite kills it
    only through a 1-rank autocast test)."""
    _check(ranks_dir, "bf16")
    c, ring = case("bf16"), _gathered(ranks_dir, "bf16")
    lse_ref = reference(c)["lse"]
    assert (ring["lse"].double() - lse_ref).abs().max() < 2e-3


def test_ring_rows_empty_on_a_whole_rank(ranks_dir):
    """Every row of rank 1 attends to nothing: out 0, lse -inf, no NaN in any gradient, and
    no gradient from those rows; rank 0's rows are exact."""
    _check(ranks_dir, "empty_rank")


def test_ring_key_value_of_batch_one(ranks_dir):
    """key/value of batch 1 shared by a query batch of 2 (flex_attention broadcasts them)."""
    _check(ranks_dir, "kv_batch1")


def test_ring_value_head_dim_differs(ranks_dir):
    _check(ranks_dir, "value_dim")


def test_ring_gqa_score_mod_reading_global_indices(ranks_dir):
    """GQA and a score_mod reading q_idx, kv_idx, h and two learnable tables at global
    positions: out, lse and every gradient (the tables' summed over the group)."""
    _check(ranks_dir, "gqa_index_bias")


def test_ring_ranks_disagreeing_on_scale_or_permuted_captured_values(ranks_dir):
    """Ranks calling with different scales, or with captured document ids that are a
    permutation of each other (equal sums), computed different attention silently (mutants
    v07, v09): an InputError on every rank, and the group stays usable."""
    for rank in range(WORLD):
        result = torch.load(os.path.join(ranks_dir, f"disagree_{rank}.pt"))
        assert "disagree on scale" in result["errors"]["scale"]
        assert "disagree on the captured tensors' values" in \
            result["errors"]["permuted_documents"]
        assert result["all_reduce"] == WORLD


def test_ranks_disagreeing_on_a_captured_tensors_requires_grad(ranks_dir):
    """Rank 0's bias requires grad, rank 1's does not: as for the sinks' requires_grad (a
    fact the ranks must agree on), an InputError on every rank before any K/V transfer."""
    for rank in range(WORLD):
        result = torch.load(os.path.join(ranks_dir, f"disagree_{rank}.pt"))
        assert "bias_requires_grad" in result["errors"], result["errors"]
