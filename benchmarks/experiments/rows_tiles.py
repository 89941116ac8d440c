"""GPU: the Gluon backward's row kernels timed alone over rows per program and warps (issue
26: in bwd_profile.py's causal step, B=1 H=16 S=16384 E=128, the postprocess took 0.154 ms,
the accumulator's zeroing 0.059 and the preprocess 0.036, against cuDNN's 0.122 for its dQ
conversion and dO.O together). Per kernel and (BLOCK, warps): the do_bench median in ms and
the bandwidth it reaches over the bytes it must move (the postprocess: the fp32 accumulator
read and dQ written; the preprocess: O and dO read, lse2 and delta written; the zeroing: the
accumulator written). The runtime's choice is runtime.families.gluon_bwd.ROWS_BLOCK and
ROWS_WARPS.

    python benchmarks/experiments/rows_tiles.py [--seq 16384] [--heads 16] [--dim 128]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--blocks", default="16,32,64,128")
    parser.add_argument("--warps", default="4,8")
    args = parser.parse_args()
    import torch
    import triton.testing

    from flexfa.codegen.gluon_bwd import POST, PRE, ZERO, RowsSpec
    from flexfa.runtime.families import gluon_bwd
    from flexfa.runtime.families.backward import Inputs

    L, H, E = args.seq, args.heads, args.dim
    dev = "cuda"
    q = torch.randn(1, H, L, E, device=dev, dtype=torch.bfloat16)
    out, grad_out, dq = torch.randn_like(q), torch.randn_like(q), torch.empty_like(q)
    lse = torch.randn(1, H, L, device=dev)
    x = Inputs(q, q, q, out, lse, grad_out, None, dq, q, q, {})
    acc = torch.randn(H * L, E, device=dev)
    major, minor = torch.cuda.get_device_capability()
    spec = RowsSpec(E, False, f"cuda:{major}{minor}")
    moved = {PRE: 2 * L * H * E * 2 + 2 * L * H * 4, POST: L * H * E * (4 + 2),
             ZERO: L * H * E * 4}
    default = (dict(gluon_bwd.ROWS_BLOCK), gluon_bwd.ROWS_WARPS)
    print(f"L={L} H={H} E={E}; default BLOCK {default[0]}, warps {default[1]}")
    print(f"{'kernel':6s} {'BLOCK':>5s} {'warps':>5s} {'ms':>8s} {'GB/s':>7s}")
    for kernel in (PRE, POST, ZERO):
        for block in map(int, args.blocks.split(",")):
            for warps in map(int, args.warps.split(",")):
                gluon_bwd.ROWS_BLOCK[kernel], gluon_bwd.ROWS_WARPS = block, warps
                pre, post = gluon_bwd.row_steps(spec, x, L)
                if kernel == PRE:
                    def run():
                        gluon_bwd.run_pre(pre, x, L)
                elif kernel == POST:
                    def run():
                        gluon_bwd.run_post(post, acc, x, 0.125)
                else:
                    zero = gluon_bwd.zero_step(spec, H * L)
                    bound = zero.binder.bind({"DQ_ACC": acc})

                    def run():
                        zero.launch(bound, q.device)
                run()
                ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
                name = kernel.rsplit("_", 1)[-1]
                print(f"{name:6s} {block:5d} {warps:5d} {ms:8.4f} {moved[kernel] / ms / 1e6:7.0f}",
                      flush=True)
                gluon_bwd.ROWS_BLOCK.update(default[0])
                gluon_bwd.ROWS_WARPS = default[1]
    return 0


if __name__ == "__main__":
    sys.exit(main())
