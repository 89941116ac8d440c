"""The Gluon forward's persistent grid (GLUON_PERSISTENT) on the CPU: its barrier protocol
across work tiles checked in every interleaving of the producer and the two consumers on an
mbarrier model (mbarrier_model.py; with and without the ping-pong turns), with the phase parities and ring
indices read from fwd_gluon.tmpl; the work tiles' order (the rendered arithmetic run as
Python); the option's spec, flag and grid. Its sm_90 compile check is in
test_gluon_compile.py, its GPU tests in tests/gpu/test_gluon_gpu.py."""
from __future__ import annotations

import dataclasses
import re
import types

import pytest
import torch

import flexfa
from flexfa.codegen.gluon import gluon_kernel
from flexfa.codegen.template import load_template
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families.gluon import FIXED_SMS, gluon_grid, gluon_spec
from flexfa.runtime.outputs import head_group
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.target import Target
from mbarrier_model import run_all_interleavings

SM90 = Target("cuda", 9, 0)
FORCED = {"BACKEND": "GLUON"}

# barrier -> arrivals that complete a phase (fwd_gluon.tmpl's mbarrier.init counts)
COUNTS = {"q_ready": 1, "q_free": 1, "k_ready": 1, "v_ready": 1, "k_free": 2, "v_free": 2,
          "turn": 1}
MODEL_GL = types.SimpleNamespace(maximum=max)  # what the counters' expressions call


def _protocol(source: str) -> dict:
    """The template's parity and ring-index expressions, by name (evaluated with j, i, t, n,
    total and STAGES)."""
    def find(pattern: str) -> str:
        found = re.findall(pattern, source)
        assert len(found) == 1, (pattern, found)
        return found[0]
    return {
        "q_free": find(r"mbarrier\.wait\(q_free\.index\(c\), (.+)\)\n"),
        "q_ready": find(r"mbarrier\.wait\(q_ready\.index\(CID\), (.+)\)\n"),
        "n": find(r"\n\s+n = (.+)\n"),
        "free": find(r"free_phase = (.+)\n"),
        "first_ready": find(r"mbarrier\.wait\(k_ready\.index\(i % STAGES\), (.+)\)\n"),
        "stage": find(r"\n\s+stage = (\(i .+)\n"),
        "prev": find(r"\n\s+prev = (.+)\n"),
        "k_ready": find(r"mbarrier\.wait\(k_ready\.index\(stage\), (.+)\)\n"),
        "v_ready": find(r"mbarrier\.wait\(v_ready\.index\(prev\), (.+)\)\n"),
        "last": find(r"\n\s+last = (.+)\n"),
        "last_ready": find(r"mbarrier\.wait\(v_ready\.index\(last\), (.+)\)\n"),
        "turn": find(r"mbarrier\.wait\(turn\.index\(CID\), (.+)\)\n"),
        "turn_to": find(r"mbarrier\.arrive\(turn\.index\((.+)\), count=1\)"),
        # the counters of the next work tile: the producer's, then the consumers'
        "next": re.findall(r"\n\s+return (j [^\n]+)\n", source),
    }


