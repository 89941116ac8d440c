"""A varlen BlockMask's tables and per-token tensors from two Triton kernel launches.

``kernel_tables(offsets, causal, window, block)`` returns what the torch path of
``varlen.py`` builds (the ``TokenTensors`` and the eight ordered tables), equal entry by entry,
from ``varlen_kernels.py``: ``varlen_rows`` (the kv-side tables, a dense class grid and the
per-token tensors) then ``varlen_columns`` (the q-side tables from the grid). Nothing per
document on the host: the offsets' totals and document count are all the launches need.
CUDA offsets take it (about 90 small torch launches otherwise); CPU offsets keep the torch
path, and tests run the kernels through the interpreter.

Device offsets are checked by the kernels too, with one device-to-host read of their flags,
totals and longest documents: inside ``varlen_rows`` when the call gives the totals
(``checked_kernel_tables``: two launches in all), else by ``varlen_check`` before the tables,
whose shapes need the totals (``device_offsets``: three). Each call makes one allocation
(two with ``varlen_check``), cut into all its outputs by a layout kept per shapes.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..loader import INTERPRETER_LOCK, load_module
from ..memo import BoundedMemo
from .checks import on_device
from .offsets import (PAD_DOC_Q, PAD_DOC_K, Offsets, TokenTensors, padded_length,
                      raise_bad_offsets, window_reach)

KERNELS = Path(__file__).with_name("varlen_kernels.py")
CHUNK = 64  # kv tiles (q tiles) one program classifies at a time
TOKENS = 1024  # per-token entries a program writes
ALIGN = 32  # int32 entries: 128 bytes
STATS = 3  # per offsets tensor: flags, last entry, longest document (varlen_kernels._check)
_MODULES: dict[bool, object] = {}


def kernels(interpret: bool):
    """``varlen_kernels.py`` imported with Triton's interpreter (``interpret``) or compiled
    (``loader.load_module``: interpreted launches hold ``INTERPRETER_LOCK``, as every other
    kernel's; the interpreter's program ids are process-wide)."""
    module = _MODULES.get(interpret)
    if module is None:
        with INTERPRETER_LOCK:  # (one module per mode, whichever thread loads it first)
            module = _MODULES.get(interpret)
            if module is None:
                name = f"flexfa_varlen_kernels_{'interp' if interpret else 'jit'}"
                module = _MODULES[interpret] = load_module(KERNELS, interpret, name)
    return module


def kernel_tables(offsets: Offsets, causal: bool, window: int | None,
                  block: tuple[int, int]) -> tuple[TokenTensors, list]:
    """(per-token tensors, the eight tables ``[1, 1, ...]``) of checked ``offsets``."""
    _, tokens, tables = _launch(offsets.cu_q, offsets.cu_k, offsets.total_q, offsets.total_k,
                                causal, window, block, check=False)
    return tokens, tables


def checked_kernel_tables(func: str, cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int,
                          causal: bool, window: int | None, block: tuple[int, int]
                          ) -> tuple[Offsets, TokenTensors, list]:
    """(``Offsets``, per-token tensors, tables) of the caller's device offsets of the given
    totals, checked in the table kernel (``CHECK``) and read back once (the one device sync);
    bad offsets raise their InputError here, before the tables are used."""
    checks, tokens, tables = _launch(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                                     total_q, total_k, causal, window, block, check=True)
    return _read(func, checks, cu_seqlens_q, cu_seqlens_k, total_q, total_k), tokens, tables


def device_offsets(func: str, cu_seqlens_q, cu_seqlens_k, total_q: int | None,
                   total_k: int | None) -> Offsets:
    """``Offsets`` of the caller's device offsets checked by one ``varlen_check`` launch and
    one read (the totals, which the tables' shapes need, are among what it reads)."""
    cu_q, cu_k, device = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), cu_seqlens_q.device
    documents = cu_q.numel() - 1
    stats, copy_q, copy_k = _allocate(((2 * STATS,), (documents + 1,), (documents + 1,)), device)
    with on_device(device):
        launch(kernels(device.type != "cuda").varlen_check, 2, (
            cu_q, cu_k, documents, _given(total_q), _given(total_k), stats, copy_q, copy_k),
            {"CHUNK": TOKENS}, (cu_q, cu_k), device)
    return _read(func, (stats, copy_q, copy_k), cu_seqlens_q, cu_seqlens_k, total_q, total_k)


