"""Check, with the torch installed, that mods of an ``nn.Module`` compile whole with flexfa.

Cases: ``self.alibi`` / ``self.near`` (bound methods reading a parameter and Python
attributes, the block mask built inside ``forward``), and an ``nn.Module`` that is itself the
score_mod with a bound-method mask_mod whose block mask is built outside. For each, under
``torch.compile(fullgraph=True)``: ``torch._dynamo.explain`` reports no graph break; the output
and the gradients (the module's parameters' included) equal eager flexfa's; after a Python
attribute or a parameter changes, they still do. Prints a table; exit status 0 when every check
passes; ``--json PATH`` writes the rows, torch's version and the device::

    timeout 900 python examples/compile_probe.py --device cuda --json probe.json
    python examples/compile_probe.py --device cpu
"""
from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch
from torch import nn

import flexfa


class WindowedAlibi(nn.Module):
    """Attention with a learnable per-head slope (``self.alibi``) and a sliding window of
    ``self.window`` (``self.near``), both bound methods."""

    def __init__(self, heads: int, window: int, block_size: int):
        super().__init__()
        self.slopes = nn.Parameter(torch.linspace(0.05, 0.2, heads))
        self.scale, self.window, self.block_size = 1.0, window, block_size

    def alibi(self, score, b, h, q_idx, kv_idx):
        return score * self.scale - self.slopes[h] * (q_idx - kv_idx).abs()

    def near(self, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= self.window

    def forward(self, q, k, v):
        mask = flexfa.create_block_mask(self.near, None, None, q.shape[2], k.shape[2],
                                        device=q.device, BLOCK_SIZE=self.block_size)
        return torch.tanh(flexfa.flex_attention(q, k, v, self.alibi, mask))


class HeadBias(nn.Module):
    """A score_mod that is an nn.Module: a learnable bias per head times the distance."""

    def __init__(self, heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-0.1, 0.1, heads))

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.weight[h] * (q_idx - kv_idx)


class Documents(nn.Module):
    """Holds document ids; ``self.same_document`` is a bound-method mask_mod."""

    def __init__(self, doc_ids: torch.Tensor):
        super().__init__()
        self.register_buffer("doc_ids", doc_ids)

    def same_document(self, b, h, q_idx, kv_idx):
        return (self.doc_ids[q_idx] == self.doc_ids[kv_idx]) & (kv_idx <= q_idx)


def step(fn, inputs, params) -> tuple:
    """(output, gradients of ``inputs`` and ``params``) of one forward and backward."""
    for t in (*inputs, *params):
        t.grad = None
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    return out.detach().float(), [t.grad.float() for t in (*inputs, *params)]


def difference(got, want) -> float:
    """The largest difference of outputs and gradients, relative to the largest magnitude of
    each (at least 1): a slope's gradient sums over every score."""
    pairs = [(got[0], want[0]), *zip(got[1], want[1])]
    return max(float((g - w).abs().max() / max(1.0, float(w.abs().max()))) for g, w in pairs)


def bound_methods(heads: int, length: int, device, block_size: int) -> tuple:
    """(name, model, its parameter, a change of what it reads) of the bound-method case."""
    model = WindowedAlibi(heads, length // 4, block_size).to(device)

    def change():
        model.window, model.scale = length // 2, 0.5
    return "bound methods (self.alibi, self.near)", model, model.slopes, change


def module_mod(heads: int, length: int, device, block_size: int) -> tuple:
    """(name, model, its parameter, a change of what it reads) of the nn.Module case."""
    bias = HeadBias(heads).to(device)
    documents = Documents(torch.arange(length, device=device) * 3 // length)
    mask = flexfa.create_block_mask(documents.same_document, 1, None, length, length,
                                    device=device, BLOCK_SIZE=block_size)

    def layer(q, k, v):
        return torch.tanh(flexfa.flex_attention(q, k, v, bias, mask))

    def change():
        with torch.no_grad():
            bias.weight.mul_(-3.0)
    return "nn.Module score_mod, bound-method mask_mod", layer, bias.weight, change


def probe(case, heads, length, dim, device, dtype, backend, tolerance) -> list:
    """Rows (case, check, passed, detail) of one case."""
    block_size = 128 if device.type == "cuda" else 32  # the GPU kernels' tiles
    name, model, param, change = case(heads, length, device, block_size)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, heads, length, dim, generator=generator).to(device, dtype)
              .requires_grad_() for _ in range(3)]
    rows = []
    try:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(*inputs)
        reasons = "; ".join(str(r.reason)[:200] for r in explained.break_reasons)
        rows.append((name, "graph breaks", explained.graph_break_count == 0,
                     f"{explained.graph_break_count} breaks, {explained.graph_count} graphs "
                     f"{reasons}".strip()))
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        for check in ("equal to eager", "after a change"):
            if check == "after a change":
                before = step(model, inputs, [param])[0]
                change()
            got, want = step(compiled, inputs, [param]), step(model, inputs, [param])
            error = difference(got, want)
            moved = check == "equal to eager" or float((want[0] - before).abs().max()) > 1e-3
            has_grad = float(want[1][-1].abs().sum()) > 0
            rows.append((name, check, error <= tolerance and moved and has_grad,
                         f"max |compiled - eager| / max |eager| {error:.1e}"
                         + ("" if has_grad else ", the parameter got no gradient")
                         + ("" if moved else ", the change did not change eager's output")))
    except Exception as error:  # a row that says what failed; the traceback to stderr
        traceback.print_exc()
        message = " ".join(f"{type(error).__name__}: {error}".split())  # one line
        rows.append((name, "compiles", False, message[:600]))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", help="torch.compile backend (default: inductor on "
                        "CUDA, aot_eager on the CPU)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    backend = args.backend or ("inductor" if cuda else "aot_eager")
    heads, length, dim = (4, 1000, 64) if cuda else (2, 100, 16)
    tolerance = 2e-2 if dtype == torch.bfloat16 else (1e-3 if cuda else 1e-4)
    rows = []
    for case in (bound_methods, module_mod):
        rows += probe(case, heads, length, dim, device, dtype, backend, tolerance)
    print(f"torch {torch.__version__}, {device}, {args.dtype}, backend {backend}")
    for name, check, passed, detail in rows:
        print(f"{'PASS' if passed else 'FAIL'}  {name:<44} {check:<15} {detail}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"torch": torch.__version__, "device": str(device), "dtype": args.dtype,
                       "backend": backend, "rows": [dict(zip(("case", "check", "passed",
                                                              "detail"), r)) for r in rows]},
                      file, indent=1)
    return 0 if rows and all(r[2] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
