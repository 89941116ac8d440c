"""flexfa as PyTorch operators, so that ``torch.compile`` captures attention into its graphs.

``torch.ops.flexfa.flex_attention`` (forward), ``torch.ops.flexfa.flex_attention_backward``
(its registered autograd formula runs it) and ``torch.ops.flexfa.block_mask_tables`` (the
tables of ``create_block_mask``). Each runs the same runtime as eager flexfa
(``flexfa.calls.attention_call``, ``run_forward``, ``run_backward``, ``create_block_mask``);
``torch.ops.flexfa.flex_decode`` runs ``flex_decode`` (``flexfa.decode.decode_call``).

A mod is not a tensor: its trace (IR, names, captured tensors' shapes and dtypes, kept
without the tensors: ``ModsEntry``) is registered under a string key, derived from the
traces' keys and the options, that the graph passes to the operators. The captured tensors
and the block mask's tables are operator inputs: Dynamo guards on them and every run reads
their current contents. Nothing registered holds a tensor, so the registry keeps no user
data alive; it is bounded, and a key that fell out of it raises an error that says so. A key
may end in ``@n``: the class attributes its mods read (``class_pins``), which the operators
check on every run where Dynamo does not guard them (``check_unchanged``: torch 2.11).
"""
from __future__ import annotations

import dataclasses
import dis
import hashlib
import itertools
import types
import weakref

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .autograd import DOUBLE_BACKWARD_MESSAGE, joint_graph, run_backward, run_forward
from .blockmask.block_mask import BlockMask, TracedMaskMod
from .blockmask.create import create_block_mask
from .blockmask.validate import TABLES, StorageRecords, storage_signature
from .calls import attention_call
from .decode import decode_call
from .errors import InputError
from .features import check_sinks
from .flops import attention_flops
from .frontend.guards import exact, filled, is_library_name
from .frontend.trace import TracedMod, mod_name
from .inputs import check_block_mask, check_scale, check_shapes, check_tensors
from .memo import BoundedMemo, keep_on_owner
from .runtime.call import SINKS_GRAD, Dropout
from .runtime.layout import memory_values, output_like
from .runtime.options import KernelOptions

__all__ = ["ModsEntry", "register_mods", "mods_entry", "watched", "class_pins", "check_unchanged"]


@dataclasses.dataclass(frozen=True, eq=False)
class Skeleton:
    """A TracedMod without its captured tensors: what a graph keeps of a mod."""

    kind: str
    root: object  # the IR root (frontend.ir.Node)
    name: str
    buffer_specs: tuple  # ((shape, dtype), ...) when traced
    grad_slots: tuple  # the slots that required grad when traced

    @classmethod
    def of(cls, traced: TracedMod) -> "Skeleton":
        return cls(traced.kind, traced.root, traced.name, traced.buffer_specs,
                   traced.grad_buffers)

    def with_buffers(self, buffers, grad_slots=()) -> TracedMod:
        """The TracedMod reading ``buffers`` (the operator's inputs); those in ``grad_slots``
        are marked as requiring grad (the backward's kernels specialize on them). Tensors past
        the traced ones are captured tensors the trace removed (``TracedMod.dropped``), passed
        so that they get torch's zero gradient; no kernel reads them."""
        if len(buffers) < len(self.buffer_specs):
            raise InputError(f"the traced {self.kind} {self.name!r} reads "
                             f"{len(self.buffer_specs)} captured tensors but the operator got "
                             f"{len(buffers)}")
        buffers = buffers[:len(self.buffer_specs)]
        for slot, (tensor, (_, dtype)) in enumerate(zip(buffers, self.buffer_specs)):
            if tensor.dtype != dtype:
                raise InputError(f"captured tensor {slot} of the {self.kind} {self.name!r} has "
                                 f"dtype {tensor.dtype} but was {dtype} when traced")
        if grad_slots:
            buffers = [t.detach().requires_grad_() if s in grad_slots else t
                       for s, t in enumerate(buffers)]
        return TracedMod(self.kind, self.root, tuple(buffers), self.name)


