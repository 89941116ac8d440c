"""Input layouts, degenerate shapes and autograd plumbing of the public entry points.

Layouts the kernels read through strides (slices with storage offsets, a last dim of stride
2, stride-0 expanded dims, overlapping ``as_strided`` views, permuted memory) must give the
contiguous call's values, and their gradients must reach the tensor the view was made of
(autograd sums an expanded input's). References: the float64 reference for gradients (torch's
eager flex_attention has no CPU backward), bitwise equality with the contiguous call where
the kernels see the same values. Also: forward-only entry points refusing inputs that require
grad, offsets inside a head past int32 (layouts whose rows lie far apart), torch.autocast.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.errors import InputError
from flexfa.runtime.layout import HEAD_OFFSET_LIMIT, int32_addressable, int32_addressable_inputs
from reference import assert_close_to_reference, reference_pair

B, H, L, S, E = 2, 2, 20, 12, 8


def _views():
    """name -> (bases, make): ``make(bases)`` gives q, k, v as views of the bases."""
    def sliced(n):
        return lambda t: t[1:, 1:, 3:3 + n, 2:2 + E]

    def overlapping(n):  # rows and heads overlap in memory
        return lambda t: t.as_strided((B, H, n, E), (3, 5, 1, 1), 7)

    def same(make_q, make_kv):
        return make_q, make_kv, make_kv
    return {
        "sliced": ([(B + 1, H + 1, L + 3, E + 4), (B + 1, H + 1, S + 3, E + 4)],
                   same(sliced(L), sliced(S))),
        "last_dim_stride_2": ([(B, H, L, 2 * E), (B, H, S, 2 * E)],
                              same(lambda t: t[..., ::2], lambda t: t[..., ::2])),
        "expanded_batch_and_heads": ([(1, 1, L, E), (1, 1, S, E)],
                                     same(lambda t: t.expand(B, H, L, E),
                                          lambda t: t.expand(B, H, S, E))),
        "expanded_rows": ([(B, H, 1, E), (B, H, 1, E)],
                          same(lambda t: t.expand(B, H, L, E), lambda t: t.expand(B, H, S, E))),
        "expanded_head_dim": ([(B, H, L, 1), (B, H, S, 1)],
                              same(lambda t: t.expand(B, H, L, E),
                                   lambda t: t.expand(B, H, S, E))),
        "overlapping": ([(300,), (300,)], same(overlapping(L), overlapping(S))),
        "permuted": ([(L, B, H, E), (S, B, H, E)],
                     same(lambda t: t.permute(1, 2, 0, 3), lambda t: t.permute(1, 2, 0, 3))),
    }


VIEWS = _views()


@pytest.mark.parametrize("name", list(VIEWS))
def test_strided_views_give_the_reference_values_and_gradients(name):
    (q_shape, kv_shape), (make_q, make_k, make_v) = VIEWS[name]
    generator = torch.Generator().manual_seed(0)
    bases = [torch.randn(shape, generator=generator, requires_grad=True)
             for shape in (q_shape, kv_shape, kv_shape)]
    q, k, v = make_q(bases[0]), make_k(bases[1]), make_v(bases[2])
    grad_out = torch.randn(B, H, L, E, generator=generator)
    out = flexfa.flex_attention(q, k, v)
    got = torch.autograd.grad(out, bases, grad_out)
    contiguous = flexfa.flex_attention(*(t.detach().contiguous() for t in (q, k, v)))
    assert torch.equal(out, contiguous)
    (out64, _), (ref, _) = reference_pair(q, k, v)
    assert_close_to_reference(out, out64, ref)
    want64 = torch.autograd.grad(out64, bases, grad_out.double())
    want = torch.autograd.grad(ref, bases, grad_out.to(ref.dtype))
    for g, w64, w in zip(got, want64, want):
        assert g.shape == w64.shape
        assert_close_to_reference(g, w64, w)


# ---- forward-only entry points --------------------------------------------------------------

@pytest.mark.parametrize("needing", ["query", "key", "value", "sinks", "a score_mod captured"])
def test_flex_decode_refuses_inputs_that_require_grad(needing):
    """flex_decode has no backward: an input that requires grad would silently get no
    gradient from its output (a loss adding it to other terms gave no error); refused, as
    flexfa.fp8's forward refuses them. Under no_grad the same call runs."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(shape, generator=generator)
               for shape in ((1, 2, 3, E), (1, 2, S, E), (1, 2, S, E)))
    tensors = {"query": q, "key": k, "value": v, "sinks": torch.zeros(2),
               "a score_mod captured": torch.zeros(2)}
    tensors[needing] = tensors[needing].clone().requires_grad_()
    bias = tensors["a score_mod captured"]

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    args = (tensors["query"], tensors["key"], tensors["value"], head_bias)
    with pytest.raises(InputError, match=f"flex_decode is inference only.*{needing}.* requires "
                                         "grad"):
        flexfa.flex_decode(*args, sinks=tensors["sinks"])
    with torch.no_grad():
        out = flexfa.flex_decode(*args, sinks=tensors["sinks"])
    want = flexfa.flex_attention(*(t.detach() for t in args[:3]), head_bias,
                                 sinks=tensors["sinks"].detach())
    torch.testing.assert_close(out, want.detach(), atol=1e-5, rtol=1e-5)


