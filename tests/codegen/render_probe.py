"""Run rendered IR in a tiny Triton kernel (under the interpreter) on a grid of index values."""
from __future__ import annotations

import hashlib

import torch

from flexfa.codegen.render import Leaves, buffer_args, needs_tile_broadcast, render
from flexfa.codegen.template import load_template
from flexfa.frontend.ir import DType, Node
from flexfa.loader import load_module

_KERNEL = '''
import triton
import triton.language as tl

{helpers}


@triton.jit
def probe(SCORE, Q, KV, OUT, off_b, off_h{params}, M: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, M)
    cols = tl.arange(0, N)
    q_idx = tl.load(Q + rows)[:, None]
    kv_idx = tl.load(KV + cols)[None, :]
    score = tl.load(SCORE + rows[:, None] * N + cols[None, :])
{code}
    value = {value}
    tl.store(OUT + rows[:, None] * N + cols[None, :], {stored})
'''
# INT results are stored as int64 (tl.store converts an int32 value), so int64 kernels show
# their full values
_OUT_DTYPE = {DType.FLOAT: torch.float32, DType.INT: torch.int64, DType.BOOL: torch.int32}


def probe_source(root: Node, buffers: tuple[torch.Tensor, ...], wide=(),
                 fast_math: bool = False) -> str:
    args = [buffer_args(i, t.dim()) for i, t in enumerate(buffers)]
    rendered = render([root], Leaves(), args, wide=wide, fast_math=fast_math)
    params = "".join(", " + p for a in args for p in a.params)
    value = rendered.values[0]
    if needs_tile_broadcast(root):
        zero = {DType.FLOAT: "0.0", DType.INT: "0", DType.BOOL: "0"}[root.dtype]
        value = f"tl.full([M, N], {zero}, {_tl_type(root.dtype)}) + ({value})"
        if root.dtype is DType.BOOL:
            value = f"({value}) != 0"
    stored = "value.to(tl.int32)" if root.dtype is DType.BOOL else "value"
    return _KERNEL.format(helpers=load_template("helpers.tmpl"), params=params,
                          code=rendered.code("    "), value=value, stored=stored)


def _tl_type(dtype: DType) -> str:
    return {DType.FLOAT: "tl.float32", DType.INT: "tl.int32", DType.BOOL: "tl.int32"}[dtype]


def run_probe(root: Node, tmp_path, *, score, b: int, h: int, q_idx, kv_idx,
              buffers: tuple[torch.Tensor, ...] = (), wide=(), fast_math: bool = False,
              device: str = "cpu") -> torch.Tensor:
    """The rendered value of ``root`` on the [len(q_idx), len(kv_idx)] grid, on the CPU
    (interpreter) or compiled for ``device`` "cuda"; returned on the CPU. ``wide``: keys of
    the INT nodes rendered in int64; ``fast_math``: the GPU kernels' transcendentals
    (``render``'s arguments)."""
    source = probe_source(root, buffers, wide, fast_math)
    path = tmp_path / f"probe_{hashlib.sha256(source.encode()).hexdigest()[:12]}.py"
    path.write_text(source)
    module = load_module(path, interpret=device == "cpu")
    M, N = len(q_idx), len(kv_idx)
    out = torch.empty(M, N, dtype=_OUT_DTYPE[root.dtype], device=device)
    buffer_values = []
    for t in buffers:
        buffer_values += [t.to(device), *t.stride(), *t.shape]
    module.probe[(1,)](score.float().contiguous().to(device), q_idx.to(device, torch.int32),
                       kv_idx.to(device, torch.int32), out, b, h, *buffer_values, M=M, N=N)
    out = out.cpu()
    return out.bool() if root.dtype is DType.BOOL else out
