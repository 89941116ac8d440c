"""The kernel cache: memo, disk, second process, corruption, concurrency, FLEXFA_DEBUG."""
import contextlib
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import pytest
import torch

import flexfa
from flexfa.runtime import cache
from flexfa.runtime.cache import STATS
from forward_utils import check_forward, make_qkv
from specialization import specialization_spy

# one script, run in this process and in a subprocess: the same mod gives the same kernel
SCRIPT = textwrap.dedent("""
    import torch, flexfa
    from flexfa.runtime.cache import STATS

    def cache_probe_mod(score, b, h, q_idx, kv_idx):
        return score * 0.75 + (q_idx - kv_idx) * 0.015625

    q = torch.ones(1, 1, 20, 16); k = torch.ones(1, 1, 24, 16); v = torch.ones(1, 1, 24, 16)
    out = flexfa.flex_attention(q, k, v, score_mod=cache_probe_mod)
    print("codegen", STATS.codegen, "disk_hits", STATS.disk_hits, "sum", round(out.sum().item(), 3))
""")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))
    cache.clear_memo()
    STATS.reset()
    yield tmp_path
    cache.clear_memo()


def _run(score_mod, L=20, S=24):
    q, k, v = make_qkv(1, 1, 1, L, S, 16)
    return flexfa.flex_attention(q, k, v, score_mod=score_mod)


def test_same_mod_twice_generates_once(fresh_cache):
    def mod(score, b, h, q_idx, kv_idx):
        return score + 0.125

    _run(mod)
    _run(mod)
    assert STATS.codegen == 1 and STATS.disk_hits == 0
    files = list(fresh_cache.glob("flexfa_fwd_d16_fp32_*.py"))
    assert len(files) == 1 and files[0].stem in files[0].read_text()


def test_new_closure_values_do_not_regenerate(fresh_cache):
    def make(bias):
        def biased(score, b, h, q_idx, kv_idx):
            return score + bias[q_idx % 4]
        return biased

    first = _run(make(torch.zeros(4)))
    second = _run(make(torch.full((4,), 2.0)))  # a new function and tensor, same shape
    assert STATS.codegen == 1
    torch.testing.assert_close(first, second)  # a constant shift per row cancels in softmax
    third = _run(make(torch.zeros(5)))  # another shape: another kernel
    assert STATS.codegen == 2 and third.shape == first.shape



def test_loaded_modules_are_bounded(fresh_cache, monkeypatch):
    """The process keeps at most cache.MAX_MODULES kernel modules (a mod whose float changes
    every step makes a kernel each step: they were all kept, in sys.modules too); a kernel
    made again gives the same result without generating its source again."""
    monkeypatch.setattr(cache._MEMO, "size", 2)

    def kernel_modules():
        return {n for n in sys.modules if n.startswith("flexfa_kernels.")}
    before, outs = kernel_modules(), []
    for step in range(4):
        temperature = 1.0 + step / 8

        def mod(score, b, h, q_idx, kv_idx):
            return score * temperature
        outs.append(_run(mod))
    assert len(cache._MEMO) == 2 and STATS.codegen == 4
    assert len(kernel_modules() - before) == 2
    temperature = 1.0

    def again(score, b, h, q_idx, kv_idx):
        return score * temperature
    torch.testing.assert_close(_run(again), outs[0], atol=0, rtol=0)
    assert STATS.codegen == 4


def test_a_dropped_kernel_module_is_released(fresh_cache, monkeypatch):
    """A kernel module the memo drops (its bound, clear_memo) is freed once nothing uses it:
    Triton's interpreter kept a rewritten copy of every function it ran in a process-wide
    dict, holding each module's globals for the life of the process whatever the memo's
    bound. A plan still holding a dropped module's kernel runs it again, its file gone."""
    from triton.runtime.interpreter import InterpretedFunction
    monkeypatch.setattr(cache._MEMO, "size", 1)
    q, k, v = make_qkv(1, 1, 1, 20, 24, 16)
    def scaled(scale):
        return lambda score, b, h, q_idx, kv_idx: score * scale
    modules, mods, outs = [], [scaled(0.625), scaled(0.375)], []
    for mod in mods:
        outs.append(flexfa.flex_attention(q, k, v, score_mod=mod))
        modules.append(cache._MEMO.values()[-1])
    assert len(cache._MEMO) == 1  # the first module was dropped by the bound
    assert not [fn for fn in InterpretedFunction.rewritten_fn
                if getattr(fn, "__globals__", None) in [vars(m) for m in modules]]
    for path in fresh_cache.glob("flexfa_*.py"):
        path.unlink()
    again = flexfa.flex_attention(q, k, v, score_mod=mods[0])  # the kept plan
    torch.testing.assert_close(again, outs[0], atol=0, rtol=0)
    assert STATS.codegen == 2
    refs = [weakref.ref(vars(m)[name]) for m in modules for name in ("flexfa_max2", m.__name__
                                                                    .split(".")[1][:-7])]
    del modules, mods, mod
    cache.clear_memo()  # every memo: the plans and prepared calls holding kernels too
    gc.collect()
    assert not [ref() for ref in refs if ref() is not None]


def test_a_second_process_reuses_the_disk_cache(fresh_cache):
    namespace = {}
    exec(compile(SCRIPT, "cache_script", "exec"), namespace)
    assert STATS.codegen == 1
    env = {**os.environ, "FLEXFA_CACHE_DIR": str(fresh_cache), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                            text=True, timeout=300, cwd=os.path.dirname(flexfa.__path__[0]))
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words[:4] == ["codegen", "0", "disk_hits", "1"], result.stdout


