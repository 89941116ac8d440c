"""flex_attention rejects bad input early, with flexfa errors naming argument and values."""
import pytest
import torch

import flexfa
from flexfa import mods
from flexfa.blockmask import create_block_mask
from flexfa.errors import InputError, InputTypeError, TraceError

AuxRequest = pytest.importorskip("torch.nn.attention.flex_attention").AuxRequest

q = torch.randn(1, 4, 20, 16)
k = torch.randn(1, 2, 30, 16)
v = torch.randn(1, 2, 30, 8)


def call(**overrides):
    args = dict(query=q, key=k, value=v, enable_gqa=True)
    args.update(overrides)
    return flexfa.flex_attention(**args)


BAD = [
    (dict(query=[1.0]), InputTypeError, "query must be a torch.Tensor"),
    (dict(key=torch.randn(2, 30, 16)), InputError, r"key must be 4-D.*\(2, 30, 16\)"),
    (dict(query=q.long()), InputTypeError, "query has dtype torch.int64"),
    (dict(value=v.double()), InputTypeError, "value has dtype torch.float64"),
    (dict(key=k.half()), InputError, "key has dtype torch.float16 but query has torch.float32"),
    (dict(key=torch.randn(2, 2, 30, 16)), InputError, "key has batch size 2 but query has 1"),
    (dict(value=torch.randn(1, 2, 31, 8)), InputError, "value has sequence length 31 but key has 30"),
    (dict(value=torch.randn(1, 1, 30, 8)), InputError, "value has 1 heads but key has 2"),
    (dict(key=torch.randn(1, 2, 30, 24)), InputError, "key has head_dim 24 but query has 16"),
    (dict(key=torch.randn(1, 3, 30, 16), value=torch.randn(1, 3, 30, 8)), InputError,
     "query has 4 heads but key has 3"),
    (dict(enable_gqa=False), InputError, "pass enable_gqa=True"),
    (dict(query=torch.randn(1, 0, 20, 16), key=torch.randn(1, 0, 30, 16),
          value=torch.randn(1, 0, 30, 8)), InputError, r"key and value have 0 heads \(query 0\)"),
    (dict(query=q.to_sparse()), InputError, "query has layout torch.sparse_coo"),
    (dict(value=torch._neg_view(v)), InputError, "value is a lazily negated view"),
    (dict(query=torch.randn(1, 2, 20, 264), key=torch.randn(1, 2, 30, 264)), InputError,
     "head_dim is 264"),
    (dict(scale="0.1"), InputTypeError, "scale must be a float"),
    (dict(scale=float("nan")), InputError, "scale must be finite"),
    (dict(scale=10 ** 400), InputError, "scale is 1000.*at most"),  # (past float's range)
    (dict(scale=1e-39), InputError, "scale is 1e-39; a nonzero scale must be at least 1.175e-38"),
    (dict(scale=-5e-324), InputError, "scale is -5e-324; a nonzero scale must be at least"),
    (dict(return_lse=1), InputTypeError, "return_lse must be a bool"),
    (dict(score_mod=3), InputTypeError, "score_mod must be callable"),
    (dict(score_mod=lambda s, b, h: s), TraceError, "3 required positional"),
    (dict(kernel_options={"BLOCK_K": 16}), InputError, r"unknown key 'BLOCK_K'.*BLOCK_M"),
    (dict(kernel_options={"BLOCK_M": 48}), InputError, "BLOCK_M.*48"),
    (dict(kernel_options={"num_warps": 3}), InputError, "num_warps.*3"),
    (dict(kernel_options={"fp32_precision": "bf16"}), InputError, "'ieee' or 'tf32'"),
    (dict(kernel_options=[("BLOCK_M", 16)]), InputTypeError, "kernel_options must be a dict"),
    (dict(block_mask="causal"), InputTypeError, "block_mask must be a BlockMask"),
    (dict(return_aux=True), InputTypeError, "return_aux must be an AuxRequest"),
    (dict(return_aux=AuxRequest(lse=1)), InputTypeError, "return_aux.lse must be a bool"),
    (dict(return_aux=AuxRequest(lse=True), return_lse=True), InputError,
     "return_lse and return_aux cannot both be given"),
    (dict(return_aux=AuxRequest(max_scores="yes")), InputTypeError,
     "return_aux.max_scores must be a bool"),
]


@pytest.mark.parametrize("overrides,error,message", BAD, ids=[m[:30] for _, _, m in BAD])
def test_bad_input_is_rejected(overrides, error, message):
    with pytest.raises(error, match=message):
        call(**overrides)


def test_errors_are_builtin_exception_types():
    with pytest.raises(ValueError):
        call(enable_gqa=False)
    with pytest.raises(TypeError):
        call(query="q")


