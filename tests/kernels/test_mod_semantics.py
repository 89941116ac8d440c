"""Torch semantics of casts and of the activation functions inside kernels: the rendered
expressions under the interpreter equal the eager evaluation (bit for bit for casts), a
forward and backward with such score_mods match the reference computed by torch running the
mod itself, and the kernels compile for sm_80 and sm_90 (no GPU needed)."""
import math
import sys
from pathlib import Path

import pytest
import torch

import flexfa
from flexfa.compile_check import compile_job
from flexfa.compile_check.jobs import forward_job
from flexfa.frontend import evaluate, trace
from flexfa.loader import load_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from render_probe import probe_source, run_probe  # noqa: E402

F = torch.nn.functional
M = N = 16
# score tile: float16 / bfloat16 rounding ties and overflow, int conversion edges, NaN, inf
EDGES = [0.0, -0.0, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8,
         65504.0, 65519.99, 65520.0, -65520.0, 2.0 ** -25, 3 * 2.0 ** -26, 3e38, -3.4e38,
         127.9, 128.0, -129.0, 255.5, 300.7, -300.7, 40000.0, 2147483520.0, 2147483648.0,
         -2147483904.0, 3e9, math.nan, math.inf, -math.inf, 1e-20, -1e-12, 0.5, -2.5]
_generator = torch.Generator().manual_seed(0)
SCORE = torch.cat([torch.tensor(EDGES), torch.randn(M * N - len(EDGES), generator=_generator)
                   * torch.logspace(-3, 5, M * N - len(EDGES))]).view(M, N)
Q_IDX = torch.arange(M) * 9001 - 70000  # int8/uint8/int16 wrap on both sides
KV_IDX = torch.arange(N) * 37 - 300

CAST_MODS = {
    "half": lambda s, q, kv: s.half(),
    "bfloat16": lambda s, q, kv: s.to(torch.bfloat16),
    "half arithmetic": lambda s, q, kv: (s.half() * 0.1 + 1) / 3,
    "bf16 + int": lambda s, q, kv: s.bfloat16() + kv,
    "float to int8": lambda s, q, kv: s.char(),
    "float to uint8": lambda s, q, kv: s.to(torch.uint8),
    "float to int16": lambda s, q, kv: s.short(),
    "float to int32": lambda s, q, kv: s.int(),
    "int8 wrap": lambda s, q, kv: q.to(torch.int8) * kv.to(torch.int8) + 100,
    "uint8 wrap": lambda s, q, kv: q.byte() - kv.byte(),
    "int16 wrap": lambda s, q, kv: q.short() * 3 + kv,
    "int32 wrap": lambda s, q, kv: q.int() * 40503 * kv.int(),
}
FUNCTION_MODS = {
    "expm1/log1p": lambda s, q, kv: torch.expm1(s * 1e-3) + torch.log1p(s.abs() * 1e-4),
    "fmod": lambda s, q, kv: torch.fmod(s, 1.3) + torch.fmod(q, kv + 1000) * 1.0,
    "activations": lambda s, q, kv: (F.silu(s) + F.gelu(s) + F.gelu(s, approximate="tanh")
                                     + F.softplus(s) + F.mish(s) + F.elu(s) + F.selu(s)),
    "kinks": lambda s, q, kv: (F.hardswish(s) + F.hardsigmoid(s) + F.relu6(s)
                               + F.leaky_relu(s) + torch.clamp(s, -1, 1) + torch.relu(s)),
    "rounding": lambda s, q, kv: torch.round(s) + torch.trunc(s) + torch.frac(s)
    + torch.round(s, decimals=1),
    "logaddexp/logsigmoid": lambda s, q, kv: torch.logaddexp(s, q * 1e-4) + F.logsigmoid(s),
    "detach": lambda s, q, kv: s + (s.round() - s).detach(),
}


def _traced(fn):
    return trace(lambda score, b, h, q_idx, kv_idx: fn(score, q_idx, kv_idx))


