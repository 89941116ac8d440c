"""flexfa: attention variants written as Python functions, compiled to fused FlashAttention kernels."""
__version__ = "0.1.0"

from .errors import FlexFAError, InputError, InputTypeError, TraceError, UnsupportedOpError
from .frontend import and_masks, noop_mask, or_masks, trace
from .api import flex_attention
from .blockmask import BlockMask, create_block_mask, create_mask
from . import fp8  # flexfa.fp8.flex_attention_fp8, flexfa.fp8.quantize
from . import mods  # ready-made mods: flexfa.mods.causal, flexfa.mods.sliding_window(1024), ...

__all__ = ["FlexFAError", "InputError", "InputTypeError", "TraceError", "UnsupportedOpError",
           "flex_attention", "BlockMask", "create_block_mask", "create_mask", "trace",
           "and_masks", "noop_mask", "or_masks", "mods", "__version__"]
