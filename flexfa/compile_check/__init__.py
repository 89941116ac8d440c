"""``python -m flexfa compile-check --arch 80,90``: compile every template variant for GPU
architectures without a GPU, and print a table.

Each registered variant is a builder ``arch -> CompileJob`` (a compiled-mode kernel, its
signature, constexprs and launch options), registered with ``register(name, builder)``;
``flexfa.compile_check.jobs`` registers every family's, ``head_dims`` the wide and odd
head dims' at their default tiles. The table shows, per (kernel, arch): ok, whether the PTX
uses ``mma.sync`` / ``wgmma``, the registers and spill bytes ``ptxas -v`` reports, how many
local-memory loads and stores lie inside the kernel's tile loops (``loop_local_ops``: the
spills paid on every tile; nvdisasm's SASS), whether ptxas serialized the kernel's wgmmas
(its C7514 / C7515 notices: an instruction reads or defines an accumulator register between
a wgmma and its wait on some path, and ptxas then waits after every wgmma of the function),
and the shared memory Triton allocates per program.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from ..frontend.trace import MASK_MOD, SCORE_MOD, trace
from ..runtime.cache import get_module


@dataclasses.dataclass(frozen=True)
class CompileJob:
    kernel: object  # a compiled-mode triton JITFunction
    signature: dict[str, str]
    constexprs: dict[str, object]
    options: dict[str, int]
    name: str = ""  # the generated kernel's name
    # arguments compiled as multiples of 16 (tt.divisibility), as the runtime specializes
    # 16-byte aligned pointers and such ints: where vector widths decide registers
    divisible: tuple[str, ...] = ()


@dataclasses.dataclass
class CompileResult:
    variant: str
    arch: int
    ok: bool
    mma_sync: bool = False
    wgmma: bool = False
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None  # Triton's compiled.metadata.shared (sm_90: 227 KB fit)
    # ptxas serialized the wgmmas (its C7514 notice: an instruction reads an accumulator of a
    # wgmma in flight; C7515: a non-wgmma instruction defines one between a wgmma and its
    # wait; either way each wgmma then waits for the one before); None: no ptxas to ask
    wgmma_serialized: bool | None = None
    # local-memory loads and stores (SASS LDL / STL) inside the kernel's innermost loops of
    # at least LOOP_MIN_INSTRUCTIONS: the spills a tile loop pays on every tile, where
    # spill_bytes also counts those of code run once (a ragged last tile, a per-head prologue)
    loop_local_ops: int | None = None
    # the opcodes (SASS, suffixes dropped) of the shortest path through the largest innermost
    # tile loop, forward branches taken or not: what a tile that needs no mask or bounds
    # check executes; a mask if-converted into every tile shows here (``tile_path``)
    loop_path: dict[str, int] | None = None
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


def compile_job(variant: str, arch: int, job_builder: Callable[[int], CompileJob],
                loops: bool = False) -> CompileResult:
    """Build and compile one variant for ``sm_<arch>``; errors become a failed result.
    ``loops``: also disassemble the cubin and count ``loop_local_ops`` (about 0.5 s more for
    a large kernel; the command-line table does)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    try:
        job = job_builder(arch)
        source = ASTSource
        if job.kernel.is_gluon():  # imported only for Gluon kernels (never interpreted)
            from triton.experimental.gluon._runtime import GluonASTSource as source
        names = list(job.signature)
        attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in job.divisible}
        compiled = triton.compile(source(job.kernel, job.signature, job.constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32), options=job.options)
        ptx = compiled.asm["ptx"]
        shared = getattr(compiled.metadata, "shared", None)
    except Exception as exc:  # reported in the table, not raised
        return CompileResult(variant, arch, False, seconds=time.perf_counter() - start,
                             error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "k.cubin") if loops else None
        registers, spills, serialized = ptxas_usage(ptx, arch, cubin)
        sass = _disassemble(arch, cubin) if loops else None
    return CompileResult(variant, arch, True, "mma.sync" in ptx, "wgmma" in ptx, registers, spills,
                         shared, serialized, loop_local_ops(sass) if sass else None,
                         tile_path(sass) if sass else None, time.perf_counter() - start,
                         ptx=ptx)


def ptxas_usage(ptx: str, arch: int, cubin: str | None = None
                ) -> tuple[int | None, int | None, bool | None]:
    """(registers, spill store bytes, wgmmas serialized) from ``ptxas -v``, or Nones if
    unavailable; ``cubin``: where to write the binary (for ``_disassemble``)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(arch).path
        suffix = "a" if arch >= 90 else ""
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            result = subprocess.run([ptxas, f"-arch=sm_{arch}{suffix}", "-v", f.name, "-o",
                                     cubin or "/dev/null"], capture_output=True, text=True,
                                    timeout=300)
        text = result.stdout + result.stderr
    except Exception:  # ptxas missing or failing: the table shows "-"
        return None, None, None
    registers = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores", text)
    return (max(map(int, registers)) if registers else None,
            max(map(int, spills)) if spills else None,
            "C7514" in text or "wgmma.mma_async instructions are serialized" in text)


def _disassemble(arch: int, cubin: str) -> str | None:
    """nvdisasm's SASS of ``cubin`` (Triton ships nvdisasm beside ptxas), or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        tool = os.path.join(os.path.dirname(get_ptxas(arch).path), "nvdisasm")
    except Exception:
        return None
    if not os.path.exists(cubin) or not os.path.exists(tool):
        return None
    result = subprocess.run([tool, "-c", cubin], capture_output=True, text=True, timeout=300)
    return result.stdout if result.returncode == 0 else None


