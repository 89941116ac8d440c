"""benchmarks/ are tools: each script answers --help quickly without a GPU, states its purpose
and is listed in benchmarks/README.md; each results folder has a manifest."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
TOOLS = sorted(BENCHMARKS.glob("*.py")) + sorted(BENCHMARKS.glob("*.sh"))
EXPERIMENTS = sorted((BENCHMARKS / "experiments").glob("*.py"))
README = (BENCHMARKS / "README.md").read_text()
FIELDS = ("commit", "gpu", "versions", "command", "date")


@pytest.mark.parametrize("script", TOOLS, ids=lambda p: p.name)
def test_every_tool_answers_help_without_a_gpu(script, tmp_path):
    runner = ["bash"] if script.suffix == ".sh" else [sys.executable]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path)}
    done = subprocess.run([*runner, str(script), "--help"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower(), done.stdout
    assert not list(tmp_path.iterdir()), "--help wrote results"


@pytest.mark.parametrize("script", [p for p in TOOLS + EXPERIMENTS if p.suffix == ".py"],
                         ids=lambda p: p.name)
def test_every_script_states_its_purpose(script):
    docstring = ast.get_docstring(ast.parse(script.read_text()))
    assert docstring and len(docstring.split()) >= 8, f"{script.name}: no purpose stated"


@pytest.mark.parametrize("script", [p for p in TOOLS if p.suffix == ".py"], ids=lambda p: p.name)
def test_every_name_a_tool_imports_from_flexfa_or_a_tool_exists(script):
    """Tools import lazily (a GPU step's imports run only on the GPU machine): a name renamed
    in flexfa would fail there first (host_step.py did, on the H200). experiments/ are kept
    as written (benchmarks/README.md)."""
    import importlib
    siblings = {p.stem: p for p in TOOLS if p.suffix == ".py"}
    for node in ast.walk(ast.parse(script.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if (node.module or "").startswith("flexfa"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(
                    f"{node.module}.{alias.name}"), f"{script.name}: {node.module}.{alias.name}"
        elif node.module in siblings:  # another tool (varlen_bench.py read a renamed one)
            tree = ast.parse(siblings[node.module].read_text())
            defined = {n.name for n in tree.body if isinstance(
                n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
            defined |= {t.id for n in tree.body if isinstance(n, ast.Assign)
                        for t in n.targets if isinstance(t, ast.Name)}
            defined |= {a.asname or a.name for n in tree.body
                        if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
            for alias in node.names:
                assert alias.name in defined, f"{script.name}: {node.module}.{alias.name}"


def test_the_readme_lists_every_script():
    listed = set(re.findall(r"`((?:experiments/)?[\w.]+\.(?:py|sh))`", README))
    present = {p.name for p in TOOLS} | {f"experiments/{p.name}" for p in EXPERIMENTS}
    assert present - listed == set(), "scripts missing from benchmarks/README.md"
    assert listed - present == set(), "benchmarks/README.md lists scripts that do not exist"


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#\s]+)", README):
        assert (BENCHMARKS / target).exists(), target


def _check_run(run: dict, where: str) -> None:
    for field in FIELDS:
        assert field in run, f"{where}: no {field!r}"
        assert run[field] not in ("", None, [], {}), f"{where}: empty {field!r}"


def test_every_results_folder_has_a_manifest():
    folders = {path.parent for path in (BENCHMARKS / "results").rglob("*")
               if path.is_file() and path.parent != BENCHMARKS / "results"}
    assert folders
    for folder in sorted(folders):
        where = folder.relative_to(BENCHMARKS)
        path = folder / "manifest.json"
        assert path.exists(), f"{where} has no manifest.json"
        manifest = json.loads(path.read_text())
        runs = manifest.get("runs", [manifest])
        assert runs, f"{where}: no runs"
        for index, run in enumerate(runs):
            _check_run(run, f"{where} run {index}")


def test_manifest_records_a_new_run(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "FLEXFA_COMMIT": "abc1234"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "manifest.py"), str(out),
                           "--command", "python -m flexfa bench --dims 64"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    _check_run(manifest, "new run")
    assert manifest["commit"] == "abc1234"
    assert manifest["gpu"] == "none"
    assert manifest["command"] == "python -m flexfa bench --dims 64"
    import torch
    assert manifest["versions"]["torch"] == torch.__version__
    assert re.match(r"\d{4}-\d\d-\d\dT", manifest["date"])


def test_each_gpu_checks_part_is_one_block_and_known():
    """A part letter reused for a second block ran both in one device call (2026-12-02: the
    new part v ran after the old one and the call's time ran out); unknown parts stop before
    anything runs."""
    text = (BENCHMARKS / "gpu_checks.sh").read_text()
    blocks = re.findall(r'^if \[ "\$PART" = (\w+) \]', text, re.M)
    assert len(blocks) == len(set(blocks)), blocks
    known = re.search(r'case "\$PART" in ([\w|]+)\)', text).group(1).split("|")
    assert sorted(set(blocks) | {"all"}) == sorted(known)
    for part in blocks:
        assert re.search(rf"\b{part}: ", text), f"part {part} is not in --help"
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu_checks.sh"), "nope"],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 2 and "unknown part" in done.stderr


def test_plot_decode_reads_shares_of_the_copy_bandwidth(tmp_path):
    sys.path.insert(0, str(BENCHMARKS))
    import plot_decode
    report = {"gpu": "G", "torch": "t", "copy_GBps": 4000.0, "cases": [
        {"case": "a", "flexfa": {"ms": 0.2, "GBps": 3000.0},
         "torch_flex_compiled": {"error": "boom"}},
        {"case": "b", "flexfa": {"ms": 0.1, "GBps": 1000.0},
         "sdpa_flash": {"ms": 0.05, "GBps": 2000.0}}]}
    names, bars = plot_decode.shares(report)
    assert names == ["a", "b"]
    assert bars["flexfa"] == [(0.75, 0.2), (0.25, 0.1)]
    assert bars["torch_flex_compiled"][0][0] == 0.0 and bars["sdpa_flash"][1] == (0.5, 0.05)
    plot_decode.plot(report, str(tmp_path / "d.png"))
    assert (tmp_path / "d.png").stat().st_size > 1000


TREE_COPY = """
import sys, torch
sys.path.insert(0, {benchmarks!r})
import flexfa, tree_ab
copy = tree_ab.load_tree({tree!r}, "flexfa_old")
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx
outs = []
for lib in (copy, flexfa):
    q, k, v = (torch.randn(1, 2, 128, 16, generator=torch.Generator().manual_seed(i),
                           requires_grad=True) for i in range(3))
    mask = lib.create_block_mask(causal, 1, None, 128, 128, device="cpu")
    out = lib.flex_attention(q, k, v, block_mask=mask)
    out.sum().backward()
    outs.append([out, q.grad, k.grad, v.grad])
own = [m for m in ("flexfa_old.runtime.forward", "flexfa_old.runtime.backward") if m in sys.modules]
print("own runtime:", own)
print("equal:", all(torch.equal(a, b) for a, b in zip(*outs)))
"""


def test_tree_ab_runs_the_other_tree_on_its_own_runtime(tmp_path):
    """tree_ab.py imports another flexfa tree as ``flexfa_old`` beside this one: the copy's
    lazily loaded runtime must be its own. flexfa.lazy once imported "flexfa.runtime..." by
    name, so the copy's calls ran this tree's runtime on the copy's traced IR and failed
    (H200, 2026-12-03: "cannot render IR op KV_IDX on int values"). A copy of this tree,
    loaded as tree_ab loads one, gives this tree's outputs and gradients from its own runtime
    (under the interpreter, in a subprocess: the copy stays out of this process)."""
    import shutil
    shutil.copytree(REPO / "flexfa", tmp_path / "flexfa",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = TREE_COPY.format(benchmarks=str(BENCHMARKS), tree=str(tmp_path))
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "own runtime: ['flexfa_old.runtime.forward', 'flexfa_old.runtime.backward']" \
        in done.stdout, done.stdout
    assert "equal: True" in done.stdout, done.stdout


def test_arrive_sync_ab_strips_only_the_rendezvous_before_mbarrier_operations():
    """experiments/arrive_sync_ab.py removes a consumer's 128-thread bar.sync only where the
    next instruction is a single-thread mbarrier arrive or a stage wait; the rendezvous before
    barrier setup, shared-memory stores and other partitions' barriers stay."""
    sys.path.insert(0, str(BENCHMARKS / "experiments"))
    try:
        from arrive_sync_ab import strip_syncs
    finally:
        sys.path.pop(0)
    ptx = "\n".join([
        "\tbar.sync \t2, 128;",                       # before an arrive: removed
        "\t.loc\t1 1369 28",
        "\t// begin inline asm",
        "\t@%p17 mbarrier.arrive.shared::cta.b64 _, [%r666];",
        "\tbar.sync \t0, 128;",                       # before a wait: removed
        "\t// begin inline asm",
        "",
        "{",
        "\t.reg .pred complete;",
        "\twaitLoop:",
        "\tmbarrier.try_wait.parity.shared.b64 complete, [%r662], %r663;",
        "\tbar.sync \t0, 128;",                       # before barrier setup: kept
        "\t@%p241 mbarrier.init.shared::cta.b64 [%r1204], 1;",
        "\tbar.sync \t2, 128;",                       # before a shared store: kept
        "\tst.shared.v4.b32 [%r1], {%r2, %r3, %r4, %r5};",
        "\tbar.sync \t1, 32;",                        # another partition's: kept
        "\t@%p7 mbarrier.arrive.shared::cta.b64 _, [%r9];",
        "\tbar.sync \t2, 128;",                       # before an expect-tx arrive: kept
        "\t@%p7 mbarrier.arrive.expect_tx.shared.b64 _, [%r210], 16384;",
    ])
    stripped, removed = strip_syncs(ptx)
    assert removed == 2
    assert stripped.count("bar.sync") == 4
    assert "mbarrier.arrive.shared::cta.b64 _, [%r666]" in stripped
