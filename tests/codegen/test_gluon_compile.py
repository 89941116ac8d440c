"""The Gluon forward (fwd_gluon.tmpl) and backward (bwd_gluon.tmpl) compile for sm_90 without
a GPU: setmaxnreg (the 1-warp partitions give registers to the consumer warpgroups), wgmma,
TMA (the backward's dQ reduce-add too), no spills; the forward's ping-pong variant
(GLUON_PINGPONG) waits on and passes the consumers' turns, its TMA-store variant
(GLUON_TMA_STORE) stores out by TMA, its persistent variant (GLUON_PERSISTENT) loops over
work tiles and waits for each consumer's Q release, its dropout keeps the keep mask out of
shared memory and its tile loop free of spills. In subprocesses:
a compiled Gluon module imports triton.experimental.gluon, whose standard library cannot be
imported where this test session decorated triton.language for the interpreter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("fwd_gluon_d128_bf16_dense", "fwd_gluon_d128_bf16_causal",
            "fwd_gluon_d128_fp16_softcap_causal", "fwd_gluon_d256_bf16_dense",
            "fwd_gluon_d256_bf16_causal",  # the zero-extended epilogue offsets (issue 28)
            "fwd_gluon_d192_ev128_bf16_causal",  # padded E, another Ev
            "fwd_gluon_d128_bf16_alibi_causal_even")  # a full tile's path without the mask
# CI compiles three of the eight registered ping-pong variants (E = 64 and 128 x dense, causal,
# softcap, document; all: python -m flexfa compile-check --arch 90 --only pingpong)
PINGPONG_VARIANTS = ("fwd_gluon_d128_bf16_causal_pingpong", "fwd_gluon_d64_fp16_softcap_pingpong",
                     "fwd_gluon_d128_bf16_document_pingpong")
# GLUON_STATIC_MAX (softcap + causal, bf16): no running row max
STATIC_VARIANTS = ("fwd_gluon_d128_bf16_softcap_causal_static",)
# dropout_p: the keep mask's Philox words computed where the score tile's halves live
DROPOUT_VARIANTS = ("fwd_gluon_d128_bf16_causal_dropout", "fwd_gluon_d256_bf16_causal_dropout")
# HAS_SINKS: each row's sink folded into its denominator in the epilogue (the second under the
# static max and the dynamic grid, compiled as a GPU test session does)
SINKS_VARIANTS = ("fwd_gluon_d128_bf16_causal_sinks",
                  "fwd_gluon_d128_bf16_softcap_causal_static_sinks")
TMA_STORE_VARIANTS = ("fwd_gluon_d128_bf16_causal_tma_store",
                      "fwd_gluon_d64_fp16_softcap_pingpong_tma_store")
# one persistent variant here (a compile takes ~40-60 s); the others (dense, softcap with the
# TMA store, E=64 document) are registered in compile_check:
#   python -m flexfa compile-check --arch 90 --only persistent
PERSISTENT_VARIANTS = ("fwd_gluon_d128_bf16_causal_persistent",)
# the default under a block mask (GLUON_PERSISTENT "AUTO"): the work tiles from an atomic
# counter; compiled where triton.language was decorated for the interpreter, as a GPU test
# session does (its first GPU run failed there on gl.max)
DYNAMIC_VARIANTS = ("fwd_gluon_d128_bf16_causal_persistent_dynamic",)
# E=128 holds dK, dV, the transposed scores and dP of a 64-key consumer in 240 registers with
# little to spare: fp16 softcap + causal (the derivative and the mask) was the last to spill
# (the others at E=128: `python -m flexfa compile-check --arch 90 --only bwd_gluon_d128`);
# ALiBi + causal GQA 4 (the consumers take each tile from its stage's code) spilled last
BWD_VARIANTS = ("bwd_gluon_d128_bf16_causal", "bwd_gluon_d128_bf16_softcap_gqa",
                "bwd_gluon_d64_fp16_alibi_document", "bwd_gluon_d128_fp16_softcap_causal",
                "bwd_gluon_d128_bf16_alibi_causal_gqa",
                # head dims padded to 128 (TMA's zero fill past E)
                "bwd_gluon_d96_bf16_softcap_causal", "bwd_gluon_d80_bf16_causal")
# dropout_p: the consumers draw the keep mask again in the transposed score tile's layout
BWD_DROPOUT_VARIANTS = ("bwd_gluon_d128_bf16_causal_dropout",
                        "bwd_gluon_d64_fp16_softcap_gqa_dropout")
# E = 256 (bwd_gluon_wide.tmpl): no spills with or without a mask, at ragged lengths and tile
# multiples, nor at E = 192 with Ev = 128, nor with GQA 4 (its producer warp spilled 48 bytes
# until it walked each head from opaque copies, OPAQUE_WALK); the others: python -m flexfa
# compile-check --arch 90 --only bwd_gluon_d256, --only bwd_gluon_d192
BWD_WIDE_VARIANTS = ("bwd_gluon_d256_bf16_dense", "bwd_gluon_d256_bf16_causal_even",
                     "bwd_gluon_d256_bf16_causal", "bwd_gluon_d192_ev128_bf16_causal",
                     "bwd_gluon_d256_bf16_softcap_causal_dropout",
                     "bwd_gluon_d256_bf16_gqa_causal", "bwd_gluon_d256_bf16_relbias_causal")
# row and key biases (sums along one tile axis, their offsets reduced to the sum's layout too):
# 52 spill bytes, 15 local-memory instructions in the loop at registration (sm_90, Triton 3.6)
BWD_AXIS_GRAD_VARIANTS = ("bwd_gluon_d256_bf16_axisbias_causal",)
# Q K^T over E's 32-column slices alone (GLUON_QK_TRIM) and the padded variants they trim
QK_TRIM_VARIANTS = ("fwd_gluon_d192_ev128_bf16_causal_qk_trim",
                    "fwd_gluon_d96_bf16_softcap_causal_qk_trim", "fwd_gluon_d96_bf16_softcap_causal",
                    "bwd_gluon_d96_bf16_softcap_causal_qk_trim")
# its row kernels (plain Triton), at the runtime's rows per program and 16-divisible pointers
BWD_ROW_VARIANTS = ("bwd_gluon_rows_pre_d128_bf16_dlse", "bwd_gluon_rows_post_d128_bf16",
                    "bwd_gluon_rows_zero_d128_bf16", "bwd_gluon_rows_post_d96_bf16")
SCRIPT = """
import json, os, re, sys
if os.environ.pop("AS_TEST_SESSION", None):  # triton.language decorated for the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language
    os.environ["TRITON_INTERPRET"] = "0"
    from flexfa.runtime.families.gluon import import_gluon
    import_gluon()
