"""Large head dims at the runtime's default tiles: E = 192 with Ev = 128 (DeepSeek's MLA)
and E = 256 on sm_90 (the Hopper forward, the backward's dK/dV and dQ kernels through tensor
descriptors, at ragged lengths and at tile multiples, whose tiles differ; the FP8
quantization kernel at 256) compile without register spills; the pointer-load kernels for
sm_80. At 192 the backward holds Q, K, dQ and dK in column blocks of 128 and 64
(flexfa.codegen.spec.head_dim_blocks), at 256 its dK/dV kernel walks the partial and full
blocks in one loop (bwd_dkdv.tmpl's ONE_LOOP). The variants are
flexfa.compile_check.head_dims's (``python -m flexfa compile-check --only d256``). Each
compile takes several seconds: the rest of the table runs under the ``slow`` marker."""
import pytest

from flexfa import compile_check
from flexfa.compile_check import compile_job


def _ptxas_missing() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(90).path
    except Exception as exc:  # spills come from ptxas -v: Triton ships it, trimmed installs not
        return f"ptxas is unavailable ({type(exc).__name__}: {exc})"
    return None


pytestmark = pytest.mark.skipif(_ptxas_missing() is not None, reason=str(_ptxas_missing()))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))


def _compiled(name: str, arch: int):
    result = compile_job(name, arch, compile_check.REGISTRY[name], loops=arch == 90)
    assert result.ok, f"{name} sm_{arch}: {result.error}"
    assert result.spill_bytes is not None, f"{name} sm_{arch}: ptxas -v reported nothing"
    return result


SM90_DEFAULTS = [f"fwd_hopper_{tag}_bf16_softcap_causal" for tag in ("d192_ev128", "d256")] + [
    f"bwd_{kernel}_{tag}_bf16_softcap_causal{lengths}" for tag in ("d192_ev128", "d256")
    for kernel, lengths in (("dkdv", ""), ("dkdv", "_even"), ("dq", "_even"), ("dq", ""))] + [
    "fp8_quantize_d256_fp16_rotate"]


# (spill bytes, local-memory instructions in the tile loops) allowed: none. E = 256's dK/dV
# walks its partial and full blocks in one loop under a guard that keeps its wgmmas
# unserialized (common.tmpl's flexfa_walk_mask_one_loop) and forms dS^T under the mask's
# branch, so that S^T's and dP^T's GEMMs give each warpgroup half the columns: it spilled
# 36 bytes (one local-memory instruction a tile) at tile multiples and 92 (18) at ragged
# lengths before, where under a block mask the ragged lengths take the even ones' 8-warp
# 64-key programs (backward.py's ragged_default); now neither spills
SPILL_BUDGET: dict[str, tuple[int, int]] = {}


@pytest.mark.parametrize("name", SM90_DEFAULTS)
def test_sm90_defaults_do_not_spill(name):
    result = _compiled(name, 90)
    spills, loop_ops = SPILL_BUDGET.get(name, (0, 0))
    assert result.spill_bytes <= spills, f"{name}: {result.spill_bytes} bytes of spills"
    assert (result.loop_local_ops or 0) <= loop_ops, \
        f"{name}: {result.loop_local_ops} local-memory instructions in loops"
    if result.wgmma_serialized is not None and result.wgmma:
        assert not result.wgmma_serialized, f"{name}: ptxas serialized its wgmmas"
    assert result.shared_bytes <= 227 * 1024, f"{name}: {result.shared_bytes} bytes of shared"
    if name.startswith("fwd_hopper"):
        assert result.wgmma and "cp.async.bulk.tensor" in result.ptx  # TMA loads, wgmma


# sm_80's pointer-load kernels, and on sm_90 E = 96 and 80 in column blocks (64 + 32,
# 64 + 16) at the E = 128 tiles, whose dK/dV programs spill there as at 128 itself (268
# bytes; the tiles won on the H200)
@pytest.mark.parametrize("name,arch,bound", [
    ("fwd_d256_bf16_softcap_causal", 80, 64),
    pytest.param("fwd_d192_ev128_bf16_softcap_causal", 80, 64, marks=pytest.mark.slow),
    pytest.param("bwd_dkdv_d256_bf16_softcap_causal", 80, 64, marks=pytest.mark.slow),
    pytest.param("bwd_dq_d256_bf16_softcap_causal", 80, 64, marks=pytest.mark.slow),
    pytest.param("bwd_dkdv_d192_ev128_bf16_softcap_causal", 80, 0, marks=pytest.mark.slow),
    pytest.param("bwd_dq_d192_ev128_bf16_softcap_causal", 80, 0, marks=pytest.mark.slow),
    pytest.param("bwd_dq_d96_bf16_softcap_causal", 90, 0, marks=pytest.mark.slow),
    pytest.param("bwd_dq_d80_bf16_softcap_causal", 90, 0, marks=pytest.mark.slow),
    pytest.param("bwd_dkdv_d96_bf16_softcap_causal", 90, 260, marks=pytest.mark.slow),
    pytest.param("bwd_dkdv_d80_bf16_softcap_causal", 90, 148, marks=pytest.mark.slow),
])
def test_sm80_and_split_e128_tiles_stay_bounded(name, arch, bound):
    result = _compiled(name, arch)
    assert (result.mma_sync, result.wgmma) == (arch == 80, arch == 90)
    assert result.spill_bytes <= bound, f"{name}: {result.spill_bytes} bytes of spills"


