"""Fixture of the reliability tests: an empty cache directory and a fresh private fallback
directory per test."""
import pytest

from flexfa.runtime import cache, cache_location
from flexfa.runtime.cache import STATS


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """FLEXFA_CACHE_DIR = a new directory (not yet created); memo, stats and the private
    fallback directory reset, so every kernel is looked up on disk again."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(directory))
    monkeypatch.setattr(cache_location, "_FALLBACK", [])
    cache.clear_memo()
    STATS.reset()
    yield directory
    cache.clear_memo()