from flexfa import compile_check
for name in sys.argv[1:]:
    r = compile_check.compile_job(name, 90, compile_check.REGISTRY[name], loops=True)
    print(json.dumps(dict(
        name=name, ok=r.ok, error=r.error, wgmma=r.wgmma, spills=r.spill_bytes,
        loop_spills=r.loop_local_ops, path=r.loop_path, st_shared=r.ptx.count("st.shared"),
        serialized=r.wgmma_serialized, wgmmas=r.ptx.count("wgmma.mma_async"),
        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\\.(inc|dec)\\.sync\\.aligned\\.u32\\s+(\\d+)",
                                         r.ptx))),
        tanh="tanh.approx.f32" in r.ptx, arrive="mbarrier.arrive" in r.ptx,
        tma="cp.async.bulk.tensor" in r.ptx, atomics=r.ptx.count("atom.global"),
        # atomic adds of one value to one address more than once (a reduced vector repeated
        # in a thread's registers: each copy is added)
        repeated_atomics=sum(n > 1 for n in collections.Counter(re.findall(REPEAT, r.ptx)).values()),
        # loads through the [heads, n, dim] views (a ragged length's q, k, v, dO) and rows
        tma_3d=r.ptx.count("cp.async.bulk.tensor.3d.shared::cluster.global"),
        tma_2d=r.ptx.count("cp.async.bulk.tensor.2d.shared::cluster.global"),
        reduce="cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in r.ptx,
        try_wait=r.ptx.count("mbarrier.try_wait"),
        tma_stores=r.ptx.count("cp.async.bulk.tensor.2d.global.shared::cta"),
        proxy_fence="fence.proxy.async.shared::cta" in r.ptx,
        grid_x=r.ptx.count("%nctaid.x"),
        fmax=len(re.findall(r"\\bmax(\\.\\w+)*\\.f32", r.ptx)),
        # an arrive right before waiting for the q.k wgmma: the ping-pong turn passed on
        turn_pass=len(re.findall(TURN_PASS, r.ptx)))))
