"""GLUON_EXP2_POLY: the Gluon forward computes one softmax exp2 in 2 or 4 by a polynomial on
the FMA pipes (helpers.tmpl's ``flexfa_exp2_poly``, inline PTX: compiled only). Its steps run
here in torch, bit for bit as the PTX does them in float32, with the template's constants, so
the accuracy and the special values are checked without a GPU; the option's validation and
the kernel it selects are checked on the CPU; the sm_90 compile is in test_gluon_compile.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import flexfa
from flexfa.codegen.gluon import gluon_kernel
from flexfa.runtime.call import AttentionCall
from flexfa.runtime.families.gluon import gluon_spec
from flexfa.runtime.options import parse_kernel_options
from flexfa.runtime.pipeline import prepare_mask, prepare_score_mod
from flexfa.runtime.target import Target

HELPERS = Path(flexfa.__file__).parent / "codegen" / "templates" / "helpers.tmpl"
SM90 = Target("cuda", 9, 0)


def _bits(hex_word: str) -> float:
    return torch.tensor(int(hex_word, 16), dtype=torch.int64).to(torch.int32).view(
        torch.float32).item()


def _asm(every: int) -> str:
    """The PTX the template builds for ``every`` (its ``flexfa_exp2_poly_asm``, run here)."""
    text = HELPERS.read_text()
    namespace = {}
    exec(text[text.index("def flexfa_exp2_poly_asm"):text.index("FLEXFA_EXP2_POLY_ASM_2 =")],
         namespace)
    return namespace["flexfa_exp2_poly_asm"](every)


def _constants(every: int = 2) -> dict[str, list[float]]:
    """The float32 constants of each instruction kind in the asm for ``every``."""
    found = {}
    for op, *words in re.findall(r"(add\.rn\.f32|sub\.rn\.f32|fma\.rn\.f32|setp\.lt\.f32)"
                                 r"[^;]*?((?:0f[0-9A-F]{8}[,;\s]*)+)", _asm(every)):
        found.setdefault(op, []).extend(_bits(w[2:]) for w in re.findall(r"0f[0-9A-F]{8}",
                                                                        words[0]))
    return found


def exp2_poly(x: torch.Tensor) -> torch.Tensor:
    """The asm's steps on float32 ``x``, bit for bit (round-to-nearest float32 arithmetic;
    each fma.rn is one rounding, done here in float64 and rounded once)."""
    c = _constants()
    magic = c["add.rn.f32"][0]
    c3, c2, c1, c0 = c["fma.rn.f32"]
    lowest = c["setp.lt.f32"][0]
    j = x + magic
    f = x - (j - magic)
    fma = lambda a, b, d: (a.double() * b.double() + d).float()  # noqa: E731
    p = fma(fma(fma(f, torch.full_like(f, c3), c2), f, c1), f, c0)
    shifted = (j.view(torch.int32).to(torch.int64) << 23) & 0xFFFFFFFF
    bits = (p.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) + shifted
    out = (bits & 0xFFFFFFFF).to(torch.int32).view(torch.float32)  # wraps as add.s32 does
    out = torch.where(x < lowest, torch.zeros_like(out), out)
    return torch.where(torch.isnan(x), x, out)


def test_the_asm_has_the_constants_this_test_reads():
    c = _constants()
    assert c["add.rn.f32"] == [12582912.0] and c["sub.rn.f32"] == [12582912.0]
    assert len(c["fma.rn.f32"]) == 4 and c["setp.lt.f32"] == [-125.0]
    assert _constants(4) == c
    for every in (2, 4):  # ex2.approx on the first every - 1 inputs, outputs written last
        asm = _asm(every)
        assert [f"${every + i}" for i in range(every - 1)] == re.findall(
            r"ex2\.approx\.ftz\.f32 e\d+, (\$\d+);", asm)
        assert asm.count(f"${2 * every - 1}") == 5  # x: add, sub, setp, testp, selp
        lines = asm.splitlines()
        reads = [n for n, line in enumerate(lines)
                 if any(f"${every + i}" in line for i in range(every))]
        writes = [n for n, line in enumerate(lines) for i in range(every)
                  if re.match(rf"\S+ \${i}, ", line)]
        assert len(writes) == every and min(writes) >= max(reads), asm


def test_polynomial_exp2_is_within_1e4_relative_over_the_softmax_range():
    x = torch.cat([torch.linspace(-125, 0, 2_000_001), torch.linspace(-1, 0, 100_001),
                   torch.tensor([0.0, -0.5, 0.5 - 2**-24, -0.5 - 2**-23, 1e-7, 2e-3])])
    got = exp2_poly(x).double()
    want = torch.exp2(x.double())
    rel = ((got - want).abs() / want).max().item()
    assert rel < 1e-4, rel
    assert got.min() > 0


def test_polynomial_exp2_special_values():
    x = torch.tensor([-float("inf"), -1e30, -126.0, -125.5, float("nan")])
    got = exp2_poly(x)
    assert got[:4].tolist() == [0.0, 0.0, 0.0, 0.0]  # below -125: 0, as the mask needs
    assert torch.isnan(got[4])


def _call(options):
    return AttentionCall(prepare_score_mod(None), prepare_mask(None), None, 0.125,
                         parse_kernel_options(options), 1)


@pytest.mark.parametrize("bad", [1, 3, 8, -2])
def test_bad_values_are_refused_by_name(bad):
    with pytest.raises(flexfa.InputError, match=r"GLUON_EXP2_POLY.*0 \(default\), 2 or 4"):
        parse_kernel_options({"GLUON_EXP2_POLY": bad})
    with pytest.raises(TypeError, match="GLUON_EXP2_POLY"):
        parse_kernel_options({"GLUON_EXP2_POLY": True})


def test_the_option_reaches_the_kernel_and_its_key():
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    specs = {every: gluon_spec(q, q, q, _call({"BACKEND": "GLUON", "GLUON_EXP2_POLY": every}),
                               SM90, True, False) for every in (0, 2, 4)}
    assert [spec.exp2_poly for spec in specs.values()] == [0, 2, 4]
    kernels = {every: gluon_kernel(spec, None, None) for every, spec in specs.items()}
    assert len({kernel.key for kernel in kernels.values()}) == 3
    for every, kernel in kernels.items():
        assert f"EXP2_POLY = tl.constexpr({every})" in kernel.source.splitlines()
