"""H200: does the forward's round-to-round spread follow the GPU's clocks? (issue 25)

``python benchmarks/experiments/clock_trace.py --rounds 8 --out DIR`` times flexfa's forward
on the benchmark's inputs (B = 1, H = 16, S = 16384, E = 128, bf16; causal, softcap + causal
and full) and cuDNN SDPA (causal, full) with ``triton.testing.do_bench`` (median), in rounds
in ``flexfa.bench.round_order``'s balanced order (guard2_a8ea5b0's run rotated it), while
``nvidia-smi`` samples the SM clock, power and temperature every 50 ms (reading them only;
nothing is set). It writes ``rounds.json`` (each timing with its
wall-clock interval) and ``smi.csv``, and prints per timing the median ms next to the median
SM clock and power sampled during it, then the correlation of time and clock per variant.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rep", type=int, default=100, help="do_bench's rep (ms)")
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--out", default="clock_trace")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import flexfa
    from flexfa.bench import round_order
    from flexfa.bench_cases import bench_variants

    os.makedirs(args.out, exist_ok=True)
    S, H, E = args.seq, 16, 128
    q, k, v = (torch.randn(1, H, S, E, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    variants = bench_variants(S, H, "cuda")
    impls = {}
    for name in ("causal", "softcap", "full"):
        score_mod, mask_mod = variants[name]
        mask = flexfa.create_block_mask(mask_mod, 1, None, S, S, device="cuda") \
            if mask_mod else None
        impls[f"flexfa {name}"] = (lambda s=score_mod, m=mask:
                                   lambda: flexfa.flex_attention(q, k, v, s, m))()

    def cudnn(causal):
        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run
    impls["cudnn causal"] = cudnn(True)
    impls["cudnn full"] = cudnn(False)
    for fn in impls.values():  # compile and tune outside the trace
        fn()
    torch.cuda.synchronize()

    smi_path = os.path.join(args.out, "smi.csv")
    with open(smi_path, "w") as smi_file:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
             "--format=csv,noheader,nounits", "-lms", "50"], stdout=smi_file)
        time.sleep(1.0)
        rows, names = [], list(impls)
        try:
            for r in range(args.rounds):
                for name in round_order(names, r):
                    start = time.time()
                    ms = do_bench(impls[name], warmup=25, rep=args.rep, return_mode="median")
                    rows.append(dict(impl=name, round=r, ms=ms, start=start, end=time.time()))
        finally:
            time.sleep(0.5)
            smi.terminate()
            smi.wait()
    samples = []
    with open(smi_path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 4:
                continue
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            try:
                samples.append((stamp, float(parts[1]), float(parts[2]), float(parts[3])))
            except ValueError:
                continue
    for row in rows:
        inside = [s for s in samples if row["start"] <= s[0] <= row["end"]]
        row["samples"] = len(inside)
        row["sm_mhz"] = statistics.median(s[1] for s in inside) if inside else None
        row["power_w"] = statistics.median(s[2] for s in inside) if inside else None
        row["temp_c"] = max(s[3] for s in inside) if inside else None
    with open(os.path.join(args.out, "rounds.json"), "w") as f:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__}, f, indent=1)
    print(f"{'impl':16} {'round':>5} {'ms':>8} {'SM MHz':>7} {'W':>6} {'C':>4} {'n':>3}")
    for row in rows:
        print(f"{row['impl']:16} {row['round']:5} {row['ms']:8.3f} {row['sm_mhz'] or 0:7.0f} "
              f"{row['power_w'] or 0:6.0f} {row['temp_c'] or 0:4.0f} {row['samples']:3}")
    for name in names:
        mine = [r for r in rows if r["impl"] == name and r["sm_mhz"]]
        ms = [r["ms"] for r in mine]
        print(f"{name:16} median {statistics.median(ms):.3f} ms, range {min(ms):.3f}-"
              f"{max(ms):.3f}, SM clock {min(r['sm_mhz'] for r in mine):.0f}-"
              f"{max(r['sm_mhz'] for r in mine):.0f} MHz"
              + (f", corr(ms, clock) {statistics.correlation(ms, [r['sm_mhz'] for r in mine]):+.2f}"
                 if len(set(ms)) > 1 and len({r['sm_mhz'] for r in mine}) > 1 else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
