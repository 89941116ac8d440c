"""The forward kernel on a CUDA GPU (compiled): the named suite at realistic sizes against the
float64 reference, dense and causal against SDPA, and the cached-call dispatch cost."""
import time

import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from forward_utils import check_forward, make_qkv, named_variants

pytestmark = pytest.mark.gpu

B, H, L = 2, 8, 1024


NAMES = ["causal", "sliding_window", "prefix_lm", "document", "alibi_causal", "softcap",
         "relative_bias", "learnable_bias_table", "dilated", "natten_2d"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("E", [64, 128])
def test_named_variant_on_gpu(name, dtype, E):
    if name == "natten_2d":
        score_mod, mask_mod = None, mods.natten_2d(32, 32, 7)
    else:
        score_mod, mask_mod = named_variants(H, L, L, "cuda")[name]
    q, k, v = make_qkv(B, H, H, L, L, E, dtype=dtype, device="cuda")
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, L, L, device="cuda")
    check_forward(q, k, v, score_mod, mask_mod, block_mask)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("E,Ev", [(64, 64), (128, 128), (256, 256), (96, 64), (192, 128), (80, 80)])
def test_matches_sdpa(causal, E, Ev):
    q, k, v = make_qkv(B, H, H, 1000, 1000, E, Ev=Ev, dtype=torch.bfloat16, device="cuda")
    block_mask = create_block_mask(mods.causal, None, None, 1000, 1000, device="cuda") \
        if causal else None
    out = flexfa.flex_attention(q, k, v, block_mask=block_mask)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                           is_causal=causal)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_gqa_and_ragged_lengths_on_gpu():
    q, k, v = make_qkv(2, 8, 2, 1000, 1777, 128, dtype=torch.bfloat16, device="cuda")
    check_forward(q, k, v, mods.softcap(30.0), enable_gqa=True)


def test_cached_dispatch_is_cheap():
    q, k, v = make_qkv(1, 1, 1, 128, 128, 64, dtype=torch.bfloat16, device="cuda")
    score_mod = mods.softcap(20.0)
    for _ in range(3):
        flexfa.flex_attention(q, k, v, score_mod=score_mod)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(100):
        flexfa.flex_attention(q, k, v, score_mod=score_mod)
    per_call = (time.perf_counter() - start) / 100
    torch.cuda.synchronize()
    assert per_call < 500e-6, f"{per_call * 1e6:.0f} us per cached call"


def test_ampere_template_direct_launches_follow_the_specializations(monkeypatch):
    """The Ampere template's cached CUDA launches go straight to the compiled kernel where an
    earlier launch fixed its specializations, and through Triton where the strides, the 16-byte
    alignment of q, k, v or the block mask differ: every call stays right."""
    from flexfa.runtime import launch

    direct = []
    real = launch.launch_direct
    monkeypatch.setattr(launch, "launch_direct", lambda *a: (direct.append(1), real(*a)))
    L, E = 300, 64
    q, k, v = make_qkv(1, 4, 4, L, L, E, dtype=torch.bfloat16, device="cuda", seed=7)
    buffer = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    q_unaligned = buffer[1:].view_as(q)  # 2 bytes past a 16-byte boundary
    q_unaligned.copy_(q)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, L, H, E] memory
    per_batch = create_block_mask(mods.causal, 1, None, L, L, device="cuda")
    shared = create_block_mask(mods.causal, None, None, L, L, device="cuda")  # broadcast tables
    for query in (q, q_unaligned, q_strided):
        for mask in (per_batch, shared):
            for _ in range(2):
                check_forward(query, k, v, mods.softcap(20.0), mods.causal, mask,
                              kernel_options={"BACKEND": "AMPERE"})
    assert len(direct) == 6  # the second call of each of the six signatures


def test_split_kv_decoding_on_gpu(launched):
    """One query per head over a 32768-key cache (32 programs): split-KV decoding
    (kernel_options SPLIT_KV="AUTO") against the float64 reference, with a window mask and
    GQA. One query row per head takes the decode family (GQA-packed), which splits."""
    auto = {"SPLIT_KV": "AUTO"}
    q, k, v = make_qkv(1, 32, 8, 1, 32768, 128, dtype=torch.bfloat16, device="cuda", seed=8)
    check_forward(q, k, v, enable_gqa=True, kernel_options=auto)

    def window(b, h, q_idx, kv_idx):
        return kv_idx >= 32768 - 5000
    mask = create_block_mask(window, None, None, 1, 32768, device="cuda")
    check_forward(q, k, v, mods.softcap(30.0), window, mask, enable_gqa=True,
                  kernel_options=auto)
    assert [family for family, _ in launched] == ["decode", "decode"]
    assert min(splits for _, splits in launched) >= 2, launched


def test_chunked_prefill_splits_on_gpu(launched):
    """512 queries at the end of 4096 keys, 32 query heads over 8 kv heads (128 programs):
    the Hopper family splits each program's live blocks by default on an H200's 132 SMs;
    forced 3 splits too; against the float64 reference."""
    L, S = 512, 4096
    q, k, v = make_qkv(1, 32, 8, L, S, 128, dtype=torch.bfloat16, device="cuda", seed=9)

    def causal_at_offset(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + (S - L)
    mask = create_block_mask(causal_at_offset, None, None, L, S, device="cuda")
    check_forward(q, k, v, mods.softcap(30.0), causal_at_offset, mask, enable_gqa=True)
    check_forward(q, k, v, None, causal_at_offset, mask, enable_gqa=True,
                  kernel_options={"SPLIT_KV": 3})
    assert [family for family, _ in launched] == ["hopper", "hopper"]
    assert launched[0][1] >= 2 and launched[1][1] == 3, launched
