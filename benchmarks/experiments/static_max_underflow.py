"""GPU: where the Gluon forward's static max (docs/gluon.md, "Static max") loses values to
float32 underflow. With a softcap the kernel subtracts the proven bound instead of the row max,
so a row whose scores all sit near -cap has P near 2^-2cap/ln2 and P * V leaves float32's normal
range for tiny values; the running max keeps the row's largest P at 1. Prints, for values of
magnitude 2^-k, the largest error relative to the largest reference entry of the Gluon forward
with and without the static max and of the Hopper forward, against the float64 reference.

    python benchmarks/experiments/static_max_underflow.py [--cap 30] [--json PATH]
"""
import argparse
import json

import torch

import flexfa
from flexfa.reference import attention_reference

EXPONENTS = (20, 30, 40, 45, 50, 55, 60, 64)
VARIANTS = {"gluon, static max": {"BACKEND": "GLUON", "GLUON_STATIC_MAX": True},
            "gluon, running max": {"BACKEND": "GLUON", "GLUON_STATIC_MAX": False},
            "hopper": {"BACKEND": "HOPPER"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=float, default=30.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    extra = {} if device == "cuda" else {"GLUON_EMULATE": True}
    softcap = flexfa.mods.softcap(args.cap)
    E, L = 64, 256
    generator = torch.Generator().manual_seed(0)
    # q.k / sqrt(E) = -25 * 64 / 8 = -200: every score near -cap after the softcap
    q = torch.full((1, 2, L, E), -5.0).to(torch.bfloat16)
    k = torch.full((1, 2, L, E), 5.0).to(torch.bfloat16)
    rows = []
    for exponent in EXPONENTS:
        v = (2.0 ** -exponent * torch.randn(1, 2, L, E, generator=generator)).to(torch.bfloat16)
        want = attention_reference(q, k, v, softcap)
        scale = want.abs().max().item()
        row = {"exponent": exponent}
        for name, options in VARIANTS.items():
            if device == "cpu" and name == "hopper":
                options = {"BACKEND": "AUTO"}
            out = flexfa.flex_attention(*(t.to(device) for t in (q, k, v)), softcap,
                                        kernel_options={**options, **extra})
            row[name] = (out.double().cpu() - want).abs().max().item() / scale
        rows.append(row)
        print(f"|v| ~ 2^-{exponent}: " + ", ".join(f"{n} {row[n]:.3g}" for n in VARIANTS),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                       "cap": args.cap, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
