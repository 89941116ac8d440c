"""Autotuning: the fastest config wins, is stored on disk, a new process reads it instead of
timing again; progress on stderr; pinned options and the interpreter never tune."""
from __future__ import annotations

import errno
import json
import subprocess
import sys

import pytest
import torch

import flexfa
from flexfa import BlockMask, mods
from flexfa.blockmask import density
from flexfa.blockmask.density import density_class
from flexfa.blockmask.validate import check_tables
from flexfa.runtime import autotune
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families import backward, hopper
from flexfa.runtime.families.hopper import HOPPER
from flexfa.runtime.options import KernelOptions, PassOptions
from flexfa.runtime.target import INTERPRETER, Target

SM80, SM90 = Target("cuda", 8, 0), Target("cuda", 9, 0)

CONFIGS = ((128, 128, 8, 2), (128, 64, 8, 3), (64, 128, 4, 3))


@pytest.fixture
def tune_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))
    autotune.clear_memo()
    yield tmp_path
    autotune.clear_memo()


def test_fastest_config_wins_and_is_persisted(tune_dir, capsys):
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.5, CONFIGS[2]: 2.0}
    timed = []

    def time_config(config):
        timed.append(config)
        return times[config]
    best = autotune.tune("k|cuda:90|e128", CONFIGS, time_config)
    assert best == CONFIGS[1] and timed == list(CONFIGS)
    assert "flexfa: tuned k|cuda:90|e128: 128x64 w8 s3" in capsys.readouterr().err
    stored = json.loads((tune_dir / "autotune.json").read_text())
    assert stored["k|cuda:90|e128"] == list(CONFIGS[1])
    assert set(stored["_timings_ms"]["k|cuda:90|e128"]) == {"128x128 w8 s2", "128x64 w8 s3",
                                                            "64x128 w4 s3"}
    # again in this process: no timing
    assert autotune.tune("k|cuda:90|e128", CONFIGS, lambda c: pytest.fail("timed again")) == best


def test_a_new_process_reads_the_winner_from_disk(tune_dir):
    autotune.tune("k2", CONFIGS, lambda c: {CONFIGS[2]: 1.0}.get(c, 2.0))
    code = ("from flexfa.runtime import autotune; import sys; "
            "print(autotune.tune('k2', %r, lambda c: sys.exit('timed again')))" % (CONFIGS,))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**__import__("os").environ, "FLEXFA_CACHE_DIR": str(tune_dir)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(CONFIGS[2])


def test_failing_configs_are_skipped_and_all_failing_is_an_error(tune_dir):
    def time_config(config):
        if config[0] == 128:
            raise RuntimeError("out of shared memory")
        return 1.0
    assert autotune.tune("k3", CONFIGS, time_config) == CONFIGS[2]
    with pytest.raises(AssertionError, match="no config of k4 ran"):
        autotune.tune("k4", CONFIGS, lambda c: 1 / 0)


def test_a_winner_stored_for_other_candidates_is_tuned_again(tune_dir):
    autotune.tune("k6", CONFIGS[:2], lambda c: {CONFIGS[1]: 1.0}.get(c, 2.0))
    assert autotune.lookup("k6") == CONFIGS[1]
    # the candidate list changed (a new version, other mask blocks): CONFIGS[1] is not in it
    timed = []
    best = autotune.tune("k6", (CONFIGS[0], CONFIGS[2]),
                         lambda c: timed.append(c) or {CONFIGS[2]: 1.0}.get(c, 2.0))
    assert best == CONFIGS[2] and timed == [CONFIGS[0], CONFIGS[2]]
    assert autotune.lookup("k6") == CONFIGS[2]


def test_corrupt_file_is_ignored(tune_dir):
    (tune_dir / "autotune.json").write_text("{not json")
    assert autotune.lookup("anything") is None
    autotune.tune("k5", CONFIGS, lambda c: 1.0)
    assert autotune.lookup("k5") == CONFIGS[0]


