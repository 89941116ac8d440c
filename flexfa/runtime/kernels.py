"""Loading a generated kernel: the codegen's source through the disk cache, memoized."""
from __future__ import annotations

import dataclasses
import os
import traceback

from ..codegen.forward import GeneratedKernel
from ..codegen.spec import load_mode
from ..errors import CodegenError, FlexFAError
from ..frontend.trace import TracedMod
from ..memo import BoundedMemo
from .cache import get_module

_MODULES = BoundedMemo(2048, "generated modules")


class Loaded:
    """A generated module, imported, with its kernels' described parameters."""

    __slots__ = ("module", "name", "params")

    def __init__(self, module, generated: GeneratedKernel):
        self.module, self.name = module, generated.name
        self.params = dict(generated.kernels)  # kernel function -> KernelParams

    def kernel(self, function: str | None = None):
        """The launchable kernel ``function`` (default: the one named like the module)."""
        return getattr(self.module, function or self.name)

    def names(self, function: str | None = None) -> tuple[str, ...]:
        """The kernel's positional parameter names, in order (flexfa/codegen/params.py)."""
        return self.params[function or self.name].names


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """The spec of a kernel that has no spec fields (the FP8 quantization, the dropout mask):
    one module per kernel and interpret/compile mode."""

    kernel: str
    interpret: bool


def generated_module(generate, spec, *mods) -> Loaded:
    """``generate(spec, *mods)`` (a GeneratedKernel) imported through the cache; memoized by
    the spec and the mods' keys."""
    memo_key = (generate, spec, *(_mod_key(m) for m in mods))
    found = _MODULES.get(memo_key)
    if found is None:
        generated = generate(spec, *mods)
        found = _MODULES[memo_key] = Loaded(load_generated(generated, load_mode(spec)), generated)
    return found


def _mod_key(mod):
    """A TracedMod by its structure and grad slots; anything else (the backward's joint graph,
    derived from the score_mod and its grad slots, which are in the key) adds nothing."""
    if isinstance(mod, TracedMod):
        return mod.key, mod.grad_buffers
    return None


def load_generated(generated: GeneratedKernel, interpret: bool | str):
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
