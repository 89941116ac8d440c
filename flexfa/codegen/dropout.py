"""The dropout-mask kernel: ``dropout_mask.tmpl`` with the helpers every attention kernel
draws its dropout from, so the mask it writes is the one the kernels apply."""
from __future__ import annotations

import hashlib

from .forward import GeneratedKernel
from .params import def_kernel, dropout_mask_params
from .template import fill, load_template, module_source, template_hash
from .versions import versions_key

DROPOUT_MASK_TEMPLATES = ("dropout_mask.tmpl", "helpers.tmpl")


def dropout_mask_kernel() -> GeneratedKernel:
    """Key, name (``flexfa_dropout_mask_<hash>``) and source of the mask kernel (one for every
    shape; its tiles are constexpr parameters)."""
    text = "|".join(("dropout_mask", versions_key(), template_hash(*DROPOUT_MASK_TEMPLATES)))
    key = hashlib.sha256(text.encode()).hexdigest()
    name = f"flexfa_dropout_mask_{key[:12]}"
    params = dropout_mask_params()
    source = module_source(f"flexfa generated dropout-mask kernel: {name}", {}, (name,),
                           load_template("helpers.tmpl"),
                           fill(load_template("dropout_mask.tmpl"), KERNEL_NAME=name,
                                DEF_KERNEL=def_kernel(name, params, {})))
    return GeneratedKernel(key, name, source, kernels=((name, params),))
