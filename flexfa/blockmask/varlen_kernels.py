"""Triton kernels writing a varlen BlockMask's tables and per-token tensors from the offsets.

Loaded by ``varlen_tables.py`` as a file (compiled for CUDA offsets, interpreted for CPU ones
in tests), never imported as a package module: Triton decides at decoration time which of
the two a ``@triton.jit`` function is.

``varlen_rows`` (grid: q tiles + token blocks): a q-tile program finds its rows' documents
by binary search in the offsets, each row's kept keys ``[lo, hi)`` (the rules of
``varlen.py``'s ``_key_ranges``), classifies the kv tiles in chunks (computed where a row's
range meets the tile; full where every row keeps the whole tile) and writes its ordered
rows of ``kv_*`` / ``full_kv_*`` and of a dense class grid; a token-block program writes
``doc_*`` / ``pos_*`` / ``diag``. ``varlen_columns`` (grid: kv tiles) orders one column of
the class grid into the q-side tables. An ordered row lists the set tiles ascending, then
the others ascending, as ``tables.dense_to_ordered`` does: two passes, a count then the
writes at ``rank`` (set) or ``count + column - rank`` (others).

The offsets' checks run on the device too (``_check``: one program per offsets tensor, which
also writes its int32 copy): in ``varlen_check`` before the tables when the totals are not
known, or as ``varlen_rows``' last two programs (``CHECK``) when they are, reading the
caller's offsets as given (int32 or int64; the tables' code reads them as int32, which only
unchecked offsets past int32 would change). The host reads the flags once and raises before
the tables are used; unchecked offsets only ever index inside them (binary searches stay in
``0..documents``) and every store stays inside its table, so garbage offsets give garbage
tables, never a bad access.
"""
import triton
import triton.language as tl



# Only Triton builtins and this file's functions: triton.language's own @jit functions
# (tl.sum, tl.max, tl.cumsum, tl.zeros_like, tl.cdiv) are decorated once, interpreted or
# compiled, when triton.language is imported, so calling them would tie these kernels to that
# mode. Reductions and the scan take this file's combine functions when compiled; the
# interpreter recognizes the standard library's by identity and runs them as numpy reductions.
@triton.jit
def _add2(a, b):
    return a + b


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


if triton.knobs.runtime.interpret:
    _sum_combine, _max_combine = tl.standard._sum_combine, tl.standard._elementwise_max
    _min_combine = tl.standard._elementwise_min
else:
    _sum_combine, _max_combine, _min_combine = _add2, _max2, _min2

PARTIAL_TILE = tl.constexpr(1)  # the class grid's values (0: empty)
FULL_TILE = tl.constexpr(2)
# ``_check``'s flags (bits); any of them set, the host checks the offsets again to name the
# entry and the values (``offsets.raise_bad_offsets``)
NEGATIVE, NONZERO_START, DECREASING = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4)
WRONG_TOTAL, NO_TOKENS, PAST_INT32 = tl.constexpr(8), tl.constexpr(16), tl.constexpr(32)
INT32_MAX = tl.constexpr(2 ** 31 - 1)
STATS = tl.constexpr(3)  # per offsets tensor: flags, last entry, longest document


