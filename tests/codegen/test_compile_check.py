"""Compile-only checks: the forward kernel compiles for sm_80 (mma.sync) and sm_90 (wgmma)
without a GPU; the compile-check command's registry and table."""
import pytest

from flexfa import compile_check
from flexfa.compile_check import CompileResult, compile_job, format_table


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize("arch,instruction", [(80, "mma_sync"), (90, "wgmma")])
def test_forward_with_mods_compiles(arch, instruction):
    name = "fwd_d64_fp16_alibi_document"  # score_mod with a buffer, mask_mod with a buffer
    result = compile_job(name, arch, compile_check.REGISTRY[name])
    assert result.ok, result.error
    assert getattr(result, instruction), f"no {instruction} in the sm_{arch} PTX"
    assert ".entry flexfa_fwd_d64_fp16_" in result.ptx


@pytest.mark.parametrize("name,arch", [("fwd_d64_fp16_softcap_sinks_dropout_max", 80),
                                       ("fwd_d64_fp16_softcap_sinks_dropout_max", 90),
                                       ("bwd_dkdv_d64_fp16_dense_dropout", 90)])
def test_sinks_and_dropout_compile(name, arch):
    """HAS_SINKS and DROPOUT (Philox, the keep mask's interleave, the sink fold) compile; the
    dK/dV kernel draws the mask on a transposed tile."""
    result = compile_job(name, arch, compile_check.REGISTRY[name])
    assert result.ok, result.error
    assert not result.spill_bytes, f"{name} sm_{arch} spills {result.spill_bytes} bytes"


def test_failures_are_reported_not_raised():
    def broken(arch):
        raise RuntimeError("no such template")

    result = compile_job("broken", 80, broken)
    assert not result.ok and "no such template" in result.error
    table = format_table([result, CompileResult("other", 90, False, skipped=True)])
    assert "FAIL" in table and "skip" in table and "broken sm_80: RuntimeError" in table