def _probe_and_eager(fn, tmp_path, score=SCORE):
    traced = _traced(fn)
    got = run_probe(traced.root, tmp_path, score=score, b=0, h=1, q_idx=Q_IDX, kv_idx=KV_IDX)
    want = evaluate(traced, score=score, b=torch.tensor(0), h=torch.tensor(1),
                    q_idx=Q_IDX.view(M, 1), kv_idx=KV_IDX.view(1, N))
    return got, want.expand(M, N)


@pytest.mark.parametrize("name", sorted(CAST_MODS))
def test_casts_in_kernels_equal_torch_bit_for_bit(name, tmp_path):
    got, want = _probe_and_eager(CAST_MODS[name], tmp_path)
    # and the eager evaluation is torch's own result on these values
    torch_value = CAST_MODS[name](SCORE, Q_IDX.view(M, 1), KV_IDX.view(1, N)).to(torch.float32)
    for reference, what in ((want, "eager evaluation"), (torch_value, "torch")):
        same = (got == reference) | (got.isnan() & reference.isnan())
        assert same.all(), (f"{name}: kernel differs from the {what} at "
                            f"{SCORE[~same][:4].tolist()}: {got[~same][:4].tolist()} vs "
                            f"{reference[~same][:4].tolist()}")


@pytest.mark.parametrize("name", sorted(FUNCTION_MODS))
def test_functions_in_kernels_match_eager(name, tmp_path):
    score = SCORE.clamp(-60, 60).nan_to_num(0.5)  # transcendental: compare finite inputs
    got, want = _probe_and_eager(FUNCTION_MODS[name], tmp_path, score)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, equal_nan=True)


def test_bfloat16_rounds_to_nearest_even_not_toward_zero(tmp_path):
    """Regression: the interpreter's own float32 -> bfloat16 conversion truncates."""
    score = torch.full((M, N), 1 + 3 * 2.0 ** -8)  # halfway: even neighbour is 1 + 2**-6
    got, _ = _probe_and_eager(lambda s, q, kv: s.bfloat16(), tmp_path, score)
    assert (got == 1 + 2.0 ** -6).all()


POW_EDGES = [-0.0, 0.0, -math.inf, math.inf, -1.0, 1.0, -2.0, 0.5, -0.5, math.nan, -3.0, 1e-3]
POW_MODS = {
    "score ** kv": lambda s, q, kv: s ** (kv % 7 - 3.0),
    "score ** half kv": lambda s, q, kv: s ** (kv * 0.5 - 3.0),
    "score ** 1.5": lambda s, q, kv: s ** 1.5,
    "score ** -1": lambda s, q, kv: s ** -1,
    "score ** -1.5": lambda s, q, kv: s ** -1.5,
    # constant exponents past the unrolled products: flexfa_pow_const's cases
    "score ** 0": lambda s, q, kv: s ** 0.0,
    "score ** 5": lambda s, q, kv: s ** 5,
    "score ** -2": lambda s, q, kv: s ** -2,
    "score ** 6.0": lambda s, q, kv: s ** 6.0,
    # torch's sqrt and rsqrt: (-inf) ** 0.5 is NaN, (-0.0) ** 0.5 is -0.0
    "score ** 0.5": lambda s, q, kv: s ** 0.5,
    "score ** -0.5": lambda s, q, kv: s ** -0.5,
    "score ** inf": lambda s, q, kv: s ** torch.where(kv % 2 == 0, math.inf, -math.inf),
    "-0.0 and -inf ** score": lambda s, q, kv: torch.where(kv % 2 == 0, -0.0, -math.inf) ** s,
    "-1.0 ** score": lambda s, q, kv: torch.pow(-1.0, s),
}


