"""Autotuning the forward tiles per (template, GPU, head dims, dtype, mask density class,
short or long kv length).

A small pruned config space per head dim is timed on the caller's own inputs the first time a
class is met; the winner goes into ``<cache dir>/autotune.json`` (atomic write under a lock),
so a new process reuses it without timing anything. The GPU in the key is the one timed
(``device_tag``: its architecture, name and SM count), not only its architecture: an H100's
winners were measured at its clocks, memory bandwidth and SM count and need not be an H200's
(both sm_90). Winners stored under the architecture alone (older stores) are never looked up.
The key ends with the toolchain (``toolchain``: the flexfa, Triton and torch versions): a
winner timed with another Triton's code generation is timed again, not reused; the store keeps
the entries of the last ``KEPT_TOOLCHAINS`` toolchains that stored one. It is the package
versions, not the sources' hash of the kernel cache key: the committed tuning file
(benchmarks/results/tuning/autotune.json) serves every commit of one release and toolchain,
and a stored winner is used only while it is one of the current candidates.
A progress line goes to stderr while tuning. Nothing is tuned under the interpreter (CPU
tensors get fixed small tiles), when the caller pins tiles through ``kernel_options``, or
with ``FLEXFA_AUTOTUNE=0``.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import threading
import warnings
from collections.abc import Callable

import torch
import triton

from .. import config
from ..blockmask.checks import on_device
from ..blockmask.validate import capturing
from ..memo import BoundedMemo
from ..version import __version__
from .cache import file_lock, write_atomic
from .cache_location import usable_cache_dir

# (BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg); the first entry is the default when not
# tuning. Pruned by hand on the H200: 128-row tiles fill two wgmma warpgroups, BLOCK_N = 128
# keeps a block-mask block one loop iteration, 64 halves the registers for wide heads. A cap of
# 128 registers (maxnreg, 0: none) with 2 stages fits two 8-warp programs on an SM, whose
# softmax and GEMMs then overlap: benchmarks/tile_sweep.py on the H200, causal S = 16384,
# E = 128: 2.21 ms at 128 x 64 capped against 2.36 ms for the uncapped 128 x 128 (E = 64
# causal S = 2048: 0.215 against 0.231 ms), docs/performance.md.
HOPPER_CONFIGS: dict[int, tuple[tuple[int, int, int, int, int], ...]] = {
    16: ((128, 128, 4, 3, 0), (128, 64, 4, 3, 0)),
    32: ((128, 128, 4, 3, 0), (128, 128, 8, 3, 0), (128, 64, 4, 3, 0)),
    64: ((128, 128, 8, 2, 128), (128, 128, 4, 3, 0), (128, 128, 8, 3, 0), (128, 64, 4, 3, 0),
         (128, 128, 4, 2, 0)),
    128: ((128, 64, 8, 2, 128), (128, 128, 8, 2, 0), (128, 128, 8, 3, 0), (128, 64, 8, 3, 0)),
    # Ev = 256: the [BLOCK_M, 256] fp32 accumulator spills (about 630 bytes) whenever one
    # warpgroup owns 64 of its rows (128 x n with 8 warps, 64 x n with 4); 64-row tiles over
    # 8 warps split its columns between two warpgroups: 193 registers, no spills (sm_90
    # compile checks, docs/performance.md "Head dims"); 3 stages take 225 of 227 KB
    256: ((64, 64, 8, 2, 0), (64, 32, 8, 2, 0), (64, 64, 8, 3, 0)),
}
# E pads past Ev (DeepSeek MLA: E = 192, Ev = 128): the registers of the Ev = 128 tiles (an
# accumulator of 128 columns, 199..218 registers, no spills) with wider Q and K in shared
# memory (128 x 64 x 2 stages: 160 KB, 3 stages 209 KB)
HOPPER_CONFIGS_WIDE_QK: dict[tuple[int, int], tuple[tuple[int, int, int, int, int], ...]] = {
    (256, 128): ((128, 64, 8, 2, 0), (128, 64, 8, 3, 0), (128, 128, 8, 1, 0), (64, 64, 4, 2, 0),
                 (128, 32, 8, 2, 0)),
}


def hopper_configs(head_dim_pad: int, head_dim_v_pad: int) -> tuple[tuple[int, ...], ...]:
    """The Hopper forward's candidates for padded head dims (E, Ev), the default first: the
    wide-QK table's where it has the pair, else the table of the larger one."""
    wide = HOPPER_CONFIGS_WIDE_QK.get((head_dim_pad, head_dim_v_pad))
    return wide or HOPPER_CONFIGS[max(16, min(256, max(head_dim_pad, head_dim_v_pad)))]


