"""Kernel families (``flexfa.runtime.registry``): which family a call takes on which target
(fake targets: no GPU needed), the logged choice on a GPU newer than sm_90, forcing a family,
and the one plan cache: a repeated call runs its family's ``run`` (not ``first_call``), and
kernel_options are part of the plan key."""
import logging

import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.errors import InputError
from flexfa.fp8 import flex_attention_fp8, quantize
from flexfa.runtime import plans, registry
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families.ampere import AMPERE
from flexfa.runtime.families.backward import BACKWARD
from flexfa.runtime.families.decode import DECODE
from flexfa.runtime.families.gluon import GLUON
from flexfa.runtime.families.gluon_bwd import GLUON_BWD
from flexfa.runtime.families.fp8 import FP8
from flexfa.runtime.families.hopper import HOPPER
from flexfa.runtime.forward import forward_plan_key
from flexfa.runtime.launch import Step
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.target import INTERPRETER, Target, parse_target, target_of
from forward_utils import make_qkv

SM80, SM89, SM90, SM100 = (Target("cuda", 8, 0), Target("cuda", 8, 9), Target("cuda", 9, 0),
                           Target("cuda", 10, 0))


def _call(options=None, score=None, block_mask=None, mask=None) -> AttentionCall:
    return AttentionCall(score, mask, block_mask, 0.25, parse_kernel_options(options), 1)


def _bf16(L=64, E=64):
    return make_qkv(1, 2, 2, L, L, E, dtype=torch.bfloat16)


def test_targets():
    assert INTERPRETER.name == "interpret" and INTERPRETER.interpret and not INTERPRETER.is_sm90
    assert SM90.name == "cuda:90" and SM90.is_sm90 and not SM90.newer_than_known
    assert not SM100.is_sm90 and SM100.newer_than_known and SM100.name == "cuda:100"
    assert not Target("cuda", 9, 1).is_sm90  # only sm_90 itself has the Hopper instructions
    for target in (INTERPRETER, SM80, SM89, SM90, SM100):
        assert parse_target(target.name) == target
    assert target_of(torch.device("cpu")) is INTERPRETER


