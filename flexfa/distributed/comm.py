"""Point-to-point ring transfers: each rank sends tensors to the next rank of the group and
receives the same number from the previous one, asynchronously, so the step's compute runs
while they travel. Tags keep the forward's K/V, the backward's K/V and the dK/dV accumulators
apart (gloo matches messages by tag; NCCL by order, which the ring keeps the same on every
rank)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from .group import NOT_A_MEMBER

KV_TAG, DKV_TAG = 0, 8


class Ring:
    """A process group seen as a ring: ``rank``, ``world``, and the global ranks of the next
    and previous members."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:  # torch's answer for a process outside the group
            raise InputError(NOT_A_MEMBER)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) \
            if group is not None else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) \
            if group is not None else (self.rank - 1) % self.world

    def source(self, step: int) -> int:
        """The rank whose K/V shard this rank holds at ring step ``step``."""
        return (self.rank - step) % self.world

    def shift(self, tensors, tag: int) -> "Transfer":
        """Send ``tensors`` to the next rank, receive same-shaped tensors from the previous
        one; ``wait()`` returns them."""
        sent = [t.contiguous() for t in tensors]  # kept alive until the sends complete
        if self.world == 1:  # the ring is this rank alone: what it sends comes back
            return Transfer([], sent, sent)
        received = [torch.empty_like(t) for t in sent]
        # one batch: under NCCL the sends and receives of a ring form one group call, so no
        # rank's send waits behind its own receive
        ops = [op for i, (out, into) in enumerate(zip(sent, received))
               for op in (dist.P2POp(dist.isend, out, self.next, self.group, tag + i),
                          dist.P2POp(dist.irecv, into, self.prev, self.group, tag + i))]
        return Transfer(dist.batch_isend_irecv(ops), sent, received)


class Transfer:
    """Transfers in flight; ``wait`` blocks until all are done and returns what arrived."""

    def __init__(self, works, sent, received):
        self.works, self.sent, self.received = works, sent, received

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


# torch renamed the tensor collectives (the old names warn); both take (output, input, group=)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_shards(ring: Ring, tensors) -> list[list[torch.Tensor]]:
    """All-gather: ``[source rank][i]`` = the ``tensors[i]`` of every rank of the group, one
    collective per tensor (``world == 1``: the tensors themselves)."""
    if ring.world == 1:
        return [list(tensors)]
    gathered = []
    for t in tensors:
        # the collectives concatenate along dim 0 (B): W x B rows, rank r's are the r-th B
        into = t.new_empty((ring.world * t.shape[0], *t.shape[1:]))
        _all_gather(into, t.contiguous(), group=ring.group)
        gathered.append(into.chunk(ring.world))
    return [list(per_source) for per_source in zip(*gathered)]


def reduce_scatter_shards(ring: Ring, per_source) -> list[torch.Tensor]:
    """Reduce-scatter: ``per_source[s][i]`` is this rank's contribution to rank s's tensor i;
    returns this rank's tensors summed over the group."""
    if ring.world == 1:
        return list(per_source[0])
    summed = []
    for parts in zip(*per_source):
        into = torch.empty_like(parts[0])
        _reduce_scatter(into, torch.cat(parts), group=ring.group)
        summed.append(into)
    return summed
