"""Split-KV decoding in the Ampere family (``flexfa.runtime.families.ampere.split_keys``;
kernel_options ``SPLIT_KV=n`` forces about n splits, also under the interpreter): it walks one
range of keys per split into float32 slices, combined by their lse. Calls of at most 16 rows
take the decode family by default (tests/kernels/test_decode.py), so these force AMPERE. Out, lse, row maxima and
gradients against the float64 reference; empty rows and splits without keys; the rule that
picks the splits; which family a split call takes (the Hopper family splits too:
tests/kernels/test_hopper_split.py)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import AuxRequest

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from flexfa.errors import InputError, InputTypeError
from flexfa.reference import attention_reference
from flexfa.runtime import registry
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families import ampere
from flexfa.runtime.families.ampere import AMPERE
from flexfa.runtime.families.hopper import HOPPER
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.target import INTERPRETER, Target
from backward_utils import check_backward
from forward_utils import check_forward, dense_block_mask, make_qkv, record_splits
from strategies import mask_mods, score_mods


SPLIT4 = {"SPLIT_KV": 4, "BACKEND": "AMPERE"}  # about four splits


@pytest.fixture
def splits(monkeypatch):
    """Record the float32 slices each call combined."""
    return record_splits(monkeypatch, ampere)


def tail_window(b, h, q_idx, kv_idx):
    """Decoding with a sliding window: query i (of 3, at the end of the cache) keeps the last
    600 keys before it; the first query keeps nothing at all."""
    pos = q_idx + 1497
    return (kv_idx <= pos) & (kv_idx > pos - 600) & (q_idx > 0)


def test_split_decoding_matches_the_reference(splits):
    """A few queries over 1500 keys, GQA, softcap and a window mask (splits that see none of
    a row's keys, a row with no keys at all), ragged S."""
    q, k, v = make_qkv(1, 4, 2, 3, 1500, 32, dtype=torch.bfloat16, seed=50)
    mask = create_block_mask(tail_window, None, None, 3, 1500, device="cpu")
    out, lse = check_forward(q, k, v, mods.softcap(8.0), tail_window, mask, enable_gqa=True,
                             kernel_options=SPLIT4)
    assert splits == [3]
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert bool((lse[:, :, 0] == float("-inf")).all())
    check_forward(q, k, v, mods.alibi(4), enable_gqa=True,  # dense, the ALiBi slopes by head
                  kernel_options=SPLIT4)
    assert splits == [3, 3]


def test_split_calls_take_the_hopper_family_on_sm90(monkeypatch):
    """On sm_90 a bf16 call of more rows than the decode family takes runs the Hopper family
    with or without SPLIT_KV (it splits too), forced or not; on sm_80 the Ampere family."""
    monkeypatch.setattr(ampere, "sm_count", lambda device: 132)
    # 20 rows: more than the decode family takes
    q, k, v = make_qkv(1, 4, 4, 20, 1500, 32, dtype=torch.bfloat16, seed=50)
    sm90, sm80 = Target("cuda", 9, 0), Target("cuda", 8, 0)

    def call(options):
        return AttentionCall(None, None, None, 0.1, parse_kernel_options(options), 1)
    for options in ({}, {"SPLIT_KV": 4}, {"SPLIT_KV": "AUTO"},
                    {"SPLIT_KV": 4, "BACKEND": "HOPPER"}):
        assert registry.choose("forward", sm90, call(options), q, k, v) is HOPPER
        if "BACKEND" not in options:
            assert registry.choose("forward", sm80, call(options), q, k, v) is AMPERE


def test_split_decoding_row_maxima_and_gradients(splits):
    q, k, v = make_qkv(2, 2, 2, 5, 900, 16, dtype=torch.float32, seed=51)

    def late(b, h, q_idx, kv_idx):  # causal with the queries at the end of the cache
        return kv_idx <= q_idx + 895
    mask = create_block_mask(late, None, None, 5, 900, device="cpu", BLOCK_SIZE=64)
    out, aux = flexfa.flex_attention(q, k, v, mods.softcap(5.0), mask, kernel_options=SPLIT4,
                                     return_aux=AuxRequest(lse=True, max_scores=True))
    ref_out, ref_max = attention_reference(q, k, v, mods.softcap(5.0), late, return_max=True)
    torch.testing.assert_close(out, ref_out.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux.max_scores, ref_max.float(), rtol=1e-5, atol=1e-5)
    assert splits and all(n >= 2 for n in splits)
    # training through it: the backward takes the combined out and lse
    check_backward(q, k, v, mods.softcap(5.0), late, mask, with_lse=True,
                   kernel_options=SPLIT4)


def test_split_keys_rule(monkeypatch):
    """Keys per split for a [*, 32 heads, 1 query, S] call with 64-row tiles and 128-key mask
    blocks."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    sm90 = Target("cuda", 9, 0)
    monkeypatch.setattr(ampere, "sm_count", lambda device: 132)

    def keys(setting, batch_heads, L, S, target=sm90, device=cuda):
        options = parse_kernel_options({} if setting is None else {"SPLIT_KV": setting})
        call = AttentionCall(None, None, None, 0.1, options, 4)
        return ampere.split_keys(call, target, batch_heads, L, S, 64, 128, device)
    assert keys(None, 32, 1, 32768) == 0  # off unless asked for
    # 32 programs on 132 SMs: about 9 splits of a power of two times 128 keys
    assert keys("AUTO", 32, 1, 32768) == 4096
    assert keys("auto", 66, 1, 32768) == 8192  # 2 * 66 <= 132: 4 splits
    assert keys("AUTO", 67, 1, 32768) == 0  # fills half the SMs
    assert keys("AUTO", 32, 1, 512) == 0  # splits hold >= 512 keys: one
    assert keys("AUTO", 32, 1, 32768, INTERPRETER, cpu) == 0  # auto: GPUs only
    assert keys(2, 1000, 64, 4096, INTERPRETER, cpu) == 2048
    assert keys(0, 1, 1, 32768) == 0
    with pytest.raises(InputTypeError, match=r"kernel_options\['SPLIT_KV'\] must be an int or 'AUTO', got "
                                             r"str 'many'"):
        keys("many", 32, 1, 32768)
    with pytest.raises(InputError, match=r"kernel_options\['SPLIT_KV'\] = -1 is not allowed"):
        keys(-1, 32, 1, 32768)


def test_combine_splits_handles_empty_splits_and_rows():
    parts = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]]).reshape(3, 1, 1, 2, 1)
    part_lse = torch.tensor([[0.0, float("-inf")], [0.0, float("-inf")],
                             [float("-inf"), float("-inf")]]).reshape(3, 1, 1, 2)
    out, lse = torch.empty(1, 1, 2, 1), torch.empty(1, 1, 2)
    ampere.combine_splits(parts, part_lse, None, out, lse, None)
    assert out.flatten().tolist() == [2.0, 0.0]  # the mean of 1 and 3; the empty row 0
    torch.testing.assert_close(lse.flatten()[0], torch.log(torch.tensor(2.0)))
    assert lse.flatten()[1] == float("-inf")


@st.composite
def split_problems(draw):
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Hq = Hkv * draw(st.sampled_from((1, 2)))
    L, S = draw(st.integers(1, 40)), draw(st.integers(2, 200))
    E = draw(st.sampled_from((16, 32)))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16)))
    return B, Hq, Hkv, L, S, E, dtype


@settings(max_examples=10)
@given(problem=split_problems(), data=st.data())
def test_random_mods_through_split_decoding(problem, data):
    """Random score_mods, mask_mods (block masks with and without full tables), ragged S, GQA
    and 2-6 splits of 16-64 keys (MIN_SPLIT_KEYS lowered) against the float64 reference, in
    the Ampere family and the Hopper family (fp16/bf16 only: it reads tensor descriptors)."""
    B, Hq, Hkv, L, S, E, dtype = problem
    backend = data.draw(st.sampled_from(("AMPERE", "HOPPER")), label="backend")
    if backend == "HOPPER" and dtype == torch.float32:
        dtype = torch.bfloat16
    score_mod = data.draw(st.none() | score_mods(B, Hq, L, S, max_depth=2), label="score_mod")
    mask_mod = data.draw(st.none() | mask_mods(B, Hq, L, S, max_depth=2), label="mask_mod")
    block_mask = None
    if mask_mod is not None:
        block_mask = dense_block_mask(mask_mod, B, Hq, L, S, 16, 16,
                                      full=data.draw(st.booleans(), label="full tables"))
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, dtype=dtype,
                       seed=data.draw(st.integers(0, 2**16), label="seed"))
    splits = data.draw(st.integers(2, 6), label="splits")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ampere, "MIN_SPLIT_KEYS", 16)
        check_forward(q, k, v, score_mod, mask_mod, block_mask, enable_gqa=Hq != Hkv,
                      kernel_options={"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_KV": splits,
                                      "BACKEND": backend})
