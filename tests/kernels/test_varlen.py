"""varlen_attention under the interpreter: each document against the float64 reference and
against flex_attention on that document alone, gradients (captured tensors too), no new
trace or kernel for new lengths, and bad input before any launch."""
import importlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import flexfa
from flexfa.runtime import kernels
from reference import assert_close_to_reference, reference_pair

trace_module = importlib.import_module("flexfa.frontend.trace")  # not the function

H, HKV, E = 4, 2, 16


def offsets(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def packed(q_lengths, k_lengths, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((sum(q_lengths), H, E), (sum(k_lengths), HKV, E), (sum(k_lengths), HKV, E))
    return [torch.randn(s, generator=generator).to(dtype) for s in shapes]


def document_mask(lq, lk, causal, window):
    """The mask of one document alone (bottom-right aligned)."""
    def mod(b, h, q_idx, kv_idx):
        distance = q_idx + (lk - lq) - kv_idx
        keep = distance > -(10 ** 9)
        if causal:
            keep = keep & (distance >= 0)
        if window is not None:
            keep = keep & ((distance < window) if causal else (abs(distance) < window))
        return keep
    return mod


def per_document(q, k, v, q_lengths, k_lengths, causal, window, score_mod=None):
    """(out, lse) pairs of the float64 and same-dtype references, document by document, with
    the score_mod's b set to the document's index."""
    cu_q, cu_k = offsets(q_lengths).tolist(), offsets(k_lengths).tolist()
    results = []
    for doc, (lq, lk) in enumerate(zip(q_lengths, k_lengths)):
        rows, keys = slice(cu_q[doc], cu_q[doc + 1]), slice(cu_k[doc], cu_k[doc + 1])
        if lq == 0:
            continue
        views = [t[s].transpose(0, 1).unsqueeze(0) for t, s in ((q, rows), (k, keys), (v, keys))]
        shifted = None if score_mod is None else (
            lambda score, b, h, q_idx, kv_idx, doc=doc: score_mod(score, b + doc, h, q_idx, kv_idx))
        if lk == 0:  # nothing to attend: out 0, lse -inf
            empty = (torch.zeros(1, H, lq, E), torch.full((1, H, lq), float("-inf")))
            results.append((rows, doc, empty, empty))
            continue
        pair = reference_pair(*views, shifted, document_mask(lq, lk, causal, window),
                              enable_gqa=True)
        results.append((rows, doc, *pair))
    return results


def check_against_reference(q_lengths, k_lengths, causal, window, score_mod=None, block=32):
    q, k, v = packed(q_lengths, k_lengths)
    out, lse = flexfa.varlen_attention(q, k, v, offsets(q_lengths), offsets(k_lengths),
                                       causal=causal, window=window, score_mod=score_mod,
                                       return_lse=True, BLOCK_SIZE=block)
    assert out.shape == (sum(q_lengths), H, E) and lse.shape == (H, sum(q_lengths))
    for rows, doc, (ref_out, ref_lse), (eager_out, eager_lse) in per_document(
            q, k, v, q_lengths, k_lengths, causal, window, score_mod):
        got = out[rows].transpose(0, 1).unsqueeze(0)
        assert_close_to_reference(got, ref_out, eager_out, name=f"out of document {doc}")
        assert_close_to_reference(lse[:, rows].unsqueeze(0), ref_lse, eager_lse,
                                  name=f"lse of document {doc}")


@settings(max_examples=4)
@given(docs=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 70)), min_size=1,
                     max_size=4).filter(lambda docs: all(sum(side) for side in zip(*docs))),
       causal=st.booleans(), window=st.one_of(st.none(), st.integers(1, 30)))
def test_random_documents(docs, causal, window):
    q_lengths, k_lengths = (list(side) for side in zip(*docs))
    check_against_reference(q_lengths, k_lengths, causal, window)


@pytest.mark.parametrize("causal,window", [(True, None), (False, 9)])
def test_empty_and_short_documents_with_score_mod(causal, window):
    """Empty documents (no queries, no keys, or more queries than keys), documents shorter
    than a block; the score_mod reads a per-document table by b and a relative bias by the
    in-document positions."""
    generator = torch.Generator().manual_seed(3)
    doc_bias = torch.randn(6, generator=generator)
    relative = torch.randn(H, 200, generator=generator)

    def bias(score, b, h, q_idx, kv_idx):
        return score + doc_bias[b] + relative[h, q_idx - kv_idx + 100]
    check_against_reference([0, 5, 70, 3, 40, 0], [4, 9, 40, 0, 40, 7], causal, window, bias)