@triton.jit
def _check(cu, documents, total, stats, copy, CHUNK: tl.constexpr):
    """Check offsets ``cu`` (``documents + 1`` entries, int32 or int64; ``total`` < 0: any
    total), write their int32 copy and ``stats``: [flags, last entry, longest document] (the
    last two clamped to int32; meaningful where flags are 0)."""
    smallest = tl.load(cu).to(tl.int64)
    steepest_drop = smallest * 0
    longest = smallest * 0
    for start in range(0, documents + 1, CHUNK):
        index = start + tl.arange(0, CHUNK)
        value = tl.load(cu + index, mask=index <= documents, other=0).to(tl.int64)
        step = tl.load(cu + index + 1, mask=index < documents, other=0).to(tl.int64) - value
        step = tl.where(index < documents, step, 0)
        smallest = tl.minimum(smallest, tl.reduce(value, 0, _min_combine))
        steepest_drop = tl.minimum(steepest_drop, tl.reduce(step, 0, _min_combine))
        longest = tl.maximum(longest, tl.reduce(step, 0, _max_combine))
        tl.store(copy + index, value.to(tl.int32), mask=index <= documents)
    first = tl.load(cu).to(tl.int64)
    last = tl.load(cu + documents).to(tl.int64)
    flags = tl.where(smallest < 0, NEGATIVE, 0) | tl.where(first != 0, NONZERO_START, 0) | \
        tl.where(steepest_drop < 0, DECREASING, 0) | \
        tl.where((total >= 0) & (last != total), WRONG_TOTAL, 0) | \
        tl.where(last == 0, NO_TOKENS, 0) | tl.where(last > INT32_MAX, PAST_INT32, 0)
    tl.store(stats, flags.to(tl.int32))
    tl.store(stats + 1, tl.minimum(tl.maximum(last, 0), INT32_MAX).to(tl.int32))
    tl.store(stats + 2, tl.minimum(tl.maximum(longest, 0), INT32_MAX).to(tl.int32))


@triton.jit
def _check_pair(which, cu_q, cu_k, documents, total_q, total_k, stats, copy_q, copy_k,
                CHUNK: tl.constexpr):
    """Program ``which`` (0: queries, 1: keys) of the offsets' checks."""
    if which == 0:
        _check(cu_q, documents, total_q, stats, copy_q, CHUNK)
    else:
        _check(cu_k, documents, total_k, stats + STATS, copy_k, CHUNK)


@triton.jit
def _documents(cu, positions, documents, steps):
    """Per position, how many of cu[1..documents] are <= it (``searchsorted(cu[1:],
    positions, right=True)``): ``steps`` >= bit length of ``documents`` bisection steps."""
    low = positions * 0
    high = low + documents
    for _ in range(steps):
        active = low < high
        mid = (low + high) // 2
        value = tl.load(cu + 1 + mid, mask=active, other=0).to(tl.int32)
        right = active & (value <= positions)
        low = tl.where(right, mid + 1, low)
        high = tl.where(active & (value > positions), mid, high)
    return low


@triton.jit
def _rows(cu_q, cu_k, positions, documents, steps, total_q, window, CAUSAL: tl.constexpr,
          WINDOW: tl.constexpr):
    """(document (``documents`` past total_q), kept keys lo, hi (hi == lo past total_q), the
    key index of the diagonal (document 0's shift past total_q)) of query ``positions``."""
    doc = _documents(cu_q, positions, documents, steps)
    inside = positions < total_q
    # (clamped: unchecked offsets whose last entry is short of total_q would give rows
    # past it the document one past the last)
    own = tl.minimum(tl.where(inside, doc, 0), documents - 1)
    key_start = tl.load(cu_k + own).to(tl.int32)
    key_end = tl.load(cu_k + own + 1).to(tl.int32)
    # documents aligned at their ends
    diag = positions + key_end - tl.load(cu_q + own + 1).to(tl.int32)
    lo = key_start
    hi = key_end
    if CAUSAL:
        hi = tl.minimum(hi, diag + 1)
    if WINDOW:
        lo = tl.maximum(lo, diag - (window - 1))
        if not CAUSAL:
            hi = tl.minimum(hi, diag + window)
    return doc, lo, tl.where(inside, hi, lo), diag


@triton.jit
def _write_ordered(indices, cols, valid, flags, count, before):
    """Store ``cols`` at their places in an ordered row of ``count`` set entries (``before``
    set ones precede this chunk); return the new ``before``."""
    set_before = before + tl.associative_scan(flags, 0, _sum_combine) - flags
    place = tl.where(flags != 0, set_before, count + cols - set_before)
    tl.store(indices + place, cols, mask=valid)
    return before + tl.reduce(flags, 0, _sum_combine)


@triton.jit
def _tally(partial, full, partials, fulls):
    return (partials + tl.reduce(partial, 0, _sum_combine),
            fulls + tl.reduce(full, 0, _sum_combine))


