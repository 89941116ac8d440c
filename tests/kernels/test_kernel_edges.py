"""Kernel paths a mutation audit (forty-fifth session) found unguarded: a change to each broke
results or gradients with every test passing. Each case against the float64 reference."""
import torch

import flexfa
from flexfa.reference import attention_reference
from flexfa.runtime import plans


def _grads(mod, q, k, v, grad, **kwargs):
    """flexfa's (out, dq, dk, dv) and the float64 reference's."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flexfa.flex_attention(*leaves, score_mod=mod, **kwargs)
    out.backward(grad)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask_mod = kwargs.get("block_mask").mask_mod if kwargs.get("block_mask") else None
    ref = attention_reference(*refs, score_mod=mod, mask_mod=mask_mod,
                              enable_gqa=kwargs.get("enable_gqa", False))
    ref.backward(grad.double())
    return [out, *(t.grad for t in leaves)], [ref, *(t.grad for t in refs)]


def _close(got, want, tolerance=2e-4):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        error = (a.double() - b).abs().max().item()
        assert error < tolerance, (name, error)


def test_constant_factors_reach_the_gradients():
    # the backward renders a score_mod with its constant factors folded out and multiplies
    # d score_mod / d score by their product: a temperature (product 1/2), 3 tanh (3)
    generator = torch.Generator().manual_seed(0)

    def temperature(score, b, h, q_idx, kv_idx):
        return score / 2.0

    def scaled_tanh(score, b, h, q_idx, kv_idx):
        return 3.0 * torch.tanh(score)
    for mod in (temperature, scaled_tanh):
        q, k, v, grad = (torch.randn(1, 2, 64, 32, generator=generator) for _ in range(4))
        _close(*_grads(mod, q, k, v, grad))


def test_a_negative_constant_factor_is_not_folded():
    # folded into the exponent, a negative factor turns the running max into the row minimum:
    # exp2 of scores far above it overflows in fp16 P
    generator = torch.Generator().manual_seed(0)

    def negated(score, b, h, q_idx, kv_idx):
        return score * -2.0
    q = (4.0 * torch.randn(1, 2, 64, 32, generator=generator)).half()
    k, v = (torch.randn(1, 2, 64, 32, generator=generator).half() for _ in range(2))
    out, lse = flexfa.flex_attention(q, k, v, score_mod=negated, return_lse=True)
    want, want_lse = attention_reference(q, k, v, negated, return_lse=True)
    assert (out.double() - want).abs().nan_to_num(nan=float("inf")).max() < 2e-3
    assert (lse.double() - want_lse).abs().max() < 1e-2


def test_gqa_gradients_walk_each_query_heads_tables():
    # per-query-head windows: the group's query heads have different tables, which dQ and
    # dK/dV must walk per query head, not per key head
    windows = torch.tensor([16, 48, 96, 200])

    def per_head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < windows[h])
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 128, 32, generator=generator)
    k, v = (torch.randn(1, 2, 128, 32, generator=generator) for _ in range(2))
    grad = torch.randn(1, 4, 128, 32, generator=generator)
    mask = flexfa.create_block_mask(per_head_window, None, 4, 128, 128, device="cpu",
                                    BLOCK_SIZE=32)
    _close(*_grads(None, q, k, v, grad, block_mask=mask, enable_gqa=True))


def test_a_captured_gradient_ignores_an_infinite_derivative_where_p_is_zero():
    # a log-gate of 0 at the keys the mask drops: d score_mod / d gate is inf there, times a
    # dS of 0; the gate's gradient there is 0 (autograd's reference gives 0 * inf = NaN)
    valid = 40
    gate = torch.ones(64)
    gate[valid:] = 0.0
    gate.requires_grad_()

    def not_padding(b, h, q_idx, kv_idx):
        return kv_idx < valid
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 64, 32, generator=generator) for _ in range(4))
    mask = flexfa.create_block_mask(not_padding, None, None, 64, 64, device="cpu",
                                    BLOCK_SIZE=32)
    out = flexfa.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + torch.log(gate[j]),
                                block_mask=mask)
    (dgate,) = torch.autograd.grad(out, [gate], grad)
    gate64 = gate.detach().double().requires_grad_()
    ref = attention_reference(*(t.double() for t in (q, k, v)),
                              lambda s, b, h, i, j: s + torch.log(gate64[j]), not_padding)
    (want,) = torch.autograd.grad(ref, [gate64], grad.double())
    assert (dgate[valid:] == 0).all()
    assert (dgate[:valid].double() - want[:valid]).abs().max() < 1e-4


def test_gluon_forward_at_a_length_one_short_of_a_key_tile():
    # S % BLOCK_N == BLOCK_N - 1: the tile reaching past S must take the bounds check (a
    # zero-filled key past S would join every row's softmax); scores near -8 make it weigh
    generator = torch.Generator().manual_seed(0)
    for S, anti in ((127, False), (127, True)):
        q = torch.randn(1, 2, 128, 64, generator=generator).bfloat16()
        k, v = (torch.randn(1, 2, S, 64, generator=generator).bfloat16() for _ in range(2))
        if anti:
            q, k = torch.ones_like(q), -torch.ones_like(k)
            v = (1.0 + torch.rand(1, 2, S, 64, generator=generator)).bfloat16()
        plans.PLANS.clear()
        out, lse = flexfa.flex_attention(q, k, v, return_lse=True, kernel_options={
            "GLUON_EMULATE": True, "BACKEND": "GLUON"})
        assert [p.family.name for p in plans.PLANS.values()] == ["gluon"]
        want, want_lse = attention_reference(q, k, v, return_lse=True)
        assert (out.double() - want).abs().max() < 3e-2, (S, anti)
        assert (lse.double() - want_lse).abs().max() < 1e-2, (S, anti)


def test_hopper_strided_inputs_with_gqa_batches_and_wider_values():
    # [B, L, H, E] memory seen as [B, H, L, E] (a projection's output): k's rows are Hkv * E
    # apart, q's Hq * E, v's Hkv * Ev; at even lengths the 2-D row views of each tensor start
    # from its own strides
    generator = torch.Generator().manual_seed(0)
    cases = (((2, 4, 2, 128, 32, 32), torch.float16, True),
             ((2, 2, 2, 128, 32, 64), torch.bfloat16, False))
    for (B, Hq, Hkv, L, E, Ev), dtype, gqa in cases:
        q = torch.randn(B, L, Hq, E, generator=generator).to(dtype).transpose(1, 2)
        k = torch.randn(B, L, Hkv, E, generator=generator).to(dtype).transpose(1, 2)
        v = torch.randn(B, L, Hkv, Ev, generator=generator).to(dtype).transpose(1, 2)
        out, lse = flexfa.flex_attention(q, k, v, enable_gqa=gqa, return_lse=True,
                                         kernel_options={"BACKEND": "HOPPER"})
        want, want_lse = attention_reference(q, k, v, enable_gqa=gqa, return_lse=True)
        assert (out.double() - want).abs().max() < 3e-2, (B, Hq, Hkv, Ev)
        assert (lse.double() - want_lse).abs().max() < 1e-2, (B, Hq, Hkv, Ev)


def test_wide_gluon_backward_captured_gradient_at_a_length_one_short_of_a_split():
    # E = 256's Gluon backward: at S % SPLIT == SPLIT - 1 the consumer tile holding the key
    # past S must take the bounds check, or its zero-filled key's dS lands on a per-key bias's
    # last entry (its clamped index)
    generator = torch.Generator().manual_seed(0)
    S = 127
    bias = (0.1 * torch.randn(S, generator=generator)).requires_grad_()
    q, k, v = (torch.randn(1, 1, n, 256, generator=generator).bfloat16() for n in (128, S, S))
    # every real score -2: the zero-filled key's score 0 would weigh the most
    q, k = 0.25 * torch.ones_like(q), -0.5 * torch.ones_like(k)
    grad = torch.randn(1, 1, 128, 256, generator=generator).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    plans.PLANS.clear()
    out = flexfa.flex_attention(*leaves, score_mod=lambda s, b, h, i, j: s + bias[j],
                                kernel_options={"GLUON_EMULATE": True, "BACKEND": "GLUON",
                                                "GLUON_BACKWARD": True})
    *_, dbias = torch.autograd.grad(out, [*leaves, bias], grad)  # (with dK/dV to make)
    assert "gluon_bwd" in {p.family.name for p in plans.PLANS.values()}
    bias64 = bias.detach().double().requires_grad_()
    ref = attention_reference(*(t.double() for t in (q, k, v)),
                              lambda s, b, h, i, j: s + bias64[j])
    (want,) = torch.autograd.grad(ref, [bias64], grad.double())
    assert (dbias.double() - want).abs().max() < 2e-2, (dbias[-1].item(), want[-1].item())
