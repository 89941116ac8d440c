"""flexfa.codegen.ranges and flexfa.codegen.fold: the interval rules' decisions held at their
edges (from the forty-seventh session's mutation audit of both modules: each test failed under
a mutant that the rest of the suite let pass, each of which changed results). Index math one
past int32 either way is computed in int64; a captured int32 table's negative values count; a
float cast is lifted to float32 only where float32 holds every value (not below -2**24, not
captured values); the static score bound of the Gluon forward is an upper bound or None (a
float table is unbounded whatever its dtype, so is a scaled score, a mod that drops every key
has none, a softcap's span is counted in log2 units); a constant divided by the mod is not an
output factor. CPU only: the Triton kernels under the interpreter, the Gluon forward through
flexfa's emulator."""
import pytest
import torch

import flexfa
from flexfa.codegen.fold import fold_scales
from flexfa.codegen.ranges import FLOAT_CAST, Domain, mods_int64_nodes, static_score_max
from flexfa.frontend import trace
from flexfa.reference import attention_reference

GLUON = {"BACKEND": "GLUON", "GLUON_EMULATE": True}


def _qkv(H, L, S, E, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, n, E, generator=g).to(dtype) for n in (L, S, S)]


def _int_keys(mod, domain):
    return {k for k in mods_int64_nodes([trace(mod, "score_mod")], domain)
            if not k.startswith(FLOAT_CAST)}


def _float_casts(mod, domain):
    return {k for k in mods_int64_nodes([trace(mod, "score_mod")], domain)
            if k.startswith(FLOAT_CAST)}


def _assert_matches_reference(mod, H=1, L=16, S=16, E=16):
    q, k, v = _qkv(H, L, S, E, torch.float32)
    out = flexfa.flex_attention(q, k, v, mod)
    ref = attention_reference(q, k, v, mod)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


# ---- int32 limits: exactly 2**31 and -2**31 - 1 leave int32 ----------------------------------

def _at_int32_max(score, b, h, q_idx, kv_idx):
    return score + 2.0 * ((q_idx + kv_idx + 2147483618) % 7).float()  # 2**31 at q = kv = 15


def _below_int32_min(score, b, h, q_idx, kv_idx):
    return score + 2.0 * ((kv_idx - q_idx - 2147483634) % 7).float()  # -2**31 - 1 at q=15, kv=0


def _fits(score, b, h, q_idx, kv_idx):  # 2**31 - 1 and -2**31 exactly: int32 holds both
    return score + ((q_idx + kv_idx + 2147483617) % 7).float() \
        + ((kv_idx - q_idx - 2147483633) % 5).float()


@pytest.mark.parametrize("mod", [_at_int32_max, _below_int32_min])
def test_index_math_one_past_int32_is_computed_in_int64(mod):
    assert _int_keys(mod, Domain(1, 1, 16, 16))
    _assert_matches_reference(mod)


def test_index_math_at_the_int32_limits_stays_int32():
    assert _int_keys(_fits, Domain(1, 1, 16, 16)) == set()


# ---- captured small-int tensors count at their dtype's full range ----------------------------

def test_negative_values_of_an_int32_table_are_not_assumed_away():
    table = torch.tensor([-2 ** 31 + 5, 3], dtype=torch.int32)

    def mod(score, b, h, q_idx, kv_idx):
        return score + 2.0 * ((table[h] - kv_idx) % 7).float()

    assert _int_keys(mod, Domain(1, 2, 16, 16))
    _assert_matches_reference(mod, H=2)


# ---- float casts: both ends of +-2**24, no captured values -----------------------------------

def test_a_cast_below_minus_2_24_is_not_lifted_to_float32():
    def mod(score, b, h, q_idx, kv_idx):  # values down to -2**25 - 15: float32 rounds them
        return score + ((q_idx + (-33554432)) - kv_idx).float() % 8.0

    assert _float_casts(mod, Domain(1, 1, 16, 16)) == set()
    q, k, v = _qkv(1, 16, 16, 16, torch.float32)
    out = flexfa.flex_attention(q, k, v, mod)
    eager = attention_reference(q, k, v, mod, dtype=torch.float32)  # int64 math, one rounding
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


def test_a_cast_of_captured_values_is_not_lifted():
    t8 = torch.tensor([-3, 100], dtype=torch.int8)

    def mod(score, b, h, q_idx, kv_idx):
        return score + 0.05 * (t8[h] - kv_idx).float()

    assert _float_casts(mod, Domain(1, 2, 16, 16)) == set()
    _assert_matches_reference(mod, H=2)


