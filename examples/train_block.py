"""Train a small transformer block with flexfa: packed documents and a learnable bias.

Each batch packs several documents into one sequence (``flexfa.mods.document`` and-ed with
``causal``: tokens see only earlier tokens of their own document) and the attention adds a
learnable per-head relative-position bias (``flexfa.mods.relative_bias``) whose gradient
flexfa's backward computes. The toy task is next-token prediction on documents that repeat
a random pattern of period 2, so the model has to learn to look two tokens back, which the
bias makes easy. A new document layout every step gives a new block mask but the same
kernels: captured tensors are kernel arguments, not part of the cache key's values.

Run it: ``python examples/train_block.py`` (a few steps on CPU, more on a GPU).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import flexfa
from flexfa import mods

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling flex_module.py
from flex_module import FlexAttention  # noqa: E402


class Block(nn.Module):
    """Embedding, one pre-norm attention + MLP block, and an output head."""

    def __init__(self, vocab: int, dim: int, heads: int, max_len: int, block_size: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = FlexAttention(dim, heads, block_size=block_size)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)
        # bias[h, (q - kv) + max_len - 1], learned; zero at the start
        self.rel_bias = nn.Parameter(torch.zeros(heads, 2 * max_len - 1))
        self.score_mod = mods.relative_bias(self.rel_bias)

    def forward(self, tokens, mask_mod):
        x = self.embed(tokens)
        x = x + self.attn(self.norm1(x), score_mod=self.score_mod, mask_mod=mask_mod)
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def sample_batch(seq_len: int, vocab: int, generator):
    """One packed sequence: documents of random length, each repeating two random tokens."""
    lengths, total = [], 0
    while total < seq_len:
        length = min(int(torch.randint(8, 40, (1,), generator=generator)), seq_len - total)
        lengths.append(length)
        total += length
    pieces = []
    for length in lengths:
        pair = torch.randint(0, vocab, (2,), generator=generator)
        pieces.append(pair.repeat(length // 2 + 1)[:length])
    return torch.cat(pieces).unsqueeze(0), lengths


def train(steps: int, seq_len: int, device, dim=32, heads=2, vocab=16, block_size=128, lr=1e-2,
          seed=0, log_every=1):
    """Train; returns (model, list of losses)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = Block(vocab, dim, heads, seq_len, block_size).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens, lengths = sample_batch(seq_len, vocab, generator)
        tokens = tokens.to(device)
        mask_mod = flexfa.and_masks(mods.document(lengths, device=device), mods.causal)
        logits = model(tokens[:, :-1], mask_mod)
        starts = torch.zeros(seq_len, dtype=torch.bool)  # no target across a document start
        starts[torch.tensor(lengths).cumsum(0)[:-1]] = True
        target = tokens[:, 1:].masked_fill(starts[1:].to(device).unsqueeze(0), -100)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(),
                                           ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  documents {len(lengths)}  "
                  f"bias grad norm {model.rel_bias.grad.norm():.2e}")
    return model, losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seq-len", type=int)
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    steps = args.steps or (300 if on_gpu else 10)
    seq_len = args.seq_len or (1024 if on_gpu else 96)
    print(f"training on {device}: {steps} steps, sequences of {seq_len} tokens")
    _, losses = train(steps, seq_len + 1, device, block_size=128 if on_gpu else 64,
                      log_every=max(steps // 10, 1))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if steps < 50:
        print("(a few steps show the mechanics; the loss falls clearly after 20-50 steps: "
              "--steps 50)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
