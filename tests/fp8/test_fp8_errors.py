"""Clear, early errors of the FP8 path."""
import dataclasses
import re

import pytest
import torch

import flexfa
from flexfa.errors import InputError, InputTypeError
from flexfa.fp8 import FP8UnsupportedError, flex_attention_fp8, quantize
from flexfa.fp8.checks import check_fp8_device


def _qkv(dtype=torch.bfloat16, L=40, S=40, E=32):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, n, E, generator=generator).to(dtype) for n in (L, S, S)]


def test_backward_is_not_supported():
    q, k, v = _qkv()
    q.requires_grad_(True)
    with pytest.raises(FP8UnsupportedError, match="forward-only.*query requires grad"):
        flex_attention_fp8(q, k, v)
    with pytest.raises(NotImplementedError):  # the builtin class callers may catch
        flex_attention_fp8(q, k, v)
    with torch.no_grad():
        assert flex_attention_fp8(q, k, v).shape == q.shape


def test_captured_tensor_requiring_grad():
    q, k, v = _qkv()
    bias = torch.zeros(2, requires_grad=True)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    with pytest.raises(FP8UnsupportedError, match="captured tensor requires grad"):
        flex_attention_fp8(q, k, v, score_mod=head_bias)


def test_fp8inputs_tensors_requiring_grad():
    """A hand-built FP8Inputs whose scales (or values) require grad is refused like bf16 inputs
    that do (the output had no grad_fn: the gradient was silently lost)."""
    x = quantize(*_qkv())
    learned = dataclasses.replace(x, q_scale=x.q_scale.clone().requires_grad_(True))
    with pytest.raises(FP8UnsupportedError, match="FP8Inputs.q_scale requires grad"):
        flex_attention_fp8(learned)
    with torch.no_grad():
        assert flex_attention_fp8(learned).shape == x.q.shape


def test_mask_captured_tensor_requiring_grad():
    """As flex_attention, a mask_mod's captured tensor that requires grad is an error."""
    q, k, v = _qkv()
    keep = torch.ones(40, requires_grad=True)

    def gate(b, h, q_idx, kv_idx):
        return keep[kv_idx] > 0

    mask = flexfa.create_block_mask(gate, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(FP8UnsupportedError, match="a mask_mod captured tensor requires grad"):
        flex_attention_fp8(q, k, v, block_mask=mask, block_size=16)


def test_mixing_bf16_and_fp16():
    """Which dtype would the output take? flex_attention refuses the mix; so do these (the
    output silently took value's dtype)."""
    q, k, v = _qkv()
    for args in ((q, k.half(), v), (q, k, v.half())):
        with pytest.raises(InputError, match="has dtype torch.float16 but query has torch.bfloat16"):
            flex_attention_fp8(*args)
        with pytest.raises(InputError, match="must share one dtype"):
            quantize(*args)


def test_fp8inputs_with_keys_of_batch_one():
    """k and v of batch 1 under a query of batch 2 (scales expanded to pass the shape check)
    are named: the kernel indexed them with the query's batch index, past the tensor's end
    (garbage on a CPU, an out-of-bounds read on a GPU)."""
    q, k, v = _qkv()
    x = quantize(q.expand(2, -1, -1, -1), k, v)
    one = quantize(q, k, v)
    shared = dataclasses.replace(x, k=one.k, v=one.v)
    with pytest.raises(InputError, match="FP8Inputs.k and .v have batch size 1 but q has 2"):
        flex_attention_fp8(shared)


def test_positive_scales_must_be_a_bool():
    """positive_scales decides whether the kernel folds the descales into exp2's FMA (wrong
    for descales <= 0): "no" or 0 was read by truthiness."""
    x = quantize(*_qkv())
    for flag in ("no", 1, None):
        with pytest.raises(InputTypeError, match="FP8Inputs.positive_scales must be a bool"):
            flex_attention_fp8(dataclasses.replace(x, positive_scales=flag))


def test_sparse_scales():
    x = quantize(*_qkv())
    with pytest.raises(InputError, match="k_scale has layout torch.sparse_coo"):
        flex_attention_fp8(dataclasses.replace(x, k_scale=x.k_scale.to_sparse()))


def test_mixing_fp8_and_bf16():
    q, k, v = _qkv()
    with pytest.raises(InputError, match="mix FP8.*key torch.float8_e4m3fn"):
        flex_attention_fp8(q, k.to(torch.float8_e4m3fn), v)


def test_fp8_tensors_without_scales():
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv())
    with pytest.raises(InputError, match="without their scales"):
        flex_attention_fp8(q, k, v)


