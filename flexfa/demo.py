"""``python -m flexfa demo``: a few attention variants, compiled, run and checked.

Each variant is written as a lambda, run forward and backward through ``flexfa.flex_attention``
and compared with the float64 eager reference (``flexfa.reference``). The demo prints one
table row per variant, draws one block mask (as text, and as a PNG where ``--out`` says) and
exits with status 1 if any check fails. On a CUDA GPU it then times each variant's forward
against torch FlexAttention compiled with ``torch.compile`` and prints the speedups, within a
time budget. Without a GPU it runs on the CPU through Triton's interpreter at small sizes, and
times nothing (the interpreter's speed says nothing about the kernels').
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import time

import torch

import flexfa
from .blockmask.draw import EMPTY_CHAR, FULL_CHAR, PARTIAL_CHAR
from .mods import alibi_slopes, document_ids
from .reference import attention_reference, error_bound, max_error
from .runtime.cache import STATS

log = logging.getLogger("flexfa")

# sizes per device: the CPU interpreter is slow, so it gets a small problem
SIZES = {"cpu": dict(batch=1, heads=2, seq_len=200, head_dim=32, dtype="float32", block_size=64),
         "cuda": dict(batch=2, heads=8, seq_len=2048, head_dim=64, dtype="bfloat16",
                      block_size=128)}
# GPU timing stops starting new variants after this many seconds; each one compiles torch's
# FlexAttention forward (a few seconds) before it is timed, so the whole run stays well under
# a minute
TIMING_BUDGET_S = 30.0
MASK_LEGEND = (f"legend: '{FULL_CHAR * 2}' full tile (no mask code), '{PARTIAL_CHAR * 2}' partial "
               f"(mask_mod applied), '{EMPTY_CHAR * 2}' empty (skipped)")


@dataclasses.dataclass
class Variant:
    name: str
    score_mod: object = None
    mask_mod: object = None
    learned: tuple = ()  # captured tensors whose gradients are checked too

    def __post_init__(self):
        # lambdas are all called "<lambda>": name them after the variant for logs and reprs
        slug = "".join(c if c.isalnum() else "_" for c in self.name.lower())
        for kind, mod in (("score", self.score_mod), ("mask", self.mask_mod)):
            if mod is not None and mod.__name__ == "<lambda>":
                mod.__name__ = mod.__qualname__ = f"demo_{slug}_{kind}"


@dataclasses.dataclass
class Result:
    name: str
    sparsity: float | None = None
    forward_error: float | None = None
    backward_error: float | None = None
    seconds: float = 0.0
    kernel: str = "-"
    status: str = "ok"
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def make_variants(seq_len: int, heads: int, device) -> list[Variant]:
    """The demo's variants, each mod written inline as a lambda."""
    window = max(seq_len // 4, 1)
    slopes = alibi_slopes(heads).to(device)
    third = max(seq_len // 3, 1)
    doc = document_ids([third, seq_len - 2 * third, third], device=device)  # 3 packed documents
    table = (0.1 * torch.randn(heads, 2 * seq_len - 1, device=device)).requires_grad_()
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    return [
        Variant("causal", mask_mod=causal),
        Variant(f"sliding window {window}",
                mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < window)),
        Variant("alibi + causal",
                score_mod=lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx),
                mask_mod=causal),
        Variant("softcap 20",
                score_mod=lambda score, b, h, q_idx, kv_idx: 20.0 * torch.tanh(score / 20.0)),
        Variant("document packing",
                mask_mod=lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)),
        Variant("learnable relative bias",
                score_mod=lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + seq_len - 1],
                mask_mod=causal, learned=(table,)),
    ]


# ---- one variant -----------------------------------------------------------------------------

def _cache_counts() -> tuple[int, int]:
    """(sources generated, sources read from disk) so far in this process."""
    return STATS.codegen, STATS.disk_hits


def _kernel_origin(before: tuple[int, int], after: tuple[int, int], device) -> str:
    """Where the call's kernels came from: new ones are compiled for a GPU, interpreted on
    the CPU."""
    if after[0] > before[0]:
        return "compiled" if device.type == "cuda" else "interpreted"
    return "disk cache" if after[1] > before[1] else "memory cache"


def _inputs(args, device, dtype):
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    return [torch.randn(shape, device=device, dtype=dtype).requires_grad_() for _ in range(3)]


