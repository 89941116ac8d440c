"""trace: what a mod may use (functions, methods, casts, captured tensors, composition), the
structural key and the cache. Each supported form is checked against calling the mod on real
broadcast tensors."""
import math

import pytest
import torch
import torch.nn.functional as F

from flexfa.frontend import MASK_MOD, SCORE_MOD, evaluate, index_grids, trace
from flexfa.frontend.ir import DType, Op
from flexfa.errors import TraceError
from flexfa.frontend.trace import supported_functions

B, H, L, S = 2, 3, 100, 37
GRIDS = index_grids(B, H, L, S)
SCORE = torch.randn(B, H, L, S, generator=torch.Generator().manual_seed(0)) * 3


def _check(mod, buffers=None):
    """Traced-then-evaluated equals the direct call on broadcast tensors."""
    traced = trace(mod)
    b, h, q, kv = GRIDS
    if traced.kind == SCORE_MOD:
        direct = mod(SCORE, b, h, q, kv)
        got = evaluate(traced, score=SCORE, b=b, h=h, q_idx=q, kv_idx=kv, buffers=buffers)
    else:
        direct = mod(b, h, q, kv)
        got = evaluate(traced, b=b, h=h, q_idx=q, kv_idx=kv, buffers=buffers)
    direct = torch.as_tensor(direct).expand(B, H, L, S)
    got = got.expand(B, H, L, S)
    if traced.kind == SCORE_MOD:
        # torch.allclose, not torch.testing.assert_close: its first call imports for seconds
        assert torch.allclose(got, direct.float(), rtol=1e-5, atol=1e-6, equal_nan=True)
    else:
        assert got.dtype == torch.bool and torch.equal(got, direct)
    return traced


_ELEMENTWISE = [
    torch.exp, torch.exp2, torch.sigmoid, torch.tanh, torch.sin, torch.cos, torch.erf,
    torch.floor, torch.ceil, torch.abs, torch.sign, torch.neg, torch.special.expit,
    torch.special.erf, torch.special.exp2, F.tanh, F.sigmoid, F.relu, F.relu6, F.hardtanh,
    torch.square, torch.relu, lambda x: torch.tan(x * 0.3), lambda x: torch.log(x.abs() + 0.5),
    lambda x: torch.log2(x * x + 1), lambda x: torch.sqrt(x.abs()), lambda x: torch.rsqrt(x * x + 1),
    lambda x: torch.clamp(x, -1, 2), lambda x: torch.clamp(x, min=0.5), lambda x: x.clamp(max=1),
    lambda x: torch.clip(x, -1, 1), lambda x: torch.clamp_min(x, 0.1), lambda x: torch.clamp_max(x, 0),
    lambda x: torch.minimum(x, x * 2), lambda x: torch.maximum(x, -x), lambda x: torch.max(x, x - 1),
    lambda x: torch.min(x, x * x), lambda x: torch.pow(x, 2), lambda x: x ** 3, lambda x: 2.0 ** x,
    lambda x: torch.where(x > 0, x, 0.1 * x), lambda x: torch.add(x, 1),
    lambda x: torch.sub(x, 2), lambda x: torch.mul(x, x), lambda x: torch.div(x, 3),
    lambda x: torch.true_divide(x, -4), lambda x: x // 0.7, lambda x: x % 1.5,
    lambda x: torch.remainder(x, -2.0), lambda x: torch.floor_divide(x, 2.5),
    lambda x: x.exp(), lambda x: x.tanh(), lambda x: x.abs().sqrt(), lambda x: x.sigmoid().log(),
    lambda x: torch.zeros_like(x) + x, lambda x: torch.ones_like(x) * x, lambda x: torch.full_like(x, 2.5),
    lambda x: abs(x), lambda x: -x, lambda x: +x, lambda x: 1 / (1 + x * x), lambda x: 3 - x,
]


@pytest.mark.parametrize("fn", _ELEMENTWISE, ids=range(len(_ELEMENTWISE)))
def test_supported_float_functions_match_torch(fn):
    def mod(score, b, h, q_idx, kv_idx):
        return fn(score)

    _check(mod)


