"""Dropout on the attention probabilities (``flex_attention(..., dropout_p=, dropout_seed=)``):
the keep mask is decided by 16-bit halves of Philox4x32-10 words of (seed, offset, b, h, q,
4 * (k // 32) + (k % 8) // 2) (checked bit for bit against a pure-Python Philox), the
forward and both backward kernels draw it identically (exact tests
against the float64 reference fed ``flexfa.dropout_mask``), its keep rate is 1 - p
(statistical tests, of the mask and of the kernel itself), p = 0 runs today's kernels, p
close to 1 stays finite, and bad arguments fail before any launch."""
import math

import pytest
import torch

import flexfa
from flexfa.errors import InputError, InputTypeError
from flexfa.reference import attention_reference
from flexfa.runtime import dropout, launch
from kernels.backward_utils import record_backward_specs
from kernels.forward_utils import TEMPLATES, make_qkv
from reference import assert_close_to_reference

B, HQ, HKV, L, S, E = 1, 4, 2, 56, 80, 32  # GQA 2; L, S not tile multiples
SEED = (1234567890123, 42)


def philox_words(seed: int, counters: tuple[int, int, int, int]) -> tuple[int, ...]:
    """Philox4x32-10's four output words (Salmon et al. 2011), in plain Python."""
    key0, key1 = seed & 0xFFFFFFFF, seed >> 32
    c0, c1, c2, c3 = counters
    for _ in range(10):
        prev0, prev2 = c0, c2
        c0 = ((prev2 * 0xCD9E8D57) >> 32) ^ c1 ^ key0
        c2 = ((prev0 * 0xD2511F53) >> 32) ^ c3 ^ key1
        c1 = (prev2 * 0xCD9E8D57) & 0xFFFFFFFF
        c3 = (prev0 * 0xD2511F53) & 0xFFFFFFFF
        key0 = (key0 + 0x9E3779B9) & 0xFFFFFFFF
        key1 = (key1 + 0xBB67AE85) & 0xFFFFFFFF
    return c0, c1, c2, c3


