"""GPU: the throughput of tanh.approx.f32 against ex2.approx.f32 (one MUFU instruction each),
so the softcap forward's cost can be read in MUFU cycles (issue 25). Each kernel runs
``ITERS`` dependent steps y = op(y) * a + b on 8 independent values per thread over enough
programs to fill every SM; the time per op is compared with ex2's and with a plain FFMA loop's.

    python benchmarks/experiments/mufu_rate.py
"""
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

ITERS = 512


@triton.jit
def _loop(X, OUT, OP: tl.constexpr, ITERS: tl.constexpr):
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    y = tl.load(X + offs)
    for _ in range(ITERS):
        if OP == 0:
            z = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y],
                                          dtype=tl.float32, is_pure=True, pack=1)
        elif OP == 1:
            z = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [y],
                                          dtype=tl.float32, is_pure=True, pack=1)
        else:
            z = y
        y = z * 0.5 - 0.25
    tl.store(OUT + offs, y)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * 64  # 128 threads each: 8 values a thread
    x = torch.rand(programs * 1024, device="cuda") - 0.5
    out = torch.empty_like(x)
    times = {}
    for name, op in (("tanh", 0), ("ex2", 1), ("ffma", 2)):
        times[name] = do_bench(lambda: _loop[(programs,)](x, out, op, ITERS, num_warps=4),
                               warmup=50, rep=200, return_mode="median")
    ops = programs * 1024 * ITERS
    for name, ms in times.items():
        print(f"{name:5} {ms:8.3f} ms  {ops / ms / 1e6 / sms:8.2f} G elem-steps/s per SM")
    mufu = {k: times[k] - times["ffma"] for k in ("tanh", "ex2")}
    print(f"MUFU time beyond the FFMA loop: tanh {mufu['tanh']:.3f} ms, ex2 {mufu['ex2']:.3f} ms,"
          f" tanh / ex2 = {mufu['tanh'] / mufu['ex2']:.2f}")


if __name__ == "__main__":
    main()
