"""The cache key covers the sources that write kernels: an edited renderer, template or IR
module gives new keys, so a stale renderer's kernels are never reused."""
import shutil

import pytest
from hypothesis import given, settings, strategies as st

from flexfa.codegen import versions
from flexfa.codegen.forward import forward_kernel
from flexfa.codegen.spec import KernelSpec
from flexfa.frontend import trace

SPEC = KernelSpec(dtype="fp32", head_dim=16, head_dim_v=16, block_m=16, block_n=16, num_warps=4,
                  num_stages=1, has_block_mask=False, has_full_blocks=False, sparse_q=16,
                  sparse_kv=16, even_l=True, even_s=True, return_lse=False, gqa_group=1,
                  input_precision="ieee", target="interpret")
HASHED = [name for name, _ in versions.read_sources(versions.PACKAGE)]


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory):
    """A copy of the hashed folders, to edit."""
    root = tmp_path_factory.mktemp("flexfa")
    for folder in ("codegen", "frontend"):
        shutil.copytree(versions.PACKAGE / folder, root / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _fresh_hash(package):
    return versions.sources_hash.__wrapped__(package)  # past the per-process cache


def test_the_renderer_templates_and_ir_are_hashed():
    for name in ("codegen/render.py", "codegen/forward.py", "codegen/templates/fwd.tmpl",
                 "codegen/templates/bwd_dq.tmpl", "frontend/ir.py", "frontend/grad.py",
                 "frontend/simplify.py"):
        assert name in HASHED, f"{name} is not part of the cache key"
    assert f"sources={versions.sources_hash()}" in versions.versions_key()


# every file (drawn from one list, CI's 15 examples reached 12 of the 47), a few edits each
@pytest.mark.parametrize("name", HASHED)
@settings(max_examples=3)
@given(fraction=st.floats(0, 1), byte=st.binary(min_size=1, max_size=3))
def test_editing_any_hashed_file_changes_the_hash(package_copy, name, fraction, byte):
    path = package_copy / name
    original = path.read_bytes()
    assert _fresh_hash(package_copy) == versions.sources_hash()
    at = int(fraction * len(original))
    try:
        path.write_bytes(original[:at] + byte + original[at:])
        assert _fresh_hash(package_copy) != versions.sources_hash(), f"edit of {name} unseen"
    finally:
        path.write_bytes(original)


def test_a_new_hashed_file_changes_the_hash(package_copy):
    added = package_copy / "frontend" / "new_rules.py"
    try:
        added.write_text("")
        assert _fresh_hash(package_copy) != versions.sources_hash()
    finally:
        added.unlink()


def test_an_edited_renderer_changes_the_kernel_key(monkeypatch):
    score = trace(lambda s, b, h, q, kv: s * 0.5)
    before = forward_kernel(SPEC, score, None)
    real = versions.read_sources

    def edited(package):
        return [(name, content + b"\n# new rule\n" if name == "codegen/render.py" else content)
                for name, content in real(package)]

    caches = (versions.sources_hash, versions.versions_key, versions.build_tag)
    monkeypatch.setattr(versions, "read_sources", edited)
    for cached in caches:
        cached.cache_clear()
    try:
        after = forward_kernel(SPEC, score, None)
        build = versions.build_tag()
    finally:
        monkeypatch.undo()
        for cached in caches:
            cached.cache_clear()
    assert after.key != before.key and after.name != before.name
    # the same text but for the name: only the key tells the builds apart
    assert after.source.replace(after.name, before.name) == before.source
    assert build != versions.build_tag()
