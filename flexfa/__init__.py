"""flexfa: attention variants written as Python functions, compiled to fused FlashAttention kernels."""
from .version import __version__

from .errors import FlexFAError, InputError, InputTypeError, TraceError, UnsupportedOpError
from .frontend import and_masks, noop_mask, or_masks, trace
from .api import AuxOutput, flex_attention
from .features import dropout_mask
from .blockmask import BlockMask, create_block_mask, create_mask, varlen_block_mask
from .decode import DecodeWorkspace, flex_decode
from .paged import PagedKVCache
from .varlen import varlen_attention
from . import fp8  # flexfa.fp8.flex_attention_fp8, flexfa.fp8.quantize
from . import mods  # ready-made mods: flexfa.mods.causal, flexfa.mods.sliding_window(1024), ...

# torch's request and option types, so that code importing them from flexfa runs unchanged;
# torch releases before them get look-alikes (flex_attention reads the fields either way)
try:
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - torch < 2.9
    from typing import NamedTuple

    class AuxRequest(NamedTuple):
        """Which auxiliary outputs ``flex_attention(..., return_aux=...)`` returns."""

        lse: bool = False
        max_scores: bool = False
try:
    from torch.nn.attention.flex_attention import FlexKernelOptions
except ImportError:  # pragma: no cover - older torch
    FlexKernelOptions = dict

__all__ = ["FlexFAError", "InputError", "InputTypeError", "TraceError", "UnsupportedOpError",
           "flex_attention", "AuxRequest", "AuxOutput", "FlexKernelOptions", "BlockMask",
           "create_block_mask", "create_mask", "varlen_block_mask", "varlen_attention", "trace",
           "flex_decode", "PagedKVCache", "DecodeWorkspace", "and_masks", "noop_mask", "or_masks",
           "mods", "dropout_mask", "__version__"]