def test_equals_flex_attention_per_document():
    q_lengths = k_lengths = [37, 100, 19]
    q, k, v = packed(q_lengths, k_lengths)
    out = flexfa.varlen_attention(q, k, v, offsets(q_lengths), offsets(k_lengths), causal=True)
    start = 0
    for length in q_lengths:
        views = [t[start:start + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, length, length, "cpu")
        alone = flexfa.flex_attention(*views, block_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out[start:start + length], alone[0].transpose(0, 1),
                                   atol=2e-5, rtol=1e-5)
        start += length


def test_gradients_equal_the_reference():
    q_lengths, k_lengths = [5, 0, 70, 33], [9, 4, 40, 33]
    q, k, v = (t.requires_grad_() for t in packed(q_lengths, k_lengths))
    generator = torch.Generator().manual_seed(1)
    relative = torch.randn(H, 200, generator=generator).requires_grad_()
    doc_bias = torch.randn(4, generator=generator).requires_grad_()

    def bias(score, b, h, q_idx, kv_idx):
        return score + relative[h, q_idx - kv_idx + 100] + doc_bias[b]
    out = flexfa.varlen_attention(q, k, v, offsets(q_lengths), offsets(k_lengths), causal=True,
                                  score_mod=bias, BLOCK_SIZE=32)
    grad_out = torch.randn(out.shape, generator=generator)
    inputs = (q, k, v, relative, doc_bias)
    got = torch.autograd.grad((out * grad_out).sum(), inputs)
    expected = torch.zeros(out.shape, dtype=torch.float64)
    for rows, _, (ref_out, _), _ in per_document(q, k, v, q_lengths, k_lengths, True, None,
                                                 bias):
        index = torch.arange(rows.start, rows.stop)
        expected = expected.index_put((index,), ref_out[0].transpose(0, 1).double())
    wanted = torch.autograd.grad((expected * grad_out.double()).sum(), inputs)
    for name, a, b in zip(("q", "k", "v", "relative", "doc_bias"), got, wanted):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)


def test_tensor_read_in_a_dead_branch_gets_zero_gradient():
    """A learnable tensor the score_mod reads only in a branch the trace proves dead gets
    zeros, as from flex_attention (None would make an optimizer skip it)."""
    lengths = [17, 0, 40]
    q, k, v = packed(lengths, lengths)
    q.requires_grad_()
    dead, live = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)

    def bias(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx < q_idx, score + dead[b], score + live[b])
    flexfa.varlen_attention(q, k, v, offsets(lengths), offsets(lengths), causal=True,
                            score_mod=bias, BLOCK_SIZE=32).sum().backward()
    assert dead.grad is not None and torch.equal(dead.grad, torch.zeros(3))
    assert live.grad is not None and q.grad is not None


def test_reads_in_range_in_every_document_are_accepted():
    """A per-token tensor in the packed layout read at ``cu[b] + q_idx`` is in range in every
    document, though not for the longest document's length at the last one (it was refused);
    a read past it names the document; a memoized check does not hide more heads."""
    lengths = [40, 5, 17]
    cu = offsets(lengths)
    starts = cu.long()
    q, k, v = packed(lengths, lengths)
    token_bias = torch.randn(H, sum(lengths))

    def packed_bias(score, b, h, q_idx, kv_idx):
        return score + token_bias[h, starts[b] + q_idx]
    for _ in range(2):  # the second call takes the memoized per-document check
        check_against_reference(lengths, lengths, True, None, packed_bias)
    short = token_bias[:, :-1]

    def short_bias(score, b, h, q_idx, kv_idx):
        return score + short[h, starts[b] + q_idx]
    with pytest.raises(flexfa.InputError, match=r"in document 2 \(17 queries, 17 keys\).*"
                                                r"indices 45..61 .*for b = 2, h < 4"):
        flexfa.varlen_attention(q, k, v, cu, cu, score_mod=short_bias)
    two_heads = token_bias[:2]

    def per_head(score, b, h, q_idx, kv_idx):
        return score + two_heads[h, starts[b] + q_idx]
    flexfa.varlen_attention(q[:, :2], k, v, cu, cu, score_mod=per_head)
    with pytest.raises(flexfa.InputError, match=r"in document 0 .*\(size 2\), for b = 0, h < 4"):
        flexfa.varlen_attention(q, k, v, cu, cu, score_mod=per_head)