@dataclasses.dataclass(frozen=True, eq=False)
class ModsEntry:
    """What a graph's operator calls share besides tensors: the mods' skeletons, the kernel
    options and enable_gqa."""

    score: Skeleton | None
    mask: Skeleton | None
    options: KernelOptions
    enable_gqa: bool


# key -> ModsEntry; not cleared by memo.clear_all: compiled graphs name their entries, and an
# entry holds only IR and options
_REGISTRY = BoundedMemo(4096, "compiled mods", register=False)


def register_mods(score: TracedMod | None, mask: TracedMod | None, options: KernelOptions,
                  enable_gqa: bool) -> str:
    """The key under which the operators find these mods and options."""
    parts = (score.key if score else "-", mask.key if mask else "-", repr(options),
             str(bool(enable_gqa)), repr(score.grad_buffers if score else ()))
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]
    if key not in _REGISTRY:
        _REGISTRY[key] = ModsEntry(score and Skeleton.of(score), mask and Skeleton.of(mask),
                                   options, bool(enable_gqa))
    return key


def mods_entry(key: str) -> ModsEntry:
    """The entry of ``register_mods``' key (a ``watched`` key's watch left out)."""
    key = key.partition(_WATCH)[0]
    entry = _REGISTRY.get(key)
    if entry is None:
        raise InputError(f"flexfa: the graph's mods {key!r} are not registered in this "
                         f"process: more than {_REGISTRY.size} mods were compiled since (call "
                         "torch._dynamo.reset() and compile again), or the graph was traced in "
                         "another process (a torch.export program loaded from a file: flexfa's "
                         "operators name their mods by a key of the process that traced them "
                         "and cannot be saved; export again in this process)")
    return entry


# ---- class attributes torch.compile may not guard ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class ClassPin:
    """A number or string a mod's code read from a class it names (``Config.window``), as
    the graph's trace saw it; the class held weakly."""

    ref: object  # weakref.ref to the class
    name: str
    value: object  # guards.exact of the value
    mod: str  # the mod's name, for the error
    where: str  # the function that reads it (the mod's own or one it calls), for the error


_WATCH = "@"  # between a key and its pins' number
_NO_ATTRIBUTE = object()
_PINS = BoundedMemo(4096, "compiled mods' class pins", register=False)
_PIN_NUMBERS = itertools.count()


def watched(key: str, pins: tuple) -> str:
    """``key`` with a number under which the operators find ``pins`` (``check_unchanged``)."""
    if not pins:
        return key
    number = str(next(_PIN_NUMBERS))
    _PINS[number] = pins
    return f"{key}{_WATCH}{number}"


def check_unchanged(key: str) -> None:
    """Raise where a class attribute a graph's mod read has changed since: torch 2.11's Dynamo
    folds a number read from a class (``Config.window``) into the graph with no guard, so the
    graph would run the old mod (2.13 guards it and compiles again before the graph runs)."""
    _, _, number = key.partition(_WATCH)
    if not number:
        return
    pins = _PINS.get(number)
    if pins is None:
        raise InputError(f"flexfa: the compiled graph's mods {key!r} are no longer registered "
                         f"(more than {_PINS.size} graphs were compiled since); call "
                         "torch._dynamo.reset() and compile again")
    for pin in pins:
        cls = pin.ref()
        if cls is not None and exact(getattr(cls, pin.name, _NO_ATTRIBUTE)) != pin.value:
            raise InputError(
                f"the mod {pin.mod!r} reads {cls.__qualname__}.{pin.name}"
                f"{'' if pin.where == pin.mod else f' (in {pin.where!r})'}, which changed since "
                "torch.compile traced it, and this torch's Dynamo does not guard class "
                "attributes: the compiled graph would run the old mod. Call "
                "torch._dynamo.reset() after changing it, or read it through an instance "
                "(self.window), a global or a closure, which Dynamo guards")


