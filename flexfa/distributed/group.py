"""Which process group the context-parallel ranks form, and how K/V reach them.

``group`` may be a ProcessGroup, None (the world group) or a DeviceMesh: a 1-D mesh, or any
mesh with ``mesh_dim`` naming the context-parallel dimension (an int or the dimension's name).

The K/V exchange (``method``):

- ``"ring"``: W-1 point-to-point shifts of one K/V shard, each under a step's kernel; wins for
  large shards (transfers hide behind compute; a rank holds 2 shards).
- ``"allgather"``: one all-gather of every K/V shard before the first step, dK/dV
  reduce-scattered; wins for small shards (per-message latency dominates; W shards fit).
- ``"auto"``: ``"allgather"`` if this rank's K + V shard is at most ``ALLGATHER_MAX_BYTES``,
  else ``"ring"``.

Every rank has the same shapes, so every rank makes the same choice.
"""
from __future__ import annotations

import torch.distributed as dist

from ..errors import InputError, InputTypeError

# 4 MiB of K + V per rank: below it a ring shift (tens of microseconds of NCCL latency) costs
# about as much as moving the bytes, and the gathered copy (W shards) stays small
ALLGATHER_MAX_BYTES = 4 << 20
METHODS = ("auto", "ring", "allgather")
NOT_A_MEMBER = ("ring_attention: this process is not a member of group; call ring_attention on "
                "the group's ranks only")


def resolve_group(group, mesh_dim):
    """The ProcessGroup (or None: the world) of ``group`` / ``mesh_dim``."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if mesh_dim is None and group.ndim != 1:
            raise InputError(f"ring_attention: group is a {group.ndim}-D DeviceMesh "
                             f"(dims {group.mesh_dim_names}); pass mesh_dim= to name the "
                             f"context-parallel dimension")
        return group.get_group(mesh_dim)
    if mesh_dim is not None:
        raise InputError(f"ring_attention: mesh_dim={mesh_dim!r} needs group to be a "
                         f"DeviceMesh, got {type(group).__name__}")
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:  # new_group's
        raise InputError(NOT_A_MEMBER)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise InputTypeError(f"ring_attention: group must be a ProcessGroup, a DeviceMesh or "
                             f"None, got {type(group).__name__}")
    return group


def choose_method(method, key, value) -> str:
    """``"ring"`` or ``"allgather"`` for ``method`` (see the table above)."""
    if method not in METHODS:
        raise InputError(f"ring_attention: method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    shard_bytes = key.nbytes + value.nbytes
    return "allgather" if shard_bytes <= ALLGATHER_MAX_BYTES else "ring"
