"""flexfa.mods: every ready mod against a hand-written dense formula and torch's create_mask."""
import math

import pytest
import torch
from hypothesis import given, strategies as st
from torch.nn.attention.flex_attention import create_mask

import flexfa
from flexfa import mods
from flexfa.frontend import dense_mask, evaluate, index_grids, trace
from flexfa.errors import InputError, InputTypeError
from flexfa.reference import attention_reference

SHAPES = [(36, 36), (100, 100), (37, 100)]  # L x S, not tile multiples, L != S


def grids(L, S, H=2):
    q = torch.arange(L).view(L, 1)
    kv = torch.arange(S).view(1, S)
    return q, kv


def check_mask(mod, expected, L, S, H=2):
    """flexfa's trace, a direct call and torch's create_mask all equal the formula."""
    want = expected.expand(1, H, L, S)
    got = dense_mask(trace(mod), 1, H, L, S)
    assert torch.equal(got, want), f"{mod.__name__}: traced mask differs from the formula"
    torch_mask = create_mask(mod, 1, H, L, S, device="cpu")
    assert torch.equal(torch_mask, want), f"{mod.__name__}: torch create_mask differs"


# ---- mask_mods -------------------------------------------------------------------------------

@pytest.mark.parametrize("L,S", SHAPES)
def test_causal(L, S):
    q, kv = grids(L, S)
    check_mask(mods.causal, q >= kv, L, S)
    assert mods.causal.__name__ == "causal"


@pytest.mark.parametrize("L,S", SHAPES)
def test_sliding_window(L, S):
    q, kv = grids(L, S)
    check_mask(mods.sliding_window(7), (q - kv >= 0) & (q - kv <= 6), L, S)
    check_mask(mods.sliding_window(7, causal=False), (q - kv).abs() <= 6, L, S)


@given(window=st.integers(1, 120), L=st.integers(1, 120), S=st.integers(1, 120))
def test_sliding_window_any_size(window, L, S):
    q, kv = grids(L, S)
    want = ((q - kv >= 0) & (q - kv < window)).expand(1, 1, L, S)
    assert torch.equal(dense_mask(trace(mods.sliding_window(window)), 1, 1, L, S), want)


@pytest.mark.parametrize("L,S", SHAPES)
def test_prefix_lm(L, S):
    q, kv = grids(L, S)
    check_mask(mods.prefix_lm(10), (kv < 10) | (q >= kv), L, S)
    check_mask(mods.prefix_lm(0), (q >= kv).expand(L, S), L, S)


def test_document_offsets_and_lengths_agree():
    by_lengths = mods.document([3, 10, 23])
    by_offsets = mods.document([0, 3, 13, 36])
    by_tensor = mods.document(torch.tensor([0, 3, 13, 36]))
    want = torch.tensor([0] * 3 + [1] * 10 + [2] * 23, dtype=torch.int32)
    for mod in (by_lengths, by_offsets, by_tensor):
        assert torch.equal(mod.doc_ids, want)
        assert mod.__name__ == "document_3"


def test_document_mask_and_causal_combination():
    L = S = 100
    lengths = [30, 1, 45, 24]
    mod = mods.document(lengths)
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    q, kv = grids(L, S)
    same = doc.view(L, 1) == doc.view(1, S)
    check_mask(mod, same, L, S)

    def packed_causal(b, h, q_idx, kv_idx):
        return mod(b, h, q_idx, kv_idx) & mods.causal(b, h, q_idx, kv_idx)
    check_mask(packed_causal, same & (q >= kv), L, S)