def class_pins(mod, functions) -> tuple:
    """The ClassPins of the attributes ``functions``' code (a mod's and what it may run:
    ``compiled.functions_run``) reads straight from a class it names (``Config.window``: an
    attribute load right after the load of a global or closure variable that holds a class;
    code nested in it included, its globals only): numbers, bools and strings, the values
    torch 2.11's Dynamo folds unguarded; ``mod`` names them in the error."""
    pins, name_of_mod = {}, mod_name(mod)
    for function in functions:
        if _is_ours(function.__module__ or ""):  # (torch's, flexfa's own: nothing to pin)
            continue
        cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
        for owner, name in _class_attribute_loads(function.__code__):
            cell = cells.get(owner)
            cls = (cell.cell_contents if cell is not None and filled(cell)
                   else function.__globals__.get(owner))
            if not isinstance(cls, type) or _is_ours(cls.__module__ or ""):
                continue
            value = getattr(cls, name, _NO_ATTRIBUTE)
            if type(value) in (bool, int, float, str) and (id(cls), name) not in pins:
                try:
                    ref = weakref.ref(cls)
                except TypeError:
                    continue
                pins[id(cls), name] = ClassPin(ref, name, exact(value), name_of_mod,
                                               mod_name(function))
    return tuple(pins.values())


def _class_attribute_loads(code: types.CodeType, nested: bool = False):
    """(variable, attribute) of each ``variable.attribute`` load in ``code`` (a global or, at
    the top level, a closure variable), and in the code nested in it."""
    previous = None
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_ATTR" and previous is not None and (
                previous.opname in ("LOAD_GLOBAL", "LOAD_NAME")
                or (previous.opname == "LOAD_DEREF" and not nested)):
            yield previous.argval, ins.argval
        previous = ins
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _class_attribute_loads(const, nested=True)


def _is_ours(module: str) -> bool:
    """A library's module or flexfa's, whose classes' attributes no mod changes."""
    return is_library_name(module) or module == "flexfa" or module.startswith("flexfa.")


# ---- block masks rebuilt from a graph's tables ---------------------------------------------

# the BlockMasks made around a kv_indices table, kept on the table (a cycle the garbage
# collector frees with it: a memo holding the mask would keep the table alive): the same
# tables give the same BlockMask object, so its table checks, plans and memos are reused.
# The mask keeps its own memos' entries (``keep_on_owner``): its plans bind the table that
# keeps the mask, which a module-level memo holding them would keep alive for ever
_MASKS = "_flexfa_graph_masks"
_MASKS_PER_TABLE = 4
# (mods, block size, lengths, the tables' and mask buffers' storage signatures) -> a weak
# reference to the BlockMask made for them: the backward's saved tensors are new objects over
# the forward's memory and find the forward's mask here (a dead reference is a miss; a live
# mask holds its tables, so no other storage can have their addresses meanwhile)
_BY_STORAGE = StorageRecords(256, "graph block masks")


def _block_mask(mods: str, entry: ModsEntry, mask_buffers, tables, block_size,
                lengths) -> BlockMask | None:
    if not tables:
        return None
    memo_key = (mods, tuple(block_size), lengths, tuple(map(id, tables)),
                tuple(map(id, mask_buffers)))
    kept = getattr(tables[1], _MASKS, None)
    mask = kept.get(memo_key) if kept is not None else None
    if mask is not None:
        return mask
    signatures = storage_signature(tables), storage_signature(mask_buffers, versions=False)
    storage_key = None
    if None not in signatures:
        storage_key = (mods, tuple(block_size), lengths, signatures[0][0], signatures[1][0])
        ref = _BY_STORAGE.get(storage_key)
        mask = ref() if ref is not None else None
    if mask is None:
        traced = entry.mask.with_buffers(mask_buffers)
        mask = BlockMask(lengths, *tables, BLOCK_SIZE=tuple(block_size),
                         mask_mod=TracedMaskMod(traced), traced_mask=traced)
        keep_on_owner(mask)
        if storage_key is not None:
            _BY_STORAGE.put(storage_key, signatures[0][1] + signatures[1][1],
                            weakref.ref(mask))
    if kept is None or len(kept) >= _MASKS_PER_TABLE:
        kept = {}
        setattr(tables[1], _MASKS, kept)
    kept[memo_key] = mask
    return mask


