"""A varlen BlockMask's tables and per-token tensors from two Triton kernel launches.

``kernel_tables(offsets, causal, window, block)`` returns what the torch path of
``varlen.py`` builds (the ``TokenTensors`` and the eight ordered tables), equal entry by entry,
from ``varlen_kernels.py``: ``varlen_rows`` (the kv-side tables, a dense class grid and the
per-token tensors) then ``varlen_columns`` (the q-side tables from the grid). No host sync
and nothing per document on the host: the offsets' checked totals and document count are
all the launches need. CUDA offsets take it (about 90 small torch launches otherwise); CPU
offsets keep the torch path, and tests run the kernels through the interpreter.
"""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

from .. import config
from .offsets import PAD_DOC_Q, PAD_DOC_K, Offsets, TokenTensors, padded_length

KERNELS = Path(__file__).with_name("varlen_kernels.py")
CHUNK = 64  # kv tiles (q tiles) one program classifies at a time
TOKENS = 1024  # per-token entries a program writes
ALIGN = 32  # int32 entries: 128 bytes
_MODULES: dict[bool, object] = {}


def kernels(interpret: bool):
    """``varlen_kernels.py`` imported with Triton's interpreter (``interpret``) or compiled."""
    module = _MODULES.get(interpret)
    if module is None:
        name = f"flexfa_varlen_kernels_{'interp' if interpret else 'jit'}"
        spec = importlib.util.spec_from_file_location(name, KERNELS)
        module = importlib.util.module_from_spec(spec)
        with config.interpret_mode(interpret):  # Triton reads it at decoration time
            spec.loader.exec_module(module)
        sys.modules[name] = module  # compiled kernels look their module up by name
        _MODULES[interpret] = module
    return module


def kernel_tables(offsets: Offsets, causal: bool, window: int | None,
                  block: tuple[int, int]) -> tuple[TokenTensors, list]:
    """(per-token tensors, the eight tables ``[1, 1, ...]``) of checked ``offsets``."""
    block_q, block_kv = block
    device = offsets.device
    q_tiles, kv_tiles = -(-offsets.total_q // block_q), -(-offsets.total_k // block_kv)
    q_length, k_length = padded_length(offsets.total_q), padded_length(offsets.total_k)

    # one allocation, cut into the tables, the class grid and the token tensors
    sizes = [(1, 1, q_tiles), (1, 1, q_tiles, kv_tiles)] * 2 + \
        [(1, 1, kv_tiles), (1, 1, kv_tiles, q_tiles)] * 2 + [(q_tiles, kv_tiles)] + \
        [(q_length,), (k_length,), (q_length,), (k_length,), (q_length,)]
    # each part 128-byte aligned: Triton specializes on pointer alignment, and new lengths
    # must not compile new kernels
    counts = [-(-math.prod(shape) // ALIGN) * ALIGN for shape in sizes]
    buffer = torch.empty(sum(counts), dtype=torch.int32, device=device)
    parts = [part[:math.prod(shape)].view(shape)
             for part, shape in zip(buffer.split(counts), sizes)]
    tables, classes, tokens = parts[:8], parts[8], TokenTensors(*parts[9:])
    documents = offsets.documents
    module = kernels(device.type != "cuda")
    grid = q_tiles + -(-q_length // TOKENS) + -(-k_length // TOKENS)
    module.varlen_rows[(grid,)](
        offsets.cu_q, offsets.cu_k, documents, documents.bit_length(), offsets.total_q,
        offsets.total_k, window or 1, *tables[:4], classes, q_tiles, kv_tiles,
        tokens.doc_q, tokens.pos_q, tokens.diag, q_length, tokens.doc_k, tokens.pos_k,
        k_length, BLOCK_Q=block_q, BLOCK_KV=block_kv, ROWS=_power_of_two(block_q), CHUNK=CHUNK,
        TOKENS=TOKENS, CAUSAL=causal, WINDOW=window is not None, PAD_DOC_Q=PAD_DOC_Q,
        PAD_DOC_K=PAD_DOC_K)
    module.varlen_columns[(kv_tiles,)](classes, *tables[4:], q_tiles, kv_tiles, CHUNK=CHUNK)
    return tokens, tables


def _power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
