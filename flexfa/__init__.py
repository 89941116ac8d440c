"""flexfa: attention variants written as Python functions, compiled to fused FlashAttention kernels."""
__version__ = "0.1.0"

from .errors import FlexFAError, InputError, InputTypeError, TraceError, UnsupportedOpError
from .frontend import and_masks, noop_mask, or_masks, trace
from .api import flex_attention
from .blockmask import BlockMask, create_block_mask, create_mask

__all__ = ["FlexFAError", "InputError", "InputTypeError", "TraceError", "UnsupportedOpError",
           "flex_attention", "BlockMask", "create_block_mask", "create_mask", "trace",
           "and_masks", "noop_mask", "or_masks", "__version__"]