"""
TURN_PASS = (r"mbarrier\.arrive\.shared::cta\.b64[^\n]*\n(?:(?![^\n]*(?:wgmma|mbarrier))"
             r"[^\n]*\n)*?[ \t]*wgmma\.wait_group\.sync\.aligned 1;")
REPEAT = r"atom\.global\.[\w.]*add\.f32\s+%r\d+,\s*\[\s*(%rd\d+\s*\+\s*\d+)\s*\],\s*(%r\d+)"
SCRIPT = f"import collections\nTURN_PASS = {TURN_PASS!r}\nREPEAT = {REPEAT!r}\n" + SCRIPT


def _start(tmp_path, variants, as_test_session=False):
    """A fresh process compiling ``variants`` by the SCRIPT, started and not waited for
    (``as_test_session``: one that decorated triton.language for the interpreter first, as a
    GPU test session does: a Gluon kernel calling Triton's standard library, gl.max, fails to
    compile there)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "",
           **({"AS_TEST_SESSION": "1"} if as_test_session else {}),
           "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "FLEXFA_CACHE_DIR": str(tmp_path / "flexfa")}
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, *variants], text=True, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return process, variants


def _rows(started) -> dict:
    """The SCRIPT's row of each variant of a process from ``_start``."""
    process, variants = started
    try:
        stdout, stderr = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"compiling {variants} took over 240 s")
    assert process.returncode == 0, stderr[-2000:]
    rows = {row["name"]: row for row in map(json.loads, stdout.strip().splitlines())}
    assert set(rows) == set(variants)
    return rows


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> dict:
    """Every compile of this module, started at once in four processes of about equal work:
    the pytest process only waits for them, so on a machine of two or more cores they share
    the cores (about half the wall time of compiling one after another)."""
    groups = {"plain": (VARIANTS, False),
              "pingpong": (PINGPONG_VARIANTS + STATIC_VARIANTS + DROPOUT_VARIANTS, False),
              "stores": (TMA_STORE_VARIANTS + PERSISTENT_VARIANTS + SINKS_VARIANTS[:1], False),
              "backward": (BWD_VARIANTS + BWD_ROW_VARIANTS + BWD_DROPOUT_VARIANTS, True),
              "dynamic": (DYNAMIC_VARIANTS + SINKS_VARIANTS[1:], True),
              "wide": (BWD_WIDE_VARIANTS + BWD_AXIS_GRAD_VARIANTS + QK_TRIM_VARIANTS, False)}
    processes = {name: _start(tmp_path_factory.mktemp(f"gluon_{name}"), variants, session)
                 for name, (variants, session) in groups.items()}
    yield processes
    for process, _ in processes.values():  # a test that failed before waiting for its rows
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def forward_rows(started) -> dict:
    """The forward variants, with and without ping-pong, the TMA store and persistence."""
    return {name: row for group in ("plain", "pingpong", "stores", "dynamic")
            for name, row in _rows(started[group]).items()}