@pytest.mark.parametrize("name", sorted(POW_MODS))
def test_float_powers_of_zeros_infinities_and_negative_bases_equal_torch(name, tmp_path):
    """Regression: flexfa_pow gave pow(-0.0, -1) = +inf, pow(-inf, 1.5) = NaN, pow(-1, inf)
    = NaN (torch: -inf, +inf, 1), and score ** inf failed to render."""
    score = torch.tensor(POW_EDGES).repeat(M * N // len(POW_EDGES) + 1)[:M * N].view(M, N)
    score = score.T.contiguous()  # every base meets every exponent
    got, _ = _probe_and_eager(POW_MODS[name], tmp_path, score)
    want = POW_MODS[name](score, Q_IDX.view(M, 1), KV_IDX.view(1, N)).expand(M, N)
    close = torch.isclose(got, want, rtol=1e-5, atol=0)  # exp2(b * log2|a|) rounds
    same = close & (got.signbit() == want.signbit()) | (got.isnan() & want.isnan())
    assert same.all(), (f"{name}: at bases {score[~same][:4].tolist()} the kernel gives "
                        f"{got[~same][:4].tolist()}, torch {want[~same][:4].tolist()}")


# ---- through flex_attention ------------------------------------------------------------------

B, H, L, S, E = 1, 2, 60, 100, 16


def _torch_attention(q, k, v, score_mod):
    """float64 attention with the score_mod run by torch itself on [B, H, L, S] grids."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    grids = [torch.arange(n).view(*[-1 if i == d else 1 for i in range(4)])
             for d, n in enumerate(scores.shape)]
    return torch.softmax(score_mod(scores, *grids), -1) @ v


def _index_bias(q_idx, kv_idx):
    return (q_idx * 37 + kv_idx * 11) * 1.25  # whole numbers: exact in float32 and float64


TABLE_INT8 = torch.tensor([100, -100, 127, 90], dtype=torch.int8)


def _int8_table_mod(table):
    """A mod reading ``table`` (int8) twice; the GPU test makes it again over a GPU copy."""
    def mod(score, b, h, q_idx, kv_idx):
        return score + 0.01 * (table[q_idx % 4] + table[kv_idx % 4])
    return mod


SEMANTIC_MODS = {
    # each adds what rounding/wrapping changes (0 if the cast were a no-op): errors of up to
    # a float16 ulp of 4500 (2), a bfloat16 ulp of 4500 (16, * 0.1) and int8 wraps (~256)
    "half": lambda score, b, h, q_idx, kv_idx: score + (
        _index_bias(q_idx, kv_idx).half().float() - _index_bias(q_idx, kv_idx)),
    "bfloat16": lambda score, b, h, q_idx, kv_idx: score + 0.1 * (
        _index_bias(q_idx, kv_idx).to(torch.bfloat16).float() - _index_bias(q_idx, kv_idx)),
    "int8": lambda score, b, h, q_idx, kv_idx: score + 0.01 * (
        (q_idx * 7 + kv_idx).to(torch.int8) - (q_idx * 7 + kv_idx)),
    # an element of a captured int8 tensor stays int8: the sum wraps (regression: int64)
    "int8 table": _int8_table_mod(TABLE_INT8),
    # shifts as torch's, int64 ones (the hash leaves int32) included
    "shifts": lambda score, b, h, q_idx, kv_idx: score + 0.5 * (
        (((q_idx * 1000003) << 13) ^ (kv_idx << 40) ^ ((q_idx - kv_idx) >> 2)) % 7),
    # expm1 overflows in float32 above score 0.02 * 88.7: the branch not taken must not make
    # the gradient NaN (regression)
    "celu": lambda score, b, h, q_idx, kv_idx: F.celu(score, 0.02),
}


@pytest.mark.parametrize("name", sorted(SEMANTIC_MODS))
def test_flex_attention_with_casts_matches_torch(name):
    score_mod = SEMANTIC_MODS[name]
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, n, E, generator=generator, requires_grad=True)
               for n in (L, S, S))
    out = flexfa.flex_attention(q, k, v, score_mod=score_mod)
    want = _torch_attention(q, k, v, score_mod)
    noop = _torch_attention(q, k, v, lambda score, b, h, q_idx, kv_idx: score)
    assert (want - noop).abs().max() > 0.05, "the casts must matter for this test to mean much"
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    grad_out = torch.randn(out.shape, generator=generator)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    expected = torch.autograd.grad(want, (q, k, v), grad_out.double())
    for g, w in zip(got, expected):
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-3, atol=1e-3)


# ---- compile for the GPU architectures ---------------------------------------------------------

def _everything(score, b, h, q_idx, kv_idx):
    cast = (score.half() + score.bfloat16() + q_idx.to(torch.int8) * kv_idx.byte()
            + (score * 100).char() + score.short() + score.int() + q_idx.int() * 7)
    functions = (torch.expm1(score) + torch.log1p(score.abs()) + torch.fmod(score, 1.3)
                 + torch.fmod(q_idx, 7) + F.silu(score) + F.softplus(score) + F.hardswish(score)
                 + torch.clamp(score, -1, 1) + (score.round() - score).detach())
    return cast + functions


@pytest.mark.parametrize("arch", [80, 90])
def test_casts_and_functions_compile(arch):
    result = compile_job("fwd_d64_fp16_casts", arch, forward_job(64, "fp16", score_mod=_everything))
    assert result.ok, result.error
    assert "cvt.rn.f16.f32" in result.ptx  # the float16 rounding survived the compiler
    assert "cvt.s32.s8" in result.ptx or "cvt.s8" in result.ptx  # int8 sign extension


def test_rendered_source_calls_the_helpers():
    source = probe_source(_traced(lambda s, q, kv: s.bfloat16() + s.char() + torch.log1p(s)
                                  + torch.expm1(s)).root, ())
    for helper in ("flexfa_round_bf16(", "flexfa_f2i32(", "flexfa_log1p(", "flexfa_expm1("):
        assert helper in source


# ---- on a GPU: compiled conversions (a GPU's own float -> int saturates, bf16 rounds in
# hardware), the fast-math kernels of flex_attention ----------------------------------------

def _gpu_probe(root, tmp_path, score):
    source = probe_source(root, ())
    path = tmp_path / "probe_gpu.py"
    path.write_text(source)
    module = load_module(path, interpret=False, module_name=f"mod_semantics_{abs(hash(source))}")
    out = torch.empty(M, N, device="cuda", dtype={"float": torch.float32, "int": torch.int64,
                                                   "bool": torch.int32}[root.dtype.value])
    module.probe[(1,)](score.float().cuda(), Q_IDX.int().cuda(), KV_IDX.int().cuda(), out, 0, 1,
                       M=M, N=N)
    return out.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CAST_MODS))
def test_casts_compiled_for_the_gpu_equal_torch_on_the_cpu(name, tmp_path):
    got = _gpu_probe(_traced(CAST_MODS[name]).root, tmp_path, SCORE)
    want = CAST_MODS[name](SCORE, Q_IDX.view(M, 1), KV_IDX.view(1, N)).to(torch.float32)
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all(), (f"{name}: at {SCORE[~same][:4].tolist()} the GPU gives "
                        f"{got[~same][:4].tolist()}, torch {want[~same][:4].tolist()}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FUNCTION_MODS))
def test_functions_compiled_for_the_gpu_match_eager(name, tmp_path):
    score = SCORE.clamp(-60, 60).nan_to_num(0.5)
    traced = _traced(FUNCTION_MODS[name])
    got = _gpu_probe(traced.root, tmp_path, score)
    want = evaluate(traced, score=score, b=torch.tensor(0), h=torch.tensor(1),
                    q_idx=Q_IDX.view(M, 1), kv_idx=KV_IDX.view(1, N)).expand(M, N)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SEMANTIC_MODS))
def test_flex_attention_with_casts_on_the_gpu(name):
    score_mod = SEMANTIC_MODS[name]
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 4, n, 64, generator=generator).half() for n in (200, 300, 300)]
    exact = [t.float().requires_grad_(True) for t in inputs]
    want = _torch_attention(*exact, score_mod)
    grad_out = torch.randn(want.shape, generator=generator)
    want_grads = torch.autograd.grad(want, exact, grad_out.double())
    gpu = [t.cuda().requires_grad_(True) for t in inputs]
    if name == "int8 table":  # its captured table on the GPU too
        score_mod = _int8_table_mod(TABLE_INT8.cuda())
    out = flexfa.flex_attention(*gpu, score_mod=score_mod)
    torch.testing.assert_close(out.double().cpu(), want.detach(), rtol=0, atol=1e-2)
    got_grads = torch.autograd.grad(out, gpu, grad_out.half().cuda())
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got.double().cpu(), expected.double(), rtol=0, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(POW_MODS))
def test_float_powers_compiled_for_the_gpu_equal_torch(name, tmp_path):
    """The pow helpers' special cases and x ** +-0.5's sqrt / rsqrt, compiled: the GPU's
    lg2 / ex2 and sqrt must keep them where the interpreter does."""
    score = torch.tensor(POW_EDGES).repeat(M * N // len(POW_EDGES) + 1)[:M * N].view(M, N)
    score = score.T.contiguous()
    got = _gpu_probe(_traced(POW_MODS[name]).root, tmp_path, score)
    want = POW_MODS[name](score, Q_IDX.view(M, 1), KV_IDX.view(1, N)).expand(M, N)
    # the compiled exp2 flushes float32 subnormals to zero (0.001 ** 13.5 is 3.2e-41 in torch)
    flushed = (want.abs() < torch.finfo(torch.float32).tiny) & (got == 0)
    close = torch.isclose(got, want, rtol=1e-5, atol=0) | flushed
    same = close & (got.signbit() == want.signbit()) | (got.isnan() & want.isnan())
    assert same.all(), (f"{name}: at bases {score[~same][:4].tolist()} the GPU gives "
                        f"{got[~same][:4].tolist()}, torch {want[~same][:4].tolist()}")


SIGNED_ZERO_MODS = {
    "x / -0.0": lambda s, q, kv: s / -0.0 + 1.0 / torch.where(kv > 0, -0.0, 0.0),
    "1 / -(x * 0)": lambda s, q, kv: 1.0 / -(s * 0.0) + 1.0 / torch.neg(kv * 0.0),
    "-0.0 compare": lambda s, q, kv: ((s * 0.0 + -0.0) < 0.0) * 1.0 + (1.0 / (s * 0.0 + -0.0)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SIGNED_ZERO_MODS))
def test_signed_zeros_compiled_for_the_gpu_equal_torch(name, tmp_path):
    """LLVM folds constants and rewrites x * -1.0: -0.0 literals and negation must keep their
    sign in the compiled kernel as in the interpreter (1 / -0.0 is -inf)."""
    score = SCORE.nan_to_num(0.5)
    got = _gpu_probe(_traced(SIGNED_ZERO_MODS[name]).root, tmp_path, score)
    want = SIGNED_ZERO_MODS[name](score, Q_IDX.view(M, 1), KV_IDX.view(1, N)).expand(M, N)
    same = (got == want) | (got.isnan() & want.isnan())
    assert same.all(), (f"{name}: the GPU gives {got[~same][:4].tolist()}, "
                        f"torch {want[~same][:4].tolist()}")


def test_a_bool_where_over_a_program_scalar_comparison_combines():
    """torch.where choosing between a float comparison of a program's scalar (h as a float)
    and a block of bools, then | with another block: the Triton interpreter failed in
    numpy's bitwise_or (the where's result was no bool array); a bool where renders
    ``!= 0`` after it. Both mods match torch's eager semantics."""
    from kernels.forward_utils import check_forward, make_qkv

    def keep(b, h, q_idx, kv_idx):
        return torch.where(h <= b, 0.5 <= h.float(), kv_idx < 3) | (q_idx >= kv_idx)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(keep(b, h, q_idx, kv_idx), score, -1.0)

    q, k, v = make_qkv(1, 2, 2, 32, 16, 16, seed=5)
    check_forward(q, k, v, score_mod)
    mask = flexfa.create_block_mask(keep, 1, 2, 32, 16, device="cpu", BLOCK_SIZE=16)
    check_forward(q, k, v, mask_mod=keep, block_mask=mask)