def _programs(proto: dict, totals: list[int], stages: int, q_free_wait: bool = True,
              pingpong: bool = False, dynamic: bool = False):
    """(producer, consumer 0, consumer 1) op lists of one program walking work tiles with
    these kv-tile counts, as fwd_gluon.tmpl's partitions issue them, each carrying its
    counters (j, i) from tile to tile as the template's returns say. Ops: ("wait", barrier,
    parity), ("arrive", barrier), ("load", buffer, value, barrier) (TMA: written and arrived
    at once), ("read", buffer, value) (from here on the buffer is in use), ("done", buffer);
    with ``pingpong`` the consumers' turns too, and ("issue", c) where consumer c issues a
    step's GEMMs; with ``dynamic`` (GLUON_PERSISTENT="DYNAMIC") the producer writes each
    tile's number into consumer c's slot ("write", buffer, value: in place, no arrival)
    after its q_free wait, the consumer reads it after its q_ready wait, and after the last
    tile the producer writes the end into each slot and arrives on q_ready without a load,
    which the consumers wait for and read."""
    def ev(name, **names):
        return eval(proto[name], {"STAGES": stages, "gl": MODEL_GL, **names})

    assert len(proto["next"]) == 2, proto["next"]
    producer, consumers = [], [[], []]
    produced, consumed = (0, 0), (0, 0, 0)  # (j, i[, u]) of the first tile: all 0
    for tile, total in enumerate(totals):
        j, i = produced
        for c in (0, 1):
            if q_free_wait:
                producer.append(("wait", ("q_free", c), ev("q_free", j=j)))
            if dynamic:
                producer.append(("write", ("slot", c), tile))
            producer.append(("load", ("q", c), tile, ("q_ready", c)))
        for t in range(total):
            n = ev("n", i=i, t=t)
            for kv in "kv":
                producer += [("wait", (f"{kv}_free", n % stages), ev("free", n=n)),
                             ("load", (kv, n % stages), (tile, t), (f"{kv}_ready", n % stages))]
        produced = eval(proto["next"][0], {"j": j, "i": i, "walk": (0, total)})
        j, i, u = consumed
        for c, ops in enumerate(consumers):
            ops += [("wait", ("q_ready", c), ev("q_ready", j=j))]
            if dynamic:
                ops += [("read", ("slot", c), tile), ("done", ("slot", c))]
            ops += [("read", ("q", c), tile)]
            if total:
                first = i % stages
                ops += [("wait", ("k_ready", first), ev("first_ready", i=i)),
                        ("read", ("k", first), (tile, 0)), ("done", ("k", first)),
                        ("arrive", ("k_free", first))]
                for t in range(1, total):
                    stage, prev = ev("stage", i=i, t=t), ev("prev", i=i, t=t)
                    ops += [("wait", ("k_ready", stage), ev("k_ready", i=i, t=t))]
                    if pingpong:
                        ops += [("wait", ("turn", c), ev("turn", u=u, t=t, CID=c)), ("issue", c)]
                    ops += [("read", ("k", stage), (tile, t)),
                            ("wait", ("v_ready", prev), ev("v_ready", i=i, t=t)),
                            ("read", ("v", prev), (tile, t - 1))]
                    if pingpong:
                        ops += [("arrive", ("turn", ev("turn_to", CID=c)))]
                    ops += [("done", ("k", stage)), ("arrive", ("k_free", stage)),
                            ("done", ("v", prev)), ("arrive", ("v_free", prev))]
                last = ev("last", i=i, total=total)
                ops += [("done", ("q", c)), ("arrive", ("q_free", c)),
                        ("wait", ("v_ready", last), ev("last_ready", i=i, total=total)),
                        ("read", ("v", last), (tile, total - 1)), ("done", ("v", last)),
                        ("arrive", ("v_free", last))]
            else:  # no kv tile: Q released at once, out = 0 stored
                ops += [("done", ("q", c)), ("arrive", ("q_free", c))]
        consumed = eval(proto["next"][1], {"j": j, "i": i, "u": u, "total": total,
                                           "gl": MODEL_GL})
    if dynamic:  # the end: no tile left
        j = produced[0]
        for c in (0, 1):
            producer += [("wait", ("q_free", c), ev("q_free", j=j)), ("write", ("slot", c), "end"),
                         ("arrive", ("q_ready", c))]
            consumers[c] += [("wait", ("q_ready", c), ev("q_ready", j=consumed[0])),
                             ("read", ("slot", c), "end"), ("done", ("slot", c))]
    return producer, *consumers


# a program's work tiles by kv-tile count: none, one empty tile, odd and even counts, empty
# tiles between and last, rings wrapping within and across tiles
WALKS = ([], [0], [1], [3], [2, 0], [1, 2, 3], [0, 3, 0], [4, 1, 0, 2])


@pytest.mark.parametrize("stages, pingpong, dynamic", [
    (2, False, False), (3, False, False), (2, True, False), (2, False, True), (3, True, True)])
