"""python -m flexfa info and python -m flexfa cache: what they print and what they delete."""
import pathlib
import subprocess
import sys

from flexfa import info
from flexfa.runtime import cli

REPO = pathlib.Path(__file__).parents[1]


def test_info_reports_versions_device_and_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "fwd").mkdir(parents=True)
    (tmp_path / "cache" / "fwd" / "kernel.py").write_text("x" * 1000)
    assert info.main([]) == 0
    text = capsys.readouterr().out
    for word in ("flexfa:", "torch:", "triton:", "gpu", "TRITON_INTERPRET",
                 f"{tmp_path / 'cache'} (1 files, 1000 B)", "FLEXFA_CACHE_DIR="):
        assert word in text, f"{word!r} missing from info output:\n{text}"


def test_info_rejects_arguments(capsys):
    assert info.main(["--bogus"]) == 2
    assert "--bogus" in capsys.readouterr().err


def test_cache_path_size_and_clear(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "flexfa-cache"
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(cache))
    assert cli.cache_dir() == cache
    (cache / "a" / "b").mkdir(parents=True)
    (cache / "a" / "b" / "k.py").write_text("12345")  # not flexfa's: clear leaves it
    (cache / "flexfa_fwd_x.py").write_text("# flexfa-kernel key=k\n")
    (cache / "flexfa_fwd_x.lock").write_text("")
    keep = tmp_path / "outside.txt"
    keep.write_text("not in the cache")
    assert cli.main(["path"]) == 0 and capsys.readouterr().out.strip() == str(cache)
    assert cli.main(["size"]) == 0 and "3 files, 27 bytes" in capsys.readouterr().out
    assert cli.main(["clear"]) == 0
    assert "removed 2 files" in capsys.readouterr().out
    assert sorted(p.name for p in cache.iterdir()) == ["a"], "clear deletes flexfa's files"
    assert keep.exists(), "clear touches nothing outside the cache directory"


def test_cache_clear_refuses_home_and_unknown_commands(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))
    (tmp_path / "precious.txt").write_text("keep me")
    assert cli.main(["clear"]) == 1
    assert (tmp_path / "precious.txt").exists()
    assert "refusing" in capsys.readouterr().err
    assert cli.main(["explode"]) == 2
    assert cli.main([]) == 2


def test_info_runs_through_python_m_flexfa(tmp_path):
    env = {"FLEXFA_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "flexfa", "info"], capture_output=True,
                          text=True, env=env, cwd=str(REPO), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "triton:" in done.stdout and str(tmp_path / "cache") in done.stdout


def test_info_says_one_true_thing_about_the_interpreter(monkeypatch):
    """flexfa interprets kernels for CPU tensors whatever TRITON_INTERPRET says; the report
    names the variable's value once, never two different values."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    text = info.report()
    assert "TRITON_INTERPRET=1" not in text and "this environment: unset" in text
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    text = info.report()
    assert text.count("TRITON_INTERPRET=1") == 1 and "unset" not in text
    assert "kernels for CPU tensors" in text


def test_info_flags_a_numpy_the_interpreter_cannot_use(monkeypatch):
    import numpy
    import triton

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    line = next(line for line in info.report().splitlines() if line.startswith("numpy:"))
    assert "2.4.1" in line and "fails with numpy >= 2.4" in line
    monkeypatch.setattr(numpy, "__version__", "2.2.6")
    line = next(line for line in info.report().splitlines() if line.startswith("numpy:"))
    assert line.split() == ["numpy:", "2.2.6"]


def test_version_flag(capsys):
    import flexfa
    from flexfa import __main__ as entry

    for flag in ("--version", "-V"):
        assert entry.main([flag]) == 0
        assert capsys.readouterr().out == f"flexfa {flexfa.__version__}\n"
    assert "--version" in entry.usage()
    done = subprocess.run([sys.executable, "-m", "flexfa", "--version"], capture_output=True,
                          text=True, cwd=str(REPO), timeout=120)
    assert done.returncode == 0 and done.stdout == f"flexfa {flexfa.__version__}\n", done.stderr