def test_a_store_that_cannot_be_written_keeps_the_winner_in_memory(tune_dir, monkeypatch):
    """Storing happens after every config was timed: a full or read-only store, or a valid
    JSON file whose timings table is not an object, must not fail the call that tuned."""
    (tune_dir / "autotune.json").write_text('{"_timings_ms": []}')
    assert autotune.tune("k7", CONFIGS, lambda c: float(c[2])) == CONFIGS[2]
    assert json.loads((tune_dir / "autotune.json").read_text())["k7"] == list(CONFIGS[2])

    def disk_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(autotune, "write_atomic", disk_full)
    with pytest.warns(RuntimeWarning, match="No space left.*k8 is kept in this process only"):
        assert autotune.tune("k8", CONFIGS, lambda c: float(c[3])) == CONFIGS[0]
    assert autotune.tune("k8", CONFIGS, lambda c: pytest.fail("timed again")) == CONFIGS[0]


def test_key_separates_density_and_length_classes():
    keys = {autotune.tune_key("fwd_hopper", "cuda:90", 128, 128, "bf16", d, n)
            for d in ("dense", "masked", "sparse") for n in (2048, 16384)}
    assert len(keys) == 6


def _no_reads(monkeypatch):
    """Fail any device-to-host read of a tensor's value (int(t))."""
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: pytest.fail("a table was read"),
                        raising=False)


def test_density_class_is_read_once_per_tables(monkeypatch):
    """create_block_mask records the class (no read at the first call); a mask rebuilt around
    aliases of the same tables (a compiled graph's) finds it on their storage; an in-place
    edit, or a mask made from new tables, reads the tables once."""
    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 64

    assert density_class(None) == "dense"
    mask = flexfa.create_block_mask(mods.causal, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=64)
    narrow = flexfa.create_block_mask(window, 1, 1, 2048, 2048, device="cpu", BLOCK_SIZE=64)
    names = tuple(f"{pair}_{part}" for pair in ("kv", "full_kv", "q", "full_q")
                  for part in ("num_blocks", "indices"))

    def rebuilt(m):
        return BlockMask(m.seq_lengths, *(getattr(m, n).detach()[:] for n in names),
                         BLOCK_SIZE=m.BLOCK_SIZE, mask_mod=m.mask_mod)
    with monkeypatch.context() as patched:
        _no_reads(patched)
        assert density_class(mask) == density_class(rebuilt(mask)) == "masked"
        assert density_class(narrow) == density_class(rebuilt(narrow)) == "sparse"
    narrow.full_kv_num_blocks.zero_()  # in place: the count tables' versions move
    narrow.kv_num_blocks.zero_()
    fresh = rebuilt(narrow)
    with monkeypatch.context() as patched:
        _no_reads(patched)
        with pytest.raises(pytest.fail.Exception, match="a table was read"):
            density_class(fresh)
    assert density_class(fresh) == "sparse"  # read now: no tile visited
    reads = BlockMask(mask.seq_lengths, *(getattr(mask, n).clone() for n in names),
                      BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod)
    with monkeypatch.context() as patched:
        _no_reads(patched)
        with pytest.raises(pytest.fail.Exception, match="a table was read"):
            density_class(reads)  # new tables (clones): read once
    assert density_class(reads) == "masked"


def test_density_class_follows_in_place_edits_of_a_checked_mask():
    """The class kept on a mask is of its tables' contents as last checked: after an in-place
    edit (seen by the next call's table check) it is counted again (it stayed "masked" for a
    mask edited down to nothing, the tuning key and head order of a dense mask)."""
    mask = flexfa.create_block_mask(mods.causal, 1, 1, 256, 256, device="cpu", BLOCK_SIZE=64)
    check_tables(mask, 256, 256)
    assert density_class(mask) == "masked"  # 10 of 16 tiles
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        getattr(mask, name).zero_()
    check_tables(mask, 256, 256)  # what the next call does first
    assert density_class(mask) == "sparse"
    assert density.visited_share(mask) == 0.0


def _call(options=KernelOptions()):
    return AttentionCall(None, None, None, 0.125, options, 1)


def _fwd(**fields) -> KernelOptions:
    return KernelOptions(fwd=PassOptions(**fields))


def _choose(q, call, target):
    return HOPPER.choose_config(q, q, q, call, target, False, None, None)


