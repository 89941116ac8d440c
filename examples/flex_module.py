"""A ``torch.nn.Module`` around flexfa: multi-head self-attention with a pluggable variant.

    attn = FlexAttention(dim=64, num_heads=4, mask_mod=flexfa.mods.causal)
    y = attn(x)                      # x: [batch, seq_len, dim]

The module owns the q/k/v and output projections; the variant is a ``score_mod`` and/or a
``mask_mod`` (given once, or per call when it changes per batch, as document masks do).
Block masks are built once per (mask_mod, length, device) and reused.

Run it: ``python examples/flex_module.py`` (CUDA if present, else the CPU interpreter).
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import flexfa
from flexfa import mods


class FlexAttention(nn.Module):
    """Multi-head self-attention run by ``flexfa.flex_attention``."""

    def __init__(self, dim: int, num_heads: int, score_mod=None, mask_mod=None,
                 block_size: int = 128):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not a multiple of num_heads {num_heads}")
        self.dim, self.num_heads, self.block_size = dim, num_heads, block_size
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self._block_masks: dict = {}

    def block_mask(self, mask_mod, seq_len: int, device):
        """The block mask of ``mask_mod`` at this length, built on first use."""
        key = (id(mask_mod), seq_len, str(device))
        if key not in self._block_masks:
            self._block_masks = {key: flexfa.create_block_mask(
                mask_mod, None, None, seq_len, seq_len, device=device,
                BLOCK_SIZE=self.block_size)}  # keep only the newest: masks change per batch
        return self._block_masks[key]

    def forward(self, x: torch.Tensor, score_mod=None, mask_mod=None) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        head_dim = self.dim // self.num_heads
        q, k, v = (self.qkv(x).view(batch, seq_len, 3, self.num_heads, head_dim)
                   .permute(2, 0, 3, 1, 4))  # each [batch, heads, seq_len, head_dim], strided
        mask_mod = mask_mod or self.mask_mod
        block_mask = self.block_mask(mask_mod, seq_len, x.device) if mask_mod else None
        out = flexfa.flex_attention(q, k, v, score_mod=score_mod or self.score_mod,
                                    block_mask=block_mask)
        return self.out(out.transpose(1, 2).reshape(batch, seq_len, self.dim))

    def extra_repr(self) -> str:
        def name(mod):
            return getattr(mod, "__name__", repr(mod)) if mod is not None else None
        return (f"dim={self.dim}, num_heads={self.num_heads}, score_mod={name(self.score_mod)}, "
                f"mask_mod={name(self.mask_mod)}, block_size={self.block_size}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="run the FlexAttention module once")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seq_len = args.seq_len or (2048 if device == "cuda" else 100)
    torch.manual_seed(0)
    attn = FlexAttention(args.dim, args.heads, score_mod=mods.softcap(30.0),
                         mask_mod=mods.sliding_window(seq_len // 4),
                         block_size=128 if device == "cuda" else 32).to(device)
    print(attn)
    x = torch.randn(2, seq_len, args.dim, device=device, requires_grad=True)
    y = attn(x)
    y.square().mean().backward()
    print(f"output {tuple(y.shape)}, grad of the input {tuple(x.grad.shape)}, "
          f"qkv weight grad norm {attn.qkv.weight.grad.norm():.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