@pytest.fixture(scope="module")
def wide_rows(started) -> dict:
    """The E = 256 backward's variants and the trimmed (GLUON_QK_TRIM, GLUON_BWD_QK_TRIM)."""
    return _rows(started["wide"])


@pytest.fixture(scope="module")
def backward_rows(started) -> dict:
    """The backward's variants: the kernel's, its row kernels', with dropout."""
    return _rows(started["backward"])


def _check_compiled(name: str, row: dict) -> None:
    assert row["ok"], (name, row["error"])
    assert row["wgmma"] and row["tma"] and row["arrive"], row
    # the producer warp drops to 24 registers, the worker consumer rises to 240
    assert ["dec", "24"] in row["setmaxnreg"] and ["inc", "240"] in row["setmaxnreg"], row
    assert row["spills"] in (0, None), row  # None: no ptxas to ask
    # ptxas did not serialize the wgmmas (a wgmma's accumulator read while it is in flight
    # makes each wait for the one before: a loop-carried in-flight dQ did, in the backward)
    assert row["serialized"] in (False, None), row


def test_gluon_forward_compiles_for_sm90(forward_rows):
    for name in VARIANTS:
        _check_compiled(name, forward_rows[name])
        assert forward_rows[name]["turn_pass"] == 0, forward_rows[name]
        assert forward_rows[name]["tma_stores"] == 0, forward_rows[name]  # plain stores
    assert forward_rows["fwd_gluon_d128_fp16_softcap_causal"]["tanh"]
    assert not forward_rows["fwd_gluon_d128_bf16_dense"]["tanh"]


def _index_compares(path: dict) -> int:
    """Integer compares on a tile loop's shortest path (a full tile's): the mask_mod's and the
    bounds checks' per score (64 a thread for a forward tile of 64 x 128 scores, 32 for a
    backward one) where they run, a few of the loop's own otherwise (a softcap's NaN guard in
    the backward is a float compare)."""
    return path.get("ISETP", 0)


def test_full_tiles_run_no_mask_and_no_bounds_check(forward_rows):
    """A full tile runs neither the mask_mod nor the check past S: ragged lengths (S not a
    multiple of the tile; checked on the tile that reaches past S) and ALiBi + causal at even
    lengths (whose cheap score_mod LLVM once hoisted out of the partial tiles' branch, and
    ptxas predicated the mask left into every tile). The causal tile's path is the dense
    one's within a few instructions; ALiBi's distance is float math (ranges.float_casts)."""
    dense = sum(forward_rows["fwd_gluon_d128_bf16_dense"]["path"].values())
    for name in ("fwd_gluon_d128_bf16_causal", "fwd_gluon_d128_bf16_alibi_causal_even",
                 "fwd_gluon_d128_fp16_softcap_causal"):
        path = forward_rows[name]["path"]
        assert path and _index_compares(path) <= 8, (name, path)
    assert sum(forward_rows["fwd_gluon_d128_bf16_causal"]["path"].values()) <= dense + 32
    # ALiBi's |q_idx - kv_idx| in float32 at S = 16384 (exact there): no integer abs per score
    assert forward_rows["fwd_gluon_d128_bf16_alibi_causal_even"]["path"].get("IABS", 0) == 0


