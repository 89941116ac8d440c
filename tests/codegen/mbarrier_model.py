"""An mbarrier model for the Gluon kernels' barrier protocols (test_gluon_persistent.py: the
forward's; test_gluon_bwd_protocol.py: the backward's): each partition is a list of ops, and
every interleaving of the partitions is run, failing where all of them wait forever, where
one reads a buffer holding other data than it expects, or where a buffer is written while a
partition still reads it.

Ops: ("wait", barrier, parity) passes once the barrier has completed a phase of that
parity (a fresh barrier's phase -1 counts as parity 1: it has completed 0 phases, and a
wait for parity 1 passes); ("arrive", barrier) counts one arrival, completing a phase at the
barrier's count; ("load", buffer, value, barrier) is a TMA load (the buffer written and one
arrival at once); ("write", buffer, value) a store by the partition itself, no arrival;
("read", buffer, value) from here on the partition reads the buffer, which must hold value;
("done", buffer) it stops reading it; ("issue", c) consumer c issues a ping-pong step's
GEMMs (consumer 0's k-th after consumer 1's k - 1 steps, consumer 1's k-th after consumer
0's k-th)."""
from __future__ import annotations

import re


def step(state, op, actor, counts: dict):
    """The state after ``op`` by partition ``actor`` (None: it waits); ``counts``: the
    arrivals that complete a phase, by barrier name (a barrier is (name, index))."""
    phases, pending, data, held, issued = state
    kind = op[0]
    if kind == "wait":
        return None if phases.get(op[1], 0) % 2 == op[2] else state
    phases, pending, data, held = dict(phases), dict(pending), dict(data), set(held)
    if kind == "issue":
        c = op[1]
        assert issued[1 - c] == issued[c] + c, f"consumer {c} issued out of turn: {issued}"
        issued = tuple(n + (k == c) for k, n in enumerate(issued))
    elif kind == "write":
        assert not any(buf == op[1] for _, buf in held), f"write into {op[1]} in use: {op}"
        data[op[1]] = op[2]
    elif kind in ("arrive", "load"):
        barrier = op[1] if kind == "arrive" else op[3]
        if kind == "load":
            assert not any(buf == op[1] for _, buf in held), f"load into {op[1]} in use: {op}"
            data[op[1]] = op[2]
        pending[barrier] = pending.get(barrier, 0) + 1
        if pending[barrier] == counts[barrier[0]]:
            pending[barrier] = 0
            phases[barrier] = phases.get(barrier, 0) + 1
    elif kind == "read":
        assert data.get(op[1]) == op[2], f"partition {actor} read {data.get(op[1])} for {op}"
        held.add((actor, op[1]))
    else:
        held.discard((actor, op[1]))
    return phases, pending, data, frozenset(held), issued


def run_all_interleavings(programs, counts: dict) -> int:
    """Every interleaving of the partitions' ``programs``; fails where all wait forever. The
    state is a function of the program counters, so each is visited once. Returns the number
    of states."""
    start = (0,) * len(programs)
    states = {start: ({}, {}, {}, frozenset(), (0, 0))}
    frontier = [start]
    while frontier:
        pcs = frontier.pop()
        state = states[pcs]
        moved = False
        for actor, (pc, program) in enumerate(zip(pcs, programs)):
            if pc == len(program):
                continue
            after = step(state, program[pc], actor, counts)
            if after is None:
                continue
            moved = True
            nxt = tuple(p + (a == actor) for a, p in enumerate(pcs))
            if nxt not in states:
                states[nxt] = after
                frontier.append(nxt)
        done = all(pc == len(p) for pc, p in zip(pcs, programs))
        assert moved or done, f"all partitions wait forever at {pcs}: " + ", ".join(
            str(p[pc]) for pc, p in zip(pcs, programs) if pc < len(p))
    return len(states)


def find_one(pattern: str, source: str) -> str:
    """The one value ``pattern``'s group takes in a template's ``source`` (an error if it
    takes none or several). An opaque copy (bwd_gluon_shared.tmpl's ``_opaque``, a ``mov``
    the compilers cannot move) is the value it copies: the producer's stage from an opaque
    copy of ``it`` is the consumers' ``it % STAGES``."""
    source = re.sub(r"\{\{KERNEL_NAME\}\}_opaque\((\w+)\)", r"\1", source)
    found = set(re.findall(pattern, source))
    assert len(found) == 1, (pattern, found)
    return found.pop()


def barrier_counts(source: str, consumers: int) -> dict:
    """Each barrier's arrival count, by name, from the template's mbarrier.init calls."""
    return {name: int(count) if count.isdigit() else {"CONSUMERS": consumers}[count]
            for name, count in re.findall(r"mbarrier\.init\((\w+)\.index\(\w+\), count=(\w+)\)",
                                          source)}


def backward_producer_tile(ev, it: int, gqa: bool) -> list[tuple]:
    """The Gluon backward producer's ops for tile ``it`` (bwd_gluon_shared.tmpl, both backward
    kernels): the stage's free wait, with GQA the tile's code into the stage's slot, then
    Q, dO, lse and delta into the stage ("q": one TMA transaction on ready). ``ev(name,
    **names)`` evaluates a template expression."""
    stage = ev("stage", it=it)
    return ([("wait", ("free", stage), ev("free", it=it))]
            + ([("write", ("code", stage), it)] if gqa else [])
            + [("load", ("q", stage), it, ("ready", stage))])
