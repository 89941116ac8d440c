"""GPU: where the softcap forward's time goes on the Gluon forward (issue 25: softcap + causal
is 1.23x plain causal's time, the target 1.1x), B=1 H=16 S=16384 E=128 bf16 causal, in one
process, rounds over the cases in turn (do_bench medians, the median of the rounds):

- ``causal``: no score_mod;
- ``softcap``: 30 * tanh(s / 30) (what users write; since the sixteenth session the code
  generator folds the /30 into the scale and the *30 into the softmax's log2 scale,
  flexfa/codegen/fold.py, so the tile computes tanh and exp2 only);
- ``softcap_in``: 30 * tanh(s) with ``scale`` = scale / 30 (written folded: before the fold,
  one multiply less per score; now the same tile as ``softcap``);
- ``tanh_only``: tanh(s) with ``scale`` / 30 (before the fold, a timing proxy for folding the
  *30 too; its result differs: only its time is read);
each by default (``plain``: GLUON_STATIC_MAX is on by default, so the softcap subtracts its
bound), with the running max (``running``: GLUON_STATIC_MAX False), with ``GLUON_PINGPONG``
(and the persistent grid with ping-pong), and with ``GLUON_STATIC_MAX`` forced (alone and
with ping-pong).

    python benchmarks/experiments/softcap_ab.py [--rounds 3] [--mods causal,softcap]
        [--options plain,pingpong,persist_pp]
"""
import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=60)
    parser.add_argument("--mods", default="causal,softcap,softcap_in,tanh_only")
    parser.add_argument("--options", default="plain,pingpong,persist_pp",
                        help="plain (the defaults), running (GLUON_STATIC_MAX False: the "
                             "running row max), pingpong, persist_pp, static (GLUON_STATIC_MAX: "
                             "the softcap's bound for the row max; nothing for causal), "
                             "static_pp")
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    import flexfa
    from flexfa import mods

    S, H, E = 16384, 16, 128
    q, k, v = (torch.randn(1, H, S, E, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = flexfa.create_block_mask(mods.causal, None, None, S, S, device="cuda")
    scale = 1.0 / math.sqrt(E)

    def softcap(s, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(s / 30.0)

    def softcap_in(s, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(s)

    def tanh_only(s, b, h, q_idx, kv_idx):
        return torch.tanh(s)

    mods_ = {"causal": (None, scale), "softcap": (softcap, scale),
             "softcap_in": (softcap_in, scale / 30.0), "tanh_only": (tanh_only, scale / 30.0)}
    options = {"plain": {}, "running": {"GLUON_STATIC_MAX": False},
               "pingpong": {"GLUON_PINGPONG": True},
               "persist_pp": {"GLUON_PERSISTENT": True, "GLUON_PINGPONG": True},
               "static": {"GLUON_STATIC_MAX": True},
               "static_pp": {"GLUON_STATIC_MAX": True, "GLUON_PINGPONG": True}}
    unknown = set(args.options.split(",")) - set(options) | set(args.mods.split(",")) - set(mods_)
    if unknown or "plain" not in args.options.split(",") or \
            not {"causal", "softcap"} <= set(args.mods.split(",")):
        parser.error(f"--mods must include causal and softcap, --options plain; unknown: "
                     f"{sorted(unknown)}")
    mods_ = {name: mods_[name] for name in args.mods.split(",")}
    options = {name: options[name] for name in args.options.split(",")}
    cases = {}
    for name, (score_mod, sc) in mods_.items():
        for label, extra in options.items():
            opts = {"BACKEND": "GLUON", **extra}
            cases[f"{name}/{label}"] = (lambda score_mod=score_mod, sc=sc, opts=opts:
                                        flexfa.flex_attention(q, k, v, score_mod=score_mod,
                                                              block_mask=mask, scale=sc,
                                                              kernel_options=opts))
    # each case against the plain kernel of its mod (softcap_in: of softcap), each run once
    outs = {name: fn().float() for name, fn in cases.items()}
    for name, out in outs.items():
        mod = name.split("/")[0]
        if name.endswith("/plain") and mod != "softcap_in" or mod == "tanh_only":
            continue
        against = f"{'softcap' if mod == 'softcap_in' else mod}/plain"
        base = outs[against]
        print(f"{name} against {against}: relative error "
              f"{float((out - base).norm() / base.norm()):.2e}", flush=True)
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(do_bench(fn, warmup=100, rep=args.rep, return_mode="median"))
    base = statistics.median(times["causal/plain"])
    print(f"{'case':24} {'ms':>8} {'x causal':>9}  rounds")
    for name, rounds in times.items():
        ms = statistics.median(rounds)
        print(f"{name:24} {ms:8.3f} {ms / base:9.3f}  " + " ".join(f"{r:.3f}" for r in rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
