"""Bad input at the edges of the public API (the sweep of the forty-first session: about 1800
cases over every public entry point): each case below crashed inside torch or Python, wrote
nothing silently, or was accepted where it should be refused; now a flexfa error naming the
argument (or, for an empty append, nothing to do)."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.distributed import positions, unshard
from flexfa.errors import InputError, InputTypeError
from flexfa.fp8 import random_signs


def _cache():
    return flexfa.PagedKVCache(8, 16, 2, 1, 16, dtype=torch.float32)


def test_paged_cache_refuses_bad_values_and_duplicate_writes():
    cache = _cache()
    cache.reserve(0, 16)
    pos, rows = torch.tensor([[3, 4]]), torch.tensor([0])
    good = torch.ones(1, 1, 2, 16)
    for value, error, words in ((good.int(), InputTypeError, "dtype torch.int32"),
                                (good.bool(), InputTypeError, "dtype torch.bool"),
                                (good.to("meta"), InputError, "is on meta")):
        with pytest.raises(error, match=words):  # (meta wrote nothing, ints were cast)
            cache.assign(rows, pos, value, good)
    with pytest.raises(InputError, match="position twice"):
        cache.assign(rows, torch.tensor([[3, 3]]), good, good)
    with pytest.raises(InputError, match="position twice"):
        cache.assign(torch.tensor([0, 0]), torch.tensor([[3], [3]]), good[:, :, :1].expand(
            2, 1, 1, 16), good[:, :, :1].expand(2, 1, 1, 16))
    assert not cache.k_cache.any()  # nothing was written by the refused calls
    cache.append(torch.ones(0, 1, 3, 16), torch.ones(0, 1, 3, 16))  # no sequences: nothing
    for query, error in (("q", InputTypeError), (None, InputTypeError),
                         (torch.randn(3, 1, 1, 16), InputError)):
        with pytest.raises(error, match="PagedKVCache.attend"):
            cache.attend(query)
    with pytest.raises(InputError, match="max_batch_size"):
        flexfa.PagedKVCache(4, 16, 2 ** 30, 1, 16)


@pytest.mark.parametrize("device", ["bogus", -1, ["cpu"], "mps", "meta"])
def test_device_arguments_are_checked(device):
    for call in (lambda: flexfa.PagedKVCache(4, 16, 1, 1, 16, device=device),
                 lambda: mods.alibi_slopes(4, device=device),
                 lambda: positions(0, 2, 4, True, device=device),
                 # (random_signs takes meta: its tests record a device's ops there)
                 lambda: random_signs(8, 0, device="mps" if device == "meta" else device)):
        with pytest.raises(InputError, match="device"):
            call()
    mask = flexfa.create_block_mask(mods.causal, 2, 2, 64, 64, device="cpu", BLOCK_SIZE=32)
    if not isinstance(device, (int, list)) and device != "bogus":
        with pytest.raises(InputError, match="BlockMask.to"):
            mask.to(device)


def test_block_mask_indices_are_checked():
    mask = flexfa.create_block_mask(mods.causal, 2, 2, 64, 64, device="cpu", BLOCK_SIZE=32)
    for index, error in (([5], InputError), ([-5], InputError), (torch.tensor([5]), InputError),
                         ([0.5], InputTypeError), ([1.9], InputTypeError),
                         (torch.tensor([0.0]), InputTypeError), (["a"], InputTypeError),
                         (slice("a", None), InputTypeError), (slice(None, None, 0), InputError),
                         (slice(None, None, -1), InputError),
                         (torch.tensor([True, False, True]), InputError)):
        with pytest.raises(error):
            mask[index]
    assert mask[[1]].kv_num_blocks.shape[0] == 1 and mask[[True, False]].kv_num_blocks.shape[0] == 1
    for limit in ("x", 1.5, None, -5, True):
        with pytest.raises(InputError, match="limit"):
            mask.to_string(limit=limit)
    with pytest.raises(InputTypeError, match="path"):
        mask.to_png(None)
    with pytest.raises(InputError, match="is on meta"):
        flexfa.BlockMask.from_kv_blocks(mask.kv_num_blocks.to("meta"),
                                        mask.kv_indices.to("meta"), BLOCK_SIZE=32)
    with pytest.raises(InputTypeError, match="traced_mask"):
        flexfa.BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, BLOCK_SIZE=32,
                                        traced_mask="not a trace")


def test_unshard_refuses_shards_that_differ_beyond_their_length():
    """torch.cat failed inside on other batch sizes and promoted mixed dtypes silently."""
    a = torch.zeros(2, 4, 4)
    with pytest.raises(InputError, match="shards\\[1\\]"):
        unshard([a, torch.zeros(1, 4, 4)], load_balance=False, dim=1)
    with pytest.raises(InputError, match="shards\\[1\\]"):
        unshard([a, a.double()], load_balance=False, dim=1)


def test_dequantize_takes_a_bool():
    from flexfa.fp8 import quantize
    x = torch.randn(1, 1, 32, 16).bfloat16()
    with pytest.raises(InputTypeError, match="unrotate"):
        quantize(x, x, x).dequantize(unrotate="no")


def test_the_reference_checks_its_arguments():
    """It broadcast a key batch of 3 against a query batch of 1, ran p > 0 without a keep
    mask and multiplied a float mask in, all silently; crashed inside torch on others."""
    from flexfa.reference import attention_reference
    q, k = torch.randn(1, 2, 8, 16), torch.randn(3, 2, 8, 16)
    for kwargs, error in ((dict(key=k, value=k), InputError),
                          (dict(dropout_p=0.5), InputError),
                          (dict(dropout_p=0.5, dropout_mask=torch.ones(1, 2, 8, 8)),
                           InputTypeError),
                          (dict(scale=float("nan")), InputError),
                          (dict(sinks=torch.zeros(3)), InputError),
                          (dict(query="q"), InputTypeError)):
        args = dict(query=q, key=q, value=q) | kwargs
        with pytest.raises(error):
            attention_reference(args.pop("query"), args.pop("key"), args.pop("value"), **args)