def test_the_mask_is_philox_of_seed_offset_and_indices():
    p, (seed, offset) = 0.3, SEED
    mask = flexfa.dropout_mask((seed, offset), 2, 3, 20, 40, p)
    assert mask.shape == (2, 3, 20, 40) and mask.dtype == torch.bool
    threshold = round(p * 2 ** 16)
    for b in range(2):
        for h in range(3):
            for q in range(0, 20, 3):
                for k in range(40):  # every key: each of the eight a Philox call covers
                    group = 4 * (k // 32) + (k % 8) // 2
                    word = philox_words(seed, (group, q, b * 3 + h, offset))[(k % 32) // 8]
                    half = (word >> (16 * (k % 2))) & 0xFFFF
                    assert bool(mask[b, h, q, k]) == (half >= threshold), (b, h, q, k)
    assert not torch.equal(mask, flexfa.dropout_mask((seed, offset + 1), 2, 3, 20, 40, p))
    assert not torch.equal(mask, flexfa.dropout_mask(seed + 1, 2, 3, 20, 40, p))
    assert torch.equal(mask, flexfa.dropout_mask((seed, offset), 2, 3, 20, 40, p))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_of_the_mask(p):
    mask = flexfa.dropout_mask(int(p * 1000), 1, 2, 64, 256, p)
    n = mask.numel()
    kept = mask.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 5 * sigma, f"keep rate {kept} for p={p} (sigma {sigma:.2e})"
    # neither rows nor columns share a pattern: per-row rates spread as binomials do
    rows = mask.double().mean(dim=-1).flatten()
    assert rows.std().item() < 3 * math.sqrt(p * (1 - p) / 256)
    assert not torch.equal(mask[0, 0, 0], mask[0, 0, 1]) and not torch.equal(mask[0, 0], mask[0, 1])


def test_keep_rate_of_the_kernel():
    """q = k = 0: P = 1/S on every key; with v = 1 each row's out is its kept fraction times
    1 / (1 - p), so the kernel's own keep rate is measured without the mask helper."""
    p, rows, keys = 0.25, 64, 512
    q = torch.zeros(1, 2, rows, 16)
    k = torch.zeros(1, 2, keys, 16)
    v = torch.ones(1, 2, keys, 16)
    out = flexfa.flex_attention(q, k, v, dropout_p=p, dropout_seed=99)
    kept = (out[..., 0].double() * (1 - p)).mean().item()
    sigma = math.sqrt(p * (1 - p) / (2 * rows * keys))
    assert abs(kept - (1 - p)) < 5 * sigma, f"kernel keep rate {kept}"
    mask = flexfa.dropout_mask(99, 1, 2, rows, keys, p)
    torch.testing.assert_close(out[..., 0].double(), mask.double().mean(-1) / keep_rate(p),
                               atol=1e-5, rtol=1e-5)


def keep_rate(p):
    """What a 16-bit threshold keeps: 1 - p rounded to a multiple of 2**-16, at least 2**-16."""
    return max(2 ** 16 - round(p * 2 ** 16), 1) / 2 ** 16


@pytest.mark.parametrize("p", [0.999, 0.9995])
def test_kept_values_are_scaled_by_the_inverse_keep_rate(p):
    """Regression: kept probabilities were scaled by 1 / (1 - p) while the threshold keeps
    1 - p rounded to 2**-16 steps: the output's expectation was 1.007 x (p = 0.999), 1.07 x
    (0.9999), 1.5e7 x (1 - 1e-12) the output without dropout. q = k = 0, v = 1: each row's
    out is its kept fraction times the scale."""
    rows, keys = 32, 256
    q, k = torch.zeros(1, 2, rows, 16), torch.zeros(1, 2, keys, 16)
    v = torch.ones(1, 2, keys, 16)
    out = flexfa.flex_attention(q, k, v, dropout_p=p, dropout_seed=5)
    mask = flexfa.dropout_mask(5, 1, 2, rows, keys, p)
    assert mask.any()
    torch.testing.assert_close(out[..., 0].double(), mask.double().mean(-1) / keep_rate(p),
                               atol=1e-6, rtol=1e-6)


def test_scale_is_the_inverse_of_the_keep_rate_at_every_p():
    """With the mask's keep rate (test_keep_rate_of_the_mask) this makes dropout unbiased:
    at p = 1 - 1e-5 the keep rate rounds to 2**-16 and 1 / (1 - p) made E[out] 1.53 x."""
    for p in (0.0, 0.1, 0.25, 0.5, 0.9, 0.999, 0.9999, 1 - 1e-5, 1 - 1e-12):
        assert dropout.scale(p) * keep_rate(p) == pytest.approx(1.0, rel=1e-15), p


def late_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx + 20  # rows 0..19 attend to nothing


def reference(q, k, v, p, seed, score_mod=None, mask_mod=late_causal, dtype=torch.float64,
              **kwargs):
    mask = flexfa.dropout_mask(seed, q.shape[0], q.shape[1], q.shape[2], k.shape[2], p)
    return attention_reference(q, k, v, score_mod, mask_mod, enable_gqa=True, return_lse=True,
                               dropout_mask=mask, dropout_p=p, dtype=dtype, **kwargs)


# split-KV: each split draws its own keys' part of the mask, the combine leaves it alone
SPLIT_HOPPER = {"BACKEND": "HOPPER", "SPLIT_KV": 3}


@pytest.mark.parametrize("template", [*sorted(TEMPLATES), "hopper_split"])
def test_forward_matches_the_reference_with_the_same_mask(template):
    q, k, v = make_qkv(B, HQ, HKV, L, S, E, dtype=torch.bfloat16)
    mask = flexfa.create_block_mask(late_causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    out, lse = flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True,
                                     dropout_p=0.4, dropout_seed=SEED,
                                     kernel_options=TEMPLATES.get(template, SPLIT_HOPPER))
    exact, eager = (reference(q, k, v, 0.4, SEED, dtype=d) for d in (torch.float64, q.dtype))
    assert_close_to_reference(out, exact[0], eager[0])
    assert_close_to_reference(lse, exact[1], eager[1], name="lse")  # dropout leaves lse alone


def gradients(q, k, v, p, seed, buffers, score_mod, options, with_sinks=False, block=32):
    """(flexfa's, float64's, same-dtype eager's) gradients of out and lse with respect to
    q, k, v (the sinks) and ``buffers``, under a block mask of ``block``-square blocks (the
    kernels' tiles are at most that)."""
    generator = torch.Generator().manual_seed(11)
    grad_out = torch.randn(*q.shape[:3], v.shape[3], generator=generator)
    grad_lse = torch.randn(*q.shape[:3], generator=generator)
    sinks = torch.linspace(-1.0, 2.0, q.shape[1]) if with_sinks else None
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    extra = [sinks.clone().requires_grad_()] if with_sinks else []
    mask = flexfa.create_block_mask(late_causal, None, None, q.shape[2], k.shape[2],
                                    device="cpu", BLOCK_SIZE=block)
    out, lse = flexfa.flex_attention(*inputs, score_mod, mask, enable_gqa=True, return_lse=True,
                                     sinks=extra[0] if extra else None, dropout_p=p,
                                     dropout_seed=seed, kernel_options=options)
    got = torch.autograd.grad([out, lse], inputs + extra + list(buffers),
                              [grad_out.to(q.dtype), grad_lse])
    wanted = []
    for dtype in (torch.float64, q.dtype):
        ref_inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref_extra = [sinks.clone().requires_grad_()] if with_sinks else []
        ref_out, ref_lse = reference(*ref_inputs, p, seed, score_mod, dtype=dtype,
                                     sinks=ref_extra[0] if ref_extra else None)
        wanted.append(torch.autograd.grad([ref_out, ref_lse], ref_inputs + ref_extra
                                          + list(buffers),
                                          [grad_out.to(dtype), grad_lse.to(dtype)]))
    return got, wanted[0], wanted[1]


@pytest.mark.parametrize("template,dtype,options,head_dim", [
    ("ampere", torch.float32, {}, E),
    ("hopper", torch.bfloat16, {"USE_TMA": True}, E),  # descriptors in the backward too
    ("ampere", torch.float32, {"DS_WORKSPACE": True}, E),  # dK/dV stores dS, dQ reads it
    # q and k in column blocks of 128 and 64 (flexfa.codegen.spec.head_dim_blocks)
    ("hopper", torch.bfloat16, {"USE_TMA": True}, 192),
])
def test_backward_draws_the_same_mask(template, dtype, options, head_dim, monkeypatch):
    specs = record_backward_specs(monkeypatch)
    q, k, v = make_qkv(1, HQ, HKV, L, S, head_dim, dtype=dtype, seed=12)
    bias = (0.1 * torch.randn(HQ, L)).requires_grad_()

    def row_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx]
    buffers = [] if options.get("DS_WORKSPACE") else [bias]  # dS workspace: no buffer grads
    got, exact, eager = gradients(q, k, v, 0.3, SEED, buffers, row_bias if buffers else None,
                                  {**TEMPLATES[template], **options},
                                  with_sinks=template == "hopper")
    names = ["dq", "dk", "dv"] + (["dsinks"] if template == "hopper" else []) + ["dbias"]
    for name, g, want, same in zip(names, got, exact, eager):
        floor = 1e-2 if dtype == torch.bfloat16 and name in ("dsinks", "dbias") else None
        assert_close_to_reference(g, want, same, fudge=6.0, name=name, floor=floor)
    assert [(s.dropout, s.ds_dq, s.use_tma, s.split_head_dim) for s in specs] == [
        (True, bool(options.get("DS_WORKSPACE")), bool(options.get("USE_TMA")),
         head_dim == 192)]


def test_tiles_of_16_keys_draw_the_same_mask(monkeypatch):
    """16-key tiles (a block mask of 16, as fp32 or E = 256 tiles can be) take half of a
    32-key block's Philox words: forward and both backward kernels against the mask kernel's
    32-key tiles."""
    from flexfa.runtime.families import ampere

    specs = record_backward_specs(monkeypatch)
    forward_specs = []
    original = ampere.forward_spec
    monkeypatch.setattr(ampere, "forward_spec",
                        lambda *a, **kw: forward_specs.append(original(*a, **kw))
                        or forward_specs[-1])
    q, k, v = make_qkv(1, HQ, HKV, L, S, E, dtype=torch.float32, seed=16)
    got, exact, eager = gradients(q, k, v, 0.3, SEED, [], None, TEMPLATES["ampere"], block=16)
    for name, g, want, same in zip(["dq", "dk", "dv"], got, exact, eager):
        assert_close_to_reference(g, want, same, fudge=6.0, name=name)
    assert [s.block_n for s in forward_specs] == [16]
    assert [(s.block_n1, s.block_n2) for s in specs] == [(16, 16)]


def test_p_zero_runs_todays_kernels(monkeypatch):
    from flexfa.runtime.families import ampere

    specs = []
    original = ampere.forward_spec
    monkeypatch.setattr(ampere, "forward_spec",
                        lambda *a, **kw: specs.append(original(*a, **kw)) or specs[-1])
    q, k, v = make_qkv(1, 2, 2, 40, 48, 16, seed=13)
    plain = flexfa.flex_attention(q, k, v, kernel_options={"BACKEND": "AMPERE"})
    zero = flexfa.flex_attention(q, k, v, dropout_p=0.0, dropout_seed=5,
                                 kernel_options={"BACKEND": "AMPERE"})
    assert torch.equal(plain, zero)
    assert all(not spec.dropout for spec in specs)


def test_p_close_to_one():
    q, k, v = make_qkv(1, 2, 2, 40, 48, 16, seed=14)
    for p in (0.99, 1 - 1e-12):
        out, lse = flexfa.flex_attention(q, k, v, return_lse=True, dropout_p=p, dropout_seed=7)
        assert torch.isfinite(out).all()
        exact = reference(q, k, v, p, 7, mask_mod=None)
        torch.testing.assert_close(out.double(), exact[0], atol=1e-5 / (1 - p), rtol=1e-4)
        torch.testing.assert_close(lse.double(), exact[1])
    # 1 - 1e-12 rounds to the largest 16-bit threshold: about one element in 2**16 survives
    assert flexfa.dropout_mask(7, 1, 2, 40, 48, 1 - 1e-12).sum() == 0


def test_seeds_decide_the_mask():
    q, k, v = make_qkv(1, 2, 2, 40, 48, 16, seed=15)
    first = flexfa.flex_attention(q, k, v, dropout_p=0.5, dropout_seed=3)
    assert torch.equal(first, flexfa.flex_attention(q, k, v, dropout_p=0.5, dropout_seed=3))
    assert not torch.equal(first, flexfa.flex_attention(q, k, v, dropout_p=0.5, dropout_seed=4))
    assert not torch.equal(first, flexfa.flex_attention(q, k, v, dropout_p=0.5,
                                                        dropout_seed=(3, 1)))
    # no seed: drawn from torch's generator, so torch.manual_seed reproduces it
    torch.manual_seed(0)
    drawn = flexfa.flex_attention(q, k, v, dropout_p=0.5)
    again = flexfa.flex_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(drawn, flexfa.flex_attention(q, k, v, dropout_p=0.5))
    assert not torch.equal(drawn, again)


def _no_launch(*args, **kwargs):
    raise AssertionError("a kernel was launched")


def test_bad_dropout_arguments_fail_before_any_launch(monkeypatch):
    monkeypatch.setattr(launch.Step, "launch", _no_launch)
    q, k, v = make_qkv(1, 2, 2, 16, 16, 16)
    cases = [
        (dict(dropout_p=1.0), InputError, r"dropout_p must be in \[0, 1\), got 1.0"),
        (dict(dropout_p=-0.1), InputError, r"dropout_p must be in \[0, 1\), got -0.1"),
        (dict(dropout_p=float("nan")), InputError, r"dropout_p must be in \[0, 1\), got nan"),
        (dict(dropout_p="0.1"), InputTypeError, "dropout_p must be a float in .*got str"),
        (dict(dropout_p=True), InputTypeError, "dropout_p must be a float in .*got bool"),
        (dict(dropout_p=0.1, dropout_seed=-1), InputError, r"seed must be in \[0, 2\*\*63\)"),
        (dict(dropout_p=0.1, dropout_seed=(1, 2 ** 32)), InputError,
         r"offset must be in \[0, 2\*\*32\), got 4294967296"),
        (dict(dropout_p=0.1, dropout_seed=1.5), InputTypeError, "dropout_seed must be None"),
        (dict(dropout_p=0.1, dropout_seed=(1, 2, 3)), InputTypeError, "dropout_seed must be"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            flexfa.flex_attention(q, k, v, **kwargs)
    with pytest.raises(InputError, match="flex_attention_fp8 has no dropout"):
        flexfa.fp8.flex_attention_fp8(q.bfloat16(), k.bfloat16(), v.bfloat16(), dropout_p=0.1)
    with pytest.raises(InputError, match="dropout_mask needs a seed"):
        flexfa.dropout_mask(None, 1, 1, 4, 4, 0.5)
    # dropout_mask's own arguments are named (the errors said dropout_seed and dropout_p)
    with pytest.raises(InputTypeError, match=r"dropout_mask: seed must be None, an int or a "
                                             r"\(seed, offset\) pair of ints, got \(1, 2, 3\)"):
        flexfa.dropout_mask((1, 2, 3), 1, 1, 4, 4, 0.5)
    with pytest.raises(InputError, match=r"dropout_mask: seed's offset must be in \[0, 2\*\*32\)"):
        flexfa.dropout_mask((1, 2 ** 32), 1, 1, 4, 4, 0.5)
    with pytest.raises(InputError, match=r"dropout_mask: p must be in \[0, 1\), got 1.0"):
        flexfa.dropout_mask(1, 1, 1, 4, 4, 1.0)
    with pytest.raises(InputError, match="dropout_mask: device='bogus' is not a torch device"):
        flexfa.dropout_mask(1, 1, 1, 4, 4, 0.5, device="bogus")


@pytest.mark.parametrize("sizes, error, message", [
    # int32 query / key indices wrap past 2**31 - 64 (the kernel wrote before the mask);
    # with S = 0 nothing ran and no error came
    ((1, 1, 2 ** 31, 0), InputError, "dropout_mask: L must be at most 2147483584 .*L=2147483648"),
    ((1, 1, 0, 2 ** 31 - 63), InputError, "dropout_mask: S must be at most 2147483584"),
    # past int64: torch's overflow error, after the checks above had passed
    ((2 ** 62, 4, 1, 1), InputError, "sizes whose product is past int64"),
    ((2 ** 40, 2 ** 40, 0, 4), InputError, "sizes whose product is past int64"),
    ((1, 1, 4.0, 4), InputTypeError, "dropout_mask: L must be an int, got float 4.0"),
    ((1, True, 4, 4), InputTypeError, "dropout_mask: H must be an int, got bool True"),
    ((1, 1, -1, 4), InputError, "dropout_mask: L must be >= 0, got -1"),
])
def test_dropout_mask_checks_its_sizes(sizes, error, message, monkeypatch):
    monkeypatch.setattr(launch.Step, "launch", _no_launch)
    with pytest.raises(error, match=message):
        flexfa.dropout_mask(1, *sizes, 0.5)


def test_dropout_mask_checks_the_cuda_grid():
    """(batch, head) pairs go on a CUDA grid axis of at most 65535, as flex_attention's."""
    from flexfa.features import _check_mask_sizes

    with pytest.raises(InputError, match="B \\* H = 65536 .* at most 65535"):
        _check_mask_sizes(1, 65536, 1, 1, torch.device("cuda"))
    _check_mask_sizes(1, 65536, 1, 1, torch.device("cpu"))
    _check_mask_sizes(1, 65536, 0, 1, torch.device("cuda"))  # nothing to launch


PHILOX_PROBE = '''
import triton
import triton.language as tl

{helpers}


@triton.jit
def philox_probe(OUT, key0, key1, N: tl.constexpr, WIDE: tl.constexpr):
    i = tl.arange(0, N).to(tl.uint32)
    c0 = i * 2654435761
    words = flexfa_philox(key0.to(tl.uint32), key1.to(tl.uint32), c0, c0 ^ 0x5BD1E995, i * 0 + 7,
                          i * 0 + 4294967295, WIDE)
    for j in tl.static_range(4):
        tl.store(OUT + j * N + tl.arange(0, N), words[j].to(tl.int64))
'''


def test_wide_multiply_philox_is_philox(tmp_path):
    """flexfa_philox's WIDE form (each 32 x 32 product as one 64-bit multiply, the Gluon
    forward's at BLOCK_N 128) gives the four-multiply form's words, and Philox4x32-10's."""
    from flexfa.codegen.template import load_template
    from flexfa.loader import load_module

    path = tmp_path / "philox_probe.py"
    path.write_text(PHILOX_PROBE.format(helpers=load_template("helpers.tmpl")))
    module = load_module(path, interpret=True)
    seed, n = 0xDEADBEEF12345678, 64
    outs = []
    for wide in (False, True):
        out = torch.empty(4, n, dtype=torch.int64)
        module.philox_probe[(1,)](out, seed & 0xFFFFFFFF, seed >> 32, N=n, WIDE=wide)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    for i in (0, 1, 17, 63):
        c0 = (i * 2654435761) & 0xFFFFFFFF
        want = philox_words(seed, (c0, c0 ^ 0x5BD1E995, 7, 4294967295))
        assert tuple(outs[1][:, i].tolist()) == want, i
