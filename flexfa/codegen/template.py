"""Kernel templates: package-data files with ``{{HOOK}}`` placeholders.

A hook written alone on a line (after indentation) takes a block of code: every line of the
filled value gets that indentation. A hook inside a line is replaced inline.
"""
from __future__ import annotations

import functools
import hashlib
import re
from importlib import resources

_HOOK = re.compile(r"\{\{([A-Z_][A-Z0-9_]*)\}\}")
_BLOCK_HOOK = re.compile(r"^([ \t]*)\{\{([A-Z_][A-Z0-9_]*)\}\}[ \t]*$", re.MULTILINE)


@functools.cache
def load_template(name: str) -> str:
    """The text of ``flexfa/codegen/templates/<name>``."""
    return resources.files(__package__).joinpath("templates", name).read_text()


def template_hash(*names: str) -> str:
    """sha256 over the named templates (part of every cache key using them)."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode())
        digest.update(load_template(name).encode())
    return digest.hexdigest()


def fill(text: str, **hooks: str) -> str:
    """Replace every ``{{HOOK}}``; a missing hook or an unused value is an error."""
    present = set(_HOOK.findall(text))
    missing = present - hooks.keys()
    unused = hooks.keys() - present
    assert not missing, f"template hooks without values: {sorted(missing)}"
    assert not unused, f"values for hooks the template does not have: {sorted(unused)}"

    def block(match: re.Match) -> str:
        indent, name = match.group(1), match.group(2)
        return "\n".join(indent + line if line else line for line in hooks[name].split("\n"))

    text = _BLOCK_HOOK.sub(block, text)
    return _HOOK.sub(lambda m: hooks[m.group(1)], text)
