"""``PagedKVCache``: a paged KV cache for ``flex_decode``, in the spirit of torch's and
attention-gym's ``PagedAttention`` (reserve, assign, erase) with vLLM's layout.

The keys and values of all sequences share ``k_cache`` / ``v_cache`` [num_pages, page_size,
Hkv, E]; ``page_table`` [max_batch_size, max_pages_per_seq] int32 maps sequence b's logical
page i to a physical page (-1: none) and ``kv_lens`` [max_batch_size] int32 holds each
sequence's key count. The decode kernel translates addresses through the table per key tile,
so mods and block masks stay in logical positions: ``convert_logical_block_mask`` has nothing
to convert. Pages are handed out on the host (a free list), so reserving never synchronises
with the GPU; ``assign`` writes on the device and can run inside a CUDA graph.

The host keeps a copy of the lengths, which ``append`` and ``length`` read. It is right
while only this cache's methods write ``kv_lens``; once ``kv_lens`` is changed on the device
(an in-place update, as a decode step with ``assign`` does, seen by its version counter,
or ``kv_lens.data = other``, seen by its memory) or
one of the cache's calls runs inside a CUDA-graph capture (whose replays change it unseen),
the cache reads the lengths back from the device for each of those calls (a
synchronisation). Until the forty-second session the stale copy made ``append`` write over
the last tokens and shrink ``kv_lens``. A write the version counter cannot see (a kernel of
one's own, a write through a NumPy array or DLPack view) needs ``sync_lengths()`` before the
next ``append``.
"""
from __future__ import annotations

import torch

from .blockmask.checks import positive_int, resolve_device
from .blockmask.validate import capturing
from .decode import flex_decode
from .errors import InputError, InputTypeError, check_bool, check_int, dims
from .inputs import SUPPORTED_DTYPES, check_block_mask_type, check_head_dim
from .memo import contents_key, memory_of

MAX_SEQUENCES = 2 ** 20  # a cache's sequences (max_batch_size)

__all__ = ["PagedKVCache"]