@triton.jit
def _column_classes(classes, rows, col, q_tiles, kv_tiles):
    """(partial, full) int32 flags of q tiles ``rows`` in column ``col`` of the class grid."""
    tile = tl.load(classes + rows.to(tl.int64) * kv_tiles + col, mask=rows < q_tiles, other=0)
    return (tile == PARTIAL_TILE).to(tl.int32), (tile == FULL_TILE).to(tl.int32)


@triton.jit
def _kv_classes(cols, kept, first, past, latest_lo, earliest_hi, total_k,
                BLOCK_KV: tl.constexpr):
    """(partial, full) int32 flags of kv tiles ``cols`` for a q tile's rows."""
    hit = kept[:, None] & (first[:, None] <= cols[None, :]) & (cols[None, :] < past[:, None])
    start = cols * BLOCK_KV
    # only tiles that exist: unchecked offsets (CHECK) may give ranges past the keys
    computed = (tl.reduce(hit.to(tl.int32), 0, _max_combine) > 0) & (start < total_k)
    full = computed & (latest_lo <= start) & (earliest_hi >= start + BLOCK_KV) & \
        (start + BLOCK_KV <= total_k)
    return (computed & ~full).to(tl.int32), full.to(tl.int32)


@triton.jit
def _classes(cols, source, FROM_GRID: tl.constexpr, BLOCK_KV: tl.constexpr):
    if FROM_GRID:
        classes, col, q_tiles, kv_tiles = source
        return _column_classes(classes, cols, col, q_tiles, kv_tiles)
    else:
        kept, first, past, latest_lo, earliest_hi, total_k = source
        return _kv_classes(cols, kept, first, past, latest_lo, earliest_hi, total_k, BLOCK_KV)


