"""Attention sinks (``flex_attention(..., sinks=)``): per-head logits in each row's softmax
denominator, from both bf16-class templates and the FP8 one under the interpreter, against
the float64 reference (``attention_reference(..., sinks=)``): out, lse (which includes the
sink), rows with nothing to attend (out 0, lse = sink), gradients into q, k, v, captured
tensors and the sinks, split-KV decoding, random shapes with dropout (hypothesis), and bad sinks refused before any
launch."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import flexfa
from flexfa.errors import InputError, InputTypeError
from flexfa.reference import attention_reference
from flexfa.runtime import launch, registry
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.options import KernelOptions
from flexfa.runtime.target import parse_target
from kernels.forward_utils import TEMPLATES, make_qkv
from reference import assert_close_to_reference

B, HQ, HKV, L, S, E = 1, 4, 2, 56, 80, 32  # GQA 2; L, S not tile multiples


def late_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx + 20  # rows 0..19 attend to nothing


def make_sinks(dtype=torch.float32, seed=3):
    generator = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(HQ, generator=generator)).to(dtype)


def block_mask_of(mask_mod, q_len=L, kv_len=S):
    return flexfa.create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu",
                                    BLOCK_SIZE=32)


def reference_pair(q, k, v, sinks, mask_mod=None, score_mod=None):
    """(float64, same-dtype eager) (out, lse) of the reference with sinks."""
    kwargs = dict(enable_gqa=True, return_lse=True, sinks=sinks)
    return (attention_reference(q, k, v, score_mod, mask_mod, **kwargs),
            attention_reference(q, k, v, score_mod, mask_mod, dtype=q.dtype, **kwargs))


# split-KV adds the sinks as it combines the splits
SPLIT_HOPPER = {"BACKEND": "HOPPER", "SPLIT_KV": 2}


@pytest.mark.parametrize("template", [*sorted(TEMPLATES), "hopper_split"])
def test_forward_matches_the_reference_with_empty_rows(template):
    q, k, v = make_qkv(B, HQ, HKV, L, S, E, dtype=torch.bfloat16)
    sinks = make_sinks()
    out, aux = flexfa.flex_attention(q, k, v, block_mask=block_mask_of(late_causal),
                                     enable_gqa=True, sinks=sinks,
                                     return_aux=flexfa.AuxRequest(lse=True, max_scores=True),
                                     kernel_options=TEMPLATES.get(template, SPLIT_HOPPER))
    lse = aux.lse
    exact, eager = reference_pair(q, k, v, sinks, late_causal)
    assert_close_to_reference(out, exact[0], eager[0])
    assert_close_to_reference(lse, exact[1], eager[1], name="lse")
    # the row max is the scores' own (-inf for the empty rows), not the sink's
    _, _, row_max = attention_reference(q, k, v, None, late_causal, enable_gqa=True,
                                        return_lse=True, return_max=True)
    assert_close_to_reference(aux.max_scores, row_max, row_max, name="max_scores")
    # rows with nothing to attend: the sink alone, whose value is 0
    assert torch.equal(out[:, :, :20], torch.zeros_like(out[:, :, :20]))
    torch.testing.assert_close(lse[:, :, :20], sinks.view(1, HQ, 1).expand(B, HQ, 20))


def test_sinks_in_the_query_dtype_and_a_score_mod():
    q, k, v = make_qkv(1, HQ, HQ, 40, 56, 16, dtype=torch.float16, seed=1)
    sinks = make_sinks(torch.float16)

    def softcap(score, b, h, q_idx, kv_idx):
        return 5.0 * torch.tanh(score / 5.0)
    out, lse = flexfa.flex_attention(q, k, v, softcap, return_lse=True, sinks=sinks)
    exact, eager = reference_pair(q, k, v, sinks, score_mod=softcap)
    assert_close_to_reference(out, exact[0], eager[0])
    assert_close_to_reference(lse, exact[1], eager[1], name="lse")


def test_a_sink_of_minus_infinity_changes_nothing():
    q, k, v = make_qkv(1, HQ, HQ, 40, 56, 16, seed=2)
    mask = block_mask_of(late_causal, 40, 56)
    plain, plain_lse = flexfa.flex_attention(q, k, v, block_mask=mask, return_lse=True)
    sinks = torch.full((HQ,), -math.inf)
    out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, return_lse=True, sinks=sinks)
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    assert (lse[:, :, :20] == -math.inf).all()


# every forward path that folds a sink: the Ampere-class and Hopper kernels, the Hopper
# split-KV combine, the decode kernel (at most 16 rows) and its combine
SINK_PATHS = {"ampere": (40, torch.float32, TEMPLATES["ampere"]),
              "hopper": (40, torch.bfloat16, TEMPLATES["hopper"]),
              "hopper_split": (40, torch.bfloat16, SPLIT_HOPPER),
              "decode": (12, torch.float32, None), "decode_split": (12, torch.float32,
                                                                    {"SPLIT_KV": 2})}


@pytest.mark.parametrize("path", sorted(SINK_PATHS))
def test_a_sink_of_plus_infinity_takes_every_row_of_its_head(path):
    """Regression: a sink of +inf gave NaN rows in the kernels that fold the sink in their
    epilogue (exp2(inf - inf) for its own term) and out 0 in the split-KV combines and the
    float64 reference. It takes all the probability: out 0 and lse +inf (the limit), the
    other heads untouched; a +inf score beside it keeps its row NaN, as the reference."""
    q_len, dtype, options = SINK_PATHS[path]
    q, k, v = make_qkv(1, 2, 2, q_len, 48, 16, dtype=dtype, seed=6)
    sinks = torch.tensor([math.inf, 0.5])

    def inf_at_row_5(score, b, h, q_idx, kv_idx):
        return torch.where((q_idx == 5) & (kv_idx == 0), math.inf, score)

    def window_without_row_3(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 30) & (q_idx != 3)
    mask = block_mask_of(window_without_row_3, q_len, 48)
    out, lse = flexfa.flex_attention(q, k, v, inf_at_row_5, mask, return_lse=True,
                                     sinks=sinks, kernel_options=options)
    exact, eager = reference_pair(q, k, v, sinks, window_without_row_3, inf_at_row_5)
    assert_close_to_reference(out[:, 1], exact[0][:, 1], eager[0][:, 1])
    assert_close_to_reference(lse[:, 1], exact[1][:, 1], eager[1][:, 1], name="lse")
    rows = [r for r in range(q_len) if r != 5]
    assert torch.equal(out[:, 0, rows], torch.zeros_like(out[:, 0, rows]))
    assert (lse[:, 0] == math.inf).all()
    assert out[:, :, 5].isnan().all() and exact[0][:, :, 5].isnan().all()


@pytest.mark.parametrize("path", ["fp8", "gluon_emulated"])
def test_fp8_and_gluon_forwards_fold_a_sink_of_plus_infinity(path):
    """The FP8 kernel (its l_i carries 2**P_SHIFT) and the Gluon forward (emulated) fold a
    +inf sink as the others: out 0 and lse +inf in its head, the other head as without it."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, dtype=torch.bfloat16, seed=12)
    sinks = torch.tensor([math.inf, 0.5])
    if path == "fp8":
        x = flexfa.fp8.quantize(q, k, v)
        out, lse = flexfa.fp8.flex_attention_fp8(x, return_lse=True, sinks=sinks)
        _, plain = flexfa.fp8.flex_attention_fp8(x, return_lse=True)
    else:
        options = {"GLUON_EMULATE": True, "BACKEND": "GLUON"}
        out, lse = flexfa.flex_attention(q, k, v, return_lse=True, sinks=sinks,
                                         kernel_options=options)
        _, plain = flexfa.flex_attention(q, k, v, return_lse=True, kernel_options=options)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and (lse[:, 0] == math.inf).all()
    torch.testing.assert_close(lse[:, 1], torch.logaddexp(plain[:, 1], sinks[1]))


