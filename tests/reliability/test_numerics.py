"""Numerics at the edges: huge scores, -inf scores, empty rows, one visible key, L = 1 or
S = 1, NaN inputs, bad scales, low-precision outputs at the ends of their range."""
import math

import pytest
import torch

import flexfa
from flexfa.reference import attention_reference
from reference import assert_close_to_reference, reference_pair
from .inputs import qkv

LOW_PRECISION = [torch.float16, torch.bfloat16]
ALL_DTYPES = [torch.float32, *LOW_PRECISION]


def _check(q, k, v, score_mod=None, mask_mod=None, block_mask=None, **kwargs):
    """flexfa's out and lse against float64 (bounded by the same-dtype eager error)."""
    out, lse = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                     return_lse=True, **kwargs)
    exact, eager = reference_pair(q, k, v, score_mod, mask_mod, **kwargs)
    assert_close_to_reference(out, exact[0], eager[0])
    assert_close_to_reference(lse, exact[1], eager[1], name="lse")
    return out, lse


def _block_mask(mask_mod, L, S, block=32):
    return flexfa.create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=block)


def _grads(q, k, v, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = flexfa.flex_attention(q, k, v, return_lse=True, **kwargs)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


# ---- huge scores ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_scores_of_magnitude_1e4_from_a_large_scale(dtype):
    q, k, v = qkv(L=100, S=72, dtype=dtype)
    scale = 2500.0
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    assert scores.abs().max() > 1e4  # the premise: scores far beyond exp's float32 range
    out, lse = _check(q, k, v, scale=scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_scores_of_magnitude_1e4_from_large_inputs(dtype):
    q, k, v = qkv(L=100, S=72, dtype=dtype)
    q, k = q * 60, k * 60  # q.k / sqrt(16) reaches ~1e4
    scores = (q.double() @ k.double().transpose(-1, -2)) / 4
    assert scores.abs().max() > 1e4
    out, lse = _check(q, k, v)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_huge_score_mod_values_do_not_overflow():
    q, k, v = qkv(L=40, S=56)

    def blow_up(score, b, h, q_idx, kv_idx):
        return score * 1e4 + kv_idx * 100.0

    out, lse = _check(q, k, v, blow_up)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ---- -inf scores, empty rows, one key --------------------------------------------------------

def _keep(b, h, q_idx, kv_idx):  # rows with q_idx % 7 == 3 attend to nothing
    return (q_idx >= kv_idx) & (q_idx % 7 != 3)


def _minus_inf_where_not_kept(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx >= kv_idx) & (q_idx % 7 != 3), score, -math.inf)


def test_minus_inf_score_equals_masking():
    q, k, v = qkv(L=100, S=100)
    by_score = _grads(q, k, v, score_mod=_minus_inf_where_not_kept)
    by_mask = _grads(q, k, v, block_mask=_block_mask(_keep, 100, 100))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), by_score, by_mask):
        assert not torch.isnan(a).any(), f"{name}: NaN from -inf scores"
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    _check(q, k, v, _minus_inf_where_not_kept)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("how", ["block mask", "score_mod -inf"])
def test_fully_masked_rows_give_zero_output_and_gradients(dtype, how):
    q, k, v = qkv(L=100, S=72, dtype=dtype)
    kwargs = ({"block_mask": _block_mask(_keep, 100, 72)} if how == "block mask"
              else {"score_mod": _minus_inf_where_not_kept})
    out, lse, dq, dk, dv = _grads(q, k, v, **kwargs)
    empty = torch.tensor([i % 7 == 3 for i in range(100)])
    assert (out[:, :, empty] == 0).all() and torch.isneginf(lse[:, :, empty]).all()
    assert torch.isfinite(lse[:, :, ~empty]).all() and torch.isfinite(out).all()
    assert (dq[:, :, empty] == 0).all()
    for grad in (dq, dk, dv):
        assert torch.isfinite(grad).all()


def test_rows_of_a_skipped_tile_are_empty():
    """Whole q tiles with nothing to attend are skipped by the block mask: 0 and -inf."""
    def late_rows(b, h, q_idx, kv_idx):
        return q_idx >= 64

    q, k, v = qkv(L=100, S=40)
    out, lse = _check(q, k, v, mask_mod=late_rows, block_mask=_block_mask(late_rows, 100, 40))
    assert (out[:, :, :64] == 0).all() and torch.isneginf(lse[:, :, :64]).all()


