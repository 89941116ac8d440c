"""A cached plan's direct launches on the GPU (``flexfa.runtime.launch.Step``: the kernel
its first launch compiled): calls whose per-call values differ from the first call's under
the same plan (tests/specialization.py records the same under the interpreter)."""
import pytest
import torch

import flexfa
from flexfa.blockmask import BlockMask
from flexfa.reference import attention_reference

pytestmark = pytest.mark.gpu


def test_ds_workspace_after_a_table_edit_in_place():
    """A cached backward plan launches its first launch's compiled kernels directly: the dS
    workspace's slots per head (MAX_SLOTS, from the tables' contents) went from 1 to 3 under
    the same plan after an in-place edit of the tables; a kernel compiled with the constant 1
    would overlap the heads' workspace regions (tests/kernels/test_backward_ds.py records the
    specialization under the interpreter)."""
    L, block = 384, 128
    kv_num_blocks = torch.tensor([[[1, 0, 0]]], dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(1, 1, 3, 3, dtype=torch.int32, device="cuda")

    def same_block(b, h, q_idx, kv_idx):
        return q_idx // block == kv_idx // block
    mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=block,
                                    mask_mod=same_block)
    q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16)

    def grads():
        out = flexfa.flex_attention(q, k, v, block_mask=mask,
                                    kernel_options={"DS_WORKSPACE": True})
        return torch.autograd.grad(out, (q, k, v), grad)
    grads()
    grads()
    kv_num_blocks.fill_(1)  # the diagonal blocks, the mask_mod's own
    kv_indices[0, 0, :, 0] = torch.arange(3, device="cuda")
    mask.q_num_blocks.copy_(kv_num_blocks)
    mask.q_indices.copy_(kv_indices)
    got = grads()
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want_out = attention_reference(*inputs, mask_mod=same_block)
    want = torch.autograd.grad(want_out, inputs, grad.double())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert (g.double() - w).abs().max().item() <= 0.12 * max(w.abs().max().item(), 1.0), name
