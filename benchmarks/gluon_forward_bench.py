"""The Gluon forward family (BACKEND="GLUON", issue 25) on the H200 in one short device call:
a safety run, correctness against the Hopper family, then timings against the Hopper family
and cuDNN SDPA.

1. ``consan``: tiny causal calls (the block-mask walk, partial and full tiles; 1, 2 and 3
   key tiles per row block), without and with the consumers' ping-pong (``GLUON_PINGPONG``),
   and with ping-pong and the TMA store of out (``GLUON_TMA_STORE``) on a mask whose first
   row block has no tile and a ragged length (TMA and plain stores; K and V past S read by
   heads, 3-D TMA), and on the persistent grid (``GLUON_PERSISTENT``, with the TMA store, and
   with ping-pong) at 96 heads (288 work tiles: 2 or 3 per program on 132 SMs, some with no
   key tile), in a subprocess compiled with Triton 3.6's concurrency sanitizer (``TRITON_INSTRUMENTATION_MODE=consan``: it checks
   the kernel's shared-memory accesses against its mbarriers and wgmma waits, and fails with
   a device assertion on a race), killed after ``--safety-timeout`` seconds (a barrier-phase
   mistake hangs instead of failing). Nothing else runs unless it passes.
2. ``check``: the same variants at B=1 H=16 S=2048 E=128 bf16, relative L2 error of the Gluon
   output (``gluon``; ``gluon_pp`` with ping-pong, ``gluon_tma`` with the TMA store,
   ``gluon_pp_tma`` with both, ``gluon_persist`` on the persistent grid, ``gluon_persist_tma``
   with the TMA store too, ``gluon_persist_pp`` with ping-pong, those of ``--impls``, which
   must equal ``gluon`` bit for bit)
   against the Hopper family's (must be < 5e-3) and lse's max difference.
3. ``time``: triton.testing.do_bench medians (ms; TFLOP/s with causal work halved, none for
   sliding and document) at H=16, B = ``--tokens`` / S, bf16, for each of ``--dims`` x
   ``--seqs`` (default E=128, S=16384) and ``--variants`` (the project's: full, causal,
   sliding 1024, ALiBi, softcap 30, document; all but full causal) and ``--impls``: Gluon,
   with ping-pong (``gluon_pp``), the TMA store (``gluon_tma``) or both (``gluon_pp_tma``),
   the persistent grid (``gluon_persist``, ``gluon_persist_tma``, ``gluon_persist_pp``),
   Hopper, cuDNN SDPA (full and causal only). The Hopper family runs its default tiles
   (``FLEXFA_AUTOTUNE=0`` is set unless ``--tune``: tuning would spend the call's time
   compiling its candidates).

A short table goes to stdout and everything to the JSON file after every step. Each step is
guarded: a failure is recorded and the rest still runs (step 1's failure stops the run).
Every GPU step runs under a time limit; run the script under one too:

    timeout 170 python benchmarks/gluon_forward_bench.py out.json [--safety-timeout 75]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SAFETY = """
import torch, triton, flexfa
# ConSan keeps its state in global scratch memory, allocated through Triton's allocator
triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))


def late_causal(b, h, q_idx, kv_idx):  # rows before 130 see nothing: row block 0 has no tile
    return (q_idx >= 130) & (kv_idx <= q_idx)


