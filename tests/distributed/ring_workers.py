"""The rank side of the ring-attention tests: one process per rank (gloo, CPU, Triton
interpreter) runs every requested case and saves its shards of the outputs and gradients."""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import traceback


@contextlib.contextmanager
def rank_group(rank: int, world: int, port: int, out_dir: str):
    """A rank process's gloo group on 127.0.0.1:``port`` (kernels under the interpreter),
    destroyed after the body; an exception leaves ``error_<rank>.txt`` with its traceback
    (``spawn_ranks`` reports it) and is raised again."""
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        try:
            yield
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target, args: tuple, world: int, out_dir: str, timeout_s: float) -> None:
    """Run ``target(rank, *args)`` on ``world`` spawned processes; fail the test on a rank's
    error (its ``error_<rank>.txt``) or when they take longer than ``timeout_s``."""
    import pytest
    import torch.multiprocessing as mp

    context = mp.spawn(target, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"ring attention on {world} ranks did not finish in {timeout_s} s")
    except mp.ProcessRaisedException:
        errors = [open(os.path.join(out_dir, f)).read() for f in os.listdir(out_dir)
                  if f.startswith("error_")]
        pytest.fail("\n".join(errors) or "a rank failed")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def run_rank(rank: int, world: int, port: int, runs: list, out_dir: str) -> None:
    """Run ``runs`` = [(case, load_balance, variant)] on rank ``rank`` of ``world``; save one
    file per run (``<case>_<lb>_<variant>_<rank>.pt``), or ``error_<rank>.txt`` with the
    traceback. ``variant``: ``"ring"`` / ``"allgather"`` (the method, group None) or
    ``"mesh"`` (method ``"auto"`` over a 1-D CPU DeviceMesh) or ``"mesh2d"`` (the ring over
    the "cp" dimension of a (1, world) mesh)."""
    with rank_group(rank, world, port, out_dir):
        import torch
        for case, load_balance, variant in runs:
            torch.save(_one_run(case, load_balance, variant, rank, world),
                       os.path.join(out_dir, result_name(case, load_balance, variant, rank)))


def result_name(case: str, load_balance: bool, variant: str, rank: int) -> str:
    return f"{case}_{int(load_balance)}_{variant}_{rank}.pt"


def _one_run(case: str, load_balance: bool, variant: str, rank: int, world: int) -> dict:
    from flexfa.distributed import ring, ring_attention, shard_sequence
    from .ring_cases import LENGTH, heads, inputs, mods, sinks

    if case == "refused_options":
        return _refused_options()
    if case == "disagreeing_ranks":
        return _disagreeing_ranks(rank)
    if case == "short_captured":
        return _short_captured(rank)
    length = LENGTH
    full = inputs(length, case)
    q, k, v, grad_out, grad_lse = (shard_sequence(t, rank, world, load_balance, dim=2)
                                   for t in full)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    score_mod, mask_mod, learned = mods(case, length)
    case_sinks = sinks(case)
    group, mesh_dim, mesh_error = _group(variant, world, q)
    method = {"ring": "ring", "allgather": "allgather", "mesh": "auto", "mesh2d": "ring"}[variant]
    q_heads, kv_heads = heads(case)
    calls, chosen = [], []
    original, original_choice = ring.flex_attention, ring.choose_method

    def counting(query, key, value, **kwargs):  # (key heads, enable_gqa) of each kernel call
        calls.append((key.shape[1], kwargs["enable_gqa"]))
        return original(query, key, value, **kwargs)

    def recording(*args):
        chosen.append(original_choice(*args))
        return chosen[-1]
    ring.flex_attention, ring.choose_method = counting, recording
    try:
        out, lse = ring_attention(q, k, v, score_mod, mask_mod, group=group,
                                  load_balance=load_balance, block_size=16, return_lse=True,
                                  method=method, mesh_dim=mesh_dim,
                                  enable_gqa=q_heads != kv_heads, sinks=case_sinks)
        forward_calls = len(calls)
        ((out * grad_out).sum() + (lse * grad_lse).sum()).backward()
    finally:
        ring.flex_attention, ring.choose_method = original, original_choice
    return {"method": chosen, "mesh_error": mesh_error,
            "out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad,
            "dv": v.grad, "dlearned": [t.grad for t in learned],
            "dsinks": None if case_sinks is None else case_sinks.grad,
            "forward_calls": forward_calls, "backward_calls": len(calls) - forward_calls,
            "kernel_kv_heads": sorted(set(calls))}


