"""The frontend: trace Python mods into the IR, evaluate it, derive its gradients."""
from .ir import DType, Node, Op, format_ir
from .trace import MASK_MOD, SCORE_MOD, TracedMod, mod_kind, trace
from .evaluate import dense_mask, evaluate, evaluate_node, index_grids
from .simplify import simplify
from .combinators import and_masks, noop_mask, or_masks

__all__ = ["DType", "Node", "Op", "format_ir", "MASK_MOD", "SCORE_MOD", "TracedMod", "mod_kind",
           "trace", "dense_mask", "evaluate", "evaluate_node", "index_grids",
           "simplify", "and_masks", "noop_mask", "or_masks"]