# ---- offsets inside a head past int32 ---------------------------------------------------------

# 17 rows 2**27 elements apart: the last row's offset is 2**31, which wraps in int32 (the
# kernels read 4 GiB before the tensor: a segfault under the interpreter, elsewhere on a GPU).
# The views share one 4 GiB float16 storage that is never written but for their rows, so
# only those pages are backed; the contiguous call is the reference, bit for bit.
_WIDE_ROWS = textwrap.dedent("""
    import torch, flexfa
    from flexfa.runtime.families.fp8 import quantize_rows
    from flexfa.runtime.layout import output_like
    rows, stride, E = 17, 2 ** 27, 8
    try:
        storage = torch.empty((rows - 1) * stride + 5 * E, dtype=torch.float16)
    except (RuntimeError, MemoryError):
        print("no memory"); raise SystemExit
    def wide(slot):  # [1, 1, rows, E], rows `stride` apart, its own columns of the storage
        t = storage.as_strided((1, 1, rows, E), (0, 0, stride, 1), slot * E)
        return t.copy_(torch.randn(1, 1, rows, E, dtype=torch.float16))
    q, k, v, grad_out = (wide(slot) for slot in range(4))
    def check(name, got, want):
        assert all(torch.equal(a, b) for a, b in zip(got, want)), name
    def attention(*tensors):
        leaves = [t.detach().requires_grad_() for t in tensors[:3]]
        out = flexfa.flex_attention(*leaves)
        assert out.stride() == output_like(tensors[0], E).stride()  # torch's layout
        return (out, *torch.autograd.grad(out, leaves, tensors[3]))
    dense = [t.contiguous() for t in (q, k, v, grad_out)]
    check("flex_attention", attention(q, k, v, grad_out), attention(*dense))
    check("flex_attention, grad_out", attention(*dense[:3], grad_out), attention(*dense))
    check("flex_decode", [flexfa.flex_decode(q[:, :, :4], k, v)],
          [flexfa.flex_decode(*(t.contiguous() for t in (q[:, :, :4], k, v)))])
    def quantized(x):
        out = torch.empty(1, 1, rows, E, dtype=torch.float8_e4m3fn)
        return quantize_rows(x, 16, None, out), out.view(torch.uint8)
    check("fp8 quantize", quantized(q), quantized(q.contiguous()))
    print("ok")
""")


