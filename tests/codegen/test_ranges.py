"""Value ranges over a call's indices and the int64 decision (flexfa.codegen.ranges)."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexfa.codegen.ranges import (FLOAT_CAST, Domain, int64_nodes, mods_int64_nodes,
                                   static_score_max, value_ranges)
from flexfa.frontend import trace
from flexfa.frontend.ir import DType, Op

DOMAIN = Domain(2, 4, 1000, 1000)


def _int_keys(mod, domain=DOMAIN):
    """The keys of the INT nodes computed in int64 (not the float-cast marks)."""
    return {key for key in mods_int64_nodes([trace(mod)], domain)
            if not key.startswith(FLOAT_CAST)}


def _float_casts(mod, domain=DOMAIN):
    return {key[len(FLOAT_CAST):] for key in mods_int64_nodes([trace(mod)], domain)
            if key.startswith(FLOAT_CAST)}


def test_index_math_cast_to_float_is_marked_where_float32_holds_it_exactly():
    """ALiBi's |q_idx - kv_idx| (and sums, extremes of indices and constants) cast to float
    is computed in float32 where every value stays within 2**24 (rounded domain); a product,
    a floor division, a captured tensor's value or longer lengths keep the int32 math."""
    def alibi(score, b, h, q_idx, kv_idx):
        return score - 0.5 * (q_idx - kv_idx).abs()

    def clamped(score, b, h, q_idx, kv_idx):
        return score + torch.maximum(q_idx - kv_idx, torch.zeros_like(q_idx) - 128) + h

    def product(score, b, h, q_idx, kv_idx):
        return score + q_idx * kv_idx

    def floored(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) // 64

    def negated(score, b, h, q_idx, kv_idx):  # -0.0 in float where q_idx == kv_idx
        return score / -(q_idx - kv_idx)

    table = torch.arange(8, dtype=torch.int32)

    def loaded(score, b, h, q_idx, kv_idx):
        return score + (table[h] - kv_idx)

    cast = _node(alibi, Op.CAST)
    assert _float_casts(alibi) == {cast.key}
    assert _float_casts(alibi, Domain(8, 64, 2 ** 23, 2 ** 23)) == {cast.key}
    assert _float_casts(alibi, Domain(1, 1, 2 ** 24 + 1, 16)) == set()  # q_idx past 2**24
    assert len(_float_casts(clamped)) == 1
    assert _float_casts(product) == _float_casts(floored) == _float_casts(loaded) == set()
    assert _float_casts(negated) == set()


def _node(mod, op):
    return next(n for n in trace(mod).root.toposort() if n.op is op)


