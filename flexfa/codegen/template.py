"""Kernel templates: package-data files with ``{{HOOK}}`` placeholders, and the generated
modules assembled from them.

A hook written alone on a line (after indentation) takes a block of code: every line of the
filled value gets that indentation. A hook inside a line is replaced inline. A generated
module (``module_source``) is a title, the imports, its flags (module-level constexprs that
the helper functions read, so no helper threads them through its parameters) and sections:
the helpers, the kernel libraries, the filled templates.
"""
from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
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


# the interpreter hands a kernel its constexpr arguments as plain Python values: its helpers
# read the flags as such too (a tl.constexpr has no reflected operators: 3 % BLOCK fails)
INTERPRETED_FLAGS = """\
if triton.knobs.runtime.interpret:
    globals().update({name: value.value for name, value in list(globals().items())
                      if isinstance(value, tl.constexpr)})"""


# Calls between a module's functions skip the interpreter's per-call patching of
# triton.language (the launch of the kernel patched it for the whole grid, and it is global):
# under the interpreter each function but the kernels becomes the plain Python function the
# interpreter would run, so the helper functions of the template library cost no more than
# code written inline
_INTERPRETED_CALLS = """\
if triton.knobs.runtime.interpret:
    from triton.runtime.interpreter import InterpretedFunction
    globals().update({{name: value.rewrite() for name, value in list(globals().items())
                      if isinstance(value, InterpretedFunction)
                      and value.fn.__module__ == __name__ and name not in {kernels}}})"""


def module_source(title: str, flags: Mapping[str, object], kernels: tuple[str, ...],
                  *sections: str) -> str:
    """A generated module: ``# title``, the imports, one ``NAME = tl.constexpr(value)`` per
    flag (each documented at the top of the template that uses it), then ``sections``; the
    functions named ``kernels`` are the ones launched."""
    header = [f"# {title}\nimport triton\nimport triton.language as tl"]
    if flags:
        header.append("\n".join(f"{name} = tl.constexpr({value!r})"
                                for name, value in flags.items()))
        header.append(INTERPRETED_FLAGS)
    return "\n\n\n".join(["\n\n".join(header),
                          *(section.strip("\n") for section in sections),
                          _INTERPRETED_CALLS.format(kernels=tuple(kernels))]) + "\n"