@triton.jit
def _ordered_rows(num, idx, full_num, full_idx, classes, slot, width, source,
                  FROM_GRID: tl.constexpr, BLOCK_KV: tl.constexpr, CHUNK: tl.constexpr):
    """Row ``slot`` (``width`` entries) of a (partial, full) pair of ordered tables from the
    flags ``_classes`` gives for ``source``: the class grid's column (``FROM_GRID``) or a q
    tile's rows (which also writes the grid's row)."""
    partials = 0
    fulls = 0
    for start in range(0, width, CHUNK):
        partial, full = _classes(start + tl.arange(0, CHUNK), source, FROM_GRID, BLOCK_KV)
        partials, fulls = _tally(partial, full, partials, fulls)
    tl.store(num + slot, partials)
    tl.store(full_num + slot, fulls)
    row = slot.to(tl.int64) * width
    partial_before = 0
    full_before = 0
    for start in range(0, width, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        valid = cols < width
        partial, full = _classes(cols, source, FROM_GRID, BLOCK_KV)
        partial_before = _write_ordered(idx + row, cols, valid, partial, partials,
                                        partial_before)
        full_before = _write_ordered(full_idx + row, cols, valid, full, fulls, full_before)
        if not FROM_GRID:
            tl.store(classes + row + cols, partial * PARTIAL_TILE + full * FULL_TILE,
                     mask=valid)


@triton.jit
def _kv_row(tile, cu_q, cu_k, documents, steps, total_q, total_k, window, kv_num, kv_idx,
            full_num, full_idx, classes, kv_tiles, BLOCK_Q: tl.constexpr,
            BLOCK_KV: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
            CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    offs = tl.arange(0, ROWS)
    in_tile = offs < BLOCK_Q
    _, lo, hi, _ = _rows(cu_q, cu_k, tile * BLOCK_Q + offs, documents, steps, total_q, window,
                         CAUSAL, WINDOW)
    kept = in_tile & (lo < hi)
    first = lo // BLOCK_KV
    past = tl.where(kept, (hi - 1) // BLOCK_KV + 1, 0)
    # a tile is full only if every row keeps all of it: an empty row (lo >= hi) never does
    latest_lo = tl.reduce(tl.where(in_tile, tl.where(kept, lo, total_k), 0), 0, _max_combine)
    earliest_hi = tl.reduce(tl.where(in_tile, hi, total_k), 0, _min_combine)
    _ordered_rows(kv_num, kv_idx, full_num, full_idx, classes, tile, kv_tiles,
                  (kept, first, past, latest_lo, earliest_hi, total_k), False, BLOCK_KV, CHUNK)


@triton.jit
def _tokens(block, cu, documents, steps, total, length, pad_doc, doc_out, pos_out,
            TOKENS: tl.constexpr):
    """doc / position inside it of packed tokens ``block * TOKENS ...`` (``pad_doc`` / 0 past
    ``total``); return (positions, in range)."""
    positions = block * TOKENS + tl.arange(0, TOKENS)
    valid = positions < length
    doc = _documents(cu, positions, documents, steps)
    inside = positions < total
    doc_start = tl.load(cu + tl.minimum(doc, documents - 1)).to(tl.int32)
    tl.store(doc_out + positions, tl.where(inside, doc, pad_doc), mask=valid)
    tl.store(pos_out + positions, tl.where(inside, positions - doc_start, 0), mask=valid)
    return positions, valid


# lengths and counts are data: no specialization on their values (no compile per new lengths)
@triton.jit(do_not_specialize=["documents", "total_q", "total_k"])
def varlen_check(cu_q, cu_k, documents, total_q, total_k, stats, copy_q, copy_k,
                 CHUNK: tl.constexpr):
    """Two programs: the checks of the query offsets, then of the key offsets."""
    _check_pair(tl.program_id(0), cu_q, cu_k, documents, total_q, total_k, stats, copy_q,
                copy_k, CHUNK)


@triton.jit(do_not_specialize=["documents", "steps", "total_q", "total_k", "window", "q_tiles",
                               "kv_tiles", "q_length", "k_length"])
def varlen_rows(cu_q, cu_k, documents, steps, total_q, total_k, window,
                kv_num, kv_idx, full_num, full_idx, classes, q_tiles, kv_tiles,
                doc_q, pos_q, diag, q_length, doc_k, pos_k, k_length, stats, copy_q, copy_k,
                BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, ROWS: tl.constexpr,
                CHUNK: tl.constexpr, TOKENS: tl.constexpr, CAUSAL: tl.constexpr,
                WINDOW: tl.constexpr, PAD_DOC_Q: tl.constexpr, PAD_DOC_K: tl.constexpr,
                CHECK: tl.constexpr):
    """Programs 0..q_tiles-1: the kv tables' rows; then the query tokens' blocks, then the
    keys'; with ``CHECK`` two more: the offsets' checks (``stats``, ``copy_*``)."""
    pid = tl.program_id(0)
    q_blocks = (q_length + TOKENS - 1) // TOKENS
    k_blocks = (k_length + TOKENS - 1) // TOKENS
    if pid < q_tiles:
        _kv_row(pid, cu_q, cu_k, documents, steps, total_q, total_k, window, kv_num, kv_idx,
                full_num, full_idx, classes, kv_tiles, BLOCK_Q, BLOCK_KV, ROWS, CHUNK, CAUSAL,
                WINDOW)
    elif pid < q_tiles + q_blocks:
        positions, valid = _tokens(pid - q_tiles, cu_q, documents, steps, total_q, q_length,
                                   PAD_DOC_Q, doc_q, pos_q, TOKENS)
        _, _, _, row_diag = _rows(cu_q, cu_k, positions, documents, steps, total_q, window,
                                  False, False)
        tl.store(diag + positions, row_diag, mask=valid)
    elif pid < q_tiles + q_blocks + k_blocks:
        _tokens(pid - q_tiles - q_blocks, cu_k, documents, steps, total_k, k_length, PAD_DOC_K,
                doc_k, pos_k, TOKENS)
    else:
        if CHECK:
            _check_pair(pid - q_tiles - q_blocks - k_blocks, cu_q, cu_k, documents, total_q,
                        total_k, stats, copy_q, copy_k, TOKENS)


@triton.jit(do_not_specialize=["q_tiles", "kv_tiles"])
def varlen_columns(classes, q_num, q_idx, full_num, full_idx, q_tiles, kv_tiles,
                   CHUNK: tl.constexpr):
    """Program j: column j of the class grid as ordered rows of the q-side tables."""
    col = tl.program_id(0)
    _ordered_rows(q_num, q_idx, full_num, full_idx, classes, col, q_tiles,
                  (classes, col, q_tiles, kv_tiles), True, 1, CHUNK)
