"""Hypothesis: random score_mods (learnable captured tensors among them) and mask_mods through
the Gluon forward and backward in the emulator (kernel_options GLUON_EMULATE;
runtime.gluon_emulator): the mods rendered into the Gluon templates' layouts, at random
lengths, GQA groups, head dims 48 to 256 (E = 256's own backward kernel, padded dims; v's 128
under 160 to 256), block masks of the blocks the Gluon kernels walk, with or without dropout,
attention sinks, fp16 and bf16, under random kernel_options of both families (ping-pong, the
TMA store, the persistent grids, the static max, ring depths, dQ parts, early dP^T, the
trims); out, lse and every gradient against the float64 reference
(kernels/backward_utils.check_backward).
Where the Gluon backward does not apply (captured-tensor gradients below E = 256,
runtime.families.gluon_bwd) the Triton backward runs, interpreted: the Gluon forward is
still the one checked."""
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backward_utils import check_drawn_problem, draw_problem
from flexfa.prepared import PREPARED
from flexfa.runtime import plans
from forward_utils import kept_plans

EXAMPLES = int(os.environ.get("FLEXFA_FUZZ_EXAMPLES", "0")) or 6
EMULATED = {"BACKEND": "GLUON", "GLUON_BACKWARD": True, "GLUON_EMULATE": True}


@st.composite
def gluon_problems(draw):
    E = draw(st.sampled_from([48, 64, 96, 128, 160, 192, 224, 256]))
    # v's head dim may be 128 where q's pads to 256 (DeepSeek's MLA: 192 / 128)
    Ev = draw(st.sampled_from([E, 128])) if E > 128 else E
    problem = draw_problem(draw, groups=[1, 2], max_len=300, head_dims=[E], head_dims_v=[Ev],
                           blocks=[128, (128, 64), 256])
    problem["dtype"] = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    dropout = draw(st.sampled_from([None, None, (0.3, 5)]))
    sinks = None  # both Gluon families take attention sinks (HAS_SINKS in the forward)
    if draw(st.integers(0, 2)) == 0:
        sinks = torch.tensor(draw(st.lists(st.floats(-3.0, 3.0), min_size=problem["Hq"],
                                           max_size=problem["Hq"])))
    # Q K^T over E's 32-column slices alone (of the head dims drawn, a forward of two or
    # three slices at 96, 160, 192 and 224, a backward of two at 96; elsewhere it changes
    # nothing)
    options = {**EMULATED, "GLUON_QK_TRIM": draw(st.booleans()),
               "GLUON_BWD_QK_TRIM": draw(st.booleans()),
               # the other options that change how the kernels run, not what they compute
               "GLUON_PINGPONG": draw(st.booleans()), "GLUON_STATIC_MAX": draw(st.booleans()),
               "GLUON_BWD_DQ_CHUNKS": draw(st.sampled_from([0, 1, 4])),
               "GLUON_BWD_OVERLAP": draw(st.booleans()),
               "GLUON_BWD_EARLY_DP": draw(st.booleans())}
    persistent = draw(st.sampled_from([None, False, True, "DYNAMIC"]))  # None: 'AUTO'
    if persistent is not None:
        options["GLUON_PERSISTENT"] = persistent
    if E <= 128:  # out's staging buffer and a third Q/dO stage fit sm_90 there only
        options["GLUON_TMA_STORE"] = draw(st.booleans())
        options["GLUON_BWD_STAGES"] = draw(st.sampled_from([0, 2, 3]))
    return dict(problem, dropout=dropout, sinks=sinks, options=options,
                with_lse=draw(st.booleans()),
                seed=draw(st.integers(0, 1000)))


@given(case=gluon_problems())
@settings(max_examples=EXAMPLES, deadline=None)
def test_random_mods_through_the_emulated_gluon_kernels(case):
    # every example plans afresh (an earlier one's plan and prepared call would serve it)
    plans.PLANS.clear()
    PREPARED.clear()
    with kept_plans(lambda plan: plan.family.name) as made:
        check_drawn_problem(case)
    assert "gluon" in made, made  # the Gluon forward ran (the backward where it applies)