class PagedKVCache:
    def __init__(self, num_pages: int, page_size: int, max_batch_size: int, num_kv_heads: int,
                 head_dim: int, *, head_dim_v: int | None = None,
                 max_pages_per_seq: int | None = None, dtype=torch.bfloat16, device="cpu"):
        func = "PagedKVCache"
        for name, value in (("num_pages", num_pages), ("page_size", page_size),
                            ("max_batch_size", max_batch_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("head_dim_v", head_dim_v),
                            ("max_pages_per_seq", max_pages_per_seq)):
            if value is not None or name not in ("head_dim_v", "max_pages_per_seq"):
                positive_int(func, name, value)
        if page_size % 16:
            raise InputError(f"page_size is {page_size}; the decode kernel needs a multiple of 16")
        for name, value in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
            if value is not None:
                check_head_dim(f"{func}: {name}", value)
        if dtype not in SUPPORTED_DTYPES:
            raise InputError(f"{func}: dtype must be torch.float16, torch.bfloat16 or "
                             f"torch.float32 (the decode kernel's), got {dtype}")
        device = resolve_device(func, device)  # (torch's own errors before)
        # (bounds before allocating: 2**30 sequences took a minute and 16 GB of host lists)
        if max_batch_size > MAX_SEQUENCES:
            raise InputError(f"{func}: max_batch_size is {max_batch_size}; at most "
                             f"{MAX_SEQUENCES} sequences")
        if num_pages * page_size >= 2 ** 31:
            raise InputError(f"{func}: num_pages * page_size is {num_pages * page_size} rows; "
                             "the page table's int32 entries address fewer than 2**31")
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq or num_pages
        self.k_cache = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype,
                                   device=device)
        self.v_cache = torch.zeros(num_pages, page_size, num_kv_heads, head_dim_v or head_dim,
                                   dtype=dtype, device=device)
        self.page_table = torch.full((max_batch_size, self.max_pages_per_seq), -1,
                                     dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self._pages: list[list[int]] = [[] for _ in range(max_batch_size)]
        self._lens = [0] * max_batch_size  # host copy of kv_lens (_host_lens)
        self._lens_right()
        # kv_lens is changed on the device: read it back (made under inference_mode, it has
        # no version counter: read back from the start)
        self._device_lengths = self.kv_lens.is_inference()
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.max_pages_per_seq * self.page_size

    def _row(self, batch_idx: int) -> int:
        batch_idx = check_int("PagedKVCache", "batch_idx", batch_idx, minimum=None)
        if not 0 <= batch_idx < len(self._pages):
            raise InputError(f"batch_idx {batch_idx} is outside 0..{len(self._pages) - 1}")
        return batch_idx

    def reserve(self, batch_idx: int, seq_len: int) -> None:
        """Give sequence ``batch_idx`` pages for ``seq_len`` keys (pages it has are kept)."""
        batch_idx = self._row(batch_idx)
        pages = self._pages[batch_idx]
        needed = self._pages_for(seq_len, "PagedKVCache.reserve")
        if needed - len(pages) > len(self._free):
            raise InputError(f"seq_len {seq_len} needs {needed - len(pages)} more pages but "
                             f"only {len(self._free)} of {self.num_pages} are free")
        new = [self._free.pop() for _ in range(needed - len(pages))]
        if new:
            self.page_table[batch_idx, len(pages):needed] = torch.tensor(new, dtype=torch.int32)
            pages += new

    def _pages_for(self, seq_len: int, func: str) -> int:
        """The pages ``seq_len`` keys take (an InputError past a sequence's most)."""
        seq_len = check_int(func, "seq_len", seq_len, minimum=0)
        needed = -(-seq_len // self.page_size)
        if needed > self.max_pages_per_seq:
            raise InputError(f"seq_len {seq_len} needs {needed} pages; a sequence has at most "
                             f"{self.max_pages_per_seq} ({self.max_seq_len} keys)")
        return needed

    def erase(self, batch_idx: int) -> None:
        """Free sequence ``batch_idx``'s pages and set its length to 0."""
        pages = self._pages[self._row(batch_idx)]
        self._free += reversed(pages)
        pages.clear()
        self.page_table[batch_idx] = -1
        self.set_length(batch_idx, 0)

    def set_length(self, batch_idx: int, seq_len: int) -> None:
        """Sequence ``batch_idx`` has ``seq_len`` keys (within its reserved pages)."""
        batch_idx = self._row(batch_idx)
        seq_len = check_int("PagedKVCache.set_length", "seq_len", seq_len, minimum=0)
        if not seq_len <= len(self._pages[batch_idx]) * self.page_size:
            raise InputError(f"seq_len {seq_len} is past sequence {batch_idx}'s "
                             f"{len(self._pages[batch_idx]) * self.page_size} reserved keys")
        self._see_device_writes()  # (before this write: the other sequences' copies)
        self._lens[batch_idx] = seq_len
        self.kv_lens[batch_idx] = seq_len
        self._lens_right()

    def length(self, batch_idx: int) -> int:
        return self._host_lens()[self._row(batch_idx)]

    def sync_lengths(self) -> None:
        """Read ``kv_lens`` back from the device into the host's copy (one synchronisation),
        and keep doing so before each ``append`` / ``length``: for writes to ``kv_lens`` its
        version counter does not see (a kernel of one's own)."""
        self._device_lengths = True
        self._host_lens()

    def _lens_right(self) -> None:
        """The host's copy of the lengths is right for ``kv_lens`` as it is now."""
        # (its memory held: the key's address stays its own)
        self._lens_key, self._lens_memory = contents_key(self.kv_lens), memory_of(self.kv_lens)

    def _see_device_writes(self) -> None:
        """Once ``kv_lens`` changed since the host's copy was last right (its version
        counter or its memory), the lengths are read back from the device from then on."""
        if contents_key(self.kv_lens) != self._lens_key:
            self._device_lengths = True

    def _host_lens(self) -> list[int]:
        """The lengths on the host: the kept copy while only this cache's methods wrote
        ``kv_lens``, else read back from the device (see the module docstring)."""
        self._see_device_writes()
        if self._device_lengths:
            if capturing():
                raise InputError("PagedKVCache: the sequences' lengths are kept on the device "
                                 "(kv_lens was changed there) and cannot be read while a CUDA "
                                 "graph is being captured; call append / length / set_length "
                                 "outside the capture")
            self._lens = self.kv_lens.tolist()
            self._lens_right()
        return self._lens

    def assign(self, batch_idx: torch.Tensor, input_pos: torch.Tensor, k_val: torch.Tensor,
               v_val: torch.Tensor, validate: bool = True) -> None:
        """Write ``k_val`` / ``v_val`` [B, Hkv, L, E] at logical positions ``input_pos`` [B, L]
        of sequences ``batch_idx`` [B] (device tensors: no synchronisation with
        ``validate=False``, as under CUDA-graph capture; the positions must be reserved).
        Lengths are not changed: ``set_length``, or ``kv_lens`` updated on the device."""
        validate = check_bool("PagedKVCache.assign: validate", validate)  # None skipped checks
        for name, tensor, ndim in (("batch_idx", batch_idx, 1), ("input_pos", input_pos, 2)):
            if not isinstance(tensor, torch.Tensor) or tensor.is_floating_point() or \
                    tensor.is_complex() or tensor.dtype is torch.bool or tensor.dim() != ndim:
                raise InputTypeError(f"{name} must be a {ndim}-D integer tensor, got "
                                     f"{getattr(tensor, 'dtype', type(tensor).__name__)} of shape "
                                     f"{tuple(getattr(tensor, 'shape', ()))}")
        B, L = input_pos.shape
        if tuple(batch_idx.shape) != (B,):
            raise InputError(f"batch_idx has shape {dims(batch_idx)} but input_pos "
                             f"{dims(input_pos)}; they must be [B] and [B, L]")
        self._check_values(k_val, v_val, B, L)
        if capturing():  # replays may advance kv_lens unseen (a decode step's += 1)
            self._device_lengths = True
        pos = input_pos.long()
        rows_ = batch_idx.long()
        if validate and capturing():  # its reads below are device syncs, which break a capture
            raise InputError("PagedKVCache.assign cannot check batch_idx and input_pos while a "
                             "CUDA graph is being captured; pass validate=False (check them "
                             "before capturing)")
        if validate:  # before the table is indexed: an index past it fails on the device
            if bool(((rows_ < 0) | (rows_ >= self.page_table.shape[0])).any()):
                raise InputError(f"batch_idx {rows_.tolist()} has entries outside the cache's "
                                 f"sequences 0..{self.page_table.shape[0] - 1}")
            if bool(((pos < 0) | (pos >= self.max_seq_len)).any()):
                raise InputError(f"input_pos has positions outside 0..{self.max_seq_len - 1} "
                                 f"(a sequence holds at most {self.max_seq_len} keys), got "
                                 f"{int(pos.min())}..{int(pos.max())}")
            # one write per (sequence, position): which of two writes wins is undefined on a GPU
            slots = (rows_[:, None] * self.max_seq_len + pos).flatten()
            if slots.numel() and int(torch.unique(slots).numel()) != slots.numel():
                raise InputError("assign writes one (batch_idx, input_pos) position twice; "
                                 "which value a GPU keeps is undefined: write each once")
        pages = self.page_table[rows_[:, None], pos // self.page_size]
        if validate and bool((pages < 0).any()):
            raise InputError("assign writes positions outside the pages reserved for their "
                             "sequences: reserve(batch_idx, seq_len) first")
        rows = (pages.long() * self.page_size + pos % self.page_size).flatten()
        self.k_cache.view(-1, *self.k_cache.shape[2:])[rows] = \
            k_val.transpose(1, 2).reshape(B * L, *self.k_cache.shape[2:]).to(self.k_cache.dtype)
        self.v_cache.view(-1, *self.v_cache.shape[2:])[rows] = \
            v_val.transpose(1, 2).reshape(B * L, *self.v_cache.shape[2:]).to(self.v_cache.dtype)

    def _check_values(self, k_val, v_val, B: int, L: int) -> None:
        """k_val [B, Hkv, L, E] and v_val [B, Hkv, L, Ev] tensors of this cache's heads and
        head dims."""
        Hkv, E, Ev = self.k_cache.shape[2], self.k_cache.shape[3], self.v_cache.shape[3]
        for name, tensor in (("k_val", k_val), ("v_val", v_val)):
            if not isinstance(tensor, torch.Tensor):
                raise InputTypeError(f"{name} must be a torch.Tensor, got "
                                     f"{type(tensor).__name__}")
            # (a value of another kind was cast into the cache silently, a meta one wrote
            # nothing: the cache kept its zeros)
            if tensor.dtype not in SUPPORTED_DTYPES:
                raise InputTypeError(f"{name} has dtype {tensor.dtype}; the cache takes "
                                     "float16, bfloat16 or float32 values (cast to its "
                                     f"{self.k_cache.dtype})")
            if tensor.device != self.k_cache.device:
                raise InputError(f"{name} is on {tensor.device} but the cache is on "
                                 f"{self.k_cache.device}")
        if tuple(k_val.shape) != (B, Hkv, L, E) or tuple(v_val.shape) != (B, Hkv, L, Ev):
            raise InputError(f"k_val {dims(k_val)} and v_val {dims(v_val)} must be "
                             f"[B={B}, Hkv={Hkv}, L={L}, E={E}] and [B, Hkv, L, Ev={Ev}] for "
                             "this cache")

    def append(self, k_val: torch.Tensor, v_val: torch.Tensor) -> None:
        """Append ``k_val`` / ``v_val`` [B, Hkv, L, E] to sequences 0..B-1 (reserving pages,
        advancing their lengths): the host knows every position, nothing is read back."""
        if not isinstance(k_val, torch.Tensor) or k_val.dim() != 4:
            raise InputError(f"k_val must be a 4-D tensor [B, Hkv, L, E], got "
                             f"{tuple(getattr(k_val, 'shape', ())) or type(k_val).__name__}")
        B, _, L, _ = k_val.shape
        self._check_values(k_val, v_val, B, L)  # before any page is reserved
        if B > len(self._pages):
            raise InputError(f"k_val has {B} sequences but the cache holds "
                             f"{len(self._pages)} (max_batch_size)")
        if L == 0 or B == 0:  # (B = 0 failed inside, blaming input_pos)
            return
        lens = list(self._host_lens()[:B])
        # every sequence's pages counted before any is reserved: a failure changes nothing
        more = sum(max(0, self._pages_for(lens[b] + L, "PagedKVCache.append")
                       - len(self._pages[b])) for b in range(B))
        if more > len(self._free):
            raise InputError(f"appending {L} keys to {B} sequences needs {more} more pages but "
                             f"only {len(self._free)} of {self.num_pages} are free")
        for b in range(B):
            self.reserve(b, lens[b] + L)
        device = self.k_cache.device
        pos = torch.tensor([[lens[b] + i for i in range(L)] for b in range(B)], device=device)
        self.assign(torch.arange(B, device=device), pos, k_val, v_val, validate=False)
        for b in range(B):
            self.set_length(b, lens[b] + L)

    def convert_logical_block_mask(self, block_mask):
        """The block mask for the paged cache: the same one (the kernel walks logical blocks
        and reads keys through the page table); its key length must be ``max_seq_len``."""
        if block_mask is not None:
            check_block_mask_type(block_mask)
        if block_mask is not None and tuple(block_mask.seq_lengths)[1] != self.max_seq_len:
            raise InputError(f"block_mask covers {tuple(block_mask.seq_lengths)[1]} keys but the "
                             f"cache's sequences hold {self.max_seq_len}")
        return block_mask

    def attend(self, query, score_mod=None, block_mask=None, **kwargs):
        """``flex_decode`` of ``query`` [B, Hq, L, E] against sequences 0..B-1 of the cache,
        the queries at the end of each sequence (``q_offsets`` in kwargs to place them)."""
        if not isinstance(query, torch.Tensor) or query.dim() != 4:
            got = tuple(getattr(query, "shape", ())) or type(query).__name__
            raise InputTypeError(f"PagedKVCache.attend: query must be a 4-D tensor [B, Hq, L, "
                                 f"E], got {got}")
        B = query.shape[0]
        if capturing():  # replays may advance kv_lens unseen (a decode step's += 1)
            self._device_lengths = True
        if B > self.page_table.shape[0]:
            raise InputError(f"PagedKVCache.attend: query has {B} sequences but the cache holds "
                             f"{self.page_table.shape[0]} (max_batch_size)")
        return flex_decode(query, self.k_cache, self.v_cache, score_mod, block_mask,
                           page_table=self.page_table[:B], kv_lens=self.kv_lens[:B], **kwargs)