def test_interpreter_and_pinned_options_never_tune(monkeypatch):
    monkeypatch.setattr(autotune, "tune", lambda *a: pytest.fail("tuned"))
    q = torch.randn(1, 2, 64, 128, dtype=torch.bfloat16)
    assert _choose(q, _call(), INTERPRETER) == (64, 64, 4, 1, 0)
    big = torch.empty(16, 16, 2048, 128, dtype=torch.bfloat16)  # never touched: no launch
    default = autotune.HOPPER_CONFIGS[128][0]
    pinned = _call(_fwd(block_m=64, num_stages=4, max_registers=0))
    assert _choose(big, pinned, SM90) == (64, default[1], default[2], 4, 0)
    # pinned tiles drop the default's register cap (it was chosen for the default's tiles)
    assert _choose(big, _call(_fwd(block_n=128)), SM90)[1:] == (128, default[2], default[3], 0)
    assert _choose(big, _call(_fwd(block_n=128, max_registers=168)), SM90)[4] == 168
    assert _choose(big, _call(_fwd(max_registers=0)), SM90) == (*default[:4], 0)
    monkeypatch.setenv("FLEXFA_AUTOTUNE", "0")
    assert _choose(big, _call(), SM90) == autotune.HOPPER_CONFIGS[128][0]


def test_small_problems_use_the_default_without_timing(monkeypatch):
    monkeypatch.setattr(autotune, "tune", lambda *a: pytest.fail("tuned"))
    q = torch.empty(1, 2, 256, 64, dtype=torch.float16)
    assert _choose(q, _call(), SM90) == autotune.HOPPER_CONFIGS[64][0]


def test_candidates_fit_small_mask_blocks():
    assert all(c[0] <= 64 and c[1] <= 64 for c in hopper._candidates(128, 64, 64))
    assert hopper._candidates(128, 32, 16) == [(32, 16, 4, 2, 0)]


def test_register_cap_is_a_tuned_field_a_pin_and_a_launch_option():
    from flexfa.codegen.spec import KernelSpec
    from flexfa.runtime.options import parse_kernel_options

    assert all(len(c) == 5 for configs in autotune.HOPPER_CONFIGS.values() for c in configs)
    assert autotune.forward_label((128, 64, 8, 2, 128)) == "128x64 w8 s2 r128"
    assert autotune.forward_label((128, 64, 8, 2, 0)) == "128x64 w8 s2"
    assert parse_kernel_options({"maxnreg": 168}).max_registers == 168
    for bad in (100, 256, 32):
        with pytest.raises(flexfa.InputError, match="maxnreg"):
            parse_kernel_options({"maxnreg": bad})
    fields = dict(dtype="bf16", head_dim=64, head_dim_v=64, block_m=128, block_n=128,
                  num_warps=8, num_stages=2, has_block_mask=False, has_full_blocks=False,
                  sparse_q=128, sparse_kv=128, even_l=True, even_s=True, return_lse=False,
                  gqa_group=1, input_precision="ieee", max_registers=128)
    assert KernelSpec(**fields, target="cuda:90").launch_options()["maxnreg"] == 128
    # the interpreter has no registers to cap; no cap, no option
    assert "maxnreg" not in KernelSpec(**fields, target="interpret").launch_options()
    assert "maxnreg" not in KernelSpec(**{**fields, "max_registers": 0},
                                       target="cuda:90").launch_options()


def test_backward_tiles_on_sm90_are_the_measured_ones():
    table = backward.HOPPER_BACKWARD_CANDIDATES
    assert backward.default_tiles(128, torch.bfloat16, SM90) == table[128][0]
    assert backward.default_tiles(64, torch.float16, SM90) == table[64][0]
    assert backward.default_tiles(32, torch.bfloat16, SM90) == table[64][0]
    # fp32, and wide heads without tensor descriptors, keep the generic choice
    assert backward.default_tiles(128, torch.float32, SM90) == backward.default_tiles(
        128, torch.float32, SM80)
    assert backward.default_tiles(256, torch.bfloat16, SM90, tma=False) == \
        backward.default_tiles(256, torch.bfloat16, SM80)
    # wide heads with descriptors: the wide table by padded (E, Ev); E = 128 < Ev = 256 and
    # E = Ev = 256 share one entry
    wide = backward.HOPPER_BACKWARD_WIDE
    assert backward.default_tiles(256, torch.bfloat16, SM90, 128) == wide[256, 128][0]
    assert backward.default_tiles(256, torch.bfloat16, SM90) == wide[256, 256][0]
    assert backward.default_tiles(128, torch.bfloat16, SM90, 256) == wide[256, 256][0]
    assert backward.default_tiles(64, torch.bfloat16, SM90, 128) == table[128][0]