BOTH = {"GLUON_PINGPONG": True, "GLUON_TMA_STORE": True}
PERSIST_TMA = {"GLUON_PERSISTENT": True, "GLUON_TMA_STORE": True}
# (name, heads, length, mask_mod, kernel_options past BACKEND, dropout_p): 384 causal has 1, 2
# and 3 key tiles per row block; at 320 the last row block's first consumer stores by TMA, the
# second plainly; 96 heads of 3 row blocks are 288 work tiles, 2 or 3 per persistent program
for name, heads, n, mask_mod, options, p in (
        ("causal", 2, 384, flexfa.mods.causal, {}, 0.0),
        ("causal_pingpong", 2, 384, flexfa.mods.causal, {"GLUON_PINGPONG": True}, 0.0),
        ("late_causal_pingpong_tma", 2, 320, late_causal, BOTH, 0.0),
        ("late_causal_persist_tma", 96, 320, late_causal, PERSIST_TMA, 0.0),
        ("causal_persist_pingpong", 96, 384, flexfa.mods.causal,
         {"GLUON_PERSISTENT": True, "GLUON_PINGPONG": True}, 0.0),
        ("late_causal_pingpong_dropout", 2, 320, late_causal, {"GLUON_PINGPONG": True}, 0.2),
        ("late_causal_dynamic_tma", 96, 320, late_causal,
         {"GLUON_PERSISTENT": "DYNAMIC", "GLUON_TMA_STORE": True}, 0.0),
        ("causal_dynamic_pingpong", 96, 384, flexfa.mods.causal,
         {"GLUON_PERSISTENT": "DYNAMIC", "GLUON_PINGPONG": True}, 0.0)):
    q, k, v = (torch.randn(1, heads, n, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    mask = flexfa.create_block_mask(mask_mod, None, None, n, n, device="cuda")
    out = flexfa.flex_attention(q, k, v, block_mask=mask, dropout_p=p, dropout_seed=3,
                                kernel_options={"BACKEND": "GLUON", **options})
    torch.cuda.synchronize()
    print(name, "finite" if bool(torch.isfinite(out).all()) else "NOT FINITE", flush=True)
"""
SAFE = ("causal finite", "causal_pingpong finite", "late_causal_pingpong_tma finite",
        "late_causal_persist_tma finite", "causal_persist_pingpong finite",
        "late_causal_pingpong_dropout finite", "late_causal_dynamic_tma finite",
        "causal_dynamic_pingpong finite")
VARIANTS = ("full", "causal", "sliding", "alibi", "softcap", "document")  # flexfa.bench_cases
# impl -> kernel_options of flexfa's families (cudnn: SDPA, full and causal only)
GLUON = {"BACKEND": "GLUON"}
IMPLS = {"gluon": GLUON, "gluon_pp": {**GLUON, "GLUON_PINGPONG": True},
         "gluon_tma": {**GLUON, "GLUON_TMA_STORE": True},
         "gluon_pp_tma": {**GLUON, "GLUON_PINGPONG": True, "GLUON_TMA_STORE": True},
         "gluon_persist": {**GLUON, "GLUON_PERSISTENT": True},
         "gluon_persist_tma": {**GLUON, "GLUON_PERSISTENT": True, "GLUON_TMA_STORE": True},
         "gluon_persist_pp": {**GLUON, "GLUON_PERSISTENT": True, "GLUON_PINGPONG": True},
         "gluon_dynamic": {**GLUON, "GLUON_PERSISTENT": "DYNAMIC"},
         "gluon_dynamic_pp": {**GLUON, "GLUON_PERSISTENT": "DYNAMIC", "GLUON_PINGPONG": True},
         "hopper": {"BACKEND": "HOPPER"}, "cudnn": None}


def safety_run(limit: float, script: str = SAFETY, expected=SAFE) -> dict:
    """Step 1: ``script`` in a subprocess under ConSan, killed after ``limit`` seconds; ok
    when it exits 0 and prints each ``expected`` line."""
    env = {**os.environ, "TRITON_INSTRUMENTATION_MODE": "consan", "TRITON_INTERPRET": "0",
           "PYTHONPATH": ROOT, "FLEXFA_CACHE_DIR": os.environ.get("FLEXFA_CACHE_DIR",
                                                                  "/tmp/flexfa-gluon-consan")}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        return dict(ok=False, seconds=limit, error=f"timed out after {limit} s (a hang?)",
                    stdout=(exc.stdout or b"")[-2000:].decode(errors="replace")
                    if isinstance(exc.stdout, bytes) else str(exc.stdout or "")[-2000:])
    lines = done.stdout.split("\n")
    ok = done.returncode == 0 and all(line in lines for line in expected)
    return dict(ok=ok, seconds=round(time.perf_counter() - start, 1), rc=done.returncode,
                stdout=done.stdout[-2000:], stderr=done.stderr[-4000:])


def safety_arguments(parser, timeout: float) -> None:
    """--safety-timeout (default ``timeout`` seconds) and --safety-only, as both Gluon
    benchmarks take them."""
    parser.add_argument("--safety-timeout", type=float, default=timeout,
                        help="seconds before the ConSan safety run counts as a hang")
    parser.add_argument("--safety-only", action="store_true",
                        help="the ConSan safety run alone (its instrumented compile lands in "
                             "Triton's cache, so a later full run repeats it quickly)")


def safety_first(out: str, limit: float, script: str = SAFETY, expected=SAFE):
    """(rows, save) after a passing safety run (recorded in ``out``), else None (printed)."""
    rows: list = []

    def save():
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)

    safety = dict(step="consan", **safety_run(limit, script, expected))
    rows.append(safety)
    save()
    print(json.dumps({k: safety[k] for k in ("step", "ok", "seconds") if k in safety}),
          flush=True)
    if not safety["ok"]:
        print(safety.get("error", ""), safety.get("stderr", "")[-3000:], sep="\n")
        return None
    return rows, save


def variant(name: str, S: int, H: int):
    """(score_mod, block_mask, share of the S x S work) of a project benchmark variant at
    length S; the share is None for sliding and document (no TFLOP/s figure)."""
    import flexfa
    from flexfa.bench_cases import bench_variants
    score_mod, mask_mod = bench_variants(S, H, "cuda")[name]
    if mask_mod is None:
        return score_mod, None, 1.0
    share = 0.5 if name in ("causal", "alibi", "softcap") else None
    return score_mod, flexfa.create_block_mask(mask_mod, None, None, S, S, device="cuda"), share


def run(impl: str, q, k, v, score_mod, block_mask, lse: bool = False):
    """flexfa's output with ``IMPLS[impl]``'s kernel_options (an impl name, or a BACKEND)."""
    import flexfa
    options = IMPLS.get(impl.lower()) or {"BACKEND": impl}
    return flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                 return_lse=lse, kernel_options=options)


def check(rows: list, impls=tuple(IMPLS)) -> None:
    import torch
    torch.manual_seed(0)
    S = 2048
    # 16 heads: 256 work tiles, so each persistent program walks about two
    q, k, v = (torch.randn(1, 16, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in VARIANTS:
        score_mod, mask, _ = variant(name, S, 16)
        ref, ref_lse, plain = None, None, None
        # the Gluon impls asked for, after the plain kernel (the bit-equality reference)
        for impl in ("gluon", *(i for i in impls if i.startswith("gluon_"))):
            row = dict(step="check", variant=name, impl=impl)
            try:
                if ref is None:
                    ref, ref_lse = run("hopper", q, k, v, score_mod, mask, lse=True)
                out, lse = run(impl, q, k, v, score_mod, mask, lse=True)
                row["relerr_vs_hopper"] = float((out.float() - ref.float()).norm()
                                                / ref.float().norm())
                row["lse_maxdiff"] = float((lse - ref_lse).abs().max())
                row["ok"] = row["relerr_vs_hopper"] < 5e-3 and row["lse_maxdiff"] < 1e-2
                if impl == "gluon":
                    plain = out
                else:  # when GEMMs issue and how out is stored, not what is computed
                    row["equals_gluon"] = plain is not None and bool(torch.equal(out, plain))
                    row["ok"] = row["ok"] and row["equals_gluon"]
            except Exception as exc:  # recorded, the rest still runs
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500],
                           trace=traceback.format_exc()[-1500:])
            rows.append(row)
            print(json.dumps(row), flush=True)


def timings(rows: list, S: int, E: int = 128, variants=VARIANTS, tokens: int = 16384,
            impls=tuple(IMPLS)) -> None:
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    B, H = max(1, tokens // S), 16
    q, k, v = (torch.randn(B, H, S, E, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name in variants:
        score_mod, mask, share = variant(name, S, H)
        flops = 4 * B * H * S * S * E * share if share else None
        causal = name == "causal"

        def cudnn(causal=causal):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        calls = {impl: (lambda impl=impl: run(impl, q, k, v, score_mod, mask))
                 for impl in impls if IMPLS[impl] is not None}
        if "cudnn" in impls and name in ("full", "causal"):
            calls["cudnn"] = cudnn
        for impl, fn in calls.items():
            row = dict(step="time", variant=name, impl=impl, B=B, H=H, S=S, E=E)
            try:
                fn()
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1) if flops else None)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
            print(json.dumps(row), flush=True)


def table(rows: list) -> str:
    lines = [f"{'variant':10} {'B':>3} {'S':>6} {'E':>4} {'impl':8} {'ms':>8} {'TF/s':>6} "
             f"{'vs hopper':>9}"]
    def case(r):
        return r["variant"], r["S"], r["E"]
    hopper = {case(r): r.get("ms") for r in rows
              if r.get("step") == "time" and r["impl"] == "hopper"}
    for r in rows:
        if r.get("step") != "time":
            continue
        head = f"{r['variant']:10} {r['B']:3} {r['S']:6} {r['E']:4} {r['impl']:8}"
        if "ms" not in r:
            lines.append(f"{head} {r.get('error', '')[:60]}")
            continue
        ratio = hopper[case(r)] / r["ms"] if hopper.get(case(r)) else float("nan")
        tflops = f"{r['tflops']:6.0f}" if r["tflops"] else f"{'-':>6}"
        lines.append(f"{head} {r['ms']:8.3f} {tflops} {ratio:9.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file for the results")
    safety_arguments(parser, 75.0)
    parser.add_argument("--seqs", default="16384",
                        help="sequence lengths of the timings, comma list (B = tokens / S)")
    parser.add_argument("--dims", default="128", help="head dims of the timings, comma list")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"variants of the timings, comma list of {','.join(VARIANTS)}")
    parser.add_argument("--tokens", type=int, default=16384, help="B * S of the timings")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"what the timings run, comma list of {','.join(IMPLS)} "
                             "(gluon_pp: the Gluon forward with GLUON_PINGPONG, gluon_tma: "
                             "with GLUON_TMA_STORE, gluon_pp_tma: both, gluon_persist: with "
                             "GLUON_PERSISTENT, gluon_persist_tma: with it and the TMA store, "
                             "gluon_persist_pp: with it and ping-pong)")
    parser.add_argument("--tune", action="store_true",
                        help="let the Hopper family tune its tiles (slow: compiles candidates)")
    args = parser.parse_args(argv)
    if not args.tune:
        os.environ["FLEXFA_AUTOTUNE"] = "0"
    impls = tuple(args.impls.split(","))
    if set(impls) - set(IMPLS):
        parser.error(f"--impls: unknown {sorted(set(impls) - set(IMPLS))}; known: {list(IMPLS)}")
    started = safety_first(args.out, args.safety_timeout)
    if started is None:
        return 1
    if args.safety_only:
        return 0
    rows, save = started
    check(rows, impls)
    save()
    variants = tuple(args.variants.split(","))
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; known: {list(VARIANTS)}")
    for E in map(int, args.dims.split(",")):
        for S in map(int, args.seqs.split(",")):
            timings(rows, S, E, variants, args.tokens, impls)
            save()
    print(table(rows))
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
