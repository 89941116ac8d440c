"""Packed documents on the GPU: flexfa.varlen_attention against torch FlexAttention (document
mask_mod + create_block_mask + compiled flex_attention) and flash_attn_varlen_func, in one
process: table building (with its breakdown), forward, forward+backward, causal and not.

Default case (issue 28): 16 documents of random lengths totalling 32768 tokens, H = 16,
E = 128, bf16. Targets: flexfa's tables < 0.2 ms; (tables + attention) >= 2x FlexAttention's.
Times are triton.testing.do_bench medians in ms. Rows, flexfa's first:

- ``tables``: ``flexfa.varlen_block_mask`` from GPU offsets, end to end (the checks in
  ``varlen_check``, one device read, then ``varlen_rows`` and ``varlen_columns``);
  ``tables_given_totals``: with ``Q_LEN`` / ``KV_LEN`` (as ``varlen_attention`` calls it: the
  checks inside ``varlen_rows``, two launches and one read); ``tables_cpu_offsets``: from CPU
  offsets (checked on the host, one copy); the breakdown: ``checks`` (``varlen_check`` and its
  read alone), ``tables_only`` (the two table kernels and the BlockMask from checked
  offsets), ``tables_torch_ops`` (the torch-operations path, the CPU's); ``tables_host_ms``:
  the host's time per ``tables`` call (perf_counter over 200 calls; near ``tables``: the call
  is host-bound); ``tables_profile``: the CUDA kernels and copies of one ``tables`` call and
  of one with the totals (torch.profiler), to confirm the launch and sync counts;
- ``fwd`` / ``fwd_bwd``: ``varlen_attention`` on the packed ``[total, H, E]`` tensors (no
  copy: the Hopper family reads them through strided descriptors) with the batch's offsets
  tensor (its mask is kept per offsets tensor, as in the layers of one step);
  ``fwd_new_offsets``: a new offsets tensor on each call (checks, tables and plans each
  time: a step's first layer); ``fwd_ampere``: forced onto the Ampere family; ``fwd_bhle``:
  flex_attention with the same mask on contiguous ``[1, H, total, E]`` copies, and
  ``copy_qkv_to_bhle`` the copies' time;
- torch: ``tables`` (create_block_mask), ``fwd`` / ``fwd_bwd`` (compiled flex_attention),
  with ``--torch-compiled-tables`` also ``tables_compiled`` (``_compile=True``); flash:
  ``fwd`` / ``fwd_bwd``.

The rows run in the order the summary needs them (flexfa's tables, torch's tables, then each
one's fwd, then fwd_bwd, then the extras), each guarded: a failure is recorded and the rest
still runs; a row whose estimated cost (torch's compiles: tens of seconds) would end past
``--budget`` is skipped (recorded as such), so the run fits one slot of a shared GPU call
(default 100 s, the causal mode only). Prints one table per mode and the summary (the
tables target, and ``tables+fwd`` / ``tables+fwd_bwd`` against FlexAttention with the >= 2x
target); JSON to ``out``:

    timeout 130 python benchmarks/varlen_bench.py results.json [--tokens 32768 --docs 16]
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


def guarded(results: dict, name: str, measure, cost: float = 1.0) -> None:
    """``results[name] = measure()``, recorded as skipped where ``cost`` (estimated seconds)
    would end past the budget, as an error where it raises."""
    if time.monotonic() + cost > DEADLINE[0]:
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


def host_ms(fn, calls: int = 200) -> float:
    """Host milliseconds per call of ``fn`` (its own syncs included), after a warm-up."""
    from dispatch_overhead import per_call_us  # the host clock over back-to-back calls

    return per_call_us(fn, calls, rounds=3)[0] / 1e3


def profiled(fn) -> dict:
    """The CUDA kernels (name -> launches) and device copies of one call of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels, copies = {}, {}
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        where = copies if "memcpy" in event.name.lower() or "memset" in event.name.lower() \
            else kernels
        where[event.name] = where.get(event.name, 0) + 1
    return {"kernels": kernels, "copies": copies}