def test_persistent_protocol_never_hangs_or_races(stages, pingpong, dynamic):
    """fwd_gluon.tmpl's barriers across work tiles, in every interleaving: no partition waits
    forever, each consumer reads the Q, K and V of its own work tile and kv tile, no TMA
    load writes a buffer a consumer still reads; with the ping-pong turns (GLUON_PINGPONG)
    the consumers issue their steps' GEMMs alternately across tiles, consumer 0 first; with
    the tiles from a counter (DYNAMIC) each consumer reads its own tile's number from its
    slot, then the end."""
    proto = _protocol(load_template("fwd_gluon.tmpl"))
    for totals in WALKS:
        assert run_all_interleavings(_programs(proto, totals, stages, pingpong=pingpong,
                                               dynamic=dynamic), COUNTS) > 0, totals


def test_persistent_model_catches_a_missing_q_release():
    """The model fails where the producer loaded the next tile's Q without waiting for
    q_free (so the check above can fail)."""
    proto = _protocol(load_template("fwd_gluon.tmpl"))
    with pytest.raises(AssertionError, match="in use|read"):
        run_all_interleavings(_programs(proto, [2, 1], 2, q_free_wait=False), COUNTS)
    # and where the producer wrote the next tile's number before the consumer read its own
    with pytest.raises(AssertionError, match="in use|read"):
        run_all_interleavings(_programs(proto, [1, 1], 2, q_free_wait=False, dynamic=True),
                              COUNTS)


def test_persistent_option_spec_and_grid():
    """GLUON_PERSISTENT (default off without a block mask) reaches the spec and the kernel's
    flag, alone and with GLUON_PINGPONG; the grid is min(SMs, work tiles), SMs fixed without
    a GPU."""
    q = k = v = torch.zeros(1, 2, 1000, 128, dtype=torch.bfloat16)
    plain, chosen = (gluon_spec(q, k, v, AttentionCall(None, None, None, 0.125,
                                                       parse_kernel_options(options), 1),
                                SM90, False, False)
                     for options in (FORCED, {**FORCED, "GLUON_PERSISTENT": True}))
    assert (plain.persistent, chosen.persistent) == (False, True)
    plain_kernel, chosen_kernel = gluon_kernel(plain, None, None), gluon_kernel(chosen, None, None)
    assert plain_kernel.key != chosen_kernel.key
    assert "PERSISTENT = tl.constexpr(True)" in chosen_kernel.source
    assert "PERSISTENT = tl.constexpr(False)" in plain_kernel.source
    assert "BATCH_HEADS" in chosen_kernel.params
    cpu = torch.device("cpu")
    assert gluon_grid(chosen, 2 * 16, 8, cpu) == (FIXED_SMS,)  # 256 work tiles
    assert gluon_grid(chosen, 2, 8, cpu) == (16,)
    assert gluon_grid(plain, 2, 8, cpu) == (8, 2)  # dense: (q tiles, B * H)
    both = parse_kernel_options({"GLUON_PERSISTENT": True, "GLUON_PINGPONG": True})
    assert both.gluon_persistent and both.gluon_pingpong
    with pytest.raises(flexfa.InputTypeError, match=r"\['GLUON_PERSISTENT'\] must be True, "
                       r"False, 'DYNAMIC' or 'AUTO', got int 1"):
        parse_kernel_options({"GLUON_PERSISTENT": 1})
    with pytest.raises(flexfa.InputError, match=r"got 'atomic'"):
        parse_kernel_options({"GLUON_PERSISTENT": "atomic"})
    assert parse_kernel_options({"GLUON_PERSISTENT": "dynamic"}).gluon_persistent == "DYNAMIC"


def _arguments(kernel) -> str:
    """The generated kernel function's parameter list."""
    start = kernel.source.index(f"def {kernel.name}(")
    return kernel.source[start:kernel.source.index(")", start)]


