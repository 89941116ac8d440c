"""The Gluon forward family on the CPU: when it applies (forced, or by default in the classes
where it measured faster; sm_90, never the interpreter), the specs it plans, how the mods are
rendered into fwd_gluon.tmpl (index vectors and broadcasts in the score tile's layout), its
GLUON_PINGPONG and GLUON_TMA_STORE options, and the ping-pong turns' phase protocol checked in
every interleaving. Its sm_90 compile check is in test_gluon_compile.py, its GPU tests in
tests/gpu/test_gluon_gpu.py."""
from __future__ import annotations

import re

import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.codegen.forward import mask_mod_code, score_mod_code
from flexfa.codegen.gluon import GLUON_TILE, gluon_kernel
from flexfa.frontend.trace import MASK_MOD, SCORE_MOD, trace
from flexfa.runtime import registry
from flexfa.runtime.call import AttentionCall, Dropout
from flexfa.runtime.families.gluon import GLUON, SHARED_BYTES, gluon_spec, shared_bytes
from flexfa.runtime.families.gluon_bwd import why_not_gluon_bwd
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.pipeline import prepare_mask, prepare_score_mod
from flexfa.runtime.target import INTERPRETER, Target

SM90, SM80 = Target("cuda", 9, 0), Target("cuda", 8, 0)
FORCED = {"BACKEND": "GLUON"}


def _call(options=None, block_mask=None, score_mod=None, dropout=None, sinks=None):
    return AttentionCall(prepare_score_mod(score_mod), prepare_mask(block_mask), block_mask,
                         0.125, parse_kernel_options(options), 1, sinks=sinks,
                         dropout=None if dropout is None else Dropout(dropout, torch.zeros(2)))


def _qkv(L=256, E=128, dtype=torch.bfloat16):
    return tuple(torch.zeros(1, 2, L, E, dtype=dtype) for _ in range(3))


def test_gluon_runs_when_forced_on_sm90_only():
    q, k, v = _qkv()
    assert registry.choose("forward", SM90, _call(FORCED), q, k, v) is GLUON
    with pytest.raises(flexfa.InputError, match="BACKEND='GLUON'.*interpreter"):
        registry.choose("forward", INTERPRETER, _call(FORCED), q, k, v)
    with pytest.raises(flexfa.InputError, match="sm_90, not cuda:80"):
        registry.choose("forward", SM80, _call(FORCED), q, k, v)
    assert registry.choose("forward", SM90, _call({"BACKEND": "HOPPER"}), q, k, v).name \
        == "hopper"


def _mask(mask_mod, L):
    return flexfa.create_block_mask(mask_mod, None, None, L, L, device="cpu")


def _window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() < 256


def _document2048(b, h, q_idx, kv_idx):  # 16 documents of 128 tokens: a sparse mask at 2048
    return q_idx // 128 == kv_idx // 128


