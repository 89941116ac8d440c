"""Every bad input to trace gets an early flexfa error of the right type whose message names
the mod and the problem."""
import math
import warnings

import pytest
import torch

from flexfa.errors import FlexFAError, InputTypeError, TraceError, UnsupportedOpError
from flexfa import flex_attention
from flexfa.frontend import and_masks, trace

bias = torch.zeros(16)
table = torch.zeros(4, 16)


def control_flow(score, b, h, q_idx, kv_idx):
    if score > 0:
        return score
    return -score


def python_and(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx and q_idx - kv_idx < 8


def python_max(score, b, h, q_idx, kv_idx):
    return max(score, 0.0)


def bool_of_proxy(b, h, q_idx, kv_idx):
    return bool(q_idx >= kv_idx)


def int_of_proxy(score, b, h, q_idx, kv_idx):
    return score + int(q_idx)


def math_exp(score, b, h, q_idx, kv_idx):
    return math.exp(score)


def range_of_proxy(b, h, q_idx, kv_idx):
    return sum(1 for _ in range(q_idx)) > 0


def three_args(q_idx, kv_idx, h):
    return q_idx >= kv_idx


def six_args(score, b, h, q_idx, kv_idx, extra):
    return score


def star_args(*args):
    return args[0]


def mask_returns_int(b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def mask_returns_float(b, h, q_idx, kv_idx):
    return bias[kv_idx]


def returns_none(score, b, h, q_idx, kv_idx):
    score + 1


def uses_softmax(score, b, h, q_idx, kv_idx):
    return torch.softmax(score, dim=0)


def uses_atan(score, b, h, q_idx, kv_idx):
    return torch.atan(score)


def uses_softmax_method(score, b, h, q_idx, kv_idx):
    return score.softmax(0)


def unknown_attribute(score, b, h, q_idx, kv_idx):
    return score.no_such_thing


def add_inplace_constant(score, b, h, q_idx, kv_idx):
    bias.add_(1)
    return score


def add_inplace_traced(score, b, h, q_idx, kv_idx):
    return score + bias.add_(score)


def setitem_traced_index(score, b, h, q_idx, kv_idx):
    bias[q_idx] = 0
    return score


def setitem_constant_index(score, b, h, q_idx, kv_idx):
    bias[0] = 1.0
    return score


def setitem_chained(score, b, h, q_idx, kv_idx):
    table[h][q_idx] = score
    return score


def inplace_on_proxy(score, b, h, q_idx, kv_idx):
    return score.mul_(2)


def float_index(score, b, h, q_idx, kv_idx):
    return score + bias[q_idx * 0.5]


def bool_index(score, b, h, q_idx, kv_idx):
    # torch reads a bool index as a mask; it was read as 0 / 1, silently
    return score + bias[q_idx > kv_idx]


BYTES = torch.tensor([0, 3, 5, 1], dtype=torch.uint8)


def uint8_index(score, b, h, q_idx, kv_idx):
    # torch reads a uint8 index as a mask too; it was read as an integer, silently
    return score + bias[BYTES[kv_idx % 4]]


def python_float_index(score, b, h, q_idx, kv_idx):
    return score + bias[1.5]


def slice_index(score, b, h, q_idx, kv_idx):
    return score + table[h, :].sum()


def too_many_indices(score, b, h, q_idx, kv_idx):
    return score + bias[q_idx, kv_idx]


def partial_index(score, b, h, q_idx, kv_idx):
    return score + table[h]


def whole_tensor(score, b, h, q_idx, kv_idx):
    return score + bias


def complex_buffer(score, b, h, q_idx, kv_idx):
    return score + COMPLEX[q_idx]


def quantized_buffer(score, b, h, q_idx, kv_idx):  # (a RuntimeError deep inside before)
    return score + QUANTIZED[q_idx]


def bitwise_on_float(score, b, h, q_idx, kv_idx):
    return score & 1


def where_float_condition(score, b, h, q_idx, kv_idx):
    return torch.where(score, score, 0.0)


def max_one_argument(score, b, h, q_idx, kv_idx):
    return torch.max(score)


def max_method(score, b, h, q_idx, kv_idx):
    return score.max()


def max_over_dim(score, b, h, q_idx, kv_idx):
    return torch.max(score, 0)  # torch reads an int as a dimension, not a value


def sum_of_score(score, b, h, q_idx, kv_idx):
    return torch.sum(score)


def amin_of_score(score, b, h, q_idx, kv_idx):
    return score.amin()


def row_difference_sum(score, b, h, q_idx, kv_idx):
    return score + (table[q_idx % 4] - table[kv_idx % 4]).sum(-1)


def row_method(score, b, h, q_idx, kv_idx):
    return score + table[h].mean()


def row_torch_sum(score, b, h, q_idx, kv_idx):
    return score + torch.sum(table[h])


class _Doubler(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad  # differs from the forward's derivative: tracing would silently ignore it


def custom_autograd_function(score, b, h, q_idx, kv_idx):
    return _Doubler.apply(score)


COMPLEX = torch.zeros(4, dtype=torch.complex64)
QUANTIZED = torch.quantize_per_tensor(torch.zeros(4), 0.1, 0, torch.qint8)

CASES = [  # (mod, exception type, regex the message must match)
    (control_flow, TraceError, r"in mod 'control_flow': Python control flow .* torch\.where"),
    (python_and, TraceError, r"'python_and': Python control flow .*and/or/not"),
    (python_max, TraceError, r"'python_max': .*builtin max/min.*torch\.maximum"),
    (bool_of_proxy, TraceError, r"'bool_of_proxy': Python control flow .*bool\(\)"),
    (int_of_proxy, TraceError, r"'int_of_proxy': int\(\) of a traced value needs a concrete"),
    (math_exp, TraceError, r"'math_exp': float\(\) of a traced value .*torch\.exp etc\. "
                           r"instead of math\.exp"),
    (range_of_proxy, TraceError, r"'range_of_proxy': using a traced value as a Python index"),
    (three_args, TraceError, r"mod 'three_args' takes 3 required positional arguments; a "
                             r"score_mod takes 5 .* a mask_mod takes 4"),
    (six_args, TraceError, r"'six_args' takes 6 required positional"),
    (star_args, TraceError, r"'star_args' takes \*args"),
    (mask_returns_int, TraceError, r"'mask_returns_int': a mask_mod must return bool .*got int"),
    (mask_returns_float, TraceError, r"'mask_returns_float': a mask_mod must return bool .*"
                                     r"got float"),
    (returns_none, TraceError, r"'returns_none': the mod returned None"),
    (uses_softmax, UnsupportedOpError, r"'uses_softmax': torch\.softmax is a reduction; a mod "
                                       r"computes one scalar per \(b, h, q_idx, kv_idx\)"),
    (uses_atan, UnsupportedOpError, r"'uses_atan': torch function torch\.atan is not supported "
                                    r"in mods; supported: .*torch\.exp, .*"
                                    r"torch\.nn\.functional\.relu, .*torch\.where"),
    (uses_softmax_method, UnsupportedOpError, r"torch\.Tensor\.softmax is a reduction"),
    (unknown_attribute, TraceError, r"'unknown_attribute': traced values have no attribute "
                                    r"'no_such_thing'"),
    (add_inplace_constant, TraceError, r"'add_inplace_constant': the mod modified the captured "
                                       r"tensor of shape \(16,\) in place"),
    (add_inplace_traced, TraceError, r"'add_inplace_traced': in-place torch\.Tensor\.add_ is "
                                     r"not allowed in a mod: mods must be pure"),
    (setitem_traced_index, TraceError, r"'setitem_traced_index': assignment into the captured "
                                       r"tensor of shape \(16,\) is not allowed"),
    (setitem_constant_index, TraceError, r"'setitem_constant_index': the mod modified the "
                                         r"captured tensor of shape \(16,\) in place"),
    (setitem_chained, TraceError, r"assignment into the captured tensor of shape \(4, 16\)"),
    (inplace_on_proxy, TraceError, r"'inplace_on_proxy': in-place torch\.Tensor\.mul_ is not "
                                   r"allowed"),
    (float_index, TraceError, r"'float_index': a captured tensor of shape \(16,\) was indexed "
                              r"with a float value; indices must be integers"),
    (bool_index, TraceError, r"'bool_index': a captured tensor of shape \(16,\) was indexed "
                             r"with a bool value, which torch reads as a mask"),
    (uint8_index, TraceError, r"'uint8_index': a captured tensor of shape \(16,\) was "
                              r"indexed with a uint8 value, which torch reads as a mask"),
    (python_float_index, TraceError, r"'python_float_index': tracing raised IndexError: "
                                     r".*\(got float\)"),
    (slice_index, UnsupportedOpError, r"'slice_index': indexing a captured tensor with "
                                      r"slice\(None, None, None\) is not supported"),
    (too_many_indices, TraceError, r"shape \(16,\) indexed with 2 indices"),
    (partial_index, TraceError, r"'partial_index': a partially indexed captured tensor was used "
                                r"as a value: the captured tensor of shape \(4, 16\) indexed in "
                                r"1 of its 2 dimensions is a row of values"),
    (whole_tensor, TraceError, r"'whole_tensor': a captured tensor of shape \(16,\) was used as "
                               r"a value; index it"),
    (complex_buffer, TraceError, r"'complex_buffer': captured tensor of dtype torch\.complex64 "
                                 r"is not supported"),
    (quantized_buffer, TraceError, r"'quantized_buffer': captured tensor of dtype torch\.qint8 "
                                   r"is not supported"),
    (bitwise_on_float, UnsupportedOpError, r"'bitwise_on_float': operator and needs bool or int "
                                           r"operands, got float"),
    (where_float_condition, TraceError, r"'where_float_condition': torch\.where needs a bool "
                                        r"condition, got float"),
    (max_one_argument, UnsupportedOpError, r"'max_one_argument': torch\.max with one argument "
                                           r"is a reduction; a mod computes one scalar per "
                                           r"\(b, h, q_idx, kv_idx\).*torch\.maximum\(a, b\)"),
    (max_method, UnsupportedOpError, r"torch\.max with one argument is a reduction"),
    (max_over_dim, UnsupportedOpError, r"torch\.max with a dimension is a reduction"),
    (sum_of_score, UnsupportedOpError, r"'sum_of_score': torch\.sum is a reduction"),
    (amin_of_score, UnsupportedOpError, r"torch\.Tensor\.amin is a reduction.*torch\.minimum"),
    (row_difference_sum, UnsupportedOpError, r"'row_difference_sum': operator sub on a partially "
                                             r"indexed captured tensor: .* shape \(4, 16\) "
                                             r"indexed in 1 of its 2 dimensions is a row"),
    (row_method, UnsupportedOpError, r"\.mean\(\) on a partially indexed captured tensor"),
    (row_torch_sum, UnsupportedOpError, r"torch\.sum applied to a partially indexed captured"),
    (custom_autograd_function, UnsupportedOpError, r"'custom_autograd_function': the custom "
                                                   r"autograd Function _Doubler was called on "
                                                   r"traced values"),
]


@pytest.mark.parametrize("mod,error,message", CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_mod_raises_a_clear_error(mod, error, message):
    try:
        with pytest.raises(error, match=message) as info:
            trace(mod)
    finally:
        bias.zero_(), table.zero_()  # writes with no traced operand happen before the check
    assert isinstance(info.value, FlexFAError)
    assert isinstance(info.value, (TypeError, ValueError))


def test_unsupported_op_error_is_also_not_implemented():
    with pytest.raises(NotImplementedError):
        trace(uses_softmax)


def test_wrong_kind_and_non_callables():
    with pytest.raises(TraceError, match=r"expected a mask_mod but 'control_flow' has the arity "
                                         r"of a score_mod"):
        trace(control_flow, kind="mask_mod")
    with pytest.raises(TraceError, match=r"kind must be 'score_mod', 'mask_mod' or None, got 'x'"):
        trace(control_flow, kind="x")
    with pytest.raises(TraceError, match=r"a mod must be callable, got int 3"):
        trace(3)


def test_combinators_reject_non_masks():
    with pytest.raises(InputTypeError, match=r"and_masks: argument 1 \(control_flow\) is a "
                                             r"score_mod; only mask_mods"):
        and_masks(python_and, control_flow)
    with pytest.raises(InputTypeError, match=r"or_masks|and_masks: argument 0 must be a mask_mod"):
        and_masks("causal")


def test_error_inside_a_mod_is_wrapped_with_its_name():
    def broken(score, b, h, q_idx, kv_idx):
        return score + {}["missing"]

    with pytest.raises(TraceError, match=r"in mod 'broken': tracing raised KeyError") as info:
        trace(broken)
    assert isinstance(info.value.__cause__, KeyError)


RANDOM_MODS = [
    lambda score, b, h, q_idx, kv_idx: score + torch.randn(()),
    lambda score, b, h, q_idx, kv_idx: score * torch.rand(()).item(),
    lambda score, b, h, q_idx, kv_idx: score * torch.rand_like(score),
    lambda score, b, h, q_idx, kv_idx: score + torch.empty(()).uniform_(),
    lambda score, b, h, q_idx, kv_idx: score + torch.distributions.Normal(0.0, 1.0).sample(),
]


@pytest.mark.parametrize("mod", RANDOM_MODS)
def test_random_draws_are_refused(mod):
    """A draw in a mod became a constant of its trace, which the memo gave every later call
    (score * torch.rand(()).item() added the same number for ever); torch's flex_attention
    refuses random operations in a mod (vmap's randomness='error'), and so does flexfa."""
    with pytest.raises(TraceError, match=r"draws random numbers; a mod must give the same "
                                         r"result on every call"):
        trace(mod)
    from torch.nn.attention.flex_attention import flex_attention
    q = torch.randn(1, 1, 8, 16)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="random operation"):
        warnings.simplefilter("ignore")  # torch's one-time "use torch.compile" warning
        flex_attention(q, q, q, score_mod=mod)


def test_flexfa_inside_a_custom_autograd_function_still_traces():
    """The check looks only at frames below the trace: a mod traced while a user's Function
    runs (flex_attention inside its forward) is fine."""
    traced = []

    class Outer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            traced.append(trace(lambda score, b, h, q_idx, kv_idx: score * 2))
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    Outer.apply(torch.ones(1))
    assert traced[0].root.op.name == "MUL"


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_a_captured_table_of_an_unsigned_wide_type_is_refused_when_traced(dtype):
    """Regression (the forty-seventh session's range audit): a captured uint16, uint32 or
    uint64 tensor was taken as an integer table by the tracer and failed in the code
    generator with a bare KeyError (torch.uint16) at the first call; the kernels have no
    such loads. A TraceError naming the dtype and the supported ones, when traced."""
    table = torch.tensor([1, 2]).to(dtype)

    def unsigned_table(score, b, h, q_idx, kv_idx):
        return score + table[h].float()

    with pytest.raises(TraceError, match=rf"'unsigned_table': captured tensor of dtype "
                                         rf"{dtype} is not supported \(use bool, int8, uint8, "
                                         r"int16, int32, int64, float16"):
        trace(unsigned_table)
    q = torch.zeros(1, 2, 16, 16)
    with pytest.raises(TraceError, match=f"dtype {dtype} is not supported"):
        flex_attention(q, q, q, unsigned_table)
