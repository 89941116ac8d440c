"""Train a small transformer with flexfa inside ``torch.compile(model, fullgraph=True)``.

The model packs documents into one sequence: a document mask (``and``-ed with causal) built
with ``flexfa.create_block_mask`` outside the compiled region, and in every layer a learnable
ALiBi-like bias (one slope per head, a parameter the score_mod reads). The same model and
batches are trained eagerly and compiled; the script prints both losses per step and their
difference (they agree to float noise: the compiled graph runs the same flexfa kernels).

CPU (default): a tiny model, backend ``aot_eager`` (``--inductor`` for Inductor's C++ backend).
GPU (``--cuda``): the issue's size (4 layers, d_model 1024, 16 heads, S=4096, bf16, AdamW at
3e-4: 3e-3 diverges there within three steps, after which eager and compiled losses part by
chaos, not by error), Inductor, and the same model with torch's FlexAttention compiled; step
times are medians over the steps after the first two (the first compiles; the second is where
Dynamo recompiles if a guard failed), with the graphs each variant compiled::

    python examples/compiled_transformer.py --cuda --json results.json

``--cudagraphs`` adds both libraries compiled with ``mode="reduce-overhead"`` (CUDA graphs:
the step's kernels replay without the host; a new mask's tables are copied into the graphs'
inputs each step). ``--frozen-slopes`` takes the slopes' gradient away (on both libraries),
to see the model's cost without a gradient into a captured tensor.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import copy
import json
import pstats
import statistics
import time
import traceback
import warnings

import torch
from torch import nn

import flexfa


class Attention(nn.Module):
    """Multi-head attention whose score_mod is a learnable per-head slope times distance."""

    def __init__(self, dim: int, heads: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.slopes = nn.Parameter(torch.linspace(0.02, 0.3, heads))

    def alibi(self, score, b, h, q_idx, kv_idx):
        return score - self.slopes[h] * (q_idx - kv_idx).abs()

    def forward(self, x, block_mask):
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = self.attend(q, k, v, score_mod=self.alibi, block_mask=block_mask)
        return self.out(y.transpose(1, 2).reshape(batch, length, dim))


class Transformer(nn.Module):
    """Embedding, pre-norm attention + MLP layers, an output head."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, attend):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.attention = nn.ModuleList(Attention(dim, heads, attend) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim),
                                               nn.GELU(), nn.Linear(4 * dim, dim))
                                 for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))

    def forward(self, tokens, block_mask):
        x = self.embed(tokens)
        for norm, attention, mlp in zip(self.norms, self.attention, self.mlp):
            x = x + attention(norm(x), block_mask)
            x = x + mlp(x)
        return self.head(x)