@pytest.mark.parametrize("L, E, mask_mod, options, chosen", [
    (2048, 128, None, None, "gluon"),        # dense, short: measured 1.15x Hopper
    (16384, 128, None, None, "gluon"),       # dense, long: 1.26x
    (8192, 128, mods.causal, None, "gluon"),  # masked, long: 1.03-1.15x
    (2048, 128, mods.causal, None, "gluon"),  # masked, short: 0.81-0.88x the time (groups)
    (8192, 128, _window, None, "gluon"),     # sparse, long: 0.88-0.92x the time (dynamic)
    (2048, 128, _document2048, None, "gluon"),  # sparse, short: 0.95x the time (dynamic)
    (16384, 64, None, None, "hopper"),       # E = 64 dense: 0.77-1.02x
    (16384, 64, mods.causal, None, "gluon"),  # E = 64 masked, long: 0.93-0.98x the time
    (2048, 64, mods.causal, None, "hopper"),  # E = 64 masked, short: not measured
    (16384, 64, _window, None, "hopper"),    # E = 64 sparse: 1.15x the time
    (16384, 256, None, None, "gluon"),       # E = 256 dense, long: 2.21x
    (8192, 256, mods.causal, None, "gluon"),  # E = 256 masked, long: 2.31-2.36x
    (2048, 256, mods.causal, None, "gluon"),  # E = 256 masked, short: 2.06x
    (8192, 256, _window, None, "gluon"),     # E = 256 sparse: 1.98-2.0x
    (1024, 256, None, None, "hopper"),       # E = 256 shorter than measured
    (8192, (192, 128), mods.causal, None, "gluon"),  # padded 256/128: 1.41-1.50x
    (2048, (192, 128), None, None, "gluon"),
    (8192, (192, 128), _window, None, "hopper"),  # sparse: not measured
    (8192, 96, None, None, "gluon"),           # padded 128: 1.11-1.34x
    (2048, 96, mods.causal, None, "gluon"),
    (8192, 80, None, None, "gluon"),           # padded 128: 1.13-1.35x
    (2048, 80, mods.causal, None, "gluon"),
    (8192, 80, _window, None, "hopper"),       # sparse: not measured
    (8192, 48, None, None, "hopper"),          # padded 64: 0.98-1.05x
    (8192, 192, None, None, "hopper"),         # 192 / 192 pads to 256 / 256: not measured
    (8192, (96, 128), None, None, "hopper"),   # not measured
    (1024, 128, None, None, "hopper"),       # shorter than measured
    (2048, 128, None, {"BLOCK_N": 64}, "hopper"),  # tiles pinned for the Hopper family
    (2048, 128, None, {"BACKEND": "HOPPER"}, "hopper"),
])
def test_auto_takes_gluon_only_in_the_classes_where_it_measured_faster(L, E, mask_mod,
                                                                          options, chosen):
    E, Ev = E if isinstance(E, tuple) else (E, E)
    q, k, v = (torch.empty(1, 1, L, dim, dtype=torch.bfloat16) for dim in (E, E, Ev))
    call = _call(options, _mask(mask_mod, L) if mask_mod else None)
    assert registry.choose("forward", SM90, call, q, k, v).name == chosen
    if call.options.backend == "AUTO":
        assert registry.choose("forward", SM80, call, q, k, v).name == "ampere"
        assert registry.choose("forward", INTERPRETER, call, q, k, v).name != "gluon"


@pytest.mark.parametrize("L, E, mask_mod, chosen", [
    (4096, 128, mods.causal, "gluon"),   # masked, short: as without dropout
    (2048, 128, mods.causal, "gluon"),
    (4096, 128, None, "gluon"),          # dense, as without dropout
    (8192, 256, mods.causal, "gluon"),
    (4096, 64, mods.causal, "hopper"),   # E = 64: 1.06x the Hopper's time
    (16384, 64, mods.causal, "hopper"),  # E = 64 masked, long: not measured with dropout
    (4096, 128, _window, "gluon"),       # sparse: as without dropout (not measured with it)
])
def test_auto_with_dropout_takes_gluon_where_measured_faster(L, E, mask_mod, chosen):
    """dropout_p: the Gluon forward has the keep mask (its Philox words overlap the other
    consumer's GEMMs); AUTO takes it in the classes it takes without dropout (E = 128 masked
    calls of short keys measured 0.87x the Hopper family's time with it before they were
    taken without), with sinks too (folded in the epilogue, HAS_SINKS)."""
    q, k, v = (torch.empty(1, 1, L, E, dtype=torch.bfloat16) for _ in range(3))
    mask = _mask(mask_mod, L) if mask_mod else None
    assert registry.choose("forward", SM90, _call(None, mask, dropout=0.1), q, k, v).name \
        == chosen
    if (L, E, mask_mod) == (4096, 128, mods.causal):
        assert registry.choose("forward", SM90, _call(None, mask), q, k, v).name == "gluon"
        call = _call(None, mask, dropout=0.1, sinks=torch.zeros(1))
        assert registry.choose("forward", SM90, call, q, k, v).name == "gluon"
        assert GLUON.why_not(SM90, _call(FORCED, mask, dropout=0.1), q, k, v) is None


