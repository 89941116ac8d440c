"""Hypothesis: random smooth score_mods with learnable captured tensors, random masks, shapes
(lengths not tile multiples, L != S, GQA, E != Ev), dtypes and block sizes; dq, dk, dv and
captured-tensor gradients against autograd of the float64 reference (the shared oracle)."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backward_utils import check_drawn_problem
from strategies import mask_mods, score_mods


@st.composite
def problems(draw):
    B = draw(st.sampled_from([1, 2]))
    Hkv = draw(st.sampled_from([1, 2]))
    Hq = Hkv * draw(st.sampled_from([1, 2]))
    L, S = draw(st.integers(1, 100)), draw(st.integers(1, 100))
    # 48: q and k in column blocks of 32 and 16 (flexfa.codegen.spec.head_dim_blocks)
    E, Ev = draw(st.sampled_from([16, 24, 32, 48])), draw(st.sampled_from([16, 40]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    score_mod = draw(st.none() | score_mods(B, Hq, L, S, smooth=True, grad_buffers=True,
                                            max_depth=3, max_buffers=2))
    mask_mod = draw(st.none() | mask_mods(B, Hq, L, S, max_depth=2, max_buffers=1))
    block = draw(st.sampled_from([16, 32, (32, 64), 64]))
    # kernel tiles must divide the mask's blocks: 16 always does
    options = draw(st.sampled_from([None, {"deterministic": True},
                                    {"BLOCK_M": 16, "BLOCK_N": 16}]))
    return dict(B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype, score_mod=score_mod,
                mask_mod=mask_mod, block=block, options=options,
                with_lse=draw(st.booleans()), seed=draw(st.integers(0, 1000)))


@given(problem=problems())
@settings(max_examples=10)
def test_random_backward_matches_reference(problem):
    check_drawn_problem(problem)