def test_block_mask_for_other_lengths_or_heads():
    wrong_len = create_block_mask(mods.causal, None, None, 20, 32, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(InputError, match="32"):
        call(block_mask=wrong_len)
    wrong_heads = create_block_mask(mods.causal, 1, 3, 20, 30, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(InputError, match="H=3"):
        call(block_mask=wrong_heads)


def test_block_size_must_fit_the_kernel_tiles():
    block_mask = create_block_mask(mods.causal, None, None, 20, 30, device="cpu", BLOCK_SIZE=32)
    # (it said 'BLOCK_M=64 must divide 32' and to build the mask with a multiple of 16)
    with pytest.raises(InputError, match=r"BLOCK_M=64 does not fit its block size 32: .* pass "
                                         r"a kernel_options 'BLOCK_M' that divides 32 .*"
                                         r"multiple of 64"):
        call(block_mask=block_mask, kernel_options={"BLOCK_M": 64})


def test_pinned_backward_tiles_must_fit_the_mask():
    """A pinned backward tile larger than the mask's block (BLOCK_M1=128 under 32-blocks) was
    cut to 32 silently, where the forward's refused; it is refused before any launch."""
    block_mask = create_block_mask(mods.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    q, k, v = (torch.randn(1, 1, 64, 16, requires_grad=True) for _ in range(3))
    for key in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"):
        out = flexfa.flex_attention(q, k, v, block_mask=block_mask, kernel_options={key: 128})
        with pytest.raises(InputError, match=rf"backward tile {key}=128 does not fit"):
            out.sum().backward()


def test_captured_tensor_on_another_device_is_rejected():
    bias = torch.zeros(4, device="meta")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    with pytest.raises(InputError, match="captured tensor of shape \\(4,\\) on meta"):
        call(score_mod=score_mod)


def test_a_negated_view_is_refused_after_a_plain_call_of_its_shape():
    """A tensor with the negative bit (z.conj().imag) holds its values' negations in memory,
    which the kernels would read: refused, also on a repeated call whose plain tensors of the
    same shape, strides and dtype were checked before (torch's flex_attention refuses it too)."""
    negated = torch.randn(1, 2, 30, 8, dtype=torch.complex64).conj().imag
    call(value=negated.resolve_neg())
    with pytest.raises(InputError, match="value is a lazily negated view"):
        call(value=negated)
    bias = torch._neg_view(torch.randn(4))

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    with pytest.raises(InputError, match=r"captured tensor of shape \(4,\) that the score_mod "
                                         "'biased' reads is a lazily negated view"):
        call(score_mod=biased)


def test_block_mask_on_another_device_is_rejected():
    block_mask = create_block_mask(mods.causal, None, None, 20, 30, device="cpu", BLOCK_SIZE=16)
    block_mask.kv_num_blocks = block_mask.kv_num_blocks.to("meta")
    with pytest.raises(InputError, match="block_mask is on meta"):
        call(block_mask=block_mask)


def test_too_many_batch_head_pairs_for_a_cuda_grid_are_rejected():
    """(batch, head) pairs go on a CUDA grid axis of at most 65535 programs: more fail early,
    naming the numbers, instead of as a launch error inside Triton; the interpreter (CPU) has
    no such limit."""
    import types

    from flexfa.inputs import check_shapes

    def fake(B, H, is_cuda):
        return types.SimpleNamespace(shape=(B, H, 16, 16), is_cuda=is_cuda)

    B, H = 4097, 16  # 65552 pairs
    with pytest.raises(flexfa.InputError, match=r"4097 x 16 heads = 65552 .* 4095 batch entries"):
        check_shapes(fake(B, H, True), fake(B, H, True), fake(B, H, True), False)
    check_shapes(fake(4095, H, True), fake(4095, H, True), fake(4095, H, True), False)
    check_shapes(fake(B, H, False), fake(B, H, False), fake(B, H, False), False)


def test_return_aux_gives_lse_as_return_lse_does():
    """torch's newer form: return_aux=AuxRequest(lse=True) -> (out, AuxOutput(lse, None)), the
    same lse as return_lse=True and differentiable; AuxRequest() -> no lse."""
    from torch.nn.attention.flex_attention import AuxOutput

    qg = q.clone().requires_grad_(True)
    out, aux = call(query=qg, return_aux=AuxRequest(lse=True))
    ref_out, ref_lse = call(query=qg, return_lse=True)
    assert isinstance(aux, AuxOutput) and aux.max_scores is None
    assert torch.equal(out, ref_out) and torch.equal(aux.lse, ref_lse)
    (grad,) = torch.autograd.grad(aux.lse.sum(), qg)
    (ref_grad,) = torch.autograd.grad(ref_lse.sum(), qg)
    assert torch.equal(grad, ref_grad) and grad.abs().sum() > 0
    out, aux = call(return_aux=AuxRequest())
    assert aux == AuxOutput(lse=None, max_scores=None) and torch.equal(out, ref_out.detach())


def test_a_grid_past_cudas_limits_is_refused_before_any_launch():
    """batch * heads lies along a grid's y in the kernels (CUDA: at most 65535 there): past
    it the launch failed inside Triton on a GPU; now an InputError on every device."""
    many = torch.randn(1, 1, 17, 16).expand(1, 65536, 17, 16)  # (17 rows: not decode's grid)
    with pytest.raises(InputError, match=r"65536 along y, past CUDA's 65535"):
        flexfa.flex_attention(many, many, many)


@pytest.mark.parametrize("grid, fails", [
    ((2 ** 31 - 1, 65535, 65535), False), ((2 ** 31, 1), True), ((1, 65536), True),
    ((1, 1, 65536), True), ((70000,), False)])
def test_launch_grid_limits(grid, fails):
    from flexfa.runtime.launch import check_grid
    if fails:
        with pytest.raises(InputError, match="past CUDA's"):
            check_grid(None, grid)
    else:
        check_grid(None, grid)
