"""Packed documents on the GPU: flexfa.varlen_attention against torch FlexAttention (document
mask_mod + create_block_mask + compiled flex_attention) and flash_attn_varlen_func, in one
process: table building, forward, forward+backward, causal and not.

Default case (issue 28): 16 documents of random lengths totalling 32768 tokens, H = 16,
E = 128, bf16. Targets: flexfa's tables < 0.2 ms; (tables + attention) >= 2x FlexAttention's.
Times are triton.testing.do_bench medians in ms. Rows:

- ``tables``: ``flexfa.varlen_block_mask`` from GPU offsets (checks with one sync included);
  ``tables_cpu_offsets``: from CPU offsets (checked on the host, no device sync);
  ``tables_only``: the table building after the checks (two Triton kernels);
  ``tables_torch_ops``: the same with the torch-operations path (the CPU's, ~90 launches);
- ``fwd`` / ``fwd_bwd``: ``varlen_attention`` on the packed ``[total, H, E]`` tensors (no
  copy: the Hopper family reads them through strided descriptors) with the batch's offsets
  tensor (its mask is kept per offsets tensor, as in the layers of one step);
  ``fwd_ampere``: the same forced onto the Ampere family (the packed path before the strided
  descriptors); ``fwd_new_offsets``: a new offsets tensor on each call (checks, tables and
  plans each time: a step's first layer); ``fwd_bhle``: flex_attention with the same mask
  on contiguous ``[1, H, total, E]`` copies, and ``copy_qkv_to_bhle`` the copies' time;
- torch: ``tables`` (create_block_mask), ``fwd`` / ``fwd_bwd`` (compiled flex_attention),
  with ``--torch-compiled-tables`` also ``tables_compiled`` (``_compile=True``); flash:
  ``fwd`` / ``fwd_bwd``.

Each peer is guarded: a failure is recorded and the rest still runs; rows that would start
after ``--budget`` seconds are skipped (recorded as such), so the run fits one slot of a shared
GPU call (default 85 s; compiles dominate). Prints one table per mode; JSON to ``out``:

    timeout 120 python benchmarks/varlen_bench.py results.json [--tokens 32768 --docs 16]
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
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def offsets_of(tokens: int, docs: int, seed: int):
    import torch
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=generator)[:docs - 1] + 1
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([tokens])]).int()


DEADLINE = [float("inf")]  # time.monotonic() past which rows are skipped (--budget)


def guarded(results: dict, name: str, measure) -> None:
    if time.monotonic() > DEADLINE[0]:
        results[name] = {"skipped": "past the time budget"}
        return
    try:
        results[name] = measure()
    except Exception as exc:  # a peer that fails is recorded, the others still run
        results[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        traceback.print_exc(limit=3)


def fwd_bwd(run, inputs):
    """A function running forward and backward, for do_bench(grad_to_none=inputs)."""
    import torch
    grad = []

    def step():
        out = run()
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])
    return step


def inference(run):
    """``run`` without autograd (the forward-only rows)."""
    import torch

    def forward():
        with torch.no_grad():
            return run()
    return forward


def flexfa_rows(q, k, v, cu, causal: bool, bench) -> dict:
    import flexfa
    from flexfa.blockmask.offsets import check_offsets
    from flexfa.blockmask.varlen import document_block_mask

    cu_cpu = cu.cpu()
    offsets = check_offsets("bench", cu, cu, q.device)
    rows = {}
    guarded(rows, "tables", lambda: bench(lambda: flexfa.varlen_block_mask(cu, causal=causal)))
    guarded(rows, "tables_cpu_offsets", lambda: bench(lambda: flexfa.varlen_block_mask(
        cu_cpu, causal=causal, device=q.device)))
    guarded(rows, "tables_only", lambda: bench(
        lambda: document_block_mask(offsets, causal, None, (128, 128))))
    guarded(rows, "tables_torch_ops", lambda: bench(
        lambda: document_block_mask(offsets, causal, None, (128, 128), kernels=False)))

    def forward(options=None):
        return flexfa.varlen_attention(q, k, v, cu, cu, causal=causal, kernel_options=options)
    guarded(rows, "fwd", lambda: bench(inference(forward)))
    guarded(rows, "fwd_ampere", lambda: bench(inference(lambda: forward({"BACKEND": "AMPERE"}))))
    guarded(rows, "fwd_new_offsets", lambda: bench(inference(
        lambda: flexfa.varlen_attention(q, k, v, cu.clone(), cu.clone(), causal=causal))))
    guarded(rows, "fwd_bwd", lambda: bench(fwd_bwd(forward, (q, k, v)), grad_to_none=[q, k, v]))
    rows["out"] = inference(forward)()
    # the same mask on contiguous [1, H, total, E] copies, and the copies' cost
    mask = flexfa.varlen_block_mask(cu, causal=causal)
    copies = [t.detach().transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]
    guarded(rows, "copy_qkv_to_bhle", lambda: bench(
        lambda: [t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]))
    guarded(rows, "fwd_bhle", lambda: bench(inference(
        lambda: flexfa.flex_attention(*copies, block_mask=mask))))
    return rows


def torch_rows(q, k, v, cu, causal: bool, bench, compiled_tables: bool = False) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    tokens = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=q.device),
                                  cu.diff().to(q.device).long())

    def document(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same
    rows = {}
    guarded(rows, "tables", lambda: bench(lambda: create_block_mask(
        document, None, None, tokens, tokens, device=q.device)))
    if compiled_tables:
        guarded(rows, "tables_compiled", lambda: bench(lambda: create_block_mask(
            document, None, None, tokens, tokens, device=q.device, _compile=True)))
    mask = create_block_mask(document, None, None, tokens, tokens, device=q.device)
    compiled = torch.compile(flex_attention)
    views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]

    def forward():
        return compiled(*views, block_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    guarded(rows, "fwd", lambda: bench(inference(forward)))
    guarded(rows, "fwd_bwd", lambda: bench(fwd_bwd(forward, (q, k, v)), grad_to_none=[q, k, v]))
    guarded(rows, "out", inference(forward))
    return rows


def flash_rows(q, k, v, cu, causal: bool, bench) -> dict:
    from flash_attn import flash_attn_varlen_func

    cu = cu.to(q.device)
    longest = int(cu.diff().max())

    def forward():
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
    rows = {}
    guarded(rows, "fwd", lambda: bench(inference(forward)))
    guarded(rows, "fwd_bwd", lambda: bench(fwd_bwd(forward, (q, k, v)), grad_to_none=[q, k, v]))
    rows["out"] = inference(forward)()
    return rows


def summary(case: dict) -> dict:
    """The issue's sums and ratios: (tables + fwd) and (tables + fwd_bwd), flexfa vs torch."""
    flexfa, torch_ = case.get("flexfa", {}), case.get("torch", {})
    out = {}
    if isinstance(flexfa.get("fwd"), float) and isinstance(flexfa.get("fwd_ampere"), float):
        out["hopper_packed_vs_ampere"] = flexfa["fwd_ampere"] / flexfa["fwd"]
    for what in ("fwd", "fwd_bwd"):
        try:
            mine = flexfa["tables"] + flexfa[what]
            theirs = torch_["tables"] + torch_[what]
            out[f"tables+{what}"] = {"flexfa": mine, "torch": theirs,
                                     "speedup": theirs / mine, "target_met": theirs / mine >= 2}
        except (KeyError, TypeError):
            pass
    for name in ("tables", "tables_only"):
        if isinstance(flexfa.get(name), float):
            out[f"{name}_target_met"] = flexfa[name] < 0.2
    return out


