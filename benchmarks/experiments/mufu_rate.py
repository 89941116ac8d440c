"""GPU: the throughput of the MUFU instructions a softmax and a softcap use, so the softcap
forward's cost can be read in MUFU cycles (issue 25): tanh.approx.f32 and ex2.approx.f32 (one
result an instruction), and the packed tanh.approx.f16x2 / .bf16x2 and ex2.approx.f16x2 (two
results an instruction). Each kernel runs ``ITERS`` dependent steps y = op(y) * a + b on 8
independent values per thread (f32 ops) or 8 pairs (packed ops, the step an HFMA2) over
enough programs to fill every SM; the time per result is compared with the plain FFMA / HFMA2
loop's, and the precision of each tanh against float64 over [-8, 8] is printed.

    python benchmarks/experiments/mufu_rate.py
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

ITERS = 512
# op name -> (asm, element dtype of the loop, results an instruction)
OPS = {
    "tanh": ("tanh.approx.f32 $0, $1;", "f32"),
    "ex2": ("ex2.approx.ftz.f32 $0, $1;", "f32"),
    "ffma": ("", "f32"),
    "tanh_f16x2": ("tanh.approx.f16x2 $0, $1;", "f16"),
    "tanh_bf16x2": ("tanh.approx.bf16x2 $0, $1;", "bf16"),
    "ex2_f16x2": ("ex2.approx.f16x2 $0, $1;", "f16"),
    "hfma2": ("", "f16"),
}
DTYPES = {"f32": (torch.float32, "=f,f", 1), "f16": (torch.float16, "=r,r", 2),
          "bf16": (torch.bfloat16, "=r,r", 2)}


@triton.jit
def _loop(X, OUT, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, PACK: tl.constexpr,
          ITERS: tl.constexpr):
    offs = tl.program_id(0) * 1024 * PACK + tl.arange(0, 1024 * PACK)
    y = tl.load(X + offs)
    for _ in range(ITERS):
        if ASM == "":
            z = y
        else:
            z = tl.inline_asm_elementwise(ASM, CONSTRAINTS, [y], dtype=y.dtype, is_pure=True,
                                          pack=PACK)
        y = z * 0.5 - 0.25
    tl.store(OUT + offs, y)


@triton.jit
def _once(X, OUT, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, PACK: tl.constexpr):
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    y = tl.load(X + offs)
    tl.store(OUT + offs, tl.inline_asm_elementwise(ASM, CONSTRAINTS, [y], dtype=y.dtype,
                                                   is_pure=True, pack=PACK))


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * 64  # 128 threads each: 8 values (or pairs) a thread
    times = {}
    for name, (asm, kind) in OPS.items():
        dtype, constraints, pack = DTYPES[kind]
        x = (torch.rand(programs * 1024 * pack, device="cuda") - 0.5).to(dtype)
        out = torch.empty_like(x)
        times[name] = do_bench(lambda: _loop[(programs,)](x, out, asm, constraints, pack, ITERS,
                                                          num_warps=4),
                               warmup=50, rep=200, return_mode="median")
    for name, ms in times.items():
        pack = DTYPES[OPS[name][1]][2]
        results = programs * 1024 * pack * ITERS
        print(f"{name:12} {ms:8.3f} ms  {results / ms / 1e6 / sms:8.2f} G results/s per SM")
    print("MUFU time per result beyond the plain loop (ms for the same number of results):")
    for name in ("tanh", "ex2", "tanh_f16x2", "tanh_bf16x2", "ex2_f16x2"):
        kind = OPS[name][1]
        base = times["ffma" if kind == "f32" else "hfma2"]
        per = (times[name] - base) / DTYPES[kind][2]
        print(f"  {name:12} {per:8.3f}  ({per / (times['tanh'] - times['ffma']):.2f}x tanh.f32's)")
    x64 = torch.linspace(-8, 8, 1 << 20, dtype=torch.float64, device="cuda")
    exact = torch.tanh(x64)
    for name in ("tanh", "tanh_f16x2", "tanh_bf16x2"):
        asm, kind = OPS[name]
        dtype, constraints, pack = DTYPES[kind]
        x = x64.to(dtype)
        out = torch.empty_like(x)
        _once[(x.numel() // 1024,)](x, out, asm, constraints, pack)
        err = (out.double() - exact).abs()
        print(f"{name:12} max abs error {float(err.max()):.3e}  max error relative to "
              f"|tanh| {float((err / exact.abs().clamp_min(1e-3)).max()):.3e} "
              f"(input rounded to {kind})")


if __name__ == "__main__":
    main()
