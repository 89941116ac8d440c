"""Running the forward kernel: a spec from the inputs, the kernel from the cache, one launch.

``run_forward(q, k, v, call, return_lse)`` assumes validated inputs (``flexfa.api`` checks
them). Per-signature work (spec, key, module) is memoized, so a cached call costs a dict
lookup plus the launch.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import traceback
import weakref

import torch

from ..blockmask.validate import table_generations
from ..codegen.forward import GeneratedKernel, forward_kernel
from ..codegen.ranges import Domain, mods_int64_nodes
from ..codegen.spec import DTYPE_NAMES, INTERPRET, KernelSpec, next_power_of_two
from ..errors import CodegenError, FlexFAError, InputError
from ..frontend.trace import TracedMod
from ..memo import BoundedMemo
from .cache import get_module
from .launch import cdiv, direct_state, launch_direct
from .options import KernelOptions


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionCall:
    """A flex_attention call apart from q, k, v: what the forward and backward need."""

    score: TracedMod | None  # prepared (traced, simplified) score_mod
    mask: TracedMod | None  # prepared mask_mod of the block mask
    block_mask: object | None  # flexfa or torch BlockMask (None: dense)
    scale: float
    options: KernelOptions
    gqa_group: int  # query heads per kv head

    @property
    def scores_first(self) -> bool:
        """HAS_SCORE_MOD of the forward kernels: score = q.k * scale is formed before the
        softmax. Without a score_mod the kernels fold the scale into the softmax's FMA and take
        the row max of the raw q.k, which needs scale > 0."""
        return self.score is not None or self.scale <= 0


@functools.cache
def _cuda_target(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"cuda:{major * 10 + minor}"


def target_of(device: torch.device) -> str:
    """``"interpret"`` for CPU tensors, ``"cuda:<capability>"`` for CUDA tensors."""
    if device.type == "cpu":
        return INTERPRET
    return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())


def _largest_tile(block: int) -> int:
    """The largest power of two (<= 128) dividing a block-mask block size."""
    tile = 128
    while tile > 1 and block % tile:
        tile //= 2
    return tile


def default_tiles(head_dim_pad: int, dtype: torch.dtype, target: str) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the Ampere-class template."""
    if target == INTERPRET:
        return 64, 64, 4, 1  # big tiles: the interpreter's cost is per tile, not per element
    # chosen so that ptxas reports no spills on sm_80 (python -m flexfa compile-check)
    if head_dim_pad <= 64:
        tiles = (128, 32, 4, 3)
    elif head_dim_pad <= 128:
        tiles = (128, 64, 8, 3)
    else:
        tiles = (64, 32, 8, 2)
    if dtype == torch.float32:  # twice the bytes per element: halve the kv tile
        tiles = (tiles[0], max(16, tiles[1] // 2), tiles[2], 2)
    return tiles


def choose_tiles(call: AttentionCall, head_dim_pad: int, dtype, target: str):
    """Tiles from kernel_options or defaults, fitted to the block mask's block sizes."""
    block_m, block_n, warps, stages = default_tiles(head_dim_pad, dtype, target)
    options = call.options
    if call.block_mask is None:
        sparse_q = sparse_kv = None
    else:
        sparse_q, sparse_kv = (int(b) for b in call.block_mask.BLOCK_SIZE)
        block_m = min(block_m, _largest_tile(sparse_q))
        block_n = min(block_n, _largest_tile(sparse_kv))
    block_m = options.block_m or block_m
    block_n = options.block_n or block_n
    if sparse_q is not None:
        for key, tile, block in (("BLOCK_M", block_m, sparse_q), ("BLOCK_N", block_n, sparse_kv)):
            if tile < 16 or block % tile:
                raise InputError(
                    f"block_mask has BLOCK_SIZE {call.block_mask.BLOCK_SIZE}; kernel tile {key}="
                    f"{tile} must divide {block} and be >= 16 (build the mask with a "
                    "BLOCK_SIZE that is a multiple of 16, or pass a smaller kernel_options "
                    f"{key!r})")
    else:
        sparse_q, sparse_kv = block_m, block_n
    return (block_m, block_n, options.num_warps or warps, options.num_stages or stages,
            sparse_q, sparse_kv)


def forward_spec(q, k, v, call: AttentionCall, return_lse: bool,
                 return_max: bool = False, split_keys: int = 0) -> KernelSpec:
    """The KernelSpec of the forward kernel for these (validated) inputs; ``split_keys`` > 0:
    split-KV decoding (``split_keys``), which always writes lse."""
    L, E = q.shape[2], q.shape[3]
    S, Ev = k.shape[2], v.shape[3]
    target = target_of(q.device)
    block_m, block_n, warps, stages, sparse_q, sparse_kv = choose_tiles(
        call, next_power_of_two(E), q.dtype, target)
    mask = call.block_mask
    return KernelSpec(
        dtype=DTYPE_NAMES[q.dtype], head_dim=E, head_dim_v=Ev, block_m=block_m, block_n=block_n,
        num_warps=warps, num_stages=stages, has_block_mask=mask is not None,
        has_full_blocks=mask is not None and getattr(mask, "full_kv_num_blocks", None) is not None,
        sparse_q=sparse_q, sparse_kv=sparse_kv, even_l=L % block_m == 0, even_s=S % block_n == 0,
        return_lse=return_lse, gqa_group=call.gqa_group,
        input_precision=call.options.fp32_precision, target=target,
        max_registers=call.options.max_registers or 0, return_max=return_max,
        split_keys=split_keys, wide_ints=call_int64_nodes(q, k, call))


def call_int64_nodes(q, k, call: AttentionCall) -> tuple[str, ...]:
    """The ``wide_ints`` of a forward spec: the mods' INT nodes that need int64 over this
    call's indices (b < B, h < Hq, q_idx < L, kv_idx < S)."""
    return mods_int64_nodes((call.score, call.mask),
                            Domain(q.shape[0], q.shape[1], q.shape[2], k.shape[2]))


_KERNELS = BoundedMemo(1024, "forward kernels")


def generated_kernel(memo: dict, generate, spec: KernelSpec, score: TracedMod | None,
                     mask: TracedMod | None):
    """The launchable kernel (a Triton JITFunction or InterpretedFunction) that
    ``generate(spec, score, mask)`` renders, through the cache, memoized in ``memo``."""
    memo_key = (spec, score.key if score else None, mask.key if mask else None)
    kernel = memo.get(memo_key)
    if kernel is None:
        generated = generate(spec, score, mask)
        module = load_generated(generated, spec.interpret)
        kernel = memo[memo_key] = getattr(module, generated.name)
    return kernel


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


def get_forward_kernel(spec: KernelSpec, score: TracedMod | None, mask: TracedMod | None):
    """The launchable Ampere-class forward kernel."""
    return generated_kernel(_KERNELS, forward_kernel, spec, score, mask)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """Everything per call signature: the spec, the kernel and its keyword arguments, and the
    compiled kernels of its CUDA launches for direct launches (``run_forward``)."""

    spec: KernelSpec
    kernel: object
    kwargs: dict  # constexprs and launch options
    block_m: int
    constexprs: dict = dataclasses.field(default_factory=dict)
    # call_plan_key, q/k/v 16-byte alignment, id of the block mask -> (weak reference to the
    # block mask or None, DirectState)
    direct: dict = dataclasses.field(default_factory=dict)


_LAUNCHES = BoundedMemo(1024, "forward launches")
_MAX_DIRECT = 64  # direct launches kept per Ampere launch signature
MIN_SPLIT_KEYS = 512  # split-KV decoding: the fewest keys a split walks


def call_plan_key(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool,
                   template: str) -> tuple:
    """The part of a plan's key that the call's mods, mask and options do not fix (the Hopper
    plans, the Ampere template's direct launches): shapes, strides, dtype, device, lse and row
    max, template setting, captured-tensor layout."""
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device,
           return_lse, return_max, template)
    for mod in (call.score, call.mask):
        if mod is not None and mod.buffers:
            key += tuple((t.stride(), t.data_ptr() % 16 == 0) for t in mod.buffers)
    return key


def _launch_for(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool,
                split: int = 0) -> _Launch:
    """The memoized launch for this call signature (a dict lookup once it exists); ``split``:
    the keys per split of split-KV decoding (0: none)."""
    mask = call.block_mask
    # B and Hq: the index domain decides which integer math needs int64 (spec.wide_ints)
    signature = (q.device, q.dtype, *q.shape, k.shape[2], v.shape[3], return_lse,
                 return_max, split,
                 call.gqa_group, call.options, call.score.key if call.score else None,
                 call.mask.key if call.mask else None, call.scores_first,
                 None if mask is None else (tuple(mask.BLOCK_SIZE),
                                            getattr(mask, "full_kv_num_blocks", None) is None))
    launch = _LAUNCHES.get(signature)
    if launch is None:
        spec = forward_spec(q, k, v, call, return_lse or split > 0, return_max, split)
        kernel = get_forward_kernel(spec, call.score, call.mask)
        constexprs = spec.constexprs(call.scores_first)
        launch = _LAUNCHES[signature] = _Launch(
            spec, kernel, {**constexprs, **spec.launch_options()}, spec.block_m, constexprs)
    return launch


@functools.cache
def _hopper():
    """flexfa.runtime.hopper, imported on first use (it imports this module)."""
    from . import hopper
    return hopper


@functools.cache
def _dummy_table(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _broadcast_strides(table: torch.Tensor) -> list[int]:
    """Strides of a block-mask table, 0 along size-1 (broadcast) batch/head dims."""
    return [0 if size == 1 else stride for size, stride in zip(table.shape, table.stride())]


def _table_args(block_mask, device) -> list:
    if block_mask is None:
        dummy = _dummy_table(device)
        return [dummy] * 4 + [0] * 14
    tables = [block_mask.kv_num_blocks, block_mask.kv_indices]
    full = getattr(block_mask, "full_kv_num_blocks", None)
    tables += [full, block_mask.full_kv_indices] if full is not None else [tables[0], tables[1]]
    return [*tables, *(s for t in tables for s in _broadcast_strides(t))]


def buffer_launch_args(traced: TracedMod | None) -> list:
    """Pointer, strides and sizes of each captured tensor, matching ``BufferArgs.params``."""
    if traced is None:
        return []
    args = []
    for tensor in traced.buffers:
        args += [tensor, *tensor.stride(), *tensor.shape]
    return args


def forward_grid(batch_heads: int, q_tiles: int, has_block_mask: bool) -> tuple[int, int]:
    """The grid of the Hopper and FP8 forward templates: under a block mask (B * HQ, q tiles),
    heads on the fast axis, so the longest q tiles of every head start first; dense (q tiles,
    B * HQ), where the programs of one head running together share its K and V in L2."""
    return (batch_heads, q_tiles) if has_block_mask else (q_tiles, batch_heads)


def allocate_outputs(q, v, return_lse: bool, return_max: bool) -> tuple:
    """Empty (out [B, Hq, L, Ev] in q's dtype, lse and row max [B, Hq, L] float32 or None)."""
    B, Hq, L, _ = q.shape
    device = q.device
    out = torch.empty(B, Hq, L, v.shape[3], dtype=q.dtype, device=device)
    if not (return_lse or return_max):  # the common case, on every cached call
        return out, None, None
    lse = torch.empty(B, Hq, L, dtype=torch.float32, device=device) if return_lse else None
    maxs = torch.empty(B, Hq, L, dtype=torch.float32, device=device) if return_max else None
    return out, lse, maxs


def stat_args(out, lse, maxs) -> list:
    """The LSE and MAXS kernel arguments: each statistic, or ``out`` as an unused pointer where
    it was not requested (RETURN_LSE / RETURN_MAX off)."""
    return [lse if lse is not None else out, maxs if maxs is not None else out]


def run_forward(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool = False):
    """(out [B, Hq, L, Ev] in q's dtype, lse [B, Hq, L] float32 natural log or None, the
    rows' max scores [B, Hq, L] float32 or None): ``return_max`` is torch's
    ``AuxRequest(max_scores=True)``, max over keys of score_mod(q.k * scale) where the mask
    keeps the key, -inf for a row with nothing to attend."""
    hopper = _hopper()  # sm_90: the Hopper template
    planned = hopper.run_planned(q, k, v, call, return_lse, return_max)  # a cached signature
    if planned is not None:
        return planned
    B, Hq, L, _ = q.shape
    S = k.shape[2]
    out, lse, maxs = allocate_outputs(q, v, return_lse, return_max)
    if out.numel() == 0:
        for stat in (lse, maxs):
            if stat is not None:
                stat.fill_(float("-inf"))
        return out, lse, maxs
    use_hopper = hopper.use_hopper(q, k, v)
    launch = None if use_hopper else _launch_for(q, k, v, call, return_lse, return_max)
    split = 0
    if launch is not None or _few_programs(B * Hq, L, q.device):
        spec = launch.spec if launch is not None else forward_spec(q, k, v, call, return_lse,
                                                                   return_max)
        split = split_keys(spec, B * Hq, L, S, q.device)
    if use_hopper and not split:
        return hopper.run_hopper_forward(q, k, v, call, return_lse, return_max, out, lse, maxs)
    splits = cdiv(S, split) if split else 1
    if split:  # split-KV decoding: float32 slices per split, combined below
        launch = _launch_for(q, k, v, call, return_lse, return_max, split)
        results = out, lse, maxs
        out = torch.empty(splits, *out.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, B, Hq, L, dtype=torch.float32, device=q.device)
        maxs = torch.empty_like(lse) if return_max else None
    grid = (cdiv(L, launch.block_m), B * Hq, splits)
    args = [q, k, v, out, *stat_args(out, lse, maxs),
            *q.stride(), *k.stride(), *v.stride(), *out.stride()[-4:],
            *_table_args(call.block_mask, q.device), Hq, L, S, float(call.scale),
            *buffer_launch_args(call.score), *buffer_launch_args(call.mask)]
    if q.device.type == "cuda":
        _launch_cuda(launch, grid, args, direct_key(q, k, v, call, return_lse, return_max),
                     call.block_mask, q.device)
    else:
        launch.kernel[grid](*args, **launch.kwargs)
    if split:
        combine_splits(out, lse, maxs, *results)
        return results
    return out, lse, maxs


def split_keys(spec: KernelSpec, batch_heads: int, L: int, S: int, device: torch.device) -> int:
    """Keys per split for split-KV decoding of a call whose (Ampere-template) ``spec`` runs
    ``cdiv(L, BLOCK_M) * batch_heads`` programs, or 0 for none. ``FLEXFA_SPLIT_KV``: ``0``
    (the default: not yet measured on a GPU) never; ``auto`` splits on a GPU where those
    programs would not fill half of its SMs, into about two programs per SM; ``n`` into about
    n splits (any device: how the interpreter tests it). A split is a power of two times the
    mask's key block (the key tile without a mask), at least ``MIN_SPLIT_KEYS`` keys, and
    there are at least two."""
    setting = os.environ.get("FLEXFA_SPLIT_KV", "0")
    if setting == "0":
        return 0
    if setting == "auto":
        if device.type != "cuda":
            return 0
        programs, sms = cdiv(L, spec.block_m) * batch_heads, _sm_count(device)
        if 2 * programs > sms:
            return 0
        wanted = cdiv(2 * sms, programs)
    elif setting.isdigit():
        wanted = int(setting)
    else:
        raise InputError(f"FLEXFA_SPLIT_KV must be auto or a number of splits, got {setting!r}")
    if wanted < 2:
        return 0
    unit = spec.sparse_kv
    keys = unit * next_power_of_two(cdiv(cdiv(S, wanted), unit), minimum=1)
    while keys < MIN_SPLIT_KEYS:
        keys *= 2
    return keys if keys < S else 0


def _few_programs(batch_heads: int, L: int, device: torch.device) -> bool:
    """Whether ``split_keys`` may split a call of ``batch_heads`` heads and L queries (a
    bound that needs no spec: tiles have at most 128 rows), so that the Hopper template's
    calls skip building the Ampere template's launch otherwise."""
    setting = os.environ.get("FLEXFA_SPLIT_KV", "0")
    if setting != "auto":
        return setting != "0"
    return device.type == "cuda" and 2 * cdiv(L, 128) * batch_heads <= _sm_count(device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def combine_splits(parts, part_lse, part_max, out, lse, maxs) -> None:
    """Write split-KV decoding's result into ``out`` (and ``lse``, ``maxs`` where wanted) from
    the splits' normalized outputs ``parts`` [n, B, H, L, Ev], their lse and row maxima
    [n, B, H, L]: out = sum over splits of exp(lse_s - lse) * out_s, lse = logsumexp(lse_s).
    A split without keys for a row has lse -inf and weight 0; a row without any keys gets
    out 0 and lse -inf, as the kernel gives it."""
    total = torch.logsumexp(part_lse, dim=0)
    weights = torch.exp(part_lse - torch.where(total == float("-inf"), 0.0, total))
    out.copy_((weights.unsqueeze(-1) * parts).sum(0))
    if lse is not None:
        lse.copy_(total)
    if maxs is not None:
        torch.amax(part_max, dim=0, out=maxs)


def direct_key(q, k, v, call: AttentionCall, return_lse: bool, return_max: bool) -> tuple:
    """What fixes every specialization Triton makes for an Ampere-template launch besides the
    launch signature (``_launch_for``): shapes, strides, 16-byte alignment of q, k, v and of
    the captured tensors, and the block mask (its tables, by identity); out, lse and the row
    maxima are fresh allocations, contiguous and aligned."""
    return (call_plan_key(q, k, v, call, return_lse, return_max, "ampere"),
            q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0,
            id(call.block_mask), table_generations(call.block_mask)[0])


def _launch_cuda(launch: _Launch, grid: tuple, args: list, key: tuple, block_mask,
                 device: torch.device) -> None:
    """Launch on a CUDA device: the compiled kernel of an earlier launch with the same ``key``
    (``direct_key``) directly, without Triton's per-call binding of the arguments (as the
    Hopper template's plans do), else through Triton, keeping its compiled kernel."""
    kept = launch.direct.get(key)
    if kept is not None and (kept[0] is None if block_mask is None else kept[0]() is block_mask) \
            and device.index == torch.cuda.current_device():
        launch_direct(kept[1], grid, device.index, args)
        return
    with torch.cuda.device(device):
        compiled = launch.kernel[grid](*args, **launch.kwargs)
    state = direct_state(launch.kernel, compiled, args, launch.constexprs)
    try:  # the entry must not keep the mask (and its tables) alive
        mask_ref = None if block_mask is None else weakref.ref(block_mask)
    except TypeError:  # a mask object without weak references: not kept
        return
    if state is not None:
        if len(launch.direct) >= _MAX_DIRECT:
            launch.direct.clear()
        launch.direct[key] = (mask_ref, state)
