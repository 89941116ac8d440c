"""One GPU call: the backward's tile configurations, two kernels or fused dQ, against
torch FlexAttention (compiled) on a few fwd+bwd cases, every configuration checked against
FlexAttention's gradients first.

    PYTHONPATH=. FLEXFA_CACHE_DIR=/tmp/fxc python benchmarks/experiments/bwd_sweep.py [--out DIR] [--quick]

Prints JSON lines as it goes and a table at the end; writes ``bwd_sweep.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from triton.testing import do_bench

import flexfa
from flexfa.bench import _relerr, _variants
from flexfa.runtime import backward as backward_runtime

# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages), mode: "2k" the dK/dV and dQ
# kernels, "fused" dQ added by the dK/dV kernel (FLEXFA_BACKWARD_FUSED=1; BLOCK_M2/N2 unused),
# "2k-ptr" the two kernels with pointer loads (FLEXFA_BACKWARD_TMA=0)
CONFIGS = {
    128: [((64, 64, 64, 64, 4, 2), "2k"), ((64, 64, 64, 64, 8, 2), "fused"),
          ((32, 128, 128, 32, 8, 2), "fused"), ((64, 128, 128, 64, 8, 2), "fused"),
          ((32, 64, 64, 32, 4, 2), "fused")],
    64: [((32, 64, 64, 32, 4, 3), "2k"), ((64, 64, 64, 64, 4, 3), "2k"),
         ((64, 128, 128, 64, 8, 2), "fused"), ((64, 128, 128, 64, 8, 3), "fused"),
         ((64, 64, 64, 64, 4, 3), "fused"), ((32, 64, 64, 32, 4, 3), "fused")],
}
MODES = {"2k": {"FLEXFA_BACKWARD_FUSED": "0", "FLEXFA_BACKWARD_TMA": "1"},
         "fused": {"FLEXFA_BACKWARD_FUSED": "1", "FLEXFA_BACKWARD_TMA": "1"},
         "2k-ptr": {"FLEXFA_BACKWARD_FUSED": "0", "FLEXFA_BACKWARD_TMA": "0"}}
CASES = [("full", 16384, 128), ("causal", 16384, 128), ("full", 8192, 64),
         ("causal", 16384, 64), ("alibi", 8192, 64), ("document", 2048, 64),
         ("softcap", 8192, 128)]
ROWS: list[dict] = []


def emit(**row) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def fwd_bwd(fn, q, k, v, do):
    def step():
        fn(q, k, v).backward(do)
    return do_bench(step, warmup=10, rep=40, return_mode="median", grad_to_none=[q, k, v])


def grads(fn, q, k, v, do):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(do)
    result = [t.grad.detach().clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return result


def run_case(variant: str, S: int, D: int, compiled_flex, quick: bool) -> None:
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    B, H = max(1, 16384 // S), 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    score_mod, mask_mod = _variants(S, H, "cuda")[variant]
    tbm = torch_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
    fbm = flexfa.create_block_mask(mask_mod, B, None, S, S, device="cuda") if mask_mod else None
    density = 1.0 - tbm.sparsity() / 100.0 if tbm is not None else 1.0
    flops = 4 * B * H * S * S * D * density * 3.5

    def flex_fn(q, k, v):
        return compiled_flex(q, k, v, score_mod=score_mod, block_mask=tbm)

    def fa_fn(q, k, v):
        return flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=fbm)

    want = grads(flex_fn, q, k, v, do)
    flex_ms = fwd_bwd(flex_fn, q, k, v, do)
    emit(kind="flex", variant=variant, S=S, D=D, ms=flex_ms, tflops=flops / flex_ms / 1e9)
    fwd_ms = do_bench(lambda: fa_fn(q, k, v), warmup=10, rep=40, return_mode="median")
    emit(kind="flexfa_fwd", variant=variant, S=S, D=D, ms=fwd_ms)
    configs = CONFIGS[D][:3] if quick else CONFIGS[D]
    original = backward_runtime.default_backward_tiles
    try:
        for config, mode in configs:
            os.environ.update(MODES[mode])
            backward_runtime.default_backward_tiles = lambda *a, c=config: c
            backward_runtime._PLANS.clear()  # plans hold the tiles of their spec
            try:
                t0 = time.perf_counter()
                got = grads(fa_fn, q, k, v, do)
                first = time.perf_counter() - t0
                errors = {n: _relerr(a, b) for n, a, b in zip(("dq", "dk", "dv"), got, want)}
                ms = fwd_bwd(fa_fn, q, k, v, do)
                emit(kind="flexfa", variant=variant, S=S, D=D, config=config, mode=mode,
                     ms=ms, tflops=flops / ms / 1e9, vs_flex=flex_ms / ms, first_s=first,
                     **errors)
            except Exception as exc:  # a config that does not fit: record and go on
                emit(kind="fail", variant=variant, S=S, D=D, config=config, mode=mode,
                     error=repr(exc)[:300])
    finally:
        backward_runtime.default_backward_tiles = original
        for name in MODES["2k"]:
            os.environ.pop(name, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="three configs per head dim")
    parser.add_argument("--cases", default="", help="variant:S:D,... (default: CASES)")
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 10 ** 4
    torch._dynamo.config.accumulated_recompile_limit = 10 ** 5
    compiled_flex = torch.compile(torch_flex, dynamic=False)
    cases = [(c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2]))
             for c in args.cases.split(",") if c] or CASES
    start = time.perf_counter()
    for variant, S, D in cases:
        run_case(variant, S, D, compiled_flex, args.quick)
        print(f"[{time.perf_counter() - start:.0f}s] {variant} S={S} D={D} done", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bwd_sweep.json"), "w") as f:
            json.dump({"commit": os.environ.get("FLEXFA_COMMIT"),
                       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": ROWS}, f, indent=1)
    print("\nvariant   S     D   config                       mode   ms      TF/s  vs flex  "
          "max grad relerr")
    for r in ROWS:
        if r["kind"] == "flex":
            print(f"{r['variant']:9} {r['S']:5} {r['D']:3} {'FlexAttention':28} -    "
                  f"{r['ms']:7.3f} {r['tflops']:5.0f}")
        elif r["kind"] == "flexfa":
            err = max(r["dq"], r["dk"], r["dv"])
            print(f"{r['variant']:9} {r['S']:5} {r['D']:3} {str(r['config']):28} {r['mode']:6} "
                  f"{r['ms']:7.3f} {r['tflops']:5.0f} {r['vs_flex']:6.2f}x  {err:.1e}")
        elif r["kind"] == "fail":
            print(f"{r['variant']:9} {r['S']:5} {r['D']:3} {str(r['config']):28} {r['mode']:6} "
                  f"FAILED {r['error'][:60]}")



if __name__ == "__main__":
    main()
