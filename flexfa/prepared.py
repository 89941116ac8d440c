"""Prepared calls: what a repeated ``flex_attention`` call would work out again, kept per call
signature, so that a cached call costs the checks of what may have changed, and the launch.

The entry of a signature holds the outcome of the call's checks and preparation: the checked
scale, the parsed options, the traced score_mod (by weak reference: the trace memo owns it),
the block mask's prepared mask_mod, the mask the kernels run (a coarser equal one where its
blocks cannot be tiled), the state of its tables as checked, the captured tensors' layout, and
the plans the call ran (``AttentionCall.plans``). A call takes the entry only after it has
established everything the entry was derived from:

- the key: q, k and v (plain tensors) by shape, strides, dtype, device and 16-byte alignment,
  the score_mod by identity, scale, enable_gqa, return_lse and the parsed kernel_options
  (one object per distinct dict and FLEXFA_BACKEND); the memo lives under the block mask
  (``MaskedMemo``: dropped with it, never hit by a new mask that reuses an id);
- the score_mod's trace is looked up as on every call (``trace_entry``: its guard, every Python
  value the mod reads) and must be the entry's trace object;
- the block mask's tables must still be in the state the entry recorded (``still_checked``:
  the same table objects, version counters and geometry; else the full path checks their
  contents again); its prepared mask_mod (looked up under its guard, as the score_mod's) must
  be the entry's, its lengths the entry's;
- the captured tensors of both mods have the recorded shapes, strides, alignment, device and
  negative bit;
- the checks that read values on every call still run (captured tensors indexed by captured
  tensor values: ``reads_values``; a mask_mod reading tensors that require grad under
  autograd); a plan kept in the entry is used only until a memo is cleared
  (``memo.CLEARS``, ``run_forward``).

Calls with sinks, dropout, a ``return_aux`` other than torch's ``AuxRequest`` of two bools,
an enormous scale, a scale that is not a real number or is zero (the key's -0.0 equals 0.0),
tensor subclasses or tensors the kernels cannot read as they are (``inputs.readable``) take
the full path every time. Nothing here keeps a user's object alive: entries hold the
score_mod's trace weakly and live under the mask, whose own objects they hold.
"""
from __future__ import annotations

import numbers
import types
import weakref

import torch
from torch.nn.attention.flex_attention import AuxRequest  # (torch's: the fast path takes no other)

from .blockmask.validate import capturing, still_checked, table_state
from .errors import InputError, InputTypeError
from .frontend.grad import check_mask_mod_grad
from .frontend.trace import MASK_MOD, SCORE_MOD, memoized
from .inputs import broadcast_batch, readable
from .lazy import lazy_function
from .memo import MaskedMemo
from .runtime.call import AttentionCall
from .runtime.options import parse_kernel_options
from .runtime.pipeline import prepare_mask, prepare_score_mod
from .scores import CHECKED_SCALE

check_captured_indices = lazy_function("flexfa.runtime.indices", "check_captured_indices")
reads_values = lazy_function("flexfa.runtime.indices", "reads_values")

PREPARED = MaskedMemo(256, per_mask=16, name="prepared calls")


class Prepared:
    """One signature's prepared call (see the module docstring)."""

    __slots__ = ("score_ref", "options", "scale", "gqa_group", "state", "mask", "seq_lengths",
                 "runnable", "call_mask", "buffers", "reads_values", "plans")
    # runnable: the coarser mask the kernels run, None for the mask itself (an entry lives
    # under its mask and must not hold it)

    def __init__(self, score_ref, options, scale: float, gqa_group: int, state, mask,
                 seq_lengths, runnable, call_mask, buffers: tuple, reads_values: bool):
        self.score_ref, self.options, self.scale = score_ref, options, scale
        self.gqa_group, self.state, self.mask = gqa_group, state, mask
        self.seq_lengths, self.runnable, self.call_mask = seq_lengths, runnable, call_mask
        self.buffers, self.reads_values = buffers, reads_values
        self.plans: dict = {}  # (return_lse, return_max) -> plan (``run_forward`` fills it)


def signature(query, key, value, score_mod, scale, enable_gqa, return_lse, kernel_options,
              return_aux, sinks, dropout_p, dropout_seed) -> tuple | None:
    """(the memo key of a call, its parsed kernel_options), or None for a call that always
    takes the full path."""
    if (not type(query) is type(key) is type(value) is torch.Tensor
            or not readable(query, key, value)  # (checked on the full path)
            or sinks is not None or dropout_seed is not None
            or type(dropout_p) not in (float, int) or dropout_p != 0
            or type(enable_gqa) is not bool or type(return_lse) is not bool
            or (kernel_options is not None and type(kernel_options) is not dict)
            or (score_mod is not None and not callable(score_mod))):
        return None
    aux = (False, False) if return_aux is None else aux_request(return_aux, return_lse)
    if aux is None:
        return None
    if scale is not None and type(scale) is not float:
        # an int or a NumPy number: keyed as the float the call runs with (check_scale's)
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            return None
        try:
            scale = float(scale)
        except OverflowError:  # an int past float's range: the full path refuses it
            return None
    try:  # memoized: equal dicts give one object (FLEXFA_BACKEND, the default, included)
        options = parse_kernel_options(kernel_options)
    except (InputError, InputTypeError):  # the full path raises it after its earlier checks
        return None
    if score_mod is None:
        mod = None
    elif type(score_mod) is types.MethodType:  # a fresh object per attribute read
        mod = (id(score_mod.__self__), id(score_mod.__func__))
    else:
        mod = id(score_mod)
    return (query.shape, key.shape, value.shape, query.stride(), key.stride(), value.stride(),
            query.dtype, key.dtype, value.dtype, query.device, key.device, value.device,
            query.data_ptr() % 16, key.data_ptr() % 16, value.data_ptr() % 16, mod, scale,
            enable_gqa, return_lse, aux, id(options)), options


