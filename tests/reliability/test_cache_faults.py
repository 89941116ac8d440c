"""The disk cache under faults: damaged files are regenerated with a warning, unusable
directories fall back to a private temporary one with a warning, foreign files never run."""
import builtins
import errno
import importlib.util
import marshal
import os
import pathlib
import stat
import subprocess
import sys
import time

import pytest
import torch

import flexfa
from flexfa.runtime import cache, cache_location
from flexfa.runtime.cache import STATS
from .inputs import assert_matches_reference, qkv

NOBODY = 65534  # a uid that is not this process's (tests run as any user, often root)


def faults_probe(score, b, h, q_idx, kv_idx):
    return score * 0.5 + (q_idx - kv_idx) * 0.03125


def _attend():
    q, k, v = qkv()
    out = flexfa.flex_attention(q, k, v, score_mod=faults_probe)
    assert_matches_reference(out, q, k, v, faults_probe)
    return out


def _only_kernel(directory):
    (path,) = directory.glob("flexfa_fwd_*.py")
    return path


def _damage_and_rerun(directory, text: str | bytes):
    """Overwrite the one cached kernel with ``text``, forget the memo, run again."""
    path = _only_kernel(directory)
    good = path.read_text()
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    cache.clear_memo()
    with pytest.warns(RuntimeWarning, match="is invalid") as record:
        _attend()
    assert str(path) in str(record[0].message)
    assert path.read_text() == good, "the damaged file was not replaced by a good one"
    return str(record[0].message)


def test_cache_dir_is_created_user_private(fresh_cache):
    assert not fresh_cache.exists()
    _attend()
    mode = stat.S_IMODE(fresh_cache.stat().st_mode)
    assert mode == 0o700, f"cache directory created with mode {oct(mode)}"
    path = _only_kernel(fresh_cache)
    assert not stat.S_IMODE(path.stat().st_mode) & 0o022, "kernel file writable by others"
    assert not list(fresh_cache.glob(".*.tmp")) and not list(fresh_cache.glob(".flexfa-probe.*"))


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "binary", "edited",
                                    "other key"])
