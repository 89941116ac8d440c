"""GPU: the Gluon backward against the Triton backward at the wide head dims (issue 28:
whether GLUON_BACKWARD='AUTO' should take E = 192 / Ev = 128, and E = 256 below S = 4096).

For each case ``E[/Ev]:S:variant[+drop]`` (variants of ``flexfa.bench_cases.bench_variants``;
``+drop``: with ``dropout_p`` ``--p``; B = tokens / S, H = 16, bf16), fwd+bwd with ``GLUON_BACKWARD`` False and True in turn, each
round in the other order (do_bench medians, the median of the rounds), and the peak extra
memory of one step. The gradients of the two backwards are compared before timing (the
largest difference over the largest Triton gradient, per tensor).

    python benchmarks/experiments/wide_bwd_ab.py OUT.json [--rounds 3]
        [--cases 192/128:8192:causal,256:2048:full,256:8192:causal+drop] [--tokens 16384]
        [--p 0.1]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CONFIGS = {"triton": {"GLUON_BACKWARD": False}, "gluon": {"GLUON_BACKWARD": True}}


def parse_case(text: str) -> tuple[int, int, int, str, bool]:
    dims, S, variant = text.split(":")
    E, _, Ev = dims.partition("/")
    variant, _, drop = variant.partition("+")
    if drop not in ("", "drop"):
        raise ValueError(f"case {text!r}: a variant's suffix is '+drop', not {drop!r}")
    return int(E), int(Ev or E), int(S), variant, drop == "drop"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--cases", default="192/128:8192:causal,192/128:8192:full")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--p", type=float, default=0.1, help="dropout_p of '+drop' cases")
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    import flexfa
    from flexfa.bench_cases import bench_variants

    rows = []
    for case in args.cases.split(","):
        E, Ev, S, variant, drop = parse_case(case)
        dropout = {"dropout_p": args.p, "dropout_seed": 1} if drop else {}
        B = max(1, args.tokens // S)
        score_mod, mask_mod = bench_variants(S, args.heads, "cuda")[variant]
        mask = (None if mask_mod is None else
                flexfa.create_block_mask(mask_mod, None, None, S, S, device="cuda"))
        q, k = (torch.randn(B, args.heads, S, E, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        v = torch.randn(B, args.heads, S, Ev, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        do = torch.randn(B, args.heads, S, Ev, device="cuda", dtype=torch.bfloat16)

        def step(opts):
            flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask,
                                  kernel_options=opts, **dropout).backward(do)
        grads, peak = {}, {}
        for label, opts in CONFIGS.items():
            for t in (q, k, v):
                t.grad = None
            step(opts)
            torch.cuda.synchronize()
            for t in (q, k, v):
                t.grad = None
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(opts)
            torch.cuda.synchronize()
            peak[label] = (torch.cuda.max_memory_allocated() - base) / 2**20
            grads[label] = [t.grad.float() for t in (q, k, v)]
        err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
                  for a, b in zip(grads["gluon"], grads["triton"]))
        times = {label: [] for label in CONFIGS}
        for r in range(args.rounds):
            order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
            for label in order:
                times[label].append(do_bench(lambda opts=CONFIGS[label]: step(opts),
                                             warmup=100, rep=args.rep, return_mode="median",
                                             grad_to_none=[q, k, v]))
        med = {label: statistics.median(ts) for label, ts in times.items()}
        rows.append({"case": case, "B": B, "dropout_p": args.p if drop else 0.0, "H": args.heads, "ms": med, "rounds": times,
                     "peak_mib": peak, "grad_rel_err": err,
                     "gluon_over_triton": med["gluon"] / med["triton"]})
        print(f"{case:24s} B={B:<2d} triton {med['triton']:8.3f} gluon {med['gluon']:8.3f} "
              f"ratio {med['gluon'] / med['triton']:.3f} peak {peak['triton']:.0f}/"
              f"{peak['gluon']:.0f} MiB rel.err {err:.1e}", flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        del q, k, v, do, grads
    print("\ncase                      triton_ms  gluon_ms  gluon/triton")
    for row in rows:
        print(f"{row['case']:24s} {row['ms']['triton']:9.3f} {row['ms']['gluon']:9.3f} "
              f"{row['gluon_over_triton']:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