def test_new_lengths_need_no_new_trace_or_kernel(monkeypatch):
    """Lengths are data: after a first call, new lengths with the same total (and a total of
    the same tile evenness under the same power of two) trace nothing and load no kernel."""
    loads, traces = [], []
    load, trace_uncached = kernels.load_generated, trace_module._trace_uncached
    monkeypatch.setattr(kernels, "load_generated", lambda *a: loads.append(1) or load(*a))
    monkeypatch.setattr(trace_module, "_trace_uncached",
                        lambda *a: traces.append(1) or trace_uncached(*a))
    relative = torch.randn(H, 300)

    def bias(score, b, h, q_idx, kv_idx):
        return score + relative[h, q_idx - kv_idx + 150]
    for i, lengths in enumerate(([30, 50, 20], [90, 10], [1, 2, 3, 4, 90], [60, 60])):
        q, k, v = packed(lengths, lengths, seed=i)
        flexfa.varlen_attention(q, k, v, offsets(lengths), offsets(lengths), causal=True,
                                score_mod=bias)
        if i == 0:
            loads.clear(), traces.clear()
    assert loads == [] and traces == []


def test_masks_are_kept_per_offsets_tensor():
    from flexfa.varlen import packed_block_mask

    cu = offsets([30, 50])
    first = packed_block_mask("f", cu, cu, 80, 80, True, None, (32, 32), torch.device("cpu"))
    assert packed_block_mask("f", cu, cu, 80, 80, True, None, (32, 32),
                             torch.device("cpu")) is first
    cu[1] = 40  # an in-place edit: a new mask
    second = packed_block_mask("f", cu, cu, 80, 80, True, None, (32, 32), torch.device("cpu"))
    assert second is not first and second.documents.offsets.cu_q.tolist() == [0, 40, 80]
    # CPU offsets rewritten through a NumPy array sharing their memory (a loader refilling one
    # buffer) bump no version counter: their contents key the mask too (it was reused stale)
    buffer = cu.numpy()
    buffer[1] = 20
    third = packed_block_mask("f", cu, cu, 80, 80, True, None, (32, 32), torch.device("cpu"))
    assert third is not second and third.documents.offsets.cu_q.tolist() == [0, 20, 80]
    cu.data[1] = 60
    fourth = packed_block_mask("f", cu, cu, 80, 80, True, None, (32, 32), torch.device("cpu"))
    assert fourth.documents.offsets.cu_q.tolist() == [0, 60, 80]


@pytest.mark.parametrize("change,error,words", [
    ({"q": torch.randn(1, 80, H, E)}, flexfa.InputError, "query must be 3-D"),
    ({"cu_seqlens_q": offsets([30, 40])}, flexfa.InputError,
     "cu_seqlens_q[-1] is 70 but query has 80 tokens"),
    ({"cu_seqlens_k": offsets([80])}, flexfa.InputError,
     "cu_seqlens_q has 3 entries (2 documents) but cu_seqlens_k has 2"),
    ({"cu_seqlens_q": torch.tensor([0, 50, 30, 80]), "cu_seqlens_k": offsets([30, 20, 30])},
     flexfa.InputError, "cu_seqlens_q decreases at index 2 (50 -> 30)"),
    ({"cu_seqlens_k": torch.tensor([0.0, 80.0])}, flexfa.InputTypeError, "torch.float32"),
    ({"max_seqlen_q": 40}, flexfa.InputError, "max_seqlen_q is 40 but the longest document"),
    ({"window": -1}, flexfa.InputError, "window must be >= 1"),
    ({"BLOCK_SIZE": 24}, flexfa.InputError, "BLOCK_SIZE must be a multiple of 16"),
    ({"k": torch.randn(80, 3, E), "v": torch.randn(80, 3, E)}, flexfa.InputError,
     "query has 4 heads but key has 3"),
])
def test_bad_input(change, error, words):
    q, k, v = packed([30, 50], [30, 50])
    args = {"q": q, "k": k, "v": v, "cu_seqlens_q": offsets([30, 50]),
            "cu_seqlens_k": offsets([30, 50]), **change}
    with pytest.raises(error) as caught:
        flexfa.varlen_attention(**args)
    assert words in str(caught.value)


