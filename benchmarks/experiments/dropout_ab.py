"""GPU: what dropout costs, flexfa with and without ``dropout_p`` (by default, with the
Hopper or the Gluon forward forced, and with the Gluon or the Triton backward forced) next to
SDPA's dropout (its flash and cuDNN backends),
forward and forward + backward, bf16, in one process.

flexfa is imported from ``PYTHONPATH`` (not from this file's tree), so that an A/B runs the
same script on two trees in alternating processes. Each case (batch, heads, length, head
dim, mask) is timed with triton's ``do_bench`` (median) in rounds; the JSON keeps every
round's medians.

    PYTHONPATH=TREE python benchmarks/experiments/dropout_ab.py out.json
        [--cases 4:16:4096:128:causal,...] [--p 0.1] [--rounds 2] [--rep 40] [--no-sdpa]
"""
import argparse
import json
import statistics

DEFAULT_CASES = "4:16:4096:128:causal,4:16:4096:128:dense,4:16:4096:64:causal,2:16:4096:256:causal"


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rep", type=int, default=40)
    parser.add_argument("--no-sdpa", action="store_true")
    parser.add_argument("--passes", default="fwd,fwd+bwd", help="fwd and/or fwd+bwd")
    args = parser.parse_args()
    passes = args.passes.split(",")
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    import flexfa

    results = {"flexfa": flexfa.__file__, "torch": torch.__version__, "p": args.p, "cases": {}}
    for case in args.cases.split(","):
        B, H, S, E, mask_name = case.split(":")
        B, H, S, E = int(B), int(H), int(S), int(E)
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, S, E, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn(B, H, S, E, device="cuda", dtype=torch.bfloat16)
        is_causal = mask_name == "causal"
        mask = flexfa.create_block_mask(causal, None, None, S, S, device="cuda") \
            if is_causal else None
        impls = {
            "flexfa": lambda: flexfa.flex_attention(q, k, v, block_mask=mask),
            "flexfa_drop": lambda: flexfa.flex_attention(q, k, v, block_mask=mask,
                                                         dropout_p=args.p, dropout_seed=1),
        }
        for family in ("hopper", "gluon"):  # the forward families, forced
            impls[f"flexfa_drop_{family}"] = (
                lambda family=family: flexfa.flex_attention(
                    q, k, v, block_mask=mask, dropout_p=args.p, dropout_seed=1,
                    kernel_options={"BACKEND": family.upper()}))
        for choice in (True, False):  # the backward families, forced (GLUON_BACKWARD)
            impls[f"flexfa_drop_bwd_{'gluon' if choice else 'triton'}"] = (
                lambda choice=choice: flexfa.flex_attention(
                    q, k, v, block_mask=mask, dropout_p=args.p, dropout_seed=1,
                    kernel_options={"GLUON_BACKWARD": choice}))
        if not args.no_sdpa:
            for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                  ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                for drop in (0.0, args.p):
                    def run(backend=backend, drop=drop):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                                  dropout_p=drop)
                    impls[name + ("_drop" if drop else "")] = run
        times = {}
        for name, fn in list(impls.items()):
            try:
                out = fn()  # compile, tune, check that it runs
                if "fwd+bwd" in passes:
                    out.backward(grad)
                torch.cuda.synchronize()
            except Exception as exc:  # an SDPA backend without this shape or dropout
                print(f"{case} {name}: skipped ({type(exc).__name__}: {str(exc)[:120]})")
                impls.pop(name)
                continue
            times[name] = {p: [] for p in passes}
        for _ in range(args.rounds):
            for name, fn in impls.items():
                if "fwd" in passes:
                    with torch.no_grad():
                        times[name]["fwd"].append(do_bench(fn, rep=args.rep,
                                                           return_mode="median"))
                if "fwd+bwd" in passes:
                    times[name]["fwd+bwd"].append(do_bench(
                        lambda: fn().backward(grad), rep=args.rep, grad_to_none=[q, k, v],
                        return_mode="median"))
        results["cases"][case] = times
        for name, t in times.items():
            print(f"{case:24s} {name:16s} " + "  ".join(
                f"{p} {statistics.median(t[p]):8.3f} ms" for p in passes), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
