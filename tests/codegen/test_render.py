"""The expression renderer: every op, Python semantics, clamped loads, sharing, errors."""
import math

import pytest
import torch

from flexfa.codegen.render import Leaves, literal, render
from flexfa.errors import UnsupportedOpError
from flexfa.frontend import evaluate, trace
from flexfa.frontend.ir import DType, Node, Op, const, index

from render_probe import run_probe

M = N = 16
Q_IDX = torch.arange(M)
KV_IDX = torch.arange(N) * 3 - 20  # negative and positive values for sign rules
B, H = 1, 2
torch.manual_seed(0)
SCORE = torch.randn(M, N) * 3
BIAS = torch.randn(4, 5)
TABLE = torch.randint(-50, 50, (7,), dtype=torch.int32)
FLAGS = torch.tensor([True, False, True, True, False])


def _check(fn, tmp_path, exact=False):
    traced = trace(fn)
    got = run_probe(traced.root, tmp_path, score=SCORE, b=B, h=H, q_idx=Q_IDX, kv_idx=KV_IDX,
                    buffers=traced.buffers)
    want = evaluate(traced, score=SCORE, b=torch.tensor(B), h=torch.tensor(H),
                    q_idx=Q_IDX.view(M, 1), kv_idx=KV_IDX.view(1, N))
    want = want.expand(M, N)
    if traced.root.dtype is DType.FLOAT:
        torch.testing.assert_close(got, want.float(), rtol=2e-5, atol=2e-5, equal_nan=True)
    else:
        assert torch.equal(got, want.to(got.dtype)), (got, want)


FLOAT_MODS = {
    "add_sub_mul_div": lambda s, b, h, q, kv: (s + q) * 0.5 - kv / (h + 1.5),
    "floordiv_float": lambda s, b, h, q, kv: s // 0.7 + s // -1.3,
    # quotients that floor(a / b) rounds the wrong way: 1.0 // 0.1 is 9.0 in Python and torch
    "floordiv_float_rounding": lambda s, b, h, q, kv: (q * 0.1 + 1.0) // 0.1
    + (q + 1.0) // (kv * 0.1 + 0.05),
    "mod_float": lambda s, b, h, q, kv: torch.remainder(s, -1.3) + s % 0.9,
    "pow_float": lambda s, b, h, q, kv: torch.pow(s, 2.0) + s ** 3 + torch.abs(s) ** 0.37
    + torch.pow(s, (kv % 3).float()),
    "max_min": lambda s, b, h, q, kv: torch.maximum(s, q * 0.1) + torch.minimum(s, -kv * 0.1),
    "unary_math": lambda s, b, h, q, kv: torch.exp(s * 0.1) + torch.exp2(s * 0.1)
    + torch.log(torch.abs(s) + 1) + torch.log2(torch.abs(s) + 2) + torch.sqrt(torch.abs(s))
    + torch.rsqrt(torch.abs(s) + 1) + torch.sin(s) + torch.cos(s) + torch.tan(s * 0.3)
    + torch.erf(s) + torch.sigmoid(s),
    "tanh": lambda s, b, h, q, kv: torch.tanh(s) + 30.0 * torch.tanh(s / 30.0) + torch.tanh(s * 1e-3),
    "sign_floor_ceil": lambda s, b, h, q, kv: torch.sign(s) + torch.floor(s) + torch.ceil(s)
    + torch.sign(s * 0.0),
    "where_neg": lambda s, b, h, q, kv: torch.where(q > kv, -s, s * 2.0),
    "nan_inf": lambda s, b, h, q, kv: torch.where(s > 1.0, float("inf"), torch.where(
        s < -1.0, float("-inf"), torch.where(s > 0.5, float("nan"), s))),
    "captured_bias": lambda s, b, h, q, kv: s + BIAS[h, q % 5] + BIAS[b, kv % 5],
    "constant_result": lambda s, b, h, q, kv: 2.5 + 0.0 * h,
    "row_only": lambda s, b, h, q, kv: q * 0.5 + h,
    "float_to_int_truncates": lambda s, b, h, q, kv: (s * 3.3).int().float(),
    "bool_cast": lambda s, b, h, q, kv: (s > 0).float() + (q > 5).int() * 1.0,
}


