"""One GPU call: the backward's two kernels timed apart, each at its own pinned configuration.

    PYTHONPATH=. python benchmarks/bwd_kernel_sweep.py [--cases 128:16384:causal,...]
        [--dkdv OWN:WALK:WARPS:STAGES:MAXNREG,...] [--dq ...] [--out DIR]

A case is E:S:variant, or E/Ev:S:variant where v's head dim differs (192/128: DeepSeek's MLA);
the variant may carry suffixes: ``+gqaG`` (G query heads per kv head), ``+drop`` (dropout 0.1,
a fixed seed), ``+nomask`` (the variant's score_mod without its mask_mod): ``causal+gqa4``.
The dK/dV kernel owns OWN keys and walks q tiles of WALK rows; the dQ kernel owns OWN rows and
walks kv tiles of WALK keys (MAXNREG 0: no register cap). For each case the backward's inputs
(q, k, v, out, lse, dO and the prepared call) are captured from one ``flexfa`` fwd+bwd, whose
gradients are the reference: every configuration is checked against them (relative L2 error of
its kernel's outputs) before its kernel alone is timed (``do_bench`` median; the default dQ
kernel, which stores delta, run once before). Prints one JSON line per configuration (with
registers, spills and shared memory of the compiled kernel) and, per case, the fastest configuration of each kernel next
to the default's; writes ``bwd_kernel_sweep.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os

DEFAULT_CASES = "128:16384:causal,128:16384:softcap"
DEFAULT_DKDV = ("64:64:4:2:0,64:32:4:2:0,64:32:4:3:0,128:32:8:2:0,128:32:8:3:0,64:64:8:2:0,"
                "128:64:8:2:0")
DEFAULT_DQ = ("64:64:4:2:0,64:32:4:2:0,128:64:8:2:0,128:32:8:2:0,128:64:8:3:0,64:64:4:3:0,"
              "64:128:4:2:0,128:128:8:2:0")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="E:S:variant,... (%(default)s)")
    parser.add_argument("--dkdv", default=DEFAULT_DKDV,
                        help="dK/dV configs, OWN:WALK:WARPS:STAGES:MAXNREG,...")
    parser.add_argument("--dq", default=DEFAULT_DQ, help="dQ configs, the same form")
    parser.add_argument("--out", default=".", help="where bwd_kernel_sweep.json goes")
    parser.add_argument("--device", default="cuda", help="cpu: interpreter smoke test")
    parser.add_argument("--heads", type=int, default=16)
    return parser


if __name__ == "__main__":  # --help and argument errors before the imports below
    build_parser().parse_args()

import torch
from triton.testing import do_bench

import flexfa
from flexfa import autograd as flexfa_autograd
from flexfa.bench import _relerr
from flexfa.bench_cases import bench_variants, split_variant
from flexfa.runtime.families import backward as bwd
from flexfa.runtime.launch import Step
from flexfa.runtime.target import target_of


def capture(variant: str, S: int, D: int, device: str = "cuda", heads: int = 16,
            Dv: int | None = None):
    """(args of run_backward, (dq, dk, dv)) of one flexfa fwd+bwd on the benchmark's inputs
    (``device="cpu"``, small S and heads: a smoke test under the interpreter); v and dO of
    head dim ``Dv`` (default D)."""
    variant, group, dropout, nomask = split_variant(variant, heads)
    B, H, Dv = max(1, 16384 // S) if device == "cuda" else 1, heads, Dv or D
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, h, S, dim, device=device, dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for dim, h in ((D, H), (D, H // group), (Dv, H // group)))
    do = torch.randn(B, H, S, Dv, device=device, dtype=torch.bfloat16, generator=gen)
    score_mod, mask_mod = bench_variants(S, H, device)[variant]
    if nomask:
        mask_mod = None
    extra = dict(enable_gqa=group > 1)
    if dropout:
        extra.update(dropout_p=0.1, dropout_seed=1234)
    block_mask = flexfa.create_block_mask(mask_mod, B, None, S, S, device=device) \
        if mask_mod else None
    seen = {}
    original = flexfa_autograd.run_backward

    def recording(*args, **kwargs):
        seen["args"] = args
        return original(*args, **kwargs)
    flexfa_autograd.run_backward = recording
    try:
        flexfa.flex_attention(q, k, v, score_mod, block_mask, **extra).backward(do)
    finally:
        flexfa_autograd.run_backward = original
    return seen["args"], (q.grad.clone(), k.grad.clone(), v.grad.clone())


def sweep_kernel(which: str, item: str, args, reference) -> dict:
    q, k, v, out, lse, grad_out, grad_lse, call = args[:8]
    own, walk, warps, stages, maxnreg = (int(x) for x in item.split(":"))
    tiles = (walk, own, own, walk) if which == "dkdv" else (own, walk, own, walk)
    spec = bwd.backward_spec(q, k, v, call, has_dlse=grad_lse is not None,
                             target=target_of(q.device), grad_out=grad_out,
                             config=(*tiles, warps, stages))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    x = bwd.Inputs(q, k, v, out, lse, grad_out, grad_lse, dq, dk, dv, {})
    plan = bwd.BACKWARD.make_plan(spec, call, x, bwd.joint_graph(call.score))
    step_args = bwd.step_args(plan, call, x)
    position = 1 if which == "dkdv" else 0  # launch order: dQ (storing delta), dK/dV
    options = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    first = plan.steps[position]
    step = Step(first.kernel, first.grid, first.constexprs, options)
    plan.steps[0].launch(step_args[0], q.device)  # delta for the dK/dV kernel
    step.launch(step_args[position], q.device)
    if q.is_cuda:
        torch.cuda.synchronize()
    errors = ({"dk": _relerr(dk, reference[1]), "dv": _relerr(dv, reference[2])}
              if which == "dkdv" else {"dq": _relerr(dq, reference[0])})
    if step.direct is None:  # the interpreter: correctness only
        return dict(kernel=which, config=item, ms=0.0, errors=errors, registers=0, spills=0,
                    shared=0)
    ms = do_bench(lambda: step.launch(step_args[position], q.device), warmup=10, rep=100,
                  return_mode="median")
    compiled = step.direct.compiled
    return dict(kernel=which, config=item, ms=ms, errors=errors, registers=compiled.n_regs,
                spills=compiled.n_spills, shared=compiled.metadata.shared)


def main() -> None:
    opts = build_parser().parse_args()
    rows = []
    for case in opts.cases.split(","):
        dims, seq, variant = case.split(":")
        dim, _, dim_v = dims.partition("/")
        args, reference = capture(variant, int(seq), int(dim), opts.device, opts.heads,
                                  int(dim_v) if dim_v else None)
        for which, items in (("dkdv", opts.dkdv), ("dq", opts.dq)):
            for item in filter(None, items.split(",")):  # "" skips the kernel
                try:
                    row = sweep_kernel(which, item, args, reference)
                except Exception as exc:  # a config that does not compile: reported, skipped
                    row = dict(kernel=which, config=item,
                               error=f"{type(exc).__name__}: {exc}"[:300])
                row["case"] = case
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{'case':22} {'kernel':5} {'config':16} {'ms':>8} {'regs':>5} {'spill':>6} "
          f"{'smem KB':>8} {'max err':>8}")
    for row in rows:
        if "ms" in row:
            print(f"{row['case']:22} {row['kernel']:5} {row['config']:16} {row['ms']:8.3f} "
                  f"{row['registers']:5} {row['spills']:6} {row['shared'] / 1024:8.1f} "
                  f"{max(row['errors'].values()):8.1e}")
    for case in opts.cases.split(","):
        for which in ("dkdv", "dq"):
            ok = [r for r in rows if r["case"] == case and r["kernel"] == which and "ms" in r
                  and max(r["errors"].values()) < 1e-2]
            if ok:
                best = min(ok, key=lambda r: r["ms"])
                print(f"{case} {which}: best {best['config']} {best['ms']:.3f} ms, first "
                      f"(default) {ok[0]['config']} {ok[0]['ms']:.3f} ms")
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "bwd_kernel_sweep.json"), "w") as f:
        gpu = torch.cuda.get_device_name() if opts.device == "cuda" else "cpu"
        json.dump({"rows": rows, "torch": torch.__version__, "gpu": gpu}, f, indent=1)


if __name__ == "__main__":
    main()
