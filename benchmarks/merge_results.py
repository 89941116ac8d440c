"""Write ``benchmarks/results/h200.json`` and ``h200.png`` from the H200 benchmark runs.

Run 12 (commit f0b9546, 2026-11-29, seventh session) covered the whole grid, both passes, in
one process (``python -m flexfa bench --dims 64,128 --seqs 2048,8192,16384 --rep 40`` on a
fresh machine, every tile from the committed tuning file, kernels compiled inside the run), so
it alone makes the results; the earlier runs (1-11, older code; run 8 needed run 8b for its
last case) stay in ``raw/`` for the record. Every row keeps the run it came from.
``python benchmarks/merge_results.py`` prints the tables of docs/performance.md.
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexfa.bench import plot, summarize  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "results")
# (file, which rows to take, why others are left out)
SOURCES = [
    ("run12_full_grid_f0b9546.json", lambda r: True, ""),
]
NOT_RUN: list[str] = []


def merged() -> dict:
    rows, metas, notes = [], {}, [n for *_, n in SOURCES if n] + NOT_RUN
    for name, keep, _ in SOURCES:
        with open(os.path.join(HERE, "raw", name)) as f:
            run = json.load(f)
        metas[name] = run["meta"]
        rows += [dict(r, run=name) for r in run["rows"] if keep(r)]
    return {"meta": {**metas[SOURCES[0][0]], "runs": metas}, "rows": rows,
            "summary": summarize(rows), "left_out": notes}


def table(result: dict, pass_: str) -> str:
    cases: dict = {}
    for r in result["rows"]:
        if r["pass_"] == pass_ and "ms" in r:
            cases.setdefault((r["D"], r["S"], r["variant"]), {})[r["impl"]] = r
    lines = ["| E | S | variant | flexfa ms (TFLOP/s) | FlexAttention ms (TFLOP/s) | speedup | "
             "cuDNN ms (TFLOP/s) | flexfa vs FlexAttention rel. err |",
             "|---|---|---|---|---|---|---|---|"]
    for (D, S, variant), impls in sorted(cases.items()):
        fa, fl, cu = impls.get("flexfa"), impls.get("flex"), impls.get("sdpa-cudnn")

        def cell(r):
            return f"{r['ms']:.3f} ({r['tflops']:.0f})" if r else "-"
        speed = f"{fl['ms'] / fa['ms']:.2f}x" if fa and fl else "-"
        err = f"{fa['out_relerr']:.1e}" if fa and "out_relerr" in fa else "-"
        lines.append(f"| {D} | {S} | {variant} | {cell(fa)} | {cell(fl)} | {speed} | {cell(cu)} "
                     f"| {err} |")
    return "\n".join(lines)


def main() -> None:
    result = merged()
    with open(os.path.join(HERE, "h200.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(HERE, "h200.png"))
    for pass_ in ("fwd", "fwd+bwd"):
        print(f"\n### {pass_}\n\n{table(result, pass_)}")
        s = result["summary"][pass_]
        print(f"\ngeomean {s['geomean_speedup']:.3f}x over {s['cases']} cases; worst "
              f"{s['worst']['speedup']:.2f}x ({s['worst']['variant']} S={s['worst']['S']} "
              f"E={s['worst']['D']})")
    speedups = {}
    for r in result["rows"]:
        if r["impl"] == "flexfa" and "ms" in r:
            fl = [x for x in result["rows"] if x["impl"] == "flex" and "ms" in x and
                  (x["variant"], x["S"], x["D"], x["pass_"]) == (r["variant"], r["S"], r["D"], r["pass_"])]
            speedups.setdefault(r["pass_"], []).append(fl[0]["ms"] / r["ms"])
    below = {p: sum(v < 1.0 for v in s) for p, s in speedups.items()}
    print("\ncases below 1.0x:", below, "| geomeans:",
          {p: round(math.exp(sum(map(math.log, s)) / len(s)), 3) for p, s in speedups.items()})


if __name__ == "__main__":
    main()
