"""Decode with per-head block masks (issue 24): the union walk of a GQA group's members against
the per-member walk (kernel option DECODE_WALK) and against the same call with one window shared
by all heads (whose K/V tiles are read once per program either way).

    python benchmarks/decode_union_bench.py results/decode_union.json [--budget 420]

Each case: bf16, E = 128, Hq = 32, Hkv = 8, flex_decode with kv_lens = S (the queries are the
cache's last L keys), query head h keeping the last 1024 + 256 * (h % 8) keys (per head) or the
last 2048 (shared). The JSON is rewritten after each case; no case starts after --budget s.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [(16, 1, 8192), (16, 4, 8192), (4, 1, 32768), (4, 4, 32768)]  # (B, L, S)
HQ, HKV, E = 32, 8, 128


def run_case(case, torch, triton, flexfa) -> dict:
    B, L, S = case

    def per_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 1024 + 256 * (h % 8))

    def shared(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 2048)
    q = torch.randn(B, HQ, L, E, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, S, E, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    result = {"B": B, "L": L, "S": S}
    for name, mod, heads, walk in (("union", per_head, HQ, "AUTO"),
                                   ("members", per_head, HQ, "MEMBERS"),
                                   ("shared_window", shared, None, "AUTO")):
        try:
            mask = flexfa.create_block_mask(mod, None, heads, S, S, device="cuda")
            options = {"DECODE_WALK": walk}
            call = lambda: flexfa.flex_decode(q, k, v, None, mask, kv_lens=lens,  # noqa: E731
                                              kernel_options=options, validate=False)
            call()
            result[name] = {"ms": triton.testing.do_bench(call, warmup=10, rep=100)}
        except Exception as exc:
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the JSON file to write")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which no new case starts (default 420)")
    args = parser.parse_args(argv)
    import torch
    import triton

    import flexfa
    if not torch.cuda.is_available():
        print("decode_union_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    start, out = time.time(), Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(), "cases": []}
    print(f"{'B':>3} {'L':>3} {'S':>6} {'union ms':>9} {'members ms':>11} {'shared ms':>10}")
    for case in CASES:
        if time.time() - start > args.budget:
            report["stopped"] = f"budget of {args.budget} s reached before {case}"
            break
        result = run_case(case, torch, triton, flexfa)
        report["cases"].append(result)
        out.write_text(json.dumps(report, indent=1))
        ms = [result[n].get("ms", float("nan")) for n in ("union", "members", "shared_window")]
        print(f"{case[0]:3} {case[1]:3} {case[2]:6} {ms[0]:9.4f} {ms[1]:11.4f} {ms[2]:10.4f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
