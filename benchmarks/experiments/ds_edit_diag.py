"""GPU diagnostic: dS workspace with a from_kv_blocks mask, fresh and after an in-place edit."""
import torch, flexfa
from flexfa.blockmask import BlockMask
from flexfa.reference import attention_reference
from flexfa.runtime import plans
_keep = plans.keep_backward


def _spy(call, key, plan):  # which backward family and spec each new plan has
    spec = plan.spec
    print(f"  new plan {type(plan.family).__name__} ds_dq={getattr(spec, 'ds_dq', None)} "
          f"tiles={getattr(spec, 'block_m1', None)}x{getattr(spec, 'block_n1', None)}/"
          f"{getattr(spec, 'block_m2', None)}x{getattr(spec, 'block_n2', None)} "
          f"tma={getattr(spec, 'use_tma', None)}", flush=True)
    return _keep(call, key, plan)


plans.keep_backward = _spy
L, block = 384, 128
def same_block(b, h, q_idx, kv_idx):
    return q_idx // block == kv_idx // block
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
grad = torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16)
inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
want = torch.autograd.grad(attention_reference(*inputs, mask_mod=same_block), inputs, grad.double())
def report(tag, mask, opts):
    out = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=opts)
    got = torch.autograd.grad(out, (q, k, v), grad)
    errs = [(g.double() - w).abs().max().item() for g, w in zip(got, want)]
    zero_rows = (got[0].abs().sum(-1) == 0).sum().item()
    print(f"{tag:40s} dq {errs[0]:.3e} dk {errs[1]:.3e} dv {errs[2]:.3e} dq zero rows {zero_rows}", flush=True)
def diag():
    n = torch.ones(1, 1, 3, dtype=torch.int32, device="cuda")
    idx = torch.zeros(1, 1, 3, 3, dtype=torch.int32, device="cuda"); idx[0, 0, :, 0] = torch.arange(3, device="cuda")
    return BlockMask.from_kv_blocks(n, idx, BLOCK_SIZE=block, mask_mod=same_block)
report("fresh diag, default", diag(), None)
report("fresh diag, DS_WORKSPACE", diag(), {"DS_WORKSPACE": True})
flexfa.clear_memo() if hasattr(flexfa, "clear_memo") else None
m = diag()
report("fresh diag DS again same mask", m, {"DS_WORKSPACE": True})
# the test's sequence
n = torch.tensor([[[1, 0, 0]]], dtype=torch.int32, device="cuda")
idx = torch.zeros(1, 1, 3, 3, dtype=torch.int32, device="cuda")
mask = BlockMask.from_kv_blocks(n, idx, BLOCK_SIZE=block, mask_mod=same_block)
for _ in range(2):
    out = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options={"DS_WORKSPACE": True})
    torch.autograd.grad(out, (q, k, v), grad)
n.fill_(1); idx[0, 0, :, 0] = torch.arange(3, device="cuda")
mask.q_num_blocks.copy_(n); mask.q_indices.copy_(idx)
print("q tables", mask.q_num_blocks.tolist(), mask.q_indices[0,0,:,0].tolist(), "full", None if mask.full_kv_num_blocks is None else mask.full_kv_num_blocks.tolist())
report("edited, DS_WORKSPACE", mask, {"DS_WORKSPACE": True})
report("edited, default", mask, None)
report("edited tables in a new BlockMask, DS", BlockMask.from_kv_blocks(
    n.clone(), idx.clone(), BLOCK_SIZE=block, mask_mod=same_block), {"DS_WORKSPACE": True})
report("edited again (same plan), DS", mask, {"DS_WORKSPACE": True})