def test_gradients_with_a_sink_of_plus_infinity_are_the_limits():
    """Regression: a +inf sink's rows (lse +inf) were read as rows that saw a +inf score:
    NaN dq for every row of its head, and NaN in every captured tensor's gradient. They give
    the limit's gradients, those of the float64 reference at a sink of 1e4 (where every
    exp(score - lse) is exactly 0 and d lse / d sink exactly 1): nothing into q, k, v or a
    learnable bias from that head, d sink = the sum of its rows' dlse."""
    q, k, v = make_qkv(B, HQ, HKV, L, S, E, seed=8)
    bias = torch.randn(HQ, L, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx]
    sinks = make_sinks()
    sinks[0] = math.inf
    got, _, _ = flexfa_and_reference_grads(q, k, v, sinks, [bias], late_causal, biased, None)
    sinks[0] = 1e4
    _, want, _ = flexfa_and_reference_grads(q, k, v, sinks, [bias], late_causal, biased, None)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks", "dbias"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4, msg=name)
    assert (got[0][:, 0] == 0).all() and (got[4][0] == 0).all()


@pytest.mark.parametrize("big", [1e31, 2e38])
def test_a_plus_infinity_sinks_gradients_stay_the_limits_beside_enormous_finite_scores(big):
    """Regression: the backward read a +inf sink's rows with lse clamped to 2**100, so a
    finite score past 1.27e30 (inside the range the interpreter resolves, docs/training.md)
    gave exp2(score - 2**100) = inf and NaN dq, dk and dv (inf * 0). Its rows' gradients are
    the limit's: zero, as at ordinary scores."""
    q, k, v = make_qkv(1, 1, 1, 16, 16, 16, seed=2)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]

    def one_enormous_key(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == 2, big, score)
    out, lse = flexfa.flex_attention(*inputs, one_enormous_key, return_lse=True,
                                     sinks=torch.tensor([math.inf]))
    assert (out == 0).all() and (lse == math.inf).all()
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for name, grad in zip("qkv", torch.autograd.grad((out * grad_out).sum(), inputs)):
        assert (grad == 0).all(), f"d{name}: {grad.isnan().sum().item()} NaN"