def test_main_lists_variants_and_validates_arch(capsys):
    assert compile_check.main(["--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert "fwd_d128_bf16_causal" in listed and "fwd_d256_bf16_dense" in listed
    assert compile_check.main(["--arch", "eighty"]) == 2


def test_register_limits_archs(monkeypatch):
    monkeypatch.setattr(compile_check, "REGISTRY", dict(compile_check.REGISTRY))
    monkeypatch.setattr(compile_check, "ARCHS", dict(compile_check.ARCHS))
    compile_check.register("hopper_only_probe", lambda arch: None, archs=(90,))
    assert compile_check.supports("hopper_only_probe", 90)
    assert not compile_check.supports("hopper_only_probe", 80)
    with pytest.raises(AssertionError, match="registered twice"):
        compile_check.register("hopper_only_probe", lambda arch: None)


@pytest.mark.parametrize("name,arch", [("decode_d128_bf16_g5_l3_paged_causal", 90),
                                       ("decode_d128_bf16_g4_l1_dense_split", 80),
                                       ("decode_combine_d128_bf16_g4_l1", 80),
                                       ("decode_d128_bf16_g4_l3_paged_per_head_union", 80),
                                       ("decode_d128_bf16_g4_l3_paged_per_head_union", 90),
                                       ("decode_d128_bf16_g4_l3_paged_causal_sinks", 80),
                                       ("decode_d128_bf16_g4_l3_paged_causal_sinks", 90),
                                       ("decode_combine_d128_bf16_g4_l1_sinks", 80),
                                       ("decode_combine_d128_bf16_g4_l1_sinks", 90)])
def test_decode_kernels_compile(name, arch):
    """The decode family's kernel (paged, a block mask, splits; the union walk of per-head
    tables across q blocks; attention sinks) and its combine kernel compile for sm_80 and
    sm_90 without spilling much."""
    result = compile_job(name, arch, compile_check.REGISTRY[name])
    assert result.ok, result.error
    assert ".entry flexfa_fwd_decode_d128_bf16_" in result.ptx
    assert result.spill_bytes is None or result.spill_bytes <= 64, result.spill_bytes


@pytest.mark.parametrize("name,arch", [("varlen_rows_causal_128", 90),
                                       ("varlen_rows_window_48x80", 80),
                                       ("varlen_columns", 80),
                                       ("varlen_rows_checked_causal_128_i64", 90),
                                       ("varlen_check_i64", 80)])
def test_varlen_table_kernels_compile(name, arch):
    """The varlen BlockMask's table kernels (blockmask/varlen_kernels.py) compile, in a
    process whose triton.language was imported for the interpreter, without spilling."""
    result = compile_job(name, arch, compile_check.REGISTRY[name])
    assert result.ok, result.error
    assert f".entry {name.split('_')[0]}_{name.split('_')[1]}" in result.ptx
    assert result.spill_bytes in (None, 0), result.spill_bytes


def _sass(body: list[str]) -> str:
    # nvdisasm -c's shape: labels on their own lines, instructions with their offset comment
    lines, offset = [], 0
    for item in body:
        if item.endswith(":"):
            lines.append(item)
        else:
            lines.append(f"        /*{offset:04x}*/                   {item} ;")
            offset += 16
    return "\n".join(lines)


def test_loop_local_ops_counts_spills_of_the_tile_loops_only():
    from flexfa.compile_check import LOOP_MIN_INSTRUCTIONS, loop_local_ops
    filler = ["FFMA R0, R1, R2, R0"] * LOOP_MIN_INSTRUCTIONS
    sass = _sass(["STL [R1], R5", "LDL R6, [R1+0x4]",  # prologue: once per program
                  ".L_x_0:", "LDL R7, [R1]", "STL [R1+0x8], R7",
                  ".L_x_2:", "HMMA.16816.F32 R8, R4, R6, R8", *filler,
                  "@P1 BRA `(.L_x_2)",  # the tile loop, inside the outer loop
                  "@!P3 BRA `(.L_x_1)",  # to a wait laid out of line, which returns to L_x_5
                  ".L_x_5:", "LDL R3, [R1+0x8]", *filler,
                  "@P2 BRA `(.L_x_0)",  # the outer loop: not innermost
                  "EXIT",
                  ".L_x_1:", "SYNCS.PHASECHK.TRANS64 P0, [R2], RZ",
                  "@!P0 BRA `(.L_x_1)", "BRA `(.L_x_5)",
                  ".L_x_9:", "BRA `(.L_x_9)"])
    # the tile loop has no LDL/STL; the wait's return branch is not a loop (else L_x_5..
    # would be an innermost loop holding LDL R3)
    assert loop_local_ops(sass) == 0
    inner = sass.replace("HMMA.16816.F32 R8, R4, R6, R8", "LDL R9, [R1+0xc]")
    inner = inner.replace("@P1 BRA", "STL [R1+0xc], R9 ;\n        /*ffff*/   @P1 BRA")
    assert loop_local_ops(inner) == 2
    # a loop shorter than LOOP_MIN_INSTRUCTIONS (a spin loop) is not a tile loop
    short = _sass([".L_x_0:", "LDL R7, [R1]", "FFMA R0, R1, R2, R0", "@P0 BRA `(.L_x_0)"])
    assert loop_local_ops(short) == 0


def test_compile_result_reports_spills_inside_loops():
    name = "fwd_d128_bf16_causal"
    result = compile_job(name, 90, compile_check.REGISTRY[name], loops=True)
    assert compile_job(name, 90, compile_check.REGISTRY[name]).loop_local_ops is None
    assert result.ok, result.error
    if result.spill_bytes is None or result.loop_local_ops is None:
        pytest.skip("ptxas or nvdisasm is unavailable")  # Triton's wheel ships both
    assert result.loop_local_ops == 0
    assert "in loops" in format_table([result])


# sm_90 kernels whose wgmmas ptxas does not serialize today (C7515); the compile check's
# "serialized" column lists the ones it does (docs/head-dims.md, "Serialized wgmmas")
UNSERIALIZED = ("fwd_hopper_d128_bf16_causal", "fwd_hopper_d64_bf16_dense",
                "fwd_hopper_d128_bf16_causal_split", "bwd_dkdv_d128_bf16_softcap_causal",
                "bwd_dq_d128_bf16_softcap_causal", "bwd_dq_d256_bf16_softcap_causal_even",
                "bwd_dkdv_d256_bf16_softcap_causal_even", "bwd_dkdv_d64_bf16_dense",
                "bwd_dq_d64_bf16_dense")


@pytest.mark.parametrize("name", UNSERIALIZED)
def test_default_kernels_keep_their_wgmmas_unserialized(name):
    result = compile_job(name, 90, compile_check.REGISTRY[name])
    assert result.ok, result.error
    if result.wgmma_serialized is None:
        pytest.skip("ptxas is unavailable")  # Triton's wheel ships it
    assert result.wgmma and not result.wgmma_serialized, name


def test_the_table_shows_serialized_wgmmas():
    serial = CompileResult("k", 90, True, False, True, 255, 0, 1024, True)
    table = format_table([serial, CompileResult("m", 80, True, True, False, 128, 0, 1024,
                                                None)])
    header, _, first, second = table.splitlines()
    column = header.index("serialized")
    assert first[column:].startswith("yes") and second[column:].startswith("-")


def test_ragged_dkdv_tiles_reach_the_gemms_without_a_bounds_select():
    """At a ragged L the dK/dV kernel reads Q and dO through per-head descriptors (zeros past
    L) instead of selecting the rows past L in registers: E = 128 causal at its default tiles
    spilled 132 bytes, 21 local-memory instructions in the loop and 1127 on the tile's path
    with the select; 20 / 2 / 768 without (docs/head-dims.md)."""
    from flexfa.compile_check import jobs
    result = compile_job("ragged", 90, jobs.backward_job("dkdv", 128, "bf16",
                                                         mask_mod=jobs.causal_mask, ragged=True),
                         loops=True)
    assert result.ok, result.error
    if result.loop_local_ops is None or not result.loop_path:
        pytest.skip("ptxas or nvdisasm is unavailable")  # Triton's wheel ships both
    assert result.loop_local_ops <= 4 and sum(result.loop_path.values()) < 900, \
        (result.spill_bytes, result.loop_local_ops, sum(result.loop_path.values()))

