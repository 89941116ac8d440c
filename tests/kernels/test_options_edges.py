"""Edges of kernel_options and of what a launch plan is keyed on, from the fiftieth
session's audit of runtime/options.py, plans.py, call.py, layout.py and launch.py (no
defect changed a result there; each test fails under a rule changed with the rest of the
suite passing: values just outside the documented ranges, FLEXFA_BACKEND over a memoized
dict, 'AUTO' flags, pinned warps or stages pinning tiles, plans shared across the scale's
sign, dtypes, value head dims, strides, sink dtypes, 16-byte alignment, a typo's suggestion
that parses)."""
import pytest
import torch

import flexfa
from flexfa.errors import InputError, InputTypeError
from flexfa.memo import BoundedMemo
from flexfa.reference import attention_reference
from flexfa.runtime import options as options_module
from flexfa.runtime.options import parse_kernel_options


@pytest.fixture
def fresh_memo(monkeypatch):
    monkeypatch.setattr(options_module, "_PARSED", BoundedMemo(256, "parsed kernel_options"))


# ---- options.py: values just outside the documented ranges ----------------
@pytest.mark.parametrize("options", [
    {"BLOCK_M": 8}, {"bwd_BLOCK_N2": 8}, {"BLOCK_N": 512},   # tiles: 16..256
    {"maxnreg": 256}, {"maxnreg": 56},                          # 0 or 64..248 step 8
    {"SPLIT_KV": -1}, {"SPLIT_KV": 1025},                       # 0..1024 or 'AUTO'
    {"HEAD_GROUP": -1}, {"GLUON_BWD_DQ_CHUNKS": -1}, {"GLUON_BWD_STAGES": 5},
])
def test_values_just_outside_the_documented_ranges_are_refused(options, fresh_memo):
    (key, value), = options.items()
    with pytest.raises(InputError, match=rf"\['{key}'\] = {value} is not allowed"):
        parse_kernel_options(options)


# ---- options.py: the memo of non-empty dicts is keyed by FLEXFA_BACKEND ---------------
def test_flexfa_backend_applies_to_a_non_empty_dict_parsed_before(monkeypatch, fresh_memo):
    monkeypatch.delenv("FLEXFA_BACKEND", raising=False)
    assert parse_kernel_options({"BLOCK_M": 32}).backend == "AUTO"
    monkeypatch.setenv("FLEXFA_BACKEND", "ampere")
    assert parse_kernel_options({"BLOCK_M": 32}).backend == "AMPERE"
    monkeypatch.setenv("FLEXFA_BACKEND", "hopper")
    assert parse_kernel_options({"BLOCK_M": 32}).backend == "HOPPER"


# ---- options.py: 'AUTO' is flexfa's choice (None), not True ---------------------
def test_auto_strings_parse_to_the_default():
    parsed = parse_kernel_options({"GLUON_PERSISTENT": "auto", "USE_TMA": "AUTO",
                                   "DS_WORKSPACE": "Auto", "GLUON_BACKWARD": "AUTO"})
    assert parsed.gluon_persistent is None and parsed.fwd.use_tma is None
    assert parsed.ds_workspace is None and parsed.gluon_backward is None
    assert parse_kernel_options({"GLUON_PERSISTENT": "dynamic"}).gluon_persistent == "DYNAMIC"


def test_pinning_warps_or_stages_alone_pins_tiles():
    """ a pinned num_warps / num_stages keeps AUTO off the Gluon families (which fix
    their own warps) and off the backward's autotuning, as pinned tiles do."""
    for key in ("num_warps", "num_stages"):
        parsed = parse_kernel_options({key: 4})
        assert parsed.fwd.pins_tiles and parsed.bwd.pins_tiles, key
    assert parse_kernel_options({"bwd_BLOCK_M1": 32}).bwd.pins_tiles
    assert not parse_kernel_options({"bwd_BLOCK_M1": 32}).fwd.pins_tiles


# ---- plan keys: two calls in a row that differ in one thing, each against the reference ----
def _close(out, want, tol=2e-3):
    assert out.shape == want.shape
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def test_a_plan_is_not_shared_across_the_sign_of_the_scale():
    """scale > 0 folds the scale into the softmax; scale <= 0 forms q.k * scale
    first (scores_first). The second call must not take the first one's kernel."""
    q, k, v = (_rand(1, 2, 40, 16, seed=seed) for seed in (1, 2, 3))
    for scale in (0.25, -0.25, 0.0, -0.5, 0.25):
        _close(flexfa.flex_attention(q, k, v, scale=scale),
               attention_reference(q, k, v, scale=scale))


def test_a_plan_is_not_shared_across_dtypes():
    """ same shapes and strides, another dtype."""
    base = [_rand(1, 2, 40, 16, seed=s) for s in (1, 2, 3)]
    for dtype, tol in ((torch.float32, 2e-3), (torch.float16, 2e-2), (torch.bfloat16, 5e-2),
                       (torch.float32, 2e-3)):
        q, k, v = (t.to(dtype) for t in base)
        out = flexfa.flex_attention(q, k, v)
        assert out.dtype == dtype
        _close(out, attention_reference(q, k, v), tol)


