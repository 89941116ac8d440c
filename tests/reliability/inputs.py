"""Small seeded attention inputs and a one-line check against the float64 reference."""
import torch

from flexfa.reference import attention_reference
from reference import assert_close_to_reference


def qkv(B=1, Hq=2, Hkv=2, L=40, S=56, E=16, Ev=None, dtype=torch.float32, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev or E))
    return [(torch.randn(s, generator=generator) * scale).to(dtype) for s in shapes]


def assert_matches_reference(out, q, k, v, score_mod=None, mask_mod=None, **kwargs):
    """flexfa's ``out`` against the float64 reference, with the eager same-dtype error bound."""
    exact = attention_reference(q, k, v, score_mod, mask_mod, **kwargs)
    eager = attention_reference(q, k, v, score_mod, mask_mod, dtype=q.dtype, **kwargs)
    assert_close_to_reference(out, exact, eager)
