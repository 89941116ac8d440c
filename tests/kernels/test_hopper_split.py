"""Split-KV in the Hopper family (``flexfa.runtime.families.hopper.split_count``): program
(q tile, head, split) walks its share of the row's live blocks (or key tiles) into float32
slices, combined by their lse (the module's combine kernel). Under the interpreter ``SPLIT_KV=n`` forces it (exactly n
splits); on a GPU the default splits where the programs leave half the program slots idle
(a chunked prefill), never a training-shaped call. Out and lse against the float64 reference
with causal masks at a query offset, GQA, a score_mod, ragged lengths and empty splits."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from flexfa.runtime import registry
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families import ampere, decode, hopper
from flexfa.runtime.families.decode import DECODE
from flexfa.runtime.families.gluon import GLUON
from flexfa.runtime.families.hopper import HOPPER, call_splits, split_count
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.target import INTERPRETER, Target
from backward_utils import check_backward
from forward_utils import check_forward, make_qkv

SM90 = Target("cuda", 9, 0)
L, S = 100, 232  # neither a tile multiple; queries at offset S - L


def causal_at_offset(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + (S - L)


@pytest.mark.parametrize("n", [2, 3])
def test_split_matches_the_reference(launched, n):
    """GQA 4:1, causal at an offset with a softcap through a block mask of 64-key blocks (4
    live blocks at most: with 3 splits the last split of a row can be empty), and dense."""
    q, k, v = make_qkv(1, 4, 1, L, S, 32, dtype=torch.bfloat16, seed=60 + n)
    mask = create_block_mask(causal_at_offset, None, None, L, S, device="cpu", BLOCK_SIZE=64)
    options = {"BACKEND": "HOPPER", "SPLIT_KV": n}
    check_forward(q, k, v, mods.softcap(5.0), causal_at_offset, mask, enable_gqa=True,
                  kernel_options=options)
    out, _ = check_forward(q, k, v, mods.alibi(4), enable_gqa=True, kernel_options=options)
    # without lse: the combine writes it to scratch, the output is the same
    alone = flexfa.flex_attention(q, k, v, mods.alibi(4), enable_gqa=True,
                                  kernel_options=options)
    assert torch.equal(alone, out)
    assert launched == [("hopper", n), ("hopper", n), ("hopper", n)]


def test_split_with_full_blocks_and_row_maxima(launched):
    """A mask with full tables (the split counts partial and full blocks as one list), the
    rows' max scores through the combine, fp16; gradients through the combined out and lse."""
    q, k, v = make_qkv(2, 2, 2, L, S, 16, dtype=torch.float16, seed=64)
    mask = create_block_mask(causal_at_offset, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    assert mask.full_kv_num_blocks is not None
    out, aux = flexfa.flex_attention(q, k, v, block_mask=mask,
                                     return_aux=flexfa.AuxRequest(lse=True, max_scores=True),
                                     kernel_options={"BACKEND": "HOPPER", "SPLIT_KV": 3})
    ref_out, ref_lse, ref_max = flexfa.reference.attention_reference(
        q, k, v, None, causal_at_offset, return_lse=True, return_max=True)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(aux.lse.double(), ref_lse, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(aux.max_scores.double(), ref_max, rtol=1e-4, atol=1e-4)
    assert launched[0] == ("hopper", 3)
    # training through it: the backward takes the combined out and lse
    check_backward(q, k, v, None, causal_at_offset, mask, with_lse=True,
                   kernel_options={"BACKEND": "HOPPER", "SPLIT_KV": 3})
    assert ("hopper", 3) in launched[1:]


def _call(options: dict, group: int = 4) -> AttentionCall:
    return AttentionCall(None, None, None, 0.1, parse_kernel_options(options), group)


def _splits(shape_q, shape_kv, options=None, target=SM90):
    q = torch.empty(shape_q, dtype=torch.bfloat16, device="meta")
    k = torch.empty(shape_kv, dtype=torch.bfloat16, device="meta")
    block_m = hopper.autotune.hopper_configs(128, 128)[0][0]  # the default tiles' 128 rows
    return call_splits(_call(options or {}), target, q, k, block_m)


def test_split_rule_on_serving_and_training_shapes(monkeypatch):
    """132 SMs: the chunked prefill (B=1, Hq=32, L=512 against S=8192: 128 programs) splits,
    by default and with "AUTO"; a training call (B=1, H=16, L=S=16384: 2048 programs) and a
    prefill of 1024 rows (256 programs, one round of the 264 slots) do not; 0 never; n
    exactly n; the interpreter only when forced."""
    monkeypatch.setattr(hopper, "sm_count", lambda device: 132)
    prefill = ((1, 32, 512, 128), (1, 8, 8192, 128))
    assert _splits(*prefill) == 2
    assert _splits(*prefill, {"SPLIT_KV": "AUTO"}) == 2
    assert _splits(*prefill, {"SPLIT_KV": 0}) == 1
    assert _splits(*prefill, {"SPLIT_KV": 3}) == 3
    assert _splits(*prefill, target=INTERPRETER) == 1
    assert _splits((1, 16, 16384, 128), (1, 16, 16384, 128)) == 1
    assert _splits((1, 32, 1024, 128), (1, 8, 8192, 128)) == 1
    assert _splits((1, 16, 512, 128), (1, 4, 8192, 128)) == 4  # 64 programs
    assert _splits((1, 32, 512, 128), (1, 8, 1024, 128)) == 2  # 1024 keys: two of 512
    assert _splits((1, 32, 512, 128), (1, 8, 600, 128)) == 1  # one split of 512 keys at most


def test_split_count_rounds():
    """The predicted rounds: ties go to fewer splits; a gain under 20% keeps one."""
    assert split_count(None, 128, 132, 8192) == 2  # 256 programs fit the 264 slots
    assert split_count(None, 300, 132, 8192) == 4  # 2 rounds -> 5 rounds of quarters
    assert split_count(None, 800, 132, 8192) == 1  # 4 rounds -> 3.5: not enough
    assert split_count(None, 10, 132, 1 << 20) == hopper.MAX_AUTO_SPLITS
    assert split_count(7, 5000, 132, 100) == 7
    assert split_count(None, 128, 0, 8192) == 1


def test_families_of_serving_shapes(monkeypatch):
    """On sm_90: decode shapes still take the decode family (its split rule unchanged); the
    chunked prefill takes the Gluon forward where its 128 programs fill the SMs (measured
    1.45x the split Hopper kernel), the Hopper family with a split count or with 8 heads."""
    monkeypatch.setattr(hopper, "sm_count", lambda device: 132)
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    monkeypatch.setattr(ampere, "sm_count", lambda device: 132)  # the Gluon family asks
    kv = torch.zeros(1, 8, 8192, 128, dtype=torch.bfloat16)
    for rows in (1, 4, 16):
        q = torch.zeros(1, 32, rows, 128, dtype=torch.bfloat16)
        assert registry.choose("forward", SM90, _call({}), q, kv, kv) is DECODE
    assert decode.split_count(_call({}), SM90, 16 * 8, 256, None) == 3
    q = torch.zeros(1, 32, 512, 128, dtype=torch.bfloat16)
    for options in ({}, {"SPLIT_KV": "AUTO"}):  # AUTO: 256 split programs > 132 SMs, no split
        assert registry.choose("forward", SM90, _call(options), q, kv, kv) is GLUON
    for options in ({"SPLIT_KV": 4}, {"BACKEND": "HOPPER", "SPLIT_KV": 2}):
        assert registry.choose("forward", SM90, _call(options), q, kv, kv) is HOPPER
    q8 = torch.zeros(1, 8, 512, 128, dtype=torch.bfloat16)  # 32 programs: the split Hopper
    assert registry.choose("forward", SM90, _call({}, group=1), q8, kv, kv) is HOPPER
