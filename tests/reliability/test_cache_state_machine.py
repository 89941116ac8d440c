"""Hypothesis state machine over the caches' inputs: a user's session of repeated
``flex_attention`` calls between which the things the caches key on change the way they
change in real code: a Python attribute a score_mod reads, a captured tensor edited in place,
replaced, or given other strides, the block mask rebuilt from a mask_mod whose window moved,
kernel_options edited in place, q edited in place or given another layout, the captured
tensor cast to another dtype. After every step a call's output and lse must be those of the
float64 reference evaluated with the state as it is now: a cache (trace memo, prepared
calls, plans, kernels) that missed a change shows as a stale result."""
import os

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import flexfa
from reference import assert_close_to_reference, reference_pair

B, H, L, S, E = 1, 2, 40, 56, 16
# more steps for a longer hunt, as test_fuzz.py: FLEXFA_FUZZ_EXAMPLES=100 HYPOTHESIS_PROFILE=dev
EXAMPLES = int(os.environ.get("FLEXFA_FUZZ_EXAMPLES", "0")) or 6


class Config:
    """What the mods read: attributes of a user's module."""

    def __init__(self):
        self.factor = 1.0
        self.window = 8
        self.bias = torch.zeros(H, S)


class CachedCalls(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 1000))
    def start(self, seed):
        generator = torch.Generator().manual_seed(seed)
        self.q, self.k, self.v = (torch.randn(B, H, n, E, generator=generator)
                                  for n in (L, S, S))
        self.config = config = Config()
        self.options = {}

        def score_mod(score, b, h, q_idx, kv_idx):
            return score * config.factor + config.bias[h, kv_idx]

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= config.window) & (kv_idx - q_idx <= config.window)
        self.score_mod, self.mask_mod = score_mod, mask_mod
        self.rebuild_mask(8)
        self.calls = 0

    @rule(factor=st.sampled_from([1.0, 0.5, -0.25, 2.0]))
    def set_factor(self, factor):
        self.config.factor = factor

    @rule(window=st.integers(0, 60))
    def rebuild_mask(self, window):
        self.config.window = window
        self.block_mask = flexfa.create_block_mask(self.mask_mod, None, None, L, S,
                                                   device="cpu", BLOCK_SIZE=16)

    @rule(value=st.floats(-1.0, 1.0), head=st.integers(0, H - 1))
    def edit_bias_in_place(self, value, head):
        self.config.bias[head].fill_(value)
        self.config.bias[head, ::3] = -value

    @rule(seed=st.integers(0, 1000))
    def replace_bias(self, seed):
        self.config.bias = torch.randn(H, S, generator=torch.Generator().manual_seed(seed))

    @rule()
    def restride_bias(self):  # the same values, column-major
        self.config.bias = self.config.bias.t().contiguous().t()

    @rule(dtype=st.sampled_from([torch.float16, torch.float32, torch.float64]))
    def recast_bias(self, dtype):
        self.config.bias = self.config.bias.to(dtype)

    @rule(options=st.sampled_from([{}, {"BLOCK_M": 16}, {"BLOCK_N": 16, "num_warps": 2},
                                   {"BLOCK_M": 16, "BLOCK_N": 16, "num_stages": 1}]))
    def edit_options_in_place(self, options):
        self.options.clear()
        self.options.update(options)

    @rule(seed=st.integers(0, 1000))
    def edit_q_in_place(self, seed):
        self.q.copy_(torch.randn(self.q.shape, generator=torch.Generator().manual_seed(seed)))

    @rule()
    def relayout_q(self):  # the same values, heads innermost but one
        self.q = self.q.transpose(1, 2).contiguous().transpose(1, 2)

    @invariant()
    def matches_the_reference_now(self):
        # after the setup and after every step: a call as the state is now
        out, lse = flexfa.flex_attention(self.q, self.k, self.v, self.score_mod, self.block_mask,
                                         return_lse=True, kernel_options=self.options)
        (out64, lse64), (out32, lse32) = reference_pair(self.q, self.k, self.v, self.score_mod,
                                                        self.mask_mod)
        assert_close_to_reference(out, out64, out32, name=f"out of call {self.calls}")
        assert_close_to_reference(lse, lse64, lse32, name=f"lse of call {self.calls}")
        self.calls += 1


CachedCalls.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=12,
                                         deadline=None)
test_repeated_calls_see_every_change = CachedCalls.TestCase


def test_the_machine_sees_a_stale_trace(monkeypatch):
    """The check can fail: with the score_mod's first trace kept whatever its guard says (a
    trace memo that missed the mod's reads), some session of steps gets a stale result."""
    import pytest
    from hypothesis import Phase
    from hypothesis.stateful import run_state_machine_as_test

    from flexfa.runtime import pipeline
    first = {}
    real = pipeline.trace_entry

    def sticky(fn, kind=None):
        return first.setdefault(fn, real(fn, kind))
    monkeypatch.setattr(pipeline, "trace_entry", sticky)
    with pytest.raises(AssertionError, match="of call"):
        run_state_machine_as_test(CachedCalls, settings=settings(
            max_examples=30, stateful_step_count=12, deadline=None, database=None,
            phases=(Phase.generate,)))  # no shrinking: only that it fails matters here


def test_each_dtype_of_the_captured_bias_in_turn():
    """recast_bias in a fixed order: CI's derandomized sessions draw float16 only, and each
    cast changes what the kernel loads (a cache keyed on the tensor alone would keep it)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, E, generator=generator) for n in (L, S, S))
    config = Config()
    config.bias = torch.randn(H, S, generator=generator) * 4

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + config.bias[h, kv_idx]
    for dtype in (torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.float32):
        config.bias = (config.bias.float() + 0.25).to(dtype)
        out = flexfa.flex_attention(q, k, v, score_mod)
        (out64, _), (out32, _) = reference_pair(q, k, v, score_mod, None)
        assert_close_to_reference(out, out64, out32, name=f"out with a {dtype} bias")
