"""Dropping a mod or a block mask releases its tensors; every in-process memo is bounded.

Before these rules, the prepared-mod memo held its own key (a WeakKeyDictionary whose value
referenced it) and the validated-signature memo held AttentionCalls: 40 dropped mods kept
1.9 GB of captured tensors alive, even after clearing the memo.
"""
import gc
import weakref

import pytest
import torch

import flexfa
from flexfa.memo import BoundedMemo, MaskedMemo, OwnedMemo, keep_on_owner

L = 64


def _inputs(grad: bool, dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(1, 2, L, 16, dtype=dtype, requires_grad=grad) for _ in range(3)]


def _one_call(grad: bool, hopper: bool):
    """One call with a score_mod and a block mask that capture tensors (bfloat16 through the
    Hopper family, float32 through the Ampere one); returns weak references to every user
    object and tensor involved."""
    options = {"BACKEND": "HOPPER" if hopper else "AMPERE"}
    q, k, v = _inputs(grad, torch.bfloat16 if hopper else torch.float32)
    bias = torch.randn(2, L, L, requires_grad=grad)
    doc = torch.arange(L) // 20

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    block_mask = flexfa.create_block_mask(mask_mod, None, None, L, L, device="cpu",
                                          BLOCK_SIZE=32)
    for _ in range(2):  # the second call runs through every memo's cached path
        out = flexfa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    kernel_options=options)
        if grad:
            out.sum().backward()
    return [weakref.ref(x) for x in (bias, doc, block_mask, block_mask.kv_indices, score_mod,
                                     mask_mod)]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("hopper", [False, True], ids=["ampere", "hopper"])
def test_dropping_mods_and_masks_releases_their_tensors(grad, hopper):
    refs = _one_call(grad, hopper)
    gc.collect()
    alive = [r() for r in refs]
    assert all(x is None for x in alive), [type(x).__name__ for x in alive if x is not None]


def test_a_kept_trace_holds_no_tensor_it_does_not_read():
    """The trace memo's guard held every tensor its walk reached: one the mod read as a number
    (``float(self.temperature)``, a constant of the trace) or one of a branch it did not take
    stayed alive after the mod let go of it, until the mod's next call."""
    class Mod:
        def __init__(self):
            self.temperature, self.bias, self.use_bias = torch.tensor(2.0), torch.randn(L), False

        def score_mod(self, score, b, h, q_idx, kv_idx):
            score = score / float(self.temperature)
            return score + self.bias[kv_idx] if self.use_bias else score
    mod = Mod()
    q = _inputs(False)[0]
    expected = flexfa.flex_attention(q, q, q, score_mod=mod.score_mod)
    refs = [weakref.ref(mod.temperature), weakref.ref(mod.bias)]
    mod.temperature, mod.bias = torch.tensor(2.0), torch.randn(L)
    gc.collect()
    assert [r() is None for r in refs] == [True, True]
    torch.testing.assert_close(flexfa.flex_attention(q, q, q, score_mod=mod.score_mod), expected)


def test_a_compiled_step_keeps_no_mask_or_table_alive():
    """The operators' BlockMask made from a graph's tables (found again by their storages),
    the table-check record and the density class kept by storage hold no table: a mask
    dropped after compiled training steps frees its tables' memory."""
    from torch.multiprocessing.reductions import StorageWeakRef
    bias = torch.randn(2, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    def layer(q, k, v, block_mask):
        return flexfa.flex_attention(q, k, v, score_mod, block_mask)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    q, k, v = _inputs(True)
    storages, masks = [], []
    for _ in range(2):
        block_mask = flexfa.create_block_mask(lambda b, h, i, j: i >= j, None, None, L, L,
                                              device="cpu", BLOCK_SIZE=32)
        compiled(q, k, v, block_mask).sum().backward()
        storages.append(StorageWeakRef(block_mask.kv_indices.untyped_storage()))
        masks.append(weakref.ref(block_mask))
        del block_mask
    gc.collect()
    assert all(m() is None for m in masks)
    assert all(s.expired() for s in storages)


def test_fresh_lambdas_per_call_keep_nothing():
    q, k, v = _inputs(False)
    tensors = []
    for step in range(20):
        bias = torch.randn(L)
        tensors.append(weakref.ref(bias))
        flexfa.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[j])
        del bias
    gc.collect()
    assert sum(r() is not None for r in tensors) == 0


def test_memo_classes_are_bounded_and_weak():
    memo = BoundedMemo(3)
    for i in range(10):
        memo[i] = i
    assert len(memo) == 3 and list(memo.values()) == [7, 8, 9]

    class Owner:
        pass
    owned = OwnedMemo(owners=2, per_owner=2)
    owners = [Owner() for _ in range(3)]
    for owner in owners:
        for key in range(3):
            owned.put(owner, key, key)
    assert owned.owner_count() == 2 and len(owned) == 4
    assert owned.get(owners[0], 2) is None  # the least recently used owner went
    del owners[2], owner
    gc.collect()
    assert owned.owner_count() == 1
    masked = MaskedMemo(2, per_mask=1)
    masked.put(None, "a", 1)
    masked.put(owners[1], "b", 2)
    assert masked.get(None, "a") == 1 and masked.get(owners[1], "b") == 2
    assert masked.get(owners[0], "b") is None


