"""A list-scheduling model of the causal forward's grid order and of the Gluon backward's
parts on two streams (no GPU needed).

The GPU hands programs to free slots in grid order. Under a causal mask, q tile i of a head
walks i + 1 kv tiles. With the heads on the grid's slow axis and the q tiles reversed, the
programs run head by head, longest first within each head, so the last head's longest tiles
start near the end; with the heads on the fast axis, the order is longest first across all
heads (list scheduling in longest-processing-time order). Prints each order's makespan over
the ideal (total work / slots) for a few benchmark shapes.

The Gluon backward runs one program per (kv block, kv head) in parts of a few kv heads, part
i on stream i % 2, a stream's next part after its last program ends. Its model: one program
per SM; programs start in grid order as SMs free up, an earlier launch's first; under a
causal mask kv block j walks (q tiles - 2 j) q tiles of 64 rows per query head of its group.
It prints the makespan over the ideal with the kv blocks on the grid's fast axis (the grid
before f8a67d8) and with the kv heads there (kernel_grid).

    python benchmarks/experiments/grid_order_model.py
"""
from __future__ import annotations

import heapq


def makespan(durations, slots: int) -> float:
    """Each program, in order, starts on the slot that frees first."""
    free = [0.0] * slots
    for duration in durations:
        heapq.heappush(free, heapq.heappop(free) + duration)
    return max(free)


def ratios(q_tiles: int, heads: int, slots: int, overhead: float = 2.0) -> tuple[float, float]:
    """(heads slow, heads fast) makespan / ideal; a program costs its kv tiles plus
    ``overhead`` tiles' worth of prologue and epilogue."""
    per_head = [i + 1 + overhead for i in reversed(range(q_tiles))]
    heads_slow = per_head * heads
    heads_fast = [d for d in per_head for _ in range(heads)]
    ideal = sum(heads_slow) / slots
    return makespan(heads_slow, slots) / ideal, makespan(heads_fast, slots) / ideal


def parts_on_streams(parts: list, sms: int, streams: int = 2) -> float:
    """Makespan of ``parts`` (each a list of program durations in grid order), part i on
    stream i % streams: a part is launched when the stream's previous part has ended; free
    SMs take the pending programs of the earliest launch first."""
    queues = [parts[s::streams] for s in range(streams)]
    launched, running, free, now = [], [], sms, 0.0  # launched: [order, stream, pending, left]
    order = 0

    def launch(stream: int) -> None:
        nonlocal order
        if queues[stream]:
            part = queues[stream].pop(0)
            launched.append([order, stream, list(part), len(part)])
            order += 1
    for stream in range(streams):
        launch(stream)
    while True:
        for entry in sorted(launched):
            while free and entry[2]:
                heapq.heappush(running, (now + entry[2].pop(0), entry[0]))
                free -= 1
        if not running:
            return now
        now, done = heapq.heappop(running)
        free += 1
        entry = next(e for e in launched if e[0] == done)
        entry[3] -= 1
        if entry[3] == 0:
            launched.remove(entry)
            launch(entry[1])


def backward_ratios(kv_blocks: int, q_tiles: int, group: int, pairs: int, per_part: int,
                    sms: int = 132) -> tuple[float, float]:
    """(kv blocks fast, kv heads fast) makespan / ideal of the causal Gluon backward over
    ``pairs`` (batch, kv head) pairs in parts of ``per_part``."""
    walk = [group * (q_tiles - 2 * j) for j in range(kv_blocks)]
    blocks_fast = [walk * per_part for _ in range(pairs // per_part)]
    heads_fast = [[w for w in walk for _ in range(per_part)] for _ in range(pairs // per_part)]
    ideal = sum(walk) * pairs / sms
    return (parts_on_streams(blocks_fast, sms) / ideal,
            parts_on_streams(heads_fast, sms) / ideal)


def main() -> None:
    # (label, q tiles per head, B * H, program slots: 132 SMs x 2 programs)
    cases = [("S=16384 E=128, 128-row tiles", 128, 16, 264),
             ("S=8192, B=2", 64, 32, 264),
             ("S=2048, B=8", 16, 128, 264)]
    print(f"{'causal forward':32} {'heads slow':>11} {'heads fast':>11}")
    for label, q_tiles, heads, slots in cases:
        slow, fast = ratios(q_tiles, heads, slots)
        print(f"{label:32} {slow:11.4f} {fast:11.4f}")
    # (label, kv blocks of 128 keys, q tiles of 64 rows, GQA group, (batch, kv head) pairs,
    # pairs a part: GLUON_BWD_DQ_CHUNKS 4 in two slots)
    backward = [("B=1 H=16 S=16384", 128, 256, 1, 16, 2),
                ("GQA 4: B=2 Hkv=8 S=8192", 64, 128, 4, 16, 2)]
    print(f"{'causal Gluon backward':32} {'blocks fast':>11} {'heads fast':>11}")
    for label, kv_blocks, q_tiles, group, pairs, per_part in backward:
        slow, fast = backward_ratios(kv_blocks, q_tiles, group, pairs, per_part)
        print(f"{label:32} {slow:11.4f} {fast:11.4f}")


if __name__ == "__main__":
    main()