def test_offsets_inside_a_head_past_int32_give_the_contiguous_results(tmp_path):
    """q, k, v, grad_out (and flex_decode's cache, the FP8 quantizer's input) whose rows lie
    2**27 elements apart: the kernels get contiguous copies (run in a subprocess: the
    unfixed kernels crash it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(flexfa.__file__)),
                      os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", _WIDE_ROWS], capture_output=True, text=True,
                            env=env, timeout=600)
    if result.stdout.strip() == "no memory":
        pytest.skip("no 4 GiB of address space for the storage")
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        result.returncode, result.stderr[-2000:])


def _meta(shape, strides):
    return torch.empty_strided(shape, strides, dtype=torch.bfloat16, device="meta")


def test_which_layouts_need_the_copy():
    """The check reads shapes and strides only (meta tensors of real sizes): a [B, L, H, E]
    layout seen as [B, H, L, E] needs it at L * H * E >= 2**31, a contiguous one or an
    expanded one (stride 0) of the same shape does not; a head of 2**31 elements or more is
    an InputError even contiguous; the output laid out as the query's counts too."""
    B, H, L, E = 1, 32, 2 ** 19, 128
    bshd = _meta((B, H, L, E), (L * H * E, E, H * E, 1))
    assert int32_addressable(bshd, "query") is not bshd
    half = bshd[:, :, :L - 1]  # one row less: 2**31 - 4096 elements
    assert int32_addressable(half, "query") is half
    contiguous = _meta((B, H, L, E), (H * L * E, L * E, E, 1))
    expanded = _meta((B, H, L, E), (0, 0, 0, 1))
    assert int32_addressable(contiguous, "query") is contiguous
    assert int32_addressable(expanded, "query") is expanded
    assert int32_addressable_inputs(contiguous, contiguous, contiguous) is None
    narrow = int32_addressable_inputs(bshd, contiguous, expanded)
    assert narrow[0].is_contiguous() and narrow[1] is contiguous and narrow[2] is expanded
    # a query that fits whose output (Ev = 2 E, rows H * Ev apart) does not
    q = _meta((B, H, L // 2, E), (L // 2 * H * E, E, H * E, 1))
    v = _meta((B, H, 16, 2 * E), (0, 0, 0, 1))
    assert int32_addressable(q, "query") is q
    assert int32_addressable_inputs(q, v[..., :E], v)[0].is_contiguous()
    with pytest.raises(InputError, match=r"key has 16777216 rows of 128 per head"):
        int32_addressable(_meta((1, 1, HEAD_OFFSET_LIMIT // E, E), (0, 0, E, 1)), "key")


# ---- torch.autocast ---------------------------------------------------------------------------

def torch_flex_attention(*args, **kwargs):
    import warnings

    from torch.nn.attention.flex_attention import flex_attention as torch_flex
    with warnings.catch_warnings():  # "called without torch.compile": expected here
        warnings.simplefilter("ignore")
        return torch_flex(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_query_key_value_as_torch_does(dtype):
    """torch's flex_attention casts q, k, v to the autocast dtype (its Autocast rule): out in
    that dtype, mixed input dtypes taken; flexfa computed in float32 (out float32) and
    refused a bf16 query with float32 key and value. The casts carry the gradients back to
    the float32 leaves."""
    generator = torch.Generator().manual_seed(2)
    leaves = [torch.randn(shape, generator=generator, requires_grad=True)
              for shape in ((1, 2, L, E), (1, 2, S, E), (1, 2, S, E))]
    grad_out = torch.randn(1, 2, L, E, generator=generator).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        out = flexfa.flex_attention(*leaves)
        mixed = flexfa.flex_attention(leaves[0].to(dtype), *leaves[1:])
        want_torch = torch_flex_attention(*(t.detach() for t in leaves))
    assert out.dtype == want_torch.dtype == dtype
    torch.testing.assert_close(out, want_torch, atol=2e-2, rtol=2e-2)
    got = torch.autograd.grad(out, leaves, grad_out)
    cast = [t.detach().to(dtype).requires_grad_() for t in leaves]
    want = flexfa.flex_attention(*cast)
    assert torch.equal(out, want) and torch.equal(mixed, want)
    for g, w in zip(got, torch.autograd.grad(want, cast, grad_out)):
        assert g.dtype == torch.float32 and torch.equal(g, w.float())
    with torch.autocast("cpu", dtype=dtype, enabled=False):
        assert flexfa.flex_attention(*leaves).dtype == torch.float32


def test_autocast_inside_torch_compile():
    """The flexfa::flex_attention operator has no autocast rule of its own: the compiled
    call casts q, k, v as the eager one does, gradients included."""
    generator = torch.Generator().manual_seed(3)
    leaves = [torch.randn(shape, generator=generator, requires_grad=True)
              for shape in ((1, 2, L, E), (1, 2, S, E), (1, 2, S, E))]
    compiled = torch.compile(flexfa.flex_attention, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(*leaves)
        want = flexfa.flex_attention(*leaves)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    grads = torch.autograd.grad(got.float().sum(), leaves)
    for g, w in zip(grads, torch.autograd.grad(want.float().sum(), leaves)):
        assert g.dtype == torch.float32 and torch.equal(g, w)


def test_flex_decode_follows_autocast_as_flex_attention():
    """flex_decode casts query, key and value to the autocast dtype as flex_attention does:
    it ran float32 under a bf16 autocast, and refused a float32 query (computed outside the
    autocast) against a bf16 cache with a dtype error. Eager, compiled and through a
    PagedKVCache; outside the autocast, float32 again."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(B, H, 3, E, generator=generator)
    k, v = (torch.randn(B, H, S, E, generator=generator) for _ in range(2))
    lens = torch.tensor([S, 7], dtype=torch.int32)
    want = flexfa.flex_decode(*(t.bfloat16() for t in (q, k, v)), mods.alibi(H), kv_lens=lens)
    compiled = torch.compile(flexfa.flex_decode, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = flexfa.flex_decode(q, k, v, mods.alibi(H), kv_lens=lens)
        mixed = flexfa.flex_decode(q, k.bfloat16(), v.bfloat16(), mods.alibi(H), kv_lens=lens)
        got_compiled = compiled(q, k, v, mods.alibi(H), kv_lens=lens)
    assert got.dtype == mixed.dtype == got_compiled.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(mixed, want)
    assert torch.equal(got_compiled, want)
    cache = flexfa.PagedKVCache(num_pages=2, page_size=16, max_batch_size=B, num_kv_heads=H,
                                head_dim=E, dtype=torch.bfloat16)
    cache.append(k[:, :, :7], v[:, :, :7])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        paged = cache.attend(q)
    assert paged.dtype == torch.bfloat16
    assert torch.equal(paged, flexfa.flex_decode(q.bfloat16(), k[:, :, :7].bfloat16(),
                                                  v[:, :, :7].bfloat16()))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert flexfa.flex_decode(q, k, v).dtype == torch.float32


def test_flex_decode_inside_torch_compile_refuses_inputs_that_require_grad():
    """As the eager call: the flexfa::flex_decode operator has no autograd formula (the
    compile failed with torch's "no autograd formula" error)."""
    q = torch.randn(1, 2, 3, E, requires_grad=True)
    k, v = torch.randn(1, 2, S, E), torch.randn(1, 2, S, E)
    compiled = torch.compile(flexfa.flex_decode, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="flex_decode is inference only.*query requires grad"):
        compiled(q, k, v)
    with torch.no_grad():
        assert torch.equal(compiled(q, k, v), flexfa.flex_decode(q.detach(), k, v))
