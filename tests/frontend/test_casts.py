"""Casts inside mods round and wrap as torch does, and so does later arithmetic on the cast
value: the eager evaluation of the traced mod equals torch running the same mod on 0-d
tensors (what a mod sees in torch's flex_attention), bit for bit."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexfa.errors import TraceError, UnsupportedOpError
from flexfa.frontend import Op, evaluate, trace
from flexfa.frontend.evaluate import narrow

# float32 values on every rounding and range edge of the storage types
FLOAT_EDGES = [0.0, -0.0, 0.5, -0.5, 1.5, 127.9, 128.0, -128.9, -129.0, 255.5, 256.0, 300.7,
               -300.7, 32767.5, 40000.0, -40000.0, 65504.0, 65519.99, 65520.0, -65520.0, 1e5,
               2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11,
               1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 2147483520.0, 2147483648.0, -2147483648.0,
               -2147483904.0, 3e9, -3e9, 1e20, 3e38, math.inf, -math.inf, math.nan]
INT_EDGES = [0, 1, -1, 127, 128, -128, -129, 255, 256, 32767, 32768, -32769, 65535, 2 ** 31 - 1,
             2 ** 31, -2 ** 31 - 1, 2 ** 40 + 3, -2 ** 40 - 5]
FLOATS = st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(width=32))
INTS = st.one_of(st.sampled_from(INT_EDGES), st.integers(-2 ** 45, 2 ** 45))

CASTS = {
    "half": lambda x: x.half(), "bfloat16": lambda x: x.bfloat16(),
    "to(float16)": lambda x: x.to(torch.float16), "to(bfloat16)": lambda x: x.to(torch.bfloat16),
    "type(float16)": lambda x: x.type(torch.float16),
    "type(str)": lambda x: x.type("torch.HalfTensor"),
    "to(dtype=bfloat16)": lambda x: x.to(dtype=torch.bfloat16), "float": lambda x: x.float(),
    "int": lambda x: x.int(), "short": lambda x: x.short(), "char": lambda x: x.char(),
    "byte": lambda x: x.byte(), "long": lambda x: x.long(), "bool": lambda x: x.bool(),
    "to(int8)": lambda x: x.to(torch.int8), "to(uint8)": lambda x: x.to(torch.uint8),
    "to(int16)": lambda x: x.to(torch.int16), "to(int32)": lambda x: x.to(torch.int32),
    "to(cpu, int8)": lambda x: x.to("cpu", torch.int8), "double": lambda x: x.double(),
    "to(uint8 tensor)": lambda x: x.to(torch.zeros((), dtype=torch.uint8)),
}
# float -> int64 out of range is the C undefined case torch leaves to the CPU; it is the
# CAST op (int64 math), which the kernels compute in int32 where it fits
NOT_FROM_FLOAT = {"long"}


def _eager_and_traced(mod, score=0.0, q=0, kv=0):
    """(torch's result of ``mod`` on 0-d tensors, the traced mod's float32 evaluation), both
    made the float32 score a score_mod returns."""
    args = dict(score=torch.tensor(score, dtype=torch.float32), b=torch.tensor(0),
                h=torch.tensor(0), q_idx=torch.tensor(q), kv_idx=torch.tensor(kv))
    want = mod(*args.values())
    got = evaluate(trace(mod), **args)
    return torch.as_tensor(want).to(torch.float32), got


def _assert_same(want, got, what):
    same = torch.equal(want.isnan(), got.isnan()) and torch.equal(want.nan_to_num(),
                                                                 got.nan_to_num())
    assert same, f"{what}: torch {want.item()!r}, flexfa {got.item()!r}"


@pytest.mark.parametrize("name", sorted(CASTS))
@given(value=FLOATS)
def test_cast_of_a_float_matches_torch(name, value):
    if name in NOT_FROM_FLOAT:
        return
    cast = CASTS[name]
    want, got = _eager_and_traced(lambda score, b, h, q_idx, kv_idx: cast(score), score=value)
    _assert_same(want, got, f"{name} of {value!r}")


@pytest.mark.parametrize("name", sorted(CASTS))
@given(value=INTS)
def test_cast_of_an_int_matches_torch(name, value):
    cast = CASTS[name]
    want, got = _eager_and_traced(lambda score, b, h, q_idx, kv_idx: cast(q_idx), q=value)
    _assert_same(want, got, f"{name} of {value!r}")


def test_every_float_edge_case():
    """The edges one by one (hypothesis may not draw each of them)."""
    for name, cast in CASTS.items():
        for value in FLOAT_EDGES:
            if name not in NOT_FROM_FLOAT:
                want, got = _eager_and_traced(lambda s, b, h, q, kv: cast(s), score=value)
                _assert_same(want, got, f"{name} of {value!r}")
        for value in INT_EDGES:
            want, got = _eager_and_traced(lambda s, b, h, q, kv: cast(q), q=value)
            _assert_same(want, got, f"{name} of {value!r}")


# later arithmetic keeps the storage type where torch's promotion keeps it
ARITHMETIC = {
    "half*0.1": lambda s, q, kv: s.half() * 0.1,
    "half+half*3": lambda s, q, kv: s.half() + s.half() * 3,
    "half/3+1": lambda s, q, kv: s.half() / 3 + 1,
    "exp(bf16*0.01)": lambda s, q, kv: torch.exp(s.bfloat16() * 0.01),
    "half+float32": lambda s, q, kv: s.half() + s * 0.1,
    "half+int": lambda s, q, kv: s.half() + q,
    "where(half,0.1)": lambda s, q, kv: torch.where(q > kv, s.half(), 0.1),
    "int8+100": lambda s, q, kv: q.to(torch.int8) + 100,
    "int8*int8": lambda s, q, kv: q.to(torch.int8) * kv.to(torch.int8),
    "uint8-1": lambda s, q, kv: q.to(torch.uint8) - 1,
    "uint8*int8": lambda s, q, kv: q.byte() * kv.char(),
    "int32 hash": lambda s, q, kv: q.int() * 3000017 * kv.int(),
    "neg int8": lambda s, q, kv: -q.to(torch.int8),
    "abs char": lambda s, q, kv: torch.abs(q.char()),
    "char//3%7": lambda s, q, kv: (q.char() // 3) % 7,
    "short**2": lambda s, q, kv: q.short() ** 2,
    "~byte": lambda s, q, kv: ~q.byte(),
    "int8/2": lambda s, q, kv: q.to(torch.int8) / 2,
    "int8+float": lambda s, q, kv: q.to(torch.int8) + 0.5,
    "int8+long": lambda s, q, kv: q.to(torch.int8) + kv,
    "half.int()": lambda s, q, kv: (s * 1000).half().int(),
    "zeros_like(half)+0.1": lambda s, q, kv: torch.zeros_like(s.half()) + 0.1,
    "new_full(half)": lambda s, q, kv: s.half().new_full((), 0.1) * s,
    "full_like(int8)": lambda s, q, kv: torch.full_like(q, 100, dtype=torch.int8) + q,
    "clamp(half)": lambda s, q, kv: torch.clamp(s.half(), min=0.1),
    "clamp(half,int)": lambda s, q, kv: torch.clamp(s.half(), min=q, max=kv),
    "where(half,int)": lambda s, q, kv: torch.where(q > kv, s.half(), kv),
    "maximum(bf16,int)": lambda s, q, kv: torch.maximum(s.bfloat16(), q),
    "silu(half)": lambda s, q, kv: torch.nn.functional.silu(s.half()),
    "to(other)": lambda s, q, kv: s.to(q.to(torch.int16)) + 40000,
    "detach(int8)+1": lambda s, q, kv: q.to(torch.int8).detach() + 127,
    # a Python int beside a narrow int is wrapped into its type first (200 is -56 in int8)
    "char//200": lambda s, q, kv: q.char() // 200, "char%-200": lambda s, q, kv: q.char() % -200,
    "char==128": lambda s, q, kv: q.char() == 128, "short<40000": lambda s, q, kv: q.short() < 40000,
    "1000//char": lambda s, q, kv: 1000 // (q.char() | 1), "byte>=300": lambda s, q, kv: q.byte() >= 300,
    "char<<260": lambda s, q, kv: q.char() << 260, "char/200": lambda s, q, kv: q.char() / 200,
    # and a Python number beside a float16 / bfloat16 is rounded to it by +, -, comparisons,
    # %, fmod and ** (not by *, / and //)
    "half==2049": lambda s, q, kv: s.half() == 2049.0, "half<2049": lambda s, q, kv: s.half() < 2049,
    "half-2047.1": lambda s, q, kv: s.half() - 2047.1, "0.9+half": lambda s, q, kv: 0.9 + s.half(),
    "half%2047.1": lambda s, q, kv: s.half() % 2047.1,
    "fmod(half)": lambda s, q, kv: torch.fmod(s.half(), 1024.3),
    "half**1.0001": lambda s, q, kv: s.abs().half() ** 1.0001,
    "half*1.0005": lambda s, q, kv: s.half() * 1.0005, "half/0.9995": lambda s, q, kv: s.half() / 0.9995,
    "half//1024.3": lambda s, q, kv: s.half() // 1024.3,
    "bf16-255.1": lambda s, q, kv: s.bfloat16() - 255.1, "bf16>=257": lambda s, q, kv: s.bfloat16() >= 257.0,
}


@pytest.mark.parametrize("name", sorted(ARITHMETIC))
@given(score=st.one_of(st.sampled_from(FLOAT_EDGES + [2048.0, 256.0, 2049.0]),
                      st.floats(-1e4, 1e4, width=32)), q=INTS, kv=INTS)
def test_arithmetic_after_a_cast_matches_torch(name, score, q, kv):
    fn = ARITHMETIC[name]
    want, got = _eager_and_traced(lambda s, b, h, q_idx, kv_idx: fn(s, q_idx, kv_idx),
                                  score=score, q=q, kv=kv)
    _assert_same(want, got, f"{name} at score={score!r}, q={q}, kv={kv}")


def test_casts_are_not_no_ops():
    """Regression: .half() and .to(torch.int8) were no-ops (identity casts)."""
    traced = trace(lambda score, b, h, q_idx, kv_idx: score.half() + q_idx.to(torch.int8))
    assert Op.NARROW in [n.op for n in traced.root.toposort()]
    got = evaluate(traced, score=torch.tensor(1 + 3 * 2.0 ** -11), b=torch.tensor(0),
                   h=torch.tensor(0), q_idx=torch.tensor(200), kv_idx=torch.tensor(0))
    # 1 + 3 * 2**-11 rounds to 1 + 2**-9, 200 wraps to -56, their sum rounds in float16
    assert got.item() == -55.0


def test_storage_dtype_is_reported():
    seen = {}

    def mod(score, b, h, q_idx, kv_idx):
        seen.update(half=score.half().dtype, index=q_idx.dtype, byte=q_idx.byte().dtype,
                    score=score.dtype, mixed=(score.half() + score).dtype)
        return score

    trace(mod)
    assert seen == dict(half=torch.float16, index=torch.int64, byte=torch.uint8,
                        score=torch.float32, mixed=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64, torch.uint32])
def test_unsupported_cast_names_the_dtype(dtype):
    with pytest.raises(UnsupportedOpError, match=f"cast to {dtype} is not supported in mods; "
                                                 "supported: bool, int64, float32"):
        trace(lambda score, b, h, q_idx, kv_idx: score.to(dtype))


def test_narrow_float_to_int_follows_the_cpu():
    """NaN and values outside int32 become -2**31 before wrapping, as torch on x86."""
    values = torch.tensor([math.nan, 3e9, -3e9, 2147483520.0, -2.5, 300.7])
    for name, dtype in (("int32", torch.int32), ("int16", torch.int16), ("int8", torch.int8),
                        ("uint8", torch.uint8)):
        assert narrow(values, name).tolist() == values.to(dtype).tolist(), name


# captured tables of narrow integer types: torch keeps an element in the table's dtype, so
# arithmetic on it wraps there (the values sit on the wrapping edges of every type)
NARROW_TABLES = {dtype: torch.tensor(values, dtype=dtype) for dtype, values in (
    (torch.int8, [100, -100, 127, -128]), (torch.uint8, [200, 0, 255, 7]),
    (torch.int16, [30000, -30000, 32767, -32768]),
    (torch.int32, [2 ** 30, -2 ** 30, 2 ** 31 - 1, -2 ** 31]))}


@pytest.mark.parametrize("dtype", list(NARROW_TABLES), ids=str)
def test_arithmetic_on_a_captured_narrow_int_element_wraps_as_torch(dtype):
    """Regression: elements of captured int8 / uint8 / int16 / int32 tensors were computed on
    as int64, so t8[q_idx] + t8[kv_idx] did not wrap where torch's does."""
    table = NARROW_TABLES[dtype]

    def mod(score, b, h, q_idx, kv_idx):
        return (table[q_idx] + table[kv_idx]) * 3 - table[kv_idx] - 100 + (-table[q_idx])

    for q in range(4):
        for kv in range(4):
            want, got = _eager_and_traced(mod, q=q, kv=kv)
            _assert_same(want, got, f"{dtype} at q={q}, kv={kv}")
    seen = {}
    trace(lambda score, b, h, q_idx, kv_idx: seen.update(dtype=table[q_idx].dtype) or score)
    assert seen["dtype"] is dtype


