"""The backward's memory policy (issue 26): by default nothing of size L x S is allocated, and
for GQA no dK/dV of the query heads' shape [B, Hq, S, E] (each dK/dV program loops over its
group's query heads and writes [B, Hkv, S, E]); the dS workspace only with
``DS_WORKSPACE=True``, whose gradients still match the reference.

Every tensor that any torch operator returns inside flexfa's forward and backward (a
``TorchDispatchMode``; the reference runs outside it) is recorded by the bytes of its
storage, so a view of a large buffer counts as the buffer (the interpreter's host copies too).
The inputs are kept small (few heads) so that the bound, L x S bytes, is larger than any input,
gradient or row statistic."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import backward_utils
from flexfa import mods
from flexfa.blockmask import create_block_mask
from backward_utils import check_backward
from forward_utils import make_qkv


class StorageSizes(TorchDispatchMode):
    """Records the storage size (bytes) of every tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[int, tuple, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.layout == torch.strided:
                self.sizes.append((out.untyped_storage().nbytes(), tuple(out.shape),
                                   str(func)))
        return result


@pytest.fixture
def allocations(monkeypatch) -> list:
    """The (bytes, shape, operator) of every tensor made inside flexfa's calls of
    ``check_backward`` (forward and backward; not the reference's)."""
    recorded = []
    original = backward_utils.flexfa_grads

    def recording(*args, **kwargs):
        mode = StorageSizes()
        with mode:
            grads = original(*args, **kwargs)
        recorded.extend(mode.sizes)
        return grads
    monkeypatch.setattr(backward_utils, "flexfa_grads", recording)
    return recorded


def largest(recorded: list) -> tuple:
    assert recorded, "nothing was recorded: the spy is not seeing flexfa's allocations"
    return max(recorded)


L = S = 256  # L x S = 65536, above the bytes of every input of these shapes (<= 32768)


def learnable_bias(heads: int):
    bias = torch.linspace(-0.5, 0.5, heads, requires_grad=True)

    def per_head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    return per_head_bias, bias


@pytest.mark.parametrize("case", ["causal_softcap", "dense_learnable_bias_deterministic",
                                  "document_learnable_relative_bias"])
def test_default_backward_allocates_nothing_l_by_s(allocations, case):
    q, k, v = make_qkv(1, 2, 2, L, S, 32, dtype=torch.bfloat16, seed=71)
    options, buffers, score_mod, mask_mod, block_mask = {}, (), mods.softcap(8.0), None, None
    if case == "causal_softcap":
        mask_mod = mods.causal
        block_mask = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=64)
    elif case == "dense_learnable_bias_deterministic":
        score_mod, bias = learnable_bias(2)
        buffers, options = (bias,), {"deterministic": True}
    else:  # a captured tensor of 2 * L - 1 elements that needs a gradient, a document mask
        relative = torch.zeros(2 * L - 1, requires_grad=True)

        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + relative[q_idx - kv_idx + L - 1]
        score_mod, buffers = relative_bias, (relative,)
        mask_mod = mods.document([100, 156])
        block_mask = create_block_mask(mask_mod, None, None, L, S, device="cpu", BLOCK_SIZE=64)
    check_backward(q, k, v, score_mod, mask_mod, block_mask, buffers=buffers,
                   kernel_options=options, with_lse=True)
    nbytes, shape, op = largest(allocations)
    assert nbytes < L * S, f"{op} made a tensor of {nbytes} bytes {shape}: L x S = {L * S}"


def test_ds_workspace_is_opt_in_and_still_right(allocations):
    """DS_WORKSPACE=True: the workspace (dense: one block slot per tile pair, B x H x L x S in
    q's dtype, 4 L x S bytes here) is allocated, and seen by the spy; gradients match the
    reference."""
    q, k, v = make_qkv(1, 2, 2, L, S, 32, dtype=torch.bfloat16, seed=72)
    check_backward(q, k, v, mods.softcap(8.0), kernel_options={"DS_WORKSPACE": True})
    nbytes, shape, op = largest(allocations)
    assert nbytes >= 4 * L * S, f"no dS workspace: largest tensor {nbytes} bytes {shape}"


@pytest.mark.parametrize("Hq, Hkv, Lq, Skv", [(4, 2, 128, 256), (3, 1, 100, 232)])
def test_gqa_backward_writes_kv_head_gradients_directly(allocations, Hq, Hkv, Lq, Skv):
    """Hq = 4 / Hkv = 2 with a causal mask and a learnable per-head bias (deterministic
    mode: its int64 accumulator), Hq = 3 / Hkv = 1
    dense with ragged lengths: dK, dV are [B, Hkv, S, E] and no tensor as large as a
    per-query-head dK or dV ([B, Hq, S, E] in bf16; L < S keeps dQ smaller) is made."""
    B, E = 1, 32
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Skv, E, dtype=torch.bfloat16, seed=73)
    if Hq == 4:
        score_mod, bias = learnable_bias(Hq)
        buffers = (bias,)
        block_mask = create_block_mask(mods.causal, None, None, Lq, Skv, device="cpu",
                                       BLOCK_SIZE=64)
        grads = check_backward(q, k, v, score_mod, mods.causal, block_mask, buffers=buffers,
                               enable_gqa=True, kernel_options={"deterministic": True})
    else:
        grads = check_backward(q, k, v, mods.softcap(6.0), enable_gqa=True, with_lse=True)
    assert grads[1].shape == grads[2].shape == (B, Hkv, Skv, E)
    nbytes, shape, op = largest(allocations)
    assert nbytes < B * Hq * Skv * E * 2, (
        f"{op} made a tensor of {nbytes} bytes {shape}, as large as a per-query-head dK/dV "
        f"[{B}, {Hq}, {Skv}, {E}] in bf16")
