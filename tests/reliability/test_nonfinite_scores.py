"""Scores of +inf, -inf and NaN follow torch's flex_attention: a row with a +inf score has out
NaN and lse +inf, a row with a NaN score out and lse NaN, a row whose scores are all -inf out
0 and lse -inf; gradients are NaN where torch's are. The oracle is torch itself, run eagerly
on the CPU: its flex_attention for out and lse, and for the gradients the dense backward it
would run (torch's CPU flex_attention has no backward). A row with both a +inf and a NaN
score is NaN in out, lse, row max and gradients, as torch's (the running max keeps NaN). The
"cuda" cases run the same checks on compiled kernels (NaN handling of max and FMA contraction
differ from the interpreter's)."""
import math
import re

import pytest
import torch
from hypothesis import given, strategies as st
from torch._higher_order_ops.flex_attention import math_attention, sdpa_dense_backward
from torch.nn.attention.flex_attention import (AuxRequest, _create_empty_block_mask,
                                               flex_attention as torch_flex_attention)

import flexfa
from flexfa.reference import attention_reference
from .inputs import qkv

L, S, SCALE = 24, 40, 0.25
INF = math.inf
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# entries of the [L, S] tensor added to the scores: +inf, -inf or NaN at a few places
ENTRIES = st.lists(st.tuples(st.integers(0, L - 1), st.integers(0, S - 1),
                             st.sampled_from([INF, -INF, math.nan])), max_size=16)


def _extra(data):
    """[L, S] float32 added to the scores: 0 but for a few non-finite entries and up to
    three rows of -inf (fully masked)."""
    extra = torch.zeros(L, S)
    for row, col, value in data.draw(ENTRIES):
        extra[row, col] = value
    extra[data.draw(st.lists(st.integers(0, L - 1), max_size=3))] = -INF
    return extra


def _mods(extra):
    """(flexfa's score_mod, torch's score_mod taking extra as a buffer, its joint graph)."""
    def add_extra(score, b, h, q_idx, kv_idx):
        return score + extra[q_idx, kv_idx]

    def torch_add(score, b, h, q_idx, kv_idx, extra):
        return score + extra[q_idx, kv_idx]

    def torch_joint(score, b, h, q_idx, kv_idx, grad, extra):  # d(score + c) / d score = 1
        return [grad, extra, extra, extra, extra, extra]

    return add_extra, torch_add, torch_joint


def _inputs(device, requires_grad=False, **shape):
    """(q, k, v) on ``device`` for flexfa and their CPU copies for torch."""
    cpu = qkv(B=1, Hq=1, Hkv=1, **shape)
    ours = [t.to(device).requires_grad_(requires_grad) for t in cpu]
    return ours, cpu


def _torch(q, k, v, extra, scale=SCALE):
    """torch's (out, lse, row max) and gradients of out.sum() (dq, dk, dv), in float32."""
    _, torch_add, torch_joint = _mods(extra)
    q, k, v = (t.float() for t in (q, k, v))
    empty = _create_empty_block_mask(q, k).as_tuple()
    out, lse2, max2 = math_attention(q, k, v, torch_add, empty, scale, {}, (extra,))
    grads = sdpa_dense_backward(q, k, v, out, lse2, torch.ones_like(out), None, torch_add,
                                torch_joint, empty, scale, {}, (extra,), ())[:3]
    return out, lse2 * math.log(2), max2 * math.log(2), grads


