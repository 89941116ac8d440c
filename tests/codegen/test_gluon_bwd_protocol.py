"""The Gluon backward's barrier protocol (bwd_gluon.tmpl) on the CPU: the producer warp, the
two consumer warpgroups and the dQ-writer warp of one program, in every interleaving, on the
mbarrier model of mbarrier_model.py, with each barrier's count, phase parity, ring stage and
dS^T buffer read from the template (the order of each partition's operations is written out
in ``_programs``: a template that reorders them needs the model changed with it). A
barrier-phase mistake hangs a GPU instead of failing,
so this runs before any GPU does (its GPU tests, with Gluon's consistency checking, are in
tests/gpu/test_gluon_bwd_gpu.py)."""
from __future__ import annotations

import re

import pytest

from flexfa.codegen.template import load_template
from mbarrier_model import (backward_producer_tile, barrier_counts, find_one,
                            run_all_interleavings)

CONSUMERS = 2


def backward_source() -> str:
    """bwd_gluon.tmpl and the producer and tile walk it shares with bwd_gluon_wide.tmpl."""
    return load_template("bwd_gluon.tmpl") + load_template("bwd_gluon_shared.tmpl")


def _protocol(source: str) -> dict:
    """The template's expressions, by name: barrier counts, parities (of `it` and STAGES),
    ring stage, and the dS^T buffers a consumer writes and its dQ wgmmas read."""
    def find(pattern: str) -> str:
        return find_one(pattern, source)

    counts = barrier_counts(source, CONSUMERS)
    ds_wait = re.findall(r"mbarrier\.wait\(ds_full\.index\((.+?)\), (.+)\)\n", source)
    assert len(ds_wait) == 1, ds_wait
    return {
        "counts": counts,
        "stage": find(r"\n\s+stage = (.+)\n"),
        "free": find(r"mbarrier\.wait\(free\.index\(stage\), (.+)\)\n"),
        "kv_ready": find(r"mbarrier\.wait\(kv_ready\.index\(c\), (.+)\)\n"),
        "ready": find(r"mbarrier\.wait\(ready\.index\(stage\), (.+)\)\n"),
        "ds_store": find(r"ds_smem\.index\((.+)\)\.store\(dsT\)"),
        "ds_arrive": find(r"mbarrier\.arrive\(ds_full\.index\((.+)\), count=1\)"),
        "free_arrive": find(r"mbarrier\.arrive\(free\.index\((.+)\), count=1\)"),
        "ds_pair": ds_wait[0][0], "ds_full": ds_wait[0][1],
        "dq_free": find(r"mbarrier\.wait\(dq_free\.index\(CID\), (.+)\)\n"),
        "ds_read": find(r"ds_smem\.index\((.+)\)\.permute"),
        "dq_ready": find(r"mbarrier\.wait\(dq_ready\.index\(c\), (.+)\)\n"),
    }