def test_gluon_sinks_are_in_the_spec_key_and_parameters():
    """HAS_SINKS: the sinks' element type is in the spec (a kernel of its own, with SINKS
    among its parameters and HAS_SINKS on); a call without sinks keeps the kernel it had."""
    q, k, v = _qkv()
    plain = gluon_spec(q, k, v, _call(FORCED), SM90, False, False)
    with_sinks = gluon_spec(q, k, v, _call(FORCED, sinks=torch.zeros(2)), SM90, False, False)
    assert plain.sinks_dtype == "" and with_sinks.sinks_dtype == "fp32"
    kernel, base = gluon_kernel(with_sinks, None, None), gluon_kernel(plain, None, None)
    assert kernel.name != base.name
    assert "HAS_SINKS = tl.constexpr(True)" in kernel.source
    assert "HAS_SINKS = tl.constexpr(False)" in base.source
    def sinks_parameter(generated):  # (HAS_SINKS is a constexpr parameter of both)
        parameters = generated.source.split(f"def {generated.name}(")[1].split("):")[0]
        return re.search(r"\bSINKS\b", parameters) is not None
    assert sinks_parameter(kernel) and not sinks_parameter(base)


def test_gluon_dropout_is_in_the_spec_key_and_parameters():
    q, k, v = _qkv()
    plain = gluon_spec(q, k, v, _call(FORCED), SM90, False, False)
    dropped = gluon_spec(q, k, v, _call(FORCED, dropout=0.2), SM90, False, False)
    assert not plain.dropout and dropped.dropout
    with_mask = gluon_kernel(dropped, None, None)
    assert with_mask.name != gluon_kernel(plain, None, None).name
    assert {"DROPOUT_SEED", "dropout_threshold", "dropout_scale"} <= set(with_mask.params)
    assert "DROPOUT = tl.constexpr(True)" in with_mask.source
    assert "DROPOUT_SEED" not in gluon_kernel(plain, None, None).params


def _at_offset(L, S):
    def causal_at_offset(b, h, q_idx, kv_idx):  # the queries are the last L positions
        return q_idx + (S - L) >= kv_idx
    return causal_at_offset


@pytest.mark.parametrize("B, H, L, S, E, masked, chosen", [
    (1, 32, 512, 8192, 128, True, "gluon"),    # 128 programs: measured 1.45x the split Hopper
    (4, 32, 128, 32768, 128, False, "gluon"),  # 128 programs (dense keys: the same class walk)
    (1, 25, 512, 8192, 128, False, "gluon"),   # 100 programs: 0.76 of 132 SMs
    (1, 24, 512, 8192, 128, False, "hopper"),  # 96: under AUTO_MIN_FILL of the SMs
    (1, 32, 128, 8192, 128, True, "hopper"),   # 32 programs: measured 0.71x
    (1, 32, 512, 4096, 128, False, "hopper"),  # short keys: not measured
    (1, 32, 512, 8192, 64, False, "hopper"),   # E = 64: not measured
])
def test_auto_takes_gluon_for_short_queries_where_its_grid_fills_the_sms(B, H, L, S, E, masked,
                                                                         chosen):
    q = torch.empty(B, H, L, E, dtype=torch.bfloat16)
    k = v = torch.empty(B, H, S, E, dtype=torch.bfloat16)
    mask = flexfa.create_block_mask(_at_offset(L, S), None, None, L, S, device="cpu",
                                    BLOCK_SIZE=128) if masked else None
    family = registry.choose("forward", SM90, _call(None, mask), q, k, v)
    assert family.name == chosen
    if chosen == "hopper":
        assert "BACKEND='AUTO'" in GLUON.why_not(SM90, _call(None, mask), q, k, v)


@pytest.mark.parametrize("make, reason", [
    (lambda: _qkv(E=32), "pad to one of 64/64, 128/128, 256/128, 256/256"),
    (lambda: _qkv(E=128)[:2] + _qkv(E=256)[2:], "not E=128, Ev=256 (padded 128/256)"),
    (lambda: _qkv(dtype=torch.float32), "fp16/bf16"),
    (lambda: tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv()), "aligned"),
])
def test_gluon_reasons(make, reason):
    q, k, v = make()
    assert reason in GLUON.why_not(SM90, _call(FORCED), q, k, v)


