"""``flexfa.blockmask.union``: the union tables of a GQA group's block-mask members against a
brute-force walk of the tables, for random tables in any entry order, shared or per-head
heads, broadcast batches and q-block spans past the last block."""
import types

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexfa.blockmask.union import ABSENT, FULL, PARTIAL, union_tables


def random_tables(draw, B, H, QB, KB):
    """Disjoint partial and full blocks per row, each listed in a random order, padded."""
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    kind = torch.randint(0, 3, (B, H, QB, KB), generator=generator)  # absent, partial, full

    def table(value):
        num = (kind == value).sum(-1, dtype=torch.int32)
        keys = torch.rand(B, H, QB, KB, generator=generator) + (kind != value) * 2.0
        return num, torch.argsort(keys, dim=-1).to(torch.int32)  # listed ones first, shuffled
    (nb, ix), (fnb, fix) = table(PARTIAL), table(FULL)
    return kind, types.SimpleNamespace(kv_num_blocks=nb, kv_indices=ix, full_kv_num_blocks=fnb,
                                       full_kv_indices=fix)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_union_tables_match_a_brute_force_walk(data):
    Hkv, G = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    per_head = data.draw(st.booleans())
    B, QB, KB = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4)), data.draw(
        st.integers(1, 6))
    span = data.draw(st.integers(1, 3))
    table_g = G if per_head else 1
    kind, mask = random_tables(data.draw, B, Hkv * G if per_head else 1, QB, KB)
    count, blocks, status = union_tables(mask, Hkv, table_g, span, QB, KB)
    assert count.shape == (B, Hkv, QB) and status.shape[:4] == blocks.shape
    assert status.shape[-1] == table_g * span
    for b in range(B):
        for h in range(Hkv):
            for qb in range(QB):
                expected = {}  # block -> each member's status
                for g in range(table_g):
                    head = h * table_g + g if per_head else 0
                    for j in range(span):
                        for kb in range(KB):
                            value = int(kind[b, head, qb + j, kb]) if qb + j < QB else ABSENT
                            expected.setdefault(kb, [ABSENT] * (table_g * span))
                            expected[kb][g * span + j] = value
                live = sorted(kb for kb, s in expected.items() if any(s))
                n = int(count[b, h, qb])
                assert blocks[b, h, qb, :n].tolist() == live
                assert [status[b, h, qb, u].tolist() for u in range(n)] == [
                    expected[kb] for kb in live]


def test_rows_past_the_calls_q_blocks_are_not_read():
    """Rows of the tables past q_blocks (a call's positions need fewer) are left out: their
    entries need not be blocks of the call (they were scattered: a RuntimeError)."""
    kind, mask = random_tables(lambda strategy: 3, 1, 2, 2, 4)
    mask.kv_indices[:, :, 1] = torch.tensor([7, 100, -5, 4], dtype=torch.int32)
    count, blocks, status = union_tables(mask, 1, 2, 1, 1, 4)
    assert count.shape == (1, 1, 1) and status.shape[-1] == 2
    live = sorted(kb for kb in range(4) if kind[0, :, 0, kb].any())
    assert blocks[0, 0, 0, :int(count[0, 0, 0])].tolist() == live
