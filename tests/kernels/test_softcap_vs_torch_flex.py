"""The GPU benchmark-case check of softcap+causal against torch's flex_attention, run here on
the CPU (flexfa under the interpreter, torch's eager flex_attention) at a small size, so the
comparison itself is exercised in CI (forward only: torch's eager flex_attention has no CPU
backward)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from test_bench_cases import softcap_against_torch_flex  # noqa: E402


def test_softcap_matches_torch_flex_attention_on_cpu():
    softcap_against_torch_flex("cpu", 256, 32, backward=False)
