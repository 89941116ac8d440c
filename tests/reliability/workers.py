"""Code run in spawned processes by test_concurrency (kept free of pytest imports)."""
import os
import traceback
import warnings


def spawn_probe_mod(score, b, h, q_idx, kv_idx):
    return score * 0.625 - ((q_idx + 2 * kv_idx) % 5) * 0.25


def attend_once(cache_dir: str, barrier, results) -> None:
    """Import flexfa, wait for every process at ``barrier``, run one new mod through an empty
    cache, check the result against the float64 reference; report through ``results``."""
    os.environ["FLEXFA_CACHE_DIR"] = cache_dir
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import torch

        import flexfa
        from flexfa.reference import attention_reference
        from flexfa.runtime.cache import STATS

        generator = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, 2, n, 16, generator=generator) for n in (36, 44, 44))
        reference = attention_reference(q, k, v, spawn_probe_mod).float()
        barrier.wait(timeout=240)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = flexfa.flex_attention(q, k, v, score_mod=spawn_probe_mod)
        results.put({"pid": os.getpid(), "error": (out - reference).abs().max().item(),
                     "codegen": STATS.codegen, "disk_hits": STATS.disk_hits,
                     "warnings": [str(w.message) for w in caught if "flexfa" in str(w.message)]})
    except BaseException:  # reported to the parent, which fails the test with it
        results.put({"pid": os.getpid(), "traceback": traceback.format_exc()})