_INDEX_MATH = [
    lambda q, kv: q - kv, lambda q, kv: (q - kv) // 7, lambda q, kv: (kv - q) % 5,
    lambda q, kv: (q - kv) // -3, lambda q, kv: (q - kv) % -4, lambda q, kv: abs(q - kv),
    lambda q, kv: torch.abs(q - kv), lambda q, kv: q * kv, lambda q, kv: q ** 2,
    lambda q, kv: torch.minimum(q, kv), lambda q, kv: torch.maximum(q, kv * 2),
    lambda q, kv: q & kv, lambda q, kv: q | kv, lambda q, kv: q ^ kv, lambda q, kv: ~q,
    lambda q, kv: torch.bitwise_and(q, 6), lambda q, kv: q / (kv + 1), lambda q, kv: q // 2 * 2,
    lambda q, kv: torch.where(q > kv, q, kv), lambda q, kv: torch.clamp(q - kv, 0, 10),
    # shifts as torch's: counts below 0 and from 64 (63 for >>) give 0 (the sign for >>)
    lambda q, kv: q << 3, lambda q, kv: (q - kv) >> 2, lambda q, kv: (q - kv) << (kv - 20),
    lambda q, kv: (q - 50) >> (kv + 30), lambda q, kv: (q + 1) << (kv + 30) >> 40,
    lambda q, kv: 1 << kv, lambda q, kv: -(2 ** 40) >> kv, lambda q, kv: (q + 3) << 63,
    lambda q, kv: (q - kv) >> 63, lambda q, kv: torch.bitwise_left_shift(q, kv % 8),
    lambda q, kv: (q - kv).bitwise_right_shift(3), lambda q, kv: q.to(torch.int8) << 3,
]


@pytest.mark.parametrize("fn", _INDEX_MATH, ids=range(len(_INDEX_MATH)))
def test_index_math_follows_python_semantics(fn):
    def mod(score, b, h, q_idx, kv_idx):
        return score + fn(q_idx, kv_idx)

    _check(mod)


@pytest.mark.parametrize("fn", [lambda s, q: s << 2, lambda s, q: q >> s,
                                lambda s, q: (q > 3) << 1, lambda s, q: q >> (q > 3)])
def test_shifts_of_floats_and_bools_are_refused_as_in_torch(fn):
    with pytest.raises(TraceError, match="operator (<<|>>) needs int operands, got"):
        trace(lambda score, b, h, q_idx, kv_idx: fn(score, q_idx))


@pytest.mark.parametrize("fn", [lambda q: q ** -1, lambda q: torch.pow(q - 3, -2),
                                lambda q: q.pow(-1)])
def test_int_to_a_negative_python_int_is_refused_as_in_torch(fn):
    with pytest.raises(RuntimeError, match="Integers to negative integer powers"):
        fn(torch.tensor(2))
    with pytest.raises(TraceError, match="Integers to negative integer powers are not allowed"):
        trace(lambda score, b, h, q_idx, kv_idx: score + fn(q_idx))


_LOGIC = [
    lambda q, kv: (q >= kv) & (q - kv < 10), lambda q, kv: (q < kv) | (kv == 3),
    lambda q, kv: (q > kv) ^ (q % 2 == 0), lambda q, kv: ~(q <= kv), lambda q, kv: q != kv,
    lambda q, kv: torch.logical_and(q >= kv, kv >= 2), lambda q, kv: torch.logical_or(q < 5, kv < 5),
    lambda q, kv: torch.logical_xor(q < 5, kv < 5), lambda q, kv: torch.logical_not(q < kv),
    lambda q, kv: torch.gt(q, kv), lambda q, kv: torch.ge(q, kv), lambda q, kv: torch.lt(q, kv),
    lambda q, kv: torch.le(q, kv), lambda q, kv: torch.eq(q % 3, kv % 3), lambda q, kv: torch.ne(q, 4),
    lambda q, kv: (q - kv).bool(), lambda q, kv: torch.where(q > 50, q >= kv, q <= kv),
    # torch's bool tensors: + is a logical or, * a logical and (True + True is True, not 2)
    lambda q, kv: (q >= kv) + (kv < 4), lambda q, kv: (q >= kv) * (q - kv < 8),
    lambda q, kv: torch.add(q > kv, q > 3), lambda q, kv: (q > kv) + True,
    # torch's logical functions read ints by truth value (logical_and(2, 1) is True)
    lambda q, kv: torch.logical_and(q % 3, kv % 4), lambda q, kv: torch.logical_or(q % 3, kv - kv),
    lambda q, kv: torch.logical_not(q % 3), lambda q, kv: torch.logical_xor(q % 2, kv % 3),
    lambda q, kv: (q % 3).logical_and(kv % 4),
]


@pytest.mark.parametrize("fn", _LOGIC, ids=range(len(_LOGIC)))
def test_mask_logic(fn):
    def mask(b, h, q_idx, kv_idx):
        return fn(q_idx, kv_idx)

    _check(mask)


_BOOL_ARITHMETIC = [
    lambda s, q, kv: s + ((q > kv) + (q > 3)), lambda s, q, kv: s + (q > kv) * (q > 3) + (kv > 5),
    lambda s, q, kv: s * torch.mul(q > kv, kv > 2), lambda s, q, kv: s + torch.logical_and(q % 3, kv),
    lambda s, q, kv: s + torch.logical_not(q % 3), lambda s, q, kv: s + torch.logical_or(s, q > kv),
    lambda s, q, kv: s + torch.logical_xor(s, q % 2),
]


