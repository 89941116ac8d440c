"""Forward tile sweep on the H200 with occupancy: which configs give two programs per SM.

``python benchmarks/tile_sweep.py [--cases 128:16384:causal,...] [--configs E=bm,bn,w,s[,maxnreg];...]``

For each case (head dim, sequence length, benchmark variant; B * S = 16384 tokens, 16 heads,
bf16) and each forward config pinned through ``kernel_options`` (tiles, warps, stages and the
register cap ``maxnreg``, 0 or "-" for none), prints the median forward time
(``triton.testing.do_bench``), the compiled kernel's registers, spills and shared
memory, and how many programs fit on one SM by registers and by shared memory. The first config
of a head dim is the reference: every other output is compared with it (relative L2 error).
``--fp8`` times the FP8 forward (``flex_attention_fp8`` on pre-quantized inputs) per config
instead, next to the tuned bf16 forward.
"""
from __future__ import annotations

import argparse
import json


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="128:16384:causal,128:16384:full,64:2048:causal,"
                        "64:16384:full", help="E:S:variant,... (%(default)s)")
    parser.add_argument("--configs", default=None, help="E=bm,bn,w,s[,maxnreg];...")
    parser.add_argument("--rep", type=int, default=50)
    parser.add_argument("--fp8", action="store_true",
                        help="time the FP8 forward (pre-quantized inputs) at each config, next "
                        "to the tuned bf16 forward (no occupancy columns)")
    return parser


if __name__ == "__main__":  # --help and argument errors before the imports below
    build_parser().parse_args()

import torch
from triton.testing import do_bench

import flexfa
from flexfa.bench import _relerr
from flexfa.bench_cases import bench_variants
from flexfa.runtime import plans

DEFAULT_CONFIGS = {
    128: [(128, 128, 8, 2, None), (128, 128, 8, 3, None), (128, 64, 8, 2, None),
          (128, 64, 8, 2, 128), (128, 64, 8, 2, 168), (128, 128, 8, 2, 168)],
    64: [(128, 128, 4, 3, None), (128, 128, 4, 2, None), (128, 128, 8, 3, None),
         (128, 128, 8, 2, 128), (128, 128, 8, 3, 128), (128, 64, 8, 2, None)],
}
FP8_CONFIGS = {128: [(128, 128, 8, 3, None), (128, 128, 8, 2, None), (64, 128, 4, 2, None),
                     (64, 128, 4, 3, None), (64, 64, 4, 3, None)]}