def test_dynamic_option_spec_counter_and_grid():
    """GLUON_PERSISTENT="DYNAMIC" makes a persistent spec with the counter: the kernel's
    DYNAMIC flag and its TILE_COUNTER argument (absent without it), the persistent grid."""
    q = k = v = torch.zeros(1, 2, 1000, 128, dtype=torch.bfloat16)
    static, dynamic = (gluon_spec(q, k, v, AttentionCall(None, None, None, 0.125,
                                                         parse_kernel_options(options), 1),
                                  SM90, False, False)
                       for options in ({**FORCED, "GLUON_PERSISTENT": True},
                                       {**FORCED, "GLUON_PERSISTENT": "DYNAMIC"}))
    assert (static.persistent, static.dynamic) == (True, False)
    assert (dynamic.persistent, dynamic.dynamic) == (True, True)
    static_kernel, dynamic_kernel = gluon_kernel(static, None, None), gluon_kernel(dynamic, None,
                                                                                     None)
    assert static_kernel.key != dynamic_kernel.key
    assert "DYNAMIC = tl.constexpr(True)" in dynamic_kernel.source
    assert "DYNAMIC = tl.constexpr(False)" in static_kernel.source
    assert "TILE_COUNTER" in _arguments(dynamic_kernel)
    assert "TILE_COUNTER" not in _arguments(static_kernel)
    assert gluon_grid(dynamic, 2 * 16, 8, torch.device("cpu")) == (FIXED_SMS,)


@pytest.mark.parametrize("value, with_mask, expected", [
    (None, True, (True, True)), ("AUTO", True, (True, True)), (None, False, (False, False)),
    (False, True, (False, False)), (True, True, (True, False)),
    ("DYNAMIC", False, (True, True))])
def test_persistent_default_is_dynamic_under_a_block_mask(value, with_mask, expected):
    """GLUON_PERSISTENT's default ("AUTO", None): the tiles from the counter where the call
    has a block mask (measured faster on causal and ALiBi + causal, docs/gluon.md), the
    plain grid without one; an explicit value holds either way."""
    q = k = v = torch.zeros(1, 2, 1000, 128, dtype=torch.bfloat16)
    mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, 1000, 1000,
                                    device="cpu") if with_mask else None
    options = {**FORCED} if value is None else {**FORCED, "GLUON_PERSISTENT": value}
    spec = gluon_spec(q, k, v, AttentionCall(None, None, mask, 0.125,
                                             parse_kernel_options(options), 1),
                      SM90, False, False)
    assert (spec.persistent, spec.dynamic) == expected


def _work_order(source: str, name: str, has_block_mask: bool, L: int, batch_heads: int,
                programs: int = 4, dynamic: bool = False, head_group: int | None = None):
    """The (q tile, batch * head) of each work tile w, from the rendered kernel's
    ``<name>_work`` and ``<name>_work_tiles`` (with fwd_common.tmpl's flexfa_head_groups)
    run as Python (their body is integer arithmetic) on a grid of ``programs``;
    ``head_group``: the dynamic order's HEAD_GROUP (None: every head in one group, as the
    kernel passes without DYNAMIC)."""
    namespace = {"HAS_BLOCK_MASK": has_block_mask, "BLOCK_M": 128, "DYNAMIC": dynamic,
                 "gl": types.SimpleNamespace(num_programs=lambda axis: programs),
                 f"{name}_tile": lambda sched, start_m, off_bh: (start_m, off_bh)}
    for function in (f"{name}_work_tiles", f"{name}_work", "flexfa_head_groups"):
        start = source.index(f"def {function}(")
        exec(source[start:source.index("\n\n\n", start)], namespace)
    sched = ((), batch_heads, 1, L, L, batch_heads if head_group is None else head_group)
    return [namespace[f"{name}_work"](sched, w)
            for w in range(namespace[f"{name}_work_tiles"](sched))]


def _persistent_kernel(has_block_mask: bool):
    q = k = v = torch.zeros(1, 2, 1000, 128, dtype=torch.bfloat16)
    spec = gluon_spec(q, k, v, AttentionCall(None, None, None, 0.125, parse_kernel_options(
        {**FORCED, "GLUON_PERSISTENT": True}), 1), SM90, False, False)
    return gluon_kernel(dataclasses.replace(spec, has_block_mask=has_block_mask), None, None)