def run_variant(variant: Variant, args, device, dtype) -> Result:
    """Forward (and backward where available) against the float64 and same-dtype references."""
    result = Result(variant.name)
    q, k, v = _inputs(args, device, dtype)
    block_mask = None
    if variant.mask_mod is not None:
        block_mask = flexfa.create_block_mask(variant.mask_mod, None, None, args.seq_len,
                                              args.seq_len, device=device,
                                              BLOCK_SIZE=args.block_size)
        result.sparsity = float(block_mask.sparsity())
    counts_before = _cache_counts()
    start = time.perf_counter()
    out = flexfa.flex_attention(q, k, v, score_mod=variant.score_mod, block_mask=block_mask)
    grad_out = torch.randn_like(out)
    leaves = [q, k, v, *variant.learned]
    grads = None
    if out.requires_grad:
        try:
            grads = torch.autograd.grad(out, leaves, grad_out)
        except NotImplementedError as exc:
            result.note = f"backward missing: {exc}"
    else:
        result.note = "backward missing: the output does not require grad"
    if device.type == "cuda":
        torch.cuda.synchronize()
    result.seconds = time.perf_counter() - start
    result.kernel = _kernel_origin(counts_before, _cache_counts(), device)

    def reference(dtype_):
        ref = attention_reference(q, k, v, variant.score_mod, variant.mask_mod, dtype=dtype_)
        return ref, (torch.autograd.grad(ref, leaves, grad_out.to(dtype_)) if grads is not None else None)

    exact, exact_grads = reference(torch.float64)
    eager, eager_grads = reference(dtype)
    result.forward_error = max_error(out, exact)
    ok = result.forward_error <= error_bound(max_error(eager, exact), dtype)
    if grads is not None:
        errors = [max_error(g, e) for g, e in zip(grads, exact_grads)]
        bounds = [error_bound(max_error(g, e), dtype) for g, e in zip(eager_grads, exact_grads)]
        result.backward_error = max(errors)
        ok = ok and all(err <= bound for err, bound in zip(errors, bounds))
    result.status = "ok" if ok else "FAIL"
    if grads is None and ok:
        result.status = "fwd only"
    return result


# ---- output ----------------------------------------------------------------------------------

def _cell(value, fmt):
    return "-" if value is None else format(value, fmt)


def _aligned(header: list[str], rows: list[list[str]]) -> list[str]:
    """The header, a rule and the rows, each column as wide as its widest cell."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip()
            for row in [header, ["-" * w for w in widths], *rows]]


def format_table(results: list[Result]) -> str:
    header = ["variant", "tiles skipped", "max err fwd", "max err bwd", "time (s)", "kernel", "check"]
    rows = [[r.name, _cell(r.sparsity, ".1f") + ("%" if r.sparsity is not None else ""),
             _cell(r.forward_error, ".2e"), _cell(r.backward_error, ".2e"),
             f"{r.seconds:.2f}", r.kernel, r.status] for r in results]
    lines = _aligned(header, rows)
    notes = [f"  {r.name}: {r.note}" for r in results if r.note]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


def draw_block_mask(variant: Variant, args, device, length: int, path: str | None) -> str:
    """The text drawing of ``variant``'s block mask at ``length`` with its legend, and the
    absolute path of its PNG (``path``; None: no PNG)."""
    block_mask = flexfa.create_block_mask(variant.mask_mod, None, None, length, length,
                                          device=device, BLOCK_SIZE=args.block_size)
    lines = [f"block mask of {variant.name!r} at L=S={length}:", repr(block_mask), MASK_LEGEND]
    if path is not None:
        path = os.path.abspath(path)
        try:
            block_mask.to_png(path)
        except ImportError:
            lines.append("no PNG: matplotlib is not installed (pip install matplotlib)")
        else:
            lines.append(f"picture written to {path}")
    return "\n".join(lines)


# ---- GPU timing ------------------------------------------------------------------------------

@dataclasses.dataclass
class Timing:
    name: str
    flexfa_ms: float | None = None
    torch_ms: float | None = None
    note: str = ""

    @property
    def speedup(self) -> float | None:
        """torch FlexAttention's time over flexfa's (> 1: flexfa is faster)."""
        if self.flexfa_ms is None or self.torch_ms is None:
            return None
        return self.torch_ms / self.flexfa_ms


def time_variants(variants: list[Variant], args, device, dtype,
                  budget_s: float = TIMING_BUDGET_S) -> list[Timing]:
    """GPU only: each variant's forward, flexfa against torch FlexAttention compiled with
    ``torch.compile`` (each with its own block mask of the same mask_mod), as medians of
    ``triton.testing.do_bench``. Variants not started within ``budget_s`` are left untimed."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
    from triton.testing import do_bench

    compiled = torch.compile(torch_flex_attention, dynamic=False)
    length = args.seq_len
    q, k, v = (torch.randn(args.batch, args.heads, length, args.head_dim, device=device,
                           dtype=dtype) for _ in range(3))
    started, timings = time.perf_counter(), []
    for variant in variants:
        if time.perf_counter() - started > budget_s:
            timings.append(Timing(variant.name, note=f"not timed: past the {budget_s:.0f} s budget"))
            continue
        ours_mask = theirs_mask = None
        try:
            if variant.mask_mod is not None:
                ours_mask = flexfa.create_block_mask(variant.mask_mod, None, None, length, length,
                                                     device=device, BLOCK_SIZE=args.block_size)
                theirs_mask = torch_block_mask(variant.mask_mod, None, None, length, length,
                                               device=device, BLOCK_SIZE=args.block_size)
            with torch.no_grad():
                ours = do_bench(lambda: flexfa.flex_attention(
                    q, k, v, score_mod=variant.score_mod, block_mask=ours_mask),
                    return_mode="median")
                theirs = do_bench(lambda: compiled(
                    q, k, v, score_mod=variant.score_mod, block_mask=theirs_mask),
                    return_mode="median")
        except Exception as exc:  # a timing that fails says so; the checks already passed
            timings.append(Timing(variant.name, note=f"not timed: {type(exc).__name__}: {exc}"))
        else:
            timings.append(Timing(variant.name, ours, theirs))
    return timings


