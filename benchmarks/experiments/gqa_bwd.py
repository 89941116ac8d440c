"""GPU: fwd+bwd of a causal GQA call (the issue-26 case: B=2, Hq=32, Hkv=8, S=8192, E=128,
bf16) on the Gluon and the Triton backward, do_bench medians over rounds, with the peak extra
memory. The tree timed is the flexfa that PYTHONPATH finds (another tree's to time its
kernels).

    PYTHONPATH=. python benchmarks/experiments/gqa_bwd.py [--rounds 3] [--label new]
"""
import argparse
import statistics


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    import flexfa

    B, Hq, Hkv, S, E = 2, 32, 8, 8192, 128
    q = torch.randn(B, Hq, S, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, Hkv, S, E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    do = torch.randn_like(q)
    mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, S, S, device="cuda")
    configs = {"gluon": {"GLUON_BACKWARD": True}, "triton": {"GLUON_BACKWARD": False}}

    def step(opts):
        flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True,
                              kernel_options=opts).backward(do)
    grads = {}
    for label, opts in configs.items():
        for t in (q, k, v):
            t.grad = None
        step(opts)
        grads[label] = [t.grad.float() for t in (q, k, v)]
    err = max(float((a - b).norm() / b.norm()) for a, b in zip(grads["gluon"], grads["triton"]))
    times = {label: [] for label in configs}
    for _ in range(args.rounds):
        for label, opts in configs.items():
            times[label].append(do_bench(lambda: step(opts), warmup=100, rep=100,
                                         return_mode="median", grad_to_none=[q, k, v]))
    for label, opts in configs.items():
        for t in (q, k, v):
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(opts)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        print(f"{args.label} {label}: fwd+bwd {statistics.median(times[label]):.3f} ms "
              f"(rounds {', '.join(f'{t:.3f}' for t in times[label])}), peak extra "
              f"{peak:.0f} MiB")
    print(f"{args.label} gluon vs triton gradients: max relative L2 error {err:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