@pytest.mark.parametrize("name,score", [
    ("half==2049", 2048.0), ("half<2049", 2048.0), ("half-2047.1", 2048.0),
    ("0.9+half", 2048.0), ("half%2047.1", 2048.0), ("fmod(half)", 2048.0),
    ("half*1.0005", 2048.0), ("half//1024.3", 2048.0), ("bf16-255.1", 256.0),
    ("bf16>=257", 256.0), ("char//200", 0.0), ("char==128", 0.0)])
def test_python_numbers_meet_narrow_values_as_in_torch(name, score):
    """Regression: Python numbers were not converted to the narrow operand's type (at 2048,
    float16 h == 2049.0 is True in torch: 2049.0 rounds to 2048; int8 -128 // 200 is 2)."""
    fn = ARITHMETIC[name]
    want, got = _eager_and_traced(lambda s, b, h, q_idx, kv_idx: fn(s, q_idx, kv_idx),
                                  score=score, q=128)
    _assert_same(want, got, f"{name} at score={score!r}")


@pytest.mark.parametrize("dtype", list(NARROW_TABLES), ids=str)
@pytest.mark.parametrize("form", ["where", "where left", "clamp max", "clamp min"])
def test_where_and_clamp_refuse_numbers_a_narrow_int_cannot_hold_as_torch(dtype, form):
    """torch.where and torch.clamp raise where a Python int does not fit the narrow int value
    beside it (torch: "value cannot be converted to type int8_t without overflow"); the
    kernels wrapped it (300 as 44 in int8). A number that fits still traces."""
    table = NARROW_TABLES[dtype]
    info = torch.iinfo(dtype)
    forms = {
        "where": lambda t, n, q, k: torch.where(q > k, t, n),
        "where left": lambda t, n, q, k: torch.where(q > k, n, t),
        "clamp max": lambda t, n, q, k: torch.clamp(t, max=n),
        "clamp min": lambda t, n, q, k: torch.clamp(t, min=n)}
    fn = forms[form]
    low = -info.max if info.min == 0 else info.min  # (uint8: -1 is taken, as 255)
    for number, fits in ((info.max + 1, False), (low - 1, False), (info.max, True),
                         (low, True)):
        with torch.no_grad():
            eager_fits = True
            try:
                fn(table, number, torch.tensor(1), torch.tensor(0))
            except RuntimeError:
                eager_fits = False
        assert eager_fits is fits, (number, "torch's behaviour changed")

        def mod(score, b, h, q_idx, kv_idx):
            return score + fn(table[q_idx % 4], number, q_idx, kv_idx)
        if fits:
            for q, kv in ((1, 0), (0, 1)):
                want, got = _eager_and_traced(mod, q=q, kv=kv)
                _assert_same(want, got, f"{form} {dtype} {number} at q={q}")
        else:
            with pytest.raises(TraceError, match="value cannot be converted"):
                trace(mod)


