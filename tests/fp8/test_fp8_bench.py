"""The FP8 benchmark entry's row assembly, on CPU tensors with the timer stubbed out."""
import torch
import triton.testing

from flexfa.fp8 import bench


def test_case_rows(monkeypatch):
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: (fn(), 2.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    q, k, v = (torch.randn(1, 1, 64, 32, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        rows = bench._case_rows("full", 64, 32, 1, 1, q, k, v, None, None, 1.0, rep=1,
                                options={"BLOCK_M": 32})
    assert [r["impl"] for r in rows] == ["flexfa-bf16", "flexfa-fp8", "flexfa-fp8+quant",
                                         "flexfa-fp8-tma"]
    for row in rows:
        assert row["ms"] == 2.0 and row["speedup_vs_bf16"] == 1.0
        assert row["tflops"] == 4 * 64 * 64 * 32 / 2.0 / 1e9
    assert rows[0]["relerr_vs_bf16"] == 0.0
    assert all(0 < row["relerr_vs_bf16"] < 0.1 for row in rows[1:])
    assert rows[3]["relerr_vs_bf16"] == rows[1]["relerr_vs_bf16"]  # TMA loads: same values
    bench.print_table(rows + [dict(impl="x", variant="full", S=64, D=32, error="boom")])
