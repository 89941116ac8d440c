"""The outlier study of docs/fp8.md at a small shape, on the emulated kernels."""
import torch

from flexfa.fp8.accuracy import compare, outlier_inputs


def test_rotation_and_block_scales_halve_plain_fp8_error_on_outliers():
    q, k, v = outlier_inputs(B=1, H=2, L=256, S=200, E=64, seed=0)
    assert q.dtype == torch.bfloat16
    result = compare(q, k, v)
    # issue 7's target: FP8 + rotation + block scales <= 0.5 x plain per-tensor FP8
    assert result["ratio_vs_per_tensor"] <= 0.5, result
    # issue 7 also asks for <= 3 x bf16's error; e4m3 keeps 3 mantissa bits to bf16's 7, so
    # that is out of reach (docs/fp8.md): bound the gap so a regression still shows
    assert result["ratio_vs_bf16"] < 25, result
    assert result["bf16"] < result["fp8_block_rotated"] < result["fp8_per_tensor"]


def test_without_outliers_fp8_stays_near_its_precision():
    q, k, v = outlier_inputs(B=1, H=2, L=128, S=128, E=64, channels=0, seed=1)
    result = compare(q, k, v)
    assert result["fp8_block_rotated"] < 0.1 * result["out_rms"], result