def _backward_inputs(E=64, dtype=torch.bfloat16):
    q = torch.randn(1, 2, 128, E, dtype=dtype)
    return backward.Inputs(q, q.clone(), q.clone(), q.clone(), torch.zeros(1, 2, 128), q.clone(),
                           None, q.clone(), q.clone(), q.clone(), {})


def test_backward_tuning_picks_the_fastest_tiles_and_stores_them(tune_dir, monkeypatch):
    """sm_90 backward tuning (timed launches faked: no GPU here): the fastest candidate wins,
    is stored, and is reused."""
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    candidates = list(backward.HOPPER_BACKWARD_CANDIDATES[64])
    fastest = candidates[1]
    timed = []

    def fake_plan(self, spec, call, x, joint):
        timed.append((spec.block_m1, spec.block_n1, spec.block_m2, spec.block_n2,
                      spec.num_warps, spec.num_stages))
        return timed[-1]
    monkeypatch.setattr(backward.Backward, "make_plan", fake_plan)
    monkeypatch.setattr(autotune.triton.testing, "do_bench",
                        lambda fn, **kw: 1.0 if timed[-1] == fastest else 2.0)
    x = _backward_inputs()
    got = backward.BACKWARD.choose_config(_call(), x, None, True, SM90)
    assert got == fastest and timed == candidates
    stored = json.loads((tune_dir / "autotune.json").read_text())
    key = f"bwd|cuda:90|e64|ev64|bf16|dense|short|{autotune.toolchain()}"
    assert stored[key] == list(fastest)
    assert set(stored["_timings_ms"][key]) == {backward._label(c) for c in candidates}
    timed.clear()
    assert backward.BACKWARD.choose_config(_call(), x, None, True, SM90) == fastest
    assert timed == []  # reused, not timed again


def test_backward_never_tunes_where_it_must_not(tune_dir, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    monkeypatch.setattr(autotune, "tune", lambda *a, **kw: pytest.fail("tuned"))

    def choose(call=_call(), joint=None, target=SM90, x=_backward_inputs(64)):
        return backward.BACKWARD.choose_config(call, x, joint, True, target)
    assert len(backward.HOPPER_BACKWARD_CANDIDATES[64]) == 3
    # one candidate at E = 128: nothing to tune
    assert choose(x=_backward_inputs(128)) is None
    assert choose(target=SM80) is None and choose(target=INTERPRETER) is None
    assert choose(_call(KernelOptions(bwd=PassOptions(block_m=32)))) is None  # pinned tiles
    assert choose(_call(KernelOptions(bwd=PassOptions(block_n1=32)))) is None
    assert choose(x=_backward_inputs(64, torch.float32)) is None  # fp32

    class Joint:  # a captured tensor that needs a gradient
        grad_slots = (0,)
    assert choose(joint=Joint()) is None
    monkeypatch.setenv("FLEXFA_AUTOTUNE", "0")
    assert choose() is None
    monkeypatch.delenv("FLEXFA_AUTOTUNE")
    with pytest.raises(pytest.fail.Exception, match="tuned"):
        choose()  # the same call tunes when nothing forbids it


class _OnGpu:
    """A stand-in for a CUDA tensor (no GPU here): what choosing tiles reads of one."""

    def __init__(self, shape, index: int, dtype=torch.bfloat16):
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, torch.device("cuda", index)


@pytest.fixture
def two_sm90_gpus(monkeypatch):
    """cuda:0 an H100, cuda:1 an H200, cuda:2 an H200 slice of fewer SMs: all sm_90."""
    from types import SimpleNamespace
    gpus = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", multi_processor_count=132),
            SimpleNamespace(name="NVIDIA H200", multi_processor_count=132),
            SimpleNamespace(name="NVIDIA H200", multi_processor_count=66)]
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: gpus[torch.device(device).index])
    return gpus


