"""Packed documents on the GPU: flexfa.varlen_attention against torch FlexAttention (document
mask_mod + create_block_mask + compiled flex_attention) and flash_attn_varlen_func, in one
process: table building, forward, forward+backward, causal and not.

Default case (issue 28): 16 documents of random lengths totalling 32768 tokens, H = 16,
E = 128, bf16. Targets: flexfa's tables < 0.2 ms; (tables + attention) >= 2x FlexAttention's.
Times are triton.testing.do_bench medians in ms. Rows:

- ``tables``: ``flexfa.varlen_block_mask`` from GPU offsets (checks with one sync included);
  ``tables_cpu_offsets``: from CPU offsets (checked on the host, no device sync);
  ``tables_only``: the table building after the checks;
- ``fwd`` / ``fwd_bwd``: ``varlen_attention`` with the batch's offsets tensor (its mask is kept
  per offsets tensor, as in the layers of one step); ``fwd_new_offsets``: a new offsets tensor
  on each call (checks, tables and plans each time: a step's first layer); ``fwd_bhle`` /
  ``fwd_bwd_bhle``: flex_attention with the same mask on contiguous ``[1, H, total, E]``
  copies (the layout the Hopper family reads; the packed views run the Ampere family) and
  ``copy_qkv_to_bhle`` the copies' time;
- torch: ``tables`` (create_block_mask), ``tables_compiled`` (``_compile=True``), ``fwd`` /
  ``fwd_bwd`` (compiled flex_attention); flash: ``fwd`` / ``fwd_bwd``.

Each peer is guarded: a failure is recorded and the rest still runs. Run under a time limit:

    timeout 900 python benchmarks/varlen_bench.py results.json [--tokens 32768 --docs 16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def offsets_of(tokens: int, docs: int, seed: int):
    import torch
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=generator)[:docs - 1] + 1
    return torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([tokens])]).int()


def guarded(results: dict, name: str, measure) -> None:
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
    rows = {"tables": bench(lambda: flexfa.varlen_block_mask(cu, causal=causal)),
            "tables_cpu_offsets": bench(lambda: flexfa.varlen_block_mask(
                cu_cpu, causal=causal, device=q.device)),
            "tables_only": bench(lambda: document_block_mask(offsets, causal, None, (128, 128)))}

    def forward():
        return flexfa.varlen_attention(q, k, v, cu, cu, causal=causal)
    rows["fwd"] = bench(inference(forward))
    rows["fwd_new_offsets"] = bench(inference(
        lambda: flexfa.varlen_attention(q, k, v, cu.clone(), cu.clone(), causal=causal)))
    guarded(rows, "fwd_bwd", lambda: bench(fwd_bwd(forward, (q, k, v)), grad_to_none=[q, k, v]))
    rows["out"] = inference(forward)()
    # the same mask on contiguous [1, H, total, E] copies: the layout the Hopper family (tensor
    # descriptors) reads, which the packed [total, H, E] views are not; and the copies' cost
    mask = flexfa.varlen_block_mask(cu, causal=causal)
    copies = [t.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
              for t in (q, k, v)]
    rows["copy_qkv_to_bhle"] = bench(
        lambda: [t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)])

    def on_copies():
        return flexfa.flex_attention(*copies, block_mask=mask)
    guarded(rows, "fwd_bhle", lambda: bench(inference(on_copies)))
    guarded(rows, "fwd_bwd_bhle", lambda: bench(fwd_bwd(on_copies, copies),
                                                grad_to_none=copies))
    return rows


def torch_rows(q, k, v, cu, causal: bool, bench) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    tokens = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=q.device),
                                  cu.diff().to(q.device).long())

    def document(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same
    rows = {"tables": bench(lambda: create_block_mask(document, None, None, tokens, tokens,
                                                      device=q.device))}
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
    rows = {"fwd": bench(inference(forward)),
            "fwd_bwd": bench(fwd_bwd(forward, (q, k, v)), grad_to_none=[q, k, v])}
    rows["out"] = inference(forward)()
    return rows


def summary(case: dict) -> dict:
    """The issue's sums and ratios: (tables + fwd) and (tables + fwd_bwd), flexfa vs torch."""
    flexfa, torch_ = case.get("flexfa", {}), case.get("torch", {})
    out = {}
    for what in ("fwd", "fwd_bwd"):
        try:
            mine = flexfa["tables"] + flexfa[what]
            theirs = torch_["tables"] + torch_[what]
            out[f"tables+{what}"] = {"flexfa": mine, "torch": theirs,
                                     "speedup": theirs / mine, "target_met": theirs / mine >= 2}
        except (KeyError, TypeError):
            pass
    if isinstance(flexfa.get("tables"), float):
        out["tables_target_met"] = flexfa["tables"] < 0.2
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file for the results")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="causal,full", help="causal and/or full (comma list)")
    args = parser.parse_args(argv)

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
    peers = {"flexfa": flexfa_rows, "torch": torch_rows, "flash": flash_rows}
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
        print(f"{mode}: " + json.dumps({n: r for n, r in case.items()}, indent=1))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
