"""The benchmark's arithmetic (speedups, geometric means, table) on synthetic rows; the timed
part needs a GPU and runs on the H200 (``python -m flexfa bench``)."""
import math
import os
import shutil

from flexfa import bench


def _row(impl, variant, ms, pass_="fwd", S=2048, D=64):
    return dict(impl=impl, variant=variant, S=S, D=D, B=8, H=16, pass_=pass_, ms=ms,
                tflops=1.0 / ms, density=1.0, first_call_s=0.1)


def test_summary_geomean_and_worst_case():
    rows = [_row("flexfa", "causal", 1.0), _row("flex", "causal", 2.0),
            _row("flexfa", "full", 2.0), _row("flex", "full", 1.0),
            _row("sdpa-cudnn", "full", 0.5),
            _row("flexfa", "full", 1.0, pass_="fwd+bwd"), _row("flex", "full", 3.0, pass_="fwd+bwd")]
    summary = bench.summarize(rows)
    assert math.isclose(summary["fwd"]["geomean_speedup"], 1.0)
    assert summary["fwd"]["worst"]["variant"] == "full"
    assert math.isclose(summary["fwd"]["worst"]["speedup"], 0.5)
    assert summary["fwd"]["cases"] == 2
    assert math.isclose(summary["fwd+bwd"]["geomean_speedup"], 3.0)


def test_rows_with_errors_are_left_out_of_the_summary(capsys):
    rows = [_row("flexfa", "alibi", 1.0), dict(impl="flex", variant="alibi", S=2048, D=64,
                                               pass_="fwd", error="boom")]
    result = {"rows": rows, "summary": bench.summarize(rows), "meta": {"gpu": "none"}}
    assert result["summary"] == {}
    bench.print_table(result)
    assert "alibi" in capsys.readouterr().out


def test_source_digest_names_the_package_files(tmp_path, monkeypatch):
    digest = bench.source_digest()
    assert len(digest) == 64 and digest == bench.source_digest()
    # a copy of the package with one template byte changed has another digest
    copy = tmp_path / "flexfa"
    shutil.copytree(os.path.dirname(bench.__file__), copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(bench, "__file__", str(copy / "bench.py"))
    assert bench.source_digest() == digest
    template = next((copy / "codegen" / "templates").glob("*.tmpl"))
    template.write_text(template.read_text() + "\n")
    assert bench.source_digest() != digest
