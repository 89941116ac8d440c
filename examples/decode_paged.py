"""Token generation with a paged KV cache: a few transformer layers with random weights, GQA,
a sliding window and a soft cap, decoded one token at a time through ``flexfa.flex_decode``
(one ``flexfa.PagedKVCache`` per layer), with and without a CUDA graph of the whole step.

    python examples/decode_paged.py                 # tiny, on the CPU (Triton's interpreter)
    python examples/decode_paged.py --device cuda --batch 1 --layers 4 --steps 64
"""
from __future__ import annotations

import argparse
import time

import torch

import flexfa
from flexfa import mods


class Model(torch.nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, kv_heads: int, vocab: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.ModuleList(
            torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
            for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False)
                                        for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)


def make_step(model, caches, block_mask, cap: float, workspaces):
    """One decode step of a batch: tokens [B] -> next tokens [B]; appends each layer's new
    key and value at position kv_lens[b] of its cache, then attends over the cache (the
    query at that position: the window's block mask is in absolute positions)."""
    score_mod = mods.softcap(cap)

    def step(tokens):
        B = tokens.shape[0]
        x = model.embed(tokens)[:, None]  # [B, 1, dim]
        batch = torch.arange(B, device=tokens.device)
        for layer, cache in enumerate(caches):
            qkv = model.qkv[layer](x).view(B, 1, -1, model.head_dim).transpose(1, 2)
            q, k, v = qkv.split([model.heads, model.kv_heads, model.kv_heads], dim=1)
            cache.assign(batch, cache.kv_lens[:B, None].long(), k, v, validate=False)
            cache.kv_lens[:B] += 1
            out = cache.attend(q, score_mod, block_mask, workspace=workspaces[layer],
                               validate=False)
            x = x + model.proj[layer](out.transpose(1, 2).reshape(B, 1, -1))
        return model.head(x[:, 0]).argmax(-1)
    return step


def generate(device="cpu", batch=2, layers=2, dim=64, heads=4, kv_heads=2, vocab=97,
             prompt=20, steps=4, page_size=16, window=32, cap=30.0, cuda_graph=False,
             seed=0):
    """(tokens [batch, steps], tokens per second)."""
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Model(layers, dim, heads, kv_heads, vocab).to(device, dtype)
    pages = -(-(prompt + steps + 1) // page_size)  # per sequence
    total = pages * page_size
    caches = []
    for _ in range(layers):
        cache = flexfa.PagedKVCache(batch * pages, page_size, batch, kv_heads, dim // heads,
                                    max_pages_per_seq=pages, dtype=dtype, device=device)
        prefix = [torch.randn(batch, kv_heads, prompt, dim // heads, device=device, dtype=dtype)
                  for _ in range(2)]
        cache.append(*prefix)  # a prompt's keys and values, as a prefill would leave them
        for b in range(batch):
            cache.reserve(b, total)  # every page up front: a captured step allocates nothing
        caches.append(cache)
    workspaces = [flexfa.DecodeWorkspace() for _ in range(layers)]
    block_mask = flexfa.create_block_mask(mods.sliding_window(window), None, None, total, total,
                                          device=device, BLOCK_SIZE=page_size)
    step = make_step(model, caches, block_mask, cap, workspaces)
    tokens = torch.zeros(batch, dtype=torch.long, device=device)
    generated = []
    with torch.no_grad():
        tokens = step(tokens)  # warm-up: compiles the kernels and fills the workspaces
        generated.append(tokens)
        run = step
        if cuda_graph:
            static = tokens.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = step(static)

            def run(tokens):
                static.copy_(tokens)
                graph.replay()
                return static_out.clone()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps - 1):
            tokens = run(tokens)
            generated.append(tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return torch.stack(generated, 1), batch * (steps - 1) / max(elapsed, 1e-9)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    kwargs = dict(device=args.device, batch=args.batch, layers=args.layers, dim=args.dim,
                  heads=args.heads, kv_heads=args.kv_heads, prompt=args.prompt, steps=args.steps)
    tokens, rate = generate(**kwargs)
    print(f"eager:      {rate:10.1f} tokens/s  first tokens {tokens[0, :8].tolist()}")
    if args.device == "cuda":
        graph_tokens, graph_rate = generate(cuda_graph=True, **kwargs)
        same = torch.equal(tokens, graph_tokens)
        print(f"cuda graph: {graph_rate:10.1f} tokens/s  ({graph_rate / rate:.2f}x; same tokens: "
              f"{same})")


if __name__ == "__main__":
    main()
