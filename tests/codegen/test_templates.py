"""Every kernel template uses only Triton builtins and flexfa's helpers, never the @jit
functions of triton.language's standard library: those are decorated once, interpreted or
compiled, when triton.language is imported (helpers.tmpl), so in a process that imported
Triton under TRITON_INTERPRET=1 (this test suite) a compiled kernel calling one fails (a
tl.zeros in the fused backward's delta kernel did, on the H200)."""
import re
from pathlib import Path

import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

TEMPLATES = Path(__file__).resolve().parents[2] / "flexfa" / "codegen" / "templates"


def _standard_jit_functions() -> set[str]:
    return {name for name in dir(tl)
            if isinstance(getattr(tl, name), (JITFunction, InterpretedFunction))}


def test_templates_call_no_standard_library_jit_function():
    banned = _standard_jit_functions()
    assert {"zeros", "sum", "max", "cdiv", "sigmoid"} <= banned
    found = []
    for path in sorted(TEMPLATES.glob("*.tmpl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for name in re.findall(r"\btl\.(\w+)\s*\(", code):
                if name in banned:
                    found.append(f"{path.name}:{number}: tl.{name}")
    assert not found, "standard-library @jit functions in templates: " + ", ".join(found)


def test_every_template_of_a_module_is_in_its_key():
    """A generated module's cache key hashes every template the module is built from (an
    edited library template must not reuse kernels built from the old one)."""
    from test_params import _generated

    from flexfa.codegen import backward, forward, fp8, hopper

    keyed = {"fwd": forward.FORWARD_TEMPLATES, "fwd_hopper": hopper.HOPPER_TEMPLATES,
             "fwd_fp8": fp8.FP8_TEMPLATES, "quantize": fp8.QUANTIZE_TEMPLATES,
             "bwd": backward.BACKWARD_TEMPLATES}
    for module, generated in _generated().items():
        used = re.findall(r"^# Template: flexfa/codegen/templates/(\w+\.tmpl)",
                          generated.source, re.M)
        assert "helpers.tmpl" in used and set(used) <= set(keyed[module]), (module, used)
