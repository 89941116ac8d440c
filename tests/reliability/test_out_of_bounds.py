"""Inputs that would make a kernel read out of bounds (a segfault under the interpreter, an
illegal address on a GPU) are rejected up front with a flexfa error."""
import types

import pytest
import torch

import flexfa
from flexfa import BlockMask
from .inputs import qkv


def _tables(q_tiles, kv_tiles):
    num_blocks = torch.ones(1, 1, q_tiles, dtype=torch.int32)
    indices = torch.arange(kv_tiles, dtype=torch.int32).expand(1, 1, q_tiles, kv_tiles)
    return num_blocks.clone(), indices.contiguous()


@pytest.mark.parametrize("fault, match", [  # (an index past the tiles is skipped, never read)
    ("negative index", "tile indices, 0 and up"),
    ("count past the row", r"must be in 0\.\.4"),
    ("negative count", r"must be in 0\.\.4"),
])
def test_from_kv_blocks_rejects_values_out_of_range(fault, match):
    num_blocks, indices = _tables(4, 4)
    target = {"negative index": (indices, -5),
              "count past the row": (num_blocks, 9), "negative count": (num_blocks, -3)}[fault]
    target[0].view(-1)[0] = target[1]
    with pytest.raises(flexfa.InputError, match=match):
        BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=16, seq_lengths=(64, 64))


@pytest.mark.parametrize("kind", ["flexfa", "duck-typed"])
def test_tables_smaller_than_the_lengths_are_rejected(kind):
    L = S = 100  # needs 7 x 7 tiles of 16
    num_blocks, indices = _tables(4, 4)
    if kind == "flexfa":
        mask = BlockMask.from_kv_blocks(num_blocks, indices, BLOCK_SIZE=16, seq_lengths=(L, S))
    else:
        mask = types.SimpleNamespace(kv_num_blocks=num_blocks, kv_indices=indices,
                                     full_kv_num_blocks=None, full_kv_indices=None,
                                     BLOCK_SIZE=(16, 16), seq_lengths=(L, S),
                                     mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= 0)
    q, k, v = qkv(L=L, S=S)
    with pytest.raises(flexfa.InputError, match="need 7 x 7"):
        flexfa.flex_attention(q, k, v, block_mask=mask)


def test_tables_covering_the_lengths_are_accepted():
    q, k, v = qkv(L=64, S=64)
    mask = BlockMask.from_kv_blocks(*_tables(4, 4), BLOCK_SIZE=16, seq_lengths=(64, 64))
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    assert torch.isfinite(out).all()


def test_empty_captured_tensor_is_rejected():
    empty = torch.zeros(0, 8)

    def reads_nothing(score, b, h, q_idx, kv_idx):
        return score + empty[q_idx, kv_idx % 8]

    q, k, v = qkv(L=20, S=24)
    with pytest.raises(flexfa.InputError, match=r"shape \(0, 8\), which has no elements"):
        flexfa.flex_attention(q, k, v, score_mod=reads_nothing)


def test_checks_are_skipped_only_for_an_unchanged_signature(monkeypatch):
    """A repeated call with the same tensors' metadata and the same, unmodified mask skips the
    tensor, shape and block-mask checks; replacing a table of that mask (or passing other
    lengths) is checked again."""
    from flexfa import api

    q, k, v = qkv(L=64, S=64)
    mask = BlockMask.from_kv_blocks(*_tables(4, 4), BLOCK_SIZE=16, seq_lengths=(64, 64))
    flexfa.flex_attention(q, k, v, block_mask=mask)
    calls = []
    original = api.check_block_mask
    monkeypatch.setattr(api, "check_block_mask", lambda *a: calls.append(a) or original(*a))
    flexfa.flex_attention(q, k, v, block_mask=mask)
    assert calls == []
    mask.kv_num_blocks, mask.kv_indices = _tables(2, 2)  # now too small for 64 x 64
    with pytest.raises(flexfa.InputError, match="need 4 x 4"):
        flexfa.flex_attention(q, k, v, block_mask=mask)
    assert len(calls) == 1
    q2, k2, v2 = qkv(L=80, S=64)
    with pytest.raises(flexfa.InputError):
        flexfa.flex_attention(q2, k2, v2, block_mask=mask)


def test_a_mask_with_an_unhashable_field_is_checked_every_time(monkeypatch):
    """A duck-typed mask whose fields cannot be hashed (here seq_lengths as a list) cannot key
    the memo of checked signatures: it works, and its checks run on every call."""
    from flexfa import api

    q, k, v = qkv(L=64, S=64)
    mask = BlockMask.from_kv_blocks(*_tables(4, 4), BLOCK_SIZE=16, seq_lengths=(64, 64))
    duck = types.SimpleNamespace(**{name: getattr(mask, name) for name in (
        "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
        "q_indices", "full_q_num_blocks", "full_q_indices", "mask_mod", "BLOCK_SIZE")},
        seq_lengths=[64, 64])
    expected = flexfa.flex_attention(q, k, v, block_mask=mask)
    calls = []
    original = api.check_block_mask
    monkeypatch.setattr(api, "check_block_mask", lambda *a: calls.append(a) or original(*a))
    for _ in range(2):
        torch.testing.assert_close(flexfa.flex_attention(q, k, v, block_mask=duck), expected)
    assert len(calls) == 2
