"""flexfa.codegen.fold: a score_mod's constant input and output factors folded into the scales
the kernels apply anyway (the softmax scale, exp2's log2(e)); the kernels that run the folded
mods (every forward template and the Triton backward under the interpreter) against the
float64 reference, with their lse and row max, and their gradients."""
import math

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest

import flexfa
from flexfa.codegen.backward import score_joint_code
from flexfa.codegen.fold import FOLD_RANGE, fold_joint, fold_scales
from flexfa.codegen.forward import forward_kernel, mod_buffer_args
from flexfa.codegen.spec import KernelSpec
from flexfa.frontend.grad import derive
from flexfa.frontend.ir import Op
from flexfa.frontend.trace import trace
from flexfa.reference import attention_reference
from kernels.backward_utils import check_backward
from kernels.forward_utils import TEMPLATES, make_qkv


def folded(fn):
    return fold_scales(trace(fn, "score_mod").root)


def test_softcap_folds_both_factors():
    fold = folded(flexfa.mods.softcap(30.0))
    assert fold.root.op is Op.TANH and fold.root.src[0].op is Op.SCORE
    assert fold.in_scale == 1.0 / 30.0 and fold.out_scale == 30.0


@pytest.mark.parametrize("fn, in_scale, out_scale", [
    (lambda s, b, h, q, k: s * 0.5, 1.0, 0.5),  # a pure scale: the output's
    (lambda s, b, h, q, k: 4.0 * (s * 0.25), 1.0, 1.0),  # out first: 4 * (s / 4) -> s, 1.0
    (lambda s, b, h, q, k: 2.0 * torch.tanh(s / 4.0) + 1.0, 0.25, 1.0),  # no output factor
    (lambda s, b, h, q, k: torch.tanh(s / 4.0) * (s / 4.0), 0.25, 1.0),  # one node used twice
    (lambda s, b, h, q, k: (torch.tanh(s * 3.0) / 8.0) / 2.0, 3.0, 1.0 / 16.0),
])
def test_fold_factors(fn, in_scale, out_scale):
    fold = folded(fn)
    assert (fold.in_scale, fold.out_scale) == pytest.approx((in_scale, out_scale), rel=1e-15)


@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, k: -3.0 * torch.tanh(s),  # negative: the row max would flip
    lambda s, b, h, q, k: torch.tanh(s) * 0.0,  # zero
    lambda s, b, h, q, k: torch.tanh(s) * 2.0 ** 70,  # outside FOLD_RANGE
    lambda s, b, h, q, k: torch.tanh(s / 2.0 ** -70),
    lambda s, b, h, q, k: s / 4.0 + s * 2.0,  # the score used two ways
    lambda s, b, h, q, k: torch.tanh(s / 4.0) + s,  # scaled and unscaled
    lambda s, b, h, q, k: s + (q - k),  # a sum: no factor
    lambda s, b, h, q, k: s * (q - k + 1),  # a factor that is not a constant
    lambda s, b, h, q, k: torch.tanh(s) * float("inf"),  # a non-finite one
])
def test_what_does_not_fold(fn):
    root = trace(fn, "score_mod").root
    fold = fold_scales(root)
    assert fold.root is root and (fold.in_scale, fold.out_scale) == (1.0, 1.0)


def test_folded_factors_stay_within_range():
    fold = folded(lambda s, b, h, q, k: (torch.tanh(s) * 2.0 ** 40) * 2.0 ** 40)
    assert FOLD_RANGE[0] <= fold.out_scale <= FOLD_RANGE[1] and fold.out_scale == 2.0 ** 40


def test_forward_module_renders_the_folded_mod():
    spec = KernelSpec(dtype="bf16", head_dim=32, head_dim_v=32, block_m=32, block_n=32,
                      num_warps=4, num_stages=1, has_block_mask=False, has_full_blocks=False,
                      sparse_q=32, sparse_kv=32, even_l=True, even_s=True, return_lse=True,
                      gqa_group=1, input_precision="ieee", target="cpu")
    source = forward_kernel(spec, trace(flexfa.mods.softcap(30.0), "score_mod"), None).source
    assert f"SCORE_IN_SCALE = tl.constexpr({1.0 / 30.0!r})" in source
    assert "SCORE_OUT_SCALE = tl.constexpr(30.0)" in source
    mod_body = source.split("def flexfa_score_mod", 1)[1].split("return score_mod_out", 1)[0]
    assert "30.0" not in mod_body and "tanh" in mod_body
    plain = forward_kernel(spec, None, None).source
    assert "SCORE_IN_SCALE = tl.constexpr(1.0)" in plain
    assert "SCORE_OUT_SCALE = tl.constexpr(1.0)" in plain


