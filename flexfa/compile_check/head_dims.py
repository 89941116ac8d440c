"""Compile-check variants of the large and odd head dims (E = 192 with Ev = 128 as in
DeepSeek's MLA, E = 256, E = 96 and 80 padded to 128), every family at the tiles the runtime
picks for them by default: ``python -m flexfa compile-check --only d192`` (or ``d256``,
``d96``, ``d80``) prints registers, spill bytes and shared memory. docs/performance.md "Head
dims" has the table and why the tiles are what they are."""
from __future__ import annotations

from ..codegen.spec import next_power_of_two
from ..runtime.autotune import hopper_configs
from . import register
from .jobs import (FP8_ARCHS, backward_job, causal_mask, forward_job, fp8_job, hopper_job,
                   softcap_mod)

# tag -> (E, Ev)
HEAD_DIMS = {"d192_ev128": (192, 128), "d256": (256, 256), "d96": (96, 96), "d80": (80, 80)}


def hopper_default_job(head_dim: int, dtype: str, head_dim_v: int | None = None, **mods):
    """``hopper_job`` at the runtime's default config for these head dims (``hopper_configs``;
    a causal block mask of 128 x 128 blocks keeps it)."""
    block_m, block_n, warps, stages, cap = hopper_configs(
        next_power_of_two(head_dim), next_power_of_two(head_dim_v or head_dim))[0]
    return hopper_job(head_dim, dtype, block_m=block_m, block_n=block_n, num_warps=warps,
                      num_stages=stages, max_registers=cap, head_dim_v=head_dim_v, **mods)


def _register() -> None:
    # a score_mod as well as the mask: the default tiles keep headroom for a mod's registers
    mods = dict(score_mod=softcap_mod, mask_mod=causal_mask)
    for tag, (E, Ev) in HEAD_DIMS.items():
        register(f"fwd_hopper_{tag}_bf16_softcap_causal",
                 hopper_default_job(E, "bf16", head_dim_v=Ev, **mods), archs=(90,))
        register(f"fwd_{tag}_bf16_softcap_causal", forward_job(E, "bf16", head_dim_v=Ev, **mods))
        for which in ("dkdv", "dq"):  # ragged lengths (bounds checks), then tile multiples
            register(f"bwd_{which}_{tag}_bf16_softcap_causal",
                     backward_job(which, E, "bf16", head_dim_v=Ev, **mods))
            if E > 128:  # past 128 the runtime's tiles differ between the two
                register(f"bwd_{which}_{tag}_bf16_softcap_causal_even",
                         backward_job(which, E, "bf16", head_dim_v=Ev, ragged=False, **mods),
                         archs=(90,))
        if E > 128:  # the FP8 tiles past 128: with descriptors on sm_90, pointer loads on both
            register(f"fwd_fp8_{tag}_causal_tma",
                     fp8_job(E, mask_mod=causal_mask, head_dim_v=Ev, use_tma=True), archs=(90,))
            register(f"fwd_fp8_{tag}_causal", fp8_job(E, mask_mod=causal_mask, head_dim_v=Ev),
                     archs=FP8_ARCHS)


_register()
