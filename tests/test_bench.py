"""The benchmark's arithmetic (speedups, geometric means, table) on synthetic rows; the timed
part needs a GPU and runs on the H200 (``python -m flexfa bench``)."""
import math
from collections import Counter
import os
import shutil

import pytest

from flexfa import bench, bench_cases


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
    digest = bench_cases.source_digest()
    assert len(digest) == 64 and digest == bench_cases.source_digest()
    # a copy of the package with one template byte changed has another digest
    copy = tmp_path / "flexfa"
    shutil.copytree(os.path.dirname(bench_cases.__file__), copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(bench_cases, "__file__", str(copy / "bench_cases.py"))
    assert bench_cases.source_digest() == digest
    template = next((copy / "codegen" / "templates").glob("*.tmpl"))
    template.write_text(template.read_text() + "\n")
    assert bench_cases.source_digest() != digest


def test_merged_results_list_each_target_with_its_margin_and_why_it_was_missed():
    """benchmarks/merge_results.py writes issue 6's targets into h200.json: measured value,
    threshold, met, and for a miss the shortfall and the reason."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "merge_results.py"
    spec = importlib.util.spec_from_file_location("merge_results", path)
    merge = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(merge)

    def row(impl, variant, pass_, ms, tflops=None, S=16384, D=128):
        return dict(impl=impl, variant=variant, S=S, D=D, pass_=pass_, ms=ms, tflops=tflops)
    rows = [row("flexfa", "causal", "fwd", 2.0, 548.0), row("flex", "causal", "fwd", 2.8),
            row("flexfa", "causal", "fwd+bwd", 9.0, 430.0), row("flex", "causal", "fwd+bwd", 8.8),
            row("flexfa", "softcap", "fwd", 2.4), row("flex", "softcap", "fwd", 5.8)]
    got = {t["target"]: t for t in merge.targets(rows, bench.summarize(rows))}
    assert got["causal E=128 S=16384 forward TFLOP/s"]["met"]
    missed = got["causal E=128 S=16384 fwd+bwd TFLOP/s"]
    assert not missed["met"] and missed["short_by"] == "4.4%" and "5 GEMMs" in missed["why"]
    worst = got["fwd+bwd worst speedup over FlexAttention"]
    assert not worst["met"] and worst["measured"] == round(8.8 / 9.0, 3)
    assert got["fwd softcap+causal worst speedup"]["met"]
    assert "fwd+bwd softcap+causal worst speedup" not in got  # no softcap fwd+bwd rows


def test_peers_are_summarized_and_tabled_with_memory(capsys):
    rows = [_row("flexfa", "full", 2.0), _row("flex", "full", 3.0),
            _row("flex-flash", "full", 1.6), _row("sdpa-cudnn", "full", 2.2),
            _row("flexfa", "causal", 1.0), _row("flex-flash", "causal", 0.8)]
    for r, mib in zip(rows, (258, 258, 300, 386, 130, 150)):
        r["peak_mib"] = mib
    peers = bench.summarize_peers(rows)
    assert list(peers) == ["flex", "flex-flash", "sdpa-cudnn"]
    flash = peers["flex-flash"]["fwd"]
    assert flash["cases"] == 2 and math.isclose(flash["geomean_speedup"], math.sqrt(0.8 * 0.8))
    assert flash["worst"]["variant"] in ("full", "causal")
    bench.print_peers(rows)
    out = capsys.readouterr().out
    assert "1.600 (0.80x) / 300" in out and "2.200 (1.10x) / 386" in out
    causal_line = next(line for line in out.splitlines() if line.startswith("causal"))
    assert "-" in causal_line.split()  # no FlexAttention row for causal


def test_extra_columns_are_parsed_and_bad_ones_named():
    assert bench.parse_extra(['gbwd={"GLUON_BACKWARD": true}']) == {
        "gbwd": {"GLUON_BACKWARD": True}}
    assert bench.parse_extra(None) == {}
    for bad, words in (("gbwd", "LABEL=JSON"), ('flex={"A": 1}', "'flex'"),
                       ("x=[1]", "JSON object")):
        try:
            bench.parse_extra([bad])
        except ValueError as exc:
            assert words in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_bad_rounds_and_extra_columns_stop_before_any_gpu_work(capsys):
    import pytest

    for argv, words in ((["--rounds", "0"], "--rounds must be at least 1"),
                        (["--extra", "nolabel"], "LABEL=JSON")):
        with pytest.raises(SystemExit) as info:
            bench.main(argv)
        assert info.value.code == 2
        assert words in capsys.readouterr().err



@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_round_order_balances_places_and_predecessors(n):
    """Over n rounds (2n for an odd n) each column is timed at each place equally often and
    right after each other column equally often (Williams's design); round 0 starts with the
    first column, and the rounds repeat with that period."""
    labels = [f"c{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n
    orders = [bench.round_order(labels, r) for r in range(period)]
    assert orders[0][0] == labels[0] and all(sorted(o) == labels for o in orders)
    for place in range(n):
        assert Counter(o[place] for o in orders) == {label: period // n for label in labels}
    pairs = Counter((o[i - 1], o[i]) for o in orders for i in range(1, n))
    assert pairs == {(a, b): period // n for a in labels for b in labels if a != b}
    assert bench.round_order(labels, period + 1) == orders[1 % period]
    assert bench.round_order([], 3) == []


def test_grad_out_takes_out_shape_with_v_head_dim():
    # E = 192, Ev = 128 (tree_ab.py's 192/128 cases): the upstream gradient is out's shape
    import torch
    q, v = torch.zeros(2, 4, 33, 192), torch.zeros(2, 1, 40, 128)
    assert bench._grad_out(q, v).shape == (2, 4, 33, 128)
