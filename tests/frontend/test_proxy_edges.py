"""Edges of the tracer's proxy (frontend/proxy.py, trace.py) from a mutation audit (the
forty-ninth session's): each test fails under the mutant it names (a rule changed with every
other frontend test passing), or under one of the three deviations from torch it found
(fixed): a Python number over a traced value divided where torch multiplies by the
reciprocal, a bool value to a Python bool power refused, unrecognised cast targets ignored.
Each compares flexfa's trace, evaluated eagerly, with plain torch running the same Python
function on broadcast index grids (or checks a refusal)."""
import numpy as np
import pytest
import torch

from flexfa.errors import TraceError, UnsupportedOpError
from flexfa.frontend import evaluate, index_grids, trace

B, H, L, S = 1, 2, 16, 12
GRIDS = index_grids(B, H, L, S)
SCORE = torch.linspace(-3, 3, L * S).view(1, 1, L, S).expand(B, H, L, S)
T1 = torch.randn(32, generator=torch.Generator().manual_seed(0))
T8 = torch.tensor([100, -100, 127, 5], dtype=torch.int8)
B16 = (torch.randn(2, L, S, generator=torch.Generator().manual_seed(1)) * 3).half()


def _torch(fn):
    b, h, q, kv = GRIDS
    return torch.as_tensor(fn(SCORE, b, h, q, kv)).float().expand(B, H, L, S)


def _flexfa(fn):
    b, h, q, kv = GRIDS
    return evaluate(trace(fn, "score_mod"), score=SCORE, b=b, h=h, q_idx=q,
                    kv_idx=kv).expand(B, H, L, S).float()


def _assert_equal_torch(fn):
    want, got = _torch(fn), _flexfa(fn)
    assert torch.equal(got, want), (got != want).sum().item()


# M24 (__rmod__ not swapped)
@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: s + 7 % (q + 1),
    lambda s, b, h, q, kv: s + (-7) % (q + 1),
    lambda s, b, h, q, kv: 2.5 % (s + 4),
], ids=["7%(q+1)", "-7%(q+1)", "2.5%(s+4)"])
def test_python_number_mod_traced_value_keeps_operand_order(fn):
    _assert_equal_torch(fn)


# M12 (q ** 0 refused as a negative power)
def test_int_to_the_power_zero_is_not_refused():
    _assert_equal_torch(lambda s, b, h, q, kv: s + q ** 0 + (kv - 3) ** 0)


# M03 (numpy integer scalars lifted as float constants)
def test_numpy_integer_scalars_stay_integers():
    _assert_equal_torch(lambda s, b, h, q, kv: s + (q ^ np.int64(5)) + T1[kv + np.int32(1)])


# M13 (float ^ reaches ir.binary's assert instead of the clear refusal)
def test_xor_of_a_float_is_refused_clearly():
    with pytest.raises(UnsupportedOpError, match="operator xor needs bool or int operands"):
        trace(lambda s, b, h, q, kv: s + ((q * 0.5) ^ kv), "score_mod")


# M22 (~ of a float traced instead of refused)
def test_invert_of_a_float_is_refused_at_trace_time():
    with pytest.raises(UnsupportedOpError, match="~ needs a bool or int operand"):
        trace(lambda s, b, h, q, kv: ~s, "score_mod")


# M17 (Python bools beside a narrow value narrowed into ints: `t8 - True` then allowed)
@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: s + (T8[kv % 4] - True),
    lambda s, b, h, q, kv: s.half() - True,
], ids=["int8-True", "half-True"])
def test_subtracting_a_python_bool_from_a_narrow_value_is_refused_as_in_torch(fn):
    with pytest.raises(RuntimeError):
        _torch(fn)  # torch refuses it too
    with pytest.raises(UnsupportedOpError, match="subtraction with a bool value"):
        trace(fn, "score_mod")


# M38 (a Python bool index read as 0 / 1)
def test_python_bool_index_into_a_captured_tensor_is_refused():
    t2 = torch.randn(L, 4)
    with pytest.raises(TraceError, match="indexed with bool True; indices must be integers"):
        trace(lambda s, b, h, q, kv: s + t2[q, True], "score_mod")


# M39 (float16 buffer elements kept in float16: docs/mods.md says they are read as float32)
def test_half_buffer_elements_compute_in_float32_as_documented():
    fn = lambda s, b, h, q, kv: s + B16[h, q, kv] * 0.1 + B16[h, q, kv] * B16[h, kv % L, q % S]
    b, h, q, kv = GRIDS
    want = (SCORE + B16.float()[h, q, kv] * 0.1
            + B16.float()[h, q, kv] * B16.float()[h, kv % L, q % S]).expand(B, H, L, S)
    assert torch.equal(_flexfa(fn), want)


