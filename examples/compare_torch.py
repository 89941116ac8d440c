"""flexfa next to torch's FlexAttention: the same mods, the same inputs, both outputs.

For each variant (from ``flexfa.mods``) both libraries build their block mask and run forward
and backward; the script prints the largest difference of the outputs and of the gradients
and each side's time (torch has no CPU backward, so on the CPU only outputs are compared,
while flexfa still runs its backward). On a GPU torch's ``flex_attention`` is wrapped in ``torch.compile`` (its
fast path); on the CPU both run eagerly at a small size (torch unfused, flexfa through the
Triton interpreter), so CPU times say nothing about GPU speed.

Run it: ``python examples/compare_torch.py``.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch.nn.attention import flex_attention as torch_fa

import flexfa
from flexfa import mods


def variants(seq_len: int, heads: int, device):
    """(name, score_mod, mask_mod) triples, all from flexfa.mods."""
    third = seq_len // 3
    documents = mods.document([third, third, seq_len - 2 * third], device=device)
    return [
        ("causal", None, mods.causal),
        ("sliding window", None, mods.sliding_window(seq_len // 4)),
        ("alibi + causal", mods.alibi(heads, device=device), mods.causal),
        ("softcap", mods.softcap(20.0), None),
        ("documents + causal", None, flexfa.and_masks(documents, mods.causal)),
        ("prefix lm", None, mods.prefix_lm(seq_len // 8)),
    ]


def timed(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| / max |theirs|: comparable across outputs and gradients."""
    scale = theirs.float().abs().max().clamp_min(1e-12)
    return ((ours.float() - theirs.float()).abs().max() / scale).item()


def forward_backward(attention, block_mask_fn, q, k, v, grad_out, score_mod, mask_mod, seq_len,
                     backward=True):
    """Build the block mask, run forward (and backward); (out, dq, dk, dv) or (out,)."""
    block_mask = block_mask_fn(mask_mod, None, None, seq_len, seq_len, device=q.device) \
        if mask_mod is not None else None
    if not backward:
        q, k, v = (t.detach() for t in (q, k, v))
    out = attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out)) if backward else (out,)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seq_len = args.seq_len or (4096 if device == "cuda" else 128)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch_attention = torch.compile(torch_fa.flex_attention) if device == "cuda" \
        else torch_fa.flex_attention
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
    torch.manual_seed(0)
    shape = (1, args.heads, seq_len, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    print(f"{device}, {dtype}, B=1 H={args.heads} L=S={seq_len} E={args.head_dim}")
    print(f"{'variant':<20} {'out rel diff':>15} {'grad rel diff':>16} "
          f"{'torch s':>8} {'flexfa s':>9}")
    worst = 0.0
    for name, score_mod, mask_mod in variants(seq_len, args.heads, device):
        theirs, torch_s = timed(lambda: forward_backward(
            torch_attention, torch_fa.create_block_mask, q, k, v, grad_out, score_mod, mask_mod,
            seq_len, backward=device == "cuda"), device)  # torch has no CPU backward
        ours, flexfa_s = timed(lambda: forward_backward(
            flexfa.flex_attention, flexfa.create_block_mask, q, k, v, grad_out, score_mod,
            mask_mod, seq_len), device)
        diffs = [relative_difference(a, b) for a, b in zip(ours, theirs)]
        worst = max(worst, *diffs)
        grad_diff = f"{max(diffs[1:]):.2e}" if len(diffs) > 1 else "n/a on CPU"
        print(f"{name:<20} {diffs[0]:>15.2e} {grad_diff:>16} {torch_s:>8.3f} {flexfa_s:>9.3f}")
    tolerance = 3e-2 if dtype is torch.bfloat16 else 1e-4
    print(f"largest relative difference {worst:.2e}, tolerance {tolerance:.0e} "
          "(times of first calls include compilation on both sides)")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
