"""Loading a generated kernel: the codegen's source through the disk cache, memoized."""
from __future__ import annotations

import os
import traceback

from ..codegen.forward import GeneratedKernel
from ..errors import CodegenError, FlexFAError
from ..frontend.trace import TracedMod
from ..memo import BoundedMemo
from .cache import get_module

_MODULES = BoundedMemo(2048, "generated modules")


def generated_module(generate, spec, *mods):
    """(module, kernel name) of ``generate(spec, *mods)`` (a GeneratedKernel), through the
    cache; memoized by the spec and the mods' keys."""
    memo_key = (generate, spec, *(_mod_key(m) for m in mods))
    found = _MODULES.get(memo_key)
    if found is None:
        generated = generate(spec, *mods)
        found = _MODULES[memo_key] = (load_generated(generated, spec.interpret), generated.name)
    return found


def generated_kernel(generate, spec, *mods):
    """The launchable kernel named like its module (a JITFunction or InterpretedFunction)."""
    module, name = generated_module(generate, spec, *mods)
    return getattr(module, name)


def _mod_key(mod):
    """A TracedMod by its structure and grad slots; anything else (the backward's joint graph,
    derived from the score_mod and its grad slots, which are in the key) adds nothing."""
    if isinstance(mod, TracedMod):
        return mod.key, mod.grad_buffers
    return None


def load_generated(generated: GeneratedKernel, interpret: bool):
    """The imported module of ``generated``, through the kernel cache. A source that Python
    cannot compile or run (an error raised from the generated file) is a CodegenError naming
    the mods and the file, not a bare SyntaxError from a file the user never wrote."""
    try:
        return get_module(generated.name, generated.key, interpret, lambda: generated.source)
    except (OSError, FlexFAError):
        raise
    except Exception as exc:
        path = _generated_file(exc, generated.name)
        if path is None:
            raise
        raise CodegenError(
            f"the kernel generated for {generated.mods} does not compile: "
            f"{type(exc).__name__}: {exc} (generated file: {path}); please report this "
            "with the mods") from exc


def _generated_file(exc: BaseException, name: str) -> str | None:
    """The generated file ``<name>.py`` an exception was raised from (a SyntaxError names
    it; otherwise a frame of its traceback runs it), or None."""
    filename = getattr(exc, "filename", None) if isinstance(exc, SyntaxError) else None
    files = [filename] + [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
    return next((f for f in files if f and os.path.basename(f) == f"{name}.py"), None)
