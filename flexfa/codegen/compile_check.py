"""``python -m flexfa compile-check --arch 80,90``: compile every template variant for GPU
architectures without a GPU, and print a table.

Each registered variant is a builder ``arch -> CompileJob`` (a compiled-mode kernel, its
signature, constexprs and launch options). Other templates register theirs with
``register(name, builder)``; this module registers the forward kernel's. The table shows, per
(kernel, arch): ok, whether the PTX uses ``mma.sync`` / ``wgmma``, and the registers and
spill bytes ``ptxas -v`` reports.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from ..frontend.trace import MASK_MOD, SCORE_MOD, trace


@dataclasses.dataclass(frozen=True)
class CompileJob:
    kernel: object  # a compiled-mode triton JITFunction
    signature: dict[str, str]
    constexprs: dict[str, object]
    options: dict[str, int]
    name: str = ""  # the generated kernel's name


@dataclasses.dataclass
class CompileResult:
    variant: str
    arch: int
    ok: bool
    mma_sync: bool = False
    wgmma: bool = False
    registers: int | None = None
    spill_bytes: int | None = None
    seconds: float = 0.0
    error: str = ""
    skipped: bool = False  # the variant does not target this arch
    ptx: str = dataclasses.field(default="", repr=False)


REGISTRY: dict[str, Callable[[int], CompileJob]] = {}
ARCHS: dict[str, tuple[int, ...]] = {}  # variants limited to some archs (FP8: sm_90 and up)


def register(name: str, builder: Callable[[int], CompileJob] | None = None,
             archs: tuple[int, ...] | None = None):
    """Register ``builder`` (arch -> CompileJob) as variant ``name``; usable as a decorator.
    ``archs`` limits it to those SM versions (others show as skipped)."""
    def add(fn):
        assert name not in REGISTRY, f"compile-check variant {name!r} registered twice"
        REGISTRY[name] = fn
        if archs is not None:
            ARCHS[name] = tuple(archs)
        return fn
    return add(builder) if builder is not None else add


def supports(name: str, arch: int) -> bool:
    return name not in ARCHS or arch in ARCHS[name]


def compile_job(variant: str, arch: int, job_builder: Callable[[int], CompileJob]) -> CompileResult:
    """Build and compile one variant for ``sm_<arch>``; errors become a failed result."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    try:
        job = job_builder(arch)
        compiled = triton.compile(ASTSource(job.kernel, job.signature, job.constexprs),
                                  target=GPUTarget("cuda", arch, 32), options=job.options)
        ptx = compiled.asm["ptx"]
    except Exception as exc:  # reported in the table, not raised
        return CompileResult(variant, arch, False, seconds=time.perf_counter() - start,
                             error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    registers, spills = ptxas_usage(ptx, arch)
    return CompileResult(variant, arch, True, "mma.sync" in ptx, "wgmma" in ptx, registers, spills,
                         time.perf_counter() - start, ptx=ptx)


def ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spill store bytes) from ``ptxas -v``, or (None, None) if unavailable."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(arch).path
        suffix = "a" if arch >= 90 else ""
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            result = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", f.name, "-o",
                                     "/dev/null"], capture_output=True, text=True, timeout=300)
        text = result.stdout + result.stderr
    except Exception:  # ptxas missing or failing: the table shows "-"
        return None, None
    registers = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    return (max(map(int, registers)) if registers else None,
            max(map(int, spills)) if spills else None)


# ---- the forward template's variants -------------------------------------------------------

def _slopes_mod():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()
    return alibi


def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _document_mask():
    doc = torch.zeros(4096, dtype=torch.int32)

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    return document


def _global_tokens_mask():
    is_global = torch.zeros(4096, dtype=torch.bool)

    def global_or_causal(b, h, q_idx, kv_idx):
        return is_global[kv_idx] | (q_idx >= kv_idx)
    return global_or_causal