def test_damaged_file_is_regenerated_with_a_warning(fresh_cache, damage):
    _attend()
    good = _only_kernel(fresh_cache).read_text()
    header, _, body = good.partition("\n")
    other_key = header.replace("key=", "key=0")
    text = {"truncated": good[: len(good) * 2 // 3], "empty": "",
            "garbage": "print('not flexfa')\n" * 5, "binary": bytes(range(256)) * 4,
            "edited": header + "\n" + body.replace("tl.", "tl .", 1),
            "other key": other_key + "\n" + body}[damage]
    message = _damage_and_rerun(fresh_cache, text)
    expected = {"truncated": "checksum", "empty": "header", "garbage": "header",
                "binary": "unreadable", "edited": "checksum", "other key": "another cache key"}
    assert expected[damage] in message
    assert STATS.regenerated == 1 and STATS.codegen == 2


@pytest.mark.parametrize("foreign", ["other owner", "group writable"])
def test_foreign_file_with_a_valid_checksum_is_never_imported(fresh_cache, foreign):
    """A file flexfa did not write (another user's, or one others could have changed) is
    not imported even when its header and checksum are consistent."""
    _attend()
    path = _only_kernel(fresh_cache)
    key = path.read_text().partition("\n")[0].split("key=")[1].split()[0]
    payload = "import builtins\nbuiltins.flexfa_foreign_code_ran = True\n"
    path.write_text(cache._with_header(key, payload))
    if foreign == "other owner":
        os.chown(path, NOBODY, NOBODY) if os.geteuid() == 0 else pytest.skip("needs root")
    else:
        path.chmod(0o666)
    cache.clear_memo()
    with pytest.warns(RuntimeWarning, match="untrusted"):
        _attend()
    assert not getattr(builtins, "flexfa_foreign_code_ran", False), "foreign code was executed"
    assert path.stat().st_uid == os.geteuid() and "flexfa_foreign" not in path.read_text()


def _bytecode_for(path, code_text: str | None = None) -> bytes:
    """A .pyc that Python accepts for the source at ``path`` (its header names the file's
    mtime and size): of ``code_text``, or (None) a damaged one, cut after the header."""
    info = path.stat()
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little") + \
        (int(info.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + \
        (info.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    if code_text is None:
        return header + b"\xe3\x00"
    return header + marshal.dumps(compile(code_text, str(path), "exec"))


@pytest.mark.parametrize("bytecode", ["damaged", "other code"])
def test_python_bytecode_of_a_kernel_never_runs(fresh_cache, bytecode):
    """Python's .pyc is valid for a source by its mtime and size alone: a damaged one failed
    every call, and one of other code ran instead of the checked kernel. The checked text runs."""
    _attend()
    path = _only_kernel(fresh_cache)
    payload = "import builtins\nbuiltins.flexfa_bytecode_ran = True\n"
    pyc = pathlib.Path(importlib.util.cache_from_source(str(path)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(_bytecode_for(path, None if bytecode == "damaged" else payload))
    cache.clear_memo()
    _attend()
    assert not getattr(builtins, "flexfa_bytecode_ran", False), "bytecode was run"
    assert STATS.codegen == 1 and STATS.disk_hits == 1


def _fallback_run(configured):
    """One call with an unusable cache directory: warns, still correct, the kernel lands in
    the private fallback directory."""
    cache.clear_memo()
    with pytest.warns(RuntimeWarning, match="private temporary directory") as record:
        _attend()
    fallback = cache_location.fallback_dir()
    assert str(configured) in str(record[0].message) and str(fallback) in str(record[0].message)
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700
    assert _only_kernel(fallback).exists()
    return str(record[0].message)


def test_read_only_cache_dir_falls_back(fresh_cache):
    fresh_cache.mkdir(mode=0o500)
    try:
        message = _fallback_run(fresh_cache)
        assert "read-only" in message
        assert not any(fresh_cache.iterdir()), "flexfa wrote into a read-only directory"
    finally:
        fresh_cache.chmod(0o700)


@pytest.mark.parametrize("owner", ["this user", "root"])
def test_read_only_cache_dir_is_reused(fresh_cache, owner, monkeypatch, recwarn):
    """Valid kernels in a trusted read-only directory (a read-only mount; an image's cache
    that root wrote, read by another user) are imported; nothing is generated or written."""
    if owner == "root" and os.geteuid() != 0:
        pytest.skip("needs root to write files owned by root")
    _attend()
    files = sorted(p.name for p in fresh_cache.iterdir())
    fresh_cache.chmod(0o500)
    try:
        cache.clear_memo()
        STATS.reset()
        with monkeypatch.context() as patch:
            if owner == "root":  # root wrote the cache; this process is another user
                patch.setattr(os, "geteuid", lambda: NOBODY)
            _attend()
        assert STATS.codegen == 0 and STATS.disk_hits == 1
        assert not [w for w in recwarn if "flexfa" in str(w.message)]
        assert sorted(p.name for p in fresh_cache.iterdir()) == files
    finally:
        fresh_cache.chmod(0o700)


def test_read_only_cache_dir_never_imports_a_foreign_file(fresh_cache):
    _attend()
    path = _only_kernel(fresh_cache)
    key = path.read_text().partition("\n")[0].split("key=")[1].split()[0]
    path.write_text(cache._with_header(key, "import builtins\nbuiltins.flexfa_foreign_ran = 1\n"))
    path.chmod(0o644)
    os.chown(path, NOBODY, NOBODY) if os.geteuid() == 0 else path.chmod(0o666)
    fresh_cache.chmod(0o500)
    STATS.reset()
    try:
        message = _fallback_run(fresh_cache)
        assert "read-only" in message and STATS.codegen == 1
        assert not getattr(builtins, "flexfa_foreign_ran", False), "foreign code was executed"
    finally:
        fresh_cache.chmod(0o700)


HOLDER = """import fcntl, sys, time
handle = open(sys.argv[1], "a+")
fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_a_lock_held_forever_by_another_process_times_out(fresh_cache, monkeypatch):
    """Another process holding a kernel's lock (stopped, hung) costs the wait of
    FLEXFA_CACHE_LOCK_TIMEOUT and a warning naming the lock, then the kernel is generated
    privately and the call is correct."""
    _attend()
    kernel = _only_kernel(fresh_cache)
    kernel.unlink()  # the lock file stays, as after a crash of its writer
    lock = kernel.with_suffix(".lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setenv("FLEXFA_CACHE_LOCK_TIMEOUT", "0.5")
        cache.clear_memo()
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match="held by another process") as record:
            _attend()
        assert time.monotonic() - start < 30
    finally:
        holder.kill()
        holder.wait()
    message = str(record[0].message)
    assert str(lock) in message and "FLEXFA_CACHE_LOCK_TIMEOUT" in message
    assert _only_kernel(cache_location.fallback_dir()).name == kernel.name
    assert not kernel.exists()


def test_missing_cache_dir_is_created(fresh_cache, monkeypatch, recwarn):
    nested = fresh_cache / "a" / "b"
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(nested))
    _attend()
    assert _only_kernel(nested).exists()
    assert not [w for w in recwarn if "flexfa" in str(w.message)]


def test_missing_cache_dir_that_cannot_be_created_falls_back(fresh_cache, monkeypatch):
    fresh_cache.parent.joinpath("a_file").write_text("not a directory")
    configured = fresh_cache.parent / "a_file" / "cache"
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(configured))
    assert "cannot be created" in _fallback_run(configured)


def test_cache_path_that_is_a_file_falls_back(fresh_cache):
    fresh_cache.write_text("not a directory")
    assert "cannot be created" in _fallback_run(fresh_cache)


@pytest.mark.parametrize("foreign", ["other owner", "world writable"])
def test_untrusted_cache_dir_falls_back(fresh_cache, foreign):
    fresh_cache.mkdir(mode=0o700)
    if foreign == "other owner":
        os.chown(fresh_cache, NOBODY, NOBODY) if os.geteuid() == 0 else pytest.skip("needs root")
        match = "owned by uid"
    else:
        fresh_cache.chmod(0o777)
        match = "writable by group or others"
    assert match in _fallback_run(fresh_cache)
    assert not any(fresh_cache.iterdir())


def test_failed_write_falls_back(fresh_cache, monkeypatch):
    """A directory that passes the checks but fails the write (disk full) is replaced."""
    real_write = cache.write_atomic

    def full_disk(path, text):
        if path.parent == fresh_cache:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, text)

    monkeypatch.setattr(cache, "write_atomic", full_disk)
    assert "failed a write" in _fallback_run(fresh_cache)


@pytest.mark.parametrize("fault", ["every write fails", "no temporary directory"])
def test_no_usable_directory_still_runs_the_kernel(fresh_cache, monkeypatch, fault):
    """Neither the configured directory nor a private one takes the kernel (every disk full;
    a read-only cache with no temporary directory): the call raised OSError; now the source
    is generated in memory, with a warning, and the call is correct."""
    def refuse(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if fault == "every write fails":
        monkeypatch.setattr(cache, "write_atomic", refuse)
    else:
        fresh_cache.mkdir(mode=0o500)
        monkeypatch.setattr(cache_location.tempfile, "mkdtemp", refuse)
    try:
        for _ in range(2):  # again after the memo is cleared: generated again, not found
            with pytest.warns(RuntimeWarning, match="generated in memory"):
                _attend()
            cache.clear_memo()
    finally:
        fresh_cache.chmod(0o700)
    assert STATS.codegen == 2 and STATS.disk_hits == 0
    assert not list(fresh_cache.glob("flexfa_*.py"))


def test_fallback_is_shared_by_later_kernels(fresh_cache):
    """A second kernel of the same process goes to the same fallback directory."""
    fresh_cache.mkdir(mode=0o500)
    try:
        _fallback_run(fresh_cache)
        q, k, v = qkv(L=24, S=24, E=32)
        with pytest.warns(RuntimeWarning, match="read-only"):
            out = flexfa.flex_attention(q, k, v)
        assert_matches_reference(out, q, k, v)
        assert len(list(cache_location.fallback_dir().glob("flexfa_fwd_*.py"))) == 2
    finally:
        fresh_cache.chmod(0o700)


def test_clean_directory_gives_no_warning(fresh_cache, recwarn):
    _attend()
    cache.clear_memo()
    out = _attend()
    assert STATS.codegen == 1 and STATS.disk_hits == 1 and torch.isfinite(out).all()
    assert not [w for w in recwarn if "flexfa" in str(w.message)]


def test_a_relative_cache_dir_does_not_follow_the_current_directory(fresh_cache, monkeypatch):
    """FLEXFA_CACHE_DIR=cache was read against the current directory at every call: after
    an os.chdir the next kernel went to another directory (and a second process started
    elsewhere with the same setting shared nothing). It is taken from the directory flexfa
    was imported in."""
    from flexfa import config
    start, elsewhere = fresh_cache.parent / "start", fresh_cache.parent / "elsewhere"
    start.mkdir()
    elsewhere.mkdir()
    monkeypatch.setattr(config, "_START_DIRECTORY", str(start), raising=False)
    monkeypatch.setenv("FLEXFA_CACHE_DIR", "cache")
    monkeypatch.chdir(elsewhere)
    assert config.cache_dir() == start / "cache"
    _attend()
    monkeypatch.chdir(fresh_cache.parent)
    q, k, v = qkv(L=24, S=24, E=32)  # a second kernel, after a chdir
    assert_matches_reference(flexfa.flex_attention(q, k, v), q, k, v)
    assert len(list((start / "cache").glob("flexfa_fwd_*.py"))) == 2
    assert not (elsewhere / "cache").exists() and not (fresh_cache.parent / "cache").exists()
    monkeypatch.setenv("FLEXFA_CACHE_DIR", "~/x/../flexfa")  # the user's: not relative
    assert config.cache_dir() == pathlib.Path.home() / "flexfa"


def _forked_child(start, results):
    """Wait until the parent's private directory is gone, then generate a new kernel."""
    torch.set_num_threads(1)  # as a DataLoader worker: the parent's OpenMP pool is not forked
    start.wait(60)
    try:
        q, k, v = qkv(L=40, S=40, E=16)  # a kernel the parent never made
        with pytest.warns(RuntimeWarning, match="read-only"):
            out = flexfa.flex_attention(q, k, v)
        assert_matches_reference(out, q, k, v)
        results.put(("ok", str(cache_location.fallback_dir())))
    except BaseException as exc:  # reported to the parent, which fails the test
        results.put(("failed", f"{type(exc).__name__}: {exc}"))


def test_a_forked_child_writes_kernels_after_its_parent_removed_its_directory(fresh_cache):
    """The private directory is removed when the process that made it exits; a forked child
    (a DataLoader worker) kept writing to it, so a new kernel failed there (FileNotFoundError
    on its lock file) once the parent was gone. A child makes its own, removed when it exits."""
    import multiprocessing
    fresh_cache.mkdir(mode=0o500)
    try:
        _fallback_run(fresh_cache)
        parents = cache_location.fallback_dir()
        context = multiprocessing.get_context("fork")
        start, results = context.Event(), context.Queue()
        child = context.Process(target=_forked_child, args=(start, results))
        child.start()
        cache_location._remove(parents, os.getpid())  # what the parent's exit does
        start.set()
        status, detail = results.get(timeout=120)
        child.join(60)
    finally:
        fresh_cache.chmod(0o700)
    assert status == "ok", detail
    assert child.exitcode == 0 and pathlib.Path(detail) != parents
    assert not pathlib.Path(detail).exists(), "the child's private directory outlived it"
