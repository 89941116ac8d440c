"""flex_decode inside torch.compile(fullgraph=True): the flexfa::flex_decode operator (opcheck),
equal to eager flex_decode, new kv_lens / q_offsets contents without a recompile, a paged
cache, and a DecodeWorkspace refused with an error that says why."""
import pytest
import torch
from torch._dynamo.utils import counters

import flexfa
from flexfa import mods
from flexfa.blockmask.validate import TABLES
from flexfa.compiled import describe, unbound

B, HQ, HKV, S, E = 2, 4, 2, 64, 16


def _inputs(seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator)
            for shape in ((B, HQ, 1, E), (B, HKV, S, E), (B, HKV, S, E))]


def test_opcheck_decode():
    bias = torch.randn(HQ)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    mask = flexfa.create_block_mask(mods.sliding_window(20), None, None, S, S, device="cpu",
                                    BLOCK_SIZE=16)
    key, score_paths, *_ = describe(*unbound(biased), *unbound(mask.mask_mod), True, None)
    assert score_paths == ((("cell", "bias"),),)
    q, k, v = _inputs()
    lens = torch.tensor([40, 64], dtype=torch.int32)
    args = (q, k, v, key, None, [bias], [], [getattr(mask, n) for n in TABLES], [16, 16],
            [S, S], lens, None, None, None, True)
    torch.library.opcheck(torch.ops.flexfa.flex_decode.default, args)
    out, lse = torch.ops.flexfa.flex_decode(*args)
    want, want_lse = flexfa.flex_decode(q, k, v, biased, mask, kv_lens=lens, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_compiled_decode_equals_eager_for_new_lengths_in_one_graph():
    """Lengths and offsets are operator inputs: new contents, same graph; a paged cache too."""
    slopes = torch.linspace(0.1, 0.4, HQ)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    window = flexfa.create_block_mask(mods.sliding_window(24), None, None, S, S, device="cpu",
                                      BLOCK_SIZE=16)
    q, k, v = _inputs()
    lens = torch.zeros(B, dtype=torch.int32)
    offsets = torch.zeros(B, dtype=torch.int32)
    pages = k.view(B * 4, 16, HKV, E), v.view(B * 4, 16, HKV, E)  # [pages, size, Hkv, E]
    table = torch.arange(B * 4, dtype=torch.int32).flip(0).view(B, 4)

    def step(q):
        dense = flexfa.flex_decode(q, k, v, alibi, window, kv_lens=lens, q_offsets=offsets,
                                   validate=False)
        paged = flexfa.flex_decode(q, *pages, alibi, kv_lens=lens, page_table=table,
                                   return_lse=True, validate=False)
        return dense, *paged

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for new_lens, new_offsets in (([17, 64], [3, 40]), ([64, 33], [63, 0]), ([5, 48], [4, 47])):
        lens.copy_(torch.tensor(new_lens))
        offsets.copy_(torch.tensor(new_offsets))
        for got, want in zip(compiled(q), step(q)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_workspace_refused_inside_compile():
    q, k, v = _inputs()

    def step(q):
        return flexfa.flex_decode(q, k, v, workspace=flexfa.DecodeWorkspace())

    torch._dynamo.reset()
    with pytest.raises(flexfa.InputError, match="workspace is not supported inside torch.compile"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(q)


@pytest.mark.parametrize("name, change, error, message", [
    ("3-D query", lambda a: {**a, "query": a["query"][:, :, 0]}, flexfa.InputError,
     r"query must be 4-D"),
    ("key a str", lambda a: {**a, "key": "k"}, flexfa.InputTypeError,
     r"key must be a torch.Tensor, got str"),
    ("sinks a list", lambda a: {**a, "sinks": [0.0] * HQ}, flexfa.InputTypeError,
     r"sinks must be a torch.Tensor or None, got list"),
    ("kv_lens a list", lambda a: {**a, "kv_lens": [40, 29]}, flexfa.InputTypeError,
     r"kv_lens must be a torch.Tensor or None, got list"),
    ("scale a tensor", lambda a: {**a, "scale": torch.tensor(0.5)}, flexfa.InputTypeError,
     r"scale must be a float or None, got Tensor"),
    ("block_mask an int", lambda a: {**a, "block_mask": 3}, flexfa.InputTypeError,
     r"block_mask must be a BlockMask")])
def test_bad_arguments_raise_flexfa_errors_inside_compile(name, change, error, message):
    """Arguments of the wrong kind reached the flexfa::flex_decode operator, whose schema or
    fake implementation failed inside Dynamo (a TorchRuntimeError), or an AttributeError
    surfaced as Dynamo's 'Observed exception'; they raise eager flex_decode's errors."""
    q, k, v = _inputs()
    arguments = change({"query": q, "key": k, "value": v})
    torch._dynamo.reset()
    with pytest.raises(error, match=message):
        flexfa.flex_decode(**arguments)
    torch._dynamo.reset()
    with pytest.raises(error, match=message):
        torch.compile(lambda: flexfa.flex_decode(**arguments), backend="aot_eager",
                      fullgraph=True)()


def test_autocast_casts_before_the_checks():
    """Under torch.autocast a float32 cache with a bf16 query runs eagerly (the casts come
    first); compiled, the dtype check ran before the casts and refused it."""
    q, k, v = _inputs()
    q = q.bfloat16()

    def step(q, k, v):
        return flexfa.flex_decode(q, k, v)

    torch._dynamo.reset()
    with torch.autocast("cpu", torch.bfloat16):
        want = step(q, k, v)
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, want)

