"""Block masks: which (q tile, kv tile) pairs a mask removes, found without the L x S mask."""
from .block_mask import BlockMask
from .create import create_block_mask, create_mask
from .varlen import varlen_block_mask

__all__ = ["BlockMask", "create_block_mask", "create_mask", "varlen_block_mask"]
