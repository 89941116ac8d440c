"""Deleting from the disk cache: ``cache clear`` and ``cache prune`` delete only files flexfa
wrote, a directory that is not a flexfa cache is refused, another build's kernels are pruned
when a new build first uses the directory, and writes keep the directory within its bound."""
import inspect
import os
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from flexfa import config
from flexfa.errors import InputError
from flexfa.runtime import cache, cache_files, cache_location, cli
from flexfa.runtime.cache import STATS

OLD_BUILD = "0123456789abcdef"
FLEXFA_NAMES = ("flexfa_fwd_d16_fp32_aaaaaaaaaaaa.py", "flexfa_fwd_d16_fp32_aaaaaaaaaaaa.lock",
                "flexfa_bwd_dq_d64_bf16_bbbbbbbbbbbb.py", "autotune.json", "autotune.lock",
                ".flexfa_fwd_d16_fp32_aaaaaaaaaaaa.k3j_9x.tmp", ".autotune.x1y2.tmp",
                ".flexfa-probe.abc123", "__pycache__/flexfa_fwd_d16_fp32_aaaaaaaaaaaa.cpython-311.pyc")
FOREIGN_NAMES = ("notes.txt", "flexfa_notes.py", "model.pt", "flexfa_busy.lock", "autotune.yaml",
                 "sub/flexfa_fwd_d16_fp32_cccccccccccc.py", "__pycache__/other.cpython-311.pyc",
                 ".flexfa-cache.bak", "flexfa_fwd_d16_fp32_dddddddddddd.py.orig")


def kernel_text(key="k" * 64, source="VALUE = 1\n", build=None):
    text = cache._with_header(key, source)
    return text if build is None else text.replace(cache_files.build_tag(), build)


def _write(directory: Path, name: str, mtime: float | None = None) -> Path:
    """A file as flexfa writes it (kernel sources carry the header), or a foreign one."""
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    flexfa_kernel = name in FLEXFA_NAMES and name.endswith(".py")
    path.write_text(kernel_text() if flexfa_kernel else "" if name.endswith(".lock")
                    and name in FLEXFA_NAMES else f"not flexfa's: {name}\n" * 3)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def _tree(directory: Path) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if not p.is_dir()}


@given(flexfa_files=st.sets(st.sampled_from(FLEXFA_NAMES), min_size=1),
       foreign=st.sets(st.sampled_from(FOREIGN_NAMES)), marker=st.booleans())
def test_clear_deletes_exactly_the_files_flexfa_wrote(flexfa_files, foreign, marker):
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "cache"
        directory.mkdir()
        for name in flexfa_files | foreign:
            _write(directory, name)
        outside = Path(tmp) / "flexfa_fwd_d16_fp32_eeeeeeeeeeee.py"
        outside.write_text(kernel_text())  # a flexfa kernel outside, reached through a link
        link = directory / "flexfa_fwd_d16_fp32_ffffffffffff.py"
        link.symlink_to(outside)
        if marker:
            (directory / cache_files.MARKER).write_text("flexfa kernel cache\n")
        before = _tree(directory)
        if marker or any(name.endswith(".py") for name in flexfa_files):
            removed, _, others = cache_files.clear(directory)
            expected = set(foreign) | {link.name} | ({cache_files.MARKER} if marker else set())
            assert _tree(directory) == expected
            assert removed == len(flexfa_files)
            assert others == len({name.split("/")[0] for name in expected} - {cache_files.MARKER,
                                                                             "__pycache__"})
        else:  # only locks, temp files or bytecode: not enough to call it a flexfa cache
            with pytest.raises(ValueError, match="does not look like a flexfa cache"):
                cache_files.clear(directory)
            assert _tree(directory) == before
        assert outside.read_text() == kernel_text(), "clear followed a link out of the cache"
        assert link.is_symlink()