def scaled_softcap(score, b, h, q_idx, kv_idx):
    return 2.5 * torch.tanh(score / 3.0)  # both factors fold


def half_alibi(score, b, h, q_idx, kv_idx):
    return 0.5 * (score - (h + 1) * 0.25 * (q_idx - kv_idx))  # an output factor only


def late_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx + 10  # rows 0..9 attend to nothing


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("score_mod", [scaled_softcap, half_alibi])
def test_folded_forward_matches_the_reference(template, score_mod):
    """Out, lse and the row max (natural units: the folded output factor is back in them) of
    the folded mods against the float64 reference, masked and empty rows included."""
    q, k, v = make_qkv(1, 2, 2, 48, 64, 32, dtype=torch.bfloat16, seed=11)
    mask = flexfa.create_block_mask(late_causal, 1, 2, 48, 64, device="cpu", BLOCK_SIZE=32)
    out, aux = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, scale=0.4,
                                     kernel_options=TEMPLATES[template],
                                     return_aux=AuxRequest(lse=True, max_scores=True))
    out64, lse64, max64 = attention_reference(q, k, v, score_mod, late_causal, scale=0.4,
                                              return_lse=True, return_max=True)
    empty = torch.isneginf(max64)
    assert empty.any() and torch.equal(torch.isneginf(aux.max_scores), empty)
    assert torch.equal(torch.isneginf(aux.lse), empty)
    torch.testing.assert_close(aux.max_scores.double()[~empty], max64[~empty], rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(aux.lse.double()[~empty], lse64[~empty], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), out64, rtol=2e-2, atol=2e-2)
    assert math.isfinite(out.double().abs().max().item())


def test_the_backward_renders_the_folded_joint_graph():
    """softcap's joint graph folded: the score read as q.k * scale / 30, tanh and its
    derivative 1 - tanh^2 without the constants (30 * 1/30 = 1), log2(e) * 30; unfolded with
    fold=False; a pure output factor moves into dscore and log2_scale."""
    softcap = trace(flexfa.mods.softcap(30.0), "score_mod")
    joint = derive(softcap)
    code = score_joint_code(joint, softcap, [], False, True)
    assert f"score = qk * (sm_scale * {1.0 / 30.0!r})" in code
    assert "30.0" not in code and "dscore = s1" in code and "1.0 - (s0 * s0)" in code
    assert f"log2_scale = {1.4426950408889634 * 30.0!r}" in code
    plain = score_joint_code(joint, softcap, [], False, True, fold=False)
    assert "score = qk * sm_scale" in plain and "30.0" in plain
    assert "log2_scale = 1.4426950408889634" in plain
    half = trace(lambda s, b, h, q, k: s * 0.5, "score_mod")
    code = score_joint_code(derive(half), half, [], False, True)
    assert "score_mod_out = score" in code and "dscore = (1.0) * 0.5" in code
    assert f"log2_scale = {1.4426950408889634 * 0.5!r}" in code


def test_a_joint_graph_with_captured_gradients_is_not_folded():
    """A learnable bias's gradient is d mod / d bias, which an output factor scales too: such
    joint graphs stay as written (forward kernels fold them: they compute no gradient)."""
    bias = torch.randn(4, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return 2.0 * (score + bias[h])
    traced = trace(biased, "score_mod")
    joint = derive(traced)
    assert joint.dloads and fold_joint(joint) is None
    args = mod_buffer_args(traced, None)[0]
    assert "log2_scale = 1.4426950408889634\n" in score_joint_code(joint, traced, args, True,
                                                                   True) + "\n"
    assert fold_scales(traced.root).out_scale == 2.0


@pytest.mark.parametrize("score_mod", [scaled_softcap, half_alibi])
def test_folded_backward_matches_the_reference(score_mod):
    """dq, dk, dv of the folded mods (both Triton backward kernels render the folded joint
    graph) against the float64 reference, with empty rows and a scale."""
    q, k, v = make_qkv(1, 2, 2, 48, 64, 32, dtype=torch.float32, seed=13)
    mask = flexfa.create_block_mask(late_causal, 1, 2, 48, 64, device="cpu", BLOCK_SIZE=32)
    check_backward(q, k, v, score_mod, late_causal, mask, scale=0.4, with_lse=True)
