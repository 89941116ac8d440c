"""The kernel families; importing this package registers them (``flexfa.runtime.registry``).

Forward, in order of preference: ``hopper`` (sm_90, tensor descriptors), ``ampere`` (every
target). Backward: ``triton_bwd``. FP8 forward: ``fp8``.
"""
from . import ampere, backward, fp8, hopper  # noqa: F401  (each registers its family)
