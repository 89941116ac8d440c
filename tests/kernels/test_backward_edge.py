"""Backward edge cases under the interpreter: rows with nothing to attend, the deterministic
option, mixed captured tensors, and bad input (grad-requiring mask captures, mods without a
derivative, backward after a no_grad call, inputs edited between forward and backward)."""
import re

import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask, validate
from flexfa.errors import InputError, UnsupportedOpError
from flexfa.frontend import grad as grad_module
from flexfa.frontend.ir import Op
from backward_utils import check_backward, flexfa_grads
from forward_utils import make_qkv

B, H, L, S, E = 1, 2, 100, 72, 16


def _late_start(b, h, q_idx, kv_idx):
    # rows 0..39 attend to nothing; the rest are causal
    return (q_idx >= 40) & (kv_idx <= q_idx)


def test_fully_masked_rows_get_zero_gradients_not_nan():
    bias = torch.zeros(H, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * torch.exp(bias[h]) + torch.log(score * score)  # -inf/NaN-prone

    q, k, v = make_qkv(B, H, H, L, S, E, seed=10)
    block_mask = create_block_mask(_late_start, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    dq, dk, dv, dbias = flexfa_grads(q, k, v, score_mod, block_mask, buffers=(bias,),
                                     grad_out=torch.randn(B, H, L, E),
                                     grad_lse=torch.randn(B, H, L))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv), ("bias", dbias)):
        assert not torch.isnan(g).any(), f"{name} has NaN"
    assert torch.count_nonzero(dq[:, :, :40]) == 0
    assert torch.count_nonzero(dq[:, :, 40:]) > 0


