"""How the K/V shards reach each rank and how their dK/dV go back (``group.choose_method``).

Both exchanges give the same K/V shard at the same step (``ring.source(step)``) and take each
step's dK/dV contribution with ``add_grads``; ``grads`` returns this rank's own dK, dV summed
over the group. The step loop in ``ring`` is the same for both.
"""
from __future__ import annotations

from .comm import DKV_TAG, KV_TAG, Ring, gather_shards, reduce_scatter_shards


class RingExchange:
    """K/V shift one rank per step while the step runs; the dK/dV accumulators travel behind
    them, each rank adding its share, and are home after a full turn."""

    def __init__(self, ring: Ring):
        self.ring, self.incoming = ring, None

    def shards(self, kv):
        """Each step's [K, V]; the next shift is in flight while the caller computes. Closed
        early (a step raised: ``close``), it waits for that shift: every rank raising at the
        same step leaves the group with nothing in flight, so its next collective runs."""
        for step in range(self.ring.world):
            transfer = self.ring.shift(kv, KV_TAG) if step < self.ring.world - 1 else None
            try:
                yield kv
            except GeneratorExit:
                if transfer is not None:
                    transfer.wait()
                raise
            if transfer is not None:
                kv = transfer.wait()

    def add_grads(self, step: int, dkv) -> None:
        if self.incoming is not None:  # what the earlier ranks added for the same K/V shard
            for acc, g in zip(dkv, self.incoming.wait()):
                acc += g
        self.incoming = self.ring.shift(dkv, DKV_TAG)

    def grads(self):
        return self.incoming.wait()

    def close(self) -> None:
        """Wait for the dK/dV shift in flight, if any (a step raised: see ``shards``)."""
        if self.incoming is not None:
            self.incoming.wait()
            self.incoming = None


class GatherExchange:
    """Every K/V shard gathered once up front; each rank's dK/dV for every shard are
    reduce-scattered to the shards' owners at the end."""

    def __init__(self, ring: Ring):
        self.ring, self.per_source = ring, [None] * ring.world

    def shards(self, kv):
        gathered = gather_shards(self.ring, kv)
        for step in range(self.ring.world):
            yield gathered[self.ring.source(step)]

    def add_grads(self, step: int, dkv) -> None:
        self.per_source[self.ring.source(step)] = dkv

    def grads(self):
        return reduce_scatter_shards(self.ring, self.per_source)

    def close(self) -> None:
        """Nothing is in flight between steps (the shards were gathered up front)."""


EXCHANGES = {"ring": RingExchange, "allgather": GatherExchange}
