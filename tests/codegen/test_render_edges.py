"""Edges of the rendered ops (codegen/render.py, the helpers of helpers.tmpl it calls, the
evaluator, dropout's keep threshold), from a mutation audit: each test fails under the
mutant its docstring names (a rule changed with every other test passing). The probes run
the rendered expression through the interpreter and compare it with torch running the mod
itself; where only a GPU's instruction differs (NaN-propagating max, correctly rounded
sqrt, the float -> int8 conversion), the rendered source is checked."""

import pytest
import torch

import flexfa
from flexfa.codegen.render import Leaves, buffer_args, render
from flexfa.frontend import evaluate, trace
from kernels.test_dropout import philox_words
from render_probe import run_probe

M = N = 16
Q_IDX = torch.arange(M)
KV_IDX = torch.arange(N) * 3 - 20
_g = torch.Generator().manual_seed(0)
SCORE = torch.randn(M, N, generator=_g) * 3


# each probe runs under the interpreter and, on a GPU machine, compiled for the GPU: the
# instructions a GPU picks (approximate division, saturating conversions, max.f32) differ
# where the interpreter's numpy does not
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _probe_on(device, fn, tmp_path, score=SCORE, q_idx=Q_IDX, kv_idx=KV_IDX, b=0, h=1):
    traced = trace(fn)
    return run_probe(traced.root, tmp_path, score=score, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx,
                     buffers=traced.buffers, device=device)


def _run_on(device, root, tmp_path, **kwargs):
    return run_probe(root, tmp_path, device=device, **kwargs)


def _eager(fn, score=SCORE, q_idx=Q_IDX, kv_idx=KV_IDX, b=0, h=1):
    """torch running the Python mod itself (not flexfa's IR evaluator)."""
    args = (torch.tensor(b), torch.tensor(h), q_idx.view(-1, 1), kv_idx.view(1, -1))
    out = fn(score, *args) if fn.__code__.co_argcount == 5 else fn(*args)
    return out.expand(len(q_idx), len(kv_idx))


def _inputs(L=32, S=32, H=2, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, H, n, E, generator=g) for n in (L, S, S))


@pytest.mark.parametrize("device", DEVICES)
def test_int_pow_uses_every_exponent_bit(tmp_path, device):
    """M05: flexfa_ipow must square over all 31 exponent bits: 0 ** 256 is 0, not 1 (an
    exponent whose low bits are zero)."""
    fn = lambda s, b, h, q, kv: ((q % 2) ** (kv * 256 + 256) + (q % 3 - 1) ** (kv + 1000)
                                 ).float()
    q = torch.arange(M)
    kv = torch.arange(N)  # exponents 256 * (kv + 1): low 8 bits all zero
    got = _probe_on(device, fn, tmp_path, q_idx=q, kv_idx=kv)
    assert torch.equal(got, _eager(fn, q_idx=q, kv_idx=kv).to(got.dtype))


@pytest.mark.parametrize("op", ["maximum", "minimum"])
def test_float_max_min_render_nan_propagating(op):
    """M06/M07: torch.maximum/minimum propagate NaN; a GPU's default max.f32 drops it (the
    interpreter's np.maximum propagates either way, so only the rendered source can show it)."""
    fn = getattr(torch, op)
    bias = torch.tensor([0.5, float("nan")])
    traced = trace(lambda s, b, h, q, kv: fn(s, bias[h]))
    rendered = render([traced.root], Leaves(), [buffer_args(0, 1)])
    text = "\n".join(rendered.lines + rendered.values)
    assert f"tl.{op}(" in text and "propagate_nan=tl.PropagateNan.ALL" in text