def document_causal(doc_ids: torch.Tensor):
    """mask_mod: same document and not in the future (closes over ``doc_ids``)."""
    def document_causal(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (kv_idx <= q_idx)
    return document_causal


def batches(steps: int, length: int, vocab: int, device, seed: int = 0) -> list:
    """(tokens, doc_ids) per step: random documents, each repeating a pair of tokens."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(length // 8, length // 2, (16,), generator=generator)
        doc_ids = torch.repeat_interleave(torch.arange(16), lengths)[:length + 1]
        pairs = torch.randint(0, vocab, (16, 2), generator=generator)
        position = torch.arange(length + 1) - torch.searchsorted(
            doc_ids, doc_ids, right=False)
        tokens = pairs[doc_ids, position % 2]
        out.append((tokens.to(device), doc_ids.to(device)))
    return out


@contextlib.contextmanager
def watched(on: bool, syncs: list, profile: bool):
    """Count the device syncs in the block (CUDA's sync debug mode warns at each) into
    ``syncs``; with ``profile``, print where each sync came from, torch.profiler's busiest
    host and device ops and cProfile's functions of most own time."""
    if not on:
        yield
        return
    profiler = torch.profiler.profile() if profile else contextlib.nullcontext()
    python = cProfile.Profile() if profile else contextlib.nullcontext()
    seen = []
    torch.cuda.set_sync_debug_mode("warn")  # (its own first-use warning is not a sync)
    try:
        with warnings.catch_warnings(), profiler, python:
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *_: seen.append(
                (str(message), traceback.format_stack(limit=14)[:-1]))
            yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    seen = [stack for message, stack in seen if "synchroniz" in message]
    syncs.append(len(seen))
    if profile:
        for number, stack in enumerate(seen):
            print(f"-- sync {number + 1} of {len(seen)}:\n" + "".join(stack[-8:]))
        for key in ("self_cpu_time_total", "self_cuda_time_total"):
            print(profiler.key_averages().table(sort_by=key, row_limit=12))
        pstats.Stats(python).sort_stats("tottime").print_stats(30)


def train(model, data, make_mask, block_size: int, lr: float, profile: bool = False,
          graphs: bool = False) -> tuple:
    """Train on ``data``; returns (losses, seconds per step, device syncs in the steady
    step that is watched: the third, on a GPU, seconds per step until all is enqueued).
    ``graphs``: the model replays CUDA graphs (each step is marked as a new one)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, seconds, syncs, host = [], [], [], []
    length = data[0][0].numel() - 1
    doc_ids = torch.empty_like(data[0][1][:length])  # one mask_mod: new contents, no recompile
    mask_mod = document_causal(doc_ids)
    for step, (tokens, new_doc_ids) in enumerate(data):
        doc_ids.copy_(new_doc_ids[:length])
        mask = make_mask(mask_mod, 1, None, length, length, device=tokens.device,
                         BLOCK_SIZE=block_size)
        start = time.perf_counter()
        with watched(step == 2 and tokens.is_cuda, syncs, profile):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            logits = model(tokens[None, :-1], mask)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        host.append(time.perf_counter() - start)  # the host's part: all enqueued
        losses.append(loss.item())  # synchronizes
        seconds.append(time.perf_counter() - start)
    return losses, seconds, syncs[0] if syncs else None, host


def run(steps=3, length=64, vocab=32, dim=32, heads=2, layers=2, block_size=32,
        device="cpu", dtype=torch.float32, backend="aot_eager", with_torch=False,
        lr=3e-3, frozen_slopes=False, profile=False, cudagraphs=False) -> dict:
    """Train the same model eagerly and compiled (and with torch's FlexAttention compiled
    when ``with_torch``; both also with mode="reduce-overhead" when ``cudagraphs``); returns {variant: (losses, seconds per step, syncs in the watched
    step or None, host seconds per step, graphs compiled)}."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = Transformer(vocab, dim, heads, layers, flexfa.flex_attention).to(device, dtype)
    if frozen_slopes:  # no gradient into a captured tensor: the attention kernels alone
        for attention in model.attention:
            attention.slopes.requires_grad_(False)
    data = batches(steps, length, vocab, device)
    results = {"flexfa eager": (*train(copy.deepcopy(model), data, flexfa.create_block_mask,
                                       block_size, lr, profile), 0)}

    def compiled(name, model, make_mask, mode=None):
        torch._dynamo.reset()
        graphs = counters["stats"]["unique_graphs"]
        model = torch.compile(model, backend=backend, fullgraph=True, mode=mode)
        results[name] = (*train(model, data, make_mask, block_size, lr, profile,
                                graphs=mode is not None),
                         counters["stats"]["unique_graphs"] - graphs)

    theirs = None
    if with_torch:
        from torch.nn.attention import flex_attention as torch_fa
        theirs = copy.deepcopy(model)
        for attention in theirs.attention:
            attention.attend = torch_fa.flex_attention
    for mode, suffix in ((None, "compiled"), ("reduce-overhead", "+ CUDA graphs")):
        if mode is None or cudagraphs:
            compiled(f"flexfa {suffix}", copy.deepcopy(model), flexfa.create_block_mask, mode)
            if theirs is not None:
                compiled(f"torch {suffix}", copy.deepcopy(theirs), torch_fa.create_block_mask,
                         mode)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cuda", action="store_true", help="the issue's size on a GPU, "
                        "Inductor, and torch's FlexAttention compiled for comparison")
    parser.add_argument("--inductor", action="store_true", help="Inductor on CPU")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--frozen-slopes", action="store_true",
                        help="slopes without gradients (what the model costs without a "
                             "learnable bias's gradient, on both libraries)")
    parser.add_argument("--profile", action="store_true", help="print the third step's "
                        "syncs with their stacks, torch.profiler's busiest ops and cProfile's "
                        "30 functions of most own time, per variant (GPU)")
    parser.add_argument("--cudagraphs", action="store_true", help="both libraries also "
                        "compiled with mode='reduce-overhead' (CUDA graphs; GPU)")
    parser.add_argument("--json", help="write the losses and step times here")
    args = parser.parse_args(argv)
    if args.cuda:
        results = run(steps=args.steps or 12, length=4096, vocab=256, dim=1024, heads=16,
                      layers=4, block_size=128, device="cuda", dtype=torch.bfloat16,
                      backend="inductor", with_torch=True, lr=3e-4,
                      frozen_slopes=args.frozen_slopes, profile=args.profile,
                      cudagraphs=args.cudagraphs)
    else:
        results = run(steps=args.steps or 3, backend="inductor" if args.inductor else "aot_eager",
                      frozen_slopes=args.frozen_slopes)
    names = list(results)
    print("step  " + "  ".join(f"{n:>20}" for n in names) + "  compiled - eager")
    eager, compiled = results["flexfa eager"][0], results["flexfa compiled"][0]
    for step in range(len(eager)):
        losses = "  ".join(f"{results[n][0][step]:>20.5f}" for n in names)
        print(f"{step:4d}  {losses}  {compiled[step] - eager[step]:+.2e}")
    steady = 2 if len(eager) > 2 else 1  # the first step compiles, the second may recompile
    if len(eager) > steady:
        print(f"median seconds per step from step {steady}: " + ", ".join(
            f"{n} {statistics.median(results[n][1][steady:]):.4f}" for n in names))
        print("  of which the host enqueues (median): " + ", ".join(
            f"{n} {statistics.median(results[n][3][steady:]):.4f}" for n in names))
    print("graphs compiled: " + ", ".join(f"{n} {results[n][4]}" for n in names[1:]))
    if results[names[0]][2] is not None:
        print("device syncs in step 2 (before the loss is read): " + ", ".join(
            f"{n} {results[n][2]}" for n in names))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({n: {"losses": l, "seconds": s, "syncs": y, "host_seconds": h,
                           "graphs": g} for n, (l, s, y, h, g) in results.items()}, file,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
