"""Hypothesis: random score_mods and mask_mods, shapes, GQA ratios, head dims, dtypes and tile
sizes through the generated forward kernel, against the float64 reference (interpreter)."""
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forward_utils import check_forward, dense_block_mask, make_qkv
from strategies import mask_mods, score_mods

HEAD_DIMS = (16, 24, 32, 48, 64, 80)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILES = (16, 32, 64)
MAX_TILE_VISITS = 96  # bounds the interpreter's work per example


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.sampled_from((1, 2)))
    L = draw(st.integers(1, 256))
    S = draw(st.integers(1, 256))
    E = draw(st.sampled_from(HEAD_DIMS))
    Ev = draw(st.sampled_from((E, 16, 40)))
    dtype = draw(st.sampled_from(DTYPES))
    visits = [(m, n) for m in TILES for n in TILES
              if math.ceil(L / m) * math.ceil(S / n) * B * Hq <= MAX_TILE_VISITS]
    block_m, block_n = draw(st.sampled_from(visits or [(64, 64)]))
    return B, Hq, Hkv, L, S, E, Ev, dtype, block_m, block_n


@settings(max_examples=12)
@given(problem=problems(), data=st.data())
def test_random_mods_match_reference(problem, data):
    B, Hq, Hkv, L, S, E, Ev, dtype, block_m, block_n = problem
    use_score = data.draw(st.booleans(), label="score_mod")
    use_mask = data.draw(st.booleans(), label="mask_mod")
    score_mod = data.draw(score_mods(B, Hq, L, S, max_depth=3)) if use_score else None
    mask_mod = data.draw(mask_mods(B, Hq, L, S, max_depth=3)) if use_mask else None
    block_mask = None
    if mask_mod is not None:
        block = data.draw(st.sampled_from((64, 128)), label="BLOCK_SIZE")
        full = data.draw(st.booleans(), label="full tables")
        block_mask = dense_block_mask(mask_mod, B, Hq, L, S, block, block, full=full)
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev=Ev, dtype=dtype,
                       seed=data.draw(st.integers(0, 2**16), label="seed"))
    check_forward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv,
                  kernel_options={"BLOCK_M": block_m, "BLOCK_N": block_n})
