"""The tests' reference (tests/reference.py) is not only flexfa's frontend: it also runs the
mods as torch does and fails where the traced evaluation differs, so a wrong rewrite or
evaluator rule cannot move kernel and reference together."""
import pytest
import torch

import reference
from flexfa.frontend import evaluate


def _inputs():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))


@pytest.mark.parametrize("wrong", ["scaled", "sign of zero", "nan dropped"])
def test_a_traced_evaluation_that_differs_from_torch_fails_the_reference(monkeypatch, wrong):
    bias = torch.tensor([0.5, -0.0, float("nan"), 1.0, -2.0, 0.0, 3.0, -1.0])

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 1.0 / bias[kv_idx]
    reference.reference_pair(*_inputs(), score_mod)  # agrees

    def off(*args, **kwargs):
        value = evaluate(*args, **kwargs)
        if wrong == "scaled":
            return value * 1.5
        if wrong == "sign of zero":  # 1 / -0.0 read as 1 / +0.0
            return torch.where(value == float("-inf"), float("inf"), value)
        return value.nan_to_num(0.0)
    monkeypatch.setattr(reference, "evaluate", off)
    with pytest.raises(AssertionError, match="traced gives"):
        reference.reference_pair(*_inputs(), score_mod)


def test_a_traced_mask_that_differs_from_torch_fails_the_reference(monkeypatch):
    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    reference.reference_pair(*_inputs(), mask_mod=mask_mod)
    monkeypatch.setattr(reference, "dense_mask", lambda *args, **kwargs: torch.ones(
        1, 2, 8, 8, dtype=torch.bool))
    with pytest.raises(AssertionError, match="traced keeps"):
        reference.reference_pair(*_inputs(), mask_mod=mask_mod)