def test_fully_masked_rows_match_the_reference():
    q, k, v = make_qkv(B, H, H, L, S, E, seed=11)
    block_mask = create_block_mask(_late_start, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    check_backward(q, k, v, mods.softcap(4.0), _late_start, block_mask, with_lse=True)


def test_everything_masked_gives_zero_gradients():
    nothing = lambda b, h, q_idx, kv_idx: q_idx < 0  # noqa: E731
    q, k, v = make_qkv(B, H, H, 40, 40, E, seed=12)
    block_mask = create_block_mask(nothing, None, None, 40, 40, device="cpu", BLOCK_SIZE=32)
    grads = flexfa_grads(q, k, v, None, block_mask, grad_out=torch.randn(B, H, 40, E))
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def _bias_mod():
    rel = torch.randn(L + S - 1).requires_grad_(True)
    scale = torch.randn(H).requires_grad_(True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * scale[h] + rel[q_idx - kv_idx + S - 1]
    return score_mod, (rel, scale)


def test_deterministic_runs_agree_with_the_reference():
    score_mod, buffers = _bias_mod()
    q, k, v = make_qkv(B, H, H, L, S, E, seed=13)
    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    options = {"deterministic": True, "BLOCK_M": 32, "BLOCK_N": 32}
    check_backward(q, k, v, score_mod, mods.causal, block_mask, buffers=buffers,
                   kernel_options=options)


def test_deterministic_is_bitwise_repeatable():
    score_mod, buffers = _bias_mod()
    q, k, v = make_qkv(B, H, H, L, S, E, seed=14)
    grad_out = torch.randn(B, H, L, E)
    runs = [flexfa_grads(q, k, v, score_mod, None, buffers=buffers, grad_out=grad_out,
                         kernel_options={"deterministic": True}) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("loss_scale", [2.0 ** 29, 2.0 ** 40])
def test_deterministic_gradient_past_its_range_is_nan_not_wrapped(loss_scale):
    """deterministic=True's fixed point holds +-2**31: a captured tensor's gradient entry whose
    contributions' magnitudes reach 2**30 is NaN (at 2**29 the sum wrapped to a finite value
    65% off, at 2**40 each tile's contribution saturated), as an overflow a GradScaler skips;
    an entry well inside the range keeps the default's value."""
    temp = torch.ones(H, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * temp[h]

    q, k, v = make_qkv(B, H, H, 64, 64, E, seed=16)
    grad_out = torch.randn(B, H, 64, E)
    grad_out[:, 0] *= loss_scale  # head 0's gradient past the range, head 1's far inside
    default, det = (flexfa_grads(q, k, v, score_mod, None, buffers=(temp,), grad_out=grad_out,
                                 kernel_options=options)[3]
                    for options in (None, {"deterministic": True}))
    assert abs(default[0]) > 2.0 ** 31 and abs(default[1]) < 2.0 ** 10
    assert torch.isnan(det[0])
    assert torch.allclose(det[1], default[1], rtol=1e-5, atol=1e-6)


def test_deterministic_gradient_keeps_small_contributions():
    """A per-element bias table under upstream gradients of 1e-9 (as out.mean() over a large
    output gives): each entry's contributions are around 1e-13, which the 2**-32 units alone
    rounded to 0 (91% of these entries were 0); with their rests in units of 2**-62 the
    deterministic gradient matches the default's float32 one."""
    table = torch.randn(H, 64, 64).requires_grad_(True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx, kv_idx]

    q, k, v = make_qkv(B, H, H, 64, 64, E, seed=17)
    grad_out = 1e-9 * torch.randn(B, H, 64, E)
    default, det = (flexfa_grads(q, k, v, score_mod, None, buffers=(table,), grad_out=grad_out,
                                 kernel_options=options)[3]
                    for options in (None, {"deterministic": True}))
    assert default.abs().max() < 1e-8 and torch.count_nonzero(det) == torch.count_nonzero(default)
    torch.testing.assert_close(det, default, rtol=1e-4, atol=1e-16)


def test_mixed_captured_tensors_only_grad_ones_get_gradients():
    table = torch.randn(H, L, S)  # no grad
    doc = torch.arange(L + S) // 25  # int
    gain = torch.rand(H, dtype=torch.float16).requires_grad_(True)  # half-precision leaf

    def score_mod(score, b, h, q_idx, kv_idx):
        same_doc = doc[q_idx] == doc[kv_idx]
        return torch.where(same_doc, score * gain[h], score) + table[h, q_idx, kv_idx]

    q, k, v = make_qkv(B, H, H, L, S, E, seed=15)
    (dgain,) = check_backward(q, k, v, score_mod, None, None, buffers=(gain,))[3:]
    assert dgain.dtype == torch.float16 and table.grad is None


# ---- bad input ----------------------------------------------------------------------------

def test_grad_requiring_capture_in_mask_mod_is_an_error():
    cutoff = torch.tensor([30.0, 50.0], requires_grad=True)

    def learned_mask(b, h, q_idx, kv_idx):
        return kv_idx < cutoff[h]

    q, k, v = make_qkv(B, H, H, L, S, E, seed=16)
    block_mask = create_block_mask(learned_mask, None, H, L, S, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(InputError, match="learned_mask.*require grad.*no gradient"):
        flexfa.flex_attention(q.requires_grad_(True), k, v, block_mask=block_mask)
    with torch.no_grad():  # inference is fine
        flexfa.flex_attention(q, k, v, block_mask=block_mask)


def _valid_edits():
    """(name, edit(sinks, document, mask)) of in-place edits, each leaving valid inputs."""
    def copy_tables(sinks, document, mask):
        causal = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None,
                                   L, S, device="cpu", BLOCK_SIZE=16)
        for name in validate.TABLES:
            getattr(mask, name).copy_(getattr(causal, name))
    return [("sinks", lambda sinks, document, mask: sinks.add_(3.0)),
            ("a tensor the mask_mod captures",
             lambda sinks, document, mask: document.copy_(torch.arange(S) // 7)),
            ("a table of block_mask", copy_tables)]


@pytest.mark.parametrize("what,edit", _valid_edits(),
                         ids=[name for name, _ in _valid_edits()])
def test_an_input_edited_between_forward_and_backward_is_an_error(what, edit):
    """The backward reads the sinks, the mask_mod's captured tensors and the tables again: one
    edited in place (to valid values) after the forward would give the gradients of another
    forward; torch's flex_attention saves them for backward and raises, and so does flexfa
    (q, k, v and score_mod captures are saved for backward already)."""
    document = torch.arange(S) // 12

    def same_document(b, h, q_idx, kv_idx):
        return document[q_idx % S] == document[kv_idx]

    q, k, v = make_qkv(B, H, H, L, S, E, seed=16)
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    block_mask = create_block_mask(same_document, None, None, L, S, device="cpu",
                                   BLOCK_SIZE=16)
    out = flexfa.flex_attention(q.requires_grad_(True), k, v, block_mask=block_mask,
                                sinks=sinks)
    with torch.no_grad():
        edit(sinks, document, block_mask)
    with pytest.raises(InputError, match=f"{re.escape(what)} .*edited in place between"):
        out.sum().backward()


def test_mod_without_derivative_names_the_op(monkeypatch):
    monkeypatch.delitem(grad_module._RULES, Op.ERF)

    def erf_mod(score, b, h, q_idx, kv_idx):
        return torch.erf(score * 0.123456)

    q, k, v = make_qkv(B, H, H, 16, 16, E, seed=17)
    with pytest.raises(UnsupportedOpError, match="erf_mod.*ERF"):
        flexfa.flex_attention(q.requires_grad_(True), k, v, erf_mod)
    with torch.no_grad():  # no derivative needed without grad
        flexfa.flex_attention(q, k, v, erf_mod)


def test_backward_after_no_grad_call_behaves_like_torch():
    q, k, v = (t.requires_grad_(True) for t in make_qkv(B, H, H, 16, 16, E, seed=18))
    with torch.no_grad():
        out = flexfa.flex_attention(q, k, v)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert not out.requires_grad and out.grad_fn is None
    with pytest.raises(RuntimeError) as torch_error:
        expected.sum().backward()
    with pytest.raises(RuntimeError) as flexfa_error:
        out.sum().backward()
    assert str(flexfa_error.value) == str(torch_error.value)


def test_backward_on_cpu_without_triton_interpret_set(tmp_path):
    """Generated kernels avoid triton.language's @jit library functions, which are decorated
    in one mode when Triton is imported: the backward runs interpreted in any process."""
    import os
    import subprocess
    import sys

    script = tmp_path / "bwd.py"
    script.write_text(
        "import torch, flexfa\n"
        "q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))\n"
        "bias = torch.randn(2, 40, requires_grad=True)\n"
        "def mod(score, b, h, q_idx, kv_idx):\n"
        "    return score * torch.sigmoid(bias[h, kv_idx])\n"
        "flexfa.flex_attention(q, k, v, mod).sum().backward()\n"
        "assert torch.isfinite(q.grad).all() and bias.grad.abs().sum() > 0\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["FLEXFA_CACHE_DIR"] = str(tmp_path / "cache")
    repo = os.path.dirname(os.path.dirname(flexfa.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_parameter_transformed_while_tracing_gets_fresh_values_and_gradients():
    """``torch.sigmoid(gate)`` on an unindexed 0-d parameter runs eagerly during tracing; the
    trace holds its result, so it is never reused from the trace cache: each call sees the
    current gate and the gradient reaches gate through torch's graph."""
    gate = torch.tensor(0.3, requires_grad=True)

    def gated(score, b, h, q_idx, kv_idx):
        return score * torch.sigmoid(gate)

    q, k, v = make_qkv(B, H, H, 24, 40, E, seed=19)
    for step in range(2):
        check_backward(q, k, v, gated, None, None, buffers=(gate,), seed=step)
        with torch.no_grad():
            gate.add_(1.0)  # an optimizer step


def test_frozen_key_value_and_an_expanded_upstream_gradient():
    """k, v without grad skip the dK/dV kernel; out.sum() hands backward a stride-0 grad."""
    score_mod, (rel, scale) = _bias_mod()
    q, k, v = make_qkv(B, H, H, L, S, E, seed=20)
    q.requires_grad_(True)
    flexfa.flex_attention(q, k, v, score_mod).sum().backward()
    assert k.grad is None and v.grad is None
    expected = flexfa_grads(q, k, v, score_mod, None, buffers=(rel, scale),
                            grad_out=torch.ones(B, H, L, E))
    for got, want in zip((q.grad, rel.grad, scale.grad), (expected[0], *expected[3:])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L, S", [(192, 192), (200, 136)])
def test_block_walks_over_several_tiles_with_a_partial_last_block(L, S):
    # 128-token blocks walked as 64-row / 64-key tiles in one flat loop: the last block of
    # each side is partly (192) or raggedly (200, 136) past the end, so the tiles there must
    # be masked even where the length is a multiple of the tile
    q, k, v = make_qkv(B, H, H, L, S, E, seed=15)
    block_mask = create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=128)
    check_backward(q, k, v, mods.softcap(6.0), mods.causal, block_mask,
                   kernel_options={"BLOCK_M": 64, "BLOCK_N": 64})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_learnable_constant_added_to_every_score(dtype):
    """score + c(t0) for a learnable 0-d t0 (found by a random hypothesis run): the softmax
    ignores c, so t0's gradient is c'(t0) times the rows' lse gradients plus what delta =
    rowsum(dO * out) from the rounded out leaves of the dS terms' cancellation; check_backward
    compares it with the float64 gradient of the kernels' own out (seed 31 failed the plain
    float64 comparison: 5.1e-2 against a bound of 1.5e-2)."""
    t0 = torch.tensor(-1.6059316396713257, requires_grad=True)

    def constant(score, b, h, q_idx, kv_idx):
        return score + torch.sin(torch.tanh(torch.cos(t0)))

    q, k, v = make_qkv(1, 2, 1, 10, 2, 48, Ev=16, dtype=dtype, seed=1)
    check_backward(q, k, v, constant, None, None, buffers=(t0,), enable_gqa=True,
                   with_lse=True, seed=31)


def test_a_captured_tensor_read_only_through_a_step_gets_zero_gradient_as_in_torch():
    """A learnable captured tensor that no score depends on differentiably (read through
    floor) gets torch's zero gradient, not None (an optimizer skips a parameter whose
    gradient is None; weight decay would not reach it)."""
    bias = torch.tensor([0.3, 1.7], requires_grad=True)

    def floored(score, b, h, q_idx, kv_idx):
        return score + bias[h].floor()
    q, k, v = (torch.randn(1, 2, 16, 16, requires_grad=True) for _ in range(3))
    out = flexfa.flex_attention(q, k, v, score_mod=floored)
    (grad,) = torch.autograd.grad(out.sum(), [bias], allow_unused=True)
    assert grad is not None and torch.equal(grad, torch.zeros(2))


def test_a_captured_tensor_in_a_branch_never_taken_gets_zero_gradient_as_in_torch():
    """torch.where(q_idx < q_idx, t, score): the trace removes the branch and the kernels
    never read t, but t requires grad and torch's eager gradient of it is zeros (found by
    the random mods of test_gluon_emulated_random.py)."""
    t = torch.tensor(0.5, requires_grad=True)

    def dead_branch(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx < q_idx, t, score) + score
    q, k, v = (torch.randn(1, 1, 8, 16, requires_grad=True) for _ in range(3))
    out = flexfa.flex_attention(q, k, v, score_mod=dead_branch)
    (grad,) = torch.autograd.grad(out.sum(), [t], allow_unused=True)
    assert grad is not None and torch.equal(grad, torch.zeros(()))


def test_a_tensor_computed_in_a_branch_never_taken_is_traced_again_each_call():
    """``w = bias * bias`` computed while tracing and read only in a removed branch gets its
    zero gradient through this call's autograd graph; a memoized trace kept that graph, and
    the second call's backward raised 'Trying to backward through the graph a second time'.
    Such a trace is not memoized (as one whose read buffers are computed is not)."""
    bias = torch.tensor([0.3, 1.7], requires_grad=True)

    def computed(score, b, h, q_idx, kv_idx):
        w = bias * bias
        return torch.where(q_idx < q_idx, w[h], score) + score
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    for _ in range(3):
        out = flexfa.flex_attention(q, k, v, score_mod=computed)
        (grad,) = torch.autograd.grad(out.sum(), [bias], allow_unused=True)
        assert grad is not None and torch.equal(grad, torch.zeros(2))


def test_one_key_rows_pass_on_the_interpreters_truncating_bf16_cast():
    """L = S = 1 in bf16: P is 1 and dV is dO exactly in float64 and in eager bf16 (error 0),
    but Triton 3.6's interpreter casts float32 to bf16 by truncation (P = 1 - 2^-24 becomes
    1 - 2^-8, and dV = P dO is truncated again): one ulp of dO, past the bf16 floor of 1e-2
    at |dO| > 1.28. The oracle's floor covers two ulps of the largest value for bf16 on the
    CPU (tests/reference.py); a hypothesis hunt found this (B = 2, H = 2, E = 48, seed 264)."""
    gen = torch.Generator().manual_seed(264)
    q, k, v = (torch.randn(2, 2, 1, 48, generator=gen).to(torch.bfloat16) for _ in range(3))
    dv = check_backward(q, k, v)[2]
    assert dv.abs().max() > 1.28  # where one ulp exceeds the fixed floor


def _grads_of(loss_of, tensors):
    for t in tensors:
        t.grad = None
    loss_of().backward()
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_negated_view_handed_in_as_the_gradient_is_read_as_its_values(compiled):
    """A loss through ``.conj()`` hands the backward a lazily negated grad_out (its memory
    holds the negations); the kernels read memory, so every gradient came out negated."""
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, H, 24, 20, E, seed=21))
    bias = torch.randn(20, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    def attend(q, k, v):
        return flexfa.flex_attention(q, k, v, biased, return_lse=True)

    call = torch.compile(attend, backend="aot_eager", fullgraph=True) if compiled else attend
    w = torch.randn(B, H, 24, E, dtype=torch.complex64)
    y = torch.randn(B, H, 24, E)
    seen = []

    def through_conj():
        out, lse = call(q, k, v)
        out.register_hook(lambda g: seen.append(g.is_neg()))
        return (torch.complex(y, out).conj() * w).real.sum() + (lse * lse).sum()

    def plain():  # the same loss's gradient: d/d out of Re(conj(y + i out) w) = Im(w)
        out, lse = attend(q, k, v)
        return (out * w.imag).sum() + (lse * lse).sum()

    got = _grads_of(through_conj, (q, k, v, bias))
    assert seen == [True]  # (what the test is about: autograd handed a negated view)
    for a, b in zip(got, _grads_of(plain, (q, k, v, bias))):
        torch.testing.assert_close(a, b)


def test_a_negated_view_as_lses_gradient_and_a_zero_tensor_gradient():
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, H, 24, 20, E, seed=22))
    out, lse = flexfa.flex_attention(q, k, v, return_lse=True)
    g = torch.randn(B, H, 24)
    got = torch.autograd.grad(lse, (q, k), torch._neg_view(-g), retain_graph=True)
    for a, b in zip(got, torch.autograd.grad(lse, (q, k), g, retain_graph=True)):
        torch.testing.assert_close(a, b)
    # autograd's efficient zero tensor (no memory): zero gradients, as torch's SDPA gives
    zero = torch._efficientzerotensor(B, H, 24, E)
    for a in torch.autograd.grad(out, (q, k, v), zero):
        assert torch.count_nonzero(a) == 0


def test_saved_tensor_hooks_that_unpack_negated_views():
    """An unpack hook may hand back an equal-valued lazily negated view (``_neg_view(-t)``)
    of q, k, v, out, lse, a captured tensor: read as values, not as memory (1.5e4 off)."""
    q, k, v = (t.requires_grad_() for t in make_qkv(B, H, H, 24, 20, E, seed=23))
    bias = torch.randn(20, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    def loss():
        return flexfa.flex_attention(q, k, v, biased, sinks=sinks).square().sum()

    def hooked():
        negated = lambda t: torch._neg_view(-t) if t.is_floating_point() else t  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, negated):
            return loss()

    for a, b in zip(_grads_of(hooked, (q, k, v, bias, sinks)),
                    _grads_of(loss, (q, k, v, bias, sinks))):
        torch.testing.assert_close(a, b)
