"""What attention sinks and dropout cost on the GPU (issue 28 items 2, 3).

For each case (batch, heads, length, head dim, mask) times flexfa's forward and forward +
backward plain, with ``sinks=``, with ``dropout_p=0.1`` and with both, next to what users do
today: sinks applied outside the kernel from lse (``out * exp(lse - logaddexp(lse, sink))``,
plus its backward through lse) and dropout through SDPA (``dropout_p``, causal or dense only).
Each case first checks that sinks-from-the-kernel equals sinks-from-lse. Prints a table and
writes JSON to the path given.

    python benchmarks/features_overhead.py out.json [--cases 4:16:4096:128:causal,...]
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexfa  # noqa: E402

DEFAULT_CASES = "4:16:4096:128:causal,4:16:4096:64:causal,2:16:8192:128:dense"


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def bench(fn, rounds: int = 20) -> float:
    """Median milliseconds of ``fn`` (CUDA events, after warm-up)."""
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=rounds, return_mode="median")


def case_timings(B, H, L, E, mask_name) -> dict:
    q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    sinks = torch.randn(H, device="cuda", requires_grad=True)
    mask = flexfa.create_block_mask(causal, None, None, L, L, device="cuda") \
        if mask_name == "causal" else None
    grad = torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16)

    def sinks_from_lse():
        out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, return_lse=True)
        total = torch.logaddexp(lse, sinks.view(1, H, 1))
        return (out * torch.exp(lse - total)[..., None]).to(out.dtype)

    variants = {
        "plain": lambda: flexfa.flex_attention(q, k, v, block_mask=mask),
        "sinks": lambda: flexfa.flex_attention(q, k, v, block_mask=mask, sinks=sinks),
        "sinks_from_lse": sinks_from_lse,
        "dropout": lambda: flexfa.flex_attention(q, k, v, block_mask=mask, dropout_p=0.1),
        "sinks_dropout": lambda: flexfa.flex_attention(q, k, v, block_mask=mask, sinks=sinks,
                                                       dropout_p=0.1),
        "sdpa_dropout": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=mask is not None, dropout_p=0.1),
    }
    error = (variants["sinks"]().float() - sinks_from_lse().float()).abs().max().item()
    result = {"sinks_vs_lse_max_error": error}
    for name, fn in variants.items():
        with torch.no_grad():
            result[f"{name}_fwd_ms"] = bench(fn)
        result[f"{name}_fwdbwd_ms"] = bench(lambda: fn().backward(grad))
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help="comma-separated B:H:L:E:mask (mask: causal or dense)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2

    def expire(signum, frame):
        raise TimeoutError("case timed out")
    signal.signal(signal.SIGALRM, expire)
    results = {}
    for case in args.cases.split(","):
        B, H, L, E, mask_name = case.split(":")
        signal.alarm(args.timeout)
        try:
            results[case] = case_timings(int(B), int(H), int(L), int(E), mask_name)
        except Exception as exc:  # a failing or slow case is reported, the others still run
            results[case] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            signal.alarm(0)
        row = results[case]
        if "error" in row:
            print(f"{case}: {row['error']}")
            continue
        print(f"{case}  sinks vs lse max error {row['sinks_vs_lse_max_error']:.2e}")
        print(f"  {'variant':16s} {'fwd ms':>8s} {'fwd+bwd ms':>11s}")
        for name in ("plain", "sinks", "sinks_from_lse", "dropout", "sinks_dropout",
                     "sdpa_dropout"):
            print(f"  {name:16s} {row[name + '_fwd_ms']:8.3f} {row[name + '_fwdbwd_ms']:11.3f}")
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
