"""Mods whose traces differed from torch running the same Python function (the mod-semantics
audit of the forty-first session): each traced-then-evaluated mod equals torch on index
grids, and the kernels agree (the where method's mask end to end)."""
import pytest
import torch

import flexfa
from flexfa.errors import InputError
from flexfa.frontend import evaluate, index_grids, trace
from flexfa.reference import attention_reference

B, H, L, S = 1, 2, 48, 32
GRIDS = index_grids(B, H, L, S)


def _as_torch(fn, kind):
    b, h, q, kv = GRIDS
    score = torch.linspace(-3, 3, L * S).view(1, 1, L, S).expand(B, H, L, S)
    if kind == "mask_mod":
        return torch.as_tensor(fn(b, h, q, kv)).expand(B, H, L, S), None
    return torch.as_tensor(fn(score, b, h, q, kv)).expand(B, H, L, S), score


MODS = {
    # Tensor.where's first argument is the value: x.where(c, y) is torch.where(c, x, y); it
    # was read as the condition (a silently different mask: 295 of 1536 entries)
    "where method mask": ("mask_mod", lambda b, h, q, kv: (kv > 3).where(q > kv, q < 10)),
    "where method score": ("score_mod", lambda s, b, h, q, kv: s.where(q >= kv, -1.0)),
    # a float16 / bfloat16 value compared with an int (tensor or number) compares in the
    # narrow type, the int rounded first; it compared in float32
    "half == int": ("score_mod", lambda s, b, h, q, kv: s + (
        (kv + 2049).half() == kv + 2049) * 1.0),
    "half < int + 1": ("mask_mod", lambda b, h, q, kv: (q * 2048).half() < q * 2048 + 1),
    "bf16 == int": ("mask_mod", lambda b, h, q, kv: (q * 2048).bfloat16() == q * 2048 + 1),
    "int >= half": ("mask_mod", lambda b, h, q, kv: q * 2048 + 1 >= (q * 2048).half()),
    "half != 0.1": ("mask_mod", lambda b, h, q, kv: (kv * 0 + 0.1).half() != 0.1),
    # a Python bool beside an int tensor in a shift is the int 0 or 1, as torch reads it
    "True << int": ("score_mod", lambda s, b, h, q, kv: s + (True << (kv % 4))),
    "int >> True": ("score_mod", lambda s, b, h, q, kv: s + (q >> True) * 0.01),
}


@pytest.mark.parametrize("name", sorted(MODS))
def test_traced_mod_equals_torch(name):
    kind, fn = MODS[name]
    want, score = _as_torch(fn, kind)
    got = evaluate(trace(fn, kind), score=score, b=GRIDS[0], h=GRIDS[1], q_idx=GRIDS[2],
                   kv_idx=GRIDS[3]).expand(B, H, L, S)
    assert torch.equal(got.to(want.dtype), want), name


def test_the_where_method_mask_in_the_kernels():
    kind, fn = MODS["where method mask"]
    q, k, v = (torch.randn(B, H, n, 16, generator=torch.Generator().manual_seed(n))
               for n in (L, S, S))
    mask = flexfa.create_block_mask(fn, B, H, L, S, device="cpu", BLOCK_SIZE=16)
    got = flexfa.flex_attention(q, k, v, block_mask=mask)
    dense = _as_torch(fn, kind)[0]  # (torch's own evaluation, read through a table)
    want = attention_reference(q, k, v, mask_mod=lambda b, h, i, j: dense[b, h, i, j])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_an_index_computed_from_the_score_is_refused():
    """A captured tensor read at an index computed from score, whose range the intervals do
    not bound: the pre-launch index check failed with a bare ValueError ("evaluating the IR
    needs a value for score"); bounded (% n, clamp) it runs."""
    q, k, v = (torch.randn(B, H, n, 16, generator=torch.Generator().manual_seed(n))
               for n in (L, S, S))
    table = torch.randn(48)
    with pytest.raises(InputError, match="index computed from score"):
        flexfa.flex_attention(q, k, v, lambda s, b, h, i, j: s + table[(s * 3).long()])
    out = flexfa.flex_attention(q, k, v, lambda s, b, h, i, j: s + table[(s * 3).long() % 48])
    want = attention_reference(q, k, v, lambda s, b, h, i, j: s + table.double()[
        (s.float() * 3).long() % 48])
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
