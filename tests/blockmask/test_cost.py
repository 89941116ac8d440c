"""Cost: only boundary tiles are evaluated element by element, evaluation chunks are bounded,
and no step needs Q_LEN x KV_LEN memory."""
import logging

import torch

from flexfa import mods
from flexfa.blockmask import analysis, create, exact
from flexfa.blockmask import create_block_mask
from flexfa.blockmask.analysis import TileGrid
from flexfa.frontend.trace import trace

from .test_vs_torch import assert_same_as_torch
from .zoo import ZOO

CPU = torch.device("cpu")


def undecided_counts(mask_mod, L, S, block, B=1, H=1):
    """(tiles intervals left undecided, tiles then evaluated element by element)."""
    grid = TileGrid(B, H, L, S, block, block, CPU)
    return create.tile_classes(trace(mask_mod), grid)[1]


def test_causal_and_windows_evaluate_only_edge_tiles():
    assert undecided_counts(mods.causal, 4096, 4096, 32) == (128, 0)  # the diagonal, probed
    undecided, in_full = undecided_counts(mods.sliding_window(100), 4000, 4000, 64)
    assert undecided <= 2 * 63 + 2 * 63 and in_full == 0
    undecided, in_full = undecided_counts(ZOO["document_long"](1, 1, 4000, 4000), 4000, 4000, 64)
    assert in_full < undecided // 4


def test_document_mask_evaluates_only_boundary_tiles():
    doc = ZOO["document_long"](1, 1, 2048, 2048)
    traced = trace(doc)
    grid = TileGrid(1, 1, 2048, 2048, 32, 32, CPU)
    found = analysis.TileAnalysis(traced, grid)
    classes = found.classify(0, grid.q_tiles)
    ids = traced.buffers[0]
    tiles = ids.view(-1, 32)
    has_boundary = tiles.amin(1) != tiles.amax(1)
    for _, _, q_tile, kv_tile in (classes == analysis.UNDECIDED).nonzero().tolist():
        assert q_tile == kv_tile or has_boundary[q_tile] or has_boundary[kv_tile]
    assert (classes == analysis.UNDECIDED).sum() < 0.1 * classes.numel()


def test_huge_lengths_without_dense_memory():
    # 262144^2 mask values would be 64 GiB; the tables are 1024 x 1024 tiles
    mask = create_block_mask(mods.sliding_window(1000), None, None, 262144, 262144,
                             device="cpu", BLOCK_SIZE=256)
    counts = mask.kv_num_blocks + mask.full_kv_num_blocks
    assert counts.max() <= 6 and int(mask.full_kv_num_blocks.sum()) > 0


def test_chunks_are_bounded(monkeypatch):
    largest = []

    def recording(original):
        def evaluate_node(*args, **kwargs):
            value = original(*args, **kwargs)
            largest.append(value.numel())
            return value
        return evaluate_node

    monkeypatch.setattr(exact, "evaluate_node", recording(exact.evaluate_node))
    monkeypatch.setattr(analysis, "evaluate_node", recording(analysis.evaluate_node))
    monkeypatch.setattr(exact, "MAX_CHUNK_ELEMENTS", 1024)
    monkeypatch.setattr(exact.settle_undecided, "__defaults__", (1024,))
    monkeypatch.setattr(analysis, "MAX_GRID_ELEMENTS", 64)
    # a lookup table cannot be bounded: every tile is evaluated, 4 tiles of 16x16 at a time
    for name in ("lookup_table", "document_causal", "head_windows"):
        largest.clear()
        assert_same_as_torch(ZOO[name](2, 3, 200, 232), 2, 3, 200, 232, 16)
        assert 0 < max(largest) <= 1024


def test_slow_builds_are_logged(caplog, monkeypatch):
    monkeypatch.setattr(create, "SLOW_BUILD_S", 0.0)
    with caplog.at_level(logging.INFO, logger="flexfa.blockmask"):
        create_block_mask(mods.causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=32)
    assert "block mask causal: 8 x 8 tiles, 8 undecided by intervals, 0 of them" in caplog.text


def test_long_exact_evaluation_logs_a_progress_line(monkeypatch, caplog):
    # a lookup by both indices cannot be bounded: every tile is evaluated element by element
    table = torch.ones(96, 80, dtype=torch.bool)

    def lookup(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]
    monkeypatch.setattr(exact, "PROGRESS_EVERY_S", -1.0)
    with caplog.at_level(logging.INFO, logger="flexfa.blockmask"):
        block_mask = create_block_mask(lookup, 1, 1, 96, 80, device="cpu", BLOCK_SIZE=16)
    assert any("evaluated" in r.getMessage() and "element by element" in r.getMessage()
               for r in caplog.records)
    assert int(block_mask.full_kv_num_blocks.sum()) == 6 * 5
