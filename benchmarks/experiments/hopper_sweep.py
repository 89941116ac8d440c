"""One GPU call's worth of Hopper work: correctness of the Hopper forward on every benchmark
variant, autotuning the forward per density class, a backward tile sweep, dispatch cost.

    PYTHONPATH=. FLEXFA_CACHE_DIR=/tmp/fxc python benchmarks/experiments/hopper_sweep.py [--out DIR]

Prints JSON lines as it goes and a short table at the end; copies the tuner's
``autotune.json`` and a ``sweep.json`` of every number into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
from triton.testing import do_bench

import flexfa
from flexfa.bench import _variants
from flexfa.reference import attention_reference
from flexfa.runtime import backward as backward_runtime

ROWS: list[dict] = []


def emit(**row) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def relerr(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_small(template: str, D: int, L: int = 1000) -> None:
    """Every benchmark variant vs the float64 reference at a length that is no tile multiple."""
    os.environ["FLEXFA_FORWARD_TEMPLATE"] = template
    B, H = 1, 4
    for name, (score_mod, mask_mod) in _variants(L, H, "cuda").items():
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        bm = flexfa.create_block_mask(mask_mod, B, None, L, L, device="cuda") if mask_mod else None
        out = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
        do = torch.randn_like(out)
        out.backward(do)
        grads = [t.grad for t in (q, k, v)]
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = attention_reference(qd, kd, vd, score_mod, mask_mod)
        ref.backward(do.double())
        # the same computation in bf16 eagerly: the error a bf16 kernel is allowed
        emit(kind="check", template=template, variant=name, D=D, L=L,
             out=relerr(out, ref), dq=relerr(grads[0], qd.grad), dk=relerr(grads[1], kd.grad),
             dv=relerr(grads[2], vd.grad))


def time_variants(S: int, D: int, template: str, names, bwd: bool) -> None:
    os.environ["FLEXFA_FORWARD_TEMPLATE"] = template
    B, H = max(1, 16384 // S), 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=bwd)
               for _ in range(3))
    variants = _variants(S, H, "cuda")
    for name in names:
        score_mod, mask_mod = variants[name]
        bm = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
        density = 1.0 if bm is None else 1.0 - bm.sparsity() / 100.0
        t0 = time.perf_counter()
        fn = lambda: flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)  # noqa
        if bwd:
            do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
            step = lambda: fn().backward(do)  # noqa
        else:
            step = fn
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms = do_bench(step, warmup=10, rep=40, return_mode="median",
                      grad_to_none=[q, k, v] if bwd else None)
        flops = 4 * B * H * S * S * D * density * (3.5 if bwd else 1.0)
        emit(kind="time", template=template, variant=name, S=S, D=D,
             pass_="fwd+bwd" if bwd else "fwd", ms=ms, tflops=flops / ms / 1e9, first_s=first,
             bwd_tiles=backward_runtime.default_backward_tiles.__name__ if bwd else None)


def sweep_backward(S: int, D: int, configs) -> None:
    original = backward_runtime.default_backward_tiles
    try:
        for config in configs:
            backward_runtime.default_backward_tiles = lambda *a, c=config: c
            backward_runtime._PLANS.clear()  # plans hold the tiles of their spec
            try:
                time_variants(S, D, "auto", ["causal"], bwd=True)
                ROWS[-1]["bwd_config"] = config
                print("bwd config", config, f"{ROWS[-1]['ms']:.3f} ms", flush=True)
            except Exception as exc:
                emit(kind="bwd_fail", S=S, D=D, bwd_config=config, error=repr(exc)[:300])
    finally:
        backward_runtime.default_backward_tiles = original


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()
    if "check" not in args.skip:
        for D in (64, 128):
            check_small("hopper", D)
    print(f"[{time.perf_counter() - start:.0f}s] checks done", flush=True)
    all_names = ["full", "causal", "sliding", "alibi", "softcap", "document", "prefix"]
    for S, D in ((8192, 128), (16384, 64)):
        time_variants(S, D, "auto", all_names, bwd=False)
    print(f"[{time.perf_counter() - start:.0f}s] forward done", flush=True)
    if "bwd" not in args.skip:
        sweep_backward(8192, 128, [(32, 64, 64, 32, 4, 2), (64, 128, 128, 64, 8, 2),
                                   (64, 64, 64, 64, 4, 3), (32, 128, 128, 32, 4, 3)])
        sweep_backward(2048, 64, [(32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 3),
                                  (64, 64, 64, 64, 4, 3)])
    print(f"[{time.perf_counter() - start:.0f}s] backward done", flush=True)
    from dispatch_overhead import main as dispatch
    emit(kind="dispatch", **dispatch(["--calls", "2000"]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    from flexfa.runtime.cache_location import usable_cache_dir
    tuned = usable_cache_dir() / "autotune.json"
    if tuned.exists():
        shutil.copy(tuned, os.path.join(args.out, "autotune.json"))
    print("\nkind   variant   S     D   pass     ms      TF/s   extra")
    for r in ROWS:
        if r["kind"] == "time":
            print(f"time   {r['variant']:9} {r['S']:5} {r['D']:3} {r['pass_']:8} {r['ms']:7.3f} "
                  f"{r['tflops']:6.0f} {r.get('bwd_config', '')}")
        elif r["kind"] == "check":
            print(f"check  {r['variant']:9} D={r['D']} out={r['out']:.1e} dq={r['dq']:.1e} "
                  f"dk={r['dk']:.1e} dv={r['dv']:.1e}")
        else:
            print(r)


if __name__ == "__main__":
    main()
