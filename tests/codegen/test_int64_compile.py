"""Compile-only checks (no GPU): kernels whose mods compute in int64 (a hash, an int64
captured tensor, a power) compile for sm_80 and sm_90 in the forward templates (Ampere-class,
Hopper) and the backward."""
import dataclasses

import pytest
import torch

from flexfa.compile_check.jobs import backward_job
from flexfa.compile_check import compile_job, kernel_job, traced_mods
from flexfa.codegen.forward import forward_kernel, forward_signature
from flexfa.codegen.hopper import HOPPER_TEMPLATE, hopper_kernel, hopper_signature
from flexfa.codegen.ranges import Domain, mods_int64_nodes
from flexfa.codegen.spec import KernelSpec

SALT = torch.tensor([3 * 10 ** 9, 7, -(2 ** 40), 11], dtype=torch.int64)


def hashed(score, b, h, q_idx, kv_idx):
    return score + ((q_idx * 3000017 * kv_idx + SALT[h % 4]) % 7).float()


def power_mask(b, h, q_idx, kv_idx):
    return (2 ** (kv_idx % 40) + q_idx * 5_000_000_000) % 3 != 1


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))


def _forward_builder(template: str):
    def build(arch: int):
        score, mask = traced_mods(hashed, power_mask)
        spec = KernelSpec(dtype="bf16", head_dim=64, head_dim_v=64, block_m=128, block_n=64,
                          num_warps=4, num_stages=2, has_block_mask=True, has_full_blocks=True,
                          sparse_q=128, sparse_kv=128, even_l=False, even_s=False,
                          return_lse=True, gqa_group=1, input_precision="ieee",
                          target=f"cuda:{arch}", template=template)
        spec = dataclasses.replace(spec, wide_ints=mods_int64_nodes(
            (score, mask), Domain(2, 8, 4096, 4096)))
        generate, signature = ((hopper_kernel, hopper_signature) if template == HOPPER_TEMPLATE
                               else (forward_kernel, forward_signature))
        source = generate(spec, score, mask).source
        assert ".to(tl.int64)" in source and ", 63)" in source
        return kernel_job(spec, score, mask, generate, signature)
    return build


@pytest.mark.parametrize("template,arch", [("fwd", 80), ("fwd", 90), (HOPPER_TEMPLATE, 90)])
def test_forward_with_int64_math_compiles(template, arch):
    result = compile_job(f"int64_{template}", arch, _forward_builder(template))
    assert result.ok, result.error


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("which", ["dq", "dkdv"])
def test_backward_with_int64_math_compiles(which, arch):
    # backward_job's lengths (256) make q_idx * 3000017 * kv_idx leave int32
    result = compile_job(f"int64_bwd_{which}", arch,
                         backward_job(which, 64, "bf16", score_mod=hashed, mask_mod=power_mask))
    assert result.ok, result.error