def test_winners_are_kept_per_gpu_not_per_architecture(tune_dir, two_sm90_gpus, monkeypatch):
    """An H100's stored winner served an H200 (both keyed 'cuda:90'): the key names the GPU
    (name and SM count); a store written under the architecture alone is not looked up."""
    tags = [autotune.device_tag(SM90, torch.device("cuda", i)) for i in range(3)]
    assert len(set(tags)) == 3 and all(t.startswith("cuda:90/") for t in tags)
    assert autotune.device_tag(SM90, torch.device("cpu")) == "cuda:90"  # nothing timed there
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    keys, real_tune = [], autotune.tune

    def tune(key, candidates, time_config, *label):
        keys.append(key)
        return real_tune(key, candidates, lambda c: times[c])
    monkeypatch.setattr(autotune, "tune", tune)
    candidates = hopper._candidates(128, None, None)
    times = {c: 1.0 + i for i, c in enumerate(reversed(candidates))}  # the last is fastest
    old_key = autotune.tune_key(hopper.HOPPER_TEMPLATE, "cuda:90", 128, 128, "bf16", "dense", 2048)
    (tune_dir / "autotune.json").write_text(json.dumps({old_key: list(candidates[1])}))
    q = _OnGpu((1, 2, 2048, 128), 0)
    assert _choose(q, _call(), SM90) == candidates[-1]  # tuned, not the old store's entry
    times = {c: 1.0 + i for i, c in enumerate(candidates)}  # the first is fastest
    for index in (1, 2):
        assert _choose(_OnGpu(q.shape, index), _call(), SM90) == candidates[0]
    assert _choose(q, _call(), SM90) == candidates[-1]  # the H100's own winner, kept
    assert [k.split("|")[1] for k in keys] == [*tags, tags[0]]
    stored = json.loads((tune_dir / "autotune.json").read_text())
    assert stored[old_key] == list(candidates[1])  # left as it was
    assert [stored[k] for k in keys[:3]] == [list(candidates[-1]), *[list(candidates[0])] * 2]


