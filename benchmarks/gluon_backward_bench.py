"""The Gluon backward family (GLUON_BACKWARD=True, issue 26) on the H200 in one device call: a
safety run, gradients against the Triton backward, then forward + backward timings and peak
memory against the Triton backward and cuDNN SDPA.

1. ``consan``: a tiny causal forward (Hopper family: the Gluon forward passed its own ConSan
   run) + Gluon backward (the block-mask walk: partial and full tiles) in a subprocess
   compiled with Triton 3.6's concurrency sanitizer (``TRITON_INSTRUMENTATION_MODE=consan``:
   shared-memory accesses checked against the mbarriers and wgmma waits), killed after
   ``--safety-timeout`` seconds (a barrier-phase mistake hangs); at L = S = 320, no multiple
   of its tiles, so the tiles past a head's end come by heads (3-D TMA). One instrumented backward
   kernel only: its compile alone took 433 s on a 2-core development machine (the dense
   walk differs in the table reads, not in the barriers); ``--safety-dropout P`` makes its
   call drop probabilities (the consumers draw the keep mask again), ``--safety-head-dim
   256`` or ``192/128`` runs the kernel for head dims padding to 256 instead
   (bwd_gluon_wide.tmpl). Nothing else runs unless it passes.
2. ``check``: B=1 H=4 S=2048 E=128 bf16, every project variant: dq, dk, dv of
   BACKEND="GLUON" + GLUON_BACKWARD (Gluon forward and backward; the plan's family recorded) against
   BACKEND="HOPPER" (Hopper forward + Triton backward): relative L2 errors, must be < 1e-2.
3. ``time``: forward + backward medians (ms, triton.testing.do_bench) and the peak memory
   past the inputs (MiB) at H=16, B = ``--tokens`` / S, for ``--seqs`` x ``--variants``:
   gluon (both Gluon families), triton (BACKEND="HOPPER": the Triton backward), cuDNN SDPA (full
   and causal). ``--budget`` seconds bound the timings (the rest is skipped, recorded).

A short table goes to stdout, everything to the JSON file after every step:

    timeout 300 python benchmarks/gluon_backward_bench.py out.json [--budget 200]
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

from gluon_forward_bench import (VARIANTS, safety_arguments, safety_first,  # noqa: E402
                                 variant)

SAFETY = """
import torch, triton, flexfa
triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
L = 320  # ragged: Q, dO, K and V tiles past a head's end read by heads (3-D TMA)
q, k, v = (torch.randn(1, 2, L, e, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for e in (HEAD_DIM, HEAD_DIM, HEAD_DIM_V))
mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, L, L, device="cuda")
out = flexfa.flex_attention(q, k, v, block_mask=mask, dropout_p=DROPOUT_P,
                            kernel_options={"BACKEND": "HOPPER", "GLUON_BACKWARD": True})