def test_ragged_lengths_read_by_heads(forward_rows, backward_rows):
    """At a length that is no multiple of the tile the Gluon kernels read the tiles a head's
    end reaches into through the [heads, n, dim] views (3-D TMA; TMA's zero fill past n)
    instead of the [heads * n, dim] rows, where a tile past S read the next head's first keys
    and an inf there made this head's P @ V NaN (tests/gpu/test_next_head_inf_gpu.py): in
    the forward K and V (Q's rows past L are never stored), in the backward Q, dO, K and V
    (lse2, delta and the dQ reduce stay 2-D); at tile multiples every load is 2-D."""
    ragged, even = (forward_rows["fwd_gluon_d128_bf16_causal"],
                    forward_rows["fwd_gluon_d128_bf16_alibi_causal_even"])
    assert ragged["tma_3d"] > 0 and ragged["tma_2d"] > 0, ragged  # K, V by heads; Q rows
    assert even["tma_3d"] == 0 and even["tma_2d"] > 0, even
    backward = backward_rows["bwd_gluon_d128_bf16_causal"]
    # Q, dO, K, V by heads (each of the producer's copies is 3-D), lse2 and delta by rows
    assert backward["tma_3d"] > 0 and backward["tma_2d"] > 0, backward


def test_gluon_static_max_forward_compiles_without_a_row_max(forward_rows):
    """GLUON_STATIC_MAX: the softcap's bound is subtracted, so no max over the scores is left
    (the running-max kernel of the same mods has one max.f32 per score)."""
    for name in STATIC_VARIANTS:
        row = forward_rows[name]
        _check_compiled(name, row)
        assert row["tanh"] and row["fmax"] == 0, row
    assert forward_rows["fwd_gluon_d128_fp16_softcap_causal"]["fmax"] > 0


def test_gluon_dropout_forward_compiles_for_sm90(forward_rows):
    """dropout_p: the Philox counters are laid out so that each consumer thread computes the
    words of the score halves it holds, so the keep mask reaches the score tile without
    shared memory (as many st.shared as the kernel without dropout) and nothing spills (at
    56196b6 ptxas spilled 12 bytes at E = 128 and 4 at 256 outside the tile loop, kernel
    arguments computed at the entry for the epilogue; 0 at 3aef015)."""
    for name in DROPOUT_VARIANTS:
        row = forward_rows[name]
        assert row["ok"], (name, row["error"])
        assert row["wgmma"] and row["tma"] and row["arrive"], row
        assert ["dec", "24"] in row["setmaxnreg"] and ["inc", "240"] in row["setmaxnreg"], row
        assert row["loop_spills"] in (0, None) and row["spills"] in (0, None), row
        assert row["serialized"] in (False, None), row
    plain = forward_rows["fwd_gluon_d128_bf16_causal"]
    assert forward_rows["fwd_gluon_d128_bf16_causal_dropout"]["st_shared"] == plain["st_shared"]


def test_gluon_sinks_forward_compiles_for_sm90(forward_rows):
    """HAS_SINKS: the sink joins each row's denominator once, in the epilogue, so the tile
    loop's path is the kernel's without sinks (the same opcodes, as many of each), with no
    spills and the wgmmas unserialized."""
    for name in SINKS_VARIANTS:
        _check_compiled(name, forward_rows[name])
    assert forward_rows["fwd_gluon_d128_bf16_causal_sinks"]["path"] == \
        forward_rows["fwd_gluon_d128_bf16_causal"]["path"]


def test_gluon_pingpong_forward_compiles_for_sm90(forward_rows):
    """GLUON_PINGPONG at E=64 and 128: each consumer waits for its turn once more per step
    (one try_wait loop per consumer over the plain kernel's) and passes the turn after
    issuing both GEMMs, before it waits for the q.k one."""
    plain = forward_rows["fwd_gluon_d128_bf16_dense"]["try_wait"]
    for name in PINGPONG_VARIANTS:
        row = forward_rows[name]
        _check_compiled(name, row)
        assert row["try_wait"] == plain + 2, (name, row["try_wait"], plain)
        assert row["turn_pass"] == 2, row  # one per consumer warpgroup
    assert forward_rows["fwd_gluon_d128_bf16_causal_pingpong"]["try_wait"] \
        > forward_rows["fwd_gluon_d128_bf16_causal"]["try_wait"]
    assert forward_rows["fwd_gluon_d64_fp16_softcap_pingpong"]["tanh"]


