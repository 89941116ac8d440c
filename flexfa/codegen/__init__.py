"""Code generation: the IR -> Triton expression renderer, kernel templates and their specs.

The backward and the other templates build on these: ``render`` (several roots at once, shared
subexpressions), ``Leaves`` / ``BufferArgs`` / ``buffer_args`` (names of the mod inputs and
captured-tensor arguments inside a kernel), ``fill`` / ``load_template`` (templates with
``{{HOOK}}`` placeholders), ``KernelSpec`` and ``forward_kernel``.
"""
from .forward import GeneratedKernel, forward_kernel, forward_signature
from .render import BufferArgs, Leaves, Rendered, buffer_args, needs_tile_broadcast, render
from .spec import KernelSpec, kernel_name
from .template import fill, load_template, template_hash

__all__ = ["GeneratedKernel", "forward_kernel", "forward_signature", "BufferArgs", "Leaves",
           "Rendered", "buffer_args", "needs_tile_broadcast", "render", "KernelSpec",
           "kernel_name", "fill", "load_template", "template_hash"]
