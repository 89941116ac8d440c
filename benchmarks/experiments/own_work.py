"""flexfa's own first-call work for a new mod, stage by stage, without a GPU: trace and
simplify, forward codegen, cache write + import of the compiled-mode module, then the
backward's derivative, codegen and import. Triton's compile is not included (it happens at
the first launch). Prints one JSON line of milliseconds.

    python benchmarks/experiments/own_work.py
"""
from __future__ import annotations

import json
import os
import tempfile
import time

os.environ["FLEXFA_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexfa-own-")


def main() -> dict:
    import torch

    from flexfa.codegen.backward import BackwardSpec, backward_kernel
    from flexfa.codegen.hopper import hopper_kernel
    from flexfa.codegen.spec import KernelSpec
    from flexfa.frontend.grad import derive
    from flexfa.runtime.cache import get_module
    from flexfa.runtime.pipeline import prepare_score_mod

    cap = 27.0 + time.time() % 1.0  # a constant no cache has seen

    def new_softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    ms = {}

    def stage(name, fn):
        start = time.perf_counter()
        value = fn()
        ms[name] = (time.perf_counter() - start) * 1e3
        return value

    score = stage("trace_simplify", lambda: prepare_score_mod(new_softcap))
    spec = KernelSpec(dtype="bf16", head_dim=128, head_dim_v=128, block_m=128, block_n=128,
                      num_warps=8, num_stages=2, has_block_mask=True, has_full_blocks=True,
                      sparse_q=128, sparse_kv=128, even_l=True, even_s=True, return_lse=True,
                      gqa_group=1, input_precision="ieee", target="cuda:90",
                      template="fwd_hopper")
    generated = stage("fwd_codegen", lambda: hopper_kernel(spec, score, None))
    stage("fwd_cache_write_import", lambda: get_module(generated.name, generated.key, False,
                                                       lambda: generated.source))
    joint = stage("bwd_derive", lambda: derive(score))
    bspec = BackwardSpec(dtype="bf16", head_dim=128, head_dim_v=128, block_m1=32, block_n1=64,
                         block_m2=64, block_n2=32, num_warps=4, num_stages=2,
                         has_block_mask=True, has_full_blocks=True, sparse_q=128,
                         sparse_kv=128, even_l1=True, even_s1=True, even_l2=True,
                         even_s2=True, gqa_group=1, deterministic=False, has_dlse=False,
                         input_precision="ieee", target="cuda:90")
    bgen = stage("bwd_codegen", lambda: backward_kernel(bspec, joint, score, None))
    stage("bwd_cache_write_import", lambda: get_module(bgen.name, bgen.key, False,
                                                       lambda: bgen.source))
    ms["fwd_total"] = ms["trace_simplify"] + ms["fwd_codegen"] + ms["fwd_cache_write_import"]
    ms["fwd_bwd_total"] = sum(v for k, v in ms.items() if k != "fwd_total")
    print(json.dumps({k: round(v, 1) for k, v in ms.items()}), flush=True)
    return ms


if __name__ == "__main__":
    main()