# M42 (an int operand not converted to float16 before a float16 op)
@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: s.half() + q * 4097,
    lambda s, b, h, q, kv: q * 4097 - s.half(),
    lambda s, b, h, q, kv: (s * 7).half() * (kv * 2049 + 1),
], ids=["half+int", "int-half", "half*int"])
def test_int_tensor_operand_is_converted_to_half_first(fn):
    _assert_equal_torch(fn)


# M44 (!= not computed in float16 when the other operand is an int tensor)
def test_half_not_equal_int_tensor_compares_in_half():
    b, h, q, kv = GRIDS
    fn = lambda b, h, q, kv: (kv + 2049).half() != kv + 2049
    got = evaluate(trace(fn, "mask_mod"), b=b, h=h, q_idx=q, kv_idx=kv)
    assert torch.equal(got.expand(B, H, L, S), fn(b, h, q, kv).expand(B, H, L, S))


# M47 (.type("torch.cuda.HalfTensor") silently returned the value unrounded)
def test_type_with_a_cuda_type_name_casts():
    fn = lambda s, b, h, q, kv: (s * 1000.1).type("torch.cuda.HalfTensor")
    assert torch.equal(_flexfa(fn), _torch(lambda s, b, h, q, kv: (s * 1000.1).half()))


# M49 (unary minus on a bool refused only by ir.unary's TypeError, wrapped)
def test_unary_minus_on_a_bool_names_the_operator():
    with pytest.raises(TraceError, match="unary minus on a bool value; use ~"):
        trace(lambda s, b, h, q, kv: s + (-(q > kv)), "score_mod")


# M51 (a score_mod returning an int not cast to float)
def test_an_int_valued_score_mod_is_cast_to_float():
    fn = lambda s, b, h, q, kv: q - kv
    assert trace(fn, "score_mod").root.dtype.value == "float"
    assert _flexfa(fn).dtype is torch.float32
    b, h, q, kv = GRIDS
    out = evaluate(trace(fn, "score_mod"), score=SCORE, b=b, h=h, q_idx=q, kv_idx=kv)
    assert out.dtype is torch.float32


# M53 (parameters with defaults counted in the arity)
def test_a_mask_mod_with_a_defaulted_parameter_is_a_mask_mod():
    from flexfa.frontend.trace import mod_kind

    def windowed(b, h, q_idx, kv_idx, window=4):
        return (q_idx - kv_idx).abs() < window

    assert mod_kind(windowed) == "mask_mod"
    b, h, q, kv = GRIDS
    got = evaluate(trace(windowed), b=b, h=h, q_idx=q, kv_idx=kv)
    assert torch.equal(got.expand(B, H, L, S), windowed(b, h, q, kv).expand(B, H, L, S))


# M54 (slots not renumbered after simplification dropped a read)
def test_a_buffer_read_only_in_a_removed_branch_is_dropped():
    ta, tb = torch.randn(L), torch.randn(S)
    fn = lambda s, b, h, q, kv: torch.where(q < q, ta[q], s) + tb[kv]
    traced = trace(fn, "score_mod")
    assert len(traced.buffers) == 1 and traced.buffers[0] is tb
    assert len(traced.dropped) == 1 and traced.dropped[0] is ta
    _assert_equal_torch(fn)


# M56 (a score_mod returning a Python number refused)
def test_a_score_mod_returning_a_python_number_is_constant():
    assert torch.equal(_flexfa(lambda s, b, h, q, kv: 1.5), torch.full((B, H, L, S), 1.5))


# ---- real bugs (fail on pristine) ------------------------------------------------------

# repro_1: torch computes `number / x` (Tensor.__rtruediv__) as x.reciprocal() * number
@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: 3.0 / s,
    lambda s, b, h, q, kv: s + 7 / (q + 1),
    lambda s, b, h, q, kv: 3 / (q * 1000 + 1).half(),
], ids=["3.0/s", "7/(q+1)", "3/half"])
def test_number_divided_by_traced_value_matches_torch(fn):
    _assert_equal_torch(fn)


# repro_2: a bool value to a Python bool power is valid torch (x ** True == x)
def test_bool_to_a_python_bool_power_is_accepted():
    b, h, q, kv = GRIDS
    fn = lambda b, h, q, kv: ((q >= kv) ** True) & ((kv > 3) ** False)
    got = evaluate(trace(fn, "mask_mod"), b=b, h=h, q_idx=q, kv_idx=kv)
    assert torch.equal(got.expand(B, H, L, S), fn(b, h, q, kv).expand(B, H, L, S))


# repro_3: an unrecognised dtype string / object in .type() / .to() is a silent no-op
@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: (s * 3.7).type("torch.int32"),
    lambda s, b, h, q, kv: (s * 1000.1).to("float16"),
    lambda s, b, h, q, kv: (s * 1000.1).to(np.float16),
], ids=["type(torch.int32)", "to(float16 str)", "to(np.float16)"])
def test_unrecognised_cast_targets_are_refused_as_in_torch(fn):
    with pytest.raises(Exception):
        _torch(fn)
    with pytest.raises(TraceError):
        trace(fn, "score_mod")