def test_document_empty_document_in_offsets():
    mod = mods.document([0, 4, 4, 9])  # an empty middle document
    assert mod.doc_ids.tolist() == [0, 0, 0, 0, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("L,S", SHAPES)
def test_dilated_window(L, S):
    q, kv = grids(L, S)
    d = q - kv
    check_mask(mods.dilated_window(5, 3), (d >= 0) & (d < 15) & (d % 3 == 0), L, S)


@pytest.mark.parametrize("L,S", [(100, 100), (37, 100)])
def test_global_sliding(L, S):
    flags = torch.zeros(100, dtype=torch.bool)
    flags[[0, 17, 60]] = True
    q, kv = grids(L, S)
    g = flags[:L].view(L, 1) | flags[:S].view(1, S)
    check_mask(mods.global_sliding(4, flags), (q >= kv) & ((q - kv < 4) | g), L, S)
    check_mask(mods.global_sliding(4, flags, causal=False), ((q - kv).abs() < 4) | g, L, S)
    assert torch.equal(mods.global_sliding(4, flags).is_global, flags)


def natten_formula(width, height, kernel, n):
    """Loop over the grid: the kernel x kernel window of each query, shifted inside the grid."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    r = kernel // 2
    for i in range(n):
        qx, qy = i % width, i // width
        x0 = min(max(qx - r, 0), width - kernel)
        y0 = min(max(qy - r, 0), height - kernel)
        for y in range(y0, y0 + kernel):
            for x in range(x0, x0 + kernel):
                if y * width + x < n:
                    mask[i, y * width + x] = True
    return mask


@pytest.mark.parametrize("width,height,kernel", [(10, 10, 3), (8, 5, 5), (12, 8, 1)])
def test_natten_2d(width, height, kernel):
    n = width * height
    mod = mods.natten_2d(width, height, kernel)
    check_mask(mod, natten_formula(width, height, kernel, n), n, n)
    assert mod.__name__ == f"natten_2d_{width}x{height}_k{kernel}"
    rows = dense_mask(trace(mod), 1, 1, n, n)[0, 0].sum(dim=1)
    assert (rows == kernel * kernel).all(), "every query sees exactly kernel**2 keys"


@pytest.mark.parametrize("L,S", SHAPES)
def test_chunked(L, S):
    q, kv = grids(L, S)
    check_mask(mods.chunked(16), q // 16 == kv // 16, L, S)
    check_mask(mods.chunked(16, causal=True), (q // 16 == kv // 16) & (q >= kv), L, S)


# ---- score_mods ------------------------------------------------------------------------------

def check_score_mod(mod, expected_fn, L, S, H, buffers=None):
    """Traced-then-evaluated and a direct call on index grids equal the formula."""
    torch.manual_seed(0)
    score = torch.randn(1, H, L, S, dtype=torch.float64)
    b, h, q, kv = index_grids(1, H, L, S)
    want = expected_fn(score, h, q, kv)
    got = evaluate(trace(mod), score=score, b=b, h=h, q_idx=q, kv_idx=kv,
                   float_dtype=torch.float64)
    torch.testing.assert_close(got, want.expand_as(got), rtol=1e-6, atol=1e-6)
    direct = mod(score, b, h, q, kv)
    torch.testing.assert_close(direct.double(), want.expand_as(direct).double(),
                               rtol=1e-6, atol=1e-6)


def test_alibi_slopes_standard_values():
    assert mods.alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    six = mods.alibi_slopes(6).tolist()  # 4 from n=4, then every other of n=8
    assert six == pytest.approx([0.25, 0.0625, 2 ** -6, 2 ** -8, 0.5, 0.125])
    assert len(mods.alibi_slopes(12)) == 12


def test_alibi_names_its_slopes_rule_and_slopes_errors_name_alibi_slopes():
    """An audit's finds: alibi(6)'s docstring gave 2^(-8(i+1)/n) for every head count (not
    the slopes it uses past a power of two), and alibi_slopes' errors said "alibi:"; and
    document_ids, public and documented, was missing from __all__."""
    assert "2^(-8(i+1)/8)" in mods.alibi(8).__doc__
    six = mods.alibi(6).__doc__
    assert "2^(-8(i+1)/4) for i < 4, then every other slope of 8" in six
    with pytest.raises(InputError, match=r"^alibi_slopes: num_heads must be >= 1"):
        mods.alibi_slopes(0)
    assert "document_ids" in mods.__all__


@pytest.mark.parametrize("heads", [1, 4, 6])
def test_alibi(heads):
    mod = mods.alibi(heads)
    slopes = mods.alibi_slopes(heads).double()
    check_score_mod(mod, lambda s, h, q, kv: s - slopes[h] * (q - kv).abs(), 37, 100, heads)
    assert mod.__name__ == f"alibi_{heads}"
    assert "slopes" in mod.__doc__


@pytest.mark.parametrize("cap,name", [(30.0, "softcap_30"), (2.5, "softcap_2p5")])
def test_softcap(cap, name):
    mod = mods.softcap(cap)
    check_score_mod(mod, lambda s, h, q, kv: cap * torch.tanh(s / cap), 36, 36, 2)
    assert mod.__name__ == name


def test_relative_bias_shared_table():
    table = torch.randn(41, dtype=torch.float64)
    mod = mods.relative_bias(table)

    def formula(s, h, q, kv):
        return s + table[(q - kv + 20).clamp(0, 40)]
    check_score_mod(mod, formula, 37, 100, 2)
    assert mod.table is table and mod.offset == 20


def test_relative_bias_per_head_and_gradient():
    L, S, H = 20, 30, 3
    table = torch.randn(H, 49, dtype=torch.float64, requires_grad=True)
    mod = mods.relative_bias(table, offset=29)
    traced = trace(mod)
    assert traced.grad_buffers == (0,), "a table that requires grad is a gradient buffer"
    b, h, q, kv = index_grids(1, H, L, S)
    weights = torch.randn(1, H, L, S, dtype=torch.float64)
    out = evaluate(traced, score=torch.zeros(1, H, L, S, dtype=torch.float64), b=b, h=h,
                   q_idx=q, kv_idx=kv, float_dtype=torch.float64)
    (grad,) = torch.autograd.grad((out * weights).sum(), table)
    want = torch.zeros_like(table)  # scatter each score's weight into its table entry
    for hh in range(H):
        for i in range(L):
            for j in range(S):
                want[hh, min(max(i - j + 29, 0), 48)] += weights[0, hh, i, j]
    torch.testing.assert_close(grad, want)


# ---- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("make,words", [
    (lambda: mods.sliding_window(0), "window"),
    (lambda: mods.prefix_lm(-1), "prefix_length"),
    (lambda: mods.document([3, 0, 2]), "lengths"),
    (lambda: mods.document([0, 5, 3]), "non-decreasing"),
    (lambda: mods.document([]), "offsets_or_lengths"),
    (lambda: mods.dilated_window(4, 0), "dilation"),
    (lambda: mods.natten_2d(8, 8, 4), "odd"),
    (lambda: mods.natten_2d(8, 4, 5), "kernel"),
    (lambda: mods.chunked(0), "chunk_size"),
    (lambda: mods.alibi(0), "num_heads"),
    (lambda: mods.softcap(-1.0), "cap"),
    (lambda: mods.softcap(float("inf")), "cap"),
    (lambda: mods.relative_bias(torch.zeros(2, 3, 4)), "shape"),
    (lambda: mods.relative_bias(torch.zeros(0, 5)), "H, R >= 1"),  # was an error at the call
    # a list of 2**40 slopes was built until memory ran out; devices failed inside torch
    (lambda: mods.alibi(2 ** 40), "num_heads must be at most"),
    (lambda: mods.alibi(4, device="nope"), "alibi: device='nope' is not a torch device"),
    (lambda: mods.document([0, 3, 5], device="nope"), "document: device='nope'"),
    (lambda: mods.global_sliding(4, [True], device=7.5), "global_sliding: device=7.5"),
])
def test_bad_arguments_raise_value_error(make, words):
    with pytest.raises(ValueError, match=words):
        make()


@pytest.mark.parametrize("make", [
    lambda: mods.sliding_window(2.5),
    lambda: mods.chunked(True),
    lambda: mods.global_sliding(4, torch.zeros(10, dtype=torch.long)),
    lambda: mods.relative_bias([1.0, 2.0]),
    lambda: mods.relative_bias(torch.zeros(5, dtype=torch.long)),  # a dtype, not a value
    lambda: mods.document([1.5, 2.0]),
    lambda: mods.sliding_window(4, causal=1),
    lambda: mods.global_sliding(4, torch.ones(4, dtype=torch.bool), causal="no"),
    lambda: mods.chunked(4, causal=None),
])
def test_wrong_types_raise_type_error(make):
    with pytest.raises(TypeError):
        make()


@pytest.mark.parametrize("make,error,message", [
    # offsets that are no sequence of ints failed inside torch (a str, None, a list of str, an
    # int past int64) or were cast (complex), a meta tensor failed reading its values
    (lambda: mods.document("abc"), InputTypeError,
     "document: offsets_or_lengths must be a 1-d sequence of ints, got str 'abc'"),
    (lambda: mods.document(None), InputTypeError, "offsets_or_lengths must be a 1-d sequence"),
    (lambda: mods.document(["0", "3"]), InputTypeError, "offsets_or_lengths must be a 1-d"),
    (lambda: mods.document([0, 2 ** 64]), InputTypeError, "offsets_or_lengths must be a 1-d"),
    (lambda: mods.document(torch.tensor([0, 3], dtype=torch.complex64)), InputTypeError,
     "offsets_or_lengths must hold integers, got torch.complex64"),
    (lambda: mods.document(torch.tensor([0, 3], device="meta")), InputError,
     "offsets_or_lengths is a meta tensor"),
    (lambda: mods.document(torch.tensor([0, 2 ** 63], dtype=torch.uint64)), InputError,
     r"holds uint64 values past int64: \[0, 9223372036854775808\]"),  # was read as negative
    (lambda: mods.global_sliding(4, None), InputTypeError,
     "global_sliding: is_global must be a 1-d sequence of bools"),
    # past int32 no position reaches: an allocation of 2**62 tokens, or torch's overflow
    (lambda: mods.document([0, 2 ** 62]), InputError,
     r"offsets_or_lengths must be at most 2147483647 .*\[0, 4611686018427387904\]"),
    # per-token ids were read as offsets of empty and 1-token documents: the mask failed
    # later with an index out of bounds that did not say why
    (lambda: mods.document([0, 0, 0, 1, 1, 2]), InputError,
     r"looks like per-token document ids .* pass the lengths \[3, 2, 1\] or the offsets "
     r"\[0, 3, 5, 6\]"),
    (lambda: mods.document(torch.tensor([0, 0, 1, 1, 1, 2])), InputError,
     r"read as offsets \(cu_seqlens\), but it looks like per-token document ids"),
    # ints past int64 failed in torch when the mod ran, ones past int32 reach no position
    (lambda: mods.sliding_window(2 ** 63), InputError,
     "sliding_window: window must be at most 2147483647 .*got 9223372036854775808"),
    (lambda: mods.sliding_window(2 ** 31, causal=False), InputError, "window must be at most"),
    (lambda: mods.prefix_lm(2 ** 70), InputError, "prefix_lm: prefix_length must be at most"),
    (lambda: mods.dilated_window(2 ** 40, 2), InputError, "dilated_window: window must be at"),
    (lambda: mods.dilated_window(2, 2 ** 63), InputError, "dilated_window: dilation must be at"),
    (lambda: mods.global_sliding(2 ** 63, [True]), InputError, "global_sliding: window must be"),
    (lambda: mods.natten_2d(2 ** 40, 8, 3), InputError, "natten_2d: width must be at most"),
    (lambda: mods.chunked(2 ** 63), InputError, "chunked: chunk_size must be at most"),
    (lambda: mods.relative_bias(torch.zeros(5), offset=2 ** 63 - 1), InputError,
     "relative_bias: offset must be at most"),
    # a cap past float32 is inf in the float32 scores: every output was NaN (torch's too)
    (lambda: mods.softcap(1e39), InputError, "softcap: cap must be within float32's normal "
                                             r"range \(1.17549e-38 .. 3.40282e\+38\).*got 1e\+39"),
    (lambda: mods.softcap(1e-300), InputError, "softcap: cap must be within float32's"),
])
def test_bad_offsets_and_sizes_fail_at_the_factory(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_documents_past_the_longest_sequence_are_refused(monkeypatch):
    """[2**31 - 1, 2] built 2**31 ids (16 GiB) for a mask no kernel can index (a smaller
    bound stands in for int32's here)."""
    monkeypatch.setattr(mods, "MAX_SIZE", 100)
    with pytest.raises(InputError, match="the documents hold 120 tokens; at most 100"):
        mods.document([60, 60])
    assert mods.document([0, 60, 100]).doc_ids.numel() == 100


def test_offsets_with_empty_documents_are_still_offsets():
    """Only offsets stepping by 0 and 1 alone read as per-token ids: real cu_seqlens with
    empty documents (padding) and the largest sizes are accepted."""
    assert mods.document([0, 3, 3, 7]).doc_ids.tolist() == [0, 0, 0, 2, 2, 2, 2]
    assert mods.document([0, 1, 2]).doc_ids.tolist() == [0, 1]
    assert mods.sliding_window(2 ** 31 - 1).__name__ == "sliding_window_2147483647"
    numpy = pytest.importorskip("numpy")
    assert mods.sliding_window(numpy.int64(4), causal=numpy.True_).__name__ == "sliding_window_4"


@pytest.mark.parametrize("make,name", [
    (lambda: mods.sliding_window(4, causal=1), "sliding_window: causal"),
    (lambda: mods.global_sliding(4, torch.ones(4, dtype=torch.bool), causal="no"),
     "global_sliding: causal"),
    (lambda: mods.chunked(4, causal=None), "chunked: causal"),
])
def test_causal_flags_must_be_bools(make, name):
    """causal=1, "no" or None is refused by name (it was read by truthiness: "no" was causal)."""
    with pytest.raises(InputTypeError, match=f"{name} must be a bool"):
        make()


def test_every_factory_names_and_documents_its_mod():
    made = [mods.causal, mods.sliding_window(1024), mods.prefix_lm(8), mods.document([4, 4]),
            mods.alibi(8), mods.softcap(30), mods.relative_bias(torch.zeros(9)),
            mods.dilated_window(8, 2), mods.global_sliding(8, torch.ones(4, dtype=torch.bool)),
            mods.natten_2d(4, 4, 3), mods.chunked(64)]
    names = [m.__name__ for m in made]
    assert names[1] == "sliding_window_1024"
    assert len(set(names)) == len(names)
    for mod in made:
        assert mod.__doc__ and mod.__name__.isidentifier()
        assert trace(mod).name == mod.__name__
    assert math.isclose(float(mods.alibi(8).slopes[0]), 0.5)


def test_names_differ_whenever_the_formula_does():
    """Six significant digits named softcap(30.0) and softcap(30.0000001) alike (and
    1234567.0 / 1234567.5); relative_bias's offset was not in its name; a trailing empty
    document of cu_seqlens was not counted."""
    table = torch.zeros(9)
    pairs = [(mods.softcap(30.0), mods.softcap(30.0000001)),
             (mods.softcap(1234567.0), mods.softcap(1234567.5)),
             (mods.relative_bias(table), mods.relative_bias(table, offset=0))]
    for one, other in pairs:
        assert one.__name__ != other.__name__ and other.__name__.isidentifier(), other.__name__
    assert mods.softcap(30.0).__name__ == "softcap_30"
    assert mods.relative_bias(table, offset=4).__name__ == "relative_bias_9"
    assert mods.relative_bias(table, offset=0).__name__ == "relative_bias_9_offset0"
    assert [mods.document(d).__name__ for d in ([0, 3, 3], [0, 0, 3], [3, 4])] == \
        ["document_2", "document_2", "document_2"]


# ---- through the kernels -----------------------------------------------------------------------

KERNEL_CASES = [
    (None, mods.causal), (None, mods.sliding_window(24)), (None, mods.prefix_lm(20)),
    (None, flexfa.and_masks(mods.document([30, 50, 20]), mods.causal)),
    (None, mods.dilated_window(8, 3)), (None, mods.natten_2d(10, 10, 5)),
    (None, mods.global_sliding(10, torch.arange(100) % 37 == 0)), (None, mods.chunked(32)),
    (mods.alibi(2), mods.causal), (mods.softcap(5.0), None),
    (mods.relative_bias(torch.randn(2, 199)), None),
]


@pytest.mark.parametrize("score_mod,mask_mod", KERNEL_CASES,
                         ids=lambda m: getattr(m, "__name__", "none"))
def test_ready_mods_run_through_flex_attention(score_mod, mask_mod):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 16) for _ in range(3))
    block_mask = None if mask_mod is None else flexfa.create_block_mask(
        mask_mod, None, None, 100, 100, device="cpu", BLOCK_SIZE=32)
    out = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    want = attention_reference(q, k, v, score_mod, mask_mod)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)


def test_factories_one_after_another_and_captured_tensors_edited_in_place():
    """Kernels are cached by the mods' structure: each factory call, and each in-place edit of
    a tensor a mod captured, gives that call's own result."""
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))

    def check(score_mod=None, mask_mod=None):
        block_mask = None if mask_mod is None else flexfa.create_block_mask(
            mask_mod, None, None, 70, 70, device="cpu", BLOCK_SIZE=32)
        out = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
        want = attention_reference(q, k, v, score_mod, mask_mod)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)

    for window in (8, 16, 8):
        check(mask_mod=mods.sliding_window(window))
    documents = mods.document([10, 30, 30])
    check(mask_mod=documents)
    documents.doc_ids.copy_(mods.document_ids([35, 35]))
    check(mask_mod=documents)
    flags = torch.zeros(70, dtype=torch.bool)
    window = mods.global_sliding(4, flags)
    check(mask_mod=window)
    window.is_global[40] = True
    check(mask_mod=window)
    alibi = mods.alibi(2)
    check(score_mod=alibi)
    alibi.slopes.mul_(4)
    check(score_mod=alibi)
    bias = mods.relative_bias(torch.randn(2, 139))
    check(score_mod=bias)
    bias.table.mul_(3)
    check(score_mod=bias)