@pytest.mark.parametrize("cast", ["half", "bfloat16"])
@pytest.mark.parametrize("form", ["clamp max", "clamp min", "clamp_max", "clip", "method"])
def test_clamp_refuses_numbers_past_a_half_values_range_as_torch(cast, form):
    """Regression: torch.clamp of a float16 / bfloat16 value with a finite bound past the
    type's range (1e5 beside float16) raises in torch ("value cannot be converted to type
    c10::Half without overflow"); flexfa computed it. Bounds within the range, +-inf and
    NaN still trace and equal torch; torch.where rounds such a number to inf, as flexfa."""
    dtype = "float16" if cast == "half" else cast
    top = torch.finfo(getattr(torch, dtype)).max
    forms = {
        "clamp max": lambda x, n: torch.clamp(x, max=n),
        "clamp min": lambda x, n: torch.clamp(x, min=-n),
        "clamp_max": lambda x, n: torch.clamp_max(x, n),
        "clip": lambda x, n: torch.clip(x, -n, n),
        "method": lambda x, n: x.clamp(max=n)}
    fn = forms[form]
    cases = [(top, True), (top * (1 + 2 ** -20), False), (1e39, False), (math.inf, True),
             (math.nan, True)] + ([(int(top) + 1, False)] if cast == "half" else [])
    for number, fits in cases:
        with torch.no_grad():
            eager_fits = True
            try:
                fn(getattr(torch.tensor(1.0), cast)(), number)
            except RuntimeError:
                eager_fits = False
        assert eager_fits is fits, (number, "torch's behaviour changed")

        def mod(score, b, h, q_idx, kv_idx):
            return fn(getattr(score, cast)(), number)
        if fits:
            for score in (3.0, 7e4, -7e4, math.inf, -3e38):
                want, got = _eager_and_traced(mod, score=score)
                _assert_same(want, got, f"{form} {cast} {number} at {score}")
        else:
            with pytest.raises(TraceError, match=f"beside a torch.{dtype} value.*cannot be conv"):
                trace(mod)
    # torch.where takes the number (rounded to inf); a float32 value takes 1e5, not 1e39
    for mod in (lambda s, b, h, q, kv: torch.where(q > kv, 1e39, getattr(s, cast)()),
                lambda s, b, h, q, kv: torch.clamp(s, max=1e5)):
        want, got = _eager_and_traced(mod, score=7e4, q=1)
        _assert_same(want, got, f"{cast} where / float32 clamp")
    with pytest.raises(TraceError, match="beside a torch.float32 value.*cannot be conv"):
        trace(lambda s, b, h, q, kv: torch.clamp(s, max=1e39))