def test_fp8inputs_with_key_or_value():
    q, k, v = _qkv()
    with pytest.raises(InputError, match="key=None"):
        flex_attention_fp8(quantize(q, k, v), k, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_other_input_dtypes(dtype):
    q, k, v = _qkv(dtype)
    with pytest.raises(InputTypeError, match=f"query has dtype {dtype}"):
        flex_attention_fp8(q, k, v)


def test_non_e4m3_fp8():
    x = quantize(*_qkv())
    e5m2 = dataclasses.replace(x, k=x.k.float().to(torch.float8_e5m2))
    with pytest.raises(FP8UnsupportedError, match="float8_e5m2.*e4m3fn only"):
        flex_attention_fp8(e5m2)


@pytest.mark.parametrize("field,shape", [("q_scale", (1, 2, 2)), ("k_scale", (1, 1, 1)),
                                         ("v_scale", (2, 1))])
def test_scales_of_the_wrong_shape(field, shape):
    x = quantize(*_qkv())
    bad = dataclasses.replace(x, **{field: torch.ones(shape)})
    with pytest.raises(InputError, match=re.escape(f"{field} has shape {shape}; expected")):
        flex_attention_fp8(bad)


def test_scales_of_the_wrong_dtype():
    x = quantize(*_qkv())
    with pytest.raises(InputTypeError, match="k_scale has dtype torch.float16"):
        flex_attention_fp8(dataclasses.replace(x, k_scale=x.k_scale.half()))


@pytest.mark.parametrize("options", [{"BACKEND": "GLUON"}, {"BACKEND": "DECODE"},
                                     {"SPLIT_KV": 4}, {"DECODE_WALK": "MEMBERS"},
                                     {"BLOCK_M1": 32}, {"bwd_BLOCK_M": 32}])
def test_kernel_options_the_fp8_kernel_does_not_read(options):
    """A forced family, SPLIT_KV, the backward's tiles: flex_attention_fp8 took them and ran
    its one kernel, silently; they are InputErrors naming the key. Its own keys run."""
    x = quantize(*_qkv())
    with pytest.raises(InputError, match=rf"kernel_options\['{next(iter(options))}'\] does "
                                         "not apply to flex_attention_fp8"):
        flex_attention_fp8(x, kernel_options=options)
    flex_attention_fp8(x, kernel_options={"BACKEND": "AUTO", "fwd_BLOCK_M": 16,
                                          "num_warps": 4, "BLOCK_N": None})
    # torch's hints and foreign backends change nothing anywhere: accepted as elsewhere
    flex_attention_fp8(x, kernel_options={"PRESCALE_QK": False, "BACKEND": "FLASH",
                                          "ROWS_GUARANTEED_SAFE": False})


@pytest.mark.parametrize("block_size", [0, 12, 48, (16, 24), (16,), "64", 2 ** 17,
                                        (16, 2 ** 40)])
def test_bad_block_sizes(block_size):
    """Past 2**16 rows a block was accepted: 2**31 overflowed the kernel's int32 offsets
    (an interpreter error), 2**40 asked the allocator for terabytes."""
    with pytest.raises((InputError, InputTypeError), match="block_size"):
        quantize(*_qkv(), block_size=block_size)


def test_an_enormous_rotation_is_an_input_error():
    from flexfa.fp8 import random_signs
    with pytest.raises(InputError, match="a power of two up to 65536"):
        random_signs(2 ** 40)


def test_quantize_rejects_fp8_and_bad_shapes():
    q, k, v = _qkv()
    with pytest.raises(InputError, match="already torch.float8_e4m3fn"):
        quantize(q.to(torch.float8_e4m3fn), k, v)
    with pytest.raises(InputError, match="key has head_dim 16 but query has 32"):
        quantize(q, k[..., :16], v)
    with pytest.raises(InputTypeError, match="rotate must be a bool"):
        quantize(q, k, v, rotate=1)


@pytest.mark.parametrize("seed,error,match", [
    ("a", InputTypeError, "seed must be an int, got str 'a'"),
    (1.5, InputTypeError, "seed must be an int, got float 1.5"),
    (2 ** 70, InputError, "seed must be in -2\\*\\*63 .. 2\\*\\*64 - 1"),
])
def test_bad_rotation_seeds(seed, error, match):
    """The rotation's seed is checked (it was a ValueError from int() or from torch's
    generator, and a float was truncated)."""
    with pytest.raises(error, match=match):
        quantize(*_qkv(), seed=seed)
    with pytest.raises(error, match=match):
        flex_attention_fp8(*_qkv(), seed=seed)


@pytest.mark.parametrize("head_dim", [0, 33, "32", None])
def test_fp8inputs_head_dim_out_of_range(head_dim):
    """A hand-edited FP8Inputs.head_dim (the default scale is 1/sqrt(head_dim)) is named, not a
    ZeroDivisionError or TypeError from the scale."""
    x = dataclasses.replace(quantize(*_qkv(), rotate=False), head_dim=head_dim)
    with pytest.raises(InputError, match=re.escape(
            f"FP8Inputs.head_dim (the head dim before padding) must be an int in 1..32 (q's "
            f"head dim), got {head_dim!r}")):
        flex_attention_fp8(x)


def test_tile_that_does_not_divide_the_scale_block():
    x = quantize(*_qkv(), block_size=32)
    with pytest.raises(InputError, match="BLOCK_M=64 must be >= 16 and divide the Q scale block 32"):
        flex_attention_fp8(x, kernel_options={"BLOCK_M": 64})


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (7, 5)])
def test_gpu_without_fp8_tensor_cores(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    with pytest.raises(FP8UnsupportedError, match=f"compute capability >= 8.9.*has "
                                                  f"{capability[0]}.{capability[1]}"):
        check_fp8_device(torch.device("cuda", 0))


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_gpus_with_fp8_tensor_cores_pass(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    check_fp8_device(torch.device("cuda", 0))
