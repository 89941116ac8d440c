"""Masks the block-mask tests compare against torch: factories of (B, H, Q_LEN, KV_LEN).

Every mask here runs unchanged in torch's own ``create_block_mask`` and in flexfa's tracer.
Captured tensors are built from a fixed seed and sized for the lengths they are used with.
"""
import torch

from flexfa import and_masks, or_masks
from flexfa import mods


def _doc_ids(length: int, seed: int, lo: int = 1, hi: int = 60) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < length:
        lengths.append(int(torch.randint(lo, hi, (), generator=generator)))
    return mods.document_ids(lengths)[:length]


def document_causal(B, H, L, S):
    doc = _doc_ids(max(L, S), seed=1)
    return and_masks(mods.document(doc.bincount().tolist()), mods.causal)


def document_bidirectional(B, H, L, S):
    return mods.document(_doc_ids(max(L, S), seed=2).bincount().tolist())


def document_long_docs(B, H, L, S):
    doc = _doc_ids(max(L, S), seed=3, lo=20, hi=200)

    def document_long(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return document_long


def global_plus_sliding(B, H, L, S):
    flags = torch.zeros(max(L, S), dtype=torch.bool)
    flags[::37] = True
    return mods.global_sliding(24, flags)


def head_windows(B, H, L, S):
    windows = torch.tensor([8, 40, 100, 3, 17, 64, 1, 250])[:H]

    def head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < windows[h])
    return head_window


def batch_lengths(B, H, L, S):
    q_lengths = torch.tensor([L, L // 2 + 3, 1, L - 7])[:B]
    kv_lengths = torch.tensor([S, S // 3 + 1, 5, S])[:B]

    def padded_batch(b, h, q_idx, kv_idx):
        return (q_idx < q_lengths[b]) & (kv_idx < kv_lengths[b])
    return padded_batch


def batch_head_offsets(B, H, L, S):
    def shifted_causal(b, h, q_idx, kv_idx):
        return q_idx + 13 * b >= kv_idx + 5 * h
    return shifted_causal


def float_window(B, H, L, S):
    def float_distance(b, h, q_idx, kv_idx):
        return (q_idx.float() * 0.75 - kv_idx.float()).abs() < 20.5
    return float_distance


def lookup_table(B, H, L, S):
    table = torch.rand(L, S, generator=torch.Generator().manual_seed(4)) < 0.02

    def random_lookup(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx] | (q_idx == kv_idx)
    return random_lookup


def xor_parity(B, H, L, S):
    def parity(b, h, q_idx, kv_idx):
        return ((q_idx // 32) ^ (kv_idx // 48)) % 2 == 0
    return parity


def combined(B, H, L, S):
    return or_masks(and_masks(mods.causal, mods.sliding_window(40)), mods.prefix_lm(10),
                    mods.chunked(64))


def always_false(B, H, L, S):
    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0
    return nothing


def where_mask(B, H, L, S):
    def where_window(b, h, q_idx, kv_idx):
        limit = torch.where(q_idx < 100, q_idx + 5, q_idx // 2)
        return (kv_idx <= limit) & (kv_idx >= torch.minimum(q_idx - 30, torch.tensor(60)))
    return where_window


def one_hole(B, H, L, S):
    # every pair kept but one off the diagonals the exact pass probes first: its tile is
    # partial (an exact pass counting one short would mark it full)
    def all_but_one(b, h, q_idx, kv_idx):
        return ~((q_idx == 5) & (kv_idx == 9))
    return all_but_one


def pow_window(B, H, L, S):
    # an integer power of a mixed exponent: the interval rule's upper bound must take the
    # exponent's upper bound (a tile would be proven full)
    def power_of_distance(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (2 ** ((q_idx - kv_idx) // 16) <= 4)
    return power_of_distance


ZOO = {
    "causal": lambda B, H, L, S: mods.causal,
    "sliding_window": lambda B, H, L, S: mods.sliding_window(48),
    "sliding_bidirectional": lambda B, H, L, S: mods.sliding_window(33, causal=False),
    "prefix_lm": lambda B, H, L, S: mods.prefix_lm(70),
    "document_causal": document_causal,
    "document_bidirectional": document_bidirectional,
    "document_long": document_long_docs,
    "global_sliding": global_plus_sliding,
    "dilated_window": lambda B, H, L, S: mods.dilated_window(12, 3),
    "natten_2d": lambda B, H, L, S: mods.natten_2d(16, max(L, S) // 16 + 1, 5),
    "chunked_causal": lambda B, H, L, S: mods.chunked(50, causal=True),
    "head_windows": head_windows,
    "batch_lengths": batch_lengths,
    "batch_head_offsets": batch_head_offsets,
    "float_window": float_window,
    "lookup_table": lookup_table,
    "xor_parity": xor_parity,
    "and_or_combination": combined,
    "noop": lambda B, H, L, S: __import__("flexfa").noop_mask,
    "always_false": always_false,
    "where_min": where_mask,
    "one_hole": one_hole,
    "pow_window": pow_window,
}
