"""A repeated call takes its prepared entry (flexfa.prepared) only while everything the entry
was derived from still holds: each test calls, changes one thing, calls again and compares the
result with the float64 reference of the new state. Also: the entry keeps nothing alive, and
a cached call's Python work stays small (counted in functions entered, not timed)."""
import gc
import importlib.util
import math
import os
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch

import flexfa
from flexfa import prepared
from flexfa.errors import InputError
from tests.reference import assert_close_to_reference, reference_pair

trace_module = sys.modules["flexfa.frontend.trace"]  # flexfa.frontend.trace is the function

L, E = 64, 16


def _qkv(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(1, 2, L, E, dtype=dtype) for _ in range(3)]


def _check(out, q, k, v, score_mod=None, mask_mod=None):
    (ref, _), (eager, _) = reference_pair(q, k, v, score_mod, mask_mod)
    assert_close_to_reference(out, ref, eager)


def _prepared_hits(monkeypatch) -> list:
    """Records each lookup's outcome (True: the prepared entry served the call)."""
    hits, lookup = [], prepared.lookup

    def spy(*args):
        found = lookup(*args)
        hits.append(found[0] is not None)
        return found
    monkeypatch.setattr(flexfa.api, "lookup", spy)
    return hits


class Shift:
    def __init__(self):
        self.amount = 0.0

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.amount * (q_idx - kv_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_a_changed_attribute_is_seen_by_the_next_call(monkeypatch):
    hits = _prepared_hits(monkeypatch)
    q, k, v = _qkv()
    shift = Shift()
    mask = flexfa.create_block_mask(causal, 1, None, L, L, device="cpu", BLOCK_SIZE=32)
    for amount in (0.0, 0.0, 0.0, 0.5, 0.5):
        shift.amount = amount
        with torch.no_grad():
            out = flexfa.flex_attention(q, k, v, shift.score_mod, block_mask=mask)
        _check(out, q, k, v, shift.score_mod, causal)
    # the second and third calls are served; the change of amount makes a new trace
    assert hits == [False, True, True, False, True]


def test_captured_tensor_edited_in_place_or_restrided(monkeypatch):
    hits = _prepared_hits(monkeypatch)
    q, k, v = _qkv()
    bias = torch.randn(L, L)
    holder = {"bias": bias}

    def biased(score, b, h, q_idx, kv_idx):
        return score + holder["bias"][q_idx, kv_idx]
    for step in range(4):
        if step == 2:
            bias.mul_(-2.0)  # new values, same tensor: the kernel reads them, no new trace
        if step == 3:  # a new tensor with other strides: a new trace and plan
            holder["bias"] = bias.t().contiguous().t()
        out = flexfa.flex_attention(q, k, v, biased)
        _check(out, q, k, v, biased)
    assert hits == [False, True, True, False]



@pytest.mark.parametrize("first", [0.0, -0.0], ids=["positive_first", "negative_first"])
def test_a_zero_scale_keeps_its_sign(first, monkeypatch):
    """-0.0 == 0.0 (and hashes alike) in a signature, but a score_mod can tell the scores'
    signs apart (1 / score): a call must run with its own zero. Checked on the call the
    kernels get: Triton's interpreter reads a float argument 0.0 of either sign as +0.0
    (a GPU passes the sign)."""
    scales, attend = [], flexfa.api.attend

    def spy(query, key, value, call, *args):
        scales.append(math.copysign(1.0, call.scale))
        return attend(query, key, value, call, *args)
    monkeypatch.setattr(flexfa.api, "attend", spy)
    q, k, v = _qkv()

    def signed(score, b, h, q_idx, kv_idx):
        return torch.where(1.0 / score > 0, score + 0.25 * kv_idx, score)
    for scale in (first, first, -first):
        flexfa.flex_attention(q, k, v, signed, scale=scale)
    assert scales == [math.copysign(1.0, s) for s in (first, first, -first)]


def test_int_and_numpy_scales_are_served_as_the_float_they_run_with(monkeypatch):
    """An int or NumPy scale took the full path on every call (twice a float's host cost);
    it is keyed as the float check_scale makes of it: a later call of an equal float, int or
    NumPy scale is served by the entry, a different value is not, and every result is the
    float scale's. A bool, a 0-d tensor or an int past float's range still take the full
    path, which refuses them."""
    import numpy as np

    prepared.PREPARED.clear()  # (0.25 is E = 16's default scale: an earlier test's entry)
    hits = _prepared_hits(monkeypatch)
    q, k, v = _qkv()
    expected = {}
    for scale in (0.25, np.float64(0.25), np.float32(0.25), 2, np.int64(2), 2.0,
                  np.float32(0.1)):
        out = flexfa.flex_attention(q, k, v, scale=scale)
        value = float(scale)
        if value in expected:
            assert torch.equal(out, expected[value]), scale
        else:
            expected[value] = out
            (ref, _), (eager, _) = reference_pair(q, k, v, None, None, scale=value)
            assert_close_to_reference(out, ref, eager)
    # (the first of each value takes the full path; np.float32(0.1) is not 0.1)
    assert hits == [False, True, True, False, True, True, False], hits
    for bad in (True, torch.tensor(0.5), 10 ** 400):
        with pytest.raises((InputError, flexfa.InputTypeError), match="scale"):
            flexfa.flex_attention(q, k, v, scale=bad)


def test_return_aux_calls_are_served_with_what_they_request(monkeypatch):
    """torch's newer ``return_aux=AuxRequest(...)`` took the full path on every call (twice
    the host cost of ``return_lse``): a repeated request is served by the entry, each with the
    outputs it asks for, equal to the full path's; a look-alike request class or one beside
    ``return_lse=True`` still takes the full path (which reads or refuses it)."""
    from collections import namedtuple

    hits = _prepared_hits(monkeypatch)
    q, k, v = _qkv()
    want_out, want_lse = flexfa.flex_attention(q, k, v, causal_score, return_lse=True)
    requests = [flexfa.AuxRequest(lse=True), flexfa.AuxRequest(max_scores=True),
                flexfa.AuxRequest(lse=True, max_scores=True), flexfa.AuxRequest()]
    seen_max = None
    for request in requests * 2:
        out, aux = flexfa.flex_attention(q, k, v, causal_score, return_aux=request)
        assert torch.equal(out, want_out)
        assert (aux.lse is None) == (not request.lse)
        if request.lse:
            assert torch.equal(aux.lse, want_lse)
        assert (aux.max_scores is None) == (not request.max_scores)
        if request.max_scores:
            seen_max = aux.max_scores if seen_max is None else seen_max
            assert torch.equal(aux.max_scores, seen_max)
    # (the return_lse call and each request's first call take the full path: their keys differ)
    assert hits == [False] * 5 + [True] * 4, hits
    LookAlike = namedtuple("LookAlike", ["lse", "max_scores"])
    out, aux = flexfa.flex_attention(q, k, v, causal_score, return_aux=LookAlike(True, False))
    assert torch.equal(aux.lse, want_lse) and len(hits) == 9  # the full path, no lookup
    with pytest.raises(InputError, match="return_lse and return_aux"):
        flexfa.flex_attention(q, k, v, causal_score, return_lse=True,
                              return_aux=flexfa.AuxRequest(lse=True))


def causal_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


def test_a_captured_tensor_made_a_negated_view_through_data_is_refused(monkeypatch):
    """``bias.data = z.conj().imag`` keeps the tensor's identity, shape, strides, dtype and
    version but sets its negative bit (its memory holds the negated values): the call
    after it must be refused as a first call with such a tensor is, not read negated."""
    hits = _prepared_hits(monkeypatch)
    q, k, v = _qkv()
    bias = torch.randn(L, dtype=torch.complex64).imag  # strides (2,), as the view below's

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    for _ in range(2):
        out = flexfa.flex_attention(q, k, v, biased)
    _check(out, q, k, v, biased)
    bias.data = torch.randn(L, dtype=torch.complex64).conj().imag
    with pytest.raises(InputError, match="negated view"):
        flexfa.flex_attention(q, k, v, biased)
    assert hits == [False, True, False]

def test_inference_mode_tensors_captured_and_edited():
    """Under torch.inference_mode captured tensors and the mask's tables have no version
    counter (the trace read it: RuntimeError from torch): repeated calls still see each edit
    (the tables are checked on every call, so these calls take no prepared entry)."""
    q, k, v = _qkv()
    with torch.inference_mode():
        bias = torch.randn(L)
        doc = torch.arange(L) // 24

        def biased(score, b, h, q_idx, kv_idx):
            return score + bias[kv_idx]

        def document(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

        mask = flexfa.create_block_mask(document, 1, None, L, L, device="cpu", BLOCK_SIZE=32)
        for step in range(3):
            if step == 2:
                bias.mul_(-2.0)
            out = flexfa.flex_attention(q, k, v, biased, block_mask=mask)
            _check(out, q, k, v, biased, document)


def test_a_cleared_plan_memo_plans_again(monkeypatch):
    from flexfa.runtime import plans

    q, k, v = _qkv()
    flexfa.flex_attention(q, k, v)
    flexfa.flex_attention(q, k, v)
    plans.PLANS.clear()
    flexfa.flex_attention(q, k, v)
    assert len(plans.PLANS) == 1, "the prepared entry's kept plan must not outlive the memo"


def test_the_default_backend_is_part_of_the_entry(monkeypatch):
    from flexfa.runtime import plans

    q, k, v = (t.to(torch.bfloat16) for t in _qkv())
    for _ in range(2):
        flexfa.flex_attention(q, k, v)
    monkeypatch.setenv("FLEXFA_BACKEND", "HOPPER")
    out = flexfa.flex_attention(q, k, v)
    _check(out, q, k, v)
    assert "hopper" in {p.family.name for p in plans.PLANS.values()}


def test_kernel_options_edited_in_place(monkeypatch):
    from flexfa.runtime import plans

    hits = _prepared_hits(monkeypatch)
    q, k, v = _qkv()
    options = {"BLOCK_M": 32, "BLOCK_N": 32}
    for _ in range(2):
        flexfa.flex_attention(q, k, v, kernel_options=options)
    options["BLOCK_M"] = 16
    out = flexfa.flex_attention(q, k, v, kernel_options=options)
    _check(out, q, k, v)
    assert hits == [False, True, False]
    # (forward plans: a backward plan that an earlier test left in the cache has no block_m)
    assert 16 in {getattr(p.spec, "block_m", None) for p in plans.PLANS.values()}
    options["BLOCK_M"] = 24
    with pytest.raises(InputError, match="BLOCK_M"):
        flexfa.flex_attention(q, k, v, kernel_options=options)


def test_an_unguarded_mod_is_traced_once_per_call(monkeypatch):
    q, k, v = _qkv()
    config = types.SimpleNamespace(factor=0.5)

    def dynamic(score, b, h, q_idx, kv_idx):  # getattr: state the guards cannot follow
        return score * getattr(config, "factor")
    traces, trace_uncached = [], trace_module._trace_uncached

    def spy(*args):
        traces.append(1)
        return trace_uncached(*args)
    monkeypatch.setattr(trace_module, "_trace_uncached", spy)
    for _ in range(3):
        flexfa.flex_attention(q, k, v, dynamic)
    assert len(traces) == 3


@pytest.mark.parametrize("block", [32, 24], ids=["tiled", "coarsened"])
def test_entries_keep_no_mod_mask_or_tensor_alive(block, monkeypatch):
    """Entries live under the mask; 24-row blocks run through a coarser mask kept with it."""
    hits = _prepared_hits(monkeypatch)
    q, k, v = _qkv()

    def calls():
        bias = torch.randn(2, L, L)
        doc = torch.arange(L) // 20

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx, kv_idx]

        def mask_mod(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]
        mask = flexfa.create_block_mask(mask_mod, None, None, L, L, device="cpu",
                                        BLOCK_SIZE=block)
        for _ in range(3):  # the third call is served by the prepared entry
            out = flexfa.flex_attention(q, k, v, score_mod, block_mask=mask)
        assert hits == [False, True, True]
        _check(out, q, k, v, score_mod, mask_mod)
        return [weakref.ref(x) for x in (bias, doc, mask, mask.kv_indices, score_mod, mask_mod)]
    refs = calls()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def _functions_entered():
    """benchmarks/host_cost.py's count of flexfa functions a call enters (sys.setprofile)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "host_cost.py"
    spec = importlib.util.spec_from_file_location("host_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.functions_entered


@pytest.mark.parametrize("case", ["dense", "causal", "captured", "grad"])
def test_a_cached_call_enters_few_functions(case):
    """The cached call's Python work, in flexfa functions entered (a timing would depend on
    the machine): 60 dense, 83 causal, 109 with a captured tensor and 84 with requires_grad
    before prepared calls; 21, 27, 47 and 30 with them; 21, 43, 68 and 48 since the mask_mod's
    trace is looked up under its guard on every call, as the score_mod's is (a mod whose
    state changed is traced again); 46, 71 and 51 with the autocast check and, on the CPU,
    the interpreter's warning filter and its kept rewritten kernels (one call each); 25, 38,
    53 and 43 since plain functions' traces are checked by their pins (guards.pins)."""
    q, k, v = _qkv()
    bias = torch.randn(L, L)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx, kv_idx]
    mask = flexfa.create_block_mask(causal, 1, None, L, L, device="cpu", BLOCK_SIZE=32)
    grads = [t.clone().requires_grad_() for t in (q, k, v)]
    call = {"dense": lambda: flexfa.flex_attention(q, k, v),
            "causal": lambda: flexfa.flex_attention(q, k, v, block_mask=mask),
            "captured": lambda: flexfa.flex_attention(q, k, v, biased, block_mask=mask),
            "grad": lambda: flexfa.flex_attention(*grads, block_mask=mask)}[case]
    for _ in range(3):
        call()
    bound = {"dense": 25, "causal": 38, "captured": 53, "grad": 43}[case]
    entered = _functions_entered()(call, os.path.dirname(flexfa.__file__), calls=1)
    assert entered <= bound, f"{case}: a cached call entered {entered} flexfa functions"