# below this many score elements (B * H * L * S) a launch is mostly overhead and timing it
# says nothing about the config: the default is used and nothing is stored
MIN_TUNED_WORK = 2 ** 28
# kv lengths up to this are tuned apart from longer ones (short rows favour other tiles)
SHORT_KV = 4096
# the store keeps the winners of this many toolchains, the most recently stored (a bound, and
# room for a few virtual environments sharing one cache directory)
KEPT_TOOLCHAINS = 4

_FILE = "autotune.json"
_LOCK = threading.Lock()
_MEMO = BoundedMemo(4096, "tuned configs")  # key -> (block_m, block_n, warps, stages)


def enabled() -> bool:
    return config.autotune_enabled()


def device_tag(target, device) -> str:
    """The tuned GPU as a tune key names it: ``cuda:90/NVIDIA H200/132sm`` (architecture,
    name, SM count: what sets the winner besides the call's class); CPU tensors (tests faking
    a target: nothing is timed on them) by ``target`` alone."""
    if device.type != "cuda":
        return target.name
    props = torch.cuda.get_device_properties(device)
    name = props.name.replace("|", "/")  # "|" separates the key's fields
    return f"{target.name}/{name}/{props.multi_processor_count}sm"


def toolchain() -> str:
    """The versions a timing depends on besides the GPU and the call's class, as a tune key's
    last field: ``flexfa=0.1.0,triton=3.6.0,torch=2.11.0+cu130``."""
    return f"flexfa={__version__},triton={triton.__version__},torch={torch.__version__}"


def _toolchain_of(key: str) -> str | None:
    last = key.rpartition("|")[2]
    return last if last.startswith("flexfa=") else None


def tune_key(template: str, device: str, head_dim_pad: int, head_dim_v_pad: int, dtype: str,
             density: str, kv_len: int) -> str:
    """The key of a stored winner; ``device``: ``device_tag``'s."""
    length = "short" if kv_len <= SHORT_KV else "long"
    return (f"{template}|{device}|e{head_dim_pad}|ev{head_dim_v_pad}|{dtype}|{density}|{length}"
            f"|{toolchain()}")


def _path():
    return usable_cache_dir() / _FILE


