"""Run by test_empty_caches.py through scripts/test.sh (not collected on its own: no test_
prefix): the suite's caches must be empty directories of its own."""
import os
from pathlib import Path


def test_the_suite_runs_on_empty_caches_of_its_own():
    seen = []
    for name in ("TRITON_CACHE_DIR", "FLEXFA_CACHE_DIR"):
        directory = Path(os.environ[name])
        assert directory != Path(os.environ["CALLER_" + name]), f"{name} is the caller's"
        assert not directory.exists() or not any(directory.iterdir()), f"{name} is not empty"
        seen.append(str(directory))
    Path(os.environ["EMPTY_CACHES_REPORT"]).write_text("\n".join(seen))
