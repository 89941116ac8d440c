"""GPU: fwd+bwd of a causal GQA call (the issue-26 case: B=2, Hq=32, Hkv=8, S=8192, E=128,
bf16) on the Gluon and the Triton backward, do_bench medians over rounds, with the peak extra
memory. The tree timed is the flexfa that PYTHONPATH finds (another tree's to time its
kernels). ``--peers`` adds torch FlexAttention (compiled, causal block mask, enable_gqa) and
SDPA's cuDNN backend (is_causal, enable_gqa) in the same rounds; ``--chunks 8,16`` adds the
Gluon backward with its dQ accumulator in that many parts (GLUON_BWD_DQ_CHUNKS).

    PYTHONPATH=. python benchmarks/experiments/gqa_bwd.py [--rounds 3] [--label new] [--peers] [--chunks 8]
"""
import argparse
import statistics


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default="")
    parser.add_argument("--peers", action="store_true")
    parser.add_argument("--chunks", default="")
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
    for n in filter(None, args.chunks.split(",")):
        configs[f"gluon_c{n}"] = {"GLUON_BACKWARD": True, "GLUON_BWD_DQ_CHUNKS": int(n)}
    if args.peers:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        tbm = create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, S, S, device="cuda")

        def flex():
            return compiled(q, k, v, block_mask=tbm, enable_gqa=True)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        configs.update(flex=flex, cudnn=cudnn)

    def step(opts):
        out = opts() if callable(opts) else flexfa.flex_attention(
            q, k, v, block_mask=mask, enable_gqa=True, kernel_options=opts)
        out.backward(do)
    grads = {}
    for label, opts in list(configs.items()):
        for t in (q, k, v):
            t.grad = None
        try:
            step(opts)
        except Exception as exc:  # a peer may not take GQA here: say so, time the rest
            print(f"{args.label} {label}: failed: {exc!r:.200}")
            del configs[label]
            continue
        grads[label] = [t.grad.float() for t in (q, k, v)]
    err = {label: max(float((a - b).norm() / b.norm())
                      for a, b in zip(grads[label], grads["triton"]))
           for label in grads if label != "triton"}
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
    for label, e in err.items():
        print(f"{args.label} {label} vs triton gradients: max relative L2 error {e:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
