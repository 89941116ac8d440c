"""A/B of two flexfa source trees in one process on the benchmark's inputs (H200 runs).

``python benchmarks/tree_ab.py --old PATH [--cases 128:16384:causal,...] [--rounds 3]``
imports this checkout's ``flexfa`` and the tree at ``PATH`` (a directory holding a
``flexfa`` package, e.g. a ``git worktree`` of an older commit) as ``flexfa_old``, checks
that both give the same outputs and gradients (relative L2 error), then times forward and
forward + backward of each case with ``triton.testing.do_bench`` (median), alternating
old / new for ``--rounds`` rounds, and prints per case the median over rounds and the ratio
old / new (> 1: this checkout is faster). Generated kernels of the two trees have different
names (their template hashes differ), so they share one kernel cache and one tuning file.
``--old-options JSON`` / ``--new-options JSON`` pass ``kernel_options`` to that side's calls
(this checkout chooses kernels only through them); ``--old-env NAME=VALUE,...`` /
``--new-env ...`` set environment variables while that side runs and is timed (older trees
read some choices from the environment); with ``--old .`` the same tree under two settings.
A case's head dim may name v's apart (``192/128:8192:causal``: E = 192, Ev = 128) and its
variant may carry ``flexfa.bench_cases.split_variant``'s suffixes (``+gqaG``, ``+drop``,
``+nomask``: ``256:8192:causal+gqa4``). ``--grid`` times the whole benchmark
grid (``python -m flexfa bench``'s dims, lengths and variants); ``--json PATH`` writes the
rows. ``--old`` may be given several times (with as many
``--old-env``, matched in order, or none): each tree is timed against this checkout in the
same rounds, which shares the new side's compile and timing between them.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, action="append",
                        help="a directory holding the old flexfa package (repeatable)")
    parser.add_argument("--cases", default="128:16384:causal,128:16384:full,128:16384:softcap,"
                        "64:2048:causal,64:8192:sliding,64:2048:full")
    parser.add_argument("--passes", default="fwd,fwd+bwd")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=40)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--old-env", action="append", default=[],
                        help="NAME=VALUE,... set while the old side runs (one per --old)")
    parser.add_argument("--new-env", default="", help="NAME=VALUE,... for this checkout's side")
    parser.add_argument("--old-options", action="append", default=[],
                        help="kernel_options JSON for the old side (one per --old)")
    parser.add_argument("--new-options", default="null",
                        help="kernel_options JSON for this checkout's side")
    parser.add_argument("--grid", action="store_true",
                        help="the benchmark's grid: E 64,128 x S 2048,8192,16384 x its variants")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    return parser


if __name__ == "__main__":  # --help and argument errors before the imports below
    build_parser().parse_args()

import torch

import flexfa
from flexfa.bench import _grad_out, _relerr, _time
from flexfa.bench_cases import VARIANTS, bench_variants, split_variant


def load_tree(path: str, name: str = "flexfa_old"):
    """The ``flexfa`` package under ``path`` imported as ``name`` (its imports are relative,
    and its lazy functions load its own runtime). A tree older than that (flexfa/lazy.py
    without ``_PACKAGE``, before 2026-12-03's twelfth session) would run this process's
    runtime on its own traced mods and fail deep in code generation: refused here by name."""
    init = Path(path) / "flexfa" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--old {path}: no flexfa/__init__.py there")
    lazy = init.parent / "lazy.py"
    if lazy.is_file() and "_PACKAGE" not in lazy.read_text():
        raise SystemExit(f"--old {path}: its flexfa/lazy.py imports 'flexfa.runtime...' by "
                         "name, which in this process is this checkout's runtime; A/B that "
                         "tree in separate processes instead (alternate the runs)")
    spec = importlib.util.spec_from_file_location(name, init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def parse_cases(text: str) -> list[tuple[int, int, int, str]]:
    """(E, Ev, S, variant) of each ``E[/Ev]:S:variant`` case."""
    cases = []
    for item in text.split(","):
        dims, seq, variant = item.split(":")
        dim, _, dim_v = dims.partition("/")
        cases.append((int(dim), int(dim_v or dim), int(seq), variant))
    return cases


def parse_env(text: str) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"environment settings must be NAME=VALUE,..., got {text!r}")
    return dict(pairs)


@contextlib.contextmanager
def env_set(env: dict[str, str]):
    """``env`` set in os.environ for the block, restored after (the forward and the backward
    it times both read it: the backward's plans are keyed by the variables they read)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.old_env and len(args.old_env) != len(args.old):
        raise SystemExit(f"{len(args.old)} --old trees but {len(args.old_env)} --old-env")
    if args.old_options and len(args.old_options) != len(args.old):
        raise SystemExit(f"{len(args.old)} --old trees but {len(args.old_options)} --old-options")
    olds = [f"old{i}" if len(args.old) > 1 else "old" for i in range(len(args.old))]
    envs = {"new": parse_env(args.new_env)}
    options = {"new": json.loads(args.new_options)}
    trees = {}
    for i, (label, path) in enumerate(zip(olds, args.old)):
        envs[label] = parse_env(args.old_env[i] if args.old_env else "")
        options[label] = json.loads(args.old_options[i]) if args.old_options else None
        trees[label] = load_tree(path, f"flexfa_{label}")
        print(f"{label}: {path} {envs[label]}", flush=True)
    trees["new"] = flexfa
    rows = []
    cases = ([(d, d, s, v) for d in (64, 128) for s in (2048, 8192, 16384) for v in VARIANTS]
             if args.grid else parse_cases(args.cases))
    for dim, dim_v, seq, variant in cases:
        B, H = max(1, args.tokens // seq), args.heads
        base, group, dropout, nomask = split_variant(variant, H)
        score_mod, mask_mod = bench_variants(seq, H, "cuda")[base]
        mask_mod = None if nomask else mask_mod
        extra = dict(enable_gqa=True) if group > 1 else {}
        if dropout:
            extra.update(dropout_p=0.1, dropout_seed=1234)
        q, k, v = (torch.randn(B, h, seq, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True)
                   for h, d in ((H, dim), (H // group, dim), (H // group, dim_v)))
        fns = {}
        for label, lib in trees.items():
            mask = (lib.create_block_mask(mask_mod, B, None, seq, seq, device="cuda")
                    if mask_mod else None)
            fns[label] = (lambda lib=lib, mask=mask, opts=options[label]:
                          lambda q, k, v: lib.flex_attention(q, k, v, score_mod, mask,
                                                             kernel_options=opts, **extra))()
        for bwd in [p == "fwd+bwd" for p in args.passes.split(",")]:
            do = _grad_out(q, v)
            results = {}
            for label, fn in fns.items():
                with env_set(envs[label]):
                    out = fn(q, k, v)
                    grads = torch.autograd.grad(out, (q, k, v), do) if bwd else ()
                results[label] = [out.detach(), *grads]
            times = {label: [] for label in fns}
            for _ in range(args.rounds):
                for label, fn in fns.items():
                    with env_set(envs[label]):
                        times[label].append(_time(fn, q, k, v, bwd, args.rep))
            for label in olds:
                errors = [_relerr(a, b) for a, b in zip(results["new"], results[label])]
                row = {"dim": dim, "dim_v": dim_v, "seq": seq, "variant": variant, "old": label,
                       "pass": "fwd+bwd" if bwd else "fwd",
                       "old_ms": statistics.median(times[label]),
                       "new_ms": statistics.median(times["new"]),
                       "times": {label: times[label], "new": times["new"]},
                       "max_relerr": max(errors)}
                row["speedup"] = row["old_ms"] / row["new_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:  # after every row: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
    print(f"\n{'E':>7} {'S':>6} {'variant':>8} {'old':>5} {'pass':>8} {'old ms':>8} "
          f"{'new ms':>8} {'old/new':>8} {'relerr':>8}")
    for r in rows:
        dims = f"{r['dim']}" + (f"/{r['dim_v']}" if r["dim_v"] != r["dim"] else "")
        print(f"{dims:>7} {r['seq']:>6} {r['variant']:>8} {r['old']:>5} {r['pass']:>8} "
              f"{r['old_ms']:8.3f} {r['new_ms']:8.3f} {r['speedup']:8.3f} {r['max_relerr']:8.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