def _read_all() -> dict:
    try:
        with open(_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def lookup(key: str, length: int = 4) -> tuple[int, ...] | None:
    """A stored winner of ``length`` ints: this process's memo, then the disk file."""
    config = _MEMO.get(key)
    if config is None:
        stored = _read_all().get(key)
        if (isinstance(stored, list) and len(stored) == length
                and all(isinstance(x, int) for x in stored)):
            config = _MEMO[key] = tuple(stored)
    return config


def store(key: str, config: tuple[int, ...], timings: dict) -> None:
    """Keep the winner in memory and in the store; a store that cannot be written (held by
    another process, full, read-only) costs a warning, never the call that tuned."""
    _MEMO[key] = config
    path = _path()
    try:
        with file_lock(path.with_suffix(".lock")):
            data = _read_all()
            data[key] = list(config)
            stored_timings = data.get("_timings_ms")
            if not isinstance(stored_timings, dict):  # an edited file: start the table again
                stored_timings = data["_timings_ms"] = {}
            stored_timings[key] = timings
            _keep_recent_toolchains(data, _toolchain_of(key))
            write_atomic(path, json.dumps(data, indent=1, sort_keys=True))
    except OSError as exc:  # LockTimeout is one too
        warnings.warn(f"flexfa: {exc}; the tuned config of {key} is kept in this process only",
                      RuntimeWarning, stacklevel=3)


def _keep_recent_toolchains(data: dict, current: str | None) -> None:
    """Drop the entries of all but the ``KEPT_TOOLCHAINS`` toolchains that stored last
    (``_toolchains`` lists them, the latest last); keys without one (older stores) stay."""
    listed = data.get("_toolchains")
    order = [t for t in listed if isinstance(t, str)] if isinstance(listed, list) else []
    if current is not None:
        order = [t for t in order if t != current] + [current]
    kept = data["_toolchains"] = order[-KEPT_TOOLCHAINS:]
    for key in [k for k in data if _toolchain_of(k) not in (None, *kept)]:
        del data[key]
        data["_timings_ms"].pop(key, None)


def forward_label(config) -> str:
    label = "x".join(map(str, config[:2])) + f" w{config[2]} s{config[3]}"
    return label + (f" r{config[4]}" if len(config) > 4 and config[4] else "")


def tune(key: str, configs, time_config: Callable[[tuple], float],
         label: Callable[[tuple], str] = forward_label) -> tuple[int, ...]:
    """The stored winner of ``key`` if it is one of ``configs``; else time every config
    (``time_config(config) -> ms``; an exception drops the config), keep the fastest and store
    it; a progress line per config on stderr (``label`` names a config there and in the stored
    timings). A winner stored for another candidate list is tuned again, not returned. While a
    CUDA graph is captured nothing is timed (timing synchronizes): the first config, unstored."""
    configs = [tuple(c) for c in configs]
    with _LOCK:
        known = lookup(key, len(configs[0]))
        if known is not None and known in configs:
            return known
        if capturing():
            return configs[0]
        timings = {}
        for i, candidate in enumerate(configs):
            label_ = label(candidate)
            print(f"\rflexfa: tuning {key}: {i + 1}/{len(configs)} ({label_})", end="",
                  file=sys.stderr, flush=True)
            try:
                timings[label_] = time_config(candidate)
            except Exception as exc:  # too many registers / shared memory: skip the config
                timings[label_] = f"failed: {type(exc).__name__}"
        good = {name: ms for name, ms in timings.items() if isinstance(ms, float)}
        assert good, f"no config of {key} ran: {timings}"
        best_label = min(good, key=good.get)
        best = configs[list(timings).index(best_label)]
        print(f"\rflexfa: tuned {key}: {best_label} ({good[best_label]:.3f} ms)" + " " * 20,
              file=sys.stderr, flush=True)
        store(key, tuple(best), timings)
        return tuple(best)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """The median time of ``fn``, launching on ``device``, in ms. ``do_bench`` records its
    events on, and synchronizes, the current device: with another GPU current it timed that
    idle GPU's cache flushes, not ``fn``, and stored a winner of noise."""
    with on_device(device):
        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def clear_memo() -> None:
    _MEMO.clear()


@dataclasses.dataclass(frozen=True)
class Pinned:
    """Tiles the caller fixed through kernel_options (None: free)."""

    block_m: int | None
    block_n: int | None
    num_warps: int | None
    num_stages: int | None
    max_registers: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in dataclasses.astuple(self))

    def apply(self, config: tuple[int, ...]) -> tuple[int, ...]:
        """``config`` with the pinned fields replaced (as long as ``config``: the backward's
        configs have no register cap). A register cap belongs to its tiles: pinned tiles, warps
        or stages drop the config's cap unless the cap is pinned too."""
        pinned = dataclasses.astuple(self)
        result = [p if p is not None else c for p, c in zip(pinned, config)]
        tiles_pinned = any(p is not None for p in pinned[:4])
        if len(result) > 4 and self.max_registers is None and tiles_pinned:
            result[4] = 0
        return tuple(result)

    @classmethod
    def of(cls, options) -> "Pinned":
        return cls(options.block_m, options.block_n, options.num_warps, options.num_stages,
                   options.max_registers)