def _assert_same(name, ours, theirs, atol):
    """Same NaN and infinity pattern, finite values close."""
    ours, theirs = ours.detach().double().cpu(), theirs.detach().double()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs)), f"{name}: NaN pattern differs"
    infinite = torch.isinf(theirs)
    assert torch.equal(torch.isinf(ours), infinite), f"{name}: infinities differ"
    assert torch.equal(ours[infinite], theirs[infinite]), f"{name}: sign of infinity differs"
    finite = torch.isfinite(theirs)
    torch.testing.assert_close(ours[finite], theirs[finite], atol=atol, rtol=atol, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("template, dtype, atol", [("AMPERE", torch.float32, 1e-4),
                                                   ("HOPPER", torch.bfloat16, 2e-2)])
@given(data=st.data())
def test_out_lse_and_row_max_follow_torch(device, template, dtype, atol, data):
    extra = _extra(data)
    (q, k, v), cpu = _inputs(device, L=L, S=S, dtype=dtype)
    out, aux = flexfa.flex_attention(q, k, v, score_mod=_mods(extra.to(device))[0], scale=SCALE,
                                     kernel_options={"BACKEND": template},
                                     return_aux=AuxRequest(lse=True, max_scores=True))
    cpu = [t.float() for t in cpu]  # torch's CPU bf16 GEMM can spread a NaN to other rows
    torch_out, torch_lse = torch_flex_attention(*cpu, score_mod=_mods(extra)[0], scale=SCALE,
                                                return_lse=True)
    _, _, torch_max, _ = _torch(*cpu, extra)
    _assert_same("out", out.float(), torch_out.float(), atol)
    _assert_same("lse", aux.lse, torch_lse, atol)
    _assert_same("max_scores", aux.max_scores, torch_max, atol)
    empty = torch.isneginf(extra).all(-1)  # fully masked rows: out 0, lse -inf
    out, lse = out.cpu(), aux.lse.cpu()
    assert (out[..., empty, :] == 0).all() and torch.isneginf(lse[..., empty]).all()


@pytest.mark.parametrize("device", DEVICES)
@given(data=st.data())
def test_gradients_follow_torch(device, data):
    extra = _extra(data)
    (q, k, v), cpu = _inputs(device, requires_grad=True, L=L, S=S)
    out, lse = flexfa.flex_attention(q, k, v, score_mod=_mods(extra.to(device))[0], scale=SCALE,
                                     return_lse=True)
    out.sum().backward()
    torch_out, torch_lse, _, torch_grads = _torch(*cpu, extra)
    _assert_same("out", out, torch_out, 1e-4)
    _assert_same("lse", lse, torch_lse, 1e-4)
    for name, ours, theirs in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), torch_grads):
        _assert_same(name, ours, theirs, 1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("template, dtype", [("AMPERE", torch.float32),
                                             ("HOPPER", torch.bfloat16)])
def test_a_row_with_inf_and_nan_scores_is_nan_as_torch(device, template, dtype):
    """Rows with a +inf and a NaN score, in one key tile (row 0) and in two (rows 1 and 2, in
    either order; BLOCK_N=16): out, lse, row max and, in float32, every gradient as torch's:
    NaN (the running max keeps NaN; one that dropped it gave lse +inf, and dV finite for the
    keys whose score was finite)."""
    extra = torch.zeros(L, S)
    extra[0, 1], extra[0, 0] = INF, math.nan
    extra[1, 3], extra[1, S - 2] = math.nan, INF
    extra[2, 2], extra[2, S - 1] = INF, math.nan
    (q, k, v), cpu = _inputs(device, requires_grad=dtype == torch.float32, L=L, S=S,
                             dtype=dtype)
    out, aux = flexfa.flex_attention(q, k, v, score_mod=_mods(extra.to(device))[0], scale=SCALE,
                                     kernel_options={"BACKEND": template, "BLOCK_N": 16},
                                     return_aux=AuxRequest(lse=True, max_scores=True))
    torch_out, torch_lse, torch_max, torch_grads = _torch(*cpu, extra)
    for name, ours, theirs in (("lse", aux.lse, torch_lse), ("max", aux.max_scores, torch_max)):
        assert torch.isnan(ours[0, 0, :3].cpu()).all() and torch.isnan(theirs[0, 0, :3]).all()
        _assert_same(name, ours, theirs, 2e-2)
    _assert_same("out", out.float(), torch_out, 2e-2)
    if dtype == torch.float32:
        out.sum().backward()
        for name, ours, theirs in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), torch_grads):
            _assert_same(name, ours, theirs, 1e-3)
        assert torch.isnan(v.grad).all()  # every key is visited by the NaN rows


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_of_a_captured_tensor_read_by_a_nan_row_is_nan(device):
    """The row with a +inf score reads every entry of the bias: torch's bias gradient is NaN
    everywhere, where the kernels' scatter-adds would add 0 for that row."""
    bias = torch.zeros(S, device=device).requires_grad_()

    def biased(score, b, h, q_idx, kv_idx):
        return torch.where((q_idx == 3) & (kv_idx == 7), INF, score + bias[kv_idx])

    (q, k, v), _ = _inputs(device, L=L, S=S)
    out = flexfa.flex_attention(q, k, v, score_mod=biased).cpu()
    out.sum().backward()
    assert torch.isnan(out[0, 0, 3]).all() and torch.isfinite(out[0, 0, :3]).all()
    assert torch.isnan(bias.grad).all()


