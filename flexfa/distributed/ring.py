"""Ring attention: context-parallel flex_attention over a process group.

Each rank holds one shard of the sequence (``sharding``); the K/V shards travel around the
ring, one step per rank, while each step's attention runs (``comm``); the partial results are
merged by their lse (``merge``). Steps whose (q shard, kv shard) pairs are all masked are
skipped (``steps``). The backward passes K/V around the ring again with the dK/dV
accumulators travelling alongside, recomputing each step's forward with autograd (flexfa's
lse is differentiable), so no per-step activation is kept between forward and backward.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..api import flex_attention
from ..autograd import check_versions, not_differentiable, outside_dynamo
from ..blockmask.checks import block_size_pair
from ..errors import InputError, InputTypeError, check_bool, dims
from ..features import check_sinks
from ..frontend import MASK_MOD, trace
from ..frontend.grad import check_mask_mod_grad
from ..inputs import (autocast_inputs, check_scale, check_shapes, check_tensors, dual_level_open,
                      refuse_tangents, refuse_transforms)
from ..runtime.backward import sinks_grad
from ..runtime.indices import check_captured_indices
from ..runtime.options import parse_kernel_options
from .comm import Ring
from .exchange import EXCHANGES
from .group import choose_method, resolve_group
from .merge import fold_sinks, merge_into, weight
from .sharding import positions
from .steps import RingMods


def ring_attention(query, key, value, score_mod=None, mask_mod=None, group=None,
                   load_balance=True, scale=None, kernel_options=None, *, block_size=128,
                   return_lse=False, method="auto", mesh_dim=None, enable_gqa=False,
                   sinks=None):
    """Attention over a sequence sharded across ``group`` (default: the world group).

    ``query`` ``[B, Hq, S_local, E]`` / ``key`` / ``value`` ``[B, Hkv, S_local, E]`` are this
    rank's shards, laid out by ``shard_sequence(x, rank, world, load_balance)``; Hkv < Hq
    (grouped-query attention, Hq a multiple of Hkv) needs ``enable_gqa=True``, and the K/V
    that travel then have Hkv heads. ``score_mod`` and ``mask_mod`` are
    the mods of the whole sequence: they see global positions. Returns this rank's shard of
    the output (and of the lse with ``return_lse``), differentiable in q, k, v and tensors
    the score_mod captures (their gradients are summed over the group). ``block_size`` is
    the block mask's, built per ring step from ``mask_mod``. ``group`` may be a DeviceMesh
    (1-D, or with ``mesh_dim``); ``method`` picks the K/V exchange: ``"ring"``,
    ``"allgather"`` or ``"auto"`` (by shard size, ``group.ALLGATHER_MAX_BYTES``).
    ``sinks``: ``[Hq]`` attention-sink logits as flex_attention takes them (docs/sinks.md),
    the same on every rank, folded into each row once its steps are merged; their gradient
    is summed over the group.
    """
    refuse_transforms("ring_attention")
    return_lse = check_bool("ring_attention: return_lse", return_lse)
    _check_mods(score_mod, mask_mod)
    # under torch.autocast, as flex_attention (torch's rule): out comes in the autocast dtype,
    # and the backward's recompute (which runs outside the autocast) sees the forward's inputs
    query, key, value = autocast_inputs(query, key, value)
    checked_scale, block_pair, sinks = _check_shards(query, key, value, load_balance,
                                                     enable_gqa, scale, kernel_options,
                                                     block_size, sinks)
    group = resolve_group(group, mesh_dim)
    method = choose_method(method, key, value)
    ring = Ring(group)
    device = query.device
    batch, heads, length = query.shape[0], query.shape[1], query.shape[2]
    q_pos = positions(ring.rank, ring.world, length, load_balance, device)
    mods = RingMods(score_mod, mask_mod, q_pos, key.shape[2], batch, heads, block_size)
    kv_pos = [positions(source, ring.world, key.shape[2], load_balance, device)
              for source in range(ring.world)]
    # with the tensors the trace removed (read in a branch it proved dead): their gradient is
    # zeros, as flex_attention gives them (None would make an optimizer skip them)
    traced = None if score_mod is None else trace(mods.score_mod)
    if dual_level_open():
        refuse_tangents("ring_attention", (("query", query), ("key", key), ("value", value),
                                           ("sinks", sinks),
                                           *(("score_mod's captured tensor", t) for t in (
                                               traced.buffers if traced else ()))))
    learned = () if traced is None else tuple(
        t for t in (*traced.buffers, *traced.dropped) if t.requires_grad)
    plan = _Plan(ring, mods, kv_pos, scale, kernel_options, method, enable_gqa)
    plan.watched, plan.traces = _captured(score_mod, mask_mod)
    if sinks is not None:
        plan.watched.append(("sinks", sinks, sinks.clone() if sinks.is_inference() else None))
    index_error = _global_index_error(plan.traces, query, key, ring.world)
    learnable = () if traced is None else tuple(
        bool(t.requires_grad) for t in (*traced.buffers, *traced.dropped))
    facts = _call_facts(query, key, value, plan.traces, load_balance, method, block_pair,
                        checked_scale, block_size, scale, enable_gqa, sinks, learnable)
    facts.append(("the captured tensors' indices", int(index_error is None),
                  "in range" if index_error is None else "out of range"))
    try:
        _check_agreement(ring, device, facts,
                         _values(plan.traces, sinks, device) if ring.world > 1 else [])
    except InputError:  # (this rank's own error says more than the disagreement)
        if index_error is not None:
            raise index_error from None
        raise
    if index_error is not None:  # (every rank raises it: no rank waits in a collective)
        raise index_error
    out, lse = _RingAttention.apply(plan, query, key, value, sinks, *learned)
    return (out, lse) if return_lse else out


def _call_facts(query, key, value, traces, load_balance, method: str, block_pair: tuple,
                checked_scale: float, block_size, scale, enable_gqa, sinks,
                learnable: tuple = ()) -> list:
    """(name, int64 code, value shown) of what every rank's call must agree on: shard
    shapes and dtype, the mods (their traces' structural keys: code and Python values read),
    the layout, the exchange, the block size and the scale (compared as ``_check_shards``
    resolved them: ``block_pair``, ``checked_scale``; shown as given), and which of the
    score_mod's captured tensors require grad (``learnable``: the backward all-reduces each
    one's gradient, so a rank with one more paired its all_reduce with another rank's next
    collective: a wrong gradient there, another all_reduce's result corrupted)."""
    keys = {what: traced.key for what, _, _, traced in traces}

    def code(text: str) -> int:  # (the same in every process, unlike hash())
        return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
    facts = [("query shape", code(repr(tuple(query.shape))), tuple(query.shape)),
             ("key shape", code(repr(tuple(key.shape))), tuple(key.shape)),
             ("value shape", code(repr(tuple(value.shape))), tuple(value.shape)),
             ("dtype", code(str(query.dtype)), query.dtype)]
    for what in ("score_mod", "mask_mod"):
        found = keys.get(what)
        facts.append((what, code(found or "None"),
                      "None" if found is None else f"a trace of key {found[:12]}"))
    facts += [("load_balance", int(bool(load_balance)), bool(load_balance)),
              ("method", code(method), method),
              ("block_size", code(repr(block_pair)), block_size),
              ("scale", code(repr(checked_scale)), scale),
              ("enable_gqa", int(bool(enable_gqa)), bool(enable_gqa)),
              ("which score_mod captured tensors require grad", code(repr(learnable)),
               learnable)]
    # (their values: _values)
    shown = None if sinks is None else (
        f"[{sinks.shape[0]}] {sinks.dtype}, requires_grad={sinks.requires_grad}")
    facts.append(("sinks", code(repr(shown)), shown))
    return facts


def _values(traces, sinks, device: torch.device) -> list:
    """[(name, int64 tensor, shown)] for ``_check_agreement``: digests of the values of the
    mods' captured tensors (``_captured``'s traces) and of the sinks, each of a fixed size
    whatever the ranks hold (ranks that disagree on the mods or on having sinks must still
    all_gather as many elements), made on the device (no sync). The mods see global
    positions, so their captured tensors (document ids, a bias over the whole sequence)
    describe the whole sequence and must be the same on every rank: where one rank's
    differed it computed another mask or bias than the others, silently (the sinks alike,
    and their gradient is summed over the group)."""
    captured = [t for _, _, _, traced in traces for t in traced.buffers]
    return [("the captured tensors' values", _digest(captured, device),
             f"{len(captured)} tensor(s)"),
            ("sinks' values", _digest([] if sinks is None else [sinks], device),
             None if sinks is None else (sinks.detach().tolist() if sinks.device.type == "cpu"
                                         else "on the device"))]


_GOLDEN = 0x9E3779B97F4A7C15 - 2 ** 64  # (an odd int64 multiplier)


def _digest(tensors, device: torch.device) -> torch.Tensor:
    """Two int64 words that differ where the tensors' values (their bits: floats through
    float64, integers and bools as int64) or their order do, computed on ``device`` (products
    and sums wrap in int64; odd multipliers that differ per position and per tensor keep
    positions apart); zeros for no tensors."""
    digest = torch.zeros(2, dtype=torch.int64, device=device)
    for index, tensor in enumerate(tensors):
        tensor = tensor.detach().to(device)
        words = (tensor.double().reshape(-1).view(torch.int64) if tensor.is_floating_point()
                 else tensor.reshape(-1).long())
        position = torch.arange(words.numel(), dtype=torch.int64, device=device)
        digest += (2 * index + 1) * torch.stack([
            (words * (2 * position + 1)).sum(),
            ((words ^ (words >> 29)) * (_GOLDEN + 2 * position)).sum()])
    return digest


def _check_sinks(sinks, query):
    """``sinks`` checked as flex_attention checks them (``check_sinks``), before any
    communication; its errors name ring_attention."""
    try:
        return check_sinks(sinks, query.shape[1], query.dtype, query.device)
    except (InputError, InputTypeError) as error:
        raise type(error)(f"ring_attention: {error}") from None


def _global_index_error(traces, query, key, world: int) -> InputError | None:
    """The InputError of a captured tensor read out of range at the global positions the
    user's mods see (q_idx < world * L, kv_idx < world * S), else None. Checked once before
    any K/V transfer, as flex_attention checks its domain; the error is returned, not raised,
    so that every rank learns of it in the agreement check (a captured tensor's values may
    differ between ranks) and none waits in a collective for a rank that raised."""
    mods = {what: traced for what, _, _, traced in traces}
    B, Hq, L, E = query.shape
    try:
        check_captured_indices(mods.get("score_mod"), mods.get("mask_mod"),
                               (B, Hq, world * L, E), world * key.shape[2], query.device)
    except InputError as error:
        return InputError(f"ring_attention: {error} (the mods see global positions: the "
                          f"sequence of {world} ranks' shards, {world * L} queries and "
                          f"{world * key.shape[2]} keys)")
    return None


def _check_agreement(ring: Ring, device: torch.device, facts: list,
                     values: list = ()) -> None:
    """An InputError (a device-side assert on a GPU, which a host comparison would have to
    sync for) where the group's ranks called ring_attention with different ``facts``: each
    rank computes with its own mods and layout, so ranks that disagree on the mask_mod or
    load_balance gave wrong results silently, and on the exchange or the shard lengths hung
    or aborted inside the collectives. ``values``: (name, int64 tensor on ``device``, shown)
    compared element by element too, each of one size on every rank. One small all_gather,
    before any K/V transfer."""
    if ring.world == 1:
        return
    mine = torch.cat([torch.tensor([value for _, value, _ in facts], dtype=torch.int64,
                                   device=device), *(t.to(device) for _, t, _ in values)])
    # (each element's fact: the values' name and shown value for each of their elements)
    named = [(name, shown) for name, _, shown in facts] + [
        (name, shown) for name, t, shown in values for _ in range(t.numel())]
    gathered = [torch.empty_like(mine) for _ in range(ring.world)]
    dist.all_gather(gathered, mine, group=ring.group)
    if device.type != "cpu":
        torch._assert_async(torch.stack(gathered).eq(mine).all(),
                            "flexfa ring_attention: the ranks of the group called it with "
                            "different shard shapes, dtypes, mods, load_balance, method, "
                            "block_size, scale, enable_gqa or sinks")
        return
    for rank, theirs in enumerate(torch.stack(gathered).tolist()):
        for (name, shown), value, other in zip(named, mine.tolist(), theirs):
            if other != value:
                raise InputError(
                    f"ring_attention: rank {ring.rank} and rank {rank} of the group disagree "
                    f"on {name} (this rank's: {shown}); every rank must call it with the "
                    "same mods, load_balance, method, block_size, scale, sinks and shard "
                    "shapes (each rank computes with its own: a mismatch gives wrong results "
                    "or hangs)")


def _captured(score_mod, mask_mod) -> tuple[list, list]:
    """(what, tensor) of the captured tensors of the user's mods, and (what, mod, kind, trace)
    of the mods: the backward recomputes each step with the mods as they are then, so it
    checks that none of those tensors was edited in place (``_check_unedited``) and that each
    mod still traces to the same code reading the same tensors (``_check_same_mods``)."""
    named, traces = [], []
    for what, mod, kind in (("score_mod", score_mod, None), ("mask_mod", mask_mod, MASK_MOD)):
        if mod is not None:
            traced = trace(mod) if kind is None else trace(mod, kind)
            # (an inference tensor has no version counter: a copy is compared instead)
            named += [(f"a tensor the {what} captures", t, t.clone() if t.is_inference()
                       else None) for t in traced.buffers]
            traces.append((what, mod, kind, traced))
    return named, traces


def _check_same_mods(traces) -> None:
    """An InputError where a mod of ``traces`` (``_captured``'s) traces otherwise than in the
    forward or reads other tensors: a Python value it reads changed (a schedule in a dict or
    attribute, ``self.window``) or a captured name was rebound to another tensor. The
    recomputed steps would give another forward's gradients (silently: 5 to 4.5e4 apart in
    an audit's probe), where flex_attention's backward keeps the forward's mods."""
    for what, mod, kind, before in traces:
        now = trace(mod) if kind is None else trace(mod, kind)
        if now.key != before.key or len(now.buffers) != len(before.buffers) or any(
                a is not b for a, b in zip(now.buffers, before.buffers)):
            raise InputError(
                f"ring_attention: the {what} changed between the forward and the backward (a "
                "Python value it reads, or a tensor it captures rebound to another); the "
                "backward recomputes the ring's steps with the mods as they are then, which "
                "would give another forward's gradients. Change the mods' state only after "
                "backward()")


def _check_unedited(watched, copies) -> None:
    """An InputError where one of the ``(what, tensor, version)`` of ``watched`` was edited in
    place since the forward, or one of the ``(what, tensor, copy)`` of ``copies`` (inference
    tensors: no version counter) differs from its copy: the recomputed steps would give the
    gradients of another forward (silently: 5-523 apart in a probe), where flex_attention's
    backward raises."""
    check_versions(watched, "ring_attention: ", "the forward and the backward, which "
                   "recomputes the ring's steps with it")
    for what, tensor, copy in copies:
        if not torch.equal(tensor, copy):
            raise InputError(f"ring_attention: {what} (an inference tensor, shape "
                             f"{dims(tensor)}) was edited between the forward and "
                             "the backward, which recomputes the ring's steps with it; the "
                             "gradients would be those of another forward: edit it after "
                             "the backward")


def _check_mods(score_mod, mask_mod) -> None:
    """Checked on every rank before any communication, as flex_attention checks them: a
    mask_mod reading a tensor that requires grad (with grad enabled) would otherwise give it
    no gradient."""
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is not None and not callable(mod):
            raise InputTypeError(f"ring_attention: {name} must be callable or None, got "
                                 f"{type(mod).__name__}")
    if mask_mod is not None and torch.is_grad_enabled():
        check_mask_mod_grad(trace(mask_mod, MASK_MOD))


def _check_shards(query, key, value, load_balance, enable_gqa, scale, kernel_options,
                  block_size, sinks) -> tuple:
    """Raise what a step would raise, before any communication; else (the scale as a float,
    the block size as a pair, the sinks as ``check_sinks`` gives them)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"ring_attention: {name} must be a tensor, got "
                                 f"{type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"ring_attention: {name} must be [B, H, S_local, E], got shape "
                             f"{dims(t)}")
    if query.shape[2] != key.shape[2] or key.shape[2] != value.shape[2]:
        raise InputError(f"ring_attention: query, key and value shards must have one length; "
                         f"got {query.shape[2]}, {key.shape[2]}, {value.shape[2]}")
    # (numpy's bools too, as shard_sequence and positions take them)
    check_bool("ring_attention: load_balance", load_balance)
    _check_heads(query.shape[1], key.shape[1], value.shape[1], enable_gqa)
    # what each step's flex_attention would refuse (dtypes, devices, batch, head dims, scale,
    # kernel_options), refused before the first K/V transfer is posted
    check_tensors(query, key, value)
    check_shapes(query, key, value, enable_gqa)
    checked_scale = check_scale(scale, query.shape[3])
    parse_kernel_options(kernel_options)
    # (the steps' create_block_mask refused it only after the first K/V transfer was posted)
    block_pair = block_size_pair("ring_attention", block_size, "block_size")
    if load_balance and query.shape[2] % 2:
        raise InputError(f"ring_attention: with load_balance=True a shard holds two equal "
                         f"chunks; its length {query.shape[2]} is odd")
    sinks = _check_sinks(sinks, query)
    if not dist.is_initialized():
        raise InputError("ring_attention: torch.distributed is not initialized "
                         "(call torch.distributed.init_process_group first)")
    return checked_scale, block_pair, sinks


def _check_heads(q_heads: int, k_heads: int, v_heads: int, enable_gqa) -> None:
    """Head counts are checked here, before any communication: a rank that failed inside the
    first step's kernel call would leave the others waiting on its K/V transfer."""
    check_bool("ring_attention: enable_gqa", enable_gqa)
    if k_heads != v_heads:
        raise InputError(f"ring_attention: value has {v_heads} heads but key has {k_heads}")
    if k_heads == 0 or q_heads % k_heads:
        raise InputError(f"ring_attention: query has {q_heads} heads but key has {k_heads}; "
                         f"query heads must be a multiple of key heads (grouped-query "
                         f"attention)")
    if q_heads != k_heads and not enable_gqa:
        raise InputError(f"ring_attention: query has {q_heads} heads but key has {k_heads}; "
                         f"pass enable_gqa=True for grouped-query attention, or give key and "
                         f"value as many heads as query")


class _Plan:
    """What the autograd function needs besides tensors; ``steps`` records, per ring step,
    whether it ran a kernel and its block mask (kept for the backward)."""

    def __init__(self, ring: Ring, mods: RingMods, kv_pos: list, scale, kernel_options,
                 method: str, enable_gqa: bool):
        self.ring, self.mods, self.kv_pos, self.method = ring, mods, kv_pos, method
        self.scale, self.kernel_options, self.enable_gqa = scale, kernel_options, enable_gqa
        self.steps: list[tuple[bool, object]] = []
        self.watched: list = []  # (what, tensor, copy): the mods' captured tensors (_captured)
        self.traces: list = []  # (what, mod, kind, trace) of the user's mods (_captured)

    def attend(self, query, key, value, mask):
        return flex_attention(query, key, value, score_mod=self.mods.score_mod, block_mask=mask,
                              scale=self.scale, enable_gqa=self.enable_gqa, return_lse=True,
                              kernel_options=self.kernel_options)


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, plan: _Plan, query, key, value, sinks, *learned):
        ring = plan.ring
        out = query.new_zeros(*query.shape[:3], value.shape[-1], dtype=torch.float32)
        lse = query.new_full(query.shape[:3], float("-inf"), dtype=torch.float32)
        plan.steps = []
        shards = EXCHANGES[plan.method](ring).shards([key, value])
        try:
            for step, kv in enumerate(shards):
                runs, mask = plan.mods.at_step(plan.kv_pos[ring.source(step)])
                plan.steps.append((runs, mask))
                if runs:
                    merge_into(out, lse, *plan.attend(query, kv[0], kv[1], mask))
        finally:  # a step that raised: the K/V shift in flight completes (no hung group)
            shards.close()
        if sinks is not None:
            fold_sinks(out, lse, sinks)
        out = out.to(query.dtype)
        ctx.plan = plan
        ctx.watched = [(what, t, t._version) for what, t, copy in plan.watched if copy is None]
        ctx.copies = [(what, t, copy) for what, t, copy in plan.watched if copy is not None]
        # (the sinks on ctx, not saved: an inference tensor cannot be, and plan.watched
        # checks them for edits as it checks the mods' tensors)
        ctx.sinks = sinks
        ctx.save_for_backward(query, key, value, out, lse, *learned)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        # compiled autograd has Dynamo trace this backward (of an eager forward): the
        # checks, the steps' recomputation and the exchanges run outside its graph
        run = outside_dynamo(_backward) if torch.compiler.is_compiling() else _backward
        return run(ctx, ctx.saved_tensors, grad_out, grad_lse)


