"""``kernel_options`` (``flexfa.runtime.options``): torch's keys with fwd_/bwd_ prefixes, hints
accepted and logged once, unknown keys and wrong types refused with the key named (and a
suggestion for a typo), the FLEXFA_BACKEND default, and BACKEND forcing a family that cannot
run the call refused with the reason. Parsing only: nothing here launches a kernel."""
import logging

import pytest
import torch

import flexfa
from flexfa.errors import InputError, InputTypeError
from flexfa.memo import BoundedMemo
from flexfa.runtime import options as options_module
from flexfa.runtime.options import (DEFAULT_OPTIONS, HINTS, SCHEMA, KernelOptions,
                                    parse_kernel_options)


@pytest.fixture
def fresh_log(monkeypatch):
    """Nothing logged or parsed yet in this process (what is logged once is logged when a
    dict is first parsed)."""
    monkeypatch.setattr(options_module, "_LOGGED", set())
    monkeypatch.setattr(options_module, "_PARSED", BoundedMemo(256, "parsed kernel_options"))


def test_defaults():
    assert parse_kernel_options(None) == parse_kernel_options({}) == DEFAULT_OPTIONS
    assert DEFAULT_OPTIONS.backend == "AUTO" and DEFAULT_OPTIONS.split_kv is None
    assert DEFAULT_OPTIONS.ds_workspace is None and DEFAULT_OPTIONS.fwd.use_tma is None
    assert not DEFAULT_OPTIONS.fwd.pins_tiles and not DEFAULT_OPTIONS.bwd.pins_tiles
    parsed = parse_kernel_options({"BLOCK_M": 32})
    assert parse_kernel_options(parsed) is parsed  # already parsed: taken as it is


def test_none_is_the_default_of_every_key(fresh_log, caplog):
    """{"SPLIT_KV": None} was an InputTypeError (USE_TMA, DS_WORKSPACE took None): a value None
    is the key's default, as if the key were absent, for every key and prefix."""
    keys = [*SCHEMA, *HINTS]
    keys += [f"{p}_{k}" for k in SCHEMA for p in SCHEMA[k][1]]
    with caplog.at_level("INFO", logger="flexfa"):
        assert parse_kernel_options({k: None for k in keys}) == DEFAULT_OPTIONS
        for key in keys:
            assert parse_kernel_options({key: None}) == DEFAULT_OPTIONS, key
    assert not caplog.records  # a hint key set to None changes nothing worth a line either
    assert parse_kernel_options({"BLOCK_M": 64, "bwd_BLOCK_M": None}).bwd.block_m == 64
    with pytest.raises(InputError, match="unknown key 'SPLITKV'"):
        parse_kernel_options({"SPLITKV": None})
    with pytest.raises(InputError, match=r"SPLIT_KV applies to the whole call"):
        parse_kernel_options({"fwd_SPLIT_KV": None})
    q, k, v = _qkv()
    want = flexfa.flex_attention(q, k, v)
    assert torch.equal(flexfa.flex_attention(q, k, v, kernel_options={"SPLIT_KV": None}), want)


def test_bare_keys_apply_to_both_passes_and_prefixed_ones_win():
    both = parse_kernel_options({"BLOCK_M": 32, "num_warps": 8, "num_stages": 2,
                                 "USE_TMA": False})
    for one in (both.fwd, both.bwd):
        assert (one.block_m, one.num_warps, one.num_stages, one.use_tma) == (32, 8, 2, False)
    assert both.fwd.pins_tiles and both.bwd.pins_tiles
    for order in (("fwd_BLOCK_M", "BLOCK_M"), ("BLOCK_M", "fwd_BLOCK_M")):  # any order
        values = {"fwd_BLOCK_M": 64, "BLOCK_M": 32}
        parsed = parse_kernel_options({key: values[key] for key in order})
        assert (parsed.fwd.block_m, parsed.bwd.block_m) == (64, 32)
    split = parse_kernel_options({"fwd_USE_TMA": True, "bwd_USE_TMA": False, "bwd_num_warps": 4})
    assert (split.fwd.use_tma, split.bwd.use_tma) == (True, False)
    assert (split.fwd.num_warps, split.bwd.num_warps) == (None, 4)
    assert split.num_warps is None and split.block_m is None  # the forward's fields
    assert parse_kernel_options({"fwd_maxnreg": 128}).max_registers == 128
    assert parse_kernel_options({"USE_TMA": "auto"}).bwd.use_tma is None


