"""Plot a decode_bench.py JSON: effective bandwidth (bytes of K and V a call must read / its
time) of flexfa, FlexAttention compiled and SDPA's flash backend per case, as a share of the
copy bandwidth measured in the same run; each bar labelled with its time in ms.

    python benchmarks/plot_decode.py results/decode.json results/decode.png
"""
from __future__ import annotations

import argparse
import json
import sys

PEERS = (("flexfa", "flexfa"), ("torch_flex_compiled", "FlexAttention compiled"),
         ("sdpa_flash", "SDPA flash"))


def shares(report: dict) -> tuple[list[str], dict[str, list[tuple[float, float]]]]:
    """Case names and, per peer, (share of the copy bandwidth, ms) per case (0, nan: absent)."""
    names = [case["case"] for case in report["cases"]]
    copy = report["copy_GBps"]
    bars = {}
    for key, _ in PEERS:
        bars[key] = [(case[key]["GBps"] / copy, case[key]["ms"]) if "ms" in case.get(key, {})
                     else (0.0, float("nan")) for case in report["cases"]]
    return names, bars


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names, bars = shares(report)
    width = 0.8 / len(PEERS)
    fig, ax = plt.subplots(figsize=(14, 5.5))
    for i, (key, label) in enumerate(PEERS):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [100 * share for share, _ in bars[key]], width, label=label)
        for x, (share, ms) in zip(xs, bars[key]):
            if share:
                ax.text(x, 100 * share + 1, f"{ms:.3f}", ha="center", fontsize=6, rotation=90)
    ax.set_xticks([j + 0.4 for j in range(len(names))])
    ax.set_xticklabels(names, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("% of the copy bandwidth")
    ax.set_ylim(0, 115)
    ax.set_title(f"decode and chunked prefill, bf16, E=128, {report['gpu']}, torch "
                 f"{report['torch']}, copy {report['copy_GBps']:.0f} GB/s (labels: ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="a decode_bench.py result")
    parser.add_argument("png", help="the picture to write")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        plot(json.load(f), args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