def test_clear_and_prune_never_enter_a_linked_bytecode_folder(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    pyc = _write(outside, "flexfa_fwd_d16_fp32_aaaaaaaaaaaa.cpython-311.pyc", mtime=1e9)
    directory = tmp_path / "cache"
    directory.mkdir()
    (directory / "__pycache__").symlink_to(outside, target_is_directory=True)
    kernel = directory / "flexfa_fwd_d16_fp32_bbbbbbbbbbbb.py"
    kernel.write_text(kernel_text())
    os.utime(kernel, (1e9, 1e9))
    assert cache_files.prune(directory, limit=0).removed_files == 1  # the kernel, not the pyc
    assert cache_files.clear(directory)[:2] == (0, 0)
    assert pyc.exists() and (directory / "__pycache__").is_symlink()


def test_clear_command(tmp_path, monkeypatch, capsys):
    """Refuses a directory that is not a flexfa cache (exit 1, nothing deleted); once flexfa
    used it (the marker), deletes flexfa's files and says what it left alone."""
    for name in ("thesis.tex", "data/train.bin", "flexfa_fwd_d16_fp32_aaaaaaaaaaaa.lock"):
        _write(tmp_path, name)
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))
    assert cli.main(["clear"]) == 1
    err = capsys.readouterr().err
    assert "does not look like a flexfa cache" in err and str(tmp_path) in err
    assert len(_tree(tmp_path)) == 3, "nothing is deleted from a directory that is refused"
    cache_files.claim(tmp_path)  # flexfa uses the directory: it writes the marker
    assert cli.main(["clear"]) == 0
    assert "removed 1 files, 0 bytes; left 2 other entries alone" in capsys.readouterr().out
    assert _tree(tmp_path) == {"thesis.tex", "data/train.bin", cache_files.MARKER}


@pytest.mark.parametrize("command", ["size", "clear", "prune"])
def test_a_cache_path_that_is_a_file_is_an_error(tmp_path, monkeypatch, capsys, command):
    """It printed "cleared ...: removed 0 files" (exit 0), as for an empty cache."""
    _write(tmp_path, "notes.txt")
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path / "notes.txt"))
    assert cli.main([command]) == 1
    assert "notes.txt is not a directory" in capsys.readouterr().err
    assert _tree(tmp_path) == {"notes.txt"}


def test_cache_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in ("path", "size", "clear", "prune"):
        assert f"\n    {command} " in text, f"{command} missing from cache --help:\n{text}"
    assert cli.main(["prune", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--max-bytes" in text and "--older-than" in text
    assert cli.main(["prune", "--max-bytes", "lots"]) == 2
    assert cli.main(["explode"]) == 2 and cli.main([]) == 2


def _kernels(directory: Path, count: int, build=None, size=1000, start=1e9) -> list[Path]:
    """``count`` kernel files of ``size`` bytes with their locks, last used 1 s apart."""
    paths = []
    for i in range(count):
        path = directory / f"flexfa_fwd_d16_fp32_{build or 'cur'}{i:09d}.py"
        path.write_text(kernel_text(f"{i:064d}", "#" * (size - 120) + "\n", build))
        (directory / f"{path.stem}.lock").write_text("")
        os.utime(path, (start + i, start + i))
        paths.append(path)
    return paths


@given(count=st.integers(1, 12), keep=st.integers(0, 12))
def test_prune_keeps_the_most_recently_used_kernels_within_the_bound(count, keep):
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        paths = _kernels(directory, count)
        size = paths[0].stat().st_size
        result = cache_files.prune(directory, limit=keep * size)
        kept = sorted(p.name for p in directory.glob("flexfa_*.py"))
        assert kept == sorted(p.name for p in paths[max(0, count - keep):])
        assert result.kept_bytes == len(kept) * size <= keep * size
        locks = sorted(p.stem for p in directory.glob("flexfa_*.lock"))
        assert locks == [Path(name).stem for name in kept], "a pruned kernel's lock stayed"


def test_prune_command_removes_other_builds_and_unused_kernels(tmp_path, monkeypatch, capsys):
    now = time.time()
    current = _kernels(tmp_path, 3, start=now - 86400 * 10)  # last used 10 days ago
    recent = _kernels(tmp_path, 1, build="recentbuild00000", start=now)
    legacy = tmp_path / "flexfa_fwd_d16_fp32_000000000000.py"  # a header without a build
    legacy.write_text(kernel_text().replace(f" build={cache_files.build_tag()}", ""))
    fresh = tmp_path / "flexfa_fwd_d16_fp32_fresh0000000.py"
    fresh.write_text(kernel_text())
    _write(tmp_path, "notes.txt")
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))
    assert cli.main(["prune", "--older-than", "7"]) == 0
    # 3 unused kernels, 1 of another build, 1 without a build; 4 locks with them
    assert "removed 9 files" in capsys.readouterr().out
    assert _tree(tmp_path) == {"notes.txt", fresh.name}, (current, recent)


def test_prune_bound_comes_from_the_environment(tmp_path, monkeypatch):
    assert cache_location.max_bytes() == config.DEFAULT_CACHE_MAX_BYTES > 0
    _kernels(tmp_path, 4)
    monkeypatch.setenv("FLEXFA_CACHE_MAX_BYTES", "2500")
    assert cache_files.prune(tmp_path).kept_kernels == 2
    for bad in ("-1", "0", "lots", "1.5"):
        monkeypatch.setenv("FLEXFA_CACHE_MAX_BYTES", bad)
        with pytest.raises(InputError, match=f"FLEXFA_CACHE_MAX_BYTES={bad!r}"):
            cache_location.max_bytes()


