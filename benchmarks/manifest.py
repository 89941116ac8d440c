"""Write ``manifest.json`` into a results folder: commit, GPU, versions, command and date of a run.

Every run keeps its files in a folder of its own under ``benchmarks/results/`` with this
manifest beside them (see benchmarks/README.md); the GPU scripts (h200_run.sh, gpu_checks.sh)
write it before their first step. Works without a GPU (``gpu``: "none").

    python benchmarks/manifest.py OUT_DIR --command "bash benchmarks/h200_run.sh a"
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIELDS = ("commit", "gpu", "versions", "command", "date")


def _commit() -> str:
    """$FLEXFA_COMMIT (a device's copy may have stale git metadata), else git's HEAD."""
    if os.environ.get("FLEXFA_COMMIT"):
        return os.environ["FLEXFA_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except Exception:  # not installed or broken: the manifest says so
        return "unknown"


def _gpu() -> str:
    try:
        import torch
    except Exception:
        return "unknown"
    if not torch.cuda.is_available():
        return "none"
    return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))


def manifest(command: str) -> dict:
    versions = {"python": platform.python_version(), "torch": _version("torch"),
                "triton": _version("triton"), "numpy": _version("numpy")}
    try:
        import torch
        versions["cuda"] = torch.version.cuda or "none"
    except Exception:
        versions["cuda"] = "unknown"
    return {"commit": _commit(), "gpu": _gpu(), "versions": versions, "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the run's results folder (created if missing)")
    parser.add_argument("--command", required=True, help="the command the run executes")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(manifest(args.command), indent=1) + "\n"
    (out / "manifest.json").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
