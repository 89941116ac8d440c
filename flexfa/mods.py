"""Ready-made mods: factories that return named ``score_mod`` / ``mask_mod`` functions.

Every mod here is a plain Python function of ``(b, h, q_idx, kv_idx)`` (mask_mod, True = keep)
or ``(score, b, h, q_idx, kv_idx)`` (score_mod, returns the new score). Each one works three
ways: traced by flexfa, called with real torch tensors (broadcast index grids), and passed to
torch's own ``flex_attention`` / ``create_block_mask``. Factories name their result after
their arguments (``sliding_window(1024).__name__ == "sliding_window_1024"``) so kernels,
logs and profiler traces say which variant they are, and each result carries a docstring
with its formula. Tensors a mod reads (document ids, ALiBi slopes, a bias table) are exposed
as attributes of the returned function.
"""
from __future__ import annotations

import math
import numbers

import torch

from .blockmask.checks import MAX_SIZE, resolve_device
from .errors import InputError, InputTypeError, check_bool, check_int, dims, shown

__all__ = ["causal", "sliding_window", "prefix_lm", "document", "document_ids", "alibi",
           "alibi_slopes", "softcap", "relative_bias", "dilated_window", "global_sliding",
           "natten_2d", "chunked"]


# ---- argument checks -----------------------------------------------------------------------