def _one_key(b, h, q_idx, kv_idx):
    return kv_idx == (q_idx * 5) % 72


def test_a_single_visible_key_returns_its_value():
    q, k, v = qkv(L=100, S=72)
    out, lse = _check(q, k, v, mask_mod=_one_key, block_mask=_block_mask(_one_key, 100, 72))
    keys = (torch.arange(100) * 5) % 72
    torch.testing.assert_close(out, v[:, :, keys], atol=1e-6, rtol=0)
    scores = (q * k[:, :, keys]).sum(-1) / 4
    torch.testing.assert_close(lse, scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("L, S", [(1, 72), (100, 1), (1, 1)])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_one_query_row_or_one_key(L, S, dtype):
    q, k, v = qkv(L=L, S=S, dtype=dtype)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score - (h + 1) * 0.5 * (q_idx - kv_idx)

    out, _ = _check(q, k, v, alibi)
    if S == 1:  # one key: every row is exactly that key's value
        assert torch.equal(out, v.expand_as(out))
    _check(q, k, v, alibi, mask_mod=causal, block_mask=_block_mask(causal, L, S, block=16))


# ---- NaN and bad scales ---------------------------------------------------------------------

def test_nan_in_a_query_row_stays_in_that_row():
    q, k, v = qkv(L=100, S=72)
    q[0, 1, 5, 3] = math.nan
    out = flexfa.flex_attention(q, k, v)
    nan_rows = torch.isnan(out).any(-1)
    assert nan_rows.nonzero().tolist() == [[0, 1, 5]] and torch.isnan(out[0, 1, 5]).all()
    reference = attention_reference(q, k, v)
    keep = ~nan_rows
    torch.testing.assert_close(out[keep], reference[keep].float(), atol=1e-5, rtol=1e-5)


def test_the_reference_lse_of_nan_and_inf_rows_is_torchs():
    """A row of NaN scores (a NaN in its query) or of +inf scores is not an empty row: its
    lse is NaN or +inf in torch's flex_attention, flexfa's and the reference's, not -inf."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    def inf_row(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx == 2, math.inf, score)

    q, k, v = qkv(L=24, S=40)
    q[0, 1, 5, 3] = math.nan
    for score_mod in (None, inf_row):
        _, want = torch_flex_attention(q, k, v, score_mod=score_mod, return_lse=True)
        _, got = flexfa.flex_attention(q, k, v, score_mod=score_mod, return_lse=True)
        _, exact = attention_reference(q, k, v, score_mod, return_lse=True)
        for lse in (got, exact):
            torch.testing.assert_close(lse.float(), want, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("dtype,shift", [(torch.float64, -1e17), (torch.float32, 1e9)])
def test_the_reference_averages_values_at_huge_scores(dtype, shift):
    """Where log(sum) is below half an ulp of a huge row max, lse rounds to the max: the
    reference's probabilities (exp(scores - lse) before) were each 1 and out summed V."""
    q, k, v = qkv(L=4, S=8)

    def shifted(score, b, h, q_idx, kv_idx):
        return score + shift  # every score rounds to the shift: uniform attention

    out = attention_reference(q, k, v, shifted, dtype=dtype)
    mean = v.to(dtype).mean(dim=2, keepdim=True).expand_as(out)
    torch.testing.assert_close(out, mean)
    torch.testing.assert_close(flexfa.flex_attention(q, k, v, shifted), mean.float())


def test_the_reference_keeps_the_limit_of_a_plus_infinite_sink():
    """A +inf sink takes all of its head's probability: the reference's out is 0 there (the
    kernels' limit) and lse +inf, the other head's unchanged."""
    q, k, v = (t.double() for t in qkv(L=8, S=12))
    sinks = torch.tensor([math.inf, 0.5], dtype=torch.float64)
    out, lse = attention_reference(q, k, v, sinks=sinks, return_lse=True)
    assert (out[:, 0] == 0).all() and (lse[:, 0] == math.inf).all()
    torch.testing.assert_close(out[:, 1], attention_reference(q, k, v, sinks=torch.tensor(
        [0.0, 0.5], dtype=torch.float64))[:, 1])


def test_nan_in_a_key_reaches_only_rows_that_attend_to_it():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    q, k, v = qkv(L=100, S=100)
    k[0, 0, 40, 0] = math.nan
    out = flexfa.flex_attention(q, k, v, block_mask=_block_mask(causal, 100, 100))
    reference = attention_reference(q, k, v, mask_mod=causal)
    assert torch.equal(torch.isnan(out).any(-1), torch.isnan(reference).any(-1))
    assert torch.isnan(out[0, 0, 40:]).all() and not torch.isnan(out[0, 0, :40]).any()
    assert not torch.isnan(out[0, 1]).any()
    keep = ~torch.isnan(reference)
    torch.testing.assert_close(out[keep], reference[keep].float(), atol=1e-5, rtol=1e-5)


def test_nan_in_a_value_stays_in_its_head_and_out_of_skipped_tiles():
    """Rows that attend to the NaN value are NaN; a row that masks it out but computes its
    tile gets 0 * NaN = NaN, as the dense reference does; rows whose block mask skips that
    tile, and every other head, stay finite and correct."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    q, k, v = qkv(L=128, S=128)
    clean = v.clone()
    v[0, 0, 100, 2] = math.nan  # in kv tile 1 (keys 64..127)
    out = flexfa.flex_attention(q, k, v, block_mask=_block_mask(causal, 128, 128, block=64))
    nan_rows = torch.isnan(out).any(-1)
    assert nan_rows[0, 0, 100:].all() and not nan_rows[0, 0, :64].any()
    assert not nan_rows[0, 1].any()
    reference = attention_reference(q, k, clean, mask_mod=causal).float()
    torch.testing.assert_close(out[0, 0, :64], reference[0, 0, :64], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 1], reference[0, 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["heads", "strided"])
@pytest.mark.parametrize("options", [{}, {"BACKEND": "HOPPER"},
                                     {"BACKEND": "HOPPER", "BLOCK_N": 64}],
                         ids=["default", "hopper", "hopper_64"])
def test_an_inf_in_the_next_heads_keys_stays_there_at_a_ragged_s(layout, options):
    """S = 100 is not a multiple of the key tile: a tile past S must not read the next head's
    (or, heads side by side, the next batch's) first keys and values, where an inf or NaN
    would turn this head's P @ V into NaN (P is 0 there, 0 * inf is not). The Hopper family
    read them through its [B * H * S, E] descriptors until the twentieth session."""
    S = 100
    gen = torch.Generator().manual_seed(7)
    shape = (2, S, 2, 32) if layout == "strided" else (2, 2, S, 32)
    q, k, v = (torch.randn(*shape, generator=gen).to(torch.bfloat16) for _ in range(3))
    if layout == "strided":  # [B, S, H, E] memory read as [B, H, S, E]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k[1, 1, 0, 0], v[1, 1, 0, 1], v[0, 1, 0, 2], v[1, 0, 0, 3] = math.inf, math.inf, math.nan, \
        -math.inf  # the first key of every (batch, head) but the first
    out = flexfa.flex_attention(q, k, v, kernel_options=options)
    assert torch.isfinite(out[0, 0]).all()
    reference = attention_reference(q[:1, :1], k[:1, :1], v[:1, :1]).float()
    torch.testing.assert_close(out[:1, :1].float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan, 1e39])
def test_inf_and_nan_scale_are_rejected(scale):
    q, k, v = qkv(L=8, S=8)
    with pytest.raises(flexfa.InputError, match="scale"):
        flexfa.flex_attention(q, k, v, scale=scale)


# ---- low-precision outputs at the ends of their range ---------------------------------------

@pytest.mark.parametrize("dtype, magnitude", [(torch.float16, 65504.0), (torch.bfloat16, 1e36)])
@pytest.mark.parametrize("scale", [None, 300.0])
def test_low_precision_outputs_stay_in_range(dtype, magnitude, scale):
    """Values at fp16's largest finite value (and bf16 values far beyond fp16's range): the
    output is a convex combination of them, so it must stay finite and within their range.
    (bf16 values near float32's maximum overflow the float32 accumulator, as they do in
    torch's SDPA.)"""
    q, k, _ = qkv(L=100, S=72, dtype=dtype)
    signs = torch.randint(0, 2, (1, 2, 72, 16), generator=torch.Generator().manual_seed(1))
    v = ((signs * 2 - 1) * magnitude).to(dtype)
    out, lse = flexfa.flex_attention(q, k, v, scale=scale, return_lse=True)
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert out.float().abs().max() <= v.float().abs().max()
    exact = attention_reference(q, k, v, scale=scale)
    error = ((out.double() - exact) / magnitude).abs().max().item()
    assert error < 2e-2, f"relative error {error:.2e}"