out.sum().backward()
torch.cuda.synchronize()
finite = all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
print("causal", "finite" if finite else "NOT FINITE", flush=True)
"""


def fwd_bwd(backend: str, q, k, v, score_mod, block_mask, grad_out):
    import torch

    import flexfa
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    options = {"BACKEND": backend, "GLUON_BACKWARD": backend == "GLUON"}
    out = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                kernel_options=options)
    return torch.autograd.grad(out, (q, k, v), grad_out)


def check(rows: list) -> None:
    import torch

    from flexfa.runtime import plans
    torch.manual_seed(0)
    S = 2048
    q, k, v, grad_out = (torch.randn(1, 4, S, 128, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
    for name in VARIANTS:
        score_mod, mask, _ = variant(name, S, 4)
        row = dict(step="check", variant=name)
        try:
            plans.PLANS.clear()
            got = fwd_bwd("GLUON", q, k, v, score_mod, mask, grad_out)
            row["families"] = sorted({p.family.name for p in plans.PLANS.values()})
            want = fwd_bwd("HOPPER", q, k, v, score_mod, mask, grad_out)
            for label, g, w in zip(("dq", "dk", "dv"), got, want):
                row[f"relerr_{label}"] = float((g.float() - w.float()).norm()
                                               / w.float().norm().clamp_min(1e-6))
            row["ok"] = (all(row[f"relerr_{x}"] < 1e-2 for x in ("dq", "dk", "dv"))
                         and "gluon_bwd" in row["families"])
        except Exception as exc:  # recorded, the rest still runs
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500],
                       trace=traceback.format_exc()[-1500:])
        rows.append(row)
        print(json.dumps(row), flush=True)


def timings(rows: list, S: int, variants, tokens: int, deadline: float) -> None:
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    B, H, E = max(1, tokens // S), 16, 128
    q, k, v, grad_out = (torch.randn(B, H, S, E, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
    for name in variants:
        score_mod, mask, _ = variant(name, S, H)
        impls = {"gluon": lambda: fwd_bwd("GLUON", q, k, v, score_mod, mask, grad_out),
                 "triton": lambda: fwd_bwd("HOPPER", q, k, v, score_mod, mask, grad_out)}
        if name in ("full", "causal"):
            def cudnn(causal=name == "causal"):
                qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv,
                                                                           is_causal=causal)
                return torch.autograd.grad(out, (qq, kk, vv), grad_out)
            impls["cudnn"] = cudnn
        for impl, fn in impls.items():
            row = dict(step="time", variant=name, impl=impl, B=B, H=H, S=S, E=E)
            if time.time() > deadline:
                row["error"] = "skipped: --budget spent"
            else:
                try:
                    fn()
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    fn()
                    torch.cuda.synchronize()
                    row["peak_extra_mib"] = round(
                        (torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)
                    row["ms"] = round(triton.testing.do_bench(fn, warmup=10, rep=50,
                                                              return_mode="median"), 4)
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
            print(json.dumps(row), flush=True)


def table(rows: list) -> str:
    lines = [f"{'variant':10} {'B':>3} {'S':>6} {'impl':8} {'ms':>8} {'MiB':>8} {'vs triton':>9}"]
    triton_ms = {(r["variant"], r["S"]): r.get("ms") for r in rows
                 if r.get("step") == "time" and r["impl"] == "triton"}
    for r in rows:
        if r.get("step") != "time":
            continue
        head = f"{r['variant']:10} {r['B']:3} {r['S']:6} {r['impl']:8}"
        if "ms" not in r:
            lines.append(f"{head} {r.get('error', '')[:60]}")
            continue
        base = triton_ms.get((r["variant"], r["S"]))
        ratio = base / r["ms"] if base else float("nan")
        lines.append(f"{head} {r['ms']:8.3f} {r['peak_extra_mib']:8.1f} {ratio:9.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file for the results")
    safety_arguments(parser, 90.0)
    parser.add_argument("--safety-dropout", type=float, default=0.0,
                        help="dropout_p of the safety run's call (the consumers' keep mask)")
    parser.add_argument("--safety-head-dim", default="128",
                        help="E or E/Ev of the safety run's call (256, 192/128: the wide kernel)")
    parser.add_argument("--seqs", default="4096,16384",
                        help="sequence lengths of the timings, comma list (B = tokens / S)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"variants of the timings, comma list of {','.join(VARIANTS)}")
    parser.add_argument("--tokens", type=int, default=16384, help="B * S of the timings")
    parser.add_argument("--budget", type=float, default=200.0,
                        help="seconds for the whole run; timings past it are skipped")
    args = parser.parse_args(argv)
    deadline = time.time() + args.budget
    variants = tuple(args.variants.split(","))
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; known: {list(VARIANTS)}")
    os.environ.setdefault("FLEXFA_AUTOTUNE", "0")  # tuning would spend the call compiling
    if not 0.0 <= args.safety_dropout < 1.0:
        parser.error(f"--safety-dropout must be in [0, 1), got {args.safety_dropout}")
    dims = args.safety_head_dim.split("/")
    if not (1 <= len(dims) <= 2 and all(d.isdigit() and int(d) > 0 for d in dims)):
        parser.error(f"--safety-head-dim must be E or E/Ev, got {args.safety_head_dim!r}")
    script = (SAFETY.replace("DROPOUT_P", repr(args.safety_dropout))
              .replace("HEAD_DIM_V", dims[-1]).replace("HEAD_DIM", dims[0]))
    started = safety_first(args.out, args.safety_timeout, script,
                           ("causal finite",))
    if started is None:
        return 1
    if args.safety_only:
        return 0
    rows, save = started
    check(rows)
    save()
    for S in map(int, args.seqs.split(",")):
        timings(rows, S, variants, args.tokens, deadline)
        save()
    print(table(rows))
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
