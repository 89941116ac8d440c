"""What a repeated call may reuse, each case a second call that differs from the first in one
thing a memo, plan or trace must key on (a mutation audit of the forty-fifth session found each
key component removable without a failing test): results and gradients against the float64
reference. Small shapes: every call runs the kernels under the interpreter."""
import torch

import flexfa
from flexfa import mods
from flexfa.features import keep_mask
from flexfa.reference import attention_reference


def qkv(heads=1, length=64, scale=1.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, length, 16, generator=generator) * scale for _ in range(3)]


def error(out, want) -> float:
    return (out.double() - want).abs().max().item()


def _double(*tensors):
    return [t.detach().double() for t in tensors]


def test_a_new_mask_mod_on_the_same_tables_is_applied():
    # every tile partial: the mask_mod decides; the prepared entry of the first call must not
    # serve the second (prepared.lookup's trace identity check)
    q, k, v = qkv()
    mask = flexfa.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, 64, 64,
                                    device="cpu", BLOCK_SIZE=16, separate_full_blocks=False)
    flexfa.flex_attention(q, k, v, block_mask=mask)
    mask.mask_mod = mods.causal
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    assert error(out, attention_reference(*_double(q, k, v), mask_mod=mods.causal)) < 1e-4


def test_a_carried_trace_follows_a_reassigned_mask_mod():
    # a mask built with its trace (traced_mask=) keeps it only while mask_mod is that mod
    q, k, v = qkv()

    def everything(b, h, q_idx, kv_idx):
        return q_idx >= 0
    counts = torch.full((1, 1, 4), 4, dtype=torch.int32)
    indices = torch.arange(4, dtype=torch.int32).expand(1, 1, 4, 4).contiguous()
    mask = flexfa.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=16, mask_mod=everything,
                                           traced_mask=flexfa.trace(everything))
    mask.mask_mod = mods.causal
    assert mask.traced_mask.name != "everything"
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    assert error(out, attention_reference(*_double(q, k, v), mask_mod=mods.causal)) < 1e-4


def test_a_negative_scale_after_a_positive_one():
    # without a score_mod the forward may take the row max of raw q.k and fold the scale into
    # the exponent only for a positive scale: the plan keys on the sign
    q, k, v = qkv(heads=2, scale=6.0)
    flexfa.flex_attention(q, k, v, scale=0.25)
    out = flexfa.flex_attention(q, k, v, scale=-0.25)
    assert error(out, attention_reference(*_double(q, k, v), scale=-0.25)) < 1e-3


def test_a_captured_tensor_unfrozen_between_calls_gets_its_gradient():
    # the backward plan keys on which captured tensors need a gradient (k, v frozen: no
    # dK/dV kernel either time)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(1))

    def key_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    q, k, v = qkv()
    q.requires_grad_()
    flexfa.flex_attention(q, k, v, score_mod=key_bias).sum().backward()
    bias.requires_grad_()
    flexfa.flex_attention(q, k, v, score_mod=key_bias).sum().backward()
    want = bias.detach().double().requires_grad_()
    attention_reference(*_double(q, k, v), score_mod=lambda s, b, h, i, j: s + want[j]) \
        .sum().backward()
    assert error(bias.grad, want.grad) < 1e-4


def test_only_a_captured_tensor_requiring_grad_takes_autograd():
    bias = torch.randn(64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    q, k, v = qkv()  # frozen inputs: a learnable bias alone
    flexfa.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[j]).sum().backward()
    want = bias.detach().double().requires_grad_()
    attention_reference(*_double(q, k, v), score_mod=lambda s, b, h, i, j: s + want[j]) \
        .sum().backward()
    assert bias.grad is not None and error(bias.grad, want.grad) < 1e-4


def test_a_buffer_computed_while_tracing_is_not_kept_from_a_no_grad_call():
    # (bias * 2) runs while tracing: a trace made under no_grad holds a buffer without a
    # graph, which the training call after it must not reuse
    bias = torch.randn(64, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def doubled(score, b, h, q_idx, kv_idx):
        return score + (bias * 2)[kv_idx]
    q, k, v = qkv()
    with torch.no_grad():
        flexfa.flex_attention(q, k, v, score_mod=doubled)
    flexfa.flex_attention(q, k, v, score_mod=doubled).sum().backward()
    want = bias.detach().double().requires_grad_()
    attention_reference(*_double(q, k, v), score_mod=lambda s, b, h, i, j: s + (want * 2)[j]) \
        .sum().backward()
    assert bias.grad is not None and error(bias.grad, want.grad) < 1e-4


def test_dropout_and_sinks_after_the_same_call_without_them():
    q, k, v = qkv(heads=2)
    plain = flexfa.flex_attention(q, k, v, dropout_p=0.0)
    torch.manual_seed(1)
    drawn = torch.randint(0, 2 ** 63 - 1, (2,), dtype=torch.int64)  # what seed None draws
    torch.manual_seed(1)
    dropped = flexfa.flex_attention(q, k, v, dropout_p=0.5)
    assert not torch.equal(dropped, plain)
    want = attention_reference(*_double(q, k, v), dropout_mask=keep_mask(drawn, 1, 2, 64, 64, 0.5),
                               dropout_p=0.5)
    assert error(dropped, want) < 1e-4
    sinks = torch.tensor([2.0, -1.0])
    out = flexfa.flex_attention(q, k, v, sinks=sinks)
    assert error(out, attention_reference(*_double(q, k, v), sinks=sinks.double())) < 1e-4


def test_a_module_score_mod_reading_a_replaced_buffer_is_traced_again():
    # float(self.temperature) is a constant of the trace: a new buffer tensor (registered
    # buffers live in _buffers) must be seen by the trace's guard
    class Temperature(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("temperature", torch.tensor(1.0))

        def forward(self, score, b, h, q_idx, kv_idx):
            return score / float(self.temperature)
    module = Temperature()
    q, k, v = qkv()
    flexfa.flex_attention(q, k, v, score_mod=module)
    module.temperature = torch.tensor(0.25)
    out = flexfa.flex_attention(q, k, v, score_mod=module)
    want = attention_reference(*_double(q, k, v), score_mod=lambda s, b, h, i, j: s / 0.25)
    assert error(out, want) < 1e-4


def test_varlen_with_another_window_or_causal_flag_on_the_same_offsets():
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(100, 2, 16, generator=generator) for _ in range(3))
    for causal, window in ((False, None), (True, None), (True, 4)):
        out = flexfa.varlen_attention(q, k, v, cu, cu, causal=causal, window=window)
        for start, end in ((0, 40), (40, 100)):
            def kept(b, h, q_idx, kv_idx, window=window, causal=causal):
                near = (q_idx - kv_idx < window) if window is not None else q_idx >= 0
                return ((q_idx >= kv_idx) | (not causal)) & near
            piece = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]
            want = attention_reference(*_double(*piece), mask_mod=kept)[0].transpose(0, 1)
            assert error(out[start:end], want) < 1e-4, (window, start)