def _generate(name: str, size: int = 1000):
    key = name.ljust(64, "0")
    return cache.get_module(name, key, True, lambda: f"VALUE = {name!r}\n" + "#" * size + "\n")


@pytest.mark.parametrize("variable", ["FLEXFA_CACHE_MAX_BYTES", "FLEXFA_CACHE_LOCK_TIMEOUT"])
def test_a_bad_cache_setting_fails_every_call_before_anything_is_written(fresh_cache, monkeypatch,
                                                                         variable):
    """The bound was first read in claiming the directory (its marker then never written),
    then after the kernel was written, and a third call succeeded."""
    monkeypatch.setenv(variable, "1G")
    for _ in range(3):
        with pytest.raises(InputError, match=f"{variable}='1G'"):
            _generate("flexfa_test_bad_setting")
    assert not list(fresh_cache.glob("flexfa_test_bad_setting.*"))
    monkeypatch.delenv(variable)
    assert _generate("flexfa_test_bad_setting").VALUE == "flexfa_test_bad_setting"
    assert (fresh_cache / cache_files.MARKER).is_file()


def test_a_new_build_prunes_the_old_builds_kernels_on_first_use(fresh_cache, monkeypatch):
    fresh_cache.mkdir(mode=0o700)
    (fresh_cache / cache_files.MARKER).write_text(f"flexfa kernel cache\nbuild={OLD_BUILD}\n")
    old = _kernels(fresh_cache, 3, build=OLD_BUILD)
    _write(fresh_cache, "notes.txt")
    assert _generate("flexfa_test_new_build").VALUE == "flexfa_test_new_build"
    assert _tree(fresh_cache) == {"notes.txt", cache_files.MARKER, "flexfa_test_new_build.py",
                                  "flexfa_test_new_build.lock"}, f"{old} not pruned"
    assert f"build={cache_files.build_tag()}" in (fresh_cache / cache_files.MARKER).read_text()


def test_writes_keep_the_directory_within_its_bound(fresh_cache, monkeypatch):
    monkeypatch.setenv("FLEXFA_CACHE_MAX_BYTES", "6000")
    names = [f"flexfa_test_bound_{i:02d}" for i in range(12)]
    for i, name in enumerate(names):
        assert _generate(name).VALUE == name
        kernels = list(fresh_cache.glob("flexfa_test_bound_*.py"))
        assert sum(p.stat().st_size for p in kernels) <= 6000, f"over the bound after {i + 1}"
        os.utime(fresh_cache / f"{name}.py", (1e9 + i, 1e9 + i))  # distinct last uses
    kept = sorted(p.stem for p in fresh_cache.glob("flexfa_test_bound_*.py"))
    assert kept == names[-len(kept):] and 3 <= len(kept) < len(names)
    assert STATS.codegen == len(names)


def test_the_bound_spares_a_kernel_just_written(fresh_cache, monkeypatch):
    """Even a bound smaller than one kernel leaves the new file for its import (and for
    other processes importing it): only kernels older than a minute are pruned for size."""
    monkeypatch.setenv("FLEXFA_CACHE_MAX_BYTES", "10")
    assert _generate("flexfa_test_tiny_bound_a").VALUE == "flexfa_test_tiny_bound_a"
    assert _generate("flexfa_test_tiny_bound_b").VALUE == "flexfa_test_tiny_bound_b"
    assert len(list(fresh_cache.glob("flexfa_test_tiny_bound_*.py"))) == 2
    os.utime(fresh_cache / "flexfa_test_tiny_bound_a.py", (1e9, 1e9))
    assert cache_files.prune(fresh_cache).kept_kernels == 1


def test_a_kernel_pruned_before_its_import_still_runs(fresh_cache, monkeypatch):
    """Another process may prune a file between this one's check and its import: the text
    that was checked is what is imported, and what ``inspect`` (Triton) reads."""
    real_load, pruned = cache.load_module, []

    def pruned_before_the_first_import(path, *args, **kwargs):
        if not pruned:
            pruned.append(path)
            path.unlink()
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(cache, "load_module", pruned_before_the_first_import)
    module = _generate("flexfa_test_pruned")
    assert module.VALUE == "flexfa_test_pruned"
    assert pruned and STATS.codegen == 1 and not pruned[0].exists()
    assert "flexfa_test_pruned" in inspect.getsource(module)
