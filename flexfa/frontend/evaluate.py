"""Evaluating the IR with torch on broadcast index grids.

This is the eager reference (``score`` of shape [B,H,L,S] in float64 gives the float64
reference) and the dense-mask path. Index values are int64 tensors that broadcast against
each other (e.g. ``b`` [B,1,1,1], ``q_idx`` [1,1,L,1]). The evaluation is differentiable in
``score`` and in float buffers, so torch.autograd on it is the reference for gradients.
"""
from __future__ import annotations

import torch

from .ir import TIES_NONE, TIES_SPLIT, DType, Node, Op

# ``TracedMod`` in the annotations below is frontend.trace's, not imported even for type
# checkers: trace imports simplify, which folds constants with apply_op below

_TORCH_DTYPE = {DType.BOOL: torch.bool, DType.INT: torch.int64}


_BINARY = {
    Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.div,
    Op.FLOORDIV: torch.floor_divide,  # Python's //, also for floats (1.0 // 0.1 == 9.0)
    Op.MOD: torch.remainder, Op.FMOD: torch.fmod, Op.POW: torch.pow,
    Op.MAX: torch.maximum, Op.MIN: torch.minimum,
    Op.LT: torch.lt, Op.LE: torch.le, Op.EQ: torch.eq, Op.NE: torch.ne,
}
_LOGIC = {
    Op.AND: (torch.logical_and, torch.bitwise_and),
    Op.OR: (torch.logical_or, torch.bitwise_or),
    Op.XOR: (torch.logical_xor, torch.bitwise_xor),
    Op.NOT: (torch.logical_not, torch.bitwise_not),
}
_UNARY = {
    Op.NEG: torch.neg, Op.ABS: torch.abs, Op.SIGN: torch.sign, Op.FLOOR: torch.floor,
    Op.CEIL: torch.ceil, Op.EXP: torch.exp, Op.EXP2: torch.exp2, Op.EXPM1: torch.expm1,
    Op.LOG: torch.log, Op.LOG2: torch.log2, Op.LOG1P: torch.log1p, Op.SQRT: torch.sqrt,
    Op.RSQRT: torch.rsqrt, Op.TANH: torch.tanh, Op.SIGMOID: torch.sigmoid, Op.SIN: torch.sin,
    Op.COS: torch.cos, Op.TAN: torch.tan, Op.ERF: torch.erf, Op.DETACH: torch.Tensor.detach,
}
_NARROW_TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
                 "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32}
_INT32_MIN = -2 ** 31


def evaluate_node(root: Node, *, score=None, b=None, h=None, q_idx=None, kv_idx=None,
                  buffers=(), float_dtype=torch.float32, device=None) -> torch.Tensor:
    """Evaluate ``root`` on broadcastable torch tensors; FLOAT math runs in ``float_dtype``."""
    leaves = {Op.SCORE: score, Op.B: b, Op.H: h, Op.Q_IDX: q_idx, Op.KV_IDX: kv_idx}
    if device is None:
        device = next((v.device for v in leaves.values() if isinstance(v, torch.Tensor)), "cpu")
    values: dict[int, torch.Tensor] = {}
    for node in root.toposort():
        values[id(node)] = _eval_one(node, [values[id(s)] for s in node.src], leaves, buffers,
                                     float_dtype, device)
    return values[id(root)]


def _target_dtype(dtype: DType, float_dtype):
    return float_dtype if dtype is DType.FLOAT else _TORCH_DTYPE[dtype]


def _eval_one(node: Node, srcs, leaves, buffers, float_dtype, device):
    op = node.op
    target = _target_dtype(node.dtype, float_dtype)
    if op is Op.CONST:
        return torch.tensor(node.arg, dtype=target, device=device)
    if op in leaves:
        value = leaves[op]
        if value is None:
            raise ValueError(f"evaluating the IR needs a value for {op.name.lower()}")
        value = torch.as_tensor(value, device=device)
        return value.to(target)
    if op is Op.LOAD:
        buf = buffers[node.arg].to(device)  # no copy when already there
        if srcs:
            srcs = torch.broadcast_tensors(*srcs)
            value = buf[tuple(srcs)]
        else:
            value = buf.reshape(())
        return value.to(target)
    if op is Op.POW and node.dtype is DType.FLOAT and node.src[1].op is Op.CONST \
            and abs(float(node.src[1].arg)) == 0.5:
        # torch computes a tensor to the Python float 0.5 or -0.5 as sqrt and rsqrt ((-inf) **
        # 0.5 is NaN, (-0.0) ** 0.5 -0.0), as the kernels render it; pow with a tensor exponent
        # would not
        base = srcs[0].to(target)
        return torch.sqrt(base) if float(node.src[1].arg) > 0 else torch.rsqrt(base)
    return apply_op(op, node.dtype, srcs, float_dtype, node.arg)