@pytest.mark.parametrize("name", ["expm1", "log1p"])
@pytest.mark.parametrize("device", DEVICES)
def test_expm1_log1p_keep_relative_accuracy_near_zero(name, tmp_path, device):
    """M18/M19: expm1 / log1p must not be rendered as exp(x) - 1 / log(1 + x), which lose
    x's low bits for small x (relative error ~1e-2 at 1e-6; the helpers' is ~1e-7)."""
    fn = getattr(torch, name)
    score = (torch.randn(M, N, generator=torch.Generator().manual_seed(1))
             * torch.logspace(-8, -3, M * N).view(M, N))
    got = _probe_on(device, lambda s, b, h, q, kv: fn(s), tmp_path, score=score)
    want = fn(score.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_floor_ceil_of_integral_and_half_values(tmp_path, device):
    """M20: ceil/floor at integral floats (ceil(2.0) == 2.0, not 3.0), halves and -0.5
    (ceil gives -0.0), bit for bit as torch."""
    score = torch.tensor([-3.0, -2.5, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 2.5, 7.0, 1e8,
                          -1e8, 3.999999, -3.999999, 16777215.0]).repeat(M, 1)
    for fn in (torch.ceil, torch.floor):
        got = _probe_on(device, lambda s, b, h, q, kv: fn(s), tmp_path, score=score)
        want = fn(score)
        assert torch.equal(got, want)
        assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("device", DEVICES)
def test_float_to_int64_cast_truncates_toward_zero(tmp_path, device):
    """M21: .long() / .to(torch.int64) of a float truncates toward zero (torch), not floor:
    -2.5 -> -2. (The .int() narrow path goes through flexfa_f2i32 and is tested elsewhere.)"""
    fn = lambda s, b, h, q, kv: (s * 3.3).long() + (s * 0.5).to(torch.int64) * 7
    got = _probe_on(device, fn, tmp_path)
    assert torch.equal(got, _eager(fn).to(got.dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_int_to_bool_cast_is_nonzero(tmp_path, device):
    """int -> bool (.bool(), torch.where on an int condition) is x != 0: negative values are
    True (a semantics guard: the audit's M22, a wrong bool cast rule, is unreachable, the
    tracer writes .bool() as != 0)."""
    fn = lambda b, h, q, kv: (q - kv).bool() & (kv % 7 - 3).bool()
    got = _probe_on(device, fn, tmp_path)
    assert torch.equal(got, _eager(fn))


@pytest.mark.parametrize("device", DEVICES)
def test_float_to_bool_cast_is_nonzero(tmp_path, device):
    """float -> bool is x != 0: negative values, -inf and NaN are True; only +-0.0 is False
    (a semantics guard, as above: M23 is unreachable)."""
    score = SCORE.clone()
    score[0, :4] = torch.tensor([float("nan"), float("-inf"), -0.0, 0.0])
    fn = lambda s, b, h, q, kv: s.bool() | (kv * 0.5 - 1.0).bool()
    got = _probe_on(device, fn, tmp_path, score=score)
    assert torch.equal(got, _eager(fn, score=score))


def test_sqrt_renders_correctly_rounded():
    """M17: torch.sqrt is correctly rounded; tl.sqrt is the GPU's approximate sqrt (the
    interpreter's np.sqrt hides the difference, so the rendered source is checked)."""
    traced = trace(lambda s, b, h, q, kv: torch.sqrt(s.abs()))
    rendered = render([traced.root], Leaves())
    text = "\n".join(rendered.lines + rendered.values)
    assert "tl.sqrt_rn(" in text and "tl.sqrt(" not in text


def test_fast_math_transcendentals_stay_accurate(tmp_path):
    """M45/M71: with fast_math (GPU targets) exp/tanh/sigmoid render to the flexfa_fast_*
    helpers; under the interpreter those are the exact helpers / exp2(x * log2(e)), which
    must match torch to float32 accuracy (a wrong rule or log2(e) constant shows here)."""
    score = torch.linspace(-30.0, 30.0, M * N).view(M, N)
    for fn in (torch.exp, torch.tanh, torch.sigmoid):
        traced = trace(lambda s, b, h, q, kv: fn(s))
        rendered = render([traced.root], Leaves(), fast_math=True)
        assert "flexfa_fast_" + fn.__name__ in "\n".join(rendered.lines + rendered.values)
        got = run_probe(traced.root, tmp_path, score=score, b=0, h=1, q_idx=Q_IDX,
                        kv_idx=KV_IDX, fast_math=True)
        torch.testing.assert_close(got.double(), fn(score.double()), rtol=3e-6, atol=1e-7)


@pytest.mark.parametrize("to", ["char", "short", "byte"])
def test_float_to_small_int_narrow_goes_through_f2i32(to):
    """M27: float -> int8/int16/uint8 converts through int32 as torch on a CPU (NaN and values
    outside int32 give -2**31, then wrap); a direct .to(tl.int8) saturates on a GPU. The x86
    interpreter's own conversion happens to agree, so the rendered source is checked."""
    traced = trace(lambda s, b, h, q, kv: getattr(s * 1e3, to)().float())
    rendered = render([traced.root], Leaves())
    text = "\n".join(rendered.lines + rendered.values)
    assert "flexfa_f2i32(" in text


@pytest.mark.parametrize("device", DEVICES)
def test_wide_float_to_int_cast_keeps_int64_values(tmp_path, device):
    """M30: a float -> int cast whose values leave int32 (ranges.int64_nodes marks it wide)
    renders as .to(tl.int64): (s * w[h]).long() with w ~ 1e10 must not wrap in int32."""
    from flexfa.codegen.ranges import Domain, int64_nodes
    w = torch.tensor([1e10, 3e10])
    fn = lambda s, b, h, q, kv: ((s * w[h]).long() % 1000003).float()
    traced = trace(fn)
    wide = int64_nodes([traced.root], tuple(t.dtype for t in traced.buffers), Domain(1, 2, M, N))
    assert wide
    got = _run_on(device, traced.root, tmp_path, score=SCORE, b=0, h=1, q_idx=Q_IDX, kv_idx=KV_IDX,
                    buffers=traced.buffers, wide=wide)
    want = _eager(fn)
    assert torch.equal(got, want.float())


@pytest.mark.parametrize("device", DEVICES)
def test_wide_int_pow_uses_63_exponent_bits(tmp_path, device):
    """M29: an int64 power squares over 63 exponent bits: 0 ** (2**31 + kv) is 0 and
    3 ** (2**31 + kv) wraps as torch's int64 does (31 bits would give 1 and 3 ** kv)."""
    from flexfa.codegen.ranges import Domain, int64_nodes
    fn = lambda s, b, h, q, kv: (((q % 2) ** (kv + 2 ** 31) + 3 ** (kv + 2 ** 31 + q))
                                 % 1000003).float()
    traced = trace(fn)
    wide = int64_nodes([traced.root], (), Domain(1, 2, M, N))
    kv = torch.arange(N)
    got = _run_on(device, traced.root, tmp_path, score=SCORE, b=0, h=1, q_idx=Q_IDX, kv_idx=kv,
                    wide=wide)
    assert torch.equal(got, _eager(fn, kv_idx=kv).to(got.dtype))


_DIVIDENDS = torch.tensor([1.0, -1.0, 0.0, -0.0, 5.0, -5.0, 0.25, -0.25, 7.5, -7.5, 1e-30,
                           -1e-30, 3.0, -3.0, 2.0, -2.0])
_DIVISORS = torch.tensor([3.0, -3.0, 0.0, -0.0, 0.5, -0.5, 1e30, -1e30, 8.0, -8.0, 2.0, -2.0,
                          7.0, -7.0, 1.0, -1.0])


@pytest.mark.parametrize("device", DEVICES)
def test_float_floordiv_signed_zeros_and_zero_divisors(tmp_path, device):
    """M51/M52: float // as torch.floor_divide bit for bit, sign of zero included: -1.0 //
    -3.0 is +0.0, 1.0 // -3.0 is -1.0, 0.0 // -3.0 is -0.0; x // +-0.0 is +-inf (NaN for 0)."""
    score = _DIVIDENDS.view(M, 1).expand(M, N).contiguous()
    fn = lambda s, b, h, q, kv: s // _DIVISORS[kv]
    got = _probe_on(device, fn, tmp_path, score=score, kv_idx=torch.arange(N))
    want = torch.floor_divide(score, _DIVISORS.view(1, N))
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))


@pytest.mark.parametrize("device", DEVICES)
def test_int_pow_with_negative_exponents_matches_torch(tmp_path, device):
    """M53: torch.pow of ints with a negative exponent: 1 ** b is 1, (-1) ** b is +-1 by
    parity, any other base 0 (not the square-and-multiply of the exponent's two's complement)."""
    from flexfa.codegen.ranges import Domain, int64_nodes
    fn = lambda s, b, h, q, kv: (((q - 3) ** (kv - 6)) % 1000003).float()
    q = torch.arange(M)
    kv = torch.arange(N)  # exponents -6 .. 9
    traced = trace(fn)
    got = _run_on(device, traced.root, tmp_path, score=SCORE, b=0, h=1, q_idx=q, kv_idx=kv,
                    wide=int64_nodes([traced.root], (), Domain(1, 2, M, N)))
    assert torch.equal(got, _eager(fn, q_idx=q, kv_idx=kv).to(got.dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_log1p_of_infinity_and_overflowing_exp(tmp_path, device):
    """M64: log1p(+inf) is +inf (log1p(exp(x)) for x past 88: a softplus); the helper's
    log(u) * x / (u - 1) would be inf * NaN."""
    score = torch.tensor([float("inf"), 1e30, 3e38, 100.0, 0.0, -0.5]).repeat(M, 3)[:, :N]
    for fn in (lambda s, b, h, q, kv: torch.log1p(s),
               lambda s, b, h, q, kv: torch.log1p(torch.exp(s))):
        got = _probe_on(device, fn, tmp_path, score=score)
        want = _eager(fn, score=score)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_tanh_relative_accuracy_near_zero(tmp_path, device):
    """M67/M68: flexfa_tanh keeps float32 relative accuracy near 0 (the odd series below
    0.125, four terms): within 1.5e-7 relative of float64 tanh on 1e-8 .. 0.125."""
    x = torch.cat([torch.logspace(-8, -1, 128), torch.linspace(0.1, 0.1249, 128)])
    score = (x * torch.tensor([1.0, -1.0]).repeat(128)).view(M, N)
    got = _probe_on(device, lambda s, b, h, q, kv: torch.tanh(s), tmp_path, score=score)
    want = torch.tanh(score.double())
    rel = ((got.double() - want) / want).abs().max().item()
    assert rel < 1.5e-7, rel


def test_dropout_keeps_a_half_equal_to_the_threshold():
    """M86: an element is kept when its 16-bit half is AT LEAST the threshold round(p * 2**16)
    (the keep rate the scale 2**16 / (2**16 - threshold) assumes). p is chosen so that the
    threshold equals the half of element (0, 0, q, k) exactly: kept; one above: dropped."""
    from flexfa.runtime.dropout import threshold
    seed, offset, H = 987654321, 7, 2
    for q, k in ((0, 0), (1, 5), (3, 33)):
        group = 4 * (k // 32) + (k % 8) // 2
        word = philox_words(seed, (group, q, 0, offset))[(k % 32) // 8]
        half = (word >> (16 * (k % 2))) & 0xFFFF
        if not 0 < half < 2 ** 16 - 1:
            continue
        p = half / 2 ** 16
        assert threshold(p) == half
        assert bool(flexfa.dropout_mask((seed, offset), 1, H, 4, 40, p)[0, 0, q, k])
        assert not flexfa.dropout_mask((seed, offset), 1, H, 4, 40, (half + 1) / 2 ** 16)[0, 0, q, k]


@pytest.mark.parametrize("device", DEVICES)
def test_not_of_a_float_scalar_comparison_combines_with_other_bools(tmp_path, device):
    """M12: ~(w[h] > 0.5) renders as (x == 0), not Triton's ~: the interpreter holds a
    comparison of float scalars in a float array, which a later & refuses."""
    w = torch.tensor([0.2, 0.7, float("nan")])
    fn = lambda b, h, q, kv: ~(w[h] > 0.5) & (q >= kv) | ~(q > kv) & ~(w[h] < 0.5)
    for h in range(3):
        got = _probe_on(device, fn, tmp_path, h=h)
        assert torch.equal(got, _eager(fn, h=h))


@pytest.mark.parametrize("op", ["//", "%"])
def test_score_mod_dividing_an_int_by_constant_zero_is_refused(op):
    """M35: q // 0 or q % 0 in a score_mod (no eager evaluation catches it, unlike a
    mask_mod's block mask) is an UnsupportedOpError, not a kernel computing garbage."""
    from flexfa.errors import UnsupportedOpError
    q, k, v = _inputs(L=16, S=16)
    score_mod = eval(f"lambda s, b, h, q_idx, kv_idx: s + (q_idx {op} 0)")
    with pytest.raises(UnsupportedOpError, match="division by zero"):
        flexfa.flex_attention(q, k, v, score_mod=score_mod)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_narrow_keeps_nan_payloads_nan(tmp_path, device):
    """M63: a NaN whose low mantissa bits are set (0x7FFFFFFF, from a captured tensor) stays
    NaN when rounded to bfloat16 (rounding its bits would carry into the sign: -0.0)."""
    w = torch.tensor([0x7FFFFFFF, 0x7FC00001, 0xFFFFFFFF - 2 ** 32, 0x3F808000],
                     dtype=torch.int64).to(torch.int32).view(torch.float32)
    fn = lambda s, b, h, q, kv: w[kv % 4].bfloat16().float()
    got = _probe_on(device, fn, tmp_path)
    want = _eager(fn)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_folded_expm1_constant_is_accurate():
    """M83: constants are folded by frontend.evaluate.apply_op (in float32, as the kernel):
    expm1(h * 0 + 1e-7) must fold to 1e-7 within float32 accuracy (exp(x) - 1 gives 1.19e-7),
    and evaluate's expm1 must be torch's."""
    traced = trace(lambda s, b, h, q, kv: s * torch.expm1(h * 0 + 1e-7))
    consts = [n.arg for n in traced.root.toposort() if n.op.name == "CONST"]
    assert len(consts) == 1 and abs(consts[0] - 1e-7) < 1e-13
    x = torch.logspace(-9, -3, 64, dtype=torch.float32)
    got = evaluate(trace(lambda s, b, h, q, kv: torch.expm1(s)), score=x, b=0, h=0, q_idx=0,
                   kv_idx=0)
    assert torch.equal(got, torch.expm1(x))


@pytest.mark.parametrize("device", DEVICES)
def test_divisions_with_discrete_uses_are_correctly_rounded(tmp_path, device):
    """torch's float / is correctly rounded; a GPU's default division (div.full.f32) is off by
    up to 2 units in the last place, which a floor, an integer cast or a comparison turns
    into a whole unit: (q * d) / d floored must be q exactly, random quotients compared,
    cast and floored bit for bit torch's."""
    d = torch.arange(N) + 3
    q = torch.arange(M) * 37 + 5
    exact = lambda s, b, h, q, kv: (((q * (kv + 3)) / (kv + 3)).floor() + (q / (kv + 3)).floor()
                                    + ((q + 0.5) / (kv + 3)).long())
    got = _probe_on(device, exact, tmp_path, q_idx=q, kv_idx=d - 3)
    assert torch.equal(got, _eager(exact, q_idx=q, kv_idx=d - 3).to(got.dtype))
    w = torch.randn(N, generator=torch.Generator().manual_seed(3)) * 7
    ratio = lambda s, b, h, q, kv: ((s / w[kv] * 64.0).floor() + (s / w[kv] > 0.25).float()
                                    + (w[kv] / s).sign())
    got = _probe_on(device, ratio, tmp_path, kv_idx=torch.arange(N))
    assert torch.equal(got, _eager(ratio, kv_idx=torch.arange(N)))


def test_only_divisions_with_discrete_uses_pay_for_rounding():
    """A quotient that only arithmetic reads keeps the GPU's division (two units in the last
    place, as the fast transcendentals are approximate); one that reaches a floor,
    comparison, integer cast, sign or POW's exponent, through any arithmetic, is
    flexfa_div; a power-of-two divisor is a multiply."""
    w = torch.tensor([2.0, 3.0])
    cases = {
        lambda s, b, h, q, kv: s / w[h] + 1.0: (1, 0),
        lambda s, b, h, q, kv: s / 4.0: (0, 0),
        lambda s, b, h, q, kv: torch.where((s / w[h] + 1.0).floor() > 2, s / w[h], s): (0, 1),
        lambda s, b, h, q, kv: s + (q / 7).long(): (0, 1),
        lambda s, b, h, q, kv: s * (-1.0) ** (kv / w[h]): (0, 1),
        lambda s, b, h, q, kv: s / w[h] + (s / 3.0 > 0).float(): (1, 1),
    }
    for fn, (plain, exact) in cases.items():
        traced = trace(fn)
        rendered = render([traced.root], Leaves(), [buffer_args(0, 1)])
        text = "\n".join(rendered.lines + rendered.values)
        assert (text.count(" / "), text.count("flexfa_div(")) == (plain, exact), text


@pytest.mark.parametrize("device", DEVICES)
def test_float_to_int32_cast_at_the_range_edges(tmp_path, device):
    """M61: float -> int32 as torch on a CPU: truncation inside [-2**31, 2**31), -2**31 for
    2**31 itself, values past it, infinities and NaN (a GPU's cvt saturates: 2**31 - 1)."""
    edges = torch.tensor([2.0 ** 31, -2.0 ** 31, 2.0 ** 31 - 128, -2.0 ** 31 - 256, 3e9, -3e9,
                          float("inf"), float("-inf"), float("nan"), 1.5, -1.5, -0.0,
                          2147483520.0, 1e10, 0.99, -0.99])
    score = edges.repeat(M, 1)
    fn = lambda s, b, h, q, kv: s.int()
    got = _probe_on(device, fn, tmp_path, score=score)
    assert torch.equal(got, score.int().to(got.dtype))


@pytest.mark.parametrize("op", ["maximum", "minimum"])
@pytest.mark.parametrize("device", DEVICES)
def test_float_max_min_propagate_nan(op, tmp_path, device):
    """torch.maximum / minimum with a NaN on either side is NaN (M06/M07's rendering, run)."""
    fn = getattr(torch, op)
    bias = torch.tensor([0.5, float("nan")])
    score = SCORE.clone()
    score[::3, ::2] = float("nan")
    for h in (0, 1):
        mod = lambda s, b, h, q, kv: fn(s, bias[h])
        got = _probe_on(device, mod, tmp_path, score=score, h=h)
        want = _eager(mod, score=score, h=h)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("to", ["char", "short", "byte"])
@pytest.mark.parametrize("device", DEVICES)
def test_float_to_small_int_narrow_wraps_as_torch(to, tmp_path, device):
    """M27, run: float -> int8 / int16 / uint8 wraps through int32 as torch on a CPU (a
    direct conversion saturates on a GPU)."""
    fn = lambda s, b, h, q, kv: getattr(s * 1e3, to)().float()
    got = _probe_on(device, fn, tmp_path)
    assert torch.equal(got, _eager(fn))


@pytest.mark.parametrize("device", DEVICES)
def test_sqrt_is_correctly_rounded(tmp_path, device):
    """M17, run: sqrt correctly rounded, the float64 root rounded to float32 (the GPU's
    sqrt.approx is not; neither, at 1 unit in the last place, is torch 2.13's CPU sqrt of
    float32, so the oracle is float64's)."""
    score = torch.rand(M, N, generator=torch.Generator().manual_seed(4)) * 1e3
    score[0, :4] = torch.tensor([0.0, 4.0, 1e-38, 3e38])
    for scale in (1.0, 1e-30):
        fn = lambda s, b, h, q, kv: torch.sqrt(s * scale)
        got = _probe_on(device, fn, tmp_path, score=score)
        assert torch.equal(got, torch.sqrt((score * scale).double()).float())


@pytest.mark.gpu
def test_fast_transcendentals_on_the_gpu(tmp_path):
    """The GPU kernels' fast tanh (tanh.approx.f32, sigmoid through it) and exp (ex2 of
    x * log2(e)) within the accuracy their comment states: tanh and sigmoid 2**-10 absolute
    (tanh.approx's relative error is about 2**-11), exp 4e-6 relative on [-30, 30] (x *
    log2(e) is rounded, up to 2**-24 * 43 in the exponent)."""
    score = torch.linspace(-30.0, 30.0, M * N).view(M, N)
    score[0, :8] = torch.tensor([0.0, -0.0, 1e-6, -1e-6, 1e-3, 0.3, 4.0, 9.0])
    for fn, rtol, atol in ((torch.tanh, 0.0, 2 ** -10), (torch.sigmoid, 0.0, 2 ** -10),
                           (torch.exp, 4e-6, 0.0)):
        traced = trace(lambda s, b, h, q, kv: fn(s))
        got = run_probe(traced.root, tmp_path, score=score, b=0, h=1, q_idx=Q_IDX,
                        kv_idx=KV_IDX, fast_math=True, device="cuda")
        torch.testing.assert_close(got.double(), fn(score.double()), rtol=rtol, atol=atol)


# with quotients from 0 to 2**276 (3.3e38 over the smallest subnormal: every step of
# flexfa_ffmod's reduction), near integers (1.0 / 0.1), divisors of both signs
_BIG_DIVIDENDS = torch.tensor([1.0, -1.0, 7.0, 0.3, 1e10, -1e10, 123456792.0, 3e7, 16777217.0,
                               2.5e-30, 5e5, -5e5, 0.7, 1e38, 3.3e38, -7.5])
_SMALL_DIVISORS = torch.tensor([0.1, -0.1, 0.7, 3.0, -3.0, 0.3, 1e-3, 7.0, 1e-7, 0.2, 1.1,
                                -1.1, 2.0 ** -20, 1e-30, 33.0, 7 * 2.0 ** -149])


def _exact_fmod(a, b):
    """C's fmod of float32 tensors, exact (math.fmod on the values; torch 2.13's vectorized
    CPU fmod is NaN where the quotient overflows float32)."""
    import math
    flat = [math.fmod(x, y) if y != 0 else float("nan") for x, y in
            zip(a.flatten().tolist(), b.expand_as(a).flatten().tolist())]
    return torch.tensor(flat, dtype=torch.float32).view(a.shape)


def _python_ops(a, b):
    """fmod, % and // of float32 values as torch defines them (c10's div_floor_floating and
    remainder, in float32, from the exact fmod)."""
    mod = _exact_fmod(a, b)
    remainder = torch.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)
    div = (a - mod) / b
    div = torch.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    floor = torch.floor(div)
    floor = torch.where(div - floor > 0.5, floor + 1.0, floor)
    floor = torch.where(div == 0, torch.copysign(torch.zeros_like(div), a / b), floor)
    floor = torch.where(b == 0, a / b, floor)
    return {torch.fmod: mod, torch.remainder: remainder, torch.floor_divide: floor}


@pytest.mark.parametrize("device", DEVICES)
def test_float_remainders_of_large_and_near_integer_quotients(tmp_path, device):
    """torch.fmod, % and // of floats are exact (C's fmod): 1.0 fmod 0.1 is 0.09999999 (the
    quotient 9.99999985 rounds to 10 in float32) and 1e10 fmod 3 is 1; x - trunc(x / y) * y,
    a GPU's remainder, gives -1.5e-8 and 256 there. Quotients of float32 values whose
    exponents differ by more than 38 (some from 2**38 = 2.7e11, all from 2**39) give NaN."""
    score = _BIG_DIVIDENDS.view(M, 1).expand(M, N).contiguous()
    wants = _python_ops(score, _SMALL_DIVISORS.view(1, N))
    # past exponents 38 apart the kernels' fmod is NaN (flexfa_ffmod: two exact steps),
    # never a wrong value
    beyond = (torch.frexp(score.double())[1] - torch.frexp(_SMALL_DIVISORS.double())[1]) > 38
    assert 0 < int(beyond.sum()) < M * N
    for op, want in wants.items():
        want = torch.where(beyond & ~torch.isinf(score) & (_SMALL_DIVISORS != 0), float("nan"),
                           want)
        fn = lambda s, b, h, q, kv: op(s, _SMALL_DIVISORS[kv])
        got = _probe_on(device, fn, tmp_path, score=score, kv_idx=torch.arange(N))
        bad = ~((got == want) | (torch.isnan(got) & torch.isnan(want)))
        assert not bad.any(), (op.__name__, score[bad][:4], _SMALL_DIVISORS.expand(M, N)[bad][:4],
                               got[bad][:4], want[bad][:4])


_FIX_KERNEL = '''
import triton
import triton.language as tl

{helpers}


@triton.jit
def fixes(A, B, Q, OUT_DIV, OUT_MOD, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(A + i)
    b = tl.load(B + i)
    q = tl.load(Q + i)
    tl.store(OUT_DIV + i, flexfa_div_step(a, b, flexfa_div_step(a, b, q)))
    tl.store(OUT_MOD + i, flexfa_fmod_fix(tl.abs(a), tl.abs(b), tl.abs(q)))
'''


def _ulps(x: torch.Tensor, n: int) -> torch.Tensor:
    """x moved n float32 steps away from zero (n < 0: toward it), by its bits."""
    return (x.view(torch.int32) + n).view(torch.float32)


@pytest.mark.parametrize("off", [-2, -1, 1, 2])
def test_division_fixes_correct_a_quotient_two_units_off(tmp_path, off):
    """flexfa_div and flexfa_fmod_step take a GPU's r / ys (div.full.f32, up to two units in
    the last place off) and correct it. Under the interpreter / is exact, so the corrections
    are checked here with quotients moved 1 or 2 units off: the correctly rounded quotient
    (from float64) and the exact remainder come back. Remainders with |a / b| < 2**20."""
    import math
    from flexfa.codegen.template import load_template
    from flexfa.loader import load_module
    g = torch.Generator().manual_seed(7 + off)
    n = 256
    b = (torch.rand(n, generator=g) + 0.5) * 10.0 ** torch.randint(-20, 20, (n,), generator=g)
    a = b * (torch.rand(n, generator=g) * 2.0 ** torch.randint(0, 20, (n,), generator=g).float())
    a[:64] = (torch.randint(1, 1000, (64,), generator=g) * b[:64])  # exact multiples
    # quotients just below and above powers of two (the step below one is half the step
    # above), and below 1
    near = 2.0 ** torch.randint(-3, 19, (96,), generator=g).double()
    offset = (torch.rand(96, generator=g).double() - 0.5) * 1.2e-7
    b[64:160] = (a[64:160].double() / (near * (1.0 + offset))).float()
    a[160:192] = b[160:192] * torch.rand(32, generator=g)
    a = a * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    exact = (a.double() / b.double()).float()
    q = _ulps(exact, off)
    path = tmp_path / "fixes.py"
    path.write_text(_FIX_KERNEL.format(helpers=load_template("helpers.tmpl")))
    module = load_module(path, interpret=True)
    out_div, out_mod = torch.empty(n), torch.empty(n)
    module.fixes[(1,)](a, b, q, out_div, out_mod, N=n)
    assert torch.equal(out_div, exact)
    want = torch.tensor([math.fmod(abs(x), abs(y)) for x, y in zip(a.tolist(), b.tolist())],
                        dtype=torch.float32)
    assert torch.equal(out_mod, want)