@pytest.mark.parametrize("fn", _BOOL_ARITHMETIC, ids=range(len(_BOOL_ARITHMETIC)))
def test_bool_arithmetic_and_logical_functions_match_torch(fn):
    """Sums and products of bools, and torch.logical_* on ints and floats, inside a score_mod:
    torch's results (bool or, and; truth values), not Python's (True + True == 2) or bitwise
    ones."""
    def mod(score, b, h, q_idx, kv_idx):
        return fn(score, q_idx, kv_idx)

    _check(mod)


_BOOL_REFUSED = [
    lambda s, q, kv: s + ((q > kv) - (q > 3)), lambda s, q, kv: s + ((q > kv) - 1),
    lambda s, q, kv: s - (q > kv), lambda s, q, kv: s + torch.sub(q, q > kv),
    lambda s, q, kv: s + (q > kv) // (kv > 2), lambda s, q, kv: s + (q > kv) % (kv > 2),
    lambda s, q, kv: s + (q > kv) ** (kv > 2), lambda s, q, kv: s + (-(q > kv)),
]


@pytest.mark.parametrize("fn", _BOOL_REFUSED, ids=range(len(_BOOL_REFUSED)))
def test_bool_arithmetic_torch_refuses_is_refused(fn):
    """Subtracting a bool, and //, %, ** of two bools, raise in torch (they are not Python's
    int arithmetic there); tracing them is a TraceError, not an int result torch never
    gives."""
    def mod(score, b, h, q_idx, kv_idx):
        return fn(score, q_idx, kv_idx)

    b, h, q, kv = GRIDS
    with pytest.raises((RuntimeError, NotImplementedError)):
        mod(SCORE, b, h, q, kv)
    with pytest.raises(TraceError, match="bool"):
        trace(mod)

def test_casts():
    def casts(score, b, h, q_idx, kv_idx):
        as_int = (score * 4).int() + (score * 3).long() + (score * 2).to(torch.int32)
        as_bool = (q_idx % 3).to(torch.bool) | (kv_idx % 5).bool()
        return as_int.float() + as_bool.double() + q_idx.to(dtype=torch.float16) + score.type(
            torch.float32) + (q_idx - kv_idx).half() + score.to("cpu")

    traced = _check(casts)
    assert traced.root.dtype is DType.FLOAT


def test_math_constants_and_python_numbers():
    def mod(score, b, h, q_idx, kv_idx):
        return score * math.log2(math.e) + math.pi - 2 ** -3 + (h + 1) * math.sqrt(2.0)

    _check(mod)


def test_captured_tensors_closures_globals_and_ranks():
    rel = torch.randn(L + S - 1)
    per_head = torch.randn(H, L, S)
    scalar = torch.tensor(1.5)
    one_element = torch.tensor([0.25])
    offsets = torch.tensor([3, 7, 11], dtype=torch.int32)

    def mod(score, b, h, q_idx, kv_idx):
        return (score + rel[q_idx - kv_idx + S - 1] + per_head[h, q_idx, kv_idx] * scalar
                + one_element + GLOBAL_SLOPES[h] * (q_idx - kv_idx + offsets[h % 3]))

    traced = _check(mod)
    assert len(traced.buffers) == 6
    loads = [n for n in traced.root.toposort() if n.op is Op.LOAD]
    assert sorted(len(n.src) for n in loads) == [0, 1, 1, 1, 1, 3]


GLOBAL_SLOPES = torch.tensor([0.5, 0.25, 0.125])


def test_chained_indexing_equals_tuple_indexing():
    table = torch.randn(B, H, 5)

    def chained(score, b, h, q_idx, kv_idx):
        return score + table[b][h][q_idx % 5]

    def tupled(score, b, h, q_idx, kv_idx):
        return score + table[b, h, q_idx % 5]

    assert trace(chained).key == trace(tupled).key
    _check(tupled)


def test_document_mask_and_nested_lookups():
    doc = torch.arange(max(L, S)) // 13
    remap = torch.randperm(16)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (remap[doc[q_idx] % 16] >= 0)

    traced = _check(document)
    assert traced.kind == MASK_MOD and len(traced.buffers) == 2


def test_captured_scalar_tensors_as_indices():
    start = torch.tensor(4)
    table = torch.randn(10)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[start] + table[(q_idx + start) % 10]

    _check(mod)


