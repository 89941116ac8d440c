"""GPU: what the partition barriers before the Gluon forward's mbarrier operations cost (issue
25). Triton 3.6's shared-memory barrier analysis puts a `bar.sync` of the consumer warpgroup
(128 threads) before each `mbarrier.arrive` (one thread arrives for the warpgroup: the analysis
makes every thread's earlier work visible first) and before some waits: three a kv tile in the
forward's consumers. Where the arrive only releases a K or V stage that a retired wgmma read
(the wgmma is one warpgroup operation, so the arriving thread's own `wgmma.wait_group` already
proves it done, as FlashAttention-3's consumers rely on), the rendezvous is not needed.

This A/B removes those `bar.sync` lines from the forward's PTX (Triton's kernel dump and
override: TRITON_KERNEL_DUMP / TRITON_KERNEL_OVERRIDE, in child processes), checks that the
outputs are bitwise those of the unpatched kernel and that the patched side compiled each
patched kernel from its file (Triton logs each override), and times both in turn (B=1 H=16 S=16384
E=128 bf16, the default options: no TMA store, no persistent grid, whose consumers write
shared memory or publish a Q release):

    python benchmarks/experiments/arrive_sync_ab.py [--rounds 3] [--cases causal,full,softcap]

A measurement tool only: flexfa does not patch PTX.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a consumer warpgroup's rendezvous (named barrier 0 or 2 of 128 threads) ...
_SYNC = re.compile(r"^\s*bar\.sync\s+[02],\s*128;\s*$")
# ... right before a single-thread arrive (not an expect-tx) or a wait
_MBAR = re.compile(r"^\s*(@%p\d+\s+mbarrier\.arrive\.shared::cta\.b64\s+_,\s*\[%r\d+\];"
                   r"|mbarrier\.try_wait\.parity)")
_SKIP = re.compile(r"^\s*($|//|\.loc|\{|\.reg|waitLoop:)")


def strip_syncs(ptx: str) -> tuple[str, int]:
    """``ptx`` without the consumer rendezvous lines whose next instruction is an mbarrier
    arrive or wait, and how many were removed."""
    lines = ptx.split("\n")
    keep, removed = [], 0
    for i, line in enumerate(lines):
        if _SYNC.match(line):
            j = i + 1
            while j < len(lines) and _SKIP.match(lines[j]):
                j += 1
            if j < len(lines) and _MBAR.match(lines[j]):
                removed += 1
                continue
        keep.append(line)
    return "\n".join(keep), removed


CHILD = r"""
import json, sys, torch, flexfa
from flexfa import mods
from triton.testing import do_bench
cases, rep, out_dir = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
S, H, E = 16384, 16, 128
torch.manual_seed(0)
q, k, v = (torch.randn(1, H, S, E, device="cuda", dtype=torch.bfloat16) for _ in range(3))
causal = flexfa.create_block_mask(mods.causal, None, None, S, S, device="cuda")
table = {"causal": (None, causal), "full": (None, None), "softcap": (mods.softcap(30.0), causal)}
rows = {}
for name in cases:
    score_mod, mask = table[name]
    fn = lambda: flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask,
                                       kernel_options={"BACKEND": "GLUON"})
    out = fn()
    torch.save(out.cpu(), f"{out_dir}/{name}.pt")
    rows[name] = do_bench(fn, warmup=100, rep=rep, return_mode="median")
print("ROWS " + json.dumps(rows))
"""


def child(cases: str, rep: int, out_dir: str, env: dict) -> tuple[dict, int]:
    """(median ms per case, how many kernels Triton compiled from an override file)."""
    done = subprocess.run([sys.executable, "-c", CHILD, cases, str(rep), out_dir],
                          capture_output=True, text=True, env=env, timeout=400)
    rows = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode or not rows:
        raise SystemExit(f"child failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    overridden = sum("Overriding kernel with file" in line
                     for line in (done.stdout + done.stderr).splitlines())
    return json.loads(rows[-1][5:]), overridden


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=60)
    parser.add_argument("--cases", default="causal,full,softcap")
    args = parser.parse_args()
    cases = args.cases.split(",")
    import torch

    work = Path(tempfile.mkdtemp(prefix="arrive_sync_"))
    dump, override = work / "dump", work / "override"
    # a private Triton cache: Triton's cache key does not cover the override, so a patched
    # binary written to a shared cache would be loaded later by unpatched runs
    base = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_ALWAYS_COMPILE": "1",
            "FLEXFA_CACHE_DIR": str(work / "flexfa"), "TRITON_CACHE_DIR": str(work / "triton")}
    outs = {"dump": work / "o_dump", "plain": work / "o_plain", "patched": work / "o_patched"}
    for folder in outs.values():
        folder.mkdir()
    child(args.cases, 5, str(outs["dump"]), {**base, "TRITON_KERNEL_DUMP": "1",
                                              "TRITON_DUMP_DIR": str(dump)})
    removed = {}
    for ptx in dump.glob("*/*.ptx"):
        if not ptx.name.startswith("flexfa_fwd_gluon"):
            continue
        target = override / ptx.parent.name
        target.mkdir(parents=True, exist_ok=True)
        text, n = strip_syncs(ptx.read_text())
        (target / ptx.name).write_text(text)
        removed[f"{ptx.parent.name[:8]}/{ptx.name}"] = n  # one compile (hash) each
    print("bar.sync lines removed:", removed, flush=True)
    envs = {"plain": base, "patched": {**base, "TRITON_KERNEL_OVERRIDE": "1",
                                       "TRITON_OVERRIDE_DIR": str(override)}}
    times = {side: {name: [] for name in cases} for side in envs}
    for _ in range(args.rounds):
        for side, env in envs.items():
            rows, overridden = child(args.cases, args.rep, str(outs[side]), env)
            # the patched side must have compiled every patched kernel from its file (else
            # both sides would time the same kernels), the plain side none
            want = len(removed) if side == "patched" else 0
            if overridden != want:
                raise SystemExit(f"{side}: {overridden} kernels overridden, expected {want}")
            for name, ms in rows.items():
                times[side][name].append(ms)
    print(f"{'case':10} {'plain ms':>9} {'patched':>9} {'speedup':>8}  equal  rounds")
    for name in cases:
        a, b = (statistics.median(times[s][name]) for s in ("plain", "patched"))
        equal = all(torch.equal(torch.load(outs["dump"] / f"{name}.pt"),
                                torch.load(outs[s] / f"{name}.pt")) for s in envs)
        print(f"{name:10} {a:9.3f} {b:9.3f} {a / b:8.3f}  {equal!s:5}  "
              + " ".join(f"{x:.3f}/{y:.3f}" for x, y in zip(times['plain'][name],
                                                             times['patched'][name])))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
