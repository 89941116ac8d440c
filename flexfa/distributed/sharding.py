"""How a sequence is split over the ranks of a context-parallel group.

Plain sharding: rank r holds the r-th of W equal chunks. Load-balanced (head-tail, "zig-zag")
sharding: the sequence is cut into 2W chunks and rank r holds chunks r and 2W-1-r, so under a
causal mask every rank has the same number of unmasked (q, kv) pairs. ``positions`` gives each
local row's global position; the ring's mods read it, so masks and score_mods see global
positions whatever the layout.
"""
from __future__ import annotations

import torch

from ..blockmask.checks import resolve_device
from ..errors import InputError, InputTypeError, check_bool, check_int, dims


def check_layout(func: str, rank, world, length: int, load_balance) -> None:
    """Validate (rank, world, load_balance) against a global ``length`` to be split."""
    chunks = _check_ranks(func, rank, world, load_balance)
    if length % chunks:
        raise InputError(f"{func}: the sequence length {length} must be a multiple of "
                         f"{chunks} ({'2 x ' if load_balance else ''}world={world}"
                         f"{', load_balance=True' if load_balance else ''})")


def _check_ranks(func: str, rank, world, load_balance) -> int:
    """Validate (rank, world, load_balance); returns how many chunks the sequence is cut into."""
    rank, world = check_int(func, "rank", rank, None), check_int(func, "world", world, None)
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"{func}: rank must be in 0..world-1, got rank={rank}, world={world}")
    load_balance = check_bool(f"{func}: load_balance", load_balance)
    return 2 * world if load_balance else world


def _check_dim(func: str, dim, ndim: int) -> int:
    """``dim`` as an int naming one of ``ndim`` dims (negative from the end, as torch's)."""
    dim = check_int(func, "dim", dim, None)
    if not -ndim <= dim < ndim:
        raise InputError(f"{func}: dim={dim} is out of range for tensors of {ndim} dims")
    return dim


def chunk_ids(rank: int, world: int, load_balance: bool) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in local order."""
    return (rank, 2 * world - 1 - rank) if load_balance else (rank,)


def positions(rank: int, world: int, local_length: int, load_balance: bool,
              device=None) -> torch.Tensor:
    """int64 [local_length]: the global position of each local row of rank ``rank``."""
    # (a length or rank out of range would give positions that are not this rank's rows)
    _check_ranks("positions", rank, world, load_balance)
    local_length = check_int("positions", "local_length", local_length, 0)
    if load_balance and local_length % 2:
        raise InputError(f"positions: with load_balance=True a shard holds two equal chunks; "
                         f"local_length={local_length} is odd")
    device = resolve_device("positions", "cpu" if device is None else device)
    if local_length * world >= 2 ** 63:  # (int64 positions)
        raise InputError(f"positions: local_length * world is {local_length * world}; the "
                         "global positions are int64")
    ids = chunk_ids(rank, world, load_balance)
    chunk = local_length // len(ids)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in ids])


def shard_sequence(x: torch.Tensor, rank: int, world: int, load_balance: bool = True,
                   dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (default -2: the L of
    ``[B, H, L, E]``), a contiguous copy."""
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"shard_sequence: x must be a tensor, got {type(x).__name__}")
    dim = _check_dim("shard_sequence", dim, x.dim())
    check_layout("shard_sequence", rank, world, x.shape[dim], load_balance)
    chunks = x.chunk(2 * world if load_balance else world, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(rank, world, load_balance)], dim=dim)


def unshard(shards, load_balance: bool = True, dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[r]`` of rank r), the inverse of
    ``shard_sequence``."""
    try:  # (a tensor is iterable too, but its rows are not shards)
        listed = None if isinstance(shards, torch.Tensor) else list(shards)
    except TypeError:
        listed = None
    if listed is None:
        raise InputTypeError(f"unshard: shards must be a list of every rank's shard (tensors), "
                             f"got {type(shards).__name__}")
    shards = listed
    world = len(shards)
    if world == 0:
        raise InputError("unshard: shards is empty")
    check_bool("unshard: load_balance", load_balance)
    # shard_sequence cuts equal shards (two equal chunks each with load_balance): other
    # lengths would be put back in a wrong order without an error
    for rank, shard in enumerate(shards):
        if not isinstance(shard, torch.Tensor):
            raise InputTypeError(f"unshard: shards[{rank}] must be a tensor, got "
                                 f"{type(shard).__name__}")
        if shard.dim() != shards[0].dim():
            raise InputError(f"unshard: shards[{rank}] has {shard.dim()} dims but shards[0] "
                             f"has {shards[0].dim()}")
    dim = _check_dim("unshard", dim, shards[0].dim())
    first = shards[0]
    for rank, shard in enumerate(shards):  # (torch.cat failed inside, or promoted dtypes)
        others = [n for n in range(first.dim()) if n != dim % first.dim()]
        if [shard.shape[n] for n in others] != [first.shape[n] for n in others] or \
                shard.dtype != first.dtype or shard.device != first.device:
            raise InputError(f"unshard: shards[{rank}] is {shard.dtype} {dims(shard)} on "
                             f"{shard.device} but shards[0] {first.dtype} {dims(first)} "
                             f"on {first.device}; they may differ along dim {dim} only")
    lengths = [shard.shape[dim] for shard in shards]
    if len(set(lengths)) > 1 or (load_balance and lengths[0] % 2):
        raise InputError(f"unshard: the shards must have one length along dim {dim}"
                         f"{', an even one with load_balance=True' if load_balance else ''}; "
                         f"got lengths {lengths}")
    if not load_balance:
        return torch.cat(shards, dim=dim)
    pieces = [None] * (2 * world)
    for rank, shard in enumerate(shards):
        head, tail = shard.chunk(2, dim=dim)
        pieces[rank], pieces[2 * world - 1 - rank] = head, tail
    return torch.cat(pieces, dim=dim)