def _positive_float(func: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{func}: {name} must be a number, got {type(value).__name__} {value!r}")
    # comparisons, not math.isfinite (as inputs.check_scale): a float torch.compile made
    # symbolic traces them (guards), not math.isfinite
    if not (value > 0 and value != math.inf):  # (NaN compares False)
        shown = "a number traced by torch.compile" if torch.compiler.is_compiling() else value
        raise InputError(f"{func}: {name} must be a finite number > 0, got {shown}")
    return float(value)


def _position(func: str, name: str, value, minimum: int = 1) -> int:
    """An int compared with positions (a window, a prefix, a chunk): positions are int32,
    sequences at most MAX_SIZE long, so a larger one changes nothing, and one past int64
    failed in torch or in the kernel generator when the mod ran."""
    value = check_int(func, name, value, minimum)
    if value > MAX_SIZE:
        raise InputError(f"{func}: {name} must be at most {MAX_SIZE} (2**31 - 1: positions are "
                         f"int32, no sequence is longer), got {value}")
    return value


def _device(func: str, device) -> torch.device | None:
    """``device`` checked as a torch device (None: the CPU, where tensors are made by default;
    create_block_mask's None is the accelerator)."""
    return None if device is None else resolve_device(func, device)


def _one_dim(func: str, name: str, values, dtype: torch.dtype, device) -> torch.Tensor:
    device = _device(func, device)
    kind = "bools" if dtype is torch.bool else "ints"
    if isinstance(values, torch.Tensor) and values.device.type == "meta":
        raise InputError(f"{func}: {name} is a meta tensor (it has no values); pass it on the "
                         "CPU or a GPU")
    try:  # (a str, None, a list of str, an int past int64 failed inside torch)
        tensor = torch.as_tensor(values, device=device)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputTypeError(f"{func}: {name} must be a 1-d sequence of {kind}, got "
                             f"{type(values).__name__} {values!r:.80} ({exc})") from None
    if tensor.dim() != 1 or tensor.numel() == 0:
        raise InputError(f"{func}: {name} must be a non-empty 1-d sequence, got shape "
                         f"{dims(tensor)}")
    if dtype is torch.bool and tensor.dtype is not torch.bool:
        raise InputTypeError(f"{func}: {name} must be bool (True = global token), got {tensor.dtype}")
    if dtype is not torch.bool and (tensor.dtype.is_floating_point or tensor.dtype.is_complex
                                    or tensor.dtype is torch.bool):
        raise InputTypeError(f"{func}: {name} must hold integers, got {tensor.dtype}")
    converted = tensor.to(dtype)
    if tensor.dtype is torch.uint64 and (converted < 0).any():  # wrapped, read as negative
        raise InputError(f"{func}: {name} holds uint64 values past int64: "
                         f"{shown(tensor)}")
    return converted


def _number_name(value: float) -> str:
    """30.0 -> '30', 2.5 -> '2p5': identifier-safe numbers for mod names, exact (the shortest
    repr, where six significant digits would round: 30.0000001 is not 30)."""
    text = f"{value:g}"
    if float(text) != value:
        text = repr(value)
    return text.replace(".", "p").replace("-", "m").replace("+", "")


def _named(fn, name: str, doc: str, **attributes):
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    for key, value in attributes.items():
        setattr(fn, key, value)
    return fn


# ---- mask_mods -----------------------------------------------------------------------------

def causal(b, h, q_idx, kv_idx):
    """Causal mask: ``q_idx >= kv_idx``."""
    return q_idx >= kv_idx


def sliding_window(window: int, causal: bool = True):
    """Sliding window of ``window`` keys.

    causal (default): ``0 <= q_idx - kv_idx < window`` (the query itself and the
    ``window - 1`` keys before it); ``causal=False``: ``|q_idx - kv_idx| < window``.
    """
    window = _position("sliding_window", "window", window)
    if check_bool("sliding_window: causal", causal):
        def mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
        return _named(mod, f"sliding_window_{window}",
                      f"keep iff 0 <= q_idx - kv_idx < {window}")

    def mod(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) < window
    return _named(mod, f"sliding_window_{window}_bidirectional",
                  f"keep iff |q_idx - kv_idx| < {window}")


def prefix_lm(prefix_length: int):
    """Prefix LM: the first ``prefix_length`` keys are seen by everyone, the rest causally.

    keep iff ``kv_idx < prefix_length or q_idx >= kv_idx``.
    """
    n = _position("prefix_lm", "prefix_length", prefix_length, minimum=0)

    def mod(b, h, q_idx, kv_idx):
        return (kv_idx < n) | (q_idx >= kv_idx)
    return _named(mod, f"prefix_lm_{n}", f"keep iff kv_idx < {n} or q_idx >= kv_idx")


def _document_lengths(offsets_or_lengths) -> torch.Tensor:
    """int64 lengths of the documents, from cu_seqlens or lengths (see ``document_ids``)."""
    values = _one_dim("document", "offsets_or_lengths", offsets_or_lengths, torch.int64, "cpu")
    listed = shown(values)
    if values.max().item() > MAX_SIZE:  # (and their sum fits int64: it is checked below)
        raise InputError(f"document: offsets_or_lengths must be at most {MAX_SIZE} (2**31 - 1: "
                         f"positions are int32), got {listed}")
    if values[0].item() == 0 and values.numel() >= 2:  # cu_seqlens
        lengths = values.diff()
        if (lengths < 0).any():
            raise InputError(f"document: offsets (cu_seqlens) must be non-decreasing, got "
                             f"{listed}")
        _refuse_token_ids(values, lengths)
    else:
        lengths = values
        if (lengths <= 0).any():
            raise InputError(f"document: lengths must all be > 0 (or pass offsets starting at "
                             f"0), got {listed}")
    total = lengths.sum().item()
    if total == 0:
        raise InputError(f"document: the documents hold no tokens: {listed}")
    if total > MAX_SIZE:
        raise InputError(f"document: the documents hold {total} tokens; at most {MAX_SIZE} "
                         f"(2**31 - 1: positions are int32), got {listed}")
    return lengths


def _refuse_token_ids(values: torch.Tensor, lengths: torch.Tensor) -> None:
    """An InputError for offsets that look like per-token document ids ([0, 0, 0, 1, 1, 2]):
    read as cu_seqlens they are documents of 0 and 1 tokens, fewer tokens than the ids, and
    the mask failed later with an index out of bounds that did not say why. (Real offsets
    with empty documents step by more than 1 somewhere; the same mask without the empty
    documents is still accepted: [0, 1, 2].)"""
    if not ((lengths == 0).any() and (lengths <= 1).all()):
        return
    per_id = torch.bincount(values)
    per_id = per_id[per_id > 0]
    raise InputError(
        f"document: offsets_or_lengths {shown(values)} starts at 0, so it is read as offsets "
        f"(cu_seqlens), but it looks like per-token document ids (non-decreasing in steps of "
        f"0 and 1, with repeats; as offsets it is {lengths.numel()} documents of 0 or 1 tokens, "
        f"{int(lengths.sum())} tokens). document() takes offsets or lengths, not ids: for these "
        f"ids pass the lengths {shown(per_id)} or the offsets "
        f"{shown(torch.cat([per_id.new_zeros(1), per_id.cumsum(0)]))}")


def document_ids(offsets_or_lengths, device=None) -> torch.Tensor:
    """The int32 document id of every token of a packed sequence.

    Accepts cu_seqlens (offsets: starts with 0, non-decreasing, e.g. ``[0, 3, 7, 10]``) or a
    list of document lengths (all > 0, e.g. ``[3, 4, 3]``); both give
    ``[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]``. Per-token ids given instead (``[0, 0, 0, 1, 1, 2]``:
    from 0 in steps of 0 and 1) are refused, naming the lengths they stand for.
    """
    return _ids(_document_lengths(offsets_or_lengths), device)


def _ids(lengths: torch.Tensor, device) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return ids.to(device=_device("document", device), dtype=torch.int32)


def document(offsets_or_lengths, device=None):
    """Packed documents: a token attends only to tokens of its own document.

    keep iff ``doc_ids[q_idx] == doc_ids[kv_idx]``, where ``doc_ids`` (exposed as
    ``mod.doc_ids``, int32, one entry per token) comes from cu_seqlens or a list of lengths
    (see ``document_ids``). Q_LEN and KV_LEN must not exceed ``len(doc_ids)``. Combine with
    ``causal`` through ``and_masks`` for packed causal language modelling.
    """
    lengths = _document_lengths(offsets_or_lengths)
    doc_ids = _ids(lengths, device)
    count = lengths.numel()  # empty documents of cu_seqlens count too, wherever they are

    def mod(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]
    return _named(mod, f"document_{count}",
                  f"keep iff doc_ids[q_idx] == doc_ids[kv_idx] ({count} documents, "
                  f"{doc_ids.numel()} tokens)", doc_ids=doc_ids)


def dilated_window(window: int, dilation: int):
    """Causal dilated window: ``window`` keys spaced ``dilation`` apart, ending at the query.

    keep iff ``d = q_idx - kv_idx`` satisfies ``0 <= d < window * dilation`` and
    ``d % dilation == 0``.
    """
    window = _position("dilated_window", "window", window)
    dilation = _position("dilated_window", "dilation", dilation)
    span = window * dilation

    def mod(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance < span) & (distance % dilation == 0)
    return _named(mod, f"dilated_window_{window}_{dilation}",
                  f"keep iff d = q_idx - kv_idx has 0 <= d < {span} and d % {dilation} == 0")


def global_sliding(window: int, is_global, causal: bool = True, device=None):
    """Sliding window plus global tokens (Longformer style).

    ``is_global`` is a bool per token (exposed as ``mod.is_global``): global tokens see every
    key and every query sees them (causal: every earlier key, every later query). causal
    (default): keep iff ``q_idx >= kv_idx`` and
    (``q_idx - kv_idx < window`` or ``is_global[q_idx]`` or ``is_global[kv_idx]``);
    ``causal=False``: keep iff ``|q_idx - kv_idx| < window`` or either token is global.
    """
    window = _position("global_sliding", "window", window)
    flags = _one_dim("global_sliding", "is_global", is_global, torch.bool, device)
    causal = check_bool("global_sliding: causal", causal)
    suffix = "" if causal else "_bidirectional"
    if causal:
        def mod(b, h, q_idx, kv_idx):
            near = q_idx - kv_idx < window
            return (q_idx >= kv_idx) & (near | flags[q_idx] | flags[kv_idx])
    else:
        def mod(b, h, q_idx, kv_idx):
            return (abs(q_idx - kv_idx) < window) | flags[q_idx] | flags[kv_idx]
    count = int(flags.sum().item())
    return _named(mod, f"global_sliding_{window}{suffix}",
                  f"{'causal ' if causal else ''}window {window} or a global token "
                  f"({count} of {flags.numel()} tokens global)", is_global=flags)


def natten_2d(width: int, height: int, kernel: int):
    """2-D neighbourhood attention over a ``width x height`` image flattened row-major.

    Token ``i`` sits at ``(x, y) = (i % width, i // width)``. A query attends to the
    ``kernel x kernel`` keys around it; near the border the window is shifted inwards so it
    always holds ``kernel**2`` keys (as NATTEN does): with ``r = kernel // 2``,
    ``cx = clamp(qx, r, width-1-r)``, ``cy = clamp(qy, r, height-1-r)``, keep iff
    ``|kx - cx| <= r and |ky - cy| <= r``.
    """
    width = _position("natten_2d", "width", width)
    height = _position("natten_2d", "height", height)
    kernel = check_int("natten_2d", "kernel", kernel)
    if kernel % 2 == 0 or kernel > min(width, height):
        raise InputError(f"natten_2d: kernel must be odd and <= min(width, height) = "
                         f"{min(width, height)}, got kernel={kernel}")
    r = kernel // 2

    def mod(b, h, q_idx, kv_idx):
        center_x = torch.clamp(q_idx % width, r, width - 1 - r)
        center_y = torch.clamp(q_idx // width, r, height - 1 - r)
        near_x = abs(kv_idx % width - center_x) <= r
        near_y = abs(kv_idx // width - center_y) <= r
        return near_x & near_y
    return _named(mod, f"natten_2d_{width}x{height}_k{kernel}",
                  f"keep iff key within the {kernel}x{kernel} window around the query on a "
                  f"{width}x{height} grid (window clamped inside the grid)")


def chunked(chunk_size: int, causal: bool = False):
    """Chunked (block-diagonal) attention: tokens attend within their chunk of ``chunk_size``.

    keep iff ``q_idx // chunk_size == kv_idx // chunk_size`` (and ``q_idx >= kv_idx`` with
    ``causal=True``, as in Llama 4's chunked layers).
    """
    size = _position("chunked", "chunk_size", chunk_size)
    if check_bool("chunked: causal", causal):
        def mod(b, h, q_idx, kv_idx):
            return (q_idx // size == kv_idx // size) & (q_idx >= kv_idx)
        return _named(mod, f"chunked_{size}_causal",
                      f"keep iff q_idx // {size} == kv_idx // {size} and q_idx >= kv_idx")

    def mod(b, h, q_idx, kv_idx):
        return q_idx // size == kv_idx // size
    return _named(mod, f"chunked_{size}", f"keep iff q_idx // {size} == kv_idx // {size}")


# ---- score_mods ----------------------------------------------------------------------------

_FLOAT32 = torch.finfo(torch.float32)
MAX_HEADS = 2 ** 20  # alibi's slopes are a Python list first


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """The standard ALiBi slopes (Press et al.), float32 ``[num_heads]`` on ``device`` (None:
    torch's default device).

    For ``n`` a power of two, head ``i`` gets ``2 ** (-8 * (i + 1) / n)``; otherwise the
    slopes of the largest power of two ``m < n`` followed by every other slope of ``2 m``.
    """
    n = check_int("alibi_slopes", "num_heads", num_heads)
    if n > MAX_HEADS:  # (a list of 2**40 slopes was built until memory ran out)
        raise InputError(f"alibi_slopes: num_heads must be at most {MAX_HEADS}, got {n}")

    def power_of_two(count):
        return [2.0 ** (-8.0 * (i + 1) / count) for i in range(count)]
    m = 2 ** int(math.floor(math.log2(n)))
    slopes = power_of_two(m) + power_of_two(2 * m)[0::2][: n - m]
    return torch.tensor(slopes, dtype=torch.float32, device=_device("alibi_slopes", device))


def alibi(num_heads: int, device=None):
    """ALiBi: ``score - slopes[h] * |q_idx - kv_idx|`` (``mod.slopes``: see ``alibi_slopes``).

    On the causal part this is the paper's ``score + slopes[h] * (kv_idx - q_idx)``.
    """
    # (made on the device asked for: on torch's default device first, a meta default failed)
    slopes = alibi_slopes(num_heads, _device("alibi", device))

    def mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * abs(q_idx - kv_idx)
    n = slopes.numel()
    if n & (n - 1) == 0:
        rule = f"2^(-8(i+1)/{n})"
    else:  # (the paper's rule for other counts: alibi_slopes)
        power = 1 << (n.bit_length() - 1)
        rule = f"2^(-8(i+1)/{power}) for i < {power}, then every other slope of {2 * power}"
    return _named(mod, f"alibi_{num_heads}", "score - slopes[h] * |q_idx - kv_idx| "
                  f"({num_heads} heads, slopes {rule})", slopes=slopes)


def softcap(cap: float):
    """Logit soft-capping (Gemma 2, Grok): ``cap * tanh(score / cap)``."""
    cap = _positive_float("softcap", "cap", cap)
    # the scores are float32 (in the kernels and in torch's): a cap past its range is inf
    # there (inf * tanh(s / inf) is NaN: every output NaN), one below it flushes to 0
    # (under torch.compile the cap may be a symbolic float: compared, never formatted)
    compiling = torch.compiler.is_compiling()
    if not _FLOAT32.tiny <= cap <= _FLOAT32.max:
        raise InputError(f"softcap: cap must be within float32's normal range "
                         f"({_FLOAT32.tiny:g} .. {_FLOAT32.max:g}): the scores are float32, "
                         f"got {'a number traced by torch.compile' if compiling else cap}")

    def mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    if compiling:
        return _named(mod, "softcap", "cap * tanh(score / cap)")
    return _named(mod, f"softcap_{_number_name(cap)}", f"{cap:g} * tanh(score / {cap:g})")


def relative_bias(table: torch.Tensor, offset: int | None = None):
    """A learnable relative-position bias: ``score + table[clamp(q_idx - kv_idx + offset)]``.

    ``table`` is float ``[R]`` (shared by all heads) or ``[H, R]`` (per head: ``table[h, ...]``)
    and is used as is, not copied, so ``table.requires_grad_()`` makes flexfa compute its
    gradient. The index is clamped to ``[0, R - 1]``, so distances beyond the table reuse its
    ends. ``offset`` defaults to ``(R - 1) // 2``: for ``R = 2 N - 1`` the centre entry is
    distance 0 and the table covers every distance of an ``N x N`` attention.
    """
    if not isinstance(table, torch.Tensor):
        raise InputTypeError(f"relative_bias: table must be a torch.Tensor, got "
                             f"{type(table).__name__}")
    if not table.dtype.is_floating_point:
        raise InputTypeError(f"relative_bias: table must be a float tensor, got dtype "
                             f"{table.dtype}")
    if table.dim() not in (1, 2) or table.numel() == 0:
        raise InputError(f"relative_bias: table must have shape [R] or [H, R] with H, R >= 1, "
                         f"got shape {dims(table)}")
    size = table.shape[-1]
    offset = (size - 1) // 2 if offset is None else _position("relative_bias", "offset", offset, 0)
    last = size - 1

    if table.dim() == 1:
        def mod(score, b, h, q_idx, kv_idx):
            return score + table[torch.clamp(q_idx - kv_idx + offset, 0, last)]
        name = f"relative_bias_{size}"
    else:
        def mod(score, b, h, q_idx, kv_idx):
            return score + table[h, torch.clamp(q_idx - kv_idx + offset, 0, last)]
        name = f"relative_bias_{table.shape[0]}x{size}"
    if offset != (size - 1) // 2:  # one name per formula: the default offset goes unsaid
        name += f"_offset{offset}"
    per_head = "[h, " if table.dim() == 2 else "["
    return _named(mod, name, f"score + table{per_head}clamp(q_idx - kv_idx + {offset}, 0, {last})]",
                  table=table, offset=offset)