def format_timings(timings: list[Timing]) -> str:
    """A table of forward times and speedups, their geometric mean, and why rows are empty."""
    header = ["variant", "flexfa (ms)", "FlexAttention (ms)", "speedup"]
    rows = [[t.name, _cell(t.flexfa_ms, ".3f"), _cell(t.torch_ms, ".3f"),
             _cell(t.speedup, ".2f") + ("x" if t.speedup is not None else "")] for t in timings]
    lines = _aligned(header, rows)
    speedups = [t.speedup for t in timings if t.speedup is not None]
    if speedups:
        mean = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
        lines += ["", f"geometric mean speedup over {len(speedups)} variants: {mean:.2f}x "
                      f"(> 1: flexfa is faster)"]
    notes = [f"  {t.name}: {t.note}" for t in timings if t.note]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


# ---- entry point -----------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m flexfa demo",
        description="Run a few attention variants forward and backward through flexfa, check "
                    "them against float64 attention, print a table and draw a block mask.")
    cpu, gpu = SIZES["cpu"], SIZES["cuda"]

    def size(flag, key, kind=int, **kwargs):
        parser.add_argument(flag, type=kind, help=f"default {cpu[key]} on CPU, {gpu[key]} on GPU",
                            **kwargs)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CUDA when torch sees a GPU, else the CPU interpreter")
    size("--batch", "batch")
    size("--heads", "heads")
    size("--seq-len", "seq_len")
    size("--head-dim", "head_dim")
    size("--dtype", "dtype", str, choices=["float32", "float16", "bfloat16"])
    size("--block-size", "block_size")
    parser.add_argument("--out", "--png", dest="out", default="flexfa_demo_blockmask.png",
                        help="where to write the block mask picture, a PNG (default: "
                             "%(default)s in the current directory)")
    parser.add_argument("--no-png", action="store_true", help="skip the picture")
    parser.add_argument("--no-timing", action="store_true",
                        help="on a GPU, skip timing against torch FlexAttention")
    parser.add_argument("--only", help="run only variants whose name contains this text")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = parser.parse_args(argv)
    for key, least in (("batch", 1), ("heads", 1), ("seq_len", 3), ("head_dim", 1),
                       ("block_size", 16)):
        value = getattr(args, key)
        if value is not None and value < least:
            parser.error(f"--{key.replace('_', '-')} must be >= {least}, got {value}")
    return args


def _pick_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("flexfa demo: --device cuda but torch sees no CUDA GPU")
    return choice


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    kind = _pick_device(args.device)
    for key, value in SIZES[kind].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device, dtype = torch.device(kind), getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    where = (torch.cuda.get_device_name() if kind == "cuda" else
             "CPU through the Triton interpreter (no CUDA GPU; small sizes, slow by design)")
    print(f"flexfa demo on {where}")
    print(f"B={args.batch} H={args.heads} L=S={args.seq_len} E={args.head_dim} {args.dtype}, "
          f"block mask tiles {args.block_size}; checked against float64 attention\n")
    variants = [v for v in make_variants(args.seq_len, args.heads, device)
                if not args.only or args.only in v.name]
    results = []
    for variant in variants:
        try:
            result = run_variant(variant, args, device, dtype)
        except Exception as exc:  # report every variant, then fail
            log.exception("demo variant %r failed", variant.name)
            result = Result(variant.name, status="FAIL", note=f"{type(exc).__name__}: {exc}")
        results.append(result)
        log.info("demo: %s -> %s", variant.name, result.status)
    print(format_table(results))
    # the sliding window reads no captured tensor, so it can be drawn longer than it ran
    window = next((v for v in variants if v.name.startswith("sliding window")), None)
    if window is not None:
        try:
            length = max(args.seq_len, 16 * args.block_size)
            print("\n" + draw_block_mask(window, args, device, length,
                                         None if args.no_png else args.out))
        except Exception as exc:
            print(f"\nno block mask picture: {type(exc).__name__}: {exc}")
    failed = [r.name for r in results if r.failed]
    if failed:
        print(f"\nFAILED: {', '.join(failed)}")
        return 1
    if any(r.status == "fwd only" for r in results):
        print("\nforward checks passed; the backward is not available yet, so it was not checked")
    else:
        print("\nall checks passed (forward and backward)")
    if kind == "cuda" and not args.no_timing:
        print(f"\nforward time against torch FlexAttention (torch.compile), medians of "
              f"triton.testing.do_bench; B={args.batch} H={args.heads} L=S={args.seq_len} "
              f"E={args.head_dim} {args.dtype}:\n")
        print(format_timings(time_variants(variants, args, device, dtype)))
    elif kind == "cpu":
        print("timings: GPU only (the interpreter's speed says nothing about the kernels')")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