def test_rows_of_a_fully_masked_head_hold_the_sink():
    q, k, v = make_qkv(1, HQ, HQ, 40, 56, 16, seed=4)
    sinks = make_sinks()

    def head_zero_blind(b, h, q_idx, kv_idx):
        return h > 0
    mask = flexfa.create_block_mask(head_zero_blind, None, HQ, 40, 56, device="cpu",
                                    BLOCK_SIZE=32)
    out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, return_lse=True, sinks=sinks)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    assert torch.equal(lse[:, 0], sinks[0].expand(1, 40))
    exact, eager = reference_pair(q, k, v, sinks, head_zero_blind)
    assert_close_to_reference(out, exact[0], eager[0])


def flexfa_and_reference_grads(q, k, v, sinks, buffers, mask_mod, score_mod, options, seed=5):
    """(flexfa's, float64's, same-dtype eager's) gradients of out and lse with respect to
    q, k, v, the sinks and the captured ``buffers``."""
    generator = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(B, HQ, L, E, generator=generator)
    grad_lse = torch.randn(B, HQ, L, generator=generator)
    inputs = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    mask = block_mask_of(mask_mod)
    out, lse = flexfa.flex_attention(*inputs[:3], score_mod, mask, enable_gqa=True,
                                     return_lse=True, sinks=inputs[3], kernel_options=options)
    got = torch.autograd.grad([out, lse], inputs + list(buffers),
                              [grad_out.to(q.dtype), grad_lse])
    wanted = []
    for dtype in (torch.float64, q.dtype):
        ref_inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref_sinks = sinks.detach().clone().requires_grad_()
        ref_out, ref_lse = attention_reference(*ref_inputs, score_mod, mask_mod, enable_gqa=True,
                                               return_lse=True, sinks=ref_sinks, dtype=dtype)
        wanted.append(torch.autograd.grad([ref_out, ref_lse], ref_inputs + [ref_sinks]
                                          + list(buffers),
                                          [grad_out.to(dtype), grad_lse.to(dtype)]))
    return got, wanted[0], wanted[1]


@pytest.mark.parametrize("template,dtype", [("ampere", torch.float32),
                                            ("hopper", torch.bfloat16)])