def test_gluon_tma_store_forward_compiles_for_sm90(forward_rows):
    """GLUON_TMA_STORE: each consumer stores its rows of out by one TMA store from shared
    memory written before a proxy fence; with ping-pong the turns are unchanged."""
    for name in TMA_STORE_VARIANTS:
        row = forward_rows[name]
        _check_compiled(name, row)
        assert row["tma_stores"] == 2 and row["proxy_fence"], row  # one per consumer
    pingpong = forward_rows["fwd_gluon_d64_fp16_softcap_pingpong_tma_store"]
    assert pingpong["turn_pass"] == 2
    assert pingpong["try_wait"] == forward_rows["fwd_gluon_d64_fp16_softcap_pingpong"]["try_wait"]
    assert forward_rows["fwd_gluon_d128_bf16_causal_tma_store"]["turn_pass"] == 0


def test_gluon_persistent_forward_compiles_for_sm90(forward_rows):
    """GLUON_PERSISTENT: the partitions step through work tiles by the grid's size
    (%nctaid.x; the plain causal kernel reads only the y size, for its one tile's index), the
    producer waits for each consumer's Q release (one try_wait loop per consumer over the
    plain kernel's), no spills (the epilogue's column offsets once spilled at 240
    registers); with "DYNAMIC" (the default under a block mask) the producer takes each next
    tile by one atomic add and hands it to the consumers."""
    plain = forward_rows["fwd_gluon_d128_bf16_causal"]
    for name in PERSISTENT_VARIANTS:
        row = forward_rows[name]
        _check_compiled(name, row)
        assert row["grid_x"] >= 1 and plain["grid_x"] == 0, (row, plain)
        assert row["try_wait"] == plain["try_wait"] + 2, (row["try_wait"], plain["try_wait"])
        assert row["turn_pass"] == 0 and row["tma_stores"] == 0, row
    static = forward_rows[PERSISTENT_VARIANTS[0]]
    assert static["atomics"] == 0, static
    for name in DYNAMIC_VARIANTS:
        # one atomic add (the producer's next tile); four try_wait loops more than the fixed
        # walk: the producer's Q-release waits before the end, once per consumer, and each
        # consumer's Q wait both before its first tile and after each
        row = forward_rows[name]
        _check_compiled(name, row)
        assert row["grid_x"] >= 1 and row["atomics"] == 1, row
        assert row["try_wait"] == static["try_wait"] + 4, (row["try_wait"], static["try_wait"])


def test_gluon_backward_compiles_for_sm90(backward_rows):
    """The Gluon backward (bwd_gluon.tmpl): wgmma, TMA loads, the dQ-writer warp's TMA
    reduce-add, the 1-warp partitions at 24 registers and the worker consumer at 240;
    compiled where triton.language was decorated for the interpreter (its first GPU run
    failed there on gl.max)."""
    rows = dict(backward_rows)
    dropout = {name: rows.pop(name) for name in BWD_DROPOUT_VARIANTS}
    for name in BWD_ROW_VARIANTS:  # plain Triton: no wgmma, no spills
        row = rows.pop(name)
        assert row["ok"] and row["spills"] in (0, None), row
    for name, row in rows.items():
        assert row["ok"], (name, row["error"])
        assert row["wgmma"] and row["tma"] and row["arrive"] and row["reduce"], row
        # ragged lengths: q tiles within L and S run no mask or bounds check (as the forward)
        assert row["path"] and _index_compares(row["path"]) <= 8, (name, row["path"])
        assert ["dec", "24"] in row["setmaxnreg"] and ["inc", "240"] in row["setmaxnreg"], row
        assert row["spills"] in (0, None), row  # None: no ptxas to ask
        assert row["serialized"] in (False, None), row  # ptxas kept the wgmmas pipelined
    # dropout_p: each Philox call is made by the two threads that hold its keys' halves of
    # the transposed tile and swapped between them by warp shuffles (32 queries at a time),
    # so the keep mask reaches the tile without shared memory (as many st.shared as without
    # dropout). At E = 128 the calls next to dK and dV leave 28 bytes of spills, one
    # local-memory instruction of them in the tile loop (Triton 3.6); at 64 none
    for name, row in dropout.items():
        assert row["ok"], (name, row["error"])
        assert row["wgmma"] and row["reduce"] and ["inc", "240"] in row["setmaxnreg"], row
        assert row["serialized"] in (False, None), row
    d128, d64 = (dropout[name] for name in BWD_DROPOUT_VARIANTS)
    assert d128["st_shared"] == rows["bwd_gluon_d128_bf16_causal"]["st_shared"], d128
    assert (d128["spills"] or 0) <= 32 and (d128["loop_spills"] or 0) <= 1, d128
    assert (d64["spills"] or 0) == 0 and (d64["loop_spills"] or 0) == 0, d64