def test_backward_tiles_take_torchs_names():
    parsed = parse_kernel_options({"BLOCK_M1": 16, "BLOCK_N1": 32, "bwd_BLOCK_M2": 64,
                                   "BLOCK_N2": 128})
    bwd = parsed.bwd
    assert (bwd.block_m1, bwd.block_n1, bwd.block_m2, bwd.block_n2) == (16, 32, 64, 128)
    assert bwd.pins_tiles and not parsed.fwd.pins_tiles


def test_call_wide_keys():
    parsed = parse_kernel_options({"SPLIT_KV": "auto", "DS_WORKSPACE": True,
                                   "DS_MAX_BYTES": 1 << 20, "deterministic": True,
                                   "fp32_precision": "tf32", "BACKEND": "hopper"})
    assert (parsed.split_kv, parsed.ds_workspace, parsed.ds_max_bytes) == ("AUTO", True, 1 << 20)
    assert parsed.deterministic and parsed.fp32_precision == "tf32"
    assert parsed.backend == "HOPPER"  # case-insensitive
    assert parse_kernel_options({"SPLIT_KV": 8}).split_kv == 8
    assert parse_kernel_options({"DS_WORKSPACE": "AUTO"}).ds_workspace is None
    assert parse_kernel_options({"BACKEND": "TRITON"}) == DEFAULT_OPTIONS  # every kernel is
    assert not DEFAULT_OPTIONS.gluon_pingpong
    pingpong = parse_kernel_options({"GLUON_PINGPONG": True})
    assert pingpong.gluon_pingpong and pingpong != DEFAULT_OPTIONS
    assert not DEFAULT_OPTIONS.gluon_tma_store
    assert parse_kernel_options({"GLUON_TMA_STORE": True}).gluon_tma_store


def _hint_values(key):
    """Two valid values of a torch key flexfa ignores, and one of the wrong type."""
    return (True, False, "yes") if key.isupper() else (2, 16, 1.5)


@pytest.mark.parametrize("key", sorted(HINTS))
def test_torch_hint_keys_are_accepted_and_logged_once(key, fresh_log, caplog):
    first, second, wrong = _hint_values(key)
    with caplog.at_level(logging.INFO, logger="flexfa"):
        assert parse_kernel_options({key: first}) == DEFAULT_OPTIONS
        assert parse_kernel_options({key: second, "BLOCK_N": 16}).fwd.block_n == 16
    logged = [r.getMessage() for r in caplog.records if repr(key) in r.getMessage()]
    assert len(logged) == 1 and "changes nothing here" in logged[0] and HINTS[key][1] in logged[0]
    # checked like flexfa's own keys: a wrong type is an error naming the key, not ignored
    with pytest.raises(InputTypeError, match=key):
        parse_kernel_options({key: wrong})
    with pytest.raises(InputTypeError, match=key):
        parse_kernel_options({f"fwd_{key}": wrong})