def test_a_plan_is_not_shared_across_value_head_dims():
    """ q and k alike, v's head dim differs."""
    q, k = _rand(1, 2, 40, 16, seed=1), _rand(1, 2, 40, 16, seed=2)
    wide = _rand(1, 2, 40, 32, seed=3)
    # the same strides (2560, 1280, 32, 1) for Ev = 32, 16 and 8: only the shape tells them apart
    for v in (wide, wide[..., :16], wide[..., :8], wide):
        _close(flexfa.flex_attention(q, k, v), attention_reference(q, k, v))


@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_plan_is_not_shared_across_strides(which):
    """the same shapes, one of q, k, v laid out [B, L, H, E] (a transposed view),
    then contiguous again."""
    shape = (1, 2, 40, 16)
    for transposed in (False, True, False):
        t = [_rand(*shape, seed=s) for s in (1, 2, 3)]
        if transposed:
            t[which] = t[which].transpose(1, 2).contiguous().transpose(1, 2)
        _close(flexfa.flex_attention(*t), attention_reference(*t))


def test_return_max_after_a_call_without_it():
    """(F1) the same call with and without max_scores."""
    from torch.nn.attention.flex_attention import AuxRequest
    q, k, v = _rand(1, 2, 40, 16, seed=1), _rand(1, 2, 40, 16, seed=2), _rand(1, 2, 40, 16, seed=3)
    flexfa.flex_attention(q, k, v, return_lse=True)
    out, aux = flexfa.flex_attention(q, k, v, return_aux=AuxRequest(lse=True, max_scores=True))
    _, lse, rmax = attention_reference(q, k, v, return_lse=True, return_max=True)
    assert aux.max_scores is not None
    _close(aux.max_scores, rmax)
    _close(aux.lse, lse)


def test_a_plan_is_not_shared_across_sink_dtypes():
    """ float32 sinks, then sinks in q's dtype: the kernels are specialized on the sinks'
    element type (spec.sinks_dtype; on a GPU the compiled kernel's pointer type), so the
    plans' keys differ. (The interpreter reads the pointer's real type: the values alone
    cannot tell, hence the key check.)"""
    from flexfa.runtime.call import AttentionCall
    from flexfa.runtime.options import DEFAULT_OPTIONS
    q, k, v = (_rand(1, 2, 40, 16, seed=s, dtype=torch.float16) for s in (1, 2, 3))
    sinks = _rand(2, seed=4)
    keys = {AttentionCall(None, None, None, 0.25, DEFAULT_OPTIONS, 1, s).mods_key
            for s in (sinks, sinks.half())}
    assert len(keys) == 2
    for s in (sinks, sinks.half(), sinks):
        want = attention_reference(q, k, v, sinks=s)
        _close(flexfa.flex_attention(q, k, v, sinks=s), want, 2e-2)


def test_the_layout_key_tells_16_byte_alignment_apart():
    """ TMA descriptors and Triton's pointer specialization need 16-byte alignment: a q
    8 bytes past a 16-byte boundary (same shape, strides, dtype) must get its own plan."""
    from flexfa.runtime import plans
    from flexfa.runtime.call import AttentionCall
    from flexfa.runtime.options import DEFAULT_OPTIONS
    storage = torch.zeros(2 * 40 * 16 + 8, dtype=torch.float16)
    aligned = storage[:2 * 40 * 16].view(1, 2, 40, 16)
    off8 = storage[4:4 + 2 * 40 * 16].view(1, 2, 40, 16)  # 8 bytes in
    off16 = storage[8:8 + 2 * 40 * 16].view(1, 2, 40, 16)  # 16 bytes in
    assert aligned.data_ptr() % 16 == 0
    call = AttentionCall(None, None, None, 0.25, DEFAULT_OPTIONS, 1)
    key = lambda q: plans.layout_key(q, aligned, aligned, call)
    assert key(aligned) != key(off8)
    assert key(aligned) == key(off16)


@pytest.mark.parametrize("typo", ["fwd_SPLITKV", "bwd_determinstic"])
def test_a_typos_suggestion_is_a_spelling_that_parses(typo):
    """A call-wide key takes no fwd_ / bwd_ prefix: the suggestion for a prefixed typo of one
    named the refused prefixed spelling."""
    with pytest.raises(InputError, match="did you mean") as error:
        parse_kernel_options({typo: 2})
    suggestion = str(error.value).split("did you mean ")[1].split("?")[0].strip("'")
    try:
        parse_kernel_options({suggestion: 2})  # (2 may be no value of that key)
    except (InputError, InputTypeError) as again:
        assert "unknown key" not in str(again) and "whole call" not in str(again), suggestion
