"""The barrier protocol of the Gluon backward's E = 256 kernel (bwd_gluon_wide.tmpl, with the
producer of bwd_gluon_shared.tmpl) on the CPU: the producer warp and both consumer
warpgroups of one program in every interleaving, on mbarrier_model.py's model, with each
barrier's count and parity read from the templates. Both consumers work on the same keys:
each stores its half of the tile's P^T and dS^T, and both read both halves (dV, dK and dQ
wgmmas), so the halves are written again only once both consumers' reads of the tile
before are done (pds_free). The order of each partition's operations is written out in
``_programs``; a template that reorders them needs the model changed with it."""
from __future__ import annotations

import re

import pytest

from flexfa.codegen.template import load_template
from mbarrier_model import (backward_producer_tile, barrier_counts, find_one,
                            run_all_interleavings)

CONSUMERS = 2


def wide_source() -> str:
    return load_template("bwd_gluon_wide.tmpl") + load_template("bwd_gluon_shared.tmpl")


def _protocol(source: str) -> dict:
    def find(pattern: str) -> str:
        return find_one(pattern, source)

    counts = barrier_counts(source, CONSUMERS)
    return {
        "counts": counts,
        "stage": find(r"\n\s+stage = (.+)\n"),
        "free": find(r"mbarrier\.wait\(free\.index\(stage\), (.+)\)\n"),
        "kv_ready": find(r"mbarrier\.wait\(kv_ready\.index\(0\), (.+)\)\n"),
        "ready": find(r"mbarrier\.wait\(ready\.index\(stage\), (.+)\)\n"),
        # (None where the template has no such wait: the model then issues none)
        "pds_free": next(iter(re.findall(r"mbarrier\.wait\(pds_free\.index\(0\), (.+)\)\n",
                                         source)), None),
        "pds_full": find(r"mbarrier\.wait\(pds_full\.index\(0\), (.+)\)\n"),
        # the half of P^T and dS^T a consumer stores, as an expression of CID
        "half": find(r"pt_smem\.slice\((.+?) \* SPLIT, SPLIT, dim=0\)\.store"),
    }


def _programs(proto: dict, tiles: int, stages: int, gqa: bool = False) -> list[list[tuple]]:
    """(producer, consumer 0, consumer 1) op lists of one program walking ``tiles`` q tiles,
    as the templates issue them: the producer loads K and V once (kv_ready), then each
    tile's Q, dO, lse and delta rows into ring stage it % STAGES ("q") after the stage's
    free wait (with GQA the tile's code first). A consumer waits for K and V, then per tile:
    the stage's ready; S and dP read the stage; pds_free's wait; its half of P^T and dS^T
    written and pds_full's arrival; pds_full's wait; dV, dK and dQ read both halves (and the
    stage); the stage freed once dV and dK retired, the halves once dQ's last slice did."""
    def ev(name, **names):
        return eval(proto[name], {"STAGES": stages, "CONSUMERS": CONSUMERS, **names})

    producer = [("load", "kv", "kv", ("kv_ready", 0))]
    consumers = [[] for _ in range(CONSUMERS)]
    halves = [("pds", h) for h in range(CONSUMERS)]
    for it in range(tiles):
        stage = ev("stage", it=it)
        producer += backward_producer_tile(ev, it, gqa)
        for cid, ops in enumerate(consumers):
            if it == 0:
                ops += [("wait", ("kv_ready", 0), ev("kv_ready")), ("read", "kv", "kv")]
            ops += [("wait", ("ready", stage), ev("ready", it=it))]
            ops += [("read", ("code", stage), it), ("done", ("code", stage))] if gqa else []
            ops += [("read", ("q", stage), it)]
            if proto["pds_free"] is not None:
                ops += [("wait", ("pds_free", 0), ev("pds_free", it=it))]
            ops += [("write", halves[ev("half", CID=cid)], (it, cid)),
                    ("arrive", ("pds_full", 0)),
                    ("wait", ("pds_full", 0), ev("pds_full", it=it))]
            ops += [("read", half, (it, h)) for h, half in enumerate(halves)]
            ops += [("done", ("q", stage)), ("arrive", ("free", stage))]
            ops += [("done", half) for half in halves]
            ops += [("arrive", ("pds_free", 0))]
    return [producer, *consumers]


def _check(source: str, tiles: int, stages: int, gqa: bool = False) -> int:
    proto = _protocol(source)
    return run_all_interleavings(_programs(proto, tiles, stages, gqa), proto["counts"])


@pytest.mark.parametrize("stages, gqa", [(2, False), (3, False), (2, True)])
@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 5])
def test_wide_backward_protocol_never_hangs_or_races(tiles, stages, gqa):
    """Every interleaving: none waits forever, each consumer reads its tile's stage (with GQA
    its code) and both halves of that tile's P^T and dS^T, and nothing is written while a
    partition still reads it."""
    assert _check(wide_source(), tiles, stages, gqa) > 0


@pytest.mark.parametrize("mistake, old, new, message", [
    # pds_free waited for the phase of the tile itself: the first tile's wait never passes
    ("pds_free parity", "mbarrier.wait(pds_free.index(0), (it & 1) ^ 1)",
     "mbarrier.wait(pds_free.index(0), it & 1)", "wait forever"),
    # no wait before storing the halves: one consumer overwrites a half the other reads
    ("no pds_free wait", "mbarrier.wait(pds_free.index(0), (it & 1) ^ 1)\n", "", "in use"),
    # pds_full completing on one arrival: a half read before the other consumer wrote it
    ("pds_full count", "mbarrier.init(pds_full.index(0), count=CONSUMERS)",
     "mbarrier.init(pds_full.index(0), count=1)", "read"),
    # both consumers storing the first half
    ("one half", "pt_smem.slice(CID * SPLIT", "pt_smem.slice(0 * SPLIT", "in use|read"),
])
def test_the_model_catches_wide_protocol_mistakes(mistake, old, new, message):
    source = wide_source()
    assert source.count(old) == 1, mistake
    with pytest.raises(AssertionError, match=message):
        _check(source.replace(old, new), 3, 2)