class _PassGradient(torch.autograd.Function):
    """``value`` in the forward, the gradient of ``x`` unchanged in the backward: float16 /
    bfloat16 rounding differentiates as the identity (torch's .half() would also round the
    gradient to float16; the kernels keep it in float32)."""

    @staticmethod
    def forward(ctx, x, value):
        return value

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _TiedExtremum(torch.autograd.Function):
    """MAX/MIN whose ties convention is not torch.maximum's half split: torch's value, and
    the gradient masks of ``grad._extremum`` (clamp's, relu's), so that torch.autograd on the
    eager reference and the derived joint graph agree."""

    @staticmethod
    def forward(ctx, a, b, is_max, ties):
        ctx.save_for_backward(a, b)
        ctx.is_max, ctx.ties = is_max, ties
        return torch.maximum(a, b) if is_max else torch.minimum(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        upper, lower = (a, b) if ctx.is_max else (b, a)  # the result is the larger of these
        if ctx.ties == TIES_NONE:
            a_gets = ~(upper <= lower)  # strictly on the kept side, or NaN
        else:
            a_gets = lower <= upper  # kept side or tie
        zero = torch.zeros((), dtype=grad.dtype, device=grad.device)
        grad_a = torch.where(a_gets, grad, zero).sum_to_size(a.shape)
        grad_b = torch.where(upper < lower, grad, zero).sum_to_size(b.shape)
        return grad_a, grad_b, None, None


def narrow(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` stored in the torch dtype ``name`` and read back (floats in x's dtype, ints as
    int64). A float stored in an int type converts as torch does on x86 CPUs: truncated
    toward zero to int32, where NaN and values outside int32 become -2**31, then wrapped
    into the type (C leaves out-of-range conversions undefined; torch on CUDA saturates)."""
    storage = _NARROW_TORCH[name]
    if storage.is_floating_point:
        rounded = x.detach().to(storage).to(x.dtype)
        return _PassGradient.apply(x, rounded) if x.requires_grad else rounded
    if x.dtype.is_floating_point:
        in_range = (x >= _INT32_MIN) & (x < -_INT32_MIN)  # False for NaN
        x = torch.where(in_range, torch.trunc(x), _INT32_MIN).to(torch.int64)
    return x.to(storage).to(torch.int64)


def apply_op(op: Op, dtype: DType, srcs, float_dtype=torch.float32, arg=None) -> torch.Tensor:
    """One non-leaf IR op on torch tensors; ``dtype`` and ``arg`` are the node's. Shared with
    constant folding (simplify.py), so folded constants equal what evaluation would compute."""
    target = _target_dtype(dtype, float_dtype)
    if op is Op.NARROW:
        return narrow(srcs[0], arg)
    if op in (Op.MAX, Op.MIN) and arg is not TIES_SPLIT and dtype is DType.FLOAT:
        return _TiedExtremum.apply(*srcs, op is Op.MAX, arg)
    if op is Op.CAST:
        (x,) = srcs
        if dtype is DType.INT and x.dtype.is_floating_point:
            return torch.trunc(x).to(target)
        return x.to(target)
    if op is Op.WHERE:
        cond, a, b = srcs
        return torch.where(cond, a, b)
    if op in _LOGIC:
        logical, bitwise = _LOGIC[op]
        fn = logical if dtype is DType.BOOL else bitwise
        return fn(*srcs)
    if op in _BINARY:
        return _BINARY[op](*srcs)
    if op in _UNARY:
        return _UNARY[op](*srcs)
    raise NotImplementedError(f"no eager evaluation rule for IR op {op.name}")


def index_grids(B: int, H: int, L: int, S: int, device="cpu", q_offset: int = 0):
    """int64 index tensors shaped to broadcast to [B,H,L,S] (rows start at ``q_offset``)."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    q = torch.arange(q_offset, q_offset + L, device=device).view(1, 1, L, 1)
    kv = torch.arange(S, device=device).view(1, 1, 1, S)
    return b, h, q, kv


def evaluate(traced: TracedMod, *, score=None, b=None, h=None, q_idx=None, kv_idx=None,
             buffers=None, float_dtype=torch.float32, device=None) -> torch.Tensor:
    """Evaluate a traced mod; ``buffers`` default to the tensors captured at trace time."""
    return evaluate_node(traced.root, score=score, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx,
                         buffers=traced.buffers if buffers is None else buffers,
                         float_dtype=float_dtype, device=device)


def dense_mask(traced: TracedMod, B: int, H: int, L: int, S: int, device="cpu",
               rows_per_chunk: int | None = None) -> torch.Tensor:
    """The [B,H,L,S] bool mask of a mask_mod, evaluated ``rows_per_chunk`` query rows at a time."""
    out = torch.empty(B, H, L, S, dtype=torch.bool, device=device)
    step = rows_per_chunk or L
    for start in range(0, L, step):
        rows = min(step, L - start)
        b, h, q, kv = index_grids(B, H, rows, S, device, q_offset=start)
        value = evaluate(traced, b=b, h=h, q_idx=q, kv_idx=kv, device=device)
        out[:, :, start:start + rows] = value.expand(B, H, rows, S)
    return out