def test_composition_and_python_helpers():
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 16

    def both(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx, kv_idx) & window(b, h, q_idx, kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * torch.tanh(score / 20.0)

    def capped_and_masked(score, b, h, q_idx, kv_idx):
        capped = softcap(score, b, h, q_idx, kv_idx)
        return torch.where(both(b, h, q_idx, kv_idx), capped, -float("inf"))

    _check(both)
    _check(capped_and_masked)


def test_torch_combinators_and_new_ones_trace():
    from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < 10

    _check(and_masks(causal, prefix))
    _check(or_masks(causal, prefix))
    assert trace(noop_mask).root.arg is True

    def zeros(score, b, h, q_idx, kv_idx):
        return score + q_idx.new_zeros(()) + score.new_full((), 2.0) + b.new_tensor(1)

    _check(zeros)


def test_key_depends_on_shapes_and_dtypes_never_on_values():
    def make(tensor):
        def mod(score, b, h, q_idx, kv_idx):
            return score + tensor[q_idx % tensor.shape[0]]
        return mod

    a, b = torch.randn(8), torch.randn(8)
    assert trace(make(a)).key == trace(make(b)).key
    assert trace(make(a)).key != trace(make(torch.randn(9))).key
    assert trace(make(a)).key != trace(make(a.double())).key
    assert trace(make(a)).buffers[0] is a


def test_cache_returns_the_same_trace_until_the_closure_changes():
    shift = 3
    table = torch.randn(8)

    def mod(score, b, h, q_idx, kv_idx):
        return score + table[(q_idx + shift) % 8]

    first = trace(mod)
    assert trace(mod) is first
    shift = 4  # a closure value changed: a new trace
    second = trace(mod)
    assert second is not first and second.key != first.key
    table = torch.randn(8)  # a new tensor of the same shape: a new trace, the same key
    third = trace(mod)
    assert third is not second and third.key == second.key and third.buffers[0] is table


def test_supported_functions_are_public_names():
    names = supported_functions()
    assert "torch.exp" in names and "torch.nn.functional.relu" in names
    assert "torch.where" in names and "torch.Tensor.float" in names
    assert not any("_VariableFunctions" in n or "TensorBase" in n for n in names)


def test_format_lists_buffers_and_ir():
    bias = torch.zeros(4, 7, requires_grad=True)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h % 4, (q_idx - kv_idx) % 7]

    text = trace(biased).format()
    assert text.splitlines()[:2] == ["score_mod biased", "buf0: float32[4, 7] requires_grad"]
    assert "buf0[%" in text and text.endswith("return %4")
    assert trace(biased).grad_buffers == (0,)


def test_inference_tensors_trace_and_python_reads_trace_again():
    """Captured tensors made under torch.inference_mode have no version counter (reading it
    raised RuntimeError from torch): they trace, and a mod whose Python read one's values is
    traced again on every call, as its edits cannot be told."""
    with torch.inference_mode():
        bias = torch.randn(H)
        flag = torch.tensor(1.0)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    def switched(score, b, h, q_idx, kv_idx):
        return score * 2 if flag > 0 else score

    _check(biased)
    assert trace(switched) is not trace(biased)
    with torch.inference_mode():
        flag.fill_(-1.0)
    b, h, q, kv = GRIDS
    got = evaluate(trace(switched), score=SCORE, b=b, h=h, q_idx=q, kv_idx=kv)
    torch.testing.assert_close(got, SCORE.expand_as(got))


def _in_another_thread(edit) -> None:
    """Run ``edit`` in another thread and wait: what a training thread's optimizer step does
    to a captured parameter while this thread traces (here at a chosen point of the trace)."""
    import threading

    worker = threading.Thread(target=edit)
    worker.start()
    worker.join()


def test_a_captured_tensor_edited_by_another_thread_while_tracing_is_no_error():
    """The in-place check is the mod's own writes: another thread editing a captured tensor
    during the trace (an optimizer step) raised 'the mod modified the captured tensor'. A
    value Python read before that edit leaves the memo stale, so the next call traces again."""
    scale = torch.tensor(2.0)

    def mod(score, b, h, q_idx, kv_idx):
        factor = float(scale)  # read by Python: the trace holds 2.0
        _in_another_thread(lambda: scale.add_(1.0))
        return score * factor

    first = trace(mod)
    assert [n.arg for n in first.root.toposort() if n.op is Op.CONST] == [2.0]
    second = trace(mod)  # scale is 3.0 now (and 4.0 after this trace's own edit)
    assert [n.arg for n in second.root.toposort() if n.op is Op.CONST] == [3.0]


def test_the_mods_own_edit_of_a_captured_view_is_still_refused():
    bias = torch.zeros(4, 16)

    def mod(score, b, h, q_idx, kv_idx):
        bias[0].add_(1.0)  # a view: its version counter is the captured tensor's
        return score

    with pytest.raises(TraceError, match=r"modified the captured tensor of shape \(4, 16\)"):
        trace(mod)
