"""FP8 forward attention (FlashAttention-3 style): e4m3 Q, K, V with per-block scales and an
optional random-sign Hadamard rotation of Q and K. Forward only; see docs/fp8.md."""
from .api import flex_attention_fp8
from .checks import FP8UnsupportedError
from .hadamard import random_signs, rotate, unrotate
from .quantize import FP8Inputs, quantize

__all__ = ["flex_attention_fp8", "quantize", "FP8Inputs", "FP8UnsupportedError", "rotate",
           "unrotate", "random_signs"]