def test_gradients_into_inputs_sinks_and_captured_tensors(template, dtype):
    q, k, v = make_qkv(B, HQ, HKV, L, S, E, dtype=dtype, seed=6)
    bias = (0.1 * torch.randn(HQ, L)).requires_grad_()

    def row_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx]
    got, exact, eager = flexfa_and_reference_grads(q, k, v, make_sinks(), [bias], late_causal,
                                                   row_bias, TEMPLATES[template])
    names = ("dq", "dk", "dv", "dsinks", "dbias")
    for name, g, want, same in zip(names, got, exact, eager):
        floor = 1e-2 if dtype == torch.bfloat16 else None
        assert_close_to_reference(g, want, same, fudge=6.0, name=name,
                                  floor=floor if name in ("dsinks", "dbias") else None)


def test_sinks_gradient_by_finite_differences():
    """d (g . out + h . lse) / d sinks against central differences of the kernels' own
    forward (float32; the gradient is -sum_rows exp(sink - lse) * (dO . O - dlse))."""
    q, k, v = make_qkv(1, 2, 2, 40, 48, 16, seed=7)
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    generator = torch.Generator().manual_seed(8)
    g, h = torch.randn(1, 2, 40, 16, generator=generator), torch.randn(1, 2, 40,
                                                                        generator=generator)

    def loss(s):
        out, lse = flexfa.flex_attention(q, k, v, return_lse=True, sinks=s)
        return (out * g).sum() + (lse * h).sum()
    (grad,) = torch.autograd.grad(loss(sinks), [sinks])
    step = 1e-2
    with torch.no_grad():
        for i in range(2):
            e = torch.zeros(2)
            e[i] = step
            numeric = (loss(sinks + e) - loss(sinks - e)) / (2 * step)
            assert abs(grad[i].item() - numeric.item()) <= 2e-3 * (1 + abs(numeric.item()))



def test_a_nan_row_leaves_other_heads_sinks_gradients_finite():
    """A NaN in one head's query makes that head's rows NaN (lse NaN); the other heads never
    see it, and their sinks' gradients stay finite, as the reference's (they are not
    poisoned like a captured tensor's, which any row may read)."""
    q, k, v = make_qkv(1, 2, 2, 40, 48, 16, seed=7)
    q[0, 1, 5, 3] = math.nan
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    (grad,) = torch.autograd.grad(flexfa.flex_attention(q, k, v, sinks=sinks)[:, 0].sum(),
                                  [sinks])
    exact = sinks.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(attention_reference(q, k, v, sinks=exact)[:, 0].sum(), [exact])
    assert torch.isfinite(want[0])
    torch.testing.assert_close(grad[0], want[0], atol=1e-5, rtol=1e-4)

def test_split_kv_decoding_adds_the_sink_once():
    q, k, v = make_qkv(1, 2, 2, 3, 1100, 16, seed=9)
    sinks = torch.tensor([1.0, 3.0])
    out, lse = flexfa.flex_attention(q, k, v, return_lse=True, sinks=sinks,
                                     kernel_options={"SPLIT_KV": 2})
    exact, eager = (attention_reference(q, k, v, return_lse=True, sinks=sinks, dtype=dtype)
                    for dtype in (torch.float64, torch.float32))
    assert_close_to_reference(out, exact[0], eager[0])
    assert_close_to_reference(lse, exact[1], eager[1], name="lse")


def test_fp8_forward_folds_the_sink_exactly():
    """The FP8 kernel with sinks against itself without: out * exp(lse - lse_sink) and
    lse_sink = logaddexp(lse, sink) (an identity, free of FP8's own error)."""
    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.bfloat16, seed=10)
    sinks = torch.tensor([0.5, 4.0])
    x = flexfa.fp8.quantize(q, k, v)
    out, lse = flexfa.fp8.flex_attention_fp8(x, return_lse=True)
    out_s, lse_s = flexfa.fp8.flex_attention_fp8(x, return_lse=True, sinks=sinks)
    torch.testing.assert_close(lse_s, torch.logaddexp(lse, sinks.view(1, 2, 1)))
    torch.testing.assert_close(out_s.float(), (out.float() * torch.exp(lse - lse_s)[..., None]),
                               atol=1e-2, rtol=1e-2)