def forward_job(head_dim: int, dtype: str, score_mod=None, mask_mod=None, head_dim_v=None,
                return_lse: bool = True, return_max: bool = False, split_keys: int = 0
                ) -> Callable[[int], CompileJob]:
    """A builder compiling the forward kernel for these mods at default GPU tiles
    (``split_keys``: split-KV decoding's variant)."""
    def build(arch: int) -> CompileJob:
        from ..runtime.families.ampere import default_tiles
        from ..runtime.target import parse_target
        from .forward import forward_kernel, forward_signature
        from .spec import TORCH_DTYPES, KernelSpec, next_power_of_two

        score, mask = traced_mods(score_mod, mask_mod)
        block_m, block_n, warps, stages = default_tiles(
            next_power_of_two(head_dim), TORCH_DTYPES[dtype], parse_target(f"cuda:{arch}"))
        spec = KernelSpec(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v or head_dim,
                          block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                          has_block_mask=mask is not None, has_full_blocks=mask is not None,
                          sparse_q=128 if mask else block_m, sparse_kv=128 if mask else block_n,
                          even_l=False, even_s=False, return_lse=return_lse, gqa_group=1,
                          input_precision="ieee", target=f"cuda:{arch}", return_max=return_max,
                          split_keys=split_keys)
        return kernel_job(spec, score, mask, forward_kernel, forward_signature)
    return build


def traced_mods(score_mod, mask_mod):
    """(score, mask) TracedMods as the runtime prepares them (None where a mod is None)."""
    return (trace(score_mod, SCORE_MOD) if score_mod else None,
            trace(mask_mod, MASK_MOD) if mask_mod else None)


def kernel_job(spec, score, mask, generate, signature_of) -> CompileJob:
    """The CompileJob of the compiled-mode kernel ``generate(spec, score, mask)`` renders;
    ``signature_of(spec, score, mask)`` gives its (signature, constexprs)."""
    from ..runtime.cache import get_module

    generated = generate(spec, score, mask)
    module = get_module(generated.name, generated.key, False, lambda: generated.source)
    signature, constexprs = signature_of(spec, score, mask)
    return CompileJob(getattr(module, generated.name), signature, constexprs,
                      spec.launch_options(), generated.name)


register("fwd_d64_bf16_dense", forward_job(64, "bf16", return_lse=False))
register("fwd_d128_bf16_causal", forward_job(128, "bf16", mask_mod=_causal))
# with the rows' max scores too (AuxRequest(max_scores=True))
register("fwd_d128_fp16_softcap", forward_job(128, "fp16", score_mod=_softcap, return_max=True))
register("fwd_d64_fp16_alibi_document", forward_job(64, "fp16", score_mod=_slopes_mod(),
                                                     mask_mod=_document_mask()))
register("fwd_d80_bf16_ev48_causal", forward_job(80, "bf16", mask_mod=_causal, head_dim_v=48))
register("fwd_d256_bf16_dense", forward_job(256, "bf16"))
register("fwd_d128_bf16_causal_split", forward_job(128, "bf16", mask_mod=_causal,
                                                   return_max=True, split_keys=4096))
register("fwd_d64_bf16_bool_table", forward_job(64, "bf16", mask_mod=_global_tokens_mask()))


def _load_other_variants() -> None:
    """Import modules of other templates so their ``register`` calls run (optional ones)."""
    import importlib
    for module in ("flexfa.codegen.backward", "flexfa.codegen.hopper", "flexfa.codegen.fp8"):
        try:
            importlib.import_module(module)
        except ImportError:
            continue


def format_table(results: list[CompileResult]) -> str:
    header = ["kernel", "arch", "ok", "mma.sync", "wgmma", "registers", "spills (B)", "time (s)"]

    def cell(value):
        return "-" if value is None else ("yes" if value is True else "no" if value is False
                                           else str(value))

    rows = [[r.variant, f"sm_{r.arch}", "ok" if r.ok else ("skip" if r.skipped else "FAIL"), cell(r.mma_sync),
             cell(r.wgmma), cell(r.registers), cell(r.spill_bytes), f"{r.seconds:.1f}"]
            for r in results]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [header, ["-" * w for w in widths], *rows]]
    errors = [f"  {r.variant} sm_{r.arch}: {r.error}" for r in results
              if not r.ok and not r.skipped]
    return "\n".join(lines + (["", "errors:", *errors] if errors else []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexfa compile-check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="comma-separated SM versions (80,90)")
    parser.add_argument("--only", default="", help="only variants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the variants and exit")
    args = parser.parse_args(argv)
    _load_other_variants()
    names = [n for n in REGISTRY if args.only in n]
    if args.list:
        print("\n".join(names))
        return 0
    try:
        archs = [int(a) for a in args.arch.split(",") if a.strip()]
    except ValueError:
        print(f"--arch must be comma-separated integers like 80,90, got {args.arch!r}",
              file=sys.stderr)
        return 2
    results = [compile_job(name, arch, REGISTRY[name]) if supports(name, arch)
               else CompileResult(name, arch, False, skipped=True, error="not for this arch")
               for name in names for arch in archs]
    print(format_table(results))
    return 0 if all(r.ok or r.skipped for r in results) else 1
