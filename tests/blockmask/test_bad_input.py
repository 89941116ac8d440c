"""Bad arguments to create_block_mask / create_mask fail early with flexfa's errors."""
import pytest
import torch

from flexfa import mods
from flexfa.blockmask import create_block_mask, create_mask
from flexfa.errors import InputError, InputTypeError, TraceError


def build(**changes):
    args = dict(mask_mod=mods.causal, B=1, H=1, Q_LEN=100, KV_LEN=100, device="cpu",
                BLOCK_SIZE=32)
    args.update(changes)
    return create_block_mask(**args)


@pytest.mark.parametrize("block", [0, -16, (32, 0), (-1, 64)])
def test_block_size_not_positive(block):
    with pytest.raises(InputError, match="BLOCK_SIZE must be positive") as info:
        build(BLOCK_SIZE=block)
    assert repr(block) in str(info.value)


@pytest.mark.parametrize("block", [32.0, "32", (32,), (32, 32, 32), True, None])
def test_block_size_wrong_type(block):
    with pytest.raises(InputTypeError, match="BLOCK_SIZE"):
        build(BLOCK_SIZE=block)


@pytest.mark.parametrize("name,value", [("Q_LEN", 0), ("KV_LEN", -5), ("B", 0), ("H", -1)])
def test_non_positive_sizes(name, value):
    with pytest.raises(InputError, match=f"{name}={value}"):
        build(**{name: value})


@pytest.mark.parametrize("name,value", [("Q_LEN", 10.0), ("KV_LEN", "8"), ("B", 2.5), ("H", True)])
def test_non_int_sizes(name, value):
    with pytest.raises(InputTypeError, match=name):
        build(**{name: value})


def test_wrong_arity():
    def three(b, q_idx, kv_idx):
        return q_idx >= kv_idx

    def score_mod(score, b, h, q_idx, kv_idx):
        return score
    with pytest.raises(TraceError, match="3 required positional"):
        build(mask_mod=three)
    with pytest.raises(TraceError, match="score_mod"):
        build(mask_mod=score_mod)


def test_non_bool_result():
    def distance(b, h, q_idx, kv_idx):
        return q_idx - kv_idx
    with pytest.raises(TraceError, match="must return bool"):
        build(mask_mod=distance)


def test_not_callable():
    # names the argument (the TraceError "a mod must be callable" named none)
    with pytest.raises(InputTypeError, match="create_block_mask: mask_mod must be callable"):
        build(mask_mod="causal")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda():
    with pytest.raises(InputError, match="CUDA is not available.*device='cpu'"):
        build(device="cuda")
    with pytest.raises(InputError, match="CUDA is not available"):
        create_mask(mods.causal, 1, 1, 8, 8, device="cuda")


def test_bad_device_name():
    with pytest.raises(InputError, match="not a torch device"):
        build(device="gpu0")
    with pytest.raises(InputError, match="device=1180591620717411303424 is not a torch device"):
        build(device=2 ** 70)  # (torch's ValueError of an int past int64 escaped)
    with pytest.raises(InputError, match="'meta' is not supported.*'cpu' or 'cuda'"):
        build(device="meta")


def test_create_mask_checks_lengths():
    with pytest.raises(InputError, match="KV_LEN=0"):
        create_mask(mods.causal, 1, 1, 8, 0, device="cpu")


def test_captured_tensor_too_short():
    doc = mods.document([30, 40])  # 70 tokens

    with pytest.raises(InputError, match="Q_LEN=100, KV_LEN=100.*IndexError.*captured tensors"):
        build(mask_mod=doc)


def test_create_mask_captured_tensor_too_short():
    """create_mask names the lengths a captured tensor does not cover, as create_block_mask
    does (it raised torch's IndexError from the evaluation), for mask_mods and score_mods."""
    doc = mods.document([30, 40])  # 70 tokens
    bias = torch.zeros(50)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx]

    with pytest.raises(InputError, match="create_mask: evaluating mask_mod 'document_2' for "
                                         "Q_LEN=100, KV_LEN=100.*IndexError.*captured tensors"):
        create_mask(doc, 1, 1, 100, 100, device="cpu")
    with pytest.raises(InputError, match="create_mask: evaluating score_mod 'biased' for "
                                         "Q_LEN=64.*IndexError"):
        create_mask(biased, 1, 1, 64, 8, device="cpu")


