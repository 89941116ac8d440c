"""The kernel families; importing this package registers them (``flexfa.runtime.registry``).

Forward, in order of preference: ``decode`` (at most 16 query rows: GQA-packed, split-KV),
``hopper`` (sm_90, tensor descriptors), ``ampere`` (every target); ``gluon`` (sm_90, FA3's
warp-specialized structure) only when BACKEND="GLUON" forces it. Backward: ``gluon_bwd``
(sm_90, FA3's backward) only under BACKEND="GLUON" and where it applies, else ``triton_bwd``.
FP8 forward: ``fp8``.
"""
# each registers its family
from . import ampere, backward, decode, fp8, gluon, gluon_bwd, hopper  # noqa: F401