def case_inputs(case: str) -> tuple:
    """(dim, seq, variant, q, k, v, score_mod, flexfa block mask) of ``dim:seq:variant``:
    bf16, 16 heads, B * seq = 16384 tokens, the benchmark's mods."""
    dim, seq, variant = case.split(":")
    dim, seq = int(dim), int(seq)
    B, H = max(1, 16384 // seq), 16
    score_mod, mask_mod = bench_variants(seq, H, "cuda")[variant]
    q, k, v = (torch.randn(B, H, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = flexfa.create_block_mask(mask_mod, B, None, seq, seq, device="cuda") if mask_mod else None
    return dim, seq, variant, q, k, v, score_mod, mask


def pinned(config) -> dict:
    """kernel_options pinning (BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg or None)."""
    bm, bn, warps, stages, maxnreg = config
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
            "maxnreg": maxnreg or 0}


def parse_configs(text: str) -> dict:
    configs = {}
    for part in text.split(";"):
        dim, values = part.split("=")
        fields = [int(x) if x not in ("", "-") else None for x in values.split(",")]
        configs.setdefault(int(dim), []).append(tuple(fields + [None] * (5 - len(fields))))
    return configs


def occupancy(compiled, warps: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(0)
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = props.regs_per_multiprocessor // (regs_per_warp * warps)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem_sm // (compiled.metadata.shared + 1024)
    return by_regs, by_smem


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.fp8:
        return fp8_sweep(args, parse_configs(args.configs) if args.configs else FP8_CONFIGS)
    configs = parse_configs(args.configs) if args.configs else DEFAULT_CONFIGS
    rows = []
    for case in args.cases.split(","):
        dim, seq, variant, q, k, v, score_mod, mask = case_inputs(case)
        reference = None
        for config in configs[dim]:
            plans.PLANS.clear()  # the plan read below is this config's
            options = pinned(config)
            warps, maxnreg = config[2], config[4]
            row = {"dim": dim, "seq": seq, "variant": variant, "config": list(config[:4]),
                   "maxnreg": maxnreg}
            try:
                def fn():
                    return flexfa.flex_attention(q, k, v, score_mod, mask, kernel_options=options)
                out = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a config that does not compile or fit: reported
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            if reference is None:
                reference = out
            row["relerr"] = _relerr(out, reference)
            row["ms"] = do_bench(fn, warmup=25, rep=args.rep, return_mode="median")
            plan = plans.PLANS.values()[0]
            direct = plan.steps[0].direct
            compiled = direct.compiled if direct is not None else None
            if compiled is not None:
                row.update(regs=compiled.n_regs, spills=compiled.n_spills,
                           smem=compiled.metadata.shared)
                row["per_sm_regs"], row["per_sm_smem"] = occupancy(compiled, warps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'E':>4} {'S':>6} {'variant':>8} {'config':>16} {'maxnreg':>7} {'ms':>7} "
          f"{'regs':>5} {'spill':>5} {'smem':>7} {'CTA/SM r,s':>10} {'relerr':>8}")
    for r in rows:
        cfg = ",".join(map(str, r["config"]))
        if "error" in r:
            print(f"{r['dim']:>4} {r['seq']:>6} {r['variant']:>8} {cfg:>16} {r['maxnreg'] or '-':>7} "
                  f"{r['error']}")
            continue
        print(f"{r['dim']:>4} {r['seq']:>6} {r['variant']:>8} {cfg:>16} {r['maxnreg'] or '-':>7} "
              f"{r['ms']:7.3f} {r.get('regs', '-'):>5} {r.get('spills', '-'):>5} "
              f"{r.get('smem', '-'):>7} {str(r.get('per_sm_regs', '-')) + ',' + str(r.get('per_sm_smem', '-')):>10} "
              f"{r['relerr']:8.1e}")
    return 0


def fp8_sweep(args, configs) -> int:
    """The FP8 kernel at each config (kernel_options, maxnreg included) against flexfa's bf16
    forward at its tuned tiles, on the same inputs; prints ms and bf16 / fp8."""
    from flexfa.fp8 import flex_attention_fp8, quantize

    print(f"{'E':>4} {'S':>6} {'variant':>8} {'config':>16} {'maxnreg':>7} {'fp8 ms':>7} "
          f"{'bf16 ms':>7} {'bf16/fp8':>8} {'relerr':>8}")
    for case in args.cases.split(","):
        dim, seq, variant, q, k, v, score_mod, mask = case_inputs(case)
        reference = flexfa.flex_attention(q, k, v, score_mod, mask)
        bf16_ms = do_bench(lambda: flexfa.flex_attention(q, k, v, score_mod, mask), warmup=25,
                           rep=args.rep, return_mode="median")
        x = quantize(q, k, v)
        for config in configs[dim]:
            options, maxnreg = pinned(config), config[4]
            row = {"dim": dim, "seq": seq, "variant": variant, "config": list(config[:4]),
                   "maxnreg": maxnreg, "bf16_ms": bf16_ms}
            try:
                def fn():
                    return flex_attention_fp8(x, score_mod=score_mod, block_mask=mask,
                                              kernel_options=options)
                out = fn()
                torch.cuda.synchronize()
                row["ms"] = do_bench(fn, warmup=25, rep=args.rep, return_mode="median")
                row["relerr"] = _relerr(out, reference)
            except Exception as exc:  # reported, the sweep goes on
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            print(json.dumps(row), flush=True)
            cfg = ",".join(map(str, row["config"]))
            if "error" in row:
                print(f"{dim:>4} {seq:>6} {variant:>8} {cfg:>16} {maxnreg or '-':>7} {row['error']}")
            else:
                print(f"{dim:>4} {seq:>6} {variant:>8} {cfg:>16} {maxnreg or '-':>7} "
                      f"{row['ms']:7.3f} {bf16_ms:7.3f} {bf16_ms / row['ms']:8.3f} "
                      f"{row['relerr']:8.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
