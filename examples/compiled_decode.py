"""Decode one token per step with the transformer of ``compiled_transformer.py``, eagerly,
under ``torch.compile(fullgraph=True)`` and, on a GPU, with CUDA graphs (``mode=
"reduce-overhead"``), where a step replays with no Python dispatch per layer.

Each layer has a static KV cache ``[B, H, max_len, E]`` (a buffer); the position of each
sequence is a device tensor (``pos`` [B], a buffer the step advances), so a new position
changes tensor contents, not the graph. A step writes the new key and value at ``pos`` on the
device and attends from its one query row, in one of two ways (both the decode family):

- ``flexfa.flex_attention`` over the whole cache, with a block mask that lists every key block
  as partial (``position_mask``): its mask_mod reads ``pos`` and decides every key, so one
  mask serves every position and is never rebuilt; the learnable ALiBi score_mod measures
  distance from ``pos`` too (``q_idx`` is 0 for the single query row);
- ``flexfa.flex_decode`` with ``kv_lens = pos + 1``: the walk stops at the position, and the
  training score_mod applies unchanged (the row is at ``q_idx = pos``).

The script decodes the same tokens with each variant from an empty cache, checks that the
logits equal flex_attention's eager ones, and prints tokens per second and flexfa's kernel
launches from Python per timed step (``count_launches``: every flexfa kernel leaves Python
through ``runtime.launch.Step.launch``): eager and compiled launch per layer, a replayed CUDA
graph launches nothing from Python.

    python examples/compiled_decode.py                  # tiny, CPU, backend aot_eager
    python examples/compiled_decode.py --cuda --json decode.json   # 4 layers, d 1024, 16 heads
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
from torch import nn

import flexfa
from flexfa.runtime import launch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled_transformer import Transformer  # noqa: E402  the model decoded here


def position_mask(mask_mod, max_len: int, block: int, device) -> flexfa.BlockMask:
    """A block mask over (1 query row, ``max_len`` keys) whose every key block is partial, so
    ``mask_mod`` decides every key: valid for every position without being rebuilt (a mask
    built for one position would hold full blocks, where the mask_mod is not applied)."""
    blocks = -(-max_len // block)
    counts = torch.full((1, 1, 1), blocks, dtype=torch.int32, device=device)
    indices = torch.arange(blocks, dtype=torch.int32, device=device).view(1, 1, 1, blocks)
    return flexfa.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=block, mask_mod=mask_mod,
                                           seq_lengths=(1, max_len))


class CachedAttention(nn.Module):
    """One layer's attention while decoding: the trained layer's projections and slopes, a
    static KV cache, and the position tensor shared by all layers."""

    def __init__(self, attention, batch: int, max_len: int, pos: torch.Tensor, block_mask):
        super().__init__()
        self.attention, self.block_mask = attention, block_mask  # None: flex_decode
        dim = attention.out.in_features
        shape = (batch, attention.heads, max_len, dim // attention.heads)
        weight = attention.out.weight
        self.register_buffer("k_cache", weight.new_zeros(shape), persistent=False)
        self.register_buffer("v_cache", weight.new_zeros(shape), persistent=False)
        self.register_buffer("pos", pos, persistent=False)

    def alibi(self, score, b, h, q_idx, kv_idx):
        """The training score_mod with the query at ``pos[b]`` (its one row has q_idx 0)."""
        return score - self.attention.slopes[h] * (self.pos[b] - kv_idx).abs()

    def forward(self, x):
        batch, _, dim = x.shape
        q, k, v = self.attention.qkv(x).view(batch, 1, 3, self.attention.heads, -1).permute(
            2, 0, 3, 1, 4)
        rows = torch.arange(batch, device=x.device)
        self.k_cache[rows, :, self.pos] = k[:, :, 0]  # on the device: no host sync
        self.v_cache[rows, :, self.pos] = v[:, :, 0]
        if self.block_mask is None:  # keys up to kv_lens only; the query row at q_idx = pos
            y = flexfa.flex_decode(q, self.k_cache, self.v_cache, self.attention.alibi,
                                   kv_lens=(self.pos + 1).to(torch.int32), validate=False)
        else:
            y = flexfa.flex_attention(q, self.k_cache, self.v_cache, score_mod=self.alibi,
                                      block_mask=self.block_mask)
        return self.attention.out(y.transpose(1, 2).reshape(batch, 1, dim))


class Decoder(nn.Module):
    """``step(tokens [B]) -> logits [B, vocab]`` of ``model`` at each sequence's position,
    which it then advances. Attention is ``flex_attention`` with ``position_mask`` or, with
    ``lengths``, ``flex_decode`` with ``kv_lens = pos + 1`` (its walk stops at the position;
    the training score_mod applies as it is, the query row being at q_idx = pos)."""

    def __init__(self, model: Transformer, batch: int, max_len: int, block: int = 128,
                 lengths: bool = False):
        super().__init__()
        self.model = model
        device = model.head.weight.device
        self.register_buffer("pos", torch.zeros(batch, dtype=torch.int64, device=device),
                             persistent=False)
        self.block_mask = None if lengths else position_mask(self.causal, max_len, block,
                                                             device)
        self.layers = nn.ModuleList(CachedAttention(a, batch, max_len, self.pos,
                                                    self.block_mask) for a in model.attention)

    def causal(self, b, h, q_idx, kv_idx):
        """mask_mod: the keys up to the sequence's position."""
        return kv_idx <= self.pos[b]

    def forward(self, tokens):
        model = self.model
        x = model.embed(tokens)[:, None]
        for norm, attention, mlp in zip(model.norms, self.layers, model.mlp):
            x = x + attention(norm(x))
            x = x + mlp(x)
        self.pos += 1
        return model.head(x[:, 0])

    def reset(self) -> None:
        """Empty caches, position 0 (in place: a compiled step keeps its graphs)."""
        self.pos.zero_()
        for layer in self.layers:
            layer.k_cache.zero_()
            layer.v_cache.zero_()

    def static_tensors(self) -> list:
        """The tensors a step reads and writes in place: fixed addresses for CUDA graphs."""
        mask = self.block_mask
        tables = [] if mask is None else [
            t for t in (mask.kv_num_blocks, mask.kv_indices, mask.q_num_blocks, mask.q_indices)
            if t is not None]
        return [self.pos, *tables, *(t for layer in self.layers
                                     for t in (layer.k_cache, layer.v_cache))]