def test_backward_winners_are_kept_per_gpu(two_sm90_gpus, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    keys = []
    monkeypatch.setattr(autotune, "tune", lambda key, candidates, *a: keys.append(key)
                        or candidates[0])
    for index in range(3):
        q = _OnGpu((1, 2, 2048, 64), index)
        x = backward.Inputs(q, q, q, q, None, q, None, q, q, q, {})
        backward.BACKWARD.choose_config(_call(), x, None, True, SM90)
    assert [k.split("|")[1] for k in keys] == [
        autotune.device_tag(SM90, torch.device("cuda", i)) for i in range(3)]


def test_a_winner_timed_with_another_toolchain_is_timed_again(tune_dir, two_sm90_gpus,
                                                              monkeypatch):
    """A winner stored by another Triton (or torch, or flexfa) was reused after an upgrade:
    the key ends with the toolchain, so it is timed again and both winners are kept."""
    import triton
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    candidates = hopper._candidates(128, None, None)
    q = _OnGpu((1, 2, 2048, 128), 1)
    with monkeypatch.context() as m:
        m.setattr(triton, "__version__", "3.5.0")
        m.setattr(autotune, "tune", _timing(autotune.tune, candidates[::-1]))
        assert _choose(q, _call(), SM90) == candidates[-1]
    monkeypatch.setattr(autotune, "tune", _timing(autotune.tune, candidates))
    assert _choose(q, _call(), SM90) == candidates[0]  # timed again, not the 3.5.0 winner
    stored = json.loads((tune_dir / "autotune.json").read_text())
    assert sorted(autotune._toolchain_of(k) or k for k in stored) == sorted([
        "_timings_ms", "_toolchains", autotune.toolchain(),
        autotune.toolchain().replace(f"triton={triton.__version__}", "triton=3.5.0")])


def _timing(real_tune, fastest_first):
    """``autotune.tune`` timing ``fastest_first[i]`` at i ms."""
    return lambda key, candidates, *rest: real_tune(
        key, candidates, lambda config: float(fastest_first.index(config)))


def test_the_store_keeps_the_latest_toolchains(tune_dir):
    """The store is bounded: a new toolchain drops the entries of the oldest beyond
    KEPT_TOOLCHAINS; keys without a toolchain (older stores) are left as they were."""
    (tune_dir / "autotune.json").write_text(json.dumps({"fwd|cuda:90|e64": [1, 2, 3, 4]}))
    versions = [f"flexfa=0.1.0,triton=3.{minor}.0,torch=2.11.0" for minor in range(6)]
    for version in versions + [versions[1]]:  # 1 again: now the latest, 2 the oldest
        autotune.clear_memo()  # as a new process: 1's winner, dropped, is timed again
        autotune.tune(f"fwd|cuda:90|e128|{version}", CONFIGS, lambda c: float(c[2]))
    stored = json.loads((tune_dir / "autotune.json").read_text())
    kept = [versions[i] for i in (3, 4, 5, 1)]
    assert stored["_toolchains"] == kept
    assert sorted(stored) == sorted(["_timings_ms", "_toolchains", "fwd|cuda:90|e64",
                                     *(f"fwd|cuda:90|e128|{v}" for v in kept)])
    assert sorted(stored["_timings_ms"]) == [f"fwd|cuda:90|e128|{v}" for v in sorted(kept)]


def test_the_committed_tuning_file_is_in_the_current_key_format():
    """benchmarks/results/tuning/autotune.json serves the benchmark runs of its toolchain: its
    keys are what tune_key makes for an H200 under that toolchain (a key format change that
    leaves the file behind makes every benchmark run tune again)."""
    from pathlib import Path
    path = Path(__file__).parents[2] / "benchmarks" / "results" / "tuning" / "autotune.json"
    stored = json.loads(path.read_text())
    assert len(stored["_toolchains"]) == 1
    winners = [key for key in stored if not key.startswith("_")]
    assert winners and sorted(stored["_timings_ms"]) == sorted(winners)
    for key in winners:
        template, device, e, ev, dtype, density, length, tools = key.split("|")
        kv_len = autotune.SHORT_KV * (1 if length == "short" else 2)
        made = autotune.tune_key(template, device, int(e[1:]), int(ev[2:]), dtype, density,
                                 kv_len)
        assert made.rpartition("|")[0] == key.rpartition("|")[0]
        assert device == "cuda:90/NVIDIA H200/132sm" and tools == stored["_toolchains"][0]
        assert isinstance(stored[key], list) and all(isinstance(x, int) for x in stored[key])


@pytest.fixture
def cuda_current(monkeypatch):
    """torch's current CUDA device faked (no GPU here): cuda:0 is current, and
    ``torch.cuda.device(d)`` makes d current while its block runs."""
    current = [0]

    class Device:
        def __init__(self, device):
            self.index, self.before = torch.device(device).index, None

        def __enter__(self):
            self.before, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.before
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", Device)
    return current


def test_configs_are_timed_on_the_tensors_gpu(tune_dir, two_sm90_gpus, cuda_current,
                                             monkeypatch):
    """do_bench records its events on, and synchronizes, the current device: a call on
    cuda:1 while cuda:0 was current timed cuda:0's cache flushes, and stored a winner of
    noise under cuda:1's GPU. Every config is now timed with the tensors' device current."""
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    monkeypatch.setattr(HOPPER, "make_plan", lambda *a, **kw: None)
    monkeypatch.setattr(HOPPER, "launch", lambda *a: None)
    current_while_timed = []
    monkeypatch.setattr(autotune.triton.testing, "do_bench", lambda fn, **kw: (
        fn(), current_while_timed.append(torch.cuda.current_device()))[0] or 1.0)
    candidates = hopper._candidates(128, None, None)
    assert _choose(_OnGpu((1, 2, 2048, 128), 1), _call(), SM90) in candidates
    assert current_while_timed == [1] * len(candidates)
    assert cuda_current == [0]  # the caller's device is current again


def test_backward_configs_are_timed_on_the_tensors_device(tune_dir, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_TUNED_WORK", 0)
    monkeypatch.setattr(backward.Backward, "make_plan", lambda self, *a: None)
    devices = []
    monkeypatch.setattr(autotune, "time_ms", lambda fn, device: devices.append(device) or 1.0)
    x = _backward_inputs()
    backward.BACKWARD.choose_config(_call(), x, None, True, SM90)
    assert devices == [x.q.device] * len(backward.HOPPER_BACKWARD_CANDIDATES[64])