def test_no_tokens_give_flex_attentions_empty_results():
    """Offsets of no tokens (a batch whose documents are all empty on one side): out 0 and lse
    -inf (the head's sink with sinks), gradients 0 into q, k, v and the sinks' the rows' count,
    as flex_attention gives for an empty side; offsets that are not those of no tokens still
    fail."""
    none = offsets([0, 0])
    q, k, v = (t.requires_grad_() for t in packed([3, 4], [0, 0]))
    sinks = torch.randn(H, requires_grad=True)
    out, lse = flexfa.varlen_attention(q, k, v, offsets([3, 4]), none, causal=True,
                                       return_lse=True, sinks=sinks)
    assert torch.equal(out, torch.zeros(7, H, E))
    assert torch.equal(lse, sinks.detach()[:, None].expand(H, 7))
    (out.sum() + lse.sum()).backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == (0, HKV, E)
    assert torch.equal(sinks.grad, torch.full((H,), 7.0))
    q, k, v = packed([0, 0], [5, 2])
    out, lse = flexfa.varlen_attention(q, k, v, none, offsets([5, 2]), return_lse=True)
    assert out.shape == (0, H, E) and lse.shape == (H, 0)
    # a score_mod's learnable tensor gets zeros, as from flex_attention (it got None)
    bias = torch.zeros(H, requires_grad=True)
    flexfa.varlen_attention(*(t.requires_grad_() for t in packed([0, 0], [5, 2])), none,
                            offsets([5, 2]), score_mod=lambda s, b, h, qi, ki: s + bias[h]
                            ).sum().backward()
    assert torch.equal(bias.grad, torch.zeros(H))
    q, k, v = packed([0], [0])
    assert flexfa.varlen_attention(q, k, v, offsets([0]), offsets([0])).shape == (0, H, E)
    with pytest.raises(flexfa.InputError, match=r"cu_seqlens_k\[-1\] is 3 but key has 0"):
        flexfa.varlen_attention(*packed([3], [0]), offsets([3]), offsets([3]))


def test_packed_tensors_run_the_hopper_family_in_place():
    """Forced onto the Hopper family (how CI runs it), the packed tensors are read in place
    through strided descriptors, with exactly the result of the same mask on contiguous
    copies, and the Ampere family's within rounding."""
    from flexfa.runtime import plans
    from flexfa.runtime.families.hopper import HOPPER

    q, k, v = packed([40, 0, 70, 40], [40, 5, 70, 35], dtype=torch.bfloat16, seed=3)
    cu_q, cu_k = offsets([40, 0, 70, 40]), offsets([40, 5, 70, 35])
    plans.PLANS.clear()
    out, lse = flexfa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                       kernel_options={"BACKEND": "HOPPER"})
    assert [p.spec.strided_qkv for p in plans.PLANS.values() if p.family is HOPPER] == [True]
    mask = flexfa.varlen_block_mask(cu_q, cu_k, causal=True)
    copies = [t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v)]
    flat_out, flat_lse = flexfa.flex_attention(*copies, block_mask=mask, enable_gqa=True,
                                               return_lse=True,
                                               kernel_options={"BACKEND": "HOPPER"})
    assert torch.equal(out, flat_out[0].transpose(0, 1)) and torch.equal(lse, flat_lse[0])
    # with dropout the packed positions draw the same keep mask in place and on the copies
    dropped = flexfa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, dropout_p=0.3,
                                      dropout_seed=5, kernel_options={"BACKEND": "HOPPER"})
    flat_dropped = flexfa.flex_attention(*copies, block_mask=mask, enable_gqa=True,
                                         dropout_p=0.3, dropout_seed=5,
                                         kernel_options={"BACKEND": "HOPPER"})
    assert torch.equal(dropped, flat_dropped[0].transpose(0, 1))
    assert not torch.equal(dropped, out)
    ampere = flexfa.varlen_attention(q, k, v, cu_q, cu_k, causal=True, return_lse=True,
                                     kernel_options={"BACKEND": "AMPERE"})
    torch.testing.assert_close(out, ampere[0], atol=1e-2, rtol=0)