# ---- static_score_max is an upper bound, or None ---------------------------------------------

DOMAIN = Domain(1, 2, 128, 128)
BIAS = torch.tensor([200.0, 0.0])


def _biased_softcap(score, b, h, q_idx, kv_idx):
    return 10.0 * torch.tanh(score / 10.0) + BIAS[h]


def _scaled_bias_softcap(score, b, h, q_idx, kv_idx):
    return 10.0 * torch.tanh(score / 10.0) + 1e-4 * BIAS[h]


def _scaled_score(score, b, h, q_idx, kv_idx):
    return score * 1e-3


def _all_dropped(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= 0, float("-inf"), score)


@pytest.mark.parametrize("mod", [_biased_softcap, _scaled_bias_softcap, _scaled_score,
                                 _all_dropped, flexfa.mods.softcap(45.0),
                                 flexfa.mods.softcap(34.0)])
def test_static_score_max_refuses_unbounded_or_too_wide_mods(mod):
    """A float captured tensor is unbounded whatever its dtype, so is the score however small
    its factor; a range that is -inf only has no bound; softcap(34) spans 68 nats = 98 log2
    units > STATIC_SPAN (96, log2 units)."""
    assert static_score_max(trace(mod, "score_mod"), DOMAIN) is None


def test_static_score_max_of_bool_tables_and_narrow_softcaps():
    """Bool captured tensors count as 0/1; softcap(33) spans 95.2 log2 units: bounded."""
    flags = torch.tensor([True, False])

    def gated(score, b, h, q_idx, kv_idx):
        return torch.tanh(score) + 50.0 * flags[h]

    assert 51.0 <= static_score_max(trace(gated, "score_mod"), DOMAIN) <= 51.001
    assert 33.0 <= static_score_max(trace(flexfa.mods.softcap(33.0), "score_mod"), DOMAIN) <= 33.001


@pytest.mark.parametrize("mod", [_biased_softcap, _all_dropped])
def test_gluon_static_max_matches_reference_beyond_the_dtype_guess(mod):
    """The Gluon forward (GLUON_STATIC_MAX on by default, bf16) on a softcap plus a float32 bias
    of 200 and on a mod that drops every key: finite and equal to the reference."""
    q, k, v = _qkv(2, 128, 128, 64, torch.bfloat16)
    out = flexfa.flex_attention(q, k, v, mod, kernel_options=GLUON).double()
    ref = attention_reference(q, k, v, mod)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, rtol=0.0, atol=0.05)


def test_gluon_static_max_keeps_small_probabilities_of_a_wide_softcap():
    """softcap(45): rows whose scores all sit near -45 with V ~ 2**-24. Under a static bound of
    45 P would be exp2(-130) and P * V would underflow to 0; the running max keeps them."""
    g = torch.Generator().manual_seed(0)
    q = torch.full((1, 1, 128, 64), -5.0).to(torch.bfloat16)
    k = torch.full((1, 1, 128, 64), 5.0).to(torch.bfloat16)  # q.k / 8 = -200: score ~ -45
    v = (2.0 ** -24 * torch.randn(1, 1, 128, 64, generator=g)).to(torch.bfloat16)
    mod = flexfa.mods.softcap(45.0)
    out = flexfa.flex_attention(q, k, v, mod, kernel_options=GLUON).double()
    ref = attention_reference(q, k, v, mod)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 0.05


# ---- fold: a constant numerator is not an output factor -------------------------------------

def test_a_constant_divided_by_the_mod_does_not_fold():
    def mod(score, b, h, q_idx, kv_idx):
        return torch.div(3.0, 2.0 + torch.tanh(score))

    root = trace(mod, "score_mod").root
    fold = fold_scales(root)
    assert fold.root is root and (fold.in_scale, fold.out_scale) == (1.0, 1.0)
    _assert_matches_reference(mod, L=32, S=32)

    def operator(score, b, h, q_idx, kv_idx):  # torch: (2 + tanh(s)).reciprocal() * 3.0
        return 3.0 / (2.0 + torch.tanh(score))

    fold = fold_scales(trace(operator, "score_mod").root)
    assert (fold.in_scale, fold.out_scale) == (1.0, 3.0)
    _assert_matches_reference(operator, L=32, S=32)