def test_an_owner_keeping_its_own_entries_is_freed_with_a_cycle_through_them():
    """An owner marked keep_on_owner holds its entries: an entry referring back to it (a
    plan binding the table that keeps its mask) is a cycle the collector frees, where the
    memo holding the entry would keep the owner alive for ever."""
    class Owner:
        pass
    owned = OwnedMemo(owners=4, per_owner=2)
    owner = Owner()
    keep_on_owner(owner)
    owned.put(owner, "plan", [owner])  # refers back to its owner
    assert owned.get(owner, "plan") == [owner] and len(owned) == 1 and owned.owner_count() == 1
    for key in range(3):  # bounded per owner as any owner
        owned.put(owner, key, key)
    assert owned.get(owner, "plan") is None and len(owned) == 2
    owned.clear()
    assert owned.get(owner, 2) is None and len(owned) == 0
    owned.put(owner, "plan", [owner])
    gone = weakref.ref(owner)
    del owner
    gc.collect()
    assert gone() is None and len(owned) == 0


def test_an_id_reused_by_a_new_mask_never_hits_an_old_entry():
    """A weakly keyed entry is found only for the very object it was stored for."""
    memo = OwnedMemo(owners=8, per_owner=1)

    class Mask:
        pass
    for _ in range(50):
        mask = Mask()
        assert memo.get(mask, "plan") is None
        memo.put(mask, "plan", id(mask))
        del mask



def test_value_checks_of_a_long_lived_mod_are_bounded(monkeypatch):
    """A mod indexing by captured values (``bias[idx[kv_idx]]``) is checked on those values
    once per call domain (batch, heads, lengths) and read, and the outcome kept: a mod kept
    for a training run of varying lengths must not keep one record per length ever seen.
    The records are bounded: after many other lengths the first one is checked again."""
    from flexfa.runtime import indices
    idx = torch.arange(1024)
    bias = torch.randn(1024)
    traced = flexfa.trace(lambda score, b, h, q_idx, kv_idx: score + bias[idx[kv_idx]])
    evaluated = []
    exact_range = indices._exact_range
    monkeypatch.setattr(indices, "_exact_range",
                        lambda *args: evaluated.append(args[2]) or exact_range(*args))
    cpu = torch.device("cpu")
    for kv_len in (*range(1, 1001), 1):
        indices.check_captured_indices(traced, None, (1, 1, 1), kv_len, cpu)
    assert len(evaluated) == 1001  # the first length's record was dropped by the bound


def test_a_kept_decode_workspace_keeps_no_dropped_mask_tables():
    """A DecodeWorkspace lives as long as the decode loop (CUDA graphs replay its buffers);
    the block masks of its calls come and go. It recognises its plan by identity only, so it
    must not keep the plan, whose launch binds the mask's tables, alive."""
    workspace = flexfa.DecodeWorkspace()
    k, v = torch.randn(1, 1, L, 16), torch.randn(1, 1, L, 16)
    query = torch.randn(1, 2, 1, 16)
    doc = torch.arange(L) // 20
    block_mask = flexfa.create_block_mask(lambda b, h, q_idx, kv_idx: doc[kv_idx] <= doc[q_idx],
                                          None, None, 1, L, device="cpu", BLOCK_SIZE=16)
    for _ in range(2):  # the second call finds the plan and the workspace's buffers
        out = flexfa.flex_decode(query, k, v, block_mask=block_mask, workspace=workspace)
    assert out is workspace.out
    refs = [weakref.ref(x) for x in (block_mask, block_mask.kv_indices, doc)]
    del block_mask, doc
    gc.collect()
    assert all(r() is None for r in refs)


def _cache_sizes() -> dict:
    """len() of every memo and of every container a flexfa module holds at module level."""
    import sys
    from flexfa import memo
    sizes = {f"memo {m.name} {id(m)}": len(m) for m in list(memo._ALL)}
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("flexfa."):
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, (dict, set, list, weakref.WeakKeyDictionary,
                                  weakref.WeakValueDictionary)) and not name.startswith("__"):
                sizes[f"{module.__name__}.{name}"] = len(value)
    return sizes