def test_gluon_block_mask_blocks_and_pinned_tiles():
    q, k, v = _qkv()
    small = flexfa.create_block_mask(mods.causal, None, None, 256, 256, device="cpu",
                                     BLOCK_SIZE=64)
    assert "multiples of (128, 64)" in GLUON.why_not(SM90, _call(FORCED, small), q, k, v)
    assert "BLOCK_M=128" in GLUON.why_not(SM90, _call({**FORCED, "BLOCK_M": 64}), q, k, v)
    mask = flexfa.create_block_mask(mods.causal, None, None, 256, 256, device="cpu",
                                    BLOCK_SIZE=(128, 64))
    call = _call({**FORCED, "num_stages": 3}, mask)
    assert GLUON.why_not(SM90, call, q, k, v) is None
    spec = gluon_spec(q, k, v, call, SM90, True, False)
    assert (spec.block_m, spec.block_n, spec.num_stages, spec.sparse_kv) == (128, 64, 3, 64)
    assert spec.has_block_mask and spec.even_l and spec.max_registers == 168
    with pytest.raises(flexfa.InputError, match="BLOCK_N=128 must divide"):
        gluon_spec(q, k, v, _call({**FORCED, "BLOCK_N": 128}, mask), SM90, True, False)
    dense = gluon_spec(*_qkv(L=200, E=64), _call(FORCED), SM90, False, True)
    assert (dense.block_n, dense.num_stages, dense.even_l, dense.even_s) == (128, 3, False, False)
    for block_n in (16, 32):  # without a mask too (it launched such tiles)
        with pytest.raises(flexfa.InputError, match=f"BLOCK_N={block_n}: the Gluon forward's "
                                                    "key tile must be >= 64"):
            gluon_spec(*_qkv(E=64), _call({**FORCED, "BLOCK_N": block_n}), SM90, False, True)


def test_head_dim_256_takes_64_key_tiles_and_overfull_pins_are_named():
    """E = 256: 64-key tiles in a 2-stage ring (193 KB of shared memory); pins that would not
    fit sm_90's 227 KB fail before any compile, naming the options and the defaults."""
    q, k, v = _qkv(E=256)
    assert GLUON.why_not(SM90, _call(FORCED), q, k, v) is None
    spec = gluon_spec(q, k, v, _call(FORCED), SM90, True, False)
    assert (spec.head_dim, spec.block_n, spec.num_stages) == (256, 64, 2)
    assert shared_bytes(256, 256, 64, 2, False) <= SHARED_BYTES < \
        shared_bytes(256, 256, 64, 3, False)
    for options, words in (({"BLOCK_N": 128}, "BLOCK_N=128, num_stages=2 needs 324 KB"),
                           ({"num_stages": 3}, "BLOCK_N=64, num_stages=3 needs 260 KB"),
                           ({"GLUON_TMA_STORE": True}, "GLUON_TMA_STORE needs 260 KB")):
        with pytest.raises(flexfa.InputError, match=words) as info:
            gluon_spec(q, k, v, _call({**FORCED, **options}), SM90, True, False)
        assert "BLOCK_N=64, num_stages=2)" in str(info.value)
        assert "head dim 256 with" in str(info.value)
    # E = 128 keeps what ran on the H200, and its third stage does not fit
    assert shared_bytes(128, 128, 128, 2, True) <= SHARED_BYTES < \
        shared_bytes(128, 128, 128, 3, False)
    # the Gluon backward (bwd_gluon_wide.tmpl) takes it under GLUON_BACKWARD=True; 'AUTO' not
    # at 256 without dropout where the Triton backward's full-block walk (BWD_FULL_WALK 'AUTO',
    # the default) runs, and with that walk off at lengths past 4096 only (where it was
    # measured), and not with v's head dim 128
    call = _call({**FORCED, "GLUON_BACKWARD": True})
    assert why_not_gluon_bwd(SM90, call, q, k, v) is None
    assert "full-block walk" in why_not_gluon_bwd(SM90, _call(FORCED), q, k, v)
    assert "GLUON_BACKWARD='AUTO' takes it for L and S past 4096" in why_not_gluon_bwd(
        SM90, _call({**FORCED, "BWD_FULL_WALK": False}), q, k, v)
    q, k = _qkv(L=8192, E=192)[:2]
    v = torch.zeros(1, 2, 8192, 128, dtype=torch.bfloat16)
    assert why_not_gluon_bwd(SM90, call, q, k, v) is None
    assert ("GLUON_BACKWARD='AUTO' takes head dims 64, 80 to 128 and 256, v's alike"
            in why_not_gluon_bwd(SM90, _call(FORCED), q, k, v))