def aux_request(return_aux, return_lse) -> tuple | None:
    """(lse, max_scores) of a ``return_aux`` (not None) a repeated call may take as it is:
    torch's own ``AuxRequest`` of two bools beside ``return_lse=False``; else None (the full
    path checks it, or refuses it)."""
    if type(return_aux) is not AuxRequest or return_lse is not False:
        return None
    lse, max_scores = return_aux
    return (lse, max_scores) if type(lse) is bool and type(max_scores) is bool else None


def buffer_layout(score, mask) -> tuple:
    """Shape, strides, alignment, device and negative bit of the captured tensors of both mods
    (``t.data = z.conj().imag`` sets the bit keeping all else: the full path refuses it)."""
    return tuple((t.shape, t.stride(), t.data_ptr() % 16, t.device, t.is_neg())
                 for traced in (score, mask) if traced is not None for t in traced.buffers)


def lookup(signature_, query, key, value, score_mod, block_mask) -> tuple:
    """((AttentionCall, key, value) of a call whose signature's entry still holds (see the
    module docstring) or None, the score_mod's trace if this looked it up, else None: the
    full path takes it instead of tracing again). Raises as the full path would where a
    check fails."""
    signature_, options = signature_
    entry = (PREPARED.dense.get(signature_) if block_mask is None  # (MaskedMemo.get, inline)
             else PREPARED.masked.get(block_mask, signature_))
    if entry is None or entry.options is not options:  # (an entry holds its options)
        return None, None
    if block_mask is not None and not still_checked(block_mask, entry.state, query.shape[2],
                                                    key.shape[2]):
        return None, None  # the full path checks the tables again
    score = None
    if score_mod is not None:
        score = prepare_score_mod(score_mod)
        if score is not entry.score_ref():
            return None, score
    if block_mask is not None:
        if prepare_mask(block_mask) is not entry.mask or \
                getattr(block_mask, "seq_lengths", None) != entry.seq_lengths:
            return None, score
    call_mask = entry.call_mask
    if entry.buffers:
        if buffer_layout(score, call_mask) != entry.buffers:
            return None, score
        if entry.reads_values:
            check_captured_indices(score, call_mask, query.shape, key.shape[2], query.device)
    if call_mask is not None and call_mask.buffers and torch.is_grad_enabled():
        check_mask_mod_grad(call_mask)
    key, value = broadcast_batch(query, key, value)
    if entry.runnable is not None and capturing():  # coarsened again inside the capture
        return None, score
    runnable = block_mask if entry.runnable is None else entry.runnable
    call = AttentionCall(score, call_mask, runnable, entry.scale, options, entry.gqa_group)
    call.plans = entry.plans
    return (call, key, value), score


def record(signature_, query, key, score_mod, block_mask, call: AttentionCall) -> None:
    """Keep the entry of a call that took the full path (``call``: its AttentionCall) and
    give the call its plan memo. Not for mods traced on every call (their state cannot be
    guarded): a lookup would trace them twice."""
    # (a zero scale: -0.0 == 0.0 in the key, but a score_mod may tell them apart: 1 / score)
    if signature_ is None or abs(call.scale) > CHECKED_SCALE or call.scale == 0.0 \
            or call.sinks is not None or call.dropout is not None \
            or call.options is not signature_[1]:
        return
    if capturing():  # what a capture computes exists only once the graph replays
        return
    if call.score is not None and memoized(score_mod, SCORE_MOD) is not call.score:
        return
    state = mask = None
    if block_mask is not None:
        state, mask = table_state(block_mask), prepare_mask(block_mask)
        if state is None:  # tables checked on every call: nothing to key the entry on
            return
        if getattr(block_mask, "traced_mask", None) is None and \
                memoized(block_mask.mask_mod, MASK_MOD) is not mask:
            return
    try:
        score_ref = weakref.ref(call.score) if call.score is not None else _none
    except TypeError:
        return
    entry = Prepared(score_ref, call.options, call.scale, call.gqa_group, state, mask,
                     getattr(block_mask, "seq_lengths", None),
                     None if call.block_mask is block_mask else call.block_mask, call.mask,
                     buffer_layout(call.score, call.mask),
                     reads_values(call.score, call.mask, query.shape, key.shape[2]))
    PREPARED.put(block_mask, signature_[0], entry)
    call.plans = entry.plans


def _none():
    return None