@pytest.mark.parametrize("backend", ["TRITON_DECODE", "FLASH"])
def test_torchs_other_backends_run_flexfas_choice_and_are_logged(backend, fresh_log, caplog):
    with caplog.at_level(logging.INFO, logger="flexfa"):
        assert parse_kernel_options({"BACKEND": backend}).backend == "AUTO"
    assert any(f"BACKEND={backend}" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("key, suggestion", [
    ("BLOCK_MM", "BLOCK_M"), ("num_warp", "num_warps"), ("SPLITKV", "SPLIT_KV"),
    ("fwd_BLOCK_MM", "fwd_BLOCK_M"), ("DS_WORKSPAC", "DS_WORKSPACE"),
    ("PRESCALE_Q", "PRESCALE_QK"), ("use_tma", "USE_TMA"), ("Num_Stages", "num_stages")])
def test_a_typo_is_refused_with_a_suggestion(key, suggestion):
    with pytest.raises(InputError, match=rf"unknown key '{key}' \(did you mean '{suggestion}'\?\)"):
        parse_kernel_options({key: 32})
    q = torch.zeros(1, 1, 16, 16)
    with pytest.raises(InputError, match=rf"unknown key '{key}'"):  # through the front door
        flexfa.flex_attention(q, q, q, kernel_options={key: 32})


@pytest.mark.parametrize("key", ["TILE", 3])
def test_unknown_keys_list_the_allowed_ones(key):
    with pytest.raises(InputError, match="unknown key.*the keys are BLOCK_M: .*SPLIT_KV: .*"
                                         "fwd_ or bwd_ prefix") as error:
        parse_kernel_options({key: 1})
    assert "did you mean" not in str(error.value)


@pytest.mark.parametrize("key, right", [("fwd_BLOCK_M1", "bwd_BLOCK_M1"),
                                        ("fwd_BLOCK_N2", "bwd_BLOCK_N2"),
                                        ("bwd_maxnreg", "fwd_maxnreg"),
                                        ("fwd_SPLIT_KV", "SPLIT_KV"),
                                        ("bwd_DS_WORKSPACE", "DS_WORKSPACE"),
                                        ("fwd_BACKEND", "BACKEND")])
def test_a_prefix_on_a_key_of_the_other_pass_names_the_right_spelling(key, right):
    with pytest.raises(InputError, match=rf"kernel_options\['{key}'\]: .* applies to .*; "
                                         rf"write '{right}'"):
        parse_kernel_options({key: 16})


@pytest.mark.parametrize("options, error, message", [
    ({"BLOCK_M": "32"}, InputTypeError, r"\['BLOCK_M'\] must be an int, got str '32'"),
    ({"BLOCK_M": 32.0}, InputTypeError, r"\['BLOCK_M'\] must be an int, got float 32.0"),
    ({"BLOCK_M": True}, InputTypeError, r"\['BLOCK_M'\] must be an int, got bool True"),
    ({"BLOCK_M": 24}, InputError, r"\['BLOCK_M'\] = 24 is not allowed; a power of two"),
    ({"bwd_BLOCK_N1": 512}, InputError, r"\['bwd_BLOCK_N1'\] = 512 is not allowed"),
    ({"num_warps": 3}, InputError, r"\['num_warps'\] = 3 is not allowed; 1, 2, 4, 8 or 16"),
    ({"num_stages": 0}, InputError, r"\['num_stages'\] = 0 is not allowed; 1..8"),
    ({"maxnreg": 100}, InputError, r"\['maxnreg'\] = 100 is not allowed; 0 for none, or a "
                                   "multiple of 8"),
    ({"USE_TMA": 1}, InputTypeError, r"\['USE_TMA'\] must be True, False or 'AUTO', got int 1"),
    ({"bwd_USE_TMA": "yes"}, InputTypeError, r"\['bwd_USE_TMA'\] must be True, False or 'AUTO', got str"),
    ({"deterministic": 0}, InputTypeError, r"\['deterministic'\] must be a bool, got int 0"),
    ({"GLUON_PINGPONG": 1}, InputTypeError, r"\['GLUON_PINGPONG'\] must be a bool, got int 1"),
    ({"GLUON_TMA_STORE": "yes"}, InputTypeError,
     r"\['GLUON_TMA_STORE'\] must be a bool, got str 'yes'"),
    ({"DS_WORKSPACE": 1}, InputTypeError, r"\['DS_WORKSPACE'\] must be True, False or 'AUTO', got int 1"),
    ({"DS_MAX_BYTES": 0}, InputError, r"\['DS_MAX_BYTES'\] = 0 is not allowed; a positive"),
    ({"DS_MAX_BYTES": 1.5}, InputTypeError, r"\['DS_MAX_BYTES'\] must be an int, got float"),
    ({"SPLIT_KV": 2000}, InputError, r"\['SPLIT_KV'\] = 2000 is not allowed; 0 \(never\)"),
    ({"SPLIT_KV": "many"}, InputTypeError, r"\['SPLIT_KV'\] must be an int or 'AUTO', got str 'many'"),
    ({"fp32_precision": "bf16"}, InputError, r"\['fp32_precision'\] must be 'ieee' or 'tf32', "
                                             "got 'bf16'"),
    # torch's fp32_precision strings are lower case ('IEEE' is an error there too)
    ({"fp32_precision": "IEEE"}, InputError, r"\['fp32_precision'\] must be 'ieee' or 'tf32' "
                                             r"\(lower case, .*got 'IEEE'"),
    ({"fp32_precision": "Tf32"}, InputError, r"\(lower case, .*got 'Tf32'"),
    ({"fp32_precision": 1}, InputTypeError, r"\['fp32_precision'\] .* got int 1"),
    ({"BACKEND": "CUTLASS"}, InputError, r"\['BACKEND'\] must be one of \['AUTO', 'TRITON', "
                                         r"'AMPERE', 'HOPPER'.*got 'CUTLASS'"),
    # (an InputError, a ValueError, until the forty-fourth session: the docs say wrong types
    # are InputTypeErrors)
    ({"BACKEND": 1}, InputTypeError, r"\['BACKEND'\] must be a str, one of .* got int 1"),
    ({"BACKEND": ["HOPPER"]}, InputTypeError, r"\['BACKEND'\] must be a str, .* got list"),
    ({"DECODE_WALK": True}, InputTypeError, r"\['DECODE_WALK'\] must be a str, .* got bool"),
    ({"BLOCK_M": [32]}, InputTypeError, r"\['BLOCK_M'\] must be an int, got list \[32\]"),
])
def test_wrong_values_name_the_key_and_the_value(options, error, message):
    with pytest.raises(error, match=message):
        parse_kernel_options(options)


def test_numpy_bools_are_bools_and_not_ints():
    """A numpy bool (what indexing a numpy bool array gives) was refused where a bool is
    taken; it is still no int, and a numpy int is still no bool."""
    numpy = pytest.importorskip("numpy")
    parsed = parse_kernel_options({"deterministic": numpy.bool_(True), "USE_TMA": numpy.False_,
                                   "GLUON_PERSISTENT": numpy.True_, "DS_WORKSPACE": numpy.True_,
                                   "PRESCALE_QK": numpy.True_})
    assert parsed == parse_kernel_options({"deterministic": True, "USE_TMA": False,
                                           "GLUON_PERSISTENT": True, "DS_WORKSPACE": True})
    assert type(parsed.deterministic) is bool and type(parsed.fwd.use_tma) is bool
    for options in ({"BLOCK_M": numpy.True_}, {"SPLIT_KV": numpy.True_},
                    {"deterministic": numpy.int64(1)}, {"USE_TMA": numpy.int64(0)}):
        with pytest.raises(InputTypeError, match=r"must be (an int|a bool|True, False)"):
            parse_kernel_options(options)


def test_not_a_dict():
    for bad in ([("BLOCK_M", 32)], "BLOCK_M=32", KernelOptions):
        with pytest.raises(InputTypeError, match="kernel_options must be a dict or None, got"):
            parse_kernel_options(bad)


def test_a_valid_value_does_not_validate_an_equal_one_of_another_type():
    """Parsed options are memoized by the dict's items: True == 1 and 32 == 32.0 hash alike,
    so a memo keyed by the items alone answered a wrong type with the valid twin's options."""
    for valid, wrong in (({"USE_TMA": True}, {"USE_TMA": 1}),
                         ({"BLOCK_M": 32}, {"BLOCK_M": 32.0}),
                         ({"deterministic": False}, {"deterministic": 0}),
                         ({"SPLIT_KV": 1}, {"SPLIT_KV": True})):
        parse_kernel_options(valid)
        with pytest.raises(InputTypeError, match="must be (an? (int|bool)|True, False or 'AUTO')"):
            parse_kernel_options(wrong)


def test_parsed_options_are_hashable_values():
    a = parse_kernel_options({"BLOCK_M": 32, "USE_TMA": False})
    b = parse_kernel_options(dict(reversed(list({"BLOCK_M": 32, "USE_TMA": False}.items()))))
    assert a == b and hash(a) == hash(b)
    assert a != parse_kernel_options({"BLOCK_M": 32})
    assert a != parse_kernel_options({"BLOCK_M": 32, "fwd_USE_TMA": False})  # the bwd differs
    unhashable = {"BLOCK_M": 32, "USE_TMA": False, "PRESCALE_QK": [1]}  # validated, not memoized
    for _ in range(2):
        with pytest.raises(InputTypeError, match="PRESCALE_QK"):
            parse_kernel_options(unhashable)


def test_flexfa_backend_sets_the_default_only(monkeypatch):
    monkeypatch.setenv("FLEXFA_BACKEND", "ampere")
    assert parse_kernel_options({}).backend == "AMPERE"
    assert parse_kernel_options({"BACKEND": "HOPPER"}).backend == "HOPPER"
    monkeypatch.setenv("FLEXFA_BACKEND", "hopper")  # the memo is keyed by it too
    assert parse_kernel_options({}).backend == "HOPPER"
    for torch_name in ("TRITON", "FLASH"):
        monkeypatch.setenv("FLEXFA_BACKEND", torch_name)
        assert parse_kernel_options({}).backend == "AUTO"
    monkeypatch.setenv("FLEXFA_BACKEND", "cutlass")
    with pytest.raises(InputError, match=r"FLEXFA_BACKEND='CUTLASS' must be one of \['AUTO'"):
        parse_kernel_options({})
    monkeypatch.delenv("FLEXFA_BACKEND")
    assert parse_kernel_options({}).backend == "AUTO"


def _qkv(dtype=torch.bfloat16, E=16, L=32):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, L, E, generator=generator).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("inputs, options, reason", [
    (_qkv(torch.float32), {"BACKEND": "HOPPER"}, "fp16/bf16 q, k, v with head dims 8..256"),
    (_qkv(E=4), {"BACKEND": "HOPPER"}, "fp16/bf16 q, k, v with head dims 8..256"),
    ([t.transpose(2, 3).contiguous().transpose(2, 3) for t in _qkv()], {"BACKEND": "HOPPER"},
     r"each a \[B \* H \* len, dim\] matrix or strided"),
    (_qkv(), {"BACKEND": "HOPPER", "USE_TMA": False}, "kernel_options USE_TMA=False"),
    (_qkv(), {"BACKEND": "AMPERE", "USE_TMA": True}, "USE_TMA=True asks for the "
                                                     r"tensor-descriptor \(Hopper\) family"),
    (_qkv(), {"BACKEND": "AMPERE", "fwd_USE_TMA": True}, "USE_TMA=True"),
])
def test_forcing_a_family_that_cannot_run_the_call_names_the_reason(inputs, options, reason):
    q, k, v = inputs
    with pytest.raises(InputError, match=rf"kernel_options BACKEND='{options['BACKEND']}' "
                                         rf"cannot run this call: .*{reason}"):
        flexfa.flex_attention(q, k, v, kernel_options=options)


def test_forcing_the_forward_family_leaves_the_backward_alone():
    """BACKEND names a forward family; the backward (one family) runs as usual, with the
    gradients of a call without options."""
    grads = []
    for options in ({"BACKEND": "AMPERE"}, None):
        q, k, v = (t.requires_grad_() for t in _qkv(torch.float32))
        out = flexfa.flex_attention(q, k, v, kernel_options=options)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for forced, plain in zip(*grads):
        assert torch.isfinite(forced).all() and torch.equal(forced, plain)