def test_cpu_tensors_say_why_gluon_cannot_run():
    q, k, v = (torch.randn(1, 2, 128, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(flexfa.InputError, match="interpreter"):
        flexfa.flex_attention(q, k, v, kernel_options=FORCED)


def _bias_of_head():
    bias = torch.tensor([0.5, -1.0])

    def head_bias(score, b, h, q_idx, kv_idx):
        return bias[h] + 0.0 * score
    return head_bias


@pytest.mark.parametrize("render, mod, kind, expected", [
    # a value that is not a tile by itself is broadcast in the score tile's layout
    (score_mod_code, lambda s, b, h, q, kv: s * 0.0 + 2.0, SCORE_MOD, None),
    (score_mod_code, lambda s, b, h, q, kv: 1.0 + h, SCORE_MOD,
     "gl.full([ROWS, BLOCK_N], 0.0, tl.float32, S_LAYOUT) + "),
    (mask_mod_code, lambda b, h, q, kv: h == 0, MASK_MOD,
     "gl.full([ROWS, BLOCK_N], 1, tl.int1, S_LAYOUT) & "),
    (mask_mod_code, mods.causal, MASK_MOD, None),
])
def test_gluon_broadcasts_in_the_score_layout(render, mod, kind, expected):
    code = render(trace(mod, kind), [], tile=GLUON_TILE)
    assert "tl.full" not in code
    if expected is None:
        assert "gl.full" not in code
    else:
        assert expected in code


def test_gluon_module_renders_mods_and_captured_tensors():
    q, k, v = _qkv()
    mask = flexfa.create_block_mask(mods.causal, None, None, 256, 256, device="cpu")
    call = _call(FORCED, mask, mods.softcap(30.0))
    spec = gluon_spec(q, k, v, call, SM90, True, False)
    generated = gluon_kernel(spec, call.score, call.mask)
    source = generated.source
    assert generated.name.startswith("flexfa_fwd_gluon_d128_bf16_")
    assert "from triton.experimental import gluon" in source
    assert f"@gluon.jit\ndef {generated.name}(" in source
    assert "gl.warp_specialize" in source and "m0 = (kv_idx <= q_idx)" in source
    assert "flexfa_fast_tanh(" in source  # GPU rendering: the hardware tanh
    assert "STAGES = tl.constexpr(2)" in source
    assert generated.params[:3] == ("Q_DESC", "K_DESC", "V_DESC")
    with pytest.raises(AssertionError, match="interpreted"):
        gluon_kernel(gluon_spec(q, k, v, call, INTERPRETER, True, False), call.score, call.mask)


def test_gluon_key_covers_stages_and_mods():
    q, k, v = _qkv()
    call = _call(FORCED)
    two = gluon_spec(q, k, v, call, SM90, False, False)
    three = gluon_spec(q, k, v, _call({**FORCED, "num_stages": 3, "BLOCK_N": 64}), SM90, False,
                       False)
    biased = _call(FORCED, score_mod=_bias_of_head())
    names = {gluon_kernel(two, None, None).name, gluon_kernel(three, None, None).name,
             gluon_kernel(two, biased.score, None).name}
    assert len(names) == 3
    source = gluon_kernel(two, biased.score, None).source
    assert "tl.load(sbuf0_ptr + flexfa_index(off_h, sbuf0_size0) * sbuf0_stride0)" in source


@pytest.mark.parametrize("key, field, flag, code", [
    ("GLUON_PINGPONG", "pingpong", "PINGPONG",
     "mbarrier.wait(turn.index(CID), (u + t + CID) & 1)"),
    ("GLUON_TMA_STORE", "tma_store", "TMA_STORE",
     "tma.async_copy_shared_to_global(O_DESC, [row, 0], o_smem)"),
])
def test_gluon_options_are_in_the_spec_key_and_source(key, field, flag, code):
    """kernel_options GLUON_PINGPONG and GLUON_TMA_STORE (default off) reach the spec, so the
    kernel's key and name, and the module's flag."""
    q, k, v = _qkv()
    plain = gluon_spec(q, k, v, _call(FORCED), SM90, False, False)
    chosen = gluon_spec(q, k, v, _call({**FORCED, key: True}), SM90, False, False)
    assert (getattr(plain, field), getattr(chosen, field)) == (False, True)
    plain_kernel, chosen_kernel = gluon_kernel(plain, None, None), gluon_kernel(chosen, None, None)
    assert plain_kernel.name != chosen_kernel.name and plain_kernel.key != chosen_kernel.key
    assert f"{flag} = tl.constexpr(False)" in plain_kernel.source
    assert f"{flag} = tl.constexpr(True)" in chosen_kernel.source
    assert code in chosen_kernel.source
    assert plain_kernel.params[:4] == ("Q_DESC", "K_DESC", "V_DESC", "OUT")
    # the output's descriptor is a parameter with TMA_STORE only
    assert ("O_DESC" in chosen_kernel.params) == (key == "GLUON_TMA_STORE")
    assert "O_DESC" not in plain_kernel.params


@pytest.mark.parametrize("E, Ev, trimmed, by_default", [
    (96, 96, True, True), (80, 80, True, True), (192, 128, True, True), (160, 160, True, True),
    (224, 224, True, False), (128, 128, False, False), (256, 256, False, False),
    (48, 48, False, False)])
def test_gluon_qk_trim_is_set_only_where_it_trims(E, Ev, trimmed, by_default):
    """GLUON_QK_TRIM reaches the spec only where E's 32-column slices are fewer than its power
    of two's, so a head dim it cannot trim compiles no second kernel; where it does, the
    kernel's key, name and module flag differ. 'AUTO' (the default) trims at the head dims
    where it measured faster (80, 96, 160, 192: wj_2c4a86f), not at 224 (never timed)."""
    q, k = (torch.empty(1, 2, 256, E, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(1, 2, 256, Ev, dtype=torch.bfloat16)

    def spec(value):
        options = FORCED if value == "default" else {**FORCED, "GLUON_QK_TRIM": value}
        return gluon_spec(q, k, v, _call(options), SM90, False, False)
    plain, chosen, default = spec(False), spec(True), spec("default")
    assert (plain.qk_trim, chosen.qk_trim, default.qk_trim) == (False, trimmed, by_default)
    assert spec("AUTO") == default
    if trimmed:
        plain_kernel, chosen_kernel = (gluon_kernel(plain, None, None),
                                       gluon_kernel(chosen, None, None))
        assert plain_kernel.name != chosen_kernel.name
        assert "QK_TRIM = tl.constexpr(False)" in plain_kernel.source
        assert "QK_TRIM = tl.constexpr(True)" in chosen_kernel.source
    else:
        assert plain == chosen == default
    with pytest.raises(TypeError, match="GLUON_QK_TRIM"):
        _call({**FORCED, "GLUON_QK_TRIM": "yes"})


def _turn_program(source: str):
    """(first step, parity(t, cid), arrival target(cid)) of fwd_gluon.tmpl's ping-pong turns,
    read from the template: the loop the turn wait sits in, its parity and the arrival's
    barrier index."""
    import re
    wait = re.search(r"mbarrier\.wait\(turn\.index\(CID\), (.+)\)\n", source)
    arrive = re.search(r"mbarrier\.arrive\(turn\.index\((.+)\), count=1\)", source)
    loop = re.findall(r"for t in range\((\w+), total\):", source[:wait.start()])
    return (int(loop[-1]), lambda t, cid: eval(wait.group(1), {"t": t, "CID": cid, "u": 0}),
            lambda cid: eval(arrive.group(1), {"CID": cid}))


def _run_all_interleavings(programs) -> set:
    """Every interleaving of the consumers' (op, barrier, parity) programs on count-1
    mbarriers (a wait for parity p passes once the barrier's completed phases have the other
    parity; a fresh barrier has completed none): the orders the GEMMs issued in; fails on a
    state where both consumers wait forever."""
    ends, seen, frontier = set(), set(), [((0, 0), (0, 0), ())]
    while frontier:
        state = frontier.pop()
        if state in seen:
            continue
        seen.add(state)
        pcs, phases, issued = state
        moves = []
        for c in (0, 1):
            if pcs[c] == len(programs[c]):
                continue
            kind, barrier, parity = programs[c][pcs[c]]
            if kind == "wait" and phases[barrier] % 2 == parity:
                continue  # the phase it waits for has not completed
            after = list(phases)
            after[barrier] += kind == "arrive"
            moved = tuple(pc + (i == c) for i, pc in enumerate(pcs))
            moves.append((moved, tuple(after), issued + ((c,) if kind == "issue" else ())))
        if pcs == (len(programs[0]), len(programs[1])):
            ends.add(issued)
        assert moves or pcs == (len(programs[0]), len(programs[1])), (
            f"both consumers wait forever at {state}")
        frontier.extend(moves)
    return ends


def test_gluon_pingpong_turns_never_hang_and_alternate():
    """fwd_gluon.tmpl's turn protocol, read from the template, in every interleaving of the
    two consumers for 0..6 key tiles (no tile, one, odd and even counts): neither hangs and
    the GEMMs issue alternately, consumer 0 first."""
    from flexfa.codegen.template import load_template
    first, parity, target = _turn_program(load_template("fwd_gluon.tmpl"))
    for total in range(7):
        steps = range(first, total)
        programs = [[op for t in steps for op in (("wait", c, parity(t, c)), ("issue", c, 0),
                                                   ("arrive", target(c), 0))]
                    for c in (0, 1)]
        assert _run_all_interleavings(programs) == {(0, 1) * len(steps)}, total


@pytest.mark.parametrize("E,Ev,pair,tiles", [(192, 128, (256, 128), (64, 3)),
                                             (96, 96, (128, 128), (128, 2)),
                                             (80, 80, (128, 128), (128, 2)),
                                             (48, 48, (64, 64), (128, 3))])
def test_padded_head_dims_take_the_padded_pairs_tiles(E, Ev, pair, tiles):
    """Head dims between the kernel's are padded (TMA fills the columns past the tensor's with
    zeros): E = 192 with Ev = 128 (DeepSeek's MLA) takes 64-key tiles in a 3-stage ring (208
    KB), E = 96 and 80 E = 128's; BACKEND="AUTO" takes E = 192, 96 and 80 (measured faster
    than the Hopper family), not 48 (measured within noise of it)."""
    q, k, v = _qkv(E=E)
    v = v[..., :Ev].contiguous()
    assert GLUON.why_not(SM90, _call(FORCED), q, k, v) is None
    spec = gluon_spec(q, k, v, _call(FORCED), SM90, True, False)
    assert (spec.head_dim, spec.head_dim_v, spec.head_dim_pad, spec.head_dim_v_pad) == \
        (E, Ev, *pair)
    assert (spec.block_n, spec.num_stages) == tiles
    assert shared_bytes(*pair, *tiles, False) <= SHARED_BYTES
    q, k = (torch.zeros(1, 2, 4096, E, dtype=torch.bfloat16) for _ in range(2))
    v = torch.zeros(1, 2, 4096, Ev, dtype=torch.bfloat16)
    reason = GLUON.why_not(SM90, _call(), q, k, v)
    if E in (192, 96, 80):
        assert reason is None
    else:
        assert "for (head dim, density, length)" in reason


@pytest.mark.parametrize("E,Ev,taken", [(256, 128, True), (192, 192, True), (128, 256, False),
                                        (32, 32, False), (128, 64, False)])
def test_head_dims_are_taken_by_their_padded_pair(E, Ev, taken):
    q, k, v = _qkv(E=E)
    v = torch.randn(*v.shape[:3], Ev, dtype=v.dtype)
    reason = GLUON.why_not(SM90, _call(FORCED), q, k, v)
    if taken:
        assert reason is None
    else:
        assert f"not E={E}, Ev={Ev}" in reason and "64/64, 128/128, 256/128, 256/256" in reason


def test_default_ring_shrinks_to_fit_the_tma_store_and_pins_do_not():
    """E = 192 / Ev = 128 with GLUON_TMA_STORE: out's staging buffer leaves room for 2 of the
    default 3 stages, so the default ring is 2 deep; 3 pinned stages fail by name."""
    q, k, v = _qkv(E=192)
    v = v[..., :128].contiguous()
    store = {**FORCED, "GLUON_TMA_STORE": True}
    spec = gluon_spec(q, k, v, _call(store), SM90, True, False)
    assert (spec.block_n, spec.num_stages, spec.tma_store) == (64, 2, True)
    assert shared_bytes(256, 128, 64, 3, True) > SHARED_BYTES
    with pytest.raises(flexfa.InputError, match="256/128 with BLOCK_N=64, num_stages=3, GLUON"):
        gluon_spec(q, k, v, _call({**store, "num_stages": 3}), SM90, True, False)
    assert gluon_spec(q, k, v, _call(FORCED), SM90, True, False).num_stages == 3


@pytest.mark.parametrize("score_mod, dtype, options, return_max, bound", [
    (mods.softcap(30.0), torch.bfloat16, {"GLUON_STATIC_MAX": True}, False, 30.0),
    (mods.softcap(30.0), torch.bfloat16, {}, False, 30.0),           # on by default
    (mods.softcap(30.0), torch.bfloat16, {"GLUON_STATIC_MAX": False}, False, None),
    (mods.softcap(30.0), torch.float16, {"GLUON_STATIC_MAX": True}, False, None),  # P underflows
    (mods.softcap(30.0), torch.bfloat16, {"GLUON_STATIC_MAX": True}, True, None),  # max_scores
    (mods.softcap(50.0), torch.bfloat16, {"GLUON_STATIC_MAX": True}, False, None),  # 144 > 96
    (None, torch.bfloat16, {"GLUON_STATIC_MAX": True}, False, None),   # q.k is unbounded
])
def test_gluon_static_max_only_where_the_bound_is_proven(score_mod, dtype, options, return_max,
                                                         bound):
    """GLUON_STATIC_MAX takes the score_mod's upper bound (codegen.ranges.static_score_max)
    for bf16 without max_scores; the kernel's module subtracts it (STATIC_MAX2, log2 units)."""
    q, k, v = _qkv(dtype=dtype)
    call = _call({**FORCED, **options}, score_mod=score_mod)
    spec = gluon_spec(q, k, v, call, SM90, True, return_max)
    if bound is None:
        assert spec.static_max is None
        return
    assert bound <= spec.static_max <= bound * (1 + 1e-5)
    source = gluon_kernel(spec, call.score, call.mask).source
    assert "STATIC_MAX = tl.constexpr(True)" in source
    assert f"STATIC_MAX2 = tl.constexpr({spec.static_max * 1.4426950408889634!r})" in source
    plain = gluon_spec(q, k, v, _call({**FORCED, "GLUON_STATIC_MAX": False},
                                      score_mod=score_mod), SM90, True, False)
    assert gluon_kernel(plain, call.score, None).key != gluon_kernel(spec, call.score, None).key