LOOP_MIN_INSTRUCTIONS = 64  # smaller loops are barrier waits and spin loops, not tile loops


_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_OPCODE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def _innermost_loops(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line of each innermost loop of at least LOOP_MIN_INSTRUCTIONS
    instructions. A loop: a conditional branch back to an earlier label; an unconditional one
    is how ptxas returns from a block it laid out of line (a barrier's wait), not a loop."""
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := _LABEL.match(line))}
    instruction = [bool(_INSTRUCTION.match(line)) for line in lines]
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"@!?U?P\w+\s+BRA\b.*?(\.L_x_\d+)", line)
        if m and instruction[i] and labels.get(m.group(1), i) < i:
            start = labels[m.group(1)]
            if sum(instruction[start:i + 1]) >= LOOP_MIN_INSTRUCTIONS:
                loops.append((start, i))
    return [(a, b) for a, b in loops
            if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]


def loop_local_ops(sass: str) -> int:
    """The local-memory instructions (LDL, STL) of ``sass`` inside its innermost loops of at
    least LOOP_MIN_INSTRUCTIONS instructions (the tile loops of the attention kernels, where
    a spill costs on every tile)."""
    lines = sass.splitlines()
    innermost = _innermost_loops(lines)
    local = re.compile(r"\b(LDL|STL)\b")
    return sum(1 for i, line in enumerate(lines) if _INSTRUCTION.match(line)
               and local.search(line) and any(a <= i <= b for a, b in innermost))


def tile_path(sass: str) -> dict[str, int] | None:
    """Opcode counts of the shortest path through the largest innermost loop of ``sass``:
    each forward branch inside the loop taken or not, whichever executes fewer instructions
    (a branch out of the loop, a barrier's wait, is not taken). None without such a loop."""
    lines = sass.splitlines()
    loops = _innermost_loops(lines)
    if not loops:
        return None
    first, last = max(loops, key=lambda loop: loop[1] - loop[0])
    labels = {m.group(1): i for i in range(first, last + 1)
              if (m := _LABEL.match(lines[i]))}
    best: dict[int, tuple[int, dict[str, int]]] = {last + 1: (0, {})}
    for i in range(last, first - 1, -1):
        m = _OPCODE.match(lines[i])
        op = m.group(1) if m and _INSTRUCTION.match(lines[i]) else None
        successors = [i + 1]
        if op == "BRA" and i != last:
            target = re.search(r"\((\.L_x_\d+)\)", lines[i])
            conditional = re.match(r"\s*/\*[0-9a-f]+\*/\s+@", lines[i]) is not None
            if target and labels.get(target.group(1), -1) > i:
                successors = [labels[target.group(1)]] + ([i + 1] if conditional else [])
            elif not conditional:
                successors = []
        options = [best[n] for n in successors if n in best]
        if not options:
            continue
        count, ops = min(options, key=lambda option: option[0])
        if op:
            ops = {**ops, op: ops.get(op, 0) + 1}
        best[i] = (count + (1 if op else 0), ops)
    return best[first][1] if first in best else None


def traced_mods(score_mod, mask_mod):
    """(score, mask) TracedMods as the runtime prepares them (None where a mod is None)."""
    return (trace(score_mod, SCORE_MOD) if score_mod else None,
            trace(mask_mod, MASK_MOD) if mask_mod else None)


def kernel_job(spec, score, mask, generate, signature_of) -> CompileJob:
    """The CompileJob of the compiled-mode kernel ``generate(spec, score, mask)`` renders;
    ``signature_of(spec, score, mask)`` gives its (signature, constexprs)."""
    generated = generate(spec, score, mask)
    module = get_module(generated.name, generated.key, False, lambda: generated.source)
    signature, constexprs = signature_of(spec, score, mask)
    return CompileJob(getattr(module, generated.name), signature, constexprs,
                      spec.launch_options(), generated.name)


def format_table(results: list[CompileResult]) -> str:
    header = ["kernel", "arch", "ok", "mma.sync", "wgmma", "serialized", "registers",
              "spills (B)", "in loops", "shared (KB)", "time (s)"]

    def cell(value):
        return "-" if value is None else ("yes" if value is True else "no" if value is False
                                           else str(value))

    rows = [[r.variant, f"sm_{r.arch}", "ok" if r.ok else ("skip" if r.skipped else "FAIL"), cell(r.mma_sync),
             cell(r.wgmma), cell(r.wgmma_serialized if r.wgmma else None), cell(r.registers),
             cell(r.spill_bytes), cell(r.loop_local_ops),
             cell(None if r.shared_bytes is None else round(r.shared_bytes / 1024, 1)),
             f"{r.seconds:.1f}"]
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
    results = [compile_job(name, arch, REGISTRY[name], loops=True) if supports(name, arch)
               else CompileResult(name, arch, False, skipped=True, error="not for this arch")
               for name in names for arch in archs]
    print(format_table(results))
    return 0 if all(r.ok or r.skipped for r in results) else 1


from . import head_dims, jobs  # noqa: E402,F401  (register every family's variants)