def flexfa_tables(q, cu, causal: bool, bench) -> dict:
    """The tables' rows and their breakdown."""
    import flexfa
    from flexfa.blockmask.offsets import check_offsets
    from flexfa.blockmask.varlen import document_block_mask
    from flexfa.blockmask.varlen_tables import device_offsets

    cu_cpu, total = cu.cpu(), q.shape[0]
    offsets = check_offsets("bench", cu, cu, q.device)

    def tables():
        return flexfa.varlen_block_mask(cu, causal=causal)

    def given_totals():
        return flexfa.varlen_block_mask(cu, causal=causal, Q_LEN=total, KV_LEN=total)
    rows = {}
    guarded(rows, "tables", lambda: bench(tables))
    guarded(rows, "tables_given_totals", lambda: bench(given_totals))
    guarded(rows, "tables_cpu_offsets", lambda: bench(lambda: flexfa.varlen_block_mask(
        cu_cpu, causal=causal, device=q.device)))
    guarded(rows, "checks", lambda: bench(lambda: device_offsets("bench", cu, cu, None, None)))
    guarded(rows, "tables_only", lambda: bench(
        lambda: document_block_mask(offsets, causal, None, (128, 128))))
    guarded(rows, "tables_torch_ops", lambda: bench(
        lambda: document_block_mask(offsets, causal, None, (128, 128), kernels=False)))
    guarded(rows, "tables_host_ms", lambda: host_ms(tables))
    guarded(rows, "tables_profile", lambda: {"tables": profiled(tables),
                                             "tables_given_totals": profiled(given_totals)})
    return rows


def flexfa_attention(q, k, v, cu, causal: bool, bench, what: str) -> dict:
    """``what``: "fwd" (with the output for the comparison), "fwd_bwd" or "extras"."""
    import flexfa

    def forward(options=None):
        return flexfa.varlen_attention(q, k, v, cu, cu, causal=causal, kernel_options=options)
    rows = {}
    if what == "fwd":
        guarded(rows, "fwd", lambda: bench(inference(forward)), cost=20)
        guarded(rows, "fwd_new_offsets", lambda: bench(inference(
            lambda: flexfa.varlen_attention(q, k, v, cu.clone(), cu.clone(), causal=causal))))
        guarded(rows, "out", inference(forward))
    elif what == "fwd_bwd":
        guarded(rows, "fwd_bwd", lambda: bench(fwd_bwd(forward, (q, k, v)),
                                               grad_to_none=[q, k, v]), cost=20)
    else:
        guarded(rows, "fwd_ampere", lambda: bench(inference(
            lambda: forward({"BACKEND": "AMPERE"}))), cost=10)
        # the same mask on contiguous [1, H, total, E] copies, and the copies' cost
        mask = flexfa.varlen_block_mask(cu, causal=causal)
        copies = [t.detach().transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]
        guarded(rows, "copy_qkv_to_bhle", lambda: bench(
            lambda: [t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]))
        guarded(rows, "fwd_bhle", lambda: bench(inference(
            lambda: flexfa.flex_attention(*copies, block_mask=mask))), cost=5)
    return rows