def test_gluon_wide_backward_compiles_for_sm90(wide_rows):
    """The E = 256 backward (bwd_gluon_wide.tmpl): wgmma unserialized, TMA loads, dQ by
    relaxed atomic adds (no TMA reduce, no dQ buffer in shared memory), the producer at 24
    registers and the worker consumer at 240; no spills, with or without the causal mask, at
    a ragged length or tile multiples, at E = 192 with Ev = 128 too, with dropout, with
    GQA 4 (the producer's head loop, OPAQUE_WALK) and with a learnable relative bias (its
    gradient's atomics, HAS_BUFFER_GRADS). With row and key biases (sums along one axis) no
    thread adds to one address twice (a keep_dims sum did: 16 and 4 repeats, wrong on the
    H200) and the spills stay within what they were at registration."""
    rows = {name: row for name, row in wide_rows.items() if name in BWD_WIDE_VARIANTS}
    for name, row in rows.items():
        assert row["ok"], (name, row["error"])
        assert row["wgmma"] and row["tma"] and row["arrive"] and not row["reduce"], row
        assert row["atomics"] > 0 and row["repeated_atomics"] == 0, row
        assert ["dec", "24"] in row["setmaxnreg"] and ["inc", "240"] in row["setmaxnreg"], row
        assert row["serialized"] in (False, None), row
        assert row["spills"] in (0, None) and row["loop_spills"] in (0, None), row
    for name in BWD_AXIS_GRAD_VARIANTS:
        row = wide_rows[name]
        assert row["ok"], (name, row["error"])
        assert row["atomics"] > 0 and row["repeated_atomics"] == 0, row
        assert (row["spills"] or 0) <= 64 and (row["loop_spills"] or 0) <= 16, row


def test_gluon_qk_trim_forward_compiles_for_sm90(wide_rows):
    """GLUON_QK_TRIM: Q K^T over E's 32-column slices alone, as two wgmmas (128 + 64 columns
    at 192, 64 + 32 at 96) with no spills and the wgmmas unserialized; fewer wgmma
    instructions than the padded kernel (6 k-steps of Q K^T a tile at 96 instead of 8)."""
    rows = wide_rows
    for name in ("fwd_gluon_d192_ev128_bf16_causal_qk_trim",
                 "fwd_gluon_d96_bf16_softcap_causal_qk_trim"):
        _check_compiled(name, rows[name])
        assert rows[name]["loop_spills"] in (0, None), rows[name]
    trimmed, padded = (rows["fwd_gluon_d96_bf16_softcap_causal_qk_trim"],
                       rows["fwd_gluon_d96_bf16_softcap_causal"])
    assert trimmed["wgmmas"] < padded["wgmmas"], (trimmed["wgmmas"], padded["wgmmas"])