def test_bad_sinks_fail_before_any_launch(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")
    monkeypatch.setattr(launch.Step, "launch", no_launch)
    q, k, v = make_qkv(1, HQ, HQ, 16, 16, 16)
    cases = [
        (torch.zeros(HQ + 1), InputError, r"sinks has shape \(5,\) but query has 4 heads"),
        (torch.zeros(1, HQ), InputError, r"sinks has shape \(1, 4\)"),
        (torch.zeros(HQ, dtype=torch.float64), InputTypeError, "sinks has dtype torch.float64"),
        (torch.zeros(HQ, dtype=torch.int32), InputTypeError, "sinks has dtype torch.int32"),
        (torch.zeros(HQ, device="meta"), InputError, "sinks is on meta but query is on cpu"),
        (torch.zeros(HQ).to_sparse(), InputError, "sinks has layout torch.sparse_coo"),
        (torch._neg_view(torch.ones(HQ)), InputError, "sinks is a lazily negated view"),
        ([0.0] * HQ, InputTypeError, "sinks must be a torch.Tensor or None, got list"),
    ]
    for sinks, error, message in cases:
        with pytest.raises(error, match=message):
            flexfa.flex_attention(q, k, v, sinks=sinks)
    with pytest.raises(InputTypeError, match=r"sinks has dtype torch.float16; it must be "
                                              r"float32 or the query's dtype torch.float32"):
        flexfa.flex_attention(q, k, v, sinks=torch.zeros(HQ, dtype=torch.float16))


def test_calls_without_sinks_keep_their_kernels():
    """No sinks: no SINKS parameter and HAS_SINKS off; a family that does not implement
    sinks is never chosen for a call with them."""
    from flexfa.codegen.forward import forward_kernel
    from flexfa.runtime.families.ampere import forward_spec

    q, k, v = make_qkv(1, 2, 2, 16, 16, 16)
    target = parse_target("interpret")
    plain = AttentionCall(None, None, None, 0.25, KernelOptions(), 1)
    with_sinks = AttentionCall(None, None, None, 0.25, KernelOptions(), 1, torch.zeros(2))
    source = forward_kernel(forward_spec(q, k, v, plain, target, True), None, None).source
    assert "SINKS" not in source.split("def flexfa_fwd_d16")[1].split("):")[0]
    assert "HAS_SINKS = tl.constexpr(False)" in source
    spec = forward_spec(q, k, v, with_sinks, target, True)
    assert spec.sinks_dtype == "fp32" and "SINKS," in forward_kernel(spec, None, None).source

    class Plain(registry.KernelFamily):
        name = "plain_probe"
    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.setitem(registry._FAMILIES, "forward", [Plain()])
        with pytest.raises(InputError, match="plain_probe: it has no sinks"):
            registry.choose("forward", target, with_sinks, q, k, v)
        assert isinstance(registry.choose("forward", target, plain, q, k, v), Plain)
    finally:
        monkeypatch.undo()


@settings(max_examples=6)
@given(q_len=st.integers(1, 70), kv_len=st.integers(1, 70), group=st.sampled_from([1, 2]),
       window=st.integers(0, 40), sink_values=st.lists(
           st.one_of(st.floats(-30.0, 30.0), st.sampled_from([-math.inf, math.inf])),
           min_size=2, max_size=2),
       dropout=st.sampled_from([0.0, 0.5]))
def test_random_shapes_windows_and_sinks(q_len, kv_len, group, window, sink_values, dropout):
    """Sliding windows that leave some rows empty, sinks from -inf to +inf, with and without
    dropout, GQA or not: out and lse against the float64 reference."""
    hq = 2 * group
    q, k, v = make_qkv(1, hq, 2, q_len, kv_len, 16, seed=q_len * 71 + kv_len)
    sinks = torch.tensor(sink_values * group, dtype=torch.float32)

    def band(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    mask = flexfa.create_block_mask(band, None, None, q_len, kv_len, device="cpu",
                                    BLOCK_SIZE=32)
    out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=group > 1,
                                     return_lse=True, sinks=sinks, dropout_p=dropout,
                                     dropout_seed=7)
    keep = flexfa.dropout_mask(7, 1, hq, q_len, kv_len, dropout) if dropout else None
    exact, eager = (attention_reference(q, k, v, None, band, enable_gqa=group > 1,
                                        return_lse=True, sinks=sinks, dropout_mask=keep,
                                        dropout_p=dropout, dtype=dtype)
                    for dtype in (torch.float64, torch.float32))
    assert_close_to_reference(out, exact[0], eager[0])
    assert_close_to_reference(lse, exact[1], eager[1], name="lse")