def _dropout(dropout_p: float, dropout_seed) -> Dropout | None:
    """The operator call's Dropout (None for p = 0); the seed is the int64 [seed, offset]
    tensor the caller drew (``flexfa.compiled.attention``), so the operator is functional."""
    if dropout_p == 0.0:
        return None
    if not 0.0 < dropout_p < 1.0:
        raise InputError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_seed is None or dropout_seed.dtype != torch.int64 or dropout_seed.shape != (2,):
        got = None if dropout_seed is None else (tuple(dropout_seed.shape), dropout_seed.dtype)
        raise InputError(f"dropout_seed must be an int64 tensor [seed, offset] of shape (2,) "
                         f"when dropout_p > 0, got {got}")
    return Dropout(dropout_p, dropout_seed)


def _call(query, key, value, mods: str, scale, score_buffers, mask_buffers, tables, block_size,
          grad_slots=(), grad_enabled=False, sinks=None, dropout=None):
    """(AttentionCall, key, value) of one operator call, checked as flex_attention checks
    a call; ``sinks`` checked as flex_attention checks them."""
    entry = mods_entry(mods)
    check_tensors(query, key, value)
    check_shapes(query, key, value, entry.enable_gqa)
    score = entry.score.with_buffers(score_buffers, grad_slots) if entry.score else None
    block_mask = _block_mask(mods, entry, mask_buffers, tables, block_size,
                             (query.shape[2], key.shape[2]))
    check_block_mask(block_mask, query, key)
    # (as flex_attention checks it, the default 1/sqrt(E) as eager's; a scale Dynamo made
    # symbolic was checked in the graph by guards, here by its value)
    scale = check_scale(scale, query.shape[3])
    sinks = check_sinks(sinks, query.shape[1], query.dtype, query.device)
    call, key, value = attention_call(query, key, value, score, block_mask, scale,
                                      entry.options, grad_enabled, sinks, dropout)
    return call, key, value


# ---- the forward --------------------------------------------------------------------------

