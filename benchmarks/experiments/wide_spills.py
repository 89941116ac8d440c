"""CPU (no GPU): where the backward's kernels spill at the wide head dims (issue 28). For E =
256 and 192 with Ev = 128, every mod class of the table (and calls without a mask under
kernel_options BWD_FULL_WALK) and both length kinds (tile multiples, whose sm_90 default is
64 keys x 64 rows on 8 warps, and ragged lengths, 32-key programs on 4 warps, except at 256
under a block mask: the 64-key ones, backward.py's ragged_default), compiles the dK/dV and dQ
kernels for sm_90 at the runtime's default tiles
(``flexfa.compile_check.jobs.backward_job``) and prints ``ptxas -v``'s spill store bytes next
to the local-memory instructions inside the tile loops (``loop_local_ops``: the spills paid on
every tile), and "S" where ptxas serialized the kernel's wgmmas (C7514 / C7515). A cold Triton
cache compiles about 90 kernels (minutes). The rows without a block mask ("dense", "softcap",
"GQA 4") compile the unmasked walk: at 256 that is kernel_options ``BWD_FULL_WALK=False``,
as the default ('AUTO') takes the "full walk" rows there (not at 192, and not with dropout).

    python benchmarks/experiments/wide_spills.py [--dims 256,192] [--only dropout] [--no-tma]
        [--block-m1 32]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def variants():
    from flexfa.compile_check import jobs
    softcap, causal = jobs.softcap_mod, jobs.causal_mask
    return {
        "dense": {}, "softcap": dict(score_mod=softcap), "causal": dict(mask_mod=causal),
        "softcap + causal": dict(score_mod=softcap, mask_mod=causal),
        "document": dict(mask_mod=jobs.document_mask()),
        "ALiBi + causal": dict(score_mod=jobs.slopes_mod(), mask_mod=causal),
        "GQA 4": dict(gqa_group=4),
        "GQA 4 causal": dict(mask_mod=causal, gqa_group=4),
        "GQA 4 softcap + causal": dict(score_mod=softcap, mask_mod=causal, gqa_group=4),
        "dropout": dict(dropout=True), "dropout + causal": dict(mask_mod=causal, dropout=True),
        "dS workspace, causal": dict(mask_mod=causal, ds=True),
        # kernel_options BWD_FULL_WALK: no block mask, walked through all-full tables
        "full walk, dense": dict(full_walk=True),
        "full walk, softcap": dict(score_mod=softcap, full_walk=True),
        "full walk, GQA 4": dict(gqa_group=4, full_walk=True),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="256,192", help="256 (Ev 256) and/or 192 (Ev 128)")
    parser.add_argument("--only", default="", help="only variants whose name contains this")
    parser.add_argument("--no-tma", action="store_true",
                        help="pointer loads instead of tensor descriptors (kernel_options "
                             "bwd_USE_TMA=False; past 128 the backward then takes its small "
                             "pointer-load tiles, so the cells compare other tiles too)")
    parser.add_argument("--block-m1", type=int, default=0,
                        help="the dK/dV kernel's query rows per step (kernel_options "
                             "bwd_BLOCK_M1; the other tiles at each cell's default)")
    args = parser.parse_args()
    from flexfa.compile_check import compile_job
    from flexfa.compile_check.jobs import backward_job

    print("E    variant                 "
          "dK/dV even      dK/dV ragged    dQ even         dQ ragged   (bytes / in loops"
          ", S: wgmmas serialized)")
    for dim in (int(d) for d in args.dims.split(",")):
        for name, mods in variants().items():
            if args.only not in name:
                continue
            cells = []
            for which in ("dkdv", "dq"):
                for ragged in (False, True):
                    result = compile_job(name, 90, backward_job(
                        which, dim, "bf16", head_dim_v=128 if dim == 192 else dim,
                        ragged=ragged, use_tma=False if args.no_tma else None,
                        block_m1=args.block_m1 or None, **mods), loops=True)
                    serial = " S" if result.wgmma_serialized else ""
                    cells.append(f"{result.spill_bytes} / {result.loop_local_ops}{serial}"
                                 if result.ok else "FAIL")
            print(f"{dim:<4} {name:23s} " + "".join(f"{c:16s}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
