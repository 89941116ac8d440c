"""GPU: where the Gluon backward beats the Triton backward on sparse block masks (issue 26:
GLUON_BACKWARD='AUTO' keeps sparse masks on the Triton backward because the benchmark's
document mask measured slower on Gluon, while its sliding window measured faster).

For causal sliding windows and causal document masks of several sizes (B=1, H=16, bf16, S
and E as given), fwd+bwd with ``GLUON_BACKWARD`` False and True in turn (do_bench medians,
the median of the rounds), with each mask's share of visited tiles and its mean walk: the
visited (query tile, key tile) pairs per key tile, the length of a Gluon backward program's
loop. The gradients of the two backwards are compared before timing. ``--graph`` also times
each configuration's step captured in a CUDA graph (replays: the GPU's time without the host's
launch costs), and ``--configs`` adds the Gluon backward with its parts one after another
(``serial``) and all at once (``c1``).

    python benchmarks/experiments/sparse_bwd.py [--rounds 3] [--seqs 16384] [--dims 128,64]
        [--graph] [--configs triton,gluon,serial,c1] [--masks sliding_1024,document_bench]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WINDOWS = (256, 512, 1024, 2048, 4096)
DOC_MEANS = (512, 1152, 2304, 4608)  # documents of lengths uniform in [mean / 4, 7 mean / 4]


def masks(S: int, device):
    import torch

    out = {}
    for w in WINDOWS:
        out[f"sliding_{w}"] = (lambda w: lambda b, h, q, kv: (q >= kv) & (q - kv < w))(w)
    for mean in DOC_MEANS:
        lengths = torch.randint(mean // 4, 7 * mean // 4, (4 * S // mean + 2,),
                                generator=torch.Generator().manual_seed(mean))
        doc = torch.searchsorted(lengths.cumsum(0), torch.arange(S), right=True).to(device)
        out[f"document_{mean}"] = (lambda d: lambda b, h, q, kv: (d[q] == d[kv]) & (q >= kv))(doc)
    from flexfa.bench_cases import bench_variants

    out["document_bench"] = bench_variants(S, 16, device)["document"][1]
    return out


def walk_stats(mask) -> tuple[float, float]:
    """(visited share of the tiles, mean visited query tiles per key tile)."""
    visited = int(mask.kv_num_blocks.sum())
    if getattr(mask, "full_kv_num_blocks", None) is not None:
        visited += int(mask.full_kv_num_blocks.sum())
    b, h, nq, nkv = mask.kv_indices.shape
    return visited / (b * h * nq * nkv), visited / (b * h * nkv)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=60)
    parser.add_argument("--seqs", default="16384")
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--configs", default="triton,gluon")
    parser.add_argument("--masks", default="")
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    import flexfa

    known = {"triton": {"GLUON_BACKWARD": False}, "gluon": {"GLUON_BACKWARD": True},
             "serial": {"GLUON_BACKWARD": True, "GLUON_BWD_OVERLAP": False},
             "c1": {"GLUON_BACKWARD": True, "GLUON_BWD_DQ_CHUNKS": 1}}
    options = {label: known[label] for label in args.configs.split(",")}
    rows = []
    for S in (int(s) for s in args.seqs.split(",")):
        for E in (int(e) for e in args.dims.split(",")):
            q, k, v = (torch.randn(1, args.heads, S, E, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            for name, mask_mod in masks(S, "cuda").items():
                if args.masks and name not in args.masks.split(","):
                    continue
                mask = flexfa.create_block_mask(mask_mod, None, None, S, S, device="cuda")
                density, walk = walk_stats(mask)

                def step(opts, mask=mask):
                    flexfa.flex_attention(q, k, v, block_mask=mask,
                                          kernel_options=opts).backward(do)
                grads = {}
                for label, opts in options.items():
                    for t in (q, k, v):
                        t.grad = None
                    step(opts)
                    grads[label] = [t.grad.float() for t in (q, k, v)]
                err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
                          for label in options for a, b in zip(grads[label], grads["triton"]))
                runs = {label: (lambda opts=opts: step(opts)) for label, opts in options.items()}
                if args.graph:
                    runs.update({f"{label}:graph": graphed(lambda opts=opts: step(opts), q, k, v)
                                 for label, opts in options.items()})
                times = {label: [] for label in runs}
                for _ in range(args.rounds):
                    for label, fn in runs.items():
                        times[label].append(do_bench(
                            fn, warmup=100, rep=args.rep, return_mode="median",
                            grad_to_none=None if label.endswith(":graph") else [q, k, v]))
                med = {label: statistics.median(ts) for label, ts in times.items()}
                rows.append((S, E, name, density, walk, med, err))
                print(f"S={S} E={E} {name:14s} density {density:.3f} walk {walk:6.2f} "
                      + " ".join(f"{label} {ms:.3f}" for label, ms in med.items())
                      + f" rel.err {err:.1e}", flush=True)
    labels = list(rows[0][5]) if rows else []
    print("\nS      E    mask            density  walk  " + " ".join(f"{x:>13s}" for x in labels))
    for S, E, name, density, walk, med, _ in sorted(rows, key=lambda r: (r[0], r[1], r[4])):
        print(f"{S:<6d} {E:<4d} {name:15s} {density:7.3f} {walk:6.2f} "
              + " ".join(f"{med[x]:13.3f}" for x in labels))
    return 0


def graphed(step, q, k, v):
    """``step`` captured in a CUDA graph (after warm-up on a side stream): its replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in (q, k, v):
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


if __name__ == "__main__":
    raise SystemExit(main())
