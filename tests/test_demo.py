"""python -m flexfa demo: runs every variant on the CPU, checks, draws; fails loudly."""
import pathlib
import subprocess
import sys


import flexfa
from flexfa import demo
from flexfa.reference import attention_reference

REPO = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ["causal", "sliding window", "alibi + causal", "softcap 20", "document packing",
            "learnable relative bias"]


def test_demo_runs_checks_and_draws(tmp_path):
    png = tmp_path / "mask.png"
    done = subprocess.run([sys.executable, "-m", "flexfa", "demo", "--png", str(png)],
                          capture_output=True, text=True, cwd=str(REPO), timeout=300,
                          env={"PATH": "/usr/bin:/bin", "FLEXFA_CACHE_DIR": str(tmp_path / "cache"),
                               "HOME": str(tmp_path)})
    out = done.stdout
    assert done.returncode == 0, f"demo failed:\n{out}\n{done.stderr}"
    assert "CPU through the Triton interpreter" in out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    for name in VARIANTS:
        row = next((line for key, line in rows.items() if key.startswith(name)), None)
        assert row is not None and row.rstrip().endswith("ok"), f"no passing row for {name}:\n{out}"
    assert "compiled" in out, "a fresh cache directory means kernels were compiled"
    assert "all checks passed (forward and backward)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_attention(error=0.0, detach=False):
    """A stand-in for flex_attention: dense float32 attention, optionally wrong or no-grad."""
    def attention(q, k, v, score_mod=None, block_mask=None, **kwargs):
        mask_mod = block_mask.mask_mod if block_mask is not None else None
        out = attention_reference(q, k, v, score_mod, mask_mod, dtype=q.dtype) + error
        return out.detach() if detach else out
    return attention


def test_demo_exits_non_zero_when_a_check_fails(monkeypatch, capsys):
    monkeypatch.setattr(flexfa, "flex_attention", _fake_attention(error=0.05), raising=False)
    assert demo.main(["--only", "causal", "--no-png", "--seq-len", "64"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "FAILED: causal" in out


def test_demo_reports_a_missing_backward(monkeypatch, capsys):
    monkeypatch.setattr(flexfa, "flex_attention", _fake_attention(detach=True), raising=False)
    assert demo.main(["--only", "softcap", "--no-png", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "fwd only" in out and "backward missing" in out
    assert "the backward is not available yet" in out


def test_demo_reports_an_exception_as_a_failure(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(flexfa, "flex_attention", broken, raising=False)
    assert demo.main(["--only", "softcap", "--no-png", "--seq-len", "64"]) == 1
    assert "RuntimeError: kernel exploded" in capsys.readouterr().out


def test_table_format():
    rows = [demo.Result("causal", 37.5, 1e-7, 2e-6, 0.5, "compiled", "ok"),
            demo.Result("softcap", None, 1e-7, None, 0.2, "cached", "fwd only", "backward missing")]
    text = demo.format_table(rows)
    assert "37.5%" in text and "2.00e-06" in text and "backward missing" in text
    header, _, first, second = text.splitlines()[:4]
    assert header.index("kernel") == first.index("compiled") == second.index("cached"), \
        "columns line up"