def torch_rows(q, k, v, cu, causal: bool, bench, what: str,
               compiled_tables: bool = False) -> dict:
    """``what``: "tables", "fwd" (with the output) or "fwd_bwd"."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    tokens = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=q.device),
                                  cu.diff().to(q.device).long())

    def document(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    def tables():
        return create_block_mask(document, None, None, tokens, tokens, device=q.device)
    rows = {}
    if what == "tables":
        guarded(rows, "tables", lambda: bench(tables), cost=3)
        if compiled_tables:
            guarded(rows, "tables_compiled", lambda: bench(lambda: create_block_mask(
                document, None, None, tokens, tokens, device=q.device, _compile=True)), cost=60)
        return rows
    mask = tables()
    compiled = TORCH_COMPILED.setdefault("flex", torch.compile(flex_attention))
    views = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]

    def forward():
        return compiled(*views, block_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    if what == "fwd":
        guarded(rows, "fwd", lambda: bench(inference(forward)), cost=30)
        guarded(rows, "out", inference(forward))
    else:
        guarded(rows, "fwd_bwd", lambda: bench(fwd_bwd(forward, (q, k, v)),
                                               grad_to_none=[q, k, v]), cost=40)
    return rows


TORCH_COMPILED: dict = {}  # one compiled flex_attention for all rows


def flash_rows(q, k, v, cu, causal: bool, bench) -> dict:
    from flash_attn import flash_attn_varlen_func

    cu = cu.to(q.device)
    longest = int(cu.diff().max())

    def forward():
        return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)
    rows = {}
    guarded(rows, "fwd", lambda: bench(inference(forward)))
    guarded(rows, "fwd_bwd", lambda: bench(fwd_bwd(forward, (q, k, v)), grad_to_none=[q, k, v]))
    guarded(rows, "out", inference(forward))
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
    for name in ("tables", "tables_given_totals", "tables_only"):
        if isinstance(flexfa.get(name), float):
            out[f"{name}_target_met"] = flexfa[name] < 0.2
    return out


def profile_lines(rows: dict) -> list[str]:
    """One line per profiled call: its CUDA kernel launches and device copies."""
    profile = rows.get("tables_profile", {})
    if {"error", "skipped"} & set(profile):
        return [f"tables_profile: {profile}"]
    lines = []
    for call, found in profile.items():
        if isinstance(found, dict) and "kernels" in found:
            kernels = ", ".join(f"{n[:40]} x{c}" for n, c in found["kernels"].items())
            lines.append(f"{call}: {sum(found['kernels'].values())} kernels ({kernels}); "
                         f"{sum(found['copies'].values())} copies {found['copies']}")
    return lines


def table(mode: str, case: dict) -> str:
    """One line per row: its time (ms) for each peer that has it."""
    ran = [p for p in ("flexfa", "torch", "flash") if case.get(p)]
    peers = [p for p in ran if not {"error", "skipped"} & set(case[p])]
    names = list(dict.fromkeys(n for p in peers for n in case[p] if n != "tables_profile"))
    lines = [f"{mode:<20}" + "".join(f"{p:>12}" for p in peers)]
    lines += [f"{p}: {next(iter(case[p].values()))}" for p in ran if p not in peers]
    for name in names:
        cells = []
        for p in peers:
            value = case[p].get(name)
            cells.append(f"{value:12.3f}" if isinstance(value, float) else
                         f"{'-' if value is None else 'error' if 'error' in value else 'skip':>12}")
        lines.append(f"{name:<20}" + "".join(cells))
    return "\n".join(lines + profile_lines(case.get("flexfa", {})))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file for the results")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="causal", help="causal and/or full (comma list)")
    parser.add_argument("--budget", type=float, default=100.0,
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
    for mode in args.modes.split(","):
        causal = mode == "causal"
        case = results["modes"][mode] = {"flexfa": {}, "torch": {}, "flash": {}}
        mine = lambda what: flexfa_attention(q, k, v, cu, causal, bench, what)  # noqa: E731
        theirs = lambda what: torch_rows(q, k, v, cu, causal, bench, what,  # noqa: E731
                                         args.torch_compiled_tables)
        # the order the summary needs: tables, then fwd, then fwd_bwd, each peer in turn
        stages = [("flexfa", "tables", lambda: flexfa_tables(q, cu, causal, bench)),
                  ("torch", "tables", lambda: theirs("tables")),
                  ("flexfa", "fwd", lambda: mine("fwd")), ("torch", "fwd", lambda: theirs("fwd")),
                  ("flexfa", "fwd_bwd", lambda: mine("fwd_bwd")),
                  ("torch", "fwd_bwd", lambda: theirs("fwd_bwd")),
                  ("flexfa", "extras", lambda: mine("extras")),
                  ("flash", "all", lambda: flash_rows(q, k, v, cu, causal, bench))]
        for peer, name, stage in stages:
            part = {}
            guarded(part, name, stage)  # a stage that fails (an import) is one row
            rows = part[name]
            case[peer].update({f"{name}_stage": rows} if {"error", "skipped"} & set(rows)
                              else rows)
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