@contextlib.contextmanager
def count_launches():
    """{"launches": n}: flexfa kernel launches from Python while active (every flexfa kernel
    leaves Python through ``Step.launch``; a replayed CUDA graph does not enter it)."""
    counts = {"launches": 0}
    original = launch.Step.launch

    def counted(self, args, device, grid=None):
        counts["launches"] += 1
        return original(self, args, device, grid)

    launch.Step.launch = counted
    try:
        yield counts
    finally:
        launch.Step.launch = original


def decode(step, decoder: Decoder, tokens: torch.Tensor, warmup: int, cuda_graphs: bool) -> dict:
    """Run ``step`` over ``tokens`` [B, steps] from an empty cache: the logits of every step,
    tokens per second and flexfa launches per step over the steps after ``warmup``."""
    decoder.reset()
    cuda = tokens.is_cuda
    logits, start, timed = [], None, tokens.shape[1] - warmup
    with torch.no_grad(), count_launches() as counts:
        for i in range(tokens.shape[1]):
            if i == warmup:
                if cuda:
                    torch.cuda.synchronize()
                counts["launches"], start = 0, time.perf_counter()
            if cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the last outputs were cloned
            logits.append(step(tokens[:, i]).clone())
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"logits": torch.stack(logits), "tokens_per_s": tokens.shape[0] * timed / seconds,
            "launches_per_step": counts["launches"] / timed}


def run(steps=4, warmup=2, batch=2, max_len=64, vocab=32, dim=32, heads=2, layers=2, block=32,
        device="cpu", dtype=torch.float32, backend="aot_eager", cuda_graphs=False) -> dict:
    """{variant: decode's result, plus the graphs compiled and Inductor's CUDA-graph skips}
    for eager, compiled and (with ``cuda_graphs``) compiled with CUDA graphs, with either
    attention (``Decoder``), on the same model and tokens."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = Transformer(vocab, dim, heads, layers, flexfa.flex_attention).to(device, dtype)
    tokens = torch.randint(0, vocab, (batch, steps), device=device)
    results = {}
    for attend in ("flex_attention", "flex_decode"):
        decoder = Decoder(model, batch, max_len, block, lengths=attend == "flex_decode")
        results[f"{attend} eager"] = decode(decoder, decoder, tokens, warmup, False)
        variants = [("compiled", {"backend": backend})]
        if cuda_graphs:
            variants.append(("+ CUDA graphs", {"backend": backend, "mode": "reduce-overhead"}))
            for tensor in decoder.static_tensors():
                torch._dynamo.mark_static_address(tensor)
        for name, options in variants:
            torch._dynamo.reset()
            graphs = counters["stats"]["unique_graphs"]
            skips = counters["inductor"]["cudagraph_skips"]  # graphs run without CUDA graphs
            step = torch.compile(decoder, fullgraph=True, **options)
            result = decode(step, decoder, tokens, warmup, "mode" in options)
            result["graphs"] = counters["stats"]["unique_graphs"] - graphs
            result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
            results[f"{attend} {name}"] = result
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda", action="store_true", help="the issue's model size on a GPU "
                        "(bf16, Inductor), with CUDA graphs")
    parser.add_argument("--steps", type=int, help="tokens decoded per variant")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--json", help="write tokens/s, launches and logit differences here")
    args = parser.parse_args(argv)
    if args.cuda:
        results = run(steps=args.steps or 64, warmup=8, batch=args.batch or 1, max_len=4096,
                      vocab=256, dim=1024, heads=16, layers=4, block=128, device="cuda",
                      dtype=torch.bfloat16, backend="inductor", cuda_graphs=True)
        tolerance = 5e-2  # bf16, Inductor's fusions against eager kernels, times max |logit|
    else:
        results = run(steps=args.steps or 4, batch=args.batch or 2)
        tolerance = 1e-5
    eager = results["flex_attention eager"]["logits"].float()
    tolerance *= max(1.0, eager.abs().max().item())
    print(f"{'variant':30} {'tokens/s':>10} {'flexfa launches/step':>21} "
          f"{'max |logits - eager|':>21} {'graphs':>6}")
    summary = {}
    for name, result in results.items():
        diff = (result["logits"].float() - eager).abs().max().item()
        summary[name] = {"tokens_per_s": result["tokens_per_s"], "max_abs_diff": diff,
                         "launches_per_step": result["launches_per_step"],
                         "graphs": result.get("graphs", 0), "equal": diff <= tolerance,
                         "cudagraph_skips": result.get("cudagraph_skips", 0)}
        print(f"{name:30} {result['tokens_per_s']:10.1f} {result['launches_per_step']:21.1f} "
              f"{diff:21.2e} {summary[name]['graphs']:6d}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(summary, file, indent=1)
    replayed = [row for name, row in summary.items() if name.endswith("CUDA graphs")]
    return 0 if all(row["equal"] for row in summary.values()) and \
        all(row["launches_per_step"] == 0 for row in replayed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