def test_gluon_bwd_qk_trim_compiles_for_sm90(wide_rows, backward_rows):
    """GLUON_BWD_QK_TRIM: S^T and dP^T over E's 64 + 32 columns at E = 96 (softcap +
    causal, ragged): no spills, unserialized, fewer wgmma instructions than the padded
    kernel."""
    trimmed = wide_rows["bwd_gluon_d96_bf16_softcap_causal_qk_trim"]
    _check_compiled("bwd_gluon_d96_bf16_softcap_causal_qk_trim", trimmed)
    padded = backward_rows["bwd_gluon_d96_bf16_softcap_causal"]
    assert trimmed["wgmmas"] < padded["wgmmas"], (trimmed["wgmmas"], padded["wgmmas"])


PLAN_SCRIPT = """
import torch, triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
assert isinstance(tl.standard.sum, InterpretedFunction)  # as in a test session
import flexfa
from flexfa.runtime.families import gluon
from flexfa.runtime.target import Target
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.options import parse_kernel_options
q = torch.zeros(1, 2, 200, 64, dtype=torch.float16)
call = AttentionCall(None, None, None, 0.125, parse_kernel_options({"BACKEND": "GLUON"}), 1)
plan = gluon.GLUON.make_plan(q, q, q, call, Target("cuda", 9, 0), True, False)
print(type(plan.steps[0].kernel).__name__, plan.steps[0].grid, plan.steps[0].options)
for name, (shape, strides, block, layout) in plan.fixed["descriptors"]:
    print("geometry", name, shape, strides, block, layout.rank)
stored = AttentionCall(None, None, None, 0.125, parse_kernel_options(
    {"BACKEND": "GLUON", "GLUON_TMA_STORE": True}), 1)
plan = gluon.GLUON.make_plan(q, q, q, stored, Target("cuda", 9, 0), True, False)
name, (shape, strides, block, layout) = plan.fixed["descriptors"][-1]
print(name, shape, strides, block)
persistent = AttentionCall(None, None, None, 0.125, parse_kernel_options(
    {"BACKEND": "GLUON", "GLUON_PERSISTENT": True}), 1)
plan = gluon.GLUON.make_plan(q, q, q, persistent, Target("cuda", 9, 0), True, False)
print("persistent", plan.steps[0].grid, plan.steps[0].binder.template[-1])
"""


def test_gluon_plan_loads_where_triton_language_is_interpreted(tmp_path):
    """A GPU test session decorates triton.language for the interpreter first; the family
    still imports Gluon and loads its compiled module there (no GPU needed to plan)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT),
           "FLEXFA_CACHE_DIR": str(tmp_path / "flexfa")}
    result = subprocess.run([sys.executable, "-c", PLAN_SCRIPT], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "GluonJITFunction", result.stdout
    assert "(2, 2)" in result.stdout and "'maxnreg': 168" in result.stdout, result.stdout
    lines = [line for line in result.stdout.splitlines() if not line.startswith("geometry")]
    # at S = 200 (no multiple of the 128-key tile) K and V by heads: [B * H, S, E] with
    # rank-3 blocks (TMA's zero fill past S, never the next head's keys); Q by rows
    geometry = [line for line in result.stdout.splitlines() if line.startswith("geometry")]
    assert geometry == ["geometry Q_DESC [400, 64] [64, 1] [64, 64] 2",
                        "geometry K_DESC [2, 200, 64] [12800, 64, 1] [1, 128, 64] 3",
                        "geometry V_DESC [2, 200, 64] [12800, 64, 1] [1, 128, 64] 3"], geometry
    # GLUON_TMA_STORE: the output's descriptor over its [B * H * L, Ev] rows, 64-row blocks
    assert lines[1] == "O_DESC [400, 64] [64, 1] [64, 64]", result.stdout
    # GLUON_PERSISTENT without a GPU: min(132 SMs, 2 q tiles x 2 heads) programs; BATCH_HEADS
    assert lines[2] == "persistent (4,) 2", result.stdout