@pytest.mark.parametrize("options", [None, {"deterministic": True}], ids=["atomic", "fixed"])
@pytest.mark.parametrize("device", DEVICES)
def test_captured_tensor_entries_a_nan_row_did_not_read_keep_their_gradient(device, options):
    """Regression: any row with a +inf or NaN score made every captured tensor's gradient
    wholly NaN. As torch's (autograd of the float64 reference), only the entries such a row
    read are NaN: head 0's row 5 (NaN score) reads row bias 5, key biases 0..5 (causal) and
    head 0's scale; head 1's row 9 (+inf) row bias 9, key biases 0..9 and head 1's scale;
    head 2 is clean. Entries masked from them stay finite too."""
    extra = torch.zeros(3, L, S)
    extra[0, 5, 2], extra[1, 9, 4] = math.nan, INF

    def biased_by(row_bias, key_bias, scale, extra):
        def biased(score, b, h, q_idx, kv_idx):
            return (score * scale[h] + row_bias[q_idx] + key_bias[kv_idx]
                    + extra[h, q_idx, kv_idx])
        return biased

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx
    leaves = [torch.randn(n, device=device).requires_grad_() for n in (L, S, 3)]
    (q, k, v), _ = _inputs(device, L=L, S=S)
    q, k, v = (t.expand(1, 3, -1, -1).contiguous() for t in (q, k, v))
    mask = flexfa.create_block_mask(causal, None, None, L, S, device=device, BLOCK_SIZE=16)
    out = flexfa.flex_attention(q, k, v, biased_by(*leaves, extra.to(device)), mask,
                                scale=SCALE, kernel_options=options)
    got = torch.autograd.grad(out.sum(), leaves)
    exact = [t.detach().cpu().double().requires_grad_() for t in leaves]
    want = torch.autograd.grad(attention_reference(
        *(t.detach().cpu() for t in (q, k, v)), biased_by(*exact, extra), causal,
        scale=SCALE).sum(), exact)
    for name, ours, theirs in zip(("row bias", "key bias", "scale"), got, want):
        _assert_same(name, ours, theirs, 1e-4)
    assert want[0].isnan().nonzero().flatten().tolist() == [5, 9]
    assert want[1].isnan().nonzero().flatten().tolist() == list(range(10))
    assert want[2].isnan().tolist() == [True, True, False]