@torch.library.custom_op("flexfa::flex_attention", mutates_args=())
def flex_attention_op(query: Tensor, key: Tensor, value: Tensor, mods: str, scale: float | None,
                      return_max: bool, score_buffers: list[Tensor], mask_buffers: list[Tensor],
                      tables: list[Tensor | None], block_size: list[int],
                      sinks: Tensor | None = None, dropout_p: float = 0.0,
                      dropout_seed: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(out in the query's dimension order, lse [B, Hq, L] float32, the rows' max scores
    [B, Hq, L] float32 or an empty tensor when ``return_max`` is False). ``sinks``: [Hq]
    sink logits or None; ``dropout_seed``: int64 [seed, offset], read when dropout_p > 0."""
    check_unchanged(mods)
    call, key, value = _call(query, key, value, mods, scale, score_buffers, mask_buffers, tables,
                             block_size, sinks=sinks, dropout=_dropout(dropout_p, dropout_seed))
    out, lse, maxs = run_forward(query, key, value, call, return_lse=True, return_max=return_max)
    return out, lse, maxs if maxs is not None else lse.new_empty(0)


@flex_attention_op.register_fake
def _(query, key, value, mods, scale, return_max, score_buffers, mask_buffers, tables,
      block_size, sinks=None, dropout_p=0.0, dropout_seed=None):
    entry = mods_entry(mods)
    check_shapes(query, key, value, entry.enable_gqa)
    B, Hq, L, _ = query.shape
    out = output_like(query, value.shape[3])
    lse = query.new_empty(B, Hq, L, dtype=torch.float32)
    return out, lse, (query.new_empty(B, Hq, L, dtype=torch.float32) if return_max
                      else query.new_empty(0, dtype=torch.float32))


def _setup_context(ctx, inputs, output) -> None:
    (query, key, value, mods, scale, _, score_buffers, mask_buffers, tables, block_size, sinks,
     dropout_p, dropout_seed) = (*inputs, None, 0.0, None)[:13]
    out, lse, maxs = output
    ctx.mods, ctx.scale, ctx.block_size, ctx.dropout_p = mods, scale, block_size, dropout_p
    ctx.counts = (len(score_buffers), len(mask_buffers), [t is not None for t in tables])
    entry = mods_entry(mods)
    read = len(entry.score.buffer_specs) if entry.score is not None else 0
    # the captured tensors the kernels read that require grad, and those past them (removed
    # by the trace: Skeleton.with_buffers) that do: torch's gradient of the latter is zeros
    ctx.grad_slots = [s for s, t in enumerate(score_buffers[:read]) if t.requires_grad]
    ctx.zero_slots = [s for s, t in enumerate(score_buffers) if s >= read and t.requires_grad]
    ctx.needs = (query.requires_grad, key.requires_grad or value.requires_grad,
                 sinks is not None and sinks.requires_grad)
    optional = [t for t in (sinks, dropout_seed if dropout_p else None) if t is not None]
    ctx.counts = (*ctx.counts, sinks is not None, len(optional))
    if entry.score is not None and ctx.grad_slots:  # no derivative: fails in the forward
        joint_graph(entry.score.with_buffers(score_buffers, tuple(ctx.grad_slots)))
    ctx.save_for_backward(query, key, value, out, lse, *score_buffers, *mask_buffers,
                          *(t for t in tables if t is not None), *optional)
    ctx.mark_non_differentiable(maxs)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse, grad_max):
    saved = ctx.saved_tensors
    query, key, value, out, lse = saved[:5]
    n_score, n_mask, present, has_sinks, n_optional = ctx.counts
    # (saved-tensor hooks may unpack negated views: the kernels read memory)
    score_buffers = [memory_values(t) for t in saved[5:5 + n_score]]
    mask_buffers = [memory_values(t) for t in saved[5 + n_score:5 + n_score + n_mask]]
    rest = iter(saved[5 + n_score + n_mask:len(saved) - n_optional])
    tables = [next(rest) if p else None for p in present]
    optional = iter(saved[len(saved) - n_optional:])
    sinks = memory_values(next(optional)) if has_sinks else None
    seed = next(optional, None)  # present when dropout_p > 0
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    need_dq, need_dkdv, need_dsinks = ctx.needs
    dq, dk, dv, dsinks, grads = flex_attention_backward_op(
        query, key, value, out, lse, grad_out, grad_lse, ctx.mods, ctx.scale, score_buffers,
        mask_buffers, tables, ctx.block_size, ctx.grad_slots, need_dq, need_dkdv, sinks,
        need_dsinks, ctx.dropout_p, seed)
    by_slot = dict(zip(ctx.grad_slots, grads))
    by_slot.update((s, torch.zeros_like(score_buffers[s])) for s in ctx.zero_slots)
    buffer_grads = [by_slot.get(s) for s in range(n_score)]
    # an empty list argument (block_size without a block mask) is a list in the inputs'
    # structure, a non-empty one of ints a leaf, and so is a list of tables holding a None (a
    # mask without full-block tables): its gradient mirrors that; a call may leave out
    # trailing arguments at their defaults (needs_input_grad has the call's structure)
    grads = (dq if need_dq else None, dk if need_dkdv else None, dv if need_dkdv else None,
             None, None, None, buffer_grads, [None] * n_mask,
             [None] * len(present) if all(present) else None,
             None if ctx.block_size else [], dsinks if need_dsinks else None, None, None)
    return grads[:len(ctx.needs_input_grad)]


# ---- the backward -------------------------------------------------------------------------

@torch.library.custom_op("flexfa::flex_attention_backward", mutates_args=())
def flex_attention_backward_op(query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                               lse: Tensor, grad_out: Tensor, grad_lse: Tensor | None, mods: str,
                               scale: float | None, score_buffers: list[Tensor],
                               mask_buffers: list[Tensor], tables: list[Tensor | None],
                               block_size: list[int], grad_slots: list[int], need_dq: bool,
                               need_dkdv: bool, sinks: Tensor | None = None,
                               need_dsinks: bool = False, dropout_p: float = 0.0,
                               dropout_seed: Tensor | None = None
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, d sinks, the gradients of the captured tensors in ``grad_slots``); the
    forward's ``dropout_seed`` draws the same keep mask. dq, dk, dv and d sinks not needed
    come back empty."""
    if need_dsinks and sinks is None:
        raise InputError("need_dsinks=True but sinks is None")
    if need_dsinks:  # run_backward computes d sinks for sinks that require grad
        sinks = sinks.detach().requires_grad_()
    call, key, value = _call(query, key, value, mods, scale, score_buffers, mask_buffers, tables,
                             block_size, tuple(grad_slots), sinks=sinks,
                             dropout=_dropout(dropout_p, dropout_seed))
    dq, dk, dv, buffer_grads = run_backward(query, key, value, out, lse, grad_out, grad_lse,
                                            call, need_dkdv=need_dkdv)
    empty = query.new_empty(0)
    return (dq if need_dq else empty.clone(), dk if need_dkdv else empty.clone(),
            dv if need_dkdv else empty.clone(),
            buffer_grads[SINKS_GRAD] if need_dsinks else empty.clone(),
            # zeros where no score depends on the tensor differentiably (score + t.floor()):
            # the kernels compute no gradient there, torch's is zeros
            [buffer_grads[s] if s in buffer_grads else
             torch.zeros_like(score_buffers[s], memory_format=torch.contiguous_format)
             for s in grad_slots])


@flex_attention_backward_op.register_fake
def _(query, key, value, out, lse, grad_out, grad_lse, mods, scale, score_buffers, mask_buffers,
      tables, block_size, grad_slots, need_dq, need_dkdv, sinks=None, need_dsinks=False,
      dropout_p=0.0, dropout_seed=None):
    # run_backward allocates dq, dk, dv and the captured tensors' gradients contiguous (a
    # fake gradient in a transposed captured tensor's strides made Inductor's size asserts
    # fail, or without them read the real one in the wrong order)
    return (query.new_empty(query.shape) if need_dq else query.new_empty(0),
            key.new_empty(key.shape) if need_dkdv else query.new_empty(0),
            value.new_empty(value.shape) if need_dkdv else query.new_empty(0),
            sinks.new_empty(sinks.shape) if need_dsinks else query.new_empty(0),
            [score_buffers[s].new_empty(score_buffers[s].shape) for s in grad_slots])


def _double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD_MESSAGE)


