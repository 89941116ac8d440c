"""The backward kernels on a CUDA GPU (compiled): fwd+bwd of the named suite at realistic
sizes against autograd of the float64 reference, dense/causal against SDPA's backward, GQA
with ragged lengths, bitwise-deterministic gradients, and empty rows."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from backward_utils import check_backward, flexfa_grads, record_backward_specs
from forward_utils import make_qkv

pytestmark = pytest.mark.gpu

B, H, L = 2, 8, 1024


def _learnable(*shape):
    return (0.1 * torch.randn(*shape, device="cuda")).requires_grad_(True)


def _named():
    """(score_mod, mask_mod, captured tensors that require grad)."""
    rel, table, gate = _learnable(2 * L - 1), _learnable(H, L, L), _learnable(H)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + L - 1]

    def learnable_table(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx, kv_idx]

    def gated_softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0) * torch.sigmoid(gate[h])

    return {
        "causal": (None, mods.causal, ()),
        "sliding_window": (None, mods.sliding_window(256), ()),
        "prefix_lm": (None, mods.prefix_lm(200), ()),
        "document": (None, mods.document([300, 500, 224], device="cuda"), ()),
        "alibi_causal": (mods.alibi(H, device="cuda"), mods.causal, ()),
        "softcap": (mods.softcap(20.0), None, ()),
        "relative_bias": (relative_bias, None, (rel,)),
        "learnable_bias_table": (learnable_table, mods.causal, (table,)),
        "gated_softcap": (gated_softcap, mods.causal, (gate,)),
        "dilated": (None, mods.dilated_window(64, 4), ()),
        "natten_2d": (None, mods.natten_2d(32, 32, 7), ()),
    }


NAMES = ["causal", "sliding_window", "prefix_lm", "document", "alibi_causal", "softcap",
         "relative_bias", "learnable_bias_table", "gated_softcap", "dilated", "natten_2d"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("E", [64, 128])
def test_named_variant_backward_on_gpu(name, dtype, E):
    score_mod, mask_mod, buffers = _named()[name]
    q, k, v = make_qkv(B, H, H, L, L, E, dtype=dtype, device="cuda")
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, L, L, device="cuda")
    check_backward(q, k, v, score_mod, mask_mod, block_mask, buffers=buffers)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("E,Ev", [(64, 64), (128, 128), (256, 256), (96, 64), (192, 128), (80, 80)])
def test_matches_sdpa_backward(causal, E, Ev):
    q, k, v = make_qkv(B, H, H, 1000, 1000, E, Ev=Ev, dtype=torch.bfloat16, device="cuda")
    grad_out = torch.randn(B, H, 1000, Ev, device="cuda", dtype=torch.bfloat16)
    block_mask = create_block_mask(mods.causal, None, None, 1000, 1000, device="cuda") \
        if causal else None
    got = flexfa_grads(q, k, v, None, block_mask, grad_out=grad_out)
    q32, k32, v32 = (t.float().requires_grad_(True) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=causal)
    want = torch.autograd.grad(out, [q32, k32, v32], grad_out.float())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.float(), w, atol=3e-2, rtol=3e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("L", [1024, 1000])  # tile multiples and not: other tiles past 128
@pytest.mark.parametrize("E,Ev", [(256, 256), (192, 128)])
def test_wide_heads_softcap_causal_both_length_kinds(L, E, Ev, monkeypatch):
    from flexfa.runtime.families import backward as backward_family
    specs = record_backward_specs(monkeypatch)
    q, k, v = make_qkv(B, H, H, L, L, E, Ev=Ev, dtype=torch.bfloat16, device="cuda")
    block_mask = create_block_mask(mods.causal, None, None, L, L, device="cuda")
    check_backward(q, k, v, mods.softcap(30.0), mods.causal, block_mask, with_lse=True)
    pair = (256, 128 if Ev == 128 else 256)
    # under a block mask ragged lengths take the even ones' tiles at 256/256 only
    tiles = backward_family.HOPPER_BACKWARD_WIDE_RAGGED[pair] if L % 128 and Ev == 128 else \
        backward_family.HOPPER_BACKWARD_WIDE[pair][0]
    assert specs and specs[0].use_tma and specs[0].num_warps == tiles[4], specs[0]


@pytest.mark.parametrize("E,Ev", [(256, 256), (192, 128)])
def test_wide_heads_gqa_alibi_causal_one_loop(E, Ev, monkeypatch):
    # GQA 4, ALiBi + causal at a tile multiple: the dK/dV kernel's one loop on 8 warps (at
    # 192 / 128 since the thirty-first session), every gradient against the float64 reference
    specs = record_backward_specs(monkeypatch)
    q, k, v = make_qkv(1, 8, 2, 1024, 1024, E, Ev=Ev, dtype=torch.bfloat16, device="cuda")
    block_mask = create_block_mask(mods.causal, None, None, 1024, 1024, device="cuda")
    check_backward(q, k, v, mods.alibi(8, device="cuda"), mods.causal, block_mask,
                   enable_gqa=True, with_lse=True, kernel_options={"GLUON_BACKWARD": False})
    assert specs and specs[0].num_warps == 8, specs[0]
    assert specs[0].dkdv_constexprs(False)["ONE_LOOP"]


@pytest.mark.parametrize("L, score", [(1024, None), (1000, "softcap"), (512, None)])
def test_wide_heads_dropout_one_loop(L, score, monkeypatch):
    # dropout 0.2 at 256 under a causal mask on the Triton backward: the dK/dV kernel's one
    # loop (the keep mask in P's sign bit before the mask's branch), every gradient against
    # the float64 reference fed the same keep mask
    specs = record_backward_specs(monkeypatch)
    q, k, v = make_qkv(1, 4, 2, L, L, 256, dtype=torch.bfloat16, device="cuda")
    block_mask = create_block_mask(mods.causal, None, None, L, L, device="cuda")
    score_mod = mods.softcap(30.0) if score else None
    check_backward(q, k, v, score_mod, mods.causal, block_mask, enable_gqa=True,
                   with_lse=True, dropout=(0.2, 77), kernel_options={"GLUON_BACKWARD": False})
    assert specs and specs[0].dropout
    assert specs[0].dkdv_constexprs(score_mod is None)["ONE_LOOP"]


@pytest.mark.parametrize("walk", ["AUTO", False])
@pytest.mark.parametrize("L", [1024, 1000])
@pytest.mark.parametrize("E,Ev,gqa", [(256, 256, 1), (256, 256, 2), (192, 128, 2)])
def test_wide_heads_softcap_without_block_mask(L, E, Ev, gqa, walk):
    # no block mask: at 256 under BWD_FULL_WALK 'AUTO' through the full-block walk, the dK/dV
    # kernel's one loop under a block mask; without it (False, the default) the one loop's
    # tile body over the unmasked walk (bwd_dkdv.tmpl's ONE_LOOP, ROW_OFFSETS); past 128 the dQ
    # kernel bounds-checks every key tile at ragged lengths (bwd_dq.tmpl's RAGGED_APART off)
    from flexfa.runtime import plans
    q, k, v = make_qkv(B, H, H // gqa, L, L, E, Ev=Ev, dtype=torch.bfloat16, device="cuda")
    plans.PLANS.clear()
    check_backward(q, k, v, mods.softcap(30.0), enable_gqa=gqa > 1, with_lse=True,
                   kernel_options={"BWD_FULL_WALK": walk, "GLUON_BACKWARD": False})
    walked = [p.fixed.get("walk") is not None for p in plans.PLANS.values()
              if p.family.name == "triton_bwd"]
    assert walked and all(w == (walk == "AUTO" and E == 256) for w in walked), walked



@pytest.mark.parametrize("E, mask_mod", [(256, None), (256, mods.causal), (128, mods.causal)])
def test_broadcast_grad_out_keeps_the_descriptor_tiles(E, mask_mod):
    # out.sum().backward(): dO is ones with every stride 0, which the tensor descriptors
    # cannot read; the Triton backward copies it (backward.dense_grad_out) and keeps the
    # descriptor tiles (at 256 without a block mask the full-block walk too), every gradient
    # against SDPA's float64 backward
    from flexfa.runtime import plans
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 4, 1000, 1000, E,
                                                     dtype=torch.bfloat16, device="cuda"))
    block_mask = (create_block_mask(mask_mod, None, None, 1000, 1000, device="cuda")
                  if mask_mod else None)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=mask_mod is not None
                                                     ).sum().backward()
    plans.PLANS.clear()
    for _ in range(2):  # the plan's first call, then the cached one
        for t in (q, k, v):
            t.grad = None
        flexfa.flex_attention(q, k, v, block_mask=block_mask,
                              kernel_options={"GLUON_BACKWARD": False}).sum().backward()
        for got, want in zip((q.grad, k.grad, v.grad), ref):
            bound = 2e-2 * max(want.grad.abs().max().item(), 1.0)
            assert (got.double() - want.grad).abs().max().item() <= bound
    (plan,) = [p for p in plans.PLANS.values() if p.family.name == "triton_bwd"]
    assert plan.fixed["dense_grad_out"] and plan.spec.use_tma
    assert (plan.fixed["walk"] is not None) == (mask_mod is None)

def test_gqa_ragged_lengths_and_lse_gradient_on_gpu():
    q, k, v = make_qkv(2, 8, 2, 1000, 1777, 128, dtype=torch.bfloat16, device="cuda")
    block_mask = create_block_mask(mods.sliding_window(300), None, None, 1000, 1777,
                                   device="cuda")
    check_backward(q, k, v, mods.softcap(30.0), mods.sliding_window(300), block_mask,
                   enable_gqa=True, with_lse=True)


def test_deterministic_is_bitwise_repeatable_on_gpu():
    rel, scale = _learnable(2 * L - 1), _learnable(H)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * scale[h] + rel[q_idx - kv_idx + L - 1]

    q, k, v = make_qkv(B, H, 2, L, L, 128, dtype=torch.bfloat16, device="cuda")
    block_mask = create_block_mask(mods.causal, None, None, L, L, device="cuda")
    grad_out = torch.randn(B, H, L, 128, device="cuda", dtype=torch.bfloat16)
    runs = [flexfa_grads(q, k, v, score_mod, block_mask, buffers=(rel, scale),
                         grad_out=grad_out, enable_gqa=True,
                         kernel_options={"deterministic": True}) for _ in range(3)]
    for name, first, *others in zip(("dq", "dk", "dv", "rel", "scale"), *runs):
        for other in others:
            assert torch.equal(first, other), f"{name} differs between deterministic runs"
    fast = flexfa_grads(q, k, v, score_mod, block_mask, buffers=(rel, scale),
                        grad_out=grad_out, enable_gqa=True)
    for name, a, b in zip(("dq", "dk", "dv", "rel", "scale"), runs[0], fast):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2,
                                   msg=lambda m: f"{name}: {m}")


def test_deterministic_gradient_past_its_range_is_nan_on_gpu():
    """The interpreter test's case on the GPU's int64 atomics: head 0's temperature gradient
    (scaled by 2**29, past the fixed point's +-2**31) NaN, head 1's the default's."""
    temp = torch.ones(2, device="cuda", requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * temp[h]

    q, k, v = make_qkv(1, 2, 2, L, L, 64, dtype=torch.float32, device="cuda")
    grad_out = torch.randn(1, 2, L, 64, device="cuda")
    grad_out[:, 0] *= 2.0 ** 29
    default, det = (flexfa_grads(q, k, v, score_mod, None, buffers=(temp,), grad_out=grad_out,
                                 kernel_options=options)[3]
                    for options in (None, {"deterministic": True}))
    assert abs(default[0]) > 2.0 ** 31
    assert torch.isnan(det[0]) and not torch.isnan(det[1])
    torch.testing.assert_close(det[1], default[1], atol=1e-4, rtol=1e-4)


def test_empty_rows_on_gpu():
    late = lambda b, h, q_idx, kv_idx: (q_idx >= 300) & (kv_idx <= q_idx)  # noqa: E731
    q, k, v = make_qkv(1, 4, 4, L, L, 64, dtype=torch.float16, device="cuda")
    block_mask = create_block_mask(late, None, None, L, L, device="cuda")
    grads = flexfa_grads(q, k, v, mods.softcap(10.0), block_mask,
                         grad_out=torch.randn(1, 4, L, 64, device="cuda", dtype=torch.float16))
    assert all(not torch.isnan(g).any() for g in grads)
    assert torch.count_nonzero(grads[0][:, :, :300]) == 0
    check_backward(q, k, v, mods.softcap(10.0), late, block_mask)


def test_training_step_reduces_loss():
    """A learnable relative bias trained through flexfa for a few steps."""
    torch.manual_seed(0)
    rel = torch.zeros(2 * 512 - 1, device="cuda", requires_grad=True)
    q, k, v = make_qkv(1, 4, 4, 512, 512, 64, dtype=torch.bfloat16, device="cuda")
    target = torch.randn(1, 4, 512, 64, device="cuda", dtype=torch.bfloat16)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx + 511]

    optimizer = torch.optim.Adam([rel], lr=0.05)
    losses = []
    for _ in range(20):
        out = flexfa.flex_attention(q, k, v, score_mod)
        loss = (out.float() - target.float()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_direct_launches_of_a_cached_backward_match_the_first_call():
    """The first backward of a signature goes through Triton's JIT launch; later ones through
    the plan's compiled launchers (no argument binding). dq, dk, dv have one writer each, so
    the two must be bitwise equal; a ragged length and a causal mask cover the bounds-checked
    kernels with TMA loads."""
    from flexfa.runtime import plans

    q, k, v = make_qkv(2, 4, 4, 1000, 1000, 128, dtype=torch.bfloat16, seed=31, device="cuda")
    block_mask = create_block_mask(mods.causal, None, None, 1000, 1000, device="cuda")
    grad_out = torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    plans.PLANS.clear()
    first = flexfa_grads(q, k, v, None, block_mask, grad_out=grad_out)
    backward = [p for p in plans.PLANS.values() if p.family.name == "triton_bwd"]
    assert len(backward) == 1, backward
    assert all(step.direct is not None for step in backward[0].steps), "no direct launch state"
    second = flexfa_grads(q, k, v, None, block_mask, grad_out=grad_out)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between the JIT and the direct launch"



def test_negated_and_zero_tensor_incoming_gradients_on_gpu():
    """A lazily negated grad_out (a loss through .conj()) and autograd's efficient zero tensor
    are read as their values on the GPU kernels too (runtime.layout.memory_values)."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 4, 300, 260, 64, dtype=torch.bfloat16,
                                                       seed=31, device="cuda"))
    out, lse = flexfa.flex_attention(q, k, v, block_mask=create_block_mask(
        mods.causal, None, None, 300, 260, device="cuda"), return_lse=True)
    g, gl = torch.randn_like(out), torch.randn_like(lse)
    want = torch.autograd.grad((out, lse), (q, k, v), (g, gl), retain_graph=True)
    got = torch.autograd.grad((out, lse), (q, k, v),
                              (torch._neg_view(-g), torch._neg_view(-gl)), retain_graph=True)
    for a, b in zip(got, want):  # (not bitwise: atomics may order the sums otherwise)
        torch.testing.assert_close(a, b)
    for a in torch.autograd.grad(out, (q, k, v), torch._efficientzerotensor(
            out.shape, dtype=out.dtype, device="cuda")):
        assert torch.count_nonzero(a) == 0