def test_a_cuda_tensors_target_is_its_own_gpus(monkeypatch):
    """No GPU here: torch's capability query is faked, cuda:0 an A100 (8.0) and cuda:1 an
    H100 (9.0), cuda:1 current. A tensor's device names its GPU whatever is current; "cuda"
    without an index is the current one; each GPU is asked once."""
    from flexfa.runtime import target as target_module

    asked, current = [], [1]
    capabilities = {0: (8, 0), 1: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda index: asked.append(index) or capabilities[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    target_module._cuda_target.cache_clear()
    try:
        assert target_of(torch.device("cuda", 0)) == SM80
        assert target_of(torch.device("cuda", 1)) == SM90
        assert target_of(torch.device("cuda")) == SM90
        current[0] = 0
        assert target_of(torch.device("cuda")) == SM80
        assert target_of(torch.device("cuda", 1)).is_sm90
        assert asked == [0, 1]
    finally:
        target_module._cuda_target.cache_clear()


def test_registered_families():
    # in order of preference; the Gluon forward only in the classes where it measured faster,
    # the Gluon backward only with GLUON_BACKWARD=True
    assert registry.families("forward") == (DECODE, GLUON, HOPPER, AMPERE)
    assert registry.families("backward") == (GLUON_BWD, BACKWARD)
    assert registry.families("fp8") == (FP8,)
    assert (HOPPER.name, AMPERE.name, BACKWARD.name, FP8.name) == (
        "hopper", "ampere", "triton_bwd", "fp8")


@pytest.mark.parametrize("target, dtype, family", [
    (INTERPRETER, torch.bfloat16, AMPERE), (SM80, torch.bfloat16, AMPERE),
    (SM89, torch.float16, AMPERE), (SM90, torch.bfloat16, HOPPER),
    (SM90, torch.float16, HOPPER), (SM90, torch.float32, AMPERE)])
def test_hopper_only_on_sm90_by_default(target, dtype, family):
    q, k, v = make_qkv(1, 2, 2, 64, 64, 64, dtype=dtype)
    assert registry.choose("forward", target, _call(), q, k, v) is family


def test_what_keeps_an_sm90_call_off_the_hopper_family():
    q, k, v = _bf16()
    assert registry.choose("forward", SM90, _call({"USE_TMA": False}), q, k, v) is AMPERE
    assert registry.choose("forward", SM90, _call({"fwd_USE_TMA": False}), q, k, v) is AMPERE
    assert registry.choose("forward", SM90, _call({"BACKEND": "AMPERE"}), q, k, v) is AMPERE
    assert registry.choose("forward", SM90, _call({"bwd_USE_TMA": False}), q, k, v) is HOPPER
    wide = make_qkv(1, 2, 2, 64, 64, 256, dtype=torch.bfloat16)  # E = MAX_HEAD_DIM
    assert registry.choose("forward", SM90, _call(), *wide) is HOPPER
    narrow = make_qkv(1, 2, 2, 64, 64, 4, dtype=torch.bfloat16)  # 8-byte rows
    assert registry.choose("forward", SM90, _call(), *narrow) is AMPERE
    # [B, L, H, E] memory: heads side by side in rows, which the strided layout reads
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert registry.choose("forward", SM90, _call(), *strided) is HOPPER
    columns = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in (q, k, v)]  # dim strided
    assert registry.choose("forward", SM90, _call(), *columns) is AMPERE
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view_as(q)  # 2 bytes off
    assert registry.choose("forward", SM90, _call(), unaligned, k, v) is AMPERE


def test_hopper_under_the_interpreter_only_when_forced():
    q, k, v = _bf16()
    for forcing in ({"BACKEND": "HOPPER"}, {"USE_TMA": True}, {"fwd_USE_TMA": True}):
        assert registry.choose("forward", INTERPRETER, _call(forcing), q, k, v) is HOPPER
    assert HOPPER.why_not(INTERPRETER, _call(), q, k, v).startswith("it runs on sm_90")
    assert AMPERE.why_not(INTERPRETER, _call(), q, k, v) is None


def test_a_newer_gpu_takes_the_ampere_family_and_logs_the_choice(monkeypatch, caplog):
    monkeypatch.setattr(registry, "_LOGGED", set())
    q, k, v = _bf16()
    with caplog.at_level(logging.WARNING, logger="flexfa"):
        for _ in range(2):
            assert registry.choose("forward", SM100, _call(), q, k, v) is AMPERE
            assert registry.choose("backward", SM100, _call(), q, k, v) is BACKWARD
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2, messages  # once per target and family
    forward, backward = messages
    assert "cuda:100 is newer than the GPUs" in forward
    assert "forward calls use the ampere family" in forward
    assert "backward calls use the triton_bwd family" in backward
    assert "BACKEND" in forward  # how to choose another
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flexfa"):
        registry.choose("forward", SM90, _call(), q, k, v)
        registry.choose("forward", SM80, _call(), q, k, v)
    assert not caplog.records  # known targets: nothing to log


def test_forcing_the_hopper_family_on_a_newer_gpu_names_the_reason():
    q, k, v = _bf16()
    with pytest.raises(InputError, match="BACKEND='HOPPER' cannot run this call: it runs on "
                                         "sm_90 .*not cuda:100"):
        registry.choose("forward", SM100, _call({"BACKEND": "HOPPER"}), q, k, v)


def test_no_family_for_the_call_names_every_reason():
    """USE_TMA=True where no tensor-descriptor family runs: the Hopper family needs sm_90, the
    Ampere family does not use descriptors; refused, not silently ignored."""
    q, k, v = _bf16()
    with pytest.raises(InputError, match=r"no forward kernel family runs this call on cuda:80: "
                                         r"decode: .*; hopper: it runs on sm_90.*; ampere: kernel_options "
                                         r"USE_TMA=True"):
        registry.choose("forward", SM80, _call({"USE_TMA": True}), q, k, v)


def test_the_backward_and_fp8_families_ignore_a_forward_backend():
    q, k, v = _bf16()
    for target in (INTERPRETER, SM80, SM90):
        for options in (None, {"BACKEND": "HOPPER"}, {"BACKEND": "AMPERE"}):
            assert registry.choose("backward", target, _call(options), q, k, v) is BACKWARD
    x = quantize(q, k, v)
    assert registry.choose("fp8", INTERPRETER, _call({"BACKEND": "HOPPER"}), x) is FP8


class _Spy:
    """Wraps a family's ``first_call`` and ``run`` (instance attributes) to record which
    ran; ``run`` inside ``first_call`` is recorded as ``first_call``'s."""

    def __init__(self, monkeypatch, family):
        self.events = []
        inside = []
        first_call, run = family.first_call, family.run

        def spy_first_call(*args, **kwargs):
            self.events.append("first_call")
            inside.append(1)
            try:
                return first_call(*args, **kwargs)
            finally:
                inside.pop()

        def spy_run(*args, **kwargs):
            if not inside:
                self.events.append("run")
            return run(*args, **kwargs)
        monkeypatch.setattr(family, "first_call", spy_first_call)
        monkeypatch.setattr(family, "run", spy_run)

    def take(self) -> list:
        events, self.events[:] = list(self.events), []
        return events


@pytest.mark.parametrize("family, dtype", [(AMPERE, torch.float32), (HOPPER, torch.bfloat16)])
def test_a_repeated_forward_runs_the_plan(family, dtype, monkeypatch):
    """The first call of a signature plans (``first_call``), the next ones run the plan;
    kernel_options are part of the key: other options plan again, equal ones (another dict,
    or a spelling that parses the same) reuse the plan."""
    spy = _Spy(monkeypatch, family)
    q, k, v = make_qkv(1, 2, 2, 48, 80, 16, dtype=dtype, seed=3)
    mask = flexfa.create_block_mask(mods.causal, None, None, 48, 80, device="cpu",
                                    BLOCK_SIZE=32)
    forced = {"BACKEND": family.name.upper()}

    def call(**options):
        return flexfa.flex_attention(q, k, v, score_mod=mods.softcap(7.0), block_mask=mask,
                                     kernel_options={**forced, **options})
    first = call()
    assert spy.take() == ["first_call"]
    plan = plans.find(_planned_call(forced, mask), _key(q, k, v, forced, mask))
    assert plan.family is family and len(plan.steps) == 1 and isinstance(plan.steps[0], Step)
    assert torch.equal(call(), first) and spy.take() == ["run"]
    assert torch.equal(call(PRESCALE_QK=False), first) and spy.take() == ["run"]  # a hint
    call(BLOCK_N=16)
    assert spy.take() == ["first_call"]  # another tile: another plan
    call(BLOCK_N=16)
    assert spy.take() == ["run"]
    call(fp32_precision="tf32")
    assert spy.take() == ["first_call"]


def _planned_call(options, mask) -> AttentionCall:
    from flexfa.runtime.pipeline import prepare_mask, prepare_score_mod

    return AttentionCall(prepare_score_mod(mods.softcap(7.0)), prepare_mask(mask), mask,
                         0.25, parse_kernel_options(options), 1)


def _key(q, k, v, options, mask) -> tuple:
    return forward_plan_key(q, k, v, _planned_call(options, mask), False, False)


def test_kernel_options_are_part_of_the_plan_key():
    q, k, v = _bf16()
    key = forward_plan_key(q, k, v, _call(), False, False)
    assert forward_plan_key(q, k, v, _call({}), False, False) == key
    assert forward_plan_key(q, k, v, _call({"BACKEND": "TRITON"}), False, False) == key
    for options in ({"BLOCK_M": 32}, {"fwd_USE_TMA": False}, {"bwd_BLOCK_M1": 16},
                    {"DS_WORKSPACE": True}, {"BACKEND": "AMPERE"}, {"deterministic": True},
                    {"SPLIT_KV": 2}):
        assert forward_plan_key(q, k, v, _call(options), False, False) != key, options


# a value other than the default of every kernel_options key
NOT_DEFAULT = {
    "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 16, "BLOCK_N1": 16, "BLOCK_M2": 16, "BLOCK_N2": 16,
    "num_warps": 2, "num_stages": 2, "maxnreg": 128, "USE_TMA": True, "BACKEND": "HOPPER",
    "deterministic": True, "fp32_precision": "tf32", "SPLIT_KV": 2, "DECODE_WALK": "MEMBERS",
    "BWD_FULL_WALK": True, "DS_WORKSPACE": True, "DS_MAX_BYTES": 2 ** 20,
    "GLUON_BACKWARD": False, "GLUON_PINGPONG": True, "GLUON_TMA_STORE": True,
    "GLUON_PERSISTENT": "DYNAMIC", "HEAD_GROUP": 2, "GLUON_STATIC_MAX": False,
    "GLUON_QK_TRIM": False, "GLUON_BWD_QK_TRIM": False, "GLUON_BWD_STAGES": 2,
    "GLUON_BWD_EARLY_DP": True, "GLUON_BWD_DQ_CHUNKS": 2, "GLUON_BWD_OVERLAP": False,
    "GLUON_EMULATE": True}


@pytest.mark.parametrize("name", sorted(NOT_DEFAULT))
def test_every_option_is_part_of_the_plan_keys(name):
    """Changing one option, and only it, never finds the plan of another value, whatever
    family the option concerns: the layout key (``plans.layout_key``, which the forward's,
    the backward's and the FP8 forward's plan keys extend) holds the parsed options."""
    from flexfa.runtime.options import SCHEMA
    assert set(NOT_DEFAULT) == set(SCHEMA)  # a new key gets a value here
    q, k, v = _bf16()
    options = {name: NOT_DEFAULT[name]}
    assert parse_kernel_options(options) != parse_kernel_options(None)
    assert forward_plan_key(q, k, v, _call(options), False, False) != \
        forward_plan_key(q, k, v, _call(), False, False)


def test_a_repeated_backward_runs_the_plan(monkeypatch):
    spy = _Spy(monkeypatch, BACKWARD)
    q, k, v = make_qkv(1, 2, 2, 40, 40, 16, seed=4)

    def grads(**options):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flexfa.flex_attention(*leaves, score_mod=mods.softcap(9.0),
                                    kernel_options={"BLOCK_M": 32, **options})
        return torch.autograd.grad(out.sum(), leaves)
    first = grads()
    assert spy.take() == ["first_call"]
    for a, b in zip(first, grads()):
        assert torch.equal(a, b)
    assert spy.take() == ["run"]
    grads(bwd_BLOCK_N1=16)  # a backward option: another backward plan
    assert spy.take() == ["first_call"]


def test_a_repeated_fp8_call_runs_the_plan(monkeypatch):
    spy = _Spy(monkeypatch, FP8)
    x = quantize(*make_qkv(1, 2, 2, 40, 72, 32, dtype=torch.bfloat16, seed=5), block_size=32)
    first = flex_attention_fp8(x)
    assert spy.take() == ["first_call"]
    assert torch.equal(flex_attention_fp8(x), first) and spy.take() == ["run"]
    flex_attention_fp8(x, kernel_options={"USE_TMA": True})
    assert spy.take() == ["first_call"]