def _programs(proto: dict, tiles: int, stages: int, gqa: bool = False) -> list[list[tuple]]:
    """(producer, consumer 0, consumer 1, dQ writer) op lists of one program walking
    ``tiles`` q tiles, as bwd_gluon.tmpl's partitions issue them. The producer loads K, V
    of each consumer's keys once (kv_ready), then each tile's Q, dO, lse and delta rows into
    ring stage it % STAGES ("q": one TMA transaction on ready) after the stage's free wait.
    A consumer waits for both consumers' K (its dQ columns read all keys), and per tile:
    the stage's ready, its wgmmas reading the stage, its dS^T into its buffer of the tile's
    pair and an arrival on ds_full, the wgmmas retired and the stage freed, then ds_full's
    wait, dq_free's, its dQ wgmmas reading both consumers' dS^T of the tile, its dQ columns
    into its buffer and an arrival on dq_ready. The writer reduces both buffers of a tile
    (read until tma.store_wait) and frees both. ``gqa``: the producer also stores each
    tile's code into the stage's code slot before the loads that arrive on ready, and the
    consumers read it before they free the stage."""
    def ev(name, **names):
        return eval(proto[name], {"STAGES": stages, "CONSUMERS": CONSUMERS, **names})

    producer = [("load", ("kv", c), "kv", ("kv_ready", c)) for c in range(CONSUMERS)]
    consumers = [[] for _ in range(CONSUMERS)]
    writer = []
    for it in range(tiles):
        stage = ev("stage", it=it)
        producer += backward_producer_tile(ev, it, gqa)
        for cid, ops in enumerate(consumers):
            if it == 0:
                for c in range(CONSUMERS):
                    ops += [("wait", ("kv_ready", c), ev("kv_ready", c=c)),
                            ("read", ("kv", c), "kv")]
            mine = ("ds", ev("ds_store", it=it, CID=cid))
            pair = ev("ds_pair", it=it)
            reads = [("ds", ev("ds_read", it=it, c=c)) for c in range(CONSUMERS)]
            ops += [("wait", ("ready", stage), ev("ready", it=it))]
            ops += [("read", ("code", stage), it), ("done", ("code", stage))] if gqa else []
            ops += [("read", ("q", stage), it),
                    ("write", mine, (it, cid)),
                    ("arrive", ("ds_full", ev("ds_arrive", it=it))),
                    ("done", ("q", stage)),
                    ("arrive", ("free", ev("free_arrive", stage=stage))),
                    ("wait", ("ds_full", pair), ev("ds_full", it=it)),
                    ("wait", ("dq_free", cid), ev("dq_free", it=it))]
            ops += [("read", buffer, (it, c)) for c, buffer in enumerate(reads)]
            ops += [("done", buffer) for buffer in reads]
            ops += [("write", ("dq", cid), it), ("arrive", ("dq_ready", cid))]
        for c in range(CONSUMERS):
            writer += [("wait", ("dq_ready", c), ev("dq_ready", it=it)), ("read", ("dq", c), it)]
        writer += [("done", ("dq", c)) for c in range(CONSUMERS)]
        writer += [("arrive", ("dq_free", c)) for c in range(CONSUMERS)]
    return [producer, *consumers, writer]


def _check(source: str, tiles: int, stages: int, gqa: bool = False) -> int:
    proto = _protocol(source)
    return run_all_interleavings(_programs(proto, tiles, stages, gqa), proto["counts"])


@pytest.mark.parametrize("stages, gqa", [(2, False), (3, False), (4, False), (2, True),
                                         (3, True)])
@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 5, 7])
def test_backward_protocol_never_hangs_or_races(tiles, stages, gqa):
    """Every interleaving of the four partitions: none waits forever, each consumer reads
    its own tile's Q/dO stage (with GQA its code) and both consumers' dS^T of that tile,
    each writer reduce reads its tile's dQ columns, and no load or store writes a buffer
    still read (the ring's stages, the two dS^T pairs across tiles, the dQ buffers)."""
    assert _check(backward_source(), tiles, stages, gqa) > 0


@pytest.mark.parametrize("mistake, old, new, message", [
    # one dS^T pair instead of two: a consumer overwrites its dS^T of tile it while the
    # other's dQ wgmmas of that tile still read it
    ("one dS pair", "(it % 2) * CONSUMERS", "0 * CONSUMERS", "in use"),
    # the producer's first wait on a fresh "free" barrier for parity 0: never passes
    ("free parity", "((it // STAGES) & 1) ^ 1)", "(it // STAGES) & 1)", "wait forever"),
    # ds_full completing on one consumer's arrival: the other's dS^T read before written
    ("ds_full count", "mbarrier.init(ds_full.index(i), count=CONSUMERS)",
     "mbarrier.init(ds_full.index(i), count=1)", "read"),
    # dq_free waited for the wrong phase: a consumer's dQ waits forever
    ("dq_free parity", "mbarrier.wait(dq_free.index(CID), (it & 1) ^ 1)",
     "mbarrier.wait(dq_free.index(CID), it & 1)", "wait forever"),
])
def test_the_model_catches_protocol_mistakes(mistake, old, new, message):
    """The check above can fail: each mistake, written into the template's text, makes the
    model hang or race."""
    source = backward_source()
    assert source.count(old) >= 1, mistake
    with pytest.raises(AssertionError, match=message):
        _check(source.replace(old, new), 4, 2)