@pytest.mark.parametrize("has_block_mask", [True, False])
def test_persistent_work_tiles_cover_every_tile_longest_first(has_block_mask):
    """Every (q tile, head) is one work tile; under a block mask the first BATCH_HEADS work
    tiles (the first the programs take) are every head's last q tile, then the one before,
    each odd round of the programs in reverse (snake order) but the last, incomplete one;
    dense, a head's q tiles are consecutive (shared K and V), last first."""
    kernel = _persistent_kernel(has_block_mask)
    # 8 q tiles x 6 heads on 5 programs: 9 complete rounds and 3 tiles over
    order = _work_order(kernel.source, kernel.name, has_block_mask, 1000, 6, programs=5)
    assert sorted(order) == [(m, bh) for m in range(8) for bh in range(6)]
    lpt = [(m, bh) for m in range(7, -1, -1) for bh in range(6)]
    if has_block_mask:
        snake = [lpt[r * 5 + (4 - p if r % 2 else p)] for r in range(9) for p in range(5)]
        assert order == snake + lpt[45:]
    else:
        assert order[:8] == [(m, 0) for m in range(7, -1, -1)]


@pytest.mark.parametrize("has_block_mask", [True, False])
def test_dynamic_work_tiles_are_longest_first(has_block_mask):
    """With the tiles from a counter (DYNAMIC) the work tiles are handed out in their
    number's order, so w is plain longest-first order: no snake under a block mask."""
    kernel = _persistent_kernel(has_block_mask)
    order = _work_order(kernel.source, kernel.name, has_block_mask, 1000, 6, programs=5,
                        dynamic=True)
    if has_block_mask:
        assert order == [(m, bh) for m in range(7, -1, -1) for bh in range(6)]
    else:
        assert order == [(m, bh) for bh in range(6) for m in range(7, -1, -1)]


@pytest.mark.parametrize("head_group", [1, 2, 4, 5, 6, 7, 100])
def test_dynamic_work_tiles_take_the_heads_in_groups(head_group):
    """Under a block mask the dynamic order goes through HEAD_GROUP heads at a time (the
    last group may be smaller): each group's tiles are contiguous, its heads' last q tile
    first, then the one before; every (q tile, head) exactly once; a group of at least
    BATCH_HEADS heads is the plain longest-first order. Without a block mask the group has
    no effect (a head's q tiles are together already)."""
    kernel = _persistent_kernel(True)
    order = _work_order(kernel.source, kernel.name, True, 1000, 6, programs=5, dynamic=True,
                        head_group=head_group)
    assert sorted(order) == [(m, bh) for m in range(8) for bh in range(6)]
    expected = [(m, bh) for first in range(0, 6, head_group) for m in range(7, -1, -1)
                for bh in range(first, min(first + head_group, 6))]
    assert order == expected
    if head_group >= 6:
        assert order == [(m, bh) for m in range(7, -1, -1) for bh in range(6)]
    dense = _persistent_kernel(False)
    assert _work_order(dense.source, dense.name, False, 1000, 6, programs=5, dynamic=True,
                       head_group=head_group) == [(m, bh) for bh in range(6)
                                                  for m in range(7, -1, -1)]


@pytest.mark.parametrize("S, E, dtype, group, option, expected", [
    (16384, 128, torch.bfloat16, 1, 0, 2),  # 8 MiB of K and V a head: 2 in 16 MiB
    (2048, 128, torch.bfloat16, 1, 0, 16),
    (16384, 64, torch.bfloat16, 1, 0, 4),
    (65536, 128, torch.bfloat16, 1, 0, 1),  # more than the budget: one head at a time
    (16384, 128, torch.bfloat16, 4, 0, 8),  # GQA: the group's query heads share K and V
    (16384, 128, torch.float32, 1, 0, 1),
    (16384, 128, torch.bfloat16, 1, 3, 3),  # kernel_options HEAD_GROUP
    (16384, 128, torch.bfloat16, 1, 1000, 64),  # never more than B * Hq (2 x 32)
    (16, 16, torch.bfloat16, 1, 0, 64),  # 1 KiB a head: all of them
])
def test_head_group_from_the_l2_budget(S, E, dtype, group, option, expected):
    """B = 2, 32 kv heads: the L2 budget's heads (times the GQA group), at most B * Hq."""
    q = torch.zeros(2, 32 * group, 1, E, dtype=dtype)
    k = v = torch.zeros(2, 32, S, E, dtype=dtype)
    call = AttentionCall(None, None, None, 0.125, parse_kernel_options(
        {"HEAD_GROUP": option}), group)
    assert head_group(call, q, k, v) == expected


