"""A list-scheduling model of the causal forward's grid order (no GPU needed).

The GPU hands programs to free slots in grid order. Under a causal mask, q tile i of a head
walks i + 1 kv tiles. With the heads on the grid's slow axis and the q tiles reversed, the
programs run head by head, longest first within each head, so the last head's longest tiles
start near the end; with the heads on the fast axis, the order is longest first across all
heads (list scheduling in longest-processing-time order). Prints each order's makespan over
the ideal (total work / slots) for a few benchmark shapes.

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


def main() -> None:
    # (label, q tiles per head, B * H, program slots: 132 SMs x 2 programs)
    cases = [("S=16384 E=128, 128-row tiles", 128, 16, 264),
             ("S=8192, B=2", 64, 32, 264),
             ("S=2048, B=8", 16, 128, 264)]
    print(f"{'causal forward':32} {'heads slow':>11} {'heads fast':>11}")
    for label, q_tiles, heads, slots in cases:
        slow, fast = ratios(q_tiles, heads, slots)
        print(f"{label:32} {slow:11.4f} {fast:11.4f}")


if __name__ == "__main__":
    main()
