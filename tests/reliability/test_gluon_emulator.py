"""The Gluon emulator (runtime.gluon_emulator) catches what it is there to catch: small Gluon
kernels written here show its barrier, TMA and deadlock semantics, and mistakes written into
the real templates (a missing wait, a wait for the wrong phase, a wrong row offset, the wrong
dS^T buffer, at E = 256 the wrong columns or an early read of P^T and dS^T) make the
emulated families fail against the float64 reference, where the unchanged templates pass
(tests/kernels/test_gluon_emulated.py)."""
from __future__ import annotations

import pytest
import torch

import flexfa
from flexfa import mods
from triton.runtime.errors import InterpreterError
from flexfa.codegen import forward as codegen_forward, gluon_bwd as codegen_gluon_bwd
from flexfa.codegen.template import load_template, module_source
from flexfa.runtime import plans
from flexfa.runtime.gluon_emulator import GluonDeadlock, load_emulated

from kernels.backward_utils import check_backward
from kernels.forward_utils import check_forward, make_qkv

EMULATED = {"GLUON_EMULATE": True, "BACKEND": "GLUON", "GLUON_BACKWARD": True}

KERNELS = '''
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

ROW = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))
SMEM = gl.constexpr(gl.NVMMASharedLayout.get_default_for([4, 16], gl.float32))


@gluon.jit
def producer(desc, buf, bars, COPY: gl.constexpr):
    if COPY:
        mbarrier.expect(bars.index(0), desc.block_type.nbytes)
        tma.async_copy_global_to_shared(desc, [4, 0], bars.index(0), buf)


@gluon.jit
def consumer(desc, buf, bars, OUT, PARITY: gl.constexpr, WAIT: gl.constexpr):
    if WAIT:
        mbarrier.wait(bars.index(0), PARITY)
    rows = gl.arange(0, 4, layout=ROW)
    values = buf.load(gl.BlockedLayout([1, 1], [2, 16], [1, 1], [1, 0]))
    gl.store(OUT + rows[:, None] * 16 + gl.arange(0, 16, layout=ROW)[None, :], values)


@gluon.jit
def kernel(desc, OUT, PARITY: gl.constexpr, WAIT: gl.constexpr, COPY: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [4, 16], SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    gl.warp_specialize([(consumer, (desc, buf, bars, OUT, PARITY, WAIT)),
                        (producer, (desc, buf, bars, COPY))], [1], [24])
'''


@pytest.fixture
def small_kernel(tmp_path):
    """The module above, loaded by the emulator, and a launcher: rows 4..7 of a [6, 16]
    tensor (two past its end: TMA's zero fill) copied through shared memory to out."""
    path = tmp_path / "small.py"
    path.write_text(module_source("emulator test kernels", {"UNUSED": 0}, ("kernel",), KERNELS))
    module = load_emulated(str(path), "flexfa_emulator_test")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from flexfa.runtime.families.gluon import import_gluon
    import_gluon()
    from triton.experimental.gluon import language as gl

    source = torch.arange(96, dtype=torch.float32).reshape(6, 16)
    layout = gl.NVMMASharedLayout.get_default_for([4, 16], gl.float32)

    def launch(**flags):
        out = torch.full((4, 16), -1.0)
        desc = TensorDescriptor(source, [6, 16], [16, 1], [4, 16], layout)
        module.kernel[(1,)](desc, out, **{"PARITY": 0, "WAIT": True, "COPY": True, **flags})
        return out
    return launch, source


def test_a_tma_load_lands_for_the_wait_of_its_phase(small_kernel):
    launch, source = small_kernel
    out = launch()
    torch.testing.assert_close(out[:2], source[4:6], atol=0, rtol=0)
    assert bool((out[2:] == 0).all())  # past the tensor's rows: zero fill


def test_a_read_without_the_wait_sees_stale_shared_memory(small_kernel):
    launch, _ = small_kernel
    assert bool((launch(WAIT=False) == 0).all())  # the load never landed
    # a wait for the phase before the load's ("-1", parity 1) passes at once: stale too
    assert bool((launch(PARITY=1) == 0).all())


def test_a_wait_no_partition_can_complete_raises_instead_of_hanging(small_kernel):
    launch, _ = small_kernel
    with pytest.raises(Exception, match="every partition waits forever") as info:
        launch(COPY=False)
    assert "parity 0" in str(info.value)


def test_unknown_inline_ptx_is_refused():
    from flexfa.runtime.gluon_emulator import inline_asm_elementwise
    with pytest.raises(NotImplementedError, match="ex2.approx"):
        inline_asm_elementwise("ex2.approx.f32 $0, $1;", "=f,f", [], None, True, 1)


def test_a_shared_memory_slice_of_no_power_of_two_width_is_refused_as_the_compiler_does():
    """Triton's sm_90 compile refuses a [64, 192] slice of a [64, 256] tile; the emulator had
    run one (E = 192's Q K^T over 192 columns, now two wgmmas of 128 and 64)."""
    import triton.language as tl

    from flexfa.runtime.gluon_emulator import allocate_shared_memory
    tile = allocate_shared_memory(tl.bfloat16, [64, 256], None)
    assert tile.slice(128, 64, dim=1).shape == [64, 64]
    with pytest.raises(ValueError, match="power-of-2.*64, 192"):
        tile.slice(0, 192, dim=1)