def test_head_group_keeps_every_head_together_under_a_sparse_mask():
    """A sparse block mask (a sliding window visiting few tiles) keeps the plain order (one
    group of all B * Hq heads: grouped heads measured slower there); a causal one groups."""
    q = k = v = torch.zeros(2, 8, 4096, 128, dtype=torch.bfloat16)
    options = parse_kernel_options({})
    sliding, causal = (flexfa.create_block_mask(mask_mod, None, None, 4096, 4096, device="cpu")
                       for mask_mod in (flexfa.mods.sliding_window(256), flexfa.mods.causal))
    assert head_group(AttentionCall(None, None, sliding, 0.125, options, 1), q, k, v) == 16
    assert head_group(AttentionCall(None, None, causal, 0.125, options, 1), q, k, v) == 8
    pinned = parse_kernel_options({"HEAD_GROUP": 2})
    assert head_group(AttentionCall(None, None, sliding, 0.125, pinned, 1), q, k, v) == 2


def test_head_group_option_and_argument():
    """HEAD_GROUP: a non-negative int (bad values name the key); HEAD_GROUP is a kernel
    argument of every Gluon forward (forward_params'), only the dynamic one's sched uses it
    (the plain grid and the fixed walk keep every head at once)."""
    assert parse_kernel_options({}).head_group == 0
    assert parse_kernel_options({"HEAD_GROUP": 4}).head_group == 4
    with pytest.raises(flexfa.InputError, match=r"\['HEAD_GROUP'\] = -1 is not allowed"):
        parse_kernel_options({"HEAD_GROUP": -1})
    for bad in ("2", True, 2.0):
        with pytest.raises(flexfa.InputTypeError, match=r"\['HEAD_GROUP'\] must be an int"):
            parse_kernel_options({"HEAD_GROUP": bad})
    q = k = v = torch.zeros(1, 2, 1000, 128, dtype=torch.bfloat16)
    static, dynamic = (gluon_kernel(gluon_spec(q, k, v, AttentionCall(
        None, None, None, 0.125, parse_kernel_options({**FORCED, "GLUON_PERSISTENT": value}),
        1), SM90, False, False), None, None) for value in (True, "DYNAMIC"))
    assert "HEAD_GROUP" in _arguments(dynamic) and "HEAD_GROUP" in _arguments(static)
    assert "BATCH_HEADS, HQ, L, S, HEAD_GROUP)" in dynamic.source


def test_persistent_snake_order_balances_causal_programs():
    """Causal at S = 16384, H = 16 on 132 programs (the H200's SMs): q tile m walks m + 1 kv
    tiles; program p takes work tiles p, p + 132, ... The snake order keeps the busiest
    program within 1% of the mean; the plain longest-first order put it 5.7% over."""
    kernel = _persistent_kernel(True)
    programs, q_tiles, heads = 132, 128, 16
    order = _work_order(kernel.source, kernel.name, True, q_tiles * 128, heads, programs)
    loads = [sum(order[w][0] + 1 for w in range(p, len(order), programs))
             for p in range(programs)]
    mean = sum(loads) / programs
    assert max(loads) <= 1.01 * mean, (max(loads), mean)
    plain = [sum(q_tiles - w // heads for w in range(p, len(order), programs))
             for p in range(programs)]
    assert sum(plain) == sum(loads) and max(plain) > 1.05 * mean
