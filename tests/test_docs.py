"""Every ```python block in docs/*.md and README.md runs, and printed outputs stay true.

Conventions for doc authors:

* the python blocks of one page run in order in one namespace (a page reads as a session);
* a ``<!-- gpu -->`` line right before a block marks it as needing CUDA: skipped without it;
* a ``<!-- output -->`` line right before a ```text block says that block is exactly what the
  previous python block prints; ``python tests/test_docs.py --update`` rewrites those blocks
  from a fresh run when the code they show has changed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import re
import sys
import types

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")  # fences may be indented (inside lists)
GPU, OUTPUT = "<!-- gpu -->", "<!-- output -->"


@dataclasses.dataclass
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    marker: str  # the non-empty line right before the fence
    end: int  # 0-based index of the closing fence line
    indent: str  # the fence's indentation, removed from the code


def blocks(path: pathlib.Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match or not match.group(2):
            i += 1
            continue
        start, indent = i, match.group(1)
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            i += 1
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in lines[start + 1:i]) + "\n"
        found.append(Block(match.group(2), code, start + 1, before, i, indent))
        i += 1
    return found


def run_page(path: pathlib.Path, on_gpu: bool):
    """Run the page's python blocks; yields (output block, what it should say) pairs."""
    # a module in sys.modules: torch 2.11's Dynamo imports the module of a function it inlines
    page = types.ModuleType(f"docs_{path.stem}")
    sys.modules[page.__name__] = page
    try:
        return _run_blocks(path, on_gpu, page.__dict__)
    finally:
        del sys.modules[page.__name__]


def _run_blocks(path: pathlib.Path, on_gpu: bool, namespace: dict) -> list:
    printed = None
    checks = []
    for block in blocks(path):
        if block.lang == "python":
            if block.marker == GPU and not on_gpu:
                printed = None
                continue
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                try:
                    exec(compile(block.code, f"{path.name}:{block.line}", "exec"), namespace)
                except Exception as exc:
                    raise AssertionError(f"{path.name} line {block.line}: the python block "
                                         f"raised {type(exc).__name__}: {exc}") from exc
            printed = buffer.getvalue()
        elif block.marker == OUTPUT:
            if printed is not None:
                checks.append((block, printed))
            printed = None
    return checks


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_page_code_runs_and_outputs_match(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # pictures and files the docs write land here
    torch.manual_seed(0)
    environment = dict(os.environ)
    try:
        checks = run_page(path, torch.cuda.is_available())
    finally:  # a page may set FLEXFA_* variables; they must not leak into other tests
        os.environ.clear()
        os.environ.update(environment)
    for block, printed in checks:
        assert block.code == printed, (
            f"{path.name} line {block.line}: the output block no longer matches what the code "
            f"prints; refresh it with `python tests/test_docs.py --update`.\n--- printed:\n"
            f"{printed}--- documented:\n{block.code}")


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_relative_links_point_at_files(path):
    for target, _ in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_the_docs_have_the_pages_the_index_promises():
    index = (REPO / "docs" / "index.md").read_text()
    for page in ("getting-started.md", "design.md", "migrating.md", "environment.md",
                 "performance.md", "ready-mods.md"):
        assert f"({page})" in index, f"docs/index.md does not link {page}"


def test_the_index_lists_each_page_once():
    index = (REPO / "docs" / "index.md").read_text()
    pages = [target for target, _ in LINK.findall(index) if target.endswith(".md")]
    assert len(pages) == len(set(pages)), f"docs/index.md lists a page twice: {sorted(pages)}"


def test_every_flexfa_variable_is_documented():
    documented = (REPO / "docs" / "environment.md").read_text()
    names = {name for path in (REPO / "flexfa").rglob("*.py")
             for name in re.findall(r"FLEXFA_[A-Z0-9_]+", path.read_text())}
    missing = sorted(name for name in names if f"`{name}`" not in documented)
    assert not missing, f"docs/environment.md does not document {missing}"


def update(paths) -> None:
    """Rewrite every ``<!-- output -->`` block with what its python block prints now."""
    import tempfile
    os.chdir(tempfile.mkdtemp(prefix="flexfa-docs-"))  # files the docs write land there
    for path in paths:
        torch.manual_seed(0)
        checks = run_page(path, torch.cuda.is_available())
        lines = path.read_text().splitlines()
        for block, printed in sorted(checks, key=lambda c: -c[0].line):
            lines[block.line:block.end] = [(block.indent + line).rstrip()
                                           for line in printed.rstrip("\n").split("\n")]
        path.write_text("\n".join(lines) + "\n")
        print(f"updated {len(checks)} output blocks in {path.relative_to(REPO)}")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--update"]:
        sys.exit("usage: python tests/test_docs.py --update [page.md ...]")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(REPO))
    update([pathlib.Path(p).resolve() for p in sys.argv[2:]] or PAGES)