@pytest.mark.slow
@pytest.mark.parametrize("name,arch", [("fwd_fp8_d256_causal_tma", 90),
                                       ("fwd_fp8_d256_causal", 89),
                                       ("fwd_fp8_d192_ev128_causal_tma", 90),
                                       ("fwd_hopper_d96_bf16_softcap_causal", 90)])
def test_other_families_at_wide_dims(name, arch):
    assert _compiled(name, arch).spill_bytes <= 64


@pytest.mark.parametrize("variant, ragged", [("dense", False), ("dense", True),
                                             ("softcap", False)])
def test_full_walk_splits_the_dkdv_tiles(variant, ragged):
    """kernel_options BWD_FULL_WALK at 256: under the full walk's mask (every block full,
    mask_mod ``q_idx >= 0``) the dK/dV kernel keeps its one loop's mask branch and with it
    S^T and dP^T split between the warpgroups: no spills (the unmasked walk spills 8 and 124
    bytes dense; with noop_mask as the mask_mod the branch folded away and it spilled 56 and
    132, five and 29 local-memory instructions a tile)."""
    from flexfa.compile_check import jobs
    mods = {"score_mod": jobs.softcap_mod} if variant == "softcap" else {}
    result = compile_job(f"full walk {variant}", 90, jobs.backward_job(
        "dkdv", 256, "bf16", ragged=ragged, full_walk=True, **mods), loops=True)
    assert result.ok, result.error
    assert (result.spill_bytes, result.loop_local_ops) == (0, 0)
    assert result.wgmma and not result.wgmma_serialized


@pytest.mark.parametrize("variant", ["GQA 4 causal", "GQA 4 softcap + causal"])
def test_192_one_loop_splits_the_dkdv_tiles(variant):
    """E = 192 / Ev = 128 at tile multiples (8 warps, 64 keys): the dK/dV kernel's one loop
    (bwd_dkdv.tmpl's ONE_LOOP) gives S^T and dP^T half the columns each warpgroup, as at
    256; in the two loops GQA 4 causal spilled 36 bytes and with a softcap 20."""
    from flexfa.compile_check import jobs
    mods = {"score_mod": jobs.softcap_mod} if "softcap" in variant else {}
    result = compile_job(f"192 {variant}", 90, jobs.backward_job(
        "dkdv", 192, "bf16", head_dim_v=128, ragged=False, mask_mod=jobs.causal_mask,
        gqa_group=4, **mods), loops=True)
    assert result.ok, result.error
    assert (result.spill_bytes, result.loop_local_ops) == (0, 0)
    assert result.wgmma and not result.wgmma_serialized


@pytest.mark.parametrize("score", ["causal", "softcap + causal"])
def test_dropout_one_loop_at_256_keeps_spills_down(score):
    """Dropout under a block mask at 256 runs the one loop: sm_90 104-128 bytes of spills and
    23-35 local-memory instructions a tile, where the two loops spilled 464-644 and 113-201."""
    from flexfa.compile_check import jobs
    mods = {"score_mod": jobs.softcap_mod} if "softcap" in score else {}
    result = compile_job(f"256 dropout {score}", 90, jobs.backward_job(
        "dkdv", 256, "bf16", ragged=False, mask_mod=jobs.causal_mask, dropout=True, **mods),
        loops=True)
    assert result.ok, result.error
    assert result.spill_bytes <= 160 and result.loop_local_ops <= 40, (
        result.spill_bytes, result.loop_local_ops)
    assert result.wgmma and not result.wgmma_serialized


@pytest.mark.parametrize("dims, variant", [((192, 128), "softcap"), ((192, 128), "dense"),
                                           ((256, 256), "softcap")])
def test_ragged_unmasked_dkdv_in_one_body(dims, variant):
    """Without a block mask at a ragged L past head dim 128 the dK/dV kernel walks every q
    tile in one bounds-checked body (bwd_dkdv.tmpl's RAGGED_L_APART off): no spills in its
    loop, 8 bytes outside (with the ragged tile apart 192 / 128 softcap spilled 100 bytes and
    13 local-memory instructions a tile, dense 56, 256 softcap 80 / 4)."""
    from flexfa.compile_check import jobs
    mods = {"score_mod": jobs.softcap_mod} if variant == "softcap" else {}
    E, Ev = dims
    result = compile_job(f"{dims} ragged {variant}", 90, jobs.backward_job(
        "dkdv", E, "bf16", head_dim_v=Ev, ragged=True, **mods), loops=True)
    assert result.ok, result.error
    assert result.spill_bytes <= 16 and result.loop_local_ops == 0, (
        result.spill_bytes, result.loop_local_ops)
    assert result.mma_sync  # the ragged lengths' 4-warp, 32-key programs