@pytest.mark.parametrize("mask_shape", [(3, 4, 64, 64), (2, 2, 64, 64), (2, 4, 64, 128)])
def test_flex_attention_rejects_a_mismatched_mask(mask_shape):
    import flexfa
    q = k = v = torch.randn(2, 4, 64, 16)
    mask = create_block_mask(mods.causal, *mask_shape, device="cpu", BLOCK_SIZE=32)
    B, H, L, S = mask_shape
    with pytest.raises(InputError, match=rf"B={B}, H={H}, Q_LEN={L}, KV_LEN={S}.*B=2, H=4"):
        flexfa.flex_attention(q, k, v, block_mask=mask)


@pytest.mark.parametrize("name,value", [("Q_LEN", 2 ** 31), ("KV_LEN", 2 ** 70), ("B", 2 ** 40),
                                        ("H", 2 ** 31), ("BLOCK_SIZE", 2 ** 31),
                                        ("BLOCK_SIZE", (16, 2 ** 70))])
def test_sizes_past_int32(name, value):
    """Sizes the int32 tables cannot index are refused at once: Q_LEN=2**40 built tables for
    minutes until memory ran out, B=2**70 failed inside torch's expand."""
    with pytest.raises(InputError, match=f"{name} must be at most 2147483647") as info:
        build(**{name: value})
    assert repr(value) in str(info.value)
    if name != "BLOCK_SIZE":
        sizes = {**dict(B=1, H=1, Q_LEN=8, KV_LEN=8, device="cpu"), name: value}
        with pytest.raises(InputError, match=f"{name} must be at most 2147483647"):
            create_mask(mods.causal, **sizes)


@pytest.mark.parametrize("block", [2 ** 12, (2 ** 12, 16), (16, 2 ** 12), (2 ** 12, 40)])
@pytest.mark.parametrize("mask_mod", [mods.causal, mods.sliding_window(7),
                                      lambda b, h, q, kv: (q * 7 + kv * 3) % 5 != 0],
                         ids=["causal", "window", "scattered"])
def test_block_far_longer_than_the_sequence(block, mask_mod, monkeypatch):
    """A BLOCK_SIZE far past the lengths evaluates only the positions inside them: the
    padding of the one tile was evaluated too (BLOCK_SIZE=2**30 for 40 positions tried to
    allocate gigabytes; here 2**12 x 2**12 mask values for a 40 x 40 mask)."""
    from flexfa.blockmask import exact
    evaluated = []

    def counting(*args, **kwargs):
        value = evaluate_node(*args, **kwargs)
        evaluated.append(value.numel())
        return value
    evaluate_node = exact.evaluate_node
    monkeypatch.setattr(exact, "evaluate_node", counting)
    mask = create_block_mask(mask_mod, 1, 2, 40, 40, device="cpu", BLOCK_SIZE=block)
    assert max(evaluated, default=0) <= 2 * 40 * 40
    dense = create_mask(mask_mod, 1, 2, 40, 40, device="cpu")
    q_block, kv_block = mask.BLOCK_SIZE
    tiles = torch.tensor([[dense[..., i:i + q_block, j:j + kv_block].any().item()
                           for j in range(0, 40, kv_block)] for i in range(0, 40, q_block)])
    assert torch.equal(mask.to_dense().bool(), tiles.expand(1, 2, *tiles.shape))
    assert mask.full_kv_num_blocks.sum() == 0  # a tile holding padding is never full


@pytest.mark.parametrize("table", ["full_kv_indices", "q_num_blocks", "q_indices",
                                   "full_q_num_blocks", "kv_num_blocks"])
@pytest.mark.parametrize("bad", ["flattened", "sparse"])
def test_flex_attention_names_a_malformed_table(table, bad):
    """Every table of a hand-made BlockMask is checked for its dims and layout (a 1-dim full
    or q table failed with IndexError in the shape check, a sparse one with torch's
    NotImplementedError in the table validation)."""
    from flexfa import BlockMask, flex_attention
    mask = build(H=2, Q_LEN=40, KV_LEN=40, BLOCK_SIZE=16)
    names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
    tables = {n: getattr(mask, n) for n in names}
    tables[table] = tables[table].flatten() if bad == "flattened" else tables[table].to_sparse()
    odd = BlockMask((40, 40), *tables.values(), BLOCK_SIZE=(16, 16), mask_mod=mods.causal)
    q = torch.randn(1, 2, 40, 16)
    with pytest.raises(InputError, match=f"block_mask.{table} has "
                                         f"{'shape' if bad == 'flattened' else 'layout'}"):
        flex_attention(q, q, q, block_mask=odd)


