"""No block of six or more lines stands in two kernel templates (issue 22): what two kernels
share lives once in the template library (common.tmpl, fwd_common.tmpl, bwd_common.tmpl)."""
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[2] / "flexfa" / "codegen" / "templates"
BLOCK = 6


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) of the lines that are code: blank lines, comments and
    lone brackets carry no logic of their own."""
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if text and not text.startswith("#") and text not in {")", "]", "):", "}"}:
            lines.append((number, text))
    return lines


def _blocks(path: Path) -> dict[tuple[str, ...], int]:
    lines = _code_lines(path)
    return {tuple(text for _, text in lines[i:i + BLOCK]): lines[i][0]
            for i in range(len(lines) - BLOCK + 1)}


def test_no_six_line_block_in_two_templates():
    files = sorted(TEMPLATES.glob("*.tmpl"))
    assert len(files) >= 6, files
    seen: dict[tuple[str, ...], tuple[str, int]] = {}
    copies = []
    for path in files:
        for block, line in _blocks(path).items():
            first = seen.setdefault(block, (path.name, line))
            if first[0] != path.name:
                copies.append(f"{first[0]}:{first[1]} and {path.name}:{line}: {block[0]!r}")
    assert not copies, "blocks repeated across templates:\n" + "\n".join(copies[:20])


def test_the_check_finds_a_copy(tmp_path):
    """The block comparison itself: a six-line block pasted into a second file is found."""
    block = "\n".join(f"x{i} = y{i} + {i}" for i in range(BLOCK))
    (tmp_path / "a.tmpl").write_text("def f():\n" + block + "\n")
    (tmp_path / "b.tmpl").write_text("# other\n" + block + "\nreturn 1\n")
    assert set(_blocks(tmp_path / "a.tmpl")) & set(_blocks(tmp_path / "b.tmpl"))
