"""Hypothesis: random smooth score_mods with learnable captured tensors, random masks, shapes
(lengths not tile multiples, L != S, GQA, E != Ev), dtypes and block sizes; dq, dk, dv and
captured-tensor gradients against autograd of the float64 reference (the shared oracle)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from backward_utils import check_drawn_problem, draw_problem


@st.composite
def problems(draw):
    # 48: q and k in column blocks of 32 and 16 (flexfa.codegen.spec.head_dim_blocks)
    problem = draw_problem(draw, groups=[1, 2], max_len=100, head_dims=[16, 24, 32, 48],
                           head_dims_v=[16, 40], blocks=[16, 32, (32, 64), 64])
    # kernel tiles must divide the mask's blocks: 16 always does. BWD_FULL_WALK: a call
    # without a mask walks all-full tables (with a mask it changes nothing)
    options = draw(st.sampled_from([None, {"deterministic": True},
                                    {"BLOCK_M": 16, "BLOCK_N": 16}, {"BWD_FULL_WALK": True}]))
    return dict(problem, options=options, with_lse=draw(st.booleans()),
                seed=draw(st.integers(0, 1000)))


@given(problem=problems())
@settings(max_examples=10)
def test_random_backward_matches_reference(problem):
    check_drawn_problem(problem)