def table(mode: str, case: dict) -> str:
    """One line per row: its time (ms) for each peer that has it."""
    ran = [p for p in ("flexfa", "torch", "flash") if isinstance(case.get(p), dict)]
    peers = [p for p in ran if not {"error", "skipped"} & set(case[p])]
    names = list(dict.fromkeys(n for p in peers for n in case[p]))
    lines = [f"{mode:<20}" + "".join(f"{p:>12}" for p in peers)]
    lines += [f"{p}: {next(iter(case[p].values()))}" for p in ran if p not in peers]
    for name in names:
        cells = []
        for p in peers:
            value = case[p].get(name)
            cells.append(f"{value:12.3f}" if isinstance(value, float) else
                         f"{'-' if value is None else 'error' if 'error' in value else 'skip':>12}")
        lines.append(f"{name:<20}" + "".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file for the results")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="causal,full", help="causal and/or full (comma list)")
    parser.add_argument("--budget", type=float, default=85.0,
                        help="seconds after which no further row starts")
    parser.add_argument("--torch-compiled-tables", action="store_true",
                        help="also time create_block_mask(_compile=True) (a long compile)")
    args = parser.parse_args(argv)
    DEADLINE[0] = time.monotonic() + args.budget

    import torch
    import triton.testing
    from manifest import manifest

    def bench(fn, grad_to_none=None):
        return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none,
                                       return_mode="median")

    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.tokens, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=generator).to("cuda", torch.bfloat16)
               .requires_grad_() for _ in range(3))
    cu = offsets_of(args.tokens, args.docs, args.seed).cuda()
    results = {"manifest": manifest(" ".join([sys.argv[0], *sys.argv[1:]])),
               "case": {**vars(args), "lengths": cu.diff().tolist()}, "modes": {}}
    peers = {"flexfa": flexfa_rows,
             "torch": lambda *a: torch_rows(*a, compiled_tables=args.torch_compiled_tables),
             "flash": flash_rows}
    for mode in args.modes.split(","):
        case = results["modes"][mode] = {}
        for name, rows in peers.items():
            guarded(case, name, lambda rows=rows: rows(q, k, v, cu, mode == "causal", bench))
        outs = {n: r.pop("out") for n, r in case.items()
                if isinstance(r, dict) and isinstance(r.get("out"), torch.Tensor)}
        if "flexfa" in outs:
            case["max_abs_diff_vs_flexfa"] = {
                n: float((o.float() - outs["flexfa"].float()).abs().max()) for n, o in outs.items()
                if n != "flexfa"}
        case["summary"] = summary(case)
        print(table(mode, case))
        print(f"{mode} summary: " + json.dumps(case["summary"]))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
