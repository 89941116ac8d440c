"""Context parallelism: one sequence sharded across the ranks of a torch.distributed group
(docs/context-parallel.md)."""
from .ring import ring_attention
from .sharding import positions, shard_sequence, unshard

__all__ = ["ring_attention", "shard_sequence", "unshard", "positions"]