def test_common_mods_fit_int32():
    def alibi(score, b, h, q_idx, kv_idx):
        return score - (2.0 ** -(h + 1)) * (q_idx - kv_idx)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= 256) & (q_idx >= kv_idx) & ((q_idx // 64) % 3 != 1)

    for mod in (alibi, sliding):
        assert _int_keys(mod, Domain(8, 64, 131072, 131072)) == set()


def test_products_of_indices_need_int64_only_at_long_lengths():
    def product(b, h, q_idx, kv_idx):
        return (q_idx * kv_idx) % 7 == 0

    mul = _node(product, Op.MUL)
    assert _int_keys(product, Domain(1, 1, 30000, 30000)) == set()  # 32767 ** 2 < 2**31
    assert _int_keys(product, Domain(1, 1, 70000, 70000)) == {mul.key}


def test_hash_constants_pow_and_int64_tensors_need_int64():
    table64 = torch.zeros(8, dtype=torch.int64)
    table32 = torch.zeros(8, dtype=torch.int32)

    def hashed(b, h, q_idx, kv_idx):
        return (q_idx * 3000017 * kv_idx) % 5 == 1

    def power(b, h, q_idx, kv_idx):
        return 2 ** (kv_idx - q_idx) > 3

    def captured64(b, h, q_idx, kv_idx):
        return table64[q_idx % 8] > kv_idx

    def captured32(b, h, q_idx, kv_idx):
        return table32[q_idx % 8] > kv_idx

    def big_constant(b, h, q_idx, kv_idx):
        return q_idx + 5_000_000_000 > kv_idx

    assert len(_int_keys(hashed, Domain(1, 1, 64, 64))) == 1  # 63 * 3000017 fits int32
    assert _node(power, Op.POW).key in _int_keys(power)
    assert _node(captured64, Op.LOAD).key in _int_keys(captured64)
    assert _int_keys(captured32) == set()  # an int32 tensor fits int32 by definition
    assert _int_keys(big_constant) >= {_node(big_constant, Op.ADD).key}


def test_growing_powers_are_bounded():
    def small_powers(b, h, q_idx, kv_idx):
        return 2 ** (kv_idx % 8) > q_idx

    pow_node = _node(small_powers, Op.POW)
    ranges = value_ranges([trace(small_powers).root], (), DOMAIN)
    assert ranges[pow_node] == (1.0, 128.0)
    assert _int_keys(small_powers) == set()


def test_decision_covers_the_rounded_domain():
    assert Domain(3, 5, 100, 1025).rounded() == Domain(4, 8, 128, 2048)
    assert Domain(1, 1, 1, 0).rounded() == Domain(1, 1, 1, 1)
    # 46341 ** 2 > 2**31 - 1 > 46340 ** 2, but both round to 65536: the same (safe) answer
    def square(b, h, q_idx, kv_idx):
        return q_idx * kv_idx > 5

    assert _int_keys(square, Domain(1, 1, 46340, 46340)) == _int_keys(
        square, Domain(1, 1, 46341, 46341)) != set()


@given(st.integers(1, 2 ** 20), st.integers(1, 2 ** 20), st.integers(-2 ** 40, 2 ** 40),
       st.integers(-3000, 3000))
def test_int32_decision_is_sound(q_len, kv_len, offset, factor):
    """Where a node is left in int32, its exact values over the domain's corners fit."""
    def affine(b, h, q_idx, kv_idx):
        return (q_idx * factor - kv_idx + offset) % 1000 == 3

    traced = trace(affine)
    keys = set(int64_nodes([traced.root], (), Domain(1, 1, q_len, kv_len)))
    q = torch.tensor([0, q_len - 1]).view(2, 1)
    kv = torch.tensor([0, kv_len - 1]).view(1, 2)
    from flexfa.frontend.evaluate import evaluate_node
    for node in traced.root.toposort():
        if node.dtype is DType.INT and node.key not in keys:
            values = evaluate_node(node, b=torch.tensor(0), h=torch.tensor(0), q_idx=q,
                                   kv_idx=kv)
            assert -2 ** 31 <= int(values.min()) and int(values.max()) < 2 ** 31, node


def test_static_score_max_bounds_softcaps_and_refuses_wide_or_open_ranges():
    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def softcap_with_slope(score, b, h, q_idx, kv_idx):  # its range grows with the lengths
        return 10.0 * torch.tanh(score) - 0.01 * (q_idx - kv_idx).abs()

    def sigmoid_gate(score, b, h, q_idx, kv_idx):
        return 8.0 * torch.sigmoid(score) + (q_idx % 4)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - 0.5 * (q_idx - kv_idx)

    bound = static_score_max(trace(softcap), DOMAIN)
    assert 30.0 <= bound <= 30.001
    assert 11.0 <= static_score_max(trace(sigmoid_gate), DOMAIN) <= 11.001
    # 20 + 0.01 * 999 nats = 43 log2 units wide: bounded; at 16384 tokens 265: not
    assert static_score_max(trace(softcap_with_slope), DOMAIN) is not None
    assert static_score_max(trace(softcap_with_slope), Domain(1, 1, 16384, 16384)) is None
    assert static_score_max(trace(alibi), DOMAIN) is None  # the score itself: unbounded
    assert static_score_max(None, DOMAIN) is None
    assert static_score_max(trace(softcap), Domain(1, 1, 0, 10)) is None
