"""Helpers shared by the forward-kernel tests: inputs, block-mask tables from a dense mask,
and one check of flexfa's out and lse against the float64 reference."""
from __future__ import annotations

import contextlib
import types
from unittest import mock

import torch

import flexfa
from flexfa import mods
from flexfa.frontend import dense_mask, trace
from reference import assert_close_to_reference, reference_pair

SMALL_TILES = {"BLOCK_M": 32, "BLOCK_N": 32}
# the kernel_options that force each forward family (an InputError where it cannot run)
TEMPLATES = {"ampere": {"BACKEND": "AMPERE"}, "hopper": {"BACKEND": "HOPPER"}}


def make_qkv(B, Hq, Hkv, L, S, E, Ev=None, dtype=torch.float32, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    Ev = E if Ev is None else Ev
    shapes = ((B, Hq, L, E), (B, Hkv, S, E), (B, Hkv, S, Ev))
    return [torch.randn(s, generator=generator).to(device=device, dtype=dtype) for s in shapes]


def named_variants(H, L, S, device="cpu"):
    """The named suite as {name: (score_mod, mask_mod)}, sized for [*, H, L, S] inputs."""
    generator = torch.Generator().manual_seed(1)
    table = (0.3 * torch.randn(H, 2 * max(L, S) - 1, generator=generator)).to(device)
    learned = (0.3 * torch.randn(H, L, S, generator=generator)).to(device)

    def learnable_bias(score, b, h, q_idx, kv_idx):
        return score + learned[h, q_idx, kv_idx]

    third = max(S // 3, 1)
    return {
        "causal": (None, mods.causal),
        "sliding_window": (None, mods.sliding_window(max(S // 6, 1))),
        "prefix_lm": (None, mods.prefix_lm(S // 8)),
        "document": (None, mods.document([third, S - 2 * third, third], device=device)),
        "alibi_causal": (mods.alibi(H, device=device), mods.causal),
        "softcap": (mods.softcap(5.0), None),
        "relative_bias": (mods.relative_bias(table), None),
        "learnable_bias_table": (learnable_bias, mods.causal),
        "dilated": (None, mods.dilated_window(8, 3)),
    }


def tables_from_dense(keep: torch.Tensor, block_q: int, block_kv: int, mask_mod, full=True):
    """A BlockMask-like object (torch's attribute names) built from a dense [B,H,L,S] mask:
    partial tiles (some kept) and, with ``full``, full tiles (all in-range entries kept)."""
    B, H, L, S = keep.shape
    nq, nkv = -(-L // block_q), -(-S // block_kv)
    padded = torch.zeros(B, H, nq * block_q, nkv * block_kv, dtype=torch.bool)
    valid = torch.zeros_like(padded)
    padded[:, :, :L, :S] = keep
    valid[:, :, :L, :S] = True
    tiles = padded.view(B, H, nq, block_q, nkv, block_kv)
    valid_tiles = valid.view(B, H, nq, block_q, nkv, block_kv)
    any_kept = tiles.any(dim=(3, 5))
    all_kept = (tiles | ~valid_tiles).all(dim=(3, 5))
    partial = any_kept & ~all_kept if full else any_kept
    full_tiles = any_kept & all_kept

    def ordered(selected):
        counts = selected.sum(-1).to(torch.int32)
        # selected tiles first, ascending; argsort of (not selected, index) is stable
        order = torch.argsort((~selected).to(torch.int32), dim=-1, stable=True).to(torch.int32)
        return counts, order

    kv_num_blocks, kv_indices = ordered(partial)
    mask = types.SimpleNamespace(kv_num_blocks=kv_num_blocks, kv_indices=kv_indices,
                                 full_kv_num_blocks=None, full_kv_indices=None,
                                 BLOCK_SIZE=(block_q, block_kv), seq_lengths=(L, S),
                                 mask_mod=mask_mod)
    if full:
        mask.full_kv_num_blocks, mask.full_kv_indices = ordered(full_tiles)
    return mask


def dense_block_mask(mask_mod, B, H, L, S, block_q, block_kv, full=True):
    keep = dense_mask(trace(mask_mod), B, H, L, S)
    return tables_from_dense(keep, block_q, block_kv, mask_mod, full)


def check_forward(q, k, v, score_mod=None, mask_mod=None, block_mask=None, *, scale=None,
                  enable_gqa=False, kernel_options=None, fudge=4.0, floor=None):
    """Run flexfa (out and lse) and compare both with the float64 / same-dtype references."""
    out, lse = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                     scale=scale, enable_gqa=enable_gqa, return_lse=True,
                                     kernel_options=kernel_options)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == (*q.shape[:3], v.shape[3]) and lse.shape == q.shape[:3]
    (out64, lse64), (out_eager, lse_eager) = reference_pair(
        q, k, v, score_mod, mask_mod, scale=scale, enable_gqa=enable_gqa)
    assert_close_to_reference(out, out64, out_eager, fudge=fudge, floor=floor, name="out")
    lse_floor = None if floor is None else floor
    assert_close_to_reference(lse, lse64, lse_eager, fudge=fudge, floor=lse_floor, name="lse")
    return out, lse


def record_splits(monkeypatch, module) -> list:
    """Spy on ``module.combine_splits`` (a family module's name for it): the list the number of
    float32 slices of each combine is appended to."""
    combined = []
    real = module.combine_splits

    def spy(parts, *rest, **kwargs):
        combined.append(parts.shape[0])
        return real(parts, *rest, **kwargs)
    monkeypatch.setattr(module, "combine_splits", spy)
    return combined


@contextlib.contextmanager
def kept_plans(record=lambda plan: plan):
    """The list of ``record(plan)`` for each plan the runtime keeps in the block (a spy on
    runtime.plans.keep: a plan outlives the call only as long as its block mask)."""
    from flexfa.runtime import plans
    made = []
    real = plans.keep

    def spy(call, key, plan):
        made.append(record(plan))
        return real(call, key, plan)
    with mock.patch.object(plans, "keep", spy):
        yield made