flex_attention_op.register_autograd(_backward, setup_context=_setup_context)
flex_attention_backward_op.register_autograd(_double_backward,
                                             setup_context=lambda ctx, inputs, output: None)


# ---- decoding -----------------------------------------------------------------------------

@torch.library.custom_op("flexfa::flex_decode", mutates_args=())
def flex_decode_op(query: Tensor, key: Tensor, value: Tensor, mods: str, scale: float | None,
                   score_buffers: list[Tensor], mask_buffers: list[Tensor],
                   tables: list[Tensor | None], block_size: list[int], mask_lengths: list[int],
                   kv_lens: Tensor | None, q_offsets: Tensor | None, page_table: Tensor | None,
                   sinks: Tensor | None, validate: bool) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, L, Ev] in the query's dimension order, lse [B, Hq, L] float32) of
    ``flex_decode`` with the registered mods; ``mask_lengths`` are the block mask's own
    (positions x cache length). Inference only: no autograd formula."""
    check_unchanged(mods)
    entry = mods_entry(mods)
    score = entry.score.with_buffers(score_buffers) if entry.score else None
    block_mask = _block_mask(mods, entry, mask_buffers, tables, block_size, tuple(mask_lengths))
    return decode_call(query, key, value, None, block_mask, scale, kv_lens, q_offsets,
                       page_table, True, entry.options, None, validate, sinks,
                       traced_score=score)


@flex_decode_op.register_fake
def _(query, key, value, mods, scale, score_buffers, mask_buffers, tables, block_size,
      mask_lengths, kv_lens, q_offsets, page_table, sinks, validate):
    B, Hq, L, _ = query.shape
    return output_like(query, value.shape[-1]), query.new_empty(B, Hq, L, dtype=torch.float32)


# ---- FLOP counts (torch.utils.flop_counter.FlopCounterMode): as eager calls count them, and
# as torch counts its flex_attention operators (flexfa.flops)

@register_flop_formula(torch.ops.flexfa.flex_attention, get_raw=True)
def _forward_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    B, Hq, L, E = query.shape
    return attention_flops(B * Hq, L * key.shape[2], E, value.shape[3], backward=False)


@register_flop_formula(torch.ops.flexfa.flex_attention_backward, get_raw=True)
def _backward_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    B, Hq, L, E = query.shape
    return attention_flops(B * Hq, L * key.shape[2], E, value.shape[3], backward=True)


@register_flop_formula(torch.ops.flexfa.flex_decode, get_raw=True)
def _decode_flops(query, key, value, mods, scale, score_buffers, mask_buffers, tables,
                  block_size, mask_lengths, kv_lens, q_offsets, page_table, *args, out_val=None,
                  **kwargs) -> int:
    B, Hq, L, E = query.shape
    S = key.shape[2] if page_table is None else page_table.shape[1] * key.shape[1]
    return attention_flops(B * Hq, L * S, E, value.shape[-1], backward=False)


# ---- block masks --------------------------------------------------------------------------

@torch.library.custom_op("flexfa::block_mask_tables", mutates_args=())
def block_mask_tables_op(mods: str, B: int, H: int, Q_LEN: int, KV_LEN: int,
                         block_size: list[int], separate_full_blocks: bool,
                         mask_buffers: list[Tensor], device: torch.device) -> list[Tensor]:
    """The tables of ``create_block_mask`` (kv, full kv, q, full q; without the full ones when
    ``separate_full_blocks`` is False) of the registered mask_mod reading ``mask_buffers``."""
    check_unchanged(mods)
    traced = mods_entry(mods).mask.with_buffers(mask_buffers)
    mask = create_block_mask(traced, B, H, Q_LEN, KV_LEN, device=device,
                             BLOCK_SIZE=tuple(block_size),
                             separate_full_blocks=separate_full_blocks)
    tables = [t for t in (getattr(mask, n) for n in TABLES) if t is not None]
    # create_block_mask may cut several tables from one allocation; an operator's outputs
    # must not alias each other, so those after the first of a storage are copies
    seen = set()
    for i, table in enumerate(tables):
        storage = table.untyped_storage().data_ptr()
        if storage in seen:
            tables[i] = table.clone()
        seen.add(storage)
    return tables


@block_mask_tables_op.register_fake
def _(mods, B, H, Q_LEN, KV_LEN, block_size, separate_full_blocks, mask_buffers, device):
    q_tiles, kv_tiles = -(-Q_LEN // block_size[0]), -(-KV_LEN // block_size[1])
    shapes = [(B, H, q_tiles), (B, H, q_tiles, kv_tiles), (B, H, kv_tiles),
              (B, H, kv_tiles, q_tiles)]
    pairs = (0, 1, 0, 1, 2, 3, 2, 3) if separate_full_blocks else (0, 1, 2, 3)
    return [torch.empty(shapes[p], dtype=torch.int32, device=device) for p in pairs]