def test_sinks_and_dropout_per_document():
    """``sinks`` and ``dropout_p`` on packed documents: each document's out, lse and
    gradients (the sinks' too) are the float64 reference's with the same sinks and the packed
    call's keep mask (``flexfa.dropout_mask`` of [1, H, total_q, total_k]) cut to the
    document; a query with no key gets out 0 and lse = its head's sink."""
    from flexfa.reference import attention_reference

    q_lengths, k_lengths = [5, 40, 0, 33], [9, 40, 6, 0]
    q, k, v = (t.requires_grad_() for t in packed(q_lengths, k_lengths, seed=7))
    sinks = torch.linspace(-1.0, 1.5, H).requires_grad_()
    p, seed = 0.25, (99, 3)
    out, lse = flexfa.varlen_attention(q, k, v, offsets(q_lengths), offsets(k_lengths),
                                       causal=True, return_lse=True, BLOCK_SIZE=32,
                                       sinks=sinks, dropout_p=p, dropout_seed=seed)
    keep = flexfa.dropout_mask(seed, 1, H, sum(q_lengths), sum(k_lengths), p)[0]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((out * grad_out).sum(), (q, k, v, sinks))
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    total = 0.0
    cu_q, cu_k = offsets(q_lengths).tolist(), offsets(k_lengths).tolist()
    for doc, (lq, lk) in enumerate(zip(q_lengths, k_lengths)):
        rows, keys = slice(cu_q[doc], cu_q[doc + 1]), slice(cu_k[doc], cu_k[doc + 1])
        if lq == 0:
            continue
        if lk == 0:  # nothing to attend: out 0, lse the sink
            assert bool((out[rows] == 0).all())
            torch.testing.assert_close(lse[:, rows], sinks.detach()[:, None].expand(H, lq))
            continue
        views = [t[s].transpose(0, 1).unsqueeze(0) for t, s in zip(ref_inputs[:3],
                                                                     (rows, keys, keys))]
        want, want_lse = attention_reference(
            *views, mask_mod=document_mask(lq, lk, True, None), enable_gqa=True,
            return_lse=True, sinks=ref_inputs[3], dropout_mask=keep[None, :, rows, keys],
            dropout_p=p)
        torch.testing.assert_close(out[rows].detach().transpose(0, 1).double(), want[0],
                                   atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse[:, rows].detach().double(), want_lse[0], atol=2e-5,
                                   rtol=1e-4)
        total = total + (want[0].transpose(0, 1) * grad_out[rows].double()).sum()
    wanted = torch.autograd.grad(total, ref_inputs)
    for name, a, b in zip(("q", "k", "v", "sinks"), got, wanted):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=1e-4, msg=name)
    # the same seed, the same result; p = 0 is no dropout; a bad sinks shape fails first
    again = flexfa.varlen_attention(q, k, v, offsets(q_lengths), offsets(k_lengths),
                                    causal=True, BLOCK_SIZE=32, sinks=sinks, dropout_p=p,
                                    dropout_seed=seed)
    assert torch.equal(again, out)
    with pytest.raises(flexfa.InputError, match=r"sinks must be \[4\]"):
        flexfa.varlen_attention(q, k, v, offsets(q_lengths), offsets(k_lengths),
                                sinks=torch.zeros(3))
    with pytest.raises(flexfa.InputError, match=r"dropout_p must be in \[0, 1\)"):
        flexfa.varlen_attention(q, k, v, offsets(q_lengths), offsets(k_lengths), dropout_p=1.0)


def test_autocast_casts_the_inputs_as_flex_attention():
    """Under torch.autocast varlen_attention computes in the autocast's dtype (q, k, v cast
    first, the casts carrying the gradients back), as flex_attention does; it ran float32
    before."""
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(40, 2, 16, generator=generator, requires_grad=True)
               for _ in range(3))
    offsets = torch.tensor([0, 17, 40], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = flexfa.varlen_attention(q, k, v, offsets, offsets, causal=True)
    want = flexfa.varlen_attention(*(t.detach().bfloat16() for t in (q, k, v)), offsets,
                                   offsets, causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and q.grad.abs().sum() > 0
