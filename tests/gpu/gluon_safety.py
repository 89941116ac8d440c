"""What the Gluon GPU tests share: a barrier-phase mistake hangs the GPU instead of failing, so
a tiny call runs first in a subprocess under a time limit, and the other tests need it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def run_safely(script: str, limit: float, what: str) -> None:
    """Run ``script`` (it prints "ok True" per call) in a subprocess killed after ``limit``
    seconds; skip without an sm_90 GPU, fail on a hang, an error or a non-finite result."""
    if not sm90():
        pytest.skip("needs an sm_90 GPU")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                env=env, timeout=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Gluon {what} hung on a tiny call (barrier phases?)")
    assert result.returncode == 0, result.stderr[-3000:]
    words = result.stdout.split()
    assert words and words == ["ok", "True"] * (len(words) // 2), result.stdout


def case_inputs(case: tuple, name: str, device: str = "cuda") -> tuple:
    """(q, k, v, score_mod, mask_mod, block_mask) of a ``CASES`` entry (B, Hq, Hkv, L, S, E,
    mods(heads, device)) on ``device`` (the GPU; the CPU for the Gluon emulator's tests); E
    may be a pair (E, Ev); fp16 where the name ends so, else bf16."""
    from flexfa import create_block_mask

    from kernels.forward_utils import make_qkv
    B, Hq, Hkv, L, S, E, make_mods = case
    E, Ev = E if isinstance(E, tuple) else (E, E)
    dtype = torch.float16 if name.endswith("fp16") else torch.bfloat16
    score_mod, mask_mod = make_mods(Hq, device)
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev=Ev, dtype=dtype, device=device)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, L, S,
                                                                 device=device)
    return q, k, v, score_mod, mask_mod, block_mask