def test_corrupted_file_is_regenerated_with_a_warning(fresh_cache):
    def mod(score, b, h, q_idx, kv_idx):
        return score * 2.0

    expected = _run(mod)
    (path,) = fresh_cache.glob("flexfa_fwd_*.py")
    good = path.read_text()
    for broken in (good[: len(good) // 2], "garbage\n" + good[40:]):
        path.write_text(broken)
        cache.clear_memo()
        with pytest.warns(RuntimeWarning, match="invalid"):
            again = _run(mod)
        torch.testing.assert_close(again, expected)
        assert path.read_text() == good
    assert STATS.regenerated == 2


def test_threads_share_one_generation(fresh_cache):
    """Concurrent first calls generate and import a module once (the interpreter itself is
    not thread-safe, so this exercises the cache layer directly)."""
    calls, modules = [], []

    def generate():
        calls.append(1)
        return "VALUE = 42\n"

    def worker():
        modules.append(cache.get_module("flexfa_test_threads", "k" * 64, True, generate))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and STATS.codegen == 1
    assert len(modules) == 4 and all(m is modules[0] for m in modules) and modules[0].VALUE == 42


def test_debug_logs_ir_and_source_path(fresh_cache, monkeypatch, caplog):
    monkeypatch.setenv("FLEXFA_DEBUG", "1")

    def debug_probe(score, b, h, q_idx, kv_idx):
        return score + (q_idx * 0 + 0.3125)  # simplifies to score + 0.3125

    with caplog.at_level(logging.INFO, logger="flexfa"):
        _run(debug_probe)
    text = caplog.text
    assert "traced score_mod debug_probe" in text and "simplified score_mod" in text
    assert "source:" in text and str(fresh_cache) in text


def test_direct_launch_keys_and_reuse(monkeypatch):
    """A plan step's CUDA launch, without a GPU: its first launch goes through Triton and
    keeps the compiled kernel, the next launches it directly; another step (another plan) or
    another current device goes through Triton again. The plan key tells apart what Triton
    specializes on, and a plan lives under its block mask object."""
    from flexfa.runtime import launch, plans
    from flexfa.runtime.call import AttentionCall
    from flexfa.runtime.forward import forward_plan_key
    from flexfa.runtime.options import KernelOptions
    from flexfa.runtime.pipeline import prepare_mask

    jit, direct = [], []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: (jit.append(grid), "compiled")[1]
    monkeypatch.setattr(launch, "direct_state", lambda kernel, compiled, args, constexprs: (
        compiled, tuple(constexprs.values())))
    monkeypatch.setattr(launch, "launch_direct",
                        lambda state, grid, index, args, stream=None: direct.append(
                            (state, grid, index)))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    device = torch.device("cuda", 0)
    step, other_step = (launch.Step(Kernel(), (5, 8), {"BLOCK": 64}, {"num_warps": 4})
                        for _ in range(2))
    step.launch([1, 2], device)
    step.launch([3, 4], device)
    assert jit == [(5, 8)] and direct == [(("compiled", (64,)), (5, 8), 0)]
    assert step.launched
    other_step.launch([3, 4], device)
    current[0] = 1
    step.launch([3, 4], device)
    assert len(jit) == 3 and len(direct) == 1

    q, k, v = make_qkv(1, 2, 2, 64, 64, 32, dtype=torch.bfloat16)
    block_mask, other_mask = (
        flexfa.create_block_mask(lambda b, h, i, j: i >= j, 1, None, 64, 64, device="cpu")
        for _ in range(2))
    call = AttentionCall(None, prepare_mask(block_mask), block_mask, 0.1, KernelOptions(), 1)
    key = forward_plan_key(q, k, v, call, False, False)
    assert forward_plan_key(q.clone(), k, v, call, False, False) == key  # new data, same key
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view_as(q)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    for other in (unaligned, strided):
        assert forward_plan_key(other, k, v, call, False, False) != key
    assert forward_plan_key(q, k, v, call, True, False) != key  # lse wanted
    plan = plans.Plan(None, None, (step,))
    plans.keep(call, key, plan)
    assert plans.find(call, key) is plan
    other_call = AttentionCall(None, prepare_mask(other_mask), other_mask, 0.1,
                               KernelOptions(), 1)
    assert plans.find(other_call, key) is None  # another mask object


def test_a_table_set_to_an_unaligned_address_gets_its_own_plan(monkeypatch):
    """``kv_indices.set_(...)`` at an address that is not 16-byte aligned keeps the table
    object, its shape, strides and dtype: the plans of the aligned table (whose GPU kernel
    was compiled for an aligned pointer, ``tests/specialization.py``) must not serve it."""
    launched, changed = specialization_spy(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 64, 64, 16, seed=5)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    mask = flexfa.create_block_mask(causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=32)
    for _ in range(2):
        check_forward(q, k, v, None, causal, mask)
    table = mask.kv_indices
    moved = torch.zeros(table.numel() + 1, dtype=table.dtype)
    moved[1:] = table.flatten()
    table.set_(moved.untyped_storage(), 1, table.shape, table.stride())
    assert table.data_ptr() % 16
    check_forward(q, k, v, None, causal, mask)
    assert launched and not changed, f"specialized otherwise than at first: {changed}"
