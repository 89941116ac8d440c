"""The versions every generated-kernel cache key includes."""
from __future__ import annotations

import functools

# bump when generated sources change meaning without a template change (renderer rules, ...)
FORMAT_VERSION = 1


@functools.cache
def versions_key() -> str:
    import torch
    import triton

    from .. import __version__
    return f"format={FORMAT_VERSION}|flexfa={__version__}|triton={triton.__version__}|torch={torch.__version__}"
