"""python -m flexfa demo: runs every variant on the CPU, checks, draws; fails loudly."""
import math
import pathlib
import subprocess
import sys

import torch

import flexfa
from flexfa import demo
from flexfa.reference import attention_reference

REPO = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ["causal", "sliding window", "alibi + causal", "softcap 20", "document packing",
            "learnable relative bias"]


def test_demo_runs_checks_and_draws(tmp_path):
    """Run as a user would, from a directory of their own without arguments: the picture lands
    there and the demo says where."""
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run([sys.executable, "-m", "flexfa", "demo"],
                          capture_output=True, text=True, cwd=str(work), timeout=300,
                          env={"PATH": "/usr/bin:/bin", "FLEXFA_CACHE_DIR": str(tmp_path / "cache"),
                               "HOME": str(tmp_path), "PYTHONPATH": str(REPO)})
    out = done.stdout
    assert done.returncode == 0, f"demo failed:\n{out}\n{done.stderr}"
    assert "CPU through the Triton interpreter" in out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    for name in VARIANTS:
        row = next((line for key, line in rows.items() if key.startswith(name)), None)
        assert row is not None and row.rstrip().endswith("ok"), f"no passing row for {name}:\n{out}"
    table = out.split("block mask of")[0]
    assert "interpreted" in table, "a fresh cache: new kernels, run by the interpreter"
    assert "compiled" not in table, "nothing is compiled on the CPU"
    assert "all checks passed (forward and backward)" in out
    assert demo.MASK_LEGEND in out, "the text drawing comes with its legend"
    png = work / "flexfa_demo_blockmask.png"
    assert f"picture written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "timings: GPU only" in out and "FlexAttention (ms)" not in out


def test_out_chooses_where_the_picture_goes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(flexfa, "flex_attention", _fake_attention(), raising=False)
    monkeypatch.chdir(tmp_path)
    assert demo.main(["--only", "sliding", "--seq-len", "64", "--out", "pics.png"]) == 0
    out = capsys.readouterr().out
    assert f"picture written to {tmp_path / 'pics.png'}" in out, "an absolute path"
    assert (tmp_path / "pics.png").read_bytes()[:4] == b"\x89PNG"
    assert demo.parse_args(["--png", "old.png"]).out == "old.png", "--png still works"
    assert demo.main(["--only", "sliding", "--seq-len", "64", "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "picture written" not in out and demo.MASK_LEGEND in out


def test_the_cpu_run_times_nothing(monkeypatch, capsys):
    def no_timing(*args, **kwargs):
        raise AssertionError("the CPU path must not time")
    monkeypatch.setattr(demo, "time_variants", no_timing)
    monkeypatch.setattr(flexfa, "flex_attention", _fake_attention(), raising=False)
    assert demo.main(["--only", "causal", "--no-png", "--seq-len", "64"]) == 0
    assert "timings: GPU only" in capsys.readouterr().out


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


def test_kernel_origin_names_what_ran():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert demo._kernel_origin((0, 0), (1, 0), cpu) == "interpreted"
    assert demo._kernel_origin((0, 0), (1, 0), cuda) == "compiled"
    assert demo._kernel_origin((1, 0), (1, 1), cpu) == "disk cache"
    assert demo._kernel_origin((1, 1), (1, 1), cuda) == "memory cache"


def test_timing_table_format():
    timings = [demo.Timing("causal", 0.5, 1.0), demo.Timing("softcap 20", 2.0, 1.0),
               demo.Timing("document packing", note="not timed: past the 30 s budget")]
    text = demo.format_timings(timings)
    header, _, first, second, third = text.splitlines()[:5]
    assert first.split()[-1] == "2.00x" and second.split()[-1] == "0.50x"
    assert header.index("speedup") == first.index("2.00x") == second.index("0.50x"), "aligned"
    assert third.split()[-3:] == ["-", "-", "-"]
    assert "geometric mean speedup over 2 variants: 1.00x" in text
    assert "document packing: not timed: past the 30 s budget" in text
    assert demo.Timing("x", 0.25, 1.0).speedup == 4.0 and demo.Timing("x").speedup is None


def test_time_variants_times_flexfa_against_compiled_torch(monkeypatch):
    """The GPU path's logic, run on the CPU: torch.compile is wrapped, both implementations run
    each variant, the medians become speedups, and the budget stops new variants."""
    import triton.testing

    compiled, calls = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append((fn, kwargs)) or fn)

    def fake_do_bench(fn, return_mode="mean", **kwargs):
        assert return_mode == "median" and not torch.is_grad_enabled()
        out = fn()
        calls.append(type(out))
        return 1.0 if len(calls) % 2 else 3.0  # flexfa first, then torch
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(flexfa, "flex_attention", _fake_attention(), raising=False)
    args = demo.parse_args(["--seq-len", "64", "--heads", "2", "--head-dim", "16",
                            "--batch", "1", "--block-size", "32"])
    variants = demo.make_variants(64, 2, torch.device("cpu"))[:2]
    timings = demo.time_variants(variants, args, torch.device("cpu"), torch.float32)
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention
    assert compiled[0] == (torch_flex_attention, {"dynamic": False})
    assert [t.name for t in timings] == [v.name for v in variants]
    assert all(math.isclose(t.speedup, 3.0) for t in timings), timings
    assert len(calls) == 4
    late = demo.time_variants(variants, args, torch.device("cpu"), torch.float32, budget_s=-1.0)
    assert all(t.speedup is None and "budget" in t.note for t in late)
