"""GPU: flexfa under two or more kernel_options configurations in alternating rounds, at any
head dims (issue 28: where GLUON_BACKWARD='AUTO' should take the wide Gluon backward, at
E = 192 / Ev = 128, at 256 below S = 4096 and with dropout; whether GLUON_QK_TRIM pays).

For each case ``E[/Ev]:S:variant[+drop][+full][+nomask][+gqaN][+bcast][+learn|+learnv]``
(variants of ``flexfa.bench_cases.bench_variants``; ``+drop``: with ``dropout_p`` ``--p``;
``+full``: a variant without a mask_mod under a block mask whose every block is full (the
block-mask walk on a dense call); ``+nomask``: the variant's score_mod without its mask_mod;
``+gqaN``: H / N key and value heads (``enable_gqa``); ``+bcast``: the upstream gradient of
``out.sum()`` (ones, broadcast: every stride 0) in place of a dense random one; ``+learn``: plus
learnable captured tensors, a relative bias times a 0-d gain and the score times a head scale,
``+learnv`` also a row bias row[h, q] and a key bias col[kv]: ``bench_cases.learnable_mod``
over the variant's score_mod, their gradients compared and timed too; B = tokens / S, H = 16,
bf16), the forward or fwd+bwd
(``--passes``) under each configuration of ``--configs`` in turn, each round in the reverse
order of the one before (do_bench medians, the median of the rounds), and the peak extra
memory of one call. The outputs (and with fwd+bwd the gradients) of every configuration are
compared with the first's before timing (the largest difference over the first's largest
value, per tensor). The default configurations are the Triton and the Gluon backward.

    python benchmarks/experiments/options_ab.py OUT.json [--rounds 3] [--passes fwd+bwd]
        [--cases 192/128:8192:causal,256:2048:full,256:8192:causal+drop] [--tokens 16384]
        [--configs 'triton={"GLUON_BACKWARD": false};gluon={"GLUON_BACKWARD": true}'] [--p 0.1]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DEFAULT_CONFIGS = 'triton={"GLUON_BACKWARD": false};gluon={"GLUON_BACKWARD": true}'


SUFFIXES = ("drop", "full", "nomask", "bcast", "learn", "learnv")


def parse_case(text: str) -> dict:
    """A case's E, Ev, S, variant, its flags (drop, full, nomask, bcast), learn ('', 'learn'
    or 'learnv') and gqa (query heads per key head)."""
    dims, S, variant = text.split(":")
    E, _, Ev = dims.partition("/")
    variant, *suffixes = variant.split("+")
    learn = [x for x in suffixes if x in ("learn", "learnv")]
    gqa = [x for x in suffixes if x.startswith("gqa") and x[3:].isdigit() and int(x[3:]) > 0]
    if (any(x not in SUFFIXES and x not in gqa for x in suffixes) or len(learn) > 1
            or len(gqa) > 1):
        raise ValueError(f"case {text!r}: a variant's suffixes are '+drop', '+full', "
                         f"'+nomask', '+bcast', '+gqaN' and one of '+learn', '+learnv', not "
                         f"{suffixes}")
    return dict(E=int(E), Ev=int(Ev or E), S=int(S), variant=variant,
                learn=(learn or [""])[0], gqa=int(gqa[0][3:]) if gqa else 1,
                **{x: x in suffixes for x in ("drop", "full", "nomask", "bcast")})



def parse_configs(text: str) -> dict[str, dict]:
    configs = {}
    for item in text.split(";"):
        label, _, options = item.partition("=")
        configs[label.strip()] = json.loads(options)
    if len(configs) < 2:
        raise ValueError(f"--configs needs two or more LABEL=JSON items, got {text!r}")
    return configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--cases", default="192/128:8192:causal,192/128:8192:full")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="LABEL=JSON kernel_options items separated by ';'")
    parser.add_argument("--passes", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--p", type=float, default=0.1, help="dropout_p of '+drop' cases")
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    backward = args.passes == "fwd+bwd"
    import torch
    from triton.testing import do_bench

    import flexfa
    from flexfa.bench_cases import bench_variants, learnable_mod
    from flexfa.runtime.families.backward import every_key  # BWD_FULL_WALK's mask_mod

    first = next(iter(configs))
    rows = []
    for case in args.cases.split(","):
        c = parse_case(case)
        E, Ev, S, learn, gqa = c["E"], c["Ev"], c["S"], c["learn"], c["gqa"]
        dropout = {"dropout_p": args.p, "dropout_seed": 1} if c["drop"] else {}
        B = max(1, args.tokens // S)
        score_mod, mask_mod = bench_variants(S, args.heads, "cuda")[c["variant"]]
        if args.heads % gqa:
            raise ValueError(f"case {case!r}: --heads {args.heads} is not a multiple of {gqa}")
        if c["nomask"]:
            mask_mod = None
        if c["full"]:
            if mask_mod is not None:
                raise ValueError(f"case {case!r}: '+full' is for variants without a mask_mod")
            mask_mod = every_key
        buffers = []
        if learn:
            score_mod, buffers = learnable_mod(args.heads, S, S, seed=0, device="cuda",
                                               vectors=learn == "learnv", base=score_mod)
            buffers = list(buffers)
        mask = (None if mask_mod is None else
                flexfa.create_block_mask(mask_mod, None, None, S, S, device="cuda"))
        q = torch.randn(B, args.heads, S, E, device="cuda", dtype=torch.bfloat16,
                        requires_grad=backward)
        k = torch.randn(B, args.heads // gqa, S, E, device="cuda", dtype=torch.bfloat16,
                        requires_grad=backward)
        v = torch.randn(B, args.heads // gqa, S, Ev, device="cuda", dtype=torch.bfloat16,
                        requires_grad=backward)
        do = (torch.ones((), device="cuda", dtype=torch.bfloat16).expand(B, args.heads, S, Ev)
              if c["bcast"] else
              torch.randn(B, args.heads, S, Ev, device="cuda", dtype=torch.bfloat16))
        leaves = [q, k, v, *buffers] if backward else buffers

        def step(opts):
            out = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask,
                                        kernel_options=opts, enable_gqa=gqa > 1, **dropout)
            if backward:
                out.backward(do)
            return out
        results, peak = {}, {}
        for label, opts in configs.items():
            for _ in range(2):  # the first call compiles; the second's peak is the call's
                for t in leaves:
                    t.grad = None
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                with torch.set_grad_enabled(backward):
                    out = step(opts)
                torch.cuda.synchronize()
            peak[label] = (torch.cuda.max_memory_allocated() - base) / 2**20
            results[label] = [out.detach().float()] + (
                [t.grad.float() for t in leaves] if backward else [])
        err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))
                  for label in configs for a, b in zip(results[label], results[first]))
        times = {label: [] for label in configs}
        for r in range(args.rounds):
            order = list(configs) if r % 2 == 0 else list(reversed(configs))
            for label in order:
                with torch.set_grad_enabled(backward):
                    times[label].append(do_bench(
                        lambda opts=configs[label]: step(opts), warmup=100, rep=args.rep,
                        return_mode="median", grad_to_none=leaves if backward else None))
        med = {label: statistics.median(ts) for label, ts in times.items()}
        rows.append({"case": case, "B": B, "H": args.heads, "passes": args.passes,
                     "dropout_p": args.p if c["drop"] else 0.0, "configs": configs, "ms": med,
                     "rounds": times, "peak_mib": peak, "rel_err": err,
                     "over_first": {label: med[label] / med[first] for label in configs}})
        print(f"{case:24s} B={B:<2d} " + " ".join(
            f"{label} {med[label]:8.3f} ({med[label] / med[first]:.3f}x, "
            f"{peak[label]:.0f} MiB)" for label in configs) + f" rel.err {err:.1e}", flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        del q, k, v, do, results, leaves, buffers
    print(f"\n{args.passes} ms; ratios over {first}")
    print(f"{'case':24s} " + " ".join(f"{label:>12s}" for label in configs) + "  ratios")
    for row in rows:
        print(f"{row['case']:24s} " + " ".join(f"{row['ms'][label]:12.3f}" for label in configs)
              + "  " + " ".join(f"{row['over_first'][label]:.3f}" for label in configs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
