"""Context parallelism on several GPUs: flexfa.distributed.ring_attention against torch's
``context_parallel`` with SDPA, and the scaling efficiency over one GPU (issue 29).

Run under torchrun, one process per GPU, NCCL:

    timeout 600 torchrun --nproc-per-node 8 benchmarks/cp_bench.py out.json \\
        [--lengths 131072,262144,524288,1048576] [--heads 32] [--head-dim 128] [--mask causal]

Per global length S (bf16, B = 1, shards of S / N rows, head-tail balancing): the ring's
forward and forward+backward (CUDA-event medians, the slowest rank's), torch's
``context_parallel`` (DeviceMesh over the group, SDPA inside, its own causal balancing) the
same way, and with ``--single`` flexfa on the whole sequence on rank 0 alone (out of memory is
recorded). ``efficiency`` = single / (N x ring) where the single run fits (issue 29's target:
>= 0.85 for causal S = 512k, E = 128, H = 32 on 8 GPUs). Each row is guarded: a failure is
recorded and the rest runs; rows that would start after ``--budget`` seconds are skipped.
Rank 0 prints a table and rewrites the JSON after every row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON results path (written by rank 0)")
    parser.add_argument("--lengths", default="131072,262144,524288,1048576")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mask", choices=("causal", "full"), default="causal")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--methods", default="ring",
                        help="ring_attention methods to time, comma-separated (ring, "
                             "allgather, auto), e.g. ring,allgather at short lengths to place "
                             "the auto threshold")
    parser.add_argument("--single", action="store_true", help="also time one GPU on rank 0")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's context_parallel")
    parser.add_argument("--budget", type=float, default=480.0)
    parser.add_argument("--cpu", action="store_true",
                        help="smoke run: gloo on CPU, Triton interpreter, wall-clock times, "
                             "no torch peer (use tiny lengths: --lengths 128 --heads 2 "
                             "--head-dim 16 --reps 1)")
    return parser.parse_args(argv)


DEVICE = ["cuda"]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def elapsed_ms(torch, fn) -> float:
    """``fn()``'s time in ms: CUDA events on a GPU, the wall clock on the CPU."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def timed(torch, dist, fn, reps: int) -> float:
    """Median ms of ``fn()`` over ``reps`` after one warm-up; the slowest rank's."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        times.append(elapsed_ms(torch, fn))
    median = torch.tensor([sorted(times)[len(times) // 2]], device=DEVICE[0])
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def fwd_and_bwd(torch, dist, run, inputs, reps: int) -> dict:
    def forward():
        with torch.no_grad():
            run(*inputs)

    def forward_backward():
        run(*inputs).sum().backward()
    return {"fwd_ms": timed(torch, dist, forward, reps),
            "fwd_bwd_ms": timed(torch, dist, forward_backward, reps)}


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import flexfa
    from flexfa.distributed import ring_attention

    if args.cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE[0], args.no_torch = "cpu", True
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not args.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    deadline = time.monotonic() + args.budget
    mask_mod = causal if args.mask == "causal" else None
    results = {"world": world, "heads": args.heads, "head_dim": args.head_dim,
               "mask": args.mask, "rows": [],
               "gpu": "cpu (gloo)" if args.cpu else torch.cuda.get_device_name()}

    def guarded(row: dict, name: str, measure) -> None:
        if time.monotonic() > deadline:
            row[name] = {"skipped": "past the time budget"}
            return
        try:
            row[name] = measure()
        except Exception as exc:  # recorded; the other rows still run
            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            if rank == 0:
                traceback.print_exc()
        if not args.cpu:
            torch.cuda.empty_cache()

    for length in map(int, args.lengths.split(",")):
        row = {"S": length}
        shape = (1, args.heads, length // world, args.head_dim)
        dtype = torch.float32 if args.cpu else torch.bfloat16
        shards = [torch.randn(shape, device=DEVICE[0], dtype=dtype, requires_grad=True)
                  for _ in range(3)]
        for method in args.methods.split(","):
            guarded(row, method, lambda m=method: fwd_and_bwd(
                torch, dist, lambda q, k, v: ring_attention(q, k, v, mask_mod=mask_mod,
                                                            method=m), shards, args.reps))
        del shards
        if not args.no_torch:
            guarded(row, "torch_cp_sdpa", lambda: _torch_cp(torch, dist, F, args, length))
        if args.single:
            guarded(row, "single_gpu", lambda: _single(torch, dist, flexfa, args, length,
                                                       mask_mod, rank))
        single, ring = row.get("single_gpu", {}), row.get("ring", {})
        if "fwd_bwd_ms" in single and "fwd_bwd_ms" in ring:
            row["efficiency_fwd_bwd"] = single["fwd_bwd_ms"] / (world * ring["fwd_bwd_ms"])
        results["rows"].append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


def _torch_cp(torch, dist, F, args, length: int) -> dict:
    """torch's context_parallel: each rank passes the whole tensors, which it shards in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    shape = (1, args.heads, length, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        inputs = [t.requires_grad_() for t in (q, k, v)]
        return fwd_and_bwd(torch, dist, lambda a, b, c: F.scaled_dot_product_attention(
            a, b, c, is_causal=args.mask == "causal"), inputs, args.reps)


def _single(torch, dist, flexfa, args, length: int, mask_mod, rank: int) -> dict:
    """flexfa on the whole sequence on rank 0 (the others wait): the one-GPU baseline."""
    result = {}
    if rank == 0:
        try:
            shape = (1, args.heads, length, args.head_dim)
            dtype = torch.float32 if DEVICE[0] == "cpu" else torch.bfloat16
            q, k, v = (torch.randn(shape, device=DEVICE[0], dtype=dtype, requires_grad=True)
                       for _ in range(3))
            mask = None if mask_mod is None else flexfa.create_block_mask(
                mask_mod, None, None, length, length, device=DEVICE[0])
            times = [elapsed_ms(torch, lambda: flexfa.flex_attention(
                q, k, v, block_mask=mask).sum().backward()) for _ in range(args.reps + 1)]
            result = {"fwd_bwd_ms": sorted(times[1:])[len(times[1:]) // 2]}
        except torch.cuda.OutOfMemoryError as exc:
            result = {"error": f"out of memory: {str(exc)[:200]}"}
    dist.barrier()
    box = [result]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    sys.exit(main())
