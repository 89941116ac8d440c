"""Bad arguments to create_block_mask / create_mask fail early with flexfa's errors."""
import pytest
import torch

from flexfa import mods
from flexfa.blockmask import create_block_mask, create_mask
from flexfa.errors import InputError, InputTypeError, TraceError


def build(**changes):
    args = dict(mask_mod=mods.causal, B=1, H=1, Q_LEN=100, KV_LEN=100, device="cpu",
                BLOCK_SIZE=32)
    args.update(changes)
    return create_block_mask(**args)


@pytest.mark.parametrize("block", [0, -16, (32, 0), (-1, 64)])
def test_block_size_not_positive(block):
    with pytest.raises(InputError, match="BLOCK_SIZE must be positive") as info:
        build(BLOCK_SIZE=block)
    assert repr(block) in str(info.value)


@pytest.mark.parametrize("block", [32.0, "32", (32,), (32, 32, 32), True, None])
def test_block_size_wrong_type(block):
    with pytest.raises(InputTypeError, match="BLOCK_SIZE"):
        build(BLOCK_SIZE=block)


@pytest.mark.parametrize("name,value", [("Q_LEN", 0), ("KV_LEN", -5), ("B", 0), ("H", -1)])
def test_non_positive_sizes(name, value):
    with pytest.raises(InputError, match=f"{name}={value}"):
        build(**{name: value})


@pytest.mark.parametrize("name,value", [("Q_LEN", 10.0), ("KV_LEN", "8"), ("B", 2.5), ("H", True)])
def test_non_int_sizes(name, value):
    with pytest.raises(InputTypeError, match=name):
        build(**{name: value})


def test_wrong_arity():
    def three(b, q_idx, kv_idx):
        return q_idx >= kv_idx

    def score_mod(score, b, h, q_idx, kv_idx):
        return score
    with pytest.raises(TraceError, match="3 required positional"):
        build(mask_mod=three)
    with pytest.raises(TraceError, match="score_mod"):
        build(mask_mod=score_mod)


def test_non_bool_result():
    def distance(b, h, q_idx, kv_idx):
        return q_idx - kv_idx
    with pytest.raises(TraceError, match="must return bool"):
        build(mask_mod=distance)


def test_not_callable():
    with pytest.raises(TraceError, match="callable"):
        build(mask_mod="causal")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda():
    with pytest.raises(InputError, match="CUDA is not available.*device='cpu'"):
        build(device="cuda")
    with pytest.raises(InputError, match="CUDA is not available"):
        create_mask(mods.causal, 1, 1, 8, 8, device="cuda")


def test_bad_device_name():
    with pytest.raises(InputError, match="not a torch device"):
        build(device="gpu0")
    with pytest.raises(InputError, match="'meta' is not supported.*'cpu' or 'cuda'"):
        build(device="meta")


def test_create_mask_checks_lengths():
    with pytest.raises(InputError, match="KV_LEN=0"):
        create_mask(mods.causal, 1, 1, 8, 0, device="cpu")


def test_captured_tensor_too_short():
    doc = mods.document([30, 40])  # 70 tokens

    with pytest.raises(InputError, match="Q_LEN=100, KV_LEN=100.*IndexError.*captured tensors"):
        build(mask_mod=doc)


def test_create_mask_captured_tensor_too_short():
    """create_mask names the lengths a captured tensor does not cover, as create_block_mask
    does (it raised torch's IndexError from the evaluation), for mask_mods and score_mods."""
    doc = mods.document([30, 40])  # 70 tokens
    bias = torch.zeros(50)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx]

    with pytest.raises(InputError, match="create_mask: evaluating mask_mod 'document_2' for "
                                         "Q_LEN=100, KV_LEN=100.*IndexError.*captured tensors"):
        create_mask(doc, 1, 1, 100, 100, device="cpu")
    with pytest.raises(InputError, match="create_mask: evaluating score_mod 'biased' for "
                                         "Q_LEN=64.*IndexError"):
        create_mask(biased, 1, 1, 64, 8, device="cpu")


@pytest.mark.parametrize("mask_shape", [(3, 4, 64, 64), (2, 2, 64, 64), (2, 4, 64, 128)])
def test_flex_attention_rejects_a_mismatched_mask(mask_shape):
    import flexfa
    q = k = v = torch.randn(2, 4, 64, 16)
    mask = create_block_mask(mods.causal, *mask_shape, device="cpu", BLOCK_SIZE=32)
    B, H, L, S = mask_shape
    with pytest.raises(InputError, match=rf"B={B}, H={H}, Q_LEN={L}, KV_LEN={S}.*B=2, H=4"):
        flexfa.flex_attention(q, k, v, block_mask=mask)
