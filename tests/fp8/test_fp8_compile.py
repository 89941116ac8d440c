"""Compile-only checks of the FP8 kernel for GPUs (no GPU needed): e4m3 tensor-core MMAs."""
import re

from flexfa import compile_check
from flexfa.compile_check.jobs import fp8_job
from flexfa.mods import causal


def test_sm90_causal_uses_e4m3_wgmma():
    result = compile_check.compile_job("fp8_d128_causal", 90, fp8_job(128, mask_mod=causal))
    assert result.ok, result.error
    assert re.search(r"wgmma\.mma_async\S*\.e4m3\.e4m3", result.ptx), "no e4m3 wgmma in the PTX"


def test_sm89_uses_e4m3_mma_sync():
    result = compile_check.compile_job("fp8_d64_dense", 89, fp8_job(64))
    assert result.ok, result.error
    assert re.search(r"mma\.sync\S*\.e4m3\.e4m3", result.ptx), "no e4m3 mma.sync in the PTX"
    assert not result.wgmma


def test_fp8_variants_are_registered():
    names = [n for n in compile_check.REGISTRY if n.startswith("fwd_fp8")]
    assert "fwd_fp8_d128_causal" in names and len(names) >= 4

