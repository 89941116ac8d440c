"""Hypothesis: the features together, as a user combines them: random smooth score_mods with
learnable captured tensors, random mask_mods as block masks of random block sizes, GQA,
lengths that are not tile multiples, E != Ev, attention sinks, dropout, a forced forward
family, in each dtype; out, lse and every gradient (q, k, v, captured tensors, sinks)
against the float64 reference and autograd of it (kernels/backward_utils.check_backward,
which feeds the reference flexfa.dropout_mask). Each feature has its own tests; this one is
for their interactions."""
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flexfa
from backward_utils import check_backward, check_drawn_problem, draw_problem
from forward_utils import make_qkv

# more examples for a longer hunt (as test_fuzz.py): FLEXFA_FUZZ_EXAMPLES=300 HYPOTHESIS_PROFILE=dev
EXAMPLES = int(os.environ.get("FLEXFA_FUZZ_EXAMPLES", "0")) or 12


@st.composite
def combinations(draw):
    problem = draw_problem(draw, groups=[1, 2, 3], max_len=80, head_dims=[16, 32, 40],
                           head_dims_v=[16, 24], blocks=[16, 32, (16, 32), (32, 16), 64])
    sinks = None
    if draw(st.booleans()):
        sinks = torch.tensor(draw(st.lists(st.floats(-2.0, 2.0), min_size=problem["Hq"],
                                           max_size=problem["Hq"])))
    dropout = draw(st.sampled_from([None, (0.2, 7), (0.6, (3, 11))]))
    # the Hopper family takes 16-bit inputs only; None: the runtime's choice
    families = [None, {"BACKEND": "AMPERE"}, {"BLOCK_M": 16, "BLOCK_N": 16}]
    if problem["dtype"] != torch.float32:
        families.append({"BACKEND": "HOPPER"})
    return dict(problem, sinks=sinks, dropout=dropout, options=draw(st.sampled_from(families)),
                with_lse=draw(st.booleans()), seed=draw(st.integers(0, 1000)))


@given(case=combinations())
@settings(max_examples=EXAMPLES)
def test_features_together_match_the_reference(case):
    check_drawn_problem(case)


def test_the_check_sees_a_wrong_sink_gradient(monkeypatch):
    """check_backward with sinks can fail: a backward whose sinks' gradient is off by 1%."""
    real = flexfa.flex_attention

    def off(*args, sinks=None, **kwargs):
        if sinks is None:
            return real(*args, **kwargs)
        return real(*args, sinks=_Scaled.apply(sinks), **kwargs)
    monkeypatch.setattr(flexfa, "flex_attention", off)
    q, k, v = make_qkv(1, 2, 2, 24, 40, 16, seed=3)
    with pytest.raises(AssertionError, match="dsinks"):
        check_backward(q, k, v, sinks=torch.tensor([0.5, -1.0]), with_lse=True)


class _Scaled(torch.autograd.Function):
    """The identity whose gradient is 1.01 times what it is given."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 1.01 * grad