@pytest.mark.parametrize("name", sorted(FLOAT_MODS))
def test_float_ops_match_eager(name, tmp_path):
    _check(FLOAT_MODS[name], tmp_path)


INT_MODS = {
    "floordiv_python_signs": lambda b, h, q, kv: ((q - kv) // 3 + (q - kv) // -4
                                                  + kv // (q + 1) == 2),
    "mod_python_signs": lambda b, h, q, kv: ((kv % 3) - (kv % -5) + (q - 7) % 4) > 1,
    "int_pow": lambda b, h, q, kv: ((kv % 4) ** 3 + (q % 3) ** (kv % 4 + 1) + q ** 2) % 7 == 1,
    "int_sign_abs_neg": lambda b, h, q, kv: torch.sign(kv) + torch.abs(kv) - (-q) > 10,
    "bitwise_int": lambda b, h, q, kv: ((q & 5) | (kv ^ 3)) + (~q) > 0,
    "bool_logic": lambda b, h, q, kv: ((q >= kv) & ~(kv < -5)) | ((q == 3) ^ (kv != 1)),
    "bool_max_min": lambda b, h, q, kv: torch.maximum(q > kv, q == 2) & torch.minimum(kv > 0, q < 9),
    "int_table": lambda b, h, q, kv: TABLE[kv % 7] > q * 2,
    "bool_table": lambda b, h, q, kv: FLAGS[q % 5] & (kv > 0),
    "scalar_result": lambda b, h, q, kv: h > 1,
    "int_max_min": lambda b, h, q, kv: torch.maximum(q, kv) - torch.minimum(q, kv) > 4,
}


@pytest.mark.parametrize("name", sorted(INT_MODS))
def test_int_and_bool_ops_match_python(name, tmp_path):
    _check(INT_MODS[name], tmp_path)


def test_loads_wrap_negative_and_clamp_out_of_range(tmp_path):
    table = torch.arange(10, dtype=torch.float32) * 10

    def reads_beyond(score, b, h, q_idx, kv_idx):
        return table[kv_idx]  # kv_idx in [-20, 25]: wraps once, then clamps

    traced = trace(reads_beyond)
    got = run_probe(traced.root, tmp_path, score=SCORE, b=B, h=H, q_idx=Q_IDX, kv_idx=KV_IDX,
                    buffers=traced.buffers)
    kv = KV_IDX.clone()
    kv = torch.where(kv < 0, kv + 10, kv).clamp(0, 9)
    assert torch.equal(got, (kv.float() * 10).expand(M, N))


def test_strided_buffer_reads_the_right_elements(tmp_path):
    base = torch.randn(6, 8)
    view = base.t()[::2]  # shape [4, 6], strides (2, 8): not contiguous

    def strided(score, b, h, q_idx, kv_idx):
        return score + view[q_idx % 4, kv_idx % 6]

    traced = trace(strided)
    got = run_probe(traced.root, tmp_path, score=SCORE, b=B, h=H, q_idx=Q_IDX, kv_idx=KV_IDX,
                    buffers=traced.buffers)
    want = SCORE + view[(Q_IDX % 4).view(M, 1), (KV_IDX % 6).view(1, N)]
    torch.testing.assert_close(got, want)


def test_shared_subexpressions_are_named_once():
    q, kv = index(Op.Q_IDX), index(Op.KV_IDX)
    diff = Node.make(Op.SUB, DType.INT, (q, kv))
    first = Node.make(Op.LT, DType.BOOL, (diff, const(4)))
    second = Node.make(Op.MUL, DType.INT, (diff, diff))
    out = render([first, second], Leaves(), prefix="x")
    assert sum(line.count("(q_idx - kv_idx)") for line in out.lines) == 1
    assert out.values == ("x1", "x2")
    assert out.lines[0] == "x0 = (q_idx - kv_idx)"


def test_single_use_values_are_inlined():
    traced = trace(lambda s, b, h, q, kv: (s * 2.0 + 1.0) * 3.0)
    out = render([traced.root], Leaves())
    assert len(out.lines) == 1 and out.lines[0] == "t0 = (((score * 2.0) + 1.0) * 3.0)"


def test_constants_fold_with_python_semantics():
    root = Node.make(Op.FLOORDIV, DType.INT, (const(-7), const(2)))
    assert render([root]).values == ("(-4)",)
    root = Node.make(Op.MOD, DType.INT, (const(7), const(-3)))
    assert render([root]).values == ("(-2)",)


def test_literals():
    assert literal(float("inf")) == 'float("inf")'
    assert literal(float("-inf")) == 'float("-inf")'
    assert literal(float("nan")) == 'float("nan")'
    assert literal(-3) == "(-3)" and literal(True) == "True"
    assert float(eval(literal(1e-30))) == 1e-30
    assert math.isinf(eval(literal(float("-inf")), {"float": float}))


def test_negative_zero_constants_keep_their_sign(tmp_path):
    """Regression: Triton turns every constant equal to 0 into +0.0 (compiled too), so a
    rendered ``(-0.0)`` made ``x / -0.0`` the opposite infinity."""
    _check(lambda s, b, h, q, kv: s / -0.0 + 1.0 / torch.where(kv > 0, -0.0, 0.0), tmp_path)
    _check(lambda s, b, h, q, kv: (s * 0.0 + -0.0) < 0.0, tmp_path)  # the mask path's compare
    _check(lambda s, b, h, q, kv: (q > kv) / -0.0 < 0.0, tmp_path)


def test_negation_of_zero_is_negative_zero(tmp_path):
    """Regression: Triton computes -x as 0 - x, so -(0.0) was +0.0 and 1 / -x the opposite
    infinity of torch's."""
    _check(lambda s, b, h, q, kv: 1.0 / -(s * 0.0) + 1.0 / -(q * 0.0) + 1.0 / torch.neg(kv * 0.0),
           tmp_path)


def test_unrenderable_op_names_the_op():
    bad = Node.make(Op.TANH, DType.INT, (index(Op.Q_IDX),))
    with pytest.raises(UnsupportedOpError, match="TANH"):
        render([bad])


def test_missing_leaf_is_an_error():
    traced = trace(lambda s, b, h, q, kv: s + 1.0)
    with pytest.raises(UnsupportedOpError, match="score"):
        render([traced.root], Leaves(score=None))


_GLUON_NEGATIVE_ZERO = '''
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from flexfa.codegen.render import NEGATIVE_ZERO

path = sys.argv[1]
with open(path, "w") as f:
    f.write("from triton.experimental import gluon\\n"
            "from triton.experimental.gluon import language as gl\\n"
            "import triton.language as tl\\n"
            "@gluon.jit\\n"
            "def negative_zero(out):\\n"
            f"    gl.store(out, {NEGATIVE_ZERO})\\n")
spec = importlib.util.spec_from_file_location("negative_zero_kernel", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
compiled = triton.compile(GluonASTSource(module.negative_zero, {"out": "*fp32"}, {}),
                          target=GPUTarget("cuda", 90, 32))
print([line for line in compiled.asm["ptx"].splitlines() if "-2147483648" in line])
'''


def test_negative_zero_literal_compiles_in_gluon_kernels(tmp_path):
    """The -0.0 literal's text works in the Gluon kernels too, whose mods render through the
    same rules (``tl.full`` did not compile there): it stores -0.0's bits. In a subprocess:
    the test session decorated triton.language for the interpreter."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", _GLUON_NEGATIVE_ZERO,
                             str(tmp_path / "kernel.py")], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "-2147483648" in result.stdout, result.stdout