def _read(func: str, checks, cu_seqlens_q, cu_seqlens_k, total_q, total_k) -> Offsets:
    """The checked ``Offsets`` from the device checks' outputs (stats, int32 copies of the
    offsets): the one device sync of a call."""
    stats, copy_q, copy_k = checks
    flags_q, last_q, longest_q, flags_k, last_k, longest_k = stats.tolist()
    if flags_q or flags_k:
        raise_bad_offsets(func, cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    return Offsets(copy_q, copy_k, last_q, last_k, longest_q, longest_k)


def _given(total: int | None) -> int:
    return -1 if total is None else total  # the kernels' "any total"


def _launch(cu_q, cu_k, total_q: int, total_k: int, causal: bool, window: int | None,
            block: tuple[int, int], check: bool):
    """Launch ``varlen_rows`` (with ``check``: also the offsets' checks) and
    ``varlen_columns``; return ((stats, int32 copies of the offsets) or None, tokens, tables)."""
    block_q, block_kv = block
    device = cu_q.device
    documents = cu_q.numel() - 1
    q_tiles, kv_tiles = -(-total_q // block_q), -(-total_k // block_kv)
    q_length, k_length = padded_length(total_q), padded_length(total_k)
    shapes = _table_shapes(q_tiles, kv_tiles, q_length, k_length)
    if check:
        shapes += ((2 * STATS,), (documents + 1,), (documents + 1,))
    parts = _allocate(shapes, device)
    tables, classes, tokens = parts[:8], parts[8], TokenTensors(*parts[9:14])
    checks = parts[14:] if check else (classes,) * 3  # unread without check
    grid = q_tiles + -(-q_length // TOKENS) + -(-k_length // TOKENS) + (2 if check else 0)
    module = kernels(device.type != "cuda")
    constexprs = {"BLOCK_Q": block_q, "BLOCK_KV": block_kv, "ROWS": _power_of_two(block_q),
                  "CHUNK": CHUNK, "TOKENS": TOKENS, "CAUSAL": causal,
                  "WINDOW": window is not None, "PAD_DOC_Q": PAD_DOC_Q, "PAD_DOC_K": PAD_DOC_K,
                  "CHECK": check}
    with on_device(device):
        launch(module.varlen_rows, grid, (
            cu_q, cu_k, documents, documents.bit_length(), total_q, total_k,
            window_reach(window, total_q, total_k) or 1,
            *tables[:4], classes, q_tiles, kv_tiles, tokens.doc_q, tokens.pos_q, tokens.diag,
            q_length, tokens.doc_k, tokens.pos_k, k_length, *checks), constexprs,
            (cu_q, cu_k), device)
        launch(module.varlen_columns, kv_tiles, (classes, *tables[4:], q_tiles, kv_tiles),
               {"CHUNK": CHUNK}, (), device)
    return (checks if check else None), tokens, tables


def _table_shapes(q_tiles: int, kv_tiles: int, q_length: int, k_length: int) -> tuple:
    """The shapes of the eight tables, the class grid and the five token tensors."""
    return ((1, 1, q_tiles), (1, 1, q_tiles, kv_tiles)) * 2 + \
        ((1, 1, kv_tiles), (1, 1, kv_tiles, q_tiles)) * 2 + ((q_tiles, kv_tiles),) + \
        ((q_length,), (k_length,), (q_length,), (k_length,), (q_length,))


# shapes -> (int32 entries, (shape, strides, offset) of each part): computed once per shapes
_LAYOUTS = BoundedMemo(256, "varlen table layouts")


def _allocate(shapes: tuple, device: torch.device) -> list:
    """Contiguous int32 tensors of ``shapes`` cut from one allocation, each 128-byte aligned:
    Triton specializes on pointer alignment, and new lengths must not compile new kernels."""
    layout = _LAYOUTS.get(shapes)
    if layout is None:
        parts, entries = [], 0
        for shape in shapes:
            strides = [1] * len(shape)
            for dim in range(len(shape) - 2, -1, -1):
                strides[dim] = strides[dim + 1] * shape[dim + 1]
            parts.append((shape, tuple(strides), entries))
            entries += -(-math.prod(shape) // ALIGN) * ALIGN
        layout = _LAYOUTS[shapes] = (entries, tuple(parts))
    entries, parts = layout
    buffer = torch.empty(entries, dtype=torch.int32, device=device)
    return [buffer.as_strided(shape, strides, offset) for shape, strides, offset in parts]


# (kernel, device index, constexprs, the offsets' dtypes and 16-byte alignment, Triton's debug
# and instrumentation settings) -> (its compiled kernel, the constexprs in parameter order)
_COMPILED = BoundedMemo(64, "varlen compiled kernels")


def launch(kernel, grid: int, args: tuple, constexprs: dict, offsets: tuple,
           device: torch.device) -> None:
    """``kernel[(grid,)](*args, **constexprs)``; on CUDA, after the first launch of a key, its
    compiled kernel directly: Triton's per-call binding and specialization cost tens of
    microseconds on the H200's host (``docs/performance.md``), and the key fixes everything
    they decide here: the constexprs, and the dtype and 16-byte alignment of the ``offsets``
    tensors (the caller's, or their checked copies; the other pointers are 128-byte aligned
    int32 parts of one allocation; every int is in the kernels' ``do_not_specialize``). With
    launch hooks set (a profiler's) Triton launches."""
    if device.type != "cuda":
        kernel[(grid,)](*args, **constexprs)
        return
    import triton  # here: importing flexfa loads no Triton (tests/compile/test_compile_ops.py)

    runtime = triton.knobs.runtime
    key = (kernel, device.index, *constexprs.values(), runtime.debug,
           triton.knobs.compilation.instrumentation_mode,
           *((t.dtype, t.data_ptr() % 16 == 0) for t in offsets))
    found = _COMPILED.get(key)
    if found is None or not (_unset(runtime.launch_enter_hook) and
                             _unset(runtime.launch_exit_hook)):
        compiled = kernel[(grid,)](*args, **constexprs)
        names = kernel.arg_names[len(args):]
        assert sorted(names) == sorted(constexprs), (names, constexprs)
        _COMPILED[key] = (compiled, tuple(constexprs[name] for name in names))
        return
    compiled, tail = found
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None,
                 None, *args, *tail)


def _unset(hook) -> bool:
    """No launch hook: None or (Triton 3.6) an empty HookChain."""
    return hook is None or getattr(hook, "calls", None) == []


def _power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
