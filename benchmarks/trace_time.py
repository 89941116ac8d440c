"""Trace time of typical mods: the first trace of a new function object and a cached trace.

``python benchmarks/trace_time.py [--repeat N]`` prints a markdown table (milliseconds for the
first trace, microseconds for a cached one, medians over N runs). The first trace builds and
simplifies the IR; a cached one only re-checks the function's closure and referenced globals
(values, tensor identities and shapes), so a changed closure is never served a stale IR.
Numbers are recorded in docs/mods.md.
"""
from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=50, help="runs per median (default 50)")
    return parser


if __name__ == "__main__":  # --help and argument errors before the imports below
    build_parser().parse_args()

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout
from flexfa import and_masks, mods  # noqa: E402
from flexfa.frontend import trace  # noqa: E402

L = S = 4096
H = 16


def _factories():
    """name -> a function returning a NEW mod object each call (so its first trace is uncached)."""
    doc_ids = torch.arange(L) // 512
    rel = torch.randn(H, 2 * S - 1)

    def document():
        def document_mask(b, h, q_idx, kv_idx):
            return doc_ids[q_idx] == doc_ids[kv_idx]
        return document_mask

    def relative_bias():
        def rel_bias(score, b, h, q_idx, kv_idx):
            return score + rel[h, q_idx - kv_idx + S - 1]
        return rel_bias

    def big():
        def big_mod(score, b, h, q_idx, kv_idx):
            capped = 30.0 * torch.tanh(score / 30.0)
            bias = rel[h, q_idx - kv_idx + S - 1] - torch.exp2(-(h + 1.0)) * abs(q_idx - kv_idx)
            keep = (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])
            return torch.where(keep, capped + bias, capped - 1.0)
        return big_mod

    return {
        "causal (mask)": lambda: (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx),
        "sliding window 1024 (mask)": lambda: mods.sliding_window(1024),
        "document (mask, 1 buffer)": document,
        "and_masks(causal, window) (mask)": lambda: and_masks(mods.causal,
                                                             mods.sliding_window(256)),
        "softcap 30 (score)": lambda: mods.softcap(30.0),
        "alibi (score, 1 buffer)": lambda: mods.alibi(H),
        "relative bias (score, 1 buffer)": relative_bias,
        "softcap+alibi+document (score, 2 buffers)": big,
    }


def _median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(repeat: int = 50) -> list[dict]:
    rows = []
    for name, factory in _factories().items():
        fresh = [factory() for _ in range(repeat)]
        pending = iter(fresh)
        first = _median_s(lambda: trace(next(pending)), repeat)
        mod = fresh[0]
        cached = _median_s(lambda: trace(mod), repeat * 20)
        traced = trace(mod)
        rows.append(dict(mod=name, nodes=len(traced.root.toposort()), first_ms=first * 1e3,
                         cached_us=cached * 1e6))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| mod | IR nodes | first trace (ms) | cached trace (us) |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {r['mod']} | {r['nodes']} | {r['first_ms']:.2f} | {r['cached_us']:.1f} |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rows = measure(args.repeat)
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