def _backward(ctx, saved: tuple, grad_out, grad_lse) -> tuple:
    """_RingAttention.backward's results; ``saved``: ``ctx.saved_tensors``, read once."""
    _check_unedited(ctx.watched, ctx.copies)
    _check_same_mods(ctx.plan.traces)
    if not torch.is_grad_enabled():
        return _ring_gradients(ctx.plan, saved, ctx.sinks, grad_out, grad_lse)
    # create_graph=True: the steps' gradients have no derivative (flex_attention's
    # backward kernels have none); ones that raise when differentiated, not constants
    # that would silently drop a gradient penalty's term
    with torch.no_grad():
        grads = _ring_gradients(ctx.plan, saved, ctx.sinks, grad_out, grad_lse)
    query, key, value, _, _, *learned = saved
    return (None, *not_differentiable(grads[1:], (query, key, value, ctx.sinks, *learned)))


def _ring_gradients(plan: _Plan, saved: tuple, sinks, grad_out, grad_lse) -> tuple:
    """_RingAttention's gradients: (None for the plan, dq, dk, dv, d_sinks, *d_learned)."""
    ring = plan.ring
    query, key, value, out, lse, *learned = saved
    grad_out = grad_out.float()
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.float()
    # d out / d lse_i = w_i (out_i - out): the part through out is the row dot below
    row_dot = (grad_out * out.float()).sum(-1)
    dq = torch.zeros_like(query, dtype=torch.float32)
    d_learned = [torch.zeros_like(t, dtype=torch.float32) for t in learned]
    exchange = EXCHANGES[plan.method](ring)
    shards = exchange.shards([key, value])
    try:
        for step, kv in enumerate(shards):
            runs, mask = plan.steps[step]
            dkv = [torch.zeros_like(t, dtype=torch.float32) for t in kv]
            if runs:
                plan.mods.kv_pos.copy_(plan.kv_pos[ring.source(step)])
                grads = _step_grads(plan, query, kv, mask, learned, lse, grad_out, grad_lse,
                                    row_dot)
                dq += grads[0]
                for acc, g in zip(dkv + d_learned, grads[1:]):
                    if g is not None:
                        acc += g
            exchange.add_grads(step, dkv)
    except BaseException:  # a step that raised: the shifts in flight complete
        shards.close()
        exchange.close()
        raise
    dk, dv = exchange.grads()  # this rank's own shard's, summed over the group
    d_sinks = None
    if sinks is not None and sinks.requires_grad:
        # the sink is a merged part whose out is 0; lse is the one it was folded into (summed
        # over the group in float32, rounded to the sinks' dtype once)
        d_sinks = sinks_grad(sinks.detach().float(), lse, row_dot - grad_lse)
    for g in (*d_learned, *(() if d_sinks is None else (d_sinks,))):
        dist.all_reduce(g, group=ring.group)
    return (None, dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype),
            None if d_sinks is None else d_sinks.to(sinks.dtype),
            *(g.to(t.dtype) for g, t in zip(d_learned, learned)))


def _step_grads(plan: _Plan, query, kv, mask, learned, lse, grad_out, grad_lse, row_dot):
    """Gradients of one step's share of the merged output: (dq, dk, dv, *d_learned)."""
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, *kv))
        out_part, lse_part = plan.attend(q, k, v, mask)
        share = weight(lse_part.detach(), lse)
        part_dot = (grad_out * out_part.detach().float()).sum(-1)
        grad_part = (share.unsqueeze(-1) * grad_out).to(out_part.dtype)
        grad_lse_part = share * (part_dot - row_dot + grad_lse)
        return torch.autograd.grad((out_part, lse_part), (q, k, v, *learned),
                                   (grad_part, grad_lse_part), allow_unused=True)
