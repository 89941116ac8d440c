"""Union tables: the live kv blocks of a GQA group's block-mask members, for the decode kernel.

A decode program packs the G query heads of one kv head times L query rows into one tile. Where
the mask's tables differ between those heads (per-head masks) or the rows span several q
blocks, each row belongs to one *member* (table head g, q block first + j) with its own block
list. ``union_tables`` lists, for every (batch, kv head, first q block), the kv blocks that any
member lists, in ascending order, and each member's status there (ABSENT, PARTIAL: apply the
mask_mod, FULL: do not), so the kernel reads each K/V tile once and gives each row its own
member's status.

The union is built from a dense status grid, so it assumes nothing about the order of a
table's entries (torch-built masks need not be sorted): only what ``check_tables`` checks and
``runnable_block_mask`` ensures (the listed blocks are in range, none twice, none both partial
and full). Members whose q block
lies past the mask's last one are absent. Built once per mask and plan (the decode family
keeps it in the plan, which lives under the mask); its size is about G * span / 4 of the
mask's index tables (one byte per member and block).
"""
from __future__ import annotations

import torch

ABSENT, PARTIAL, FULL = 0, 1, 2


def block_status(block_mask, q_blocks: int, kv_blocks: int) -> torch.Tensor:
    """[B, H, q_blocks, kv_blocks] int8: each block's status in the first q_blocks rows of the
    kv tables (the rows a call reads, the ones ``check_tables`` checked: a table may have
    more, whose entries need not be blocks of the call's lengths)."""
    status = None
    pairs = (("kv", PARTIAL), ("full_kv", FULL))
    for name, value in pairs:
        num_blocks = getattr(block_mask, f"{name}_num_blocks", None)
        if num_blocks is None:
            continue
        num_blocks = num_blocks[:, :, :q_blocks]
        indices = getattr(block_mask, f"{name}_indices")[:, :, :q_blocks]
        if status is None:  # one slot past the end takes the entries past each row's count
            status = torch.zeros(*indices.shape[:3], kv_blocks + 1, dtype=torch.int8,
                                 device=indices.device)
        listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
        slots = torch.where(listed, indices.long(), kv_blocks)
        status.scatter_(-1, slots, torch.full(slots.shape, value, dtype=torch.int8,
                                              device=slots.device))
    return status[..., :kv_blocks]


def union_tables(block_mask, kv_heads: int, table_g: int, qb_span: int, q_blocks: int,
                 kv_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count [B, Hkv, QB] int32, blocks [B, Hkv, QB, W] int32, status [B, Hkv, QB, W, M]
    int8), contiguous, B the mask's batch size (1: broadcast), QB = q_blocks (the q blocks of
    the call's query positions). Row (b, h, qb) is the union of
    members m = g * qb_span + j (g < table_g: table head h * table_g + g, or the one shared
    head; j < qb_span: q block qb + j); its first count entries are the blocks, ascending."""
    status = block_status(block_mask, q_blocks, kv_blocks)
    B, H, QB, KB = status.shape
    heads = status.reshape(B, H // table_g, table_g, QB, KB).expand(B, kv_heads, table_g, QB, KB)
    padded = torch.cat([heads, heads.new_zeros(B, kv_heads, table_g, qb_span - 1, KB)], dim=3)
    members = torch.stack([padded[:, :, :, j:j + QB] for j in range(qb_span)], dim=3)
    members = members.reshape(B, kv_heads, table_g * qb_span, QB, KB).permute(0, 1, 3, 4, 2)
    live = (members != ABSENT).any(-1)  # [B, Hkv, QB, KB]
    count = live.sum(-1, dtype=torch.int32)
    width = max(int(count.max()), 1)  # one host sync, once per mask and plan
    # the live blocks first, each group in ascending block order (a stable sort)
    order = torch.sort((~live).to(torch.int8), dim=-1, stable=True).indices[..., :width]
    member_status = members.gather(3, order[..., None].expand(*order.shape, members.shape[-1]))
    return count.contiguous(), order.to(torch.int32).contiguous(), member_status.contiguous()
