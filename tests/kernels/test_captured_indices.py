"""Captured-tensor reads out of range raise before a launch, as torch's indexing does, instead
of being clamped by the kernel; reads in range (negative ones too) run and match the
reference (flexfa.runtime.indices)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexfa
from flexfa.blockmask import create_block_mask
from flexfa.errors import InputError
from flexfa.frontend import evaluate, trace
from flexfa.runtime import indices
from flexfa.runtime.indices import check_captured_indices
from kernels.forward_utils import make_qkv
from reference import assert_close_to_reference, reference_pair

L = S = 40


def _run_and_compare(score_mod, L=L, S=S, H=2):
    q, k, v = make_qkv(1, H, H, L, S, 16)
    out = flexfa.flex_attention(q, k, v, score_mod)
    (out64, _), (eager, _) = reference_pair(q, k, v, score_mod)
    assert_close_to_reference(out, out64, eager)


def test_score_mod_reading_past_the_end_raises():
    bias = torch.randn(S - 8)

    def short_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    q, k, v = make_qkv(1, 2, 2, L, S, 16)
    with pytest.raises(IndexError):  # what torch (and the eager reference) does
        reference_pair(q, k, v, short_bias)
    message = (r"score_mod 'short_bias' reads a captured tensor of shape \(32,\) at indices "
               r"0\.\.39 in dimension 0 \(size 32\).*-32\.\.31")
    with pytest.raises(InputError, match=message):
        flexfa.flex_attention(q, k, v, short_bias)
    with pytest.raises(InputError, match="short_bias"):  # the backward's forward too
        flexfa.flex_attention(q.requires_grad_(), k, v, short_bias)


def test_negative_indices_wrap_as_in_torch():
    bias = torch.randn(2, S)

    def from_the_end(score, b, h, q_idx, kv_idx):
        return score + bias[h - 2, kv_idx - S]  # -2..-1 and -S..-1: valid in torch

    _run_and_compare(from_the_end)

    def one_too_far(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx - S - 1]

    with pytest.raises(InputError, match=r"indices -41\.\.-2 in dimension 1 \(size 40\)"):
        _run_and_compare(one_too_far)


def test_mask_mod_reading_past_a_broadcast_batch_raises():
    per_batch = torch.tensor([5])

    def batch_limit(b, h, q_idx, kv_idx):
        return kv_idx < per_batch[b] + q_idx

    block_mask = create_block_mask(batch_limit, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    q, k, v = make_qkv(2, 2, 2, L, S, 16)  # b = 1 reads per_batch[1]
    with pytest.raises(InputError, match=r"mask_mod 'batch_limit'.*indices 0\.\.1 in dimension 0"):
        flexfa.flex_attention(q, k, v, block_mask=block_mask)


def test_exact_evaluation_where_intervals_cannot_prove():
    """(q - 5) * (q - 30) lies in -156..306 over q < 40, but its interval is wider."""
    table = torch.randn(307)

    def parabola(score, b, h, q_idx, kv_idx):
        return score + table[(q_idx - 5) * (q_idx - 30)]

    _run_and_compare(parabola)
    small = torch.randn(300)

    def parabola_small(score, b, h, q_idx, kv_idx):
        return score + small[(q_idx - 5) * (q_idx - 30)]

    with pytest.raises(InputError, match=r"indices -156\.\.306 in dimension 0 \(size 300\)"):
        _run_and_compare(parabola_small)


def test_indices_read_from_captured_values_are_checked_when_they_change():
    doc = torch.arange(L) // 10  # document ids 0..3
    offsets = torch.tensor([0, 10, 20, 30])

    def in_document_position(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx - offsets[doc[q_idx]]).float()

    _run_and_compare(in_document_position)
    doc[7] = 4  # in place: the trace is the same, the values are not
    with pytest.raises(InputError, match=r"shape \(4,\) at indices 0\.\.4 in dimension 0"):
        _run_and_compare(in_document_position)
    doc[7] = 0
    _run_and_compare(in_document_position)


@pytest.mark.parametrize("divide", [
    lambda q, kv: q % kv, lambda q, kv: q // (kv - 5), lambda q, kv: torch.fmod(q, kv - 39),
    lambda q, kv: torch.div(q, kv, rounding_mode="trunc"),
    lambda q, kv: torch.where(kv > 0, q // kv, 0),  # torch divides in both branches
    lambda q, kv: q // ((q - kv) % 7),  # 0 on a diagonal the intervals cannot see
], ids=["mod", "floordiv", "fmod", "trunc", "where", "exact"])
def test_integer_division_by_zero_raises_as_in_torch(divide):
    """Regression: the kernels computed garbage where torch raises ZeroDivisionError."""
    def divides(score, b, h, q_idx, kv_idx):
        return score + 0.1 * divide(q_idx, kv_idx)

    q, k, v = make_qkv(1, 2, 2, L, S, 16)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        reference_pair(q, k, v, divides)
    with pytest.raises(InputError, match=r"score_mod 'divides' divides integers .* by a "
                                         r"divisor that is 0 for some b < 1, h < 2"):
        flexfa.flex_attention(q, k, v, divides)


def test_nonzero_divisors_run_and_divisors_read_from_values_are_checked_when_they_change():
    _run_and_compare(lambda score, b, h, q_idx, kv_idx: score + (q_idx // (2 * kv_idx - 51)))
    _run_and_compare(lambda score, b, h, q_idx, kv_idx: score + q_idx % ((q_idx - kv_idx) ** 2 + 1))
    period = torch.full((S,), 3)

    def periodic(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx % period[kv_idx])

    _run_and_compare(periodic)
    period[5] = 0  # in place: the trace is the same, the values are not
    with pytest.raises(InputError, match=r"divisor that is 0 .* \(its values: 0\.\.3\)"):
        _run_and_compare(periodic)


def test_repeated_calls_reuse_the_check(monkeypatch):
    bias = torch.randn(S)

    def in_range(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    calls = []
    real = indices._static
    monkeypatch.setattr(indices, "_static", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(indices, "_STATIC", {})
    traced = trace(in_range)
    for _ in range(3):
        check_captured_indices(traced, None, (1, 2, L, 16), S, "cpu")
    assert len(calls) == 1
    check_captured_indices(traced, None, (1, 2, L, 16), S - 1, "cpu")  # other lengths: checked
    assert len(calls) == 2


@given(st.integers(-3, 3), st.integers(-3, 3), st.integers(-120, 120), st.integers(1, 100),
       st.integers(1, 50), st.integers(1, 50))
def test_check_agrees_with_torch_indexing(a, c, d, size, q_len, kv_len):
    """For affine reads table[a * q_idx + c * kv_idx + d]: an error exactly when torch's
    indexing (the eager evaluator) raises."""
    table = torch.zeros(size)

    def affine(score, b, h, q_idx, kv_idx):
        return score + table[a * q_idx + c * kv_idx + d]

    traced = trace(affine)
    try:
        evaluate(traced, score=torch.zeros(()), b=torch.tensor(0), h=torch.tensor(0),
                 q_idx=torch.arange(q_len).view(-1, 1), kv_idx=torch.arange(kv_len).view(1, -1))
        torch_raises = False
    except IndexError:
        torch_raises = True
    try:
        check_captured_indices(traced, None, (1, 1, q_len, 16), kv_len, "cpu")
        raises = False
    except InputError:
        raises = True
    assert raises == torch_raises


def test_logical_ops_of_float_comparisons_read_per_head():
    """Regression: under the Triton interpreter a comparison of float scalars (w[h] > 0) is a
    float array, so `&`, `|` and `^` with a tile failed (InterpreterError) in score_mods,
    mask_mods and their derivatives; rendered as `(... != 0)` they run."""
    w = torch.tensor([0.3, -0.2])

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where((q_idx >= kv_idx) & (w[h] > 0) | (w[h] * score > 1.0), score,
                           score * 2.0)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((q_idx >= kv_idx) & (w[h] > 0)) ^ (w[h] < -0.1)

    q, k, v = make_qkv(1, 2, 2, 40, 56, 16)
    mask = create_block_mask(mask_mod, None, 2, 40, 56, device="cpu", BLOCK_SIZE=16)
    out, lse = flexfa.flex_attention(q, k, v, score_mod, block_mask=mask, return_lse=True)
    exact, eager = reference_pair(q, k, v, score_mod, mask_mod)
    assert_close_to_reference(out, exact[0], eager[0])
    assert_close_to_reference(lse, exact[1], eager[1], name="lse")