def _refused_options() -> dict:
    """Two calls whose kernel_options only the first step's kernel choice refuses (after the
    first K/V shift was posted), then a collective: it hung on the shifts left in flight."""
    import torch
    import torch.distributed as dist

    from flexfa.distributed import ring_attention
    from flexfa.errors import InputError

    errors = []
    for options, rows in (({"BACKEND": "DECODE"}, 20), ({"BLOCK_N": 128}, 10)):
        q = torch.randn(1, 2, rows, 16)
        try:
            ring_attention(q, q, q, mask_mod=lambda b, h, i, j: i >= j, method="ring",
                           block_size=16, kernel_options=options)
        except InputError as error:
            errors.append(str(error))
    total = torch.ones(1)
    work = dist.all_reduce(total, async_op=True)
    finished = work.wait(timeout=datetime.timedelta(seconds=30))
    return {"errors": errors, "all_reduce": total.item() if finished else None}


def _disagreeing_ranks(rank: int) -> dict:
    """Calls whose ranks disagree on the mask_mod, its window, load_balance, the method, the
    shard length, the sinks or a captured tensor's values: each rank computed with its own
    (wrong results or hangs); each is an InputError on every rank now, and the group stays
    usable."""
    import torch
    import torch.distributed as dist

    from flexfa.distributed import ring_attention
    from flexfa.errors import InputError

    window = 4 + rank

    def causal(b, h, i, j):
        return i >= j

    def sliding(b, h, i, j):
        return (i >= j) & (i - j < window)

    documents = torch.tensor([0] * 10 + [1] * 14)
    documents[9] += rank  # one position's document differs on rank 1

    def same_document(b, h, i, j):
        return documents[i] == documents[j]

    q = torch.randn(1, 2, 12, 16)
    calls = {"mask_mod": dict(mask_mod=causal if rank == 0 else None),
             "window": dict(mask_mod=sliding),
             "load_balance": dict(mask_mod=causal, load_balance=rank == 0),
             "method": dict(mask_mod=causal, method=("ring", "allgather")[rank]),
             "sinks": dict(mask_mod=causal, sinks=torch.zeros(2) if rank == 0 else None),
             "sinks' values": dict(mask_mod=causal, sinks=torch.tensor([0.5, 0.5 * rank])),
             "captured values": dict(mask_mod=same_document),
             "length": dict(mask_mod=causal, rows=12 - 2 * rank)}
    errors = {}
    for name, kwargs in calls.items():
        rows = kwargs.pop("rows", 12)
        try:
            ring_attention(q[:, :, :rows], q[:, :, :rows], q[:, :, :rows], **kwargs)
        except InputError as error:
            errors[name] = str(error)
    agreed = ring_attention(q, q, q, mask_mod=causal)  # the same call on every rank runs
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"errors": errors, "agreed": agreed, "all_reduce": total.item()}


def _short_captured(rank: int) -> dict:
    """Captured tensors read at global positions out of their range: a bias shorter than the
    sequence on every rank (each step's check named the internal wrapper and the shard's
    domain), and index values out of range on one rank only (that rank raised inside its
    steps, the other waited on the ring). Both raise on every rank before any K/V transfer,
    naming the global domain; the group's next collective runs."""
    import torch
    import torch.distributed as dist

    from flexfa.distributed import ring_attention
    from flexfa.errors import InputError

    q = torch.randn(1, 2, 12, 16)
    short = torch.randn(20)
    where = torch.arange(24)
    where[5] += 24 * rank  # rank 1 reads past the bias there

    def short_bias(score, b, h, i, j):
        return score + short[j]

    full = torch.randn(24)

    def indirect(score, b, h, i, j):
        return score + full[where[j]]

    errors = {}
    for name, score_mod in (("short", short_bias), ("one_rank", indirect)):
        try:
            ring_attention(q, q, q, score_mod, lambda b, h, i, j: i >= j, block_size=16)
        except InputError as error:
            errors[name] = str(error)
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"errors": errors, "all_reduce": total.item()}


def _group(variant: str, world: int, q):
    """(group, mesh_dim, the error of a 2-D mesh without mesh_dim) for ``variant``."""
    from torch.distributed.device_mesh import init_device_mesh

    from flexfa.distributed import ring_attention
    from flexfa.errors import InputError

    if variant == "mesh":
        return init_device_mesh("cpu", (world,)), None, None
    if variant != "mesh2d":
        return None, None, None
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    try:
        ring_attention(q, q, q, group=mesh)
    except InputError as error:  # raised before any communication
        return mesh, "cp", str(error)
    return mesh, "cp", None