@pytest.mark.parametrize("backend", ["AMPERE", "DECODE"])
@pytest.mark.parametrize("device", DEVICES)
def test_split_kv_decoding_combines_non_finite_rows(monkeypatch, device, backend):
    """Split-KV decoding (the Ampere family's torch combine, the decode family's combine
    kernel): each split's lse carries the row's +inf / NaN / -inf into the combination."""
    from flexfa.runtime.families import ampere

    combined = []
    real = ampere.combine_splits
    monkeypatch.setattr(ampere, "combine_splits",
                        lambda parts, *rest, **kw: (combined.append(parts.shape[0]),
                                                    real(parts, *rest, **kw)))
    rows, keys = 8, 1024
    extra = torch.zeros(rows, keys)
    extra[0, 900] = INF  # in the second split only
    extra[1, 10] = math.nan  # in the first split only
    extra[2] = -INF  # nothing to attend
    extra[3, :512] = -INF  # the first split has nothing for this row
    extra[4, 10], extra[4, 512:] = math.nan, -INF  # NaN, and the second split has nothing
    extra[5, 10], extra[5, 900] = math.nan, INF  # NaN in the first split, +inf in the second
    extra[6, 3], extra[6, 5] = INF, math.nan  # both in the first split
    extra[7, 700], extra[7, 600] = INF, math.nan  # both in the second split
    (q, k, v), cpu = _inputs(device, L=rows, S=keys)
    out, aux = flexfa.flex_attention(q, k, v, score_mod=_mods(extra.to(device))[0],
                                     kernel_options={"SPLIT_KV": 2, "BACKEND": backend},
                                     return_aux=AuxRequest(lse=True, max_scores=True))
    assert combined == ([2] if backend == "AMPERE" else [])
    torch_out, torch_lse = torch_flex_attention(*cpu, score_mod=_mods(extra)[0],
                                                return_lse=True)
    _assert_same("out", out, torch_out, 1e-4)
    _assert_same("lse", aux.lse, torch_lse, 1e-4)
    maxs = aux.max_scores.cpu()
    assert maxs[0, 0, 0] == INF and math.isnan(maxs[0, 0, 1]) and maxs[0, 0, 2] == -INF
    assert torch.isnan(maxs[0, 0, 4:]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_path_follows_torch(device):
    from flexfa.fp8 import flex_attention_fp8

    extra = torch.zeros(64, 64)
    extra[0, 7], extra[2, 5], extra[1] = INF, math.nan, -INF
    extra[3, 1], extra[3, 40] = INF, math.nan  # both: NaN, as torch's
    (q, k, v), cpu = _inputs(device, L=64, S=64, E=32, dtype=torch.bfloat16)
    out, lse = flex_attention_fp8(q, k, v, score_mod=_mods(extra.to(device))[0],
                                  return_lse=True)
    torch_out, torch_lse = torch_flex_attention(*(t.float() for t in cpu),
                                                score_mod=_mods(extra)[0], return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(torch.isnan(out), torch.isnan(torch_out))
    assert torch.isposinf(lse[0, 0, 0]) and torch.isnan(lse[0, 0, 2:4]).all()
    assert torch.isneginf(lse[0, 0, 1]) and (out[0, 0, 1] == 0).all()
    assert torch.isfinite(lse[0, 0, 4:]).all()


@pytest.mark.parametrize("scale", [1e37, -1e37, 1e9])
def test_an_enormous_scale_is_an_input_error(scale):
    """torch accepts scale=1e37 (its eager path returns a one-hot softmax); flexfa's kernels
    cannot resolve such scores on a GPU (flexfa.scores), so the call is refused up front."""
    q, k, v = qkv(B=1, Hq=1, Hkv=1, L=L, S=S)
    message = re.escape(f"scale={scale:g} with these inputs allows scores q.k * scale up to")
    with pytest.raises(flexfa.InputError, match=message):
        flexfa.flex_attention(q, k, v, scale=scale)
    # flex_decode runs the same softmax: refused as well (it ran such calls until the
    # fortieth session; an audit found it)
    with pytest.raises(flexfa.InputError, match=message):
        flexfa.flex_decode(q[:, :, :1], k, v, scale=scale)


@pytest.mark.parametrize("device", DEVICES)
def test_a_large_scale_with_small_inputs_matches_torch(device):
    """A scale past flexfa.scores.CHECKED_SCALE is fine where the inputs keep the scores in
    range (here below 1e3)."""
    (q, k, v), cpu = _inputs(device, L=L, S=S)
    scale = 1e6
    q, cpu[0] = q * 1e-4, cpu[0] * 1e-4
    out, lse = flexfa.flex_attention(q, k, v, scale=scale, return_lse=True)
    torch_out, torch_lse = torch_flex_attention(*cpu, scale=scale, return_lse=True)
    torch.testing.assert_close(out.cpu(), torch_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), torch_lse, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("factor", [1e8, 1e20, 1e37])
def test_scores_past_the_resolved_range_are_nan_never_an_empty_row(device, factor):
    """Scores past flexfa.scores.MAX_SCORE from a score_mod, which no check sees before
    launch: each row is torch's, or NaN with lse NaN or +inf (a GPU's FMA, flexfa.scores; in
    the interpreter only past float32's max / log2(e)); never out NaN under lse -inf."""
    def blow_up(score, b, h, q_idx, kv_idx):
        return score * factor

    (q, k, v), cpu = _inputs(device, L=L, S=S)
    out, lse = flexfa.flex_attention(q, k, v, score_mod=blow_up, return_lse=True)
    out, lse = out.cpu()[0, 0], lse.cpu()[0, 0]
    torch_out, torch_lse = (t[0, 0] for t in torch_flex_attention(*cpu, score_mod=blow_up,
                                                                  return_lse=True))
    nan_rows = torch.isnan(out).any(-1)
    assert (torch.isnan(lse[nan_rows]) | torch.isposinf(lse[nan_rows])).all()
    if device == "cpu" and factor < 1e30:  # the interpreter resolves these
        assert not nan_rows.any()
    torch.testing.assert_close(out[~nan_rows], torch_out[~nan_rows], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse[~nan_rows], torch_lse[~nan_rows], atol=0, rtol=1e-5)