# the lines that retire a tile's wgmmas and release the stage they read (swapped below)
_BWD_RETIRE = """        dv, dk, p_op, ds_op = warpgroup_mma_wait(num_outstanding=0,
                                                 deps=(dv, dk, p_op, ds_op))
"""
_BWD_FREE = "        mbarrier.arrive(free.index(stage), count=1)\n"
_FWD_RETIRE = "            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))\n"
_FWD_FREE = "            mbarrier.arrive(v_free.index(prev), count=1)\n"
# mistakes written into the templates: (template, text, replacement, what it breaks)
MUTATIONS = {
    # the consumer's P @ V reads a V stage without waiting for its TMA load
    "fwd_no_v_wait": ("fwd_gluon.tmpl", "            mbarrier.wait(v_ready.index(prev), "
                      "((i + t - 1) // STAGES) & 1)\n", "", "forward"),
    # the K stage's wait for the phase before its load's: passes at once, stale K
    "fwd_k_parity": ("fwd_gluon.tmpl",
                     "mbarrier.wait(k_ready.index(stage), ((i + t) // STAGES) & 1)",
                     "mbarrier.wait(k_ready.index(stage), (((i + t) // STAGES) & 1) ^ 1)",
                     "forward"),
    # both consumers' rows indexed as the first's (the mask and mods see the wrong rows)
    "fwd_rows": ("fwd_gluon.tmpl", "offs_m = q_start + CID * ROWS + gl.arange",
                 "offs_m = q_start + gl.arange", "forward"),
    # the dQ wgmmas read the other dS^T pair
    "bwd_ds_pair": ("bwd_gluon.tmpl",
                    "dq = warpgroup_mma(ds_smem.index((it % 2) * CONSUMERS + c)",
                    "dq = warpgroup_mma(ds_smem.index(((it + 1) % 2) * CONSUMERS + c)",
                    "backward"),
    # the dQ wgmmas go ahead without both consumers' dS^T
    "bwd_ds_full": ("bwd_gluon.tmpl", "mbarrier.wait(ds_full.index(it % 2), (it // 2) & 1)",
                    "mbarrier.wait(ds_full.index(it % 2), ((it // 2) & 1) ^ 1)", "backward"),
    # the stage released before the dV and dK wgmmas reading its Q and dO retired: the
    # producer's refill is issued under them
    "bwd_early_free": ("bwd_gluon.tmpl", _BWD_RETIRE + _BWD_FREE, _BWD_FREE + _BWD_RETIRE,
                       "backward"),
    # the V stage released before the P @ V wgmma reading it retired: the producer's next V
    # load into it is issued under the wgmma
    "fwd_early_v_free": ("fwd_gluon.tmpl", _FWD_RETIRE + _FWD_FREE, _FWD_FREE + _FWD_RETIRE,
                         "forward"),
    # the dQ writer releases its buffers before its TMA reduce-adds have read them: a
    # consumer's next dQ store lands under them (GluonRace)
    "bwd_no_store_wait": ("bwd_gluon.tmpl", "            tma.store_wait(0)\n", "", "backward"),
    # the forward's TMA store of out never waited for: each consumer ends (and with it the
    # program) with the store in flight (GluonRace)
    "fwd_no_store_wait": ("fwd_gluon.tmpl", "    tma.store_wait(0)\n", "", "forward_tma_store"),
    # E = 256: both dQ slices formed from the first slice's keys' columns
    "wide_dq_slice": ("bwd_gluon_wide.tmpl", "k.slice((FIRST_DQ + h) * DQ_SLICE, DQ_SLICE",
                      "k.slice(FIRST_DQ * DQ_SLICE, DQ_SLICE", "wide"),
    # E = 256: the halves of P^T and dS^T read before the other consumer stored its half
    "wide_pds_full": ("bwd_gluon_wide.tmpl", "mbarrier.wait(pds_full.index(0), it & 1)",
                      "mbarrier.wait(pds_full.index(0), (it & 1) ^ 1)", "wide"),
}


def _check(direction: str) -> set[str]:
    """The families that ran (the plans live as long as the block mask); "wide": the
    backward at E = 256."""
    # the forward's last q tile walks 5 kv tiles through a ring of 3 (K and V stages reused)
    L = 640 if direction.startswith("forward") else 384
    q, k, v = make_qkv(1, 2, 2, L, L, 256 if direction == "wide" else 64, dtype=torch.bfloat16)
    mask = flexfa.create_block_mask(mods.causal, None, None, L, L, device="cpu")
    if direction == "forward":
        check_forward(q, k, v, None, mods.causal, mask, kernel_options=EMULATED)
    elif direction == "forward_tma_store":
        check_forward(q, k, v, None, mods.causal, mask,
                      kernel_options={**EMULATED, "GLUON_TMA_STORE": True})
    else:
        check_backward(q, k, v, None, mods.causal, mask, kernel_options=EMULATED)
    return {p.family.name for p in plans.PLANS.values()}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_mistake_in_a_template_fails_the_emulated_family(name, fresh_cache, monkeypatch):
    template, text, replacement, direction = MUTATIONS[name]
    assert load_template(template).count(text) == 1, f"{name}: the template changed"
    real = load_template

    def mutated(which: str) -> str:
        found = real(which)
        return found.replace(text, replacement) if which == template else found
    for module in (codegen_forward, codegen_gluon_bwd):
        monkeypatch.setattr(module, "load_template", mutated)
    plans.PLANS.clear()
    # a wrong result, or a wait no partition completes (raised through the interpreter)
    with pytest.raises((AssertionError, GluonDeadlock, InterpreterError)):
        _check(direction)
    plans.PLANS.clear()


@pytest.mark.parametrize("direction", ["forward", "forward_tma_store", "backward", "wide"])
def test_the_unchanged_templates_pass_the_same_check(direction, fresh_cache):
    plans.PLANS.clear()
    want = {"gluon"} if direction.startswith("forward") else {"gluon", "gluon_bwd"}
    assert _check(direction) == want
    plans.PLANS.clear()
