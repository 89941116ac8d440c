"""What ``flex_decode`` hands the decode family, importable without Triton (``import flexfa``
stays cheap): the per-call inputs, the preallocated workspace and the key geometry."""
from __future__ import annotations

import dataclasses
import weakref

import torch

from .outputs import allocate_outputs

MAX_Q_LEN = 16  # query rows per head: decoding, speculative verification, small chunks
# the kernel's query-offset modes (flexfa.codegen.decode's OFFSETS_*, checked equal there)
OFFSETS_NONE, OFFSETS_FROM_LENS, OFFSETS_TENSOR = OFFSETS = (0, 1, 2)


@dataclasses.dataclass(frozen=True)
class DecodeInputs:
    """What ``flex_decode`` adds to a call: per-sequence key counts ``kv_lens`` [B] int32,
    query offsets ``q_offsets`` [B] int32, a page table [B, max_pages] int32 over a paged
    cache of ``page_size`` keys per page, and a ``DecodeWorkspace``."""

    kv_lens: torch.Tensor | None = None
    q_offsets: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    page_size: int = 0
    workspace: "DecodeWorkspace | None" = None

    @property
    def paged(self) -> bool:
        return self.page_table is not None

    @property
    def offsets(self) -> int:
        if self.q_offsets is not None:
            return OFFSETS_TENSOR
        return OFFSETS_FROM_LENS if self.kv_lens is not None else OFFSETS_NONE

    def key(self) -> tuple:
        """What of these inputs a plan specializes on (their 16-byte alignment too: a cached
        plan launches the kernel its first call compiled for it)."""
        table = self.page_table
        return (self.offsets, self.page_size, _aligned(self.kv_lens), _aligned(self.q_offsets),
                None if table is None else (table.shape, table.stride(), _aligned(table)))


def _aligned(tensor: torch.Tensor | None) -> bool | None:
    return None if tensor is None else tensor.data_ptr() % 16 == 0


NO_INPUTS = DecodeInputs()


class DecodeWorkspace:
    """Preallocated outputs and split workspaces: a call given a workspace allocates nothing
    once the workspace holds the buffers of its plan (after its first call), and returns the
    workspace's ``out`` (and ``lse``), overwritten by the next call. What a CUDA graph
    captures: the same addresses on every replay."""

    def __init__(self):
        # the plan whose buffers these are, by weak reference: a plan binds its block mask's
        # tables, which a workspace kept for a decode loop would keep alive after the mask
        self.plan = _no_plan
        self.out = self.lse = self.maxs = None
        self.parts = self.part_lse = self.part_max = None

    def buffers(self, plan, q, v, return_lse: bool, return_max: bool) -> tuple:
        if self.plan() is not plan or (return_lse and self.lse is None) or (
                return_max and self.maxs is None):
            self.out, self.lse, self.maxs = allocate_outputs(q, v, True, return_max)
            self.parts, self.part_lse, self.part_max = split_workspaces(plan, v)
            self.plan = weakref.ref(plan)
        return (self.out, self.lse if return_lse else None, self.maxs if return_max else None,
                self.parts, self.part_lse, self.part_max)


def _no_plan():
    return None


def split_workspaces(plan, v) -> tuple:
    """The float32 slices of a split plan (Nones without splits)."""
    splits, bh, rows = plan.fixed["splits"], *plan.fixed["rows"]
    if splits == 1:
        return None, None, None
    parts = torch.empty(splits * bh * rows * v.shape[-1], dtype=torch.float32, device=v.device)
    stats = torch.empty(2, splits * bh * rows, dtype=torch.float32, device=v.device)
    return parts, stats[0], stats[1]


def kv_geometry(k, inputs: DecodeInputs) -> tuple[int, int]:
    """(kv heads, keys per sequence at most) of contiguous [B, Hkv, S, E] keys or a paged
    cache [num_pages, page_size, Hkv, E] read through a [B, max_pages] page table."""
    if inputs.paged:
        return k.shape[2], inputs.page_table.shape[1] * inputs.page_size
    return k.shape[1], k.shape[2]