def _causal_except_batch0(b, h, q_idx, kv_idx):
    return (b == 0) | (kv_idx <= q_idx)


def _causal_except_head1(b, h, q_idx, kv_idx):
    return (h == 1) | (kv_idx <= q_idx)


@pytest.mark.parametrize("mask_mod,dim", [(_causal_except_batch0, "B"),
                                          (_causal_except_head1, "H")])
@pytest.mark.parametrize("entry", ["flex_attention", "torch_mask", "flex_decode", "fp8"])
def test_a_mask_reading_b_or_h_is_not_broadcast(mask_mod, dim, entry):
    # tables of batch (head) size 1 hold b = 0's (h = 0's) tiles: the tiles full there would
    # run without the mask for the other batch entries (heads), 1.8 off in an audit's probe
    import flexfa
    from flexfa.fp8 import flex_attention_fp8
    q = k = v = torch.randn(2, 2, 64, 16)
    L = 16 if entry == "flex_decode" else 64  # (flex_decode: at most 16 query rows)
    q = q[:, :, :L]
    if entry == "fp8":  # (it takes half-precision inputs)
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    if entry == "torch_mask":
        from torch.nn.attention.flex_attention import create_block_mask as torch_create
        mask = torch_create(mask_mod, None, None, L, 64, device="cpu", BLOCK_SIZE=16)
    else:
        mask = create_block_mask(mask_mod, None, None, L, 64, device="cpu", BLOCK_SIZE=16)
    call = {"flex_attention": flexfa.flex_attention, "torch_mask": flexfa.flex_attention,
            "flex_decode": flexfa.flex_decode, "fp8": flex_attention_fp8}[entry]
    with pytest.raises(InputError, match=rf"built for {dim}=1 .* reads {dim.lower()} and the "
                                         rf"call has {dim}=2: the tables mark tiles full or "
                                         rf"empty for {dim.lower()}=0 only; build the mask "
                                         rf"with {dim}=2"):
        call(q, k, v, block_mask=mask)
    # built for every batch entry and head, it runs and is right
    full = create_block_mask(mask_mod, 2, 2, 64, 64, device="cpu", BLOCK_SIZE=16)
    if entry in ("flex_attention", "torch_mask"):
        from flexfa.reference import attention_reference
        out = flexfa.flex_attention(q, k, v, block_mask=full)
        want = attention_reference(q, k, v, None, mask_mod)
        assert (out.double() - want).abs().max() < 1e-5


def test_a_mask_not_reading_b_or_h_is_broadcast():
    import flexfa
    from flexfa.reference import attention_reference
    q = k = v = torch.randn(2, 2, 64, 16)
    mask = create_block_mask(mods.causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    assert (out.double() - attention_reference(q, k, v, None, mods.causal)).abs().max() < 1e-5


@pytest.mark.parametrize("mask_mod", [_causal_except_batch0, _causal_except_head1])
def test_tables_listing_every_tile_partial_serve_every_batch_and_head(mask_mod):
    # the mask_mod decides every element: tables of size 1 are right for every b and h (the
    # compiled decode step of docs/torch-compile.md keeps such a mask); an edit that marks a
    # tile full makes them unproven again
    import flexfa
    from flexfa.reference import attention_reference
    q = k = v = torch.randn(2, 2, 64, 16)
    counts = torch.full((1, 1, 4), 4, dtype=torch.int32)
    indices = torch.arange(4, dtype=torch.int32).expand(1, 1, 4, 4).contiguous()
    mask = flexfa.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=16, mask_mod=mask_mod)
    out = flexfa.flex_attention(q, k, v, block_mask=mask)
    assert (out.double() - attention_reference(q, k, v, None, mask_mod)).abs().max() < 1e-5
    counts[0, 0, 3] = 3  # q tile 3 leaves kv tile 3 out
    mask = flexfa.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=16, mask_mod=mask_mod)
    with pytest.raises(InputError, match="mark tiles full or empty"):
        flexfa.flex_attention(q, k, v, block_mask=mask)
