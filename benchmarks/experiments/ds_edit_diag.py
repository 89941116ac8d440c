"""GPU: the dS workspace (kernel_options DS_WORKSPACE) with a ``from_kv_blocks`` mask, fresh
and after an in-place edit of its tables under a cached plan: each gradient's largest error
against the float64 reference, dQ's rows of zeros, and each new backward plan's family, tiles
and TMA use (zb_d2b136d's failure: a stale TMA descriptor of the workspace, fixed in db06216;
that needs the allocator to hand the larger workspace back at the old address, which this
process need not reproduce: tests/gpu/test_cached_plans_gpu.py did).

    PYTHONPATH=. python benchmarks/experiments/ds_edit_diag.py
"""
import torch

import flexfa
from flexfa.blockmask import BlockMask
from flexfa.reference import attention_reference
from flexfa.runtime import plans

L, BLOCK = 384, 128
DS = {"DS_WORKSPACE": True}
_keep = plans.keep_backward


def _spy(call, key, plan):  # which backward family and spec each new plan has
    spec = plan.spec
    print(f"  new plan {type(plan.family).__name__} ds_dq={getattr(spec, 'ds_dq', None)} "
          f"tiles={getattr(spec, 'block_m1', None)}x{getattr(spec, 'block_n1', None)}/"
          f"{getattr(spec, 'block_m2', None)}x{getattr(spec, 'block_n2', None)} "
          f"tma={getattr(spec, 'use_tma', None)}", flush=True)
    return _keep(call, key, plan)


def same_block(b, h, q_idx, kv_idx):
    return q_idx // BLOCK == kv_idx // BLOCK


def diagonal_tables(first_only: bool) -> tuple:
    """(kv_num_blocks, kv_indices): block (0, 0) alone, or every diagonal block."""
    counts = torch.tensor([[[1, 0, 0]]] if first_only else [[[1, 1, 1]]], dtype=torch.int32,
                          device="cuda")
    indices = torch.zeros(1, 1, 3, 3, dtype=torch.int32, device="cuda")
    if not first_only:
        indices[0, 0, :, 0] = torch.arange(3, device="cuda")
    return counts, indices


def mask_of(counts, indices):
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=BLOCK, mask_mod=same_block)


def main() -> None:
    plans.keep_backward = _spy
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16)
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_reference(*inputs, mask_mod=same_block), inputs,
                               grad.double())

    def grads(mask, options):
        out = flexfa.flex_attention(q, k, v, block_mask=mask, kernel_options=options)
        return torch.autograd.grad(out, (q, k, v), grad)

    def report(tag, mask, options):
        got = grads(mask, options)
        errors = " ".join(f"{name} {(g.double() - w).abs().max().item():.3e}"
                          for name, g, w in zip(("dq", "dk", "dv"), got, want))
        zero_rows = (got[0].abs().sum(-1) == 0).sum().item()
        print(f"{tag:40s} {errors} dq zero rows {zero_rows}", flush=True)

    report("fresh diag, default", mask_of(*diagonal_tables(False)), None)
    report("fresh diag, DS_WORKSPACE", mask_of(*diagonal_tables(False)), DS)
    report("fresh diag DS again same mask", mask_of(*diagonal_tables(False)), DS)
    counts, indices = diagonal_tables(True)  # the GPU test's sequence: two calls, then the edit
    mask = mask_of(counts, indices)
    for _ in range(2):
        grads(mask, DS)
    edited = diagonal_tables(False)
    counts.copy_(edited[0])
    indices.copy_(edited[1])
    mask.q_num_blocks.copy_(counts)
    mask.q_indices.copy_(indices)
    print("q tables", mask.q_num_blocks.tolist(), mask.q_indices[0, 0, :, 0].tolist())
    report("edited, DS_WORKSPACE", mask, DS)
    report("edited, default", mask, None)
    report("edited tables in a new BlockMask, DS", mask_of(counts.clone(), indices.clone()), DS)
    report("edited again (same plan), DS", mask, DS)


if __name__ == "__main__":
    main()