def test_thousands_of_distinct_mods_masks_and_offsets_grow_no_cache():
    """Distinct objects per step (a new closure over new tensors, a new mask, new offsets):
    every memo stays within its bound and no module-level container grows with the steps."""
    from flexfa import memo, varlen
    from flexfa.runtime import indices
    cpu, steps = torch.device("cpu"), 2000
    before = _cache_sizes()
    for step in range(steps):
        bias, index = torch.randn(16), torch.arange(16)
        traced = flexfa.trace(lambda score, b, h, q_idx, kv_idx: score + bias[index[kv_idx]])
        indices.check_captured_indices(traced, None, (1, 1, 16), 16, cpu)
        doc = torch.arange(16) // (1 + step % 7)
        flexfa.create_block_mask(lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx], None,
                                 None, 16, 16, device="cpu", BLOCK_SIZE=16)
        offsets = torch.tensor([0, 1 + step % 15, 16], dtype=torch.int32)
        varlen.packed_block_mask("varlen_attention", offsets, offsets.clone(), 16, 16, True,
                                 None, (16, 16), cpu)
    gc.collect()
    for m in list(memo._ALL):
        bound = m.size if isinstance(m, BoundedMemo) else m._owners.size * m.per_owner
        assert len(m) <= bound, m
    grown = {name: (before.get(name, 0), size) for name, size in _cache_sizes().items()
             if size - before.get(name, 0) >= steps // 4}
    assert not grown, grown


# ---- each API path, run twice (the second through the memos), keeps none of its objects ----

def _document_mask(length: int, block: int, heads=None):
    doc = torch.arange(length) // 20
    mask = flexfa.create_block_mask(lambda b, h, q_idx, kv_idx: doc[kv_idx] <= doc[q_idx],
                                    None, heads, length, length, device="cpu",
                                    BLOCK_SIZE=block)
    return mask, doc


def _create_block_mask_only():
    mask, doc = _document_mask(L, 32)
    return mask, doc, mask.kv_indices, mask.mask_mod


def _paged_decode_union_walk():
    cache = flexfa.PagedKVCache(8, 16, 2, 1, 16, max_pages_per_seq=4, dtype=torch.float32)
    for row in range(2):
        cache.reserve(row, L)
    mask, doc = _document_mask(L, 16, heads=2)  # two query heads per kv head: a union walk
    bias = torch.randn(L)
    kv_lens = torch.tensor([40, 50], dtype=torch.int32)
    for _ in range(2):
        flexfa.flex_decode(torch.randn(2, 2, 2, 16), cache.k_cache, cache.v_cache,
                           lambda score, b, h, q_idx, kv_idx: score + bias[kv_idx], mask,
                           kv_lens=kv_lens, page_table=cache.page_table,
                           kernel_options={"DECODE_WALK": "UNION"})
    return cache, cache.k_cache, cache.page_table, kv_lens, mask, mask.kv_indices, doc, bias


def _varlen_per_token_score_mod():
    offsets = torch.tensor([0, 20, L], dtype=torch.int32)
    q, k, v = (torch.randn(L, 2, 16, requires_grad=True) for _ in range(3))
    per_token = torch.randn(L, requires_grad=True)
    for _ in range(2):
        flexfa.varlen_attention(q, k, v, offsets, offsets.clone(), causal=True, BLOCK_SIZE=16,
                                score_mod=lambda score, b, h, q_idx, kv_idx:
                                score + per_token[kv_idx]).sum().backward()
    return offsets, per_token, q


def _prepared_bound_method():
    class Bias:
        def __init__(self):
            self.table = torch.randn(L)

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return score + self.table[kv_idx]
    bias = Bias()
    mask, doc = _document_mask(L, 32)
    q, k, v = _inputs(False)
    for _ in range(3):  # the later calls take the prepared entry
        flexfa.flex_attention(q, k, v, bias.score_mod, mask)
    return bias, bias.table, mask, doc


def _dropout_and_sinks():
    q, k, v = _inputs(True)
    sinks, bias = torch.randn(2, requires_grad=True), torch.randn(L, requires_grad=True)
    for _ in range(2):
        flexfa.flex_attention(q, k, v, lambda score, b, h, q_idx, kv_idx: score + bias[kv_idx],
                              sinks=sinks, dropout_p=0.25).sum().backward()
    return sinks, bias, q


def _under_torch_compile():
    bias = torch.randn(2, requires_grad=True)
    doc = torch.arange(L) // 20

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    def layer(q, k, v):
        mask = flexfa.create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=32)
        return flexfa.flex_attention(q, k, v, score_mod, mask)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager")
    q, k, v = _inputs(True)
    for _ in range(2):
        compiled(q, k, v).sum().backward()
    del compiled
    torch._dynamo.reset()  # Dynamo's own code cache holds the frame's guards
    return bias, doc, score_mod, mask_mod, q


def _fp8_quantize():
    q, k, v = _inputs(False)
    quantized = flexfa.fp8.quantize(q, k, v, block_size=32)
    return q, quantized, quantized.q, quantized.q_scale


def _ring_shards():
    from flexfa.distributed import shard_sequence, unshard
    x = torch.randn(1, 2, L, 16)
    shards = [shard_sequence(x, rank, 2) for rank in range(2)]
    return x, unshard(shards), *shards


@pytest.mark.parametrize("path", [_create_block_mask_only, _paged_decode_union_walk,
                                  _varlen_per_token_score_mod, _prepared_bound_method,
                                  _dropout_and_sinks, _under_torch_compile, _fp8_quantize,
                                  _ring_shards], ids=lambda path: path.__name__.strip("_"))
def test_each_path_releases_its_objects(path):
    refs = [weakref.ref(x) for x in path()]
    gc.collect()
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, alive
