"""PagedKVCache's host side: bad arguments are InputErrors that change nothing, writes stay
inside the pages reserved for their sequence, and the host's view of the lengths follows
writes made on the device (a decode step's ``kv_lens += 1``, CUDA-graph replays). Each test
here was a mutant of flexfa/paged.py that the suite let through (the forty-sixth session's
mutation audit): a torch error instead of an InputError, a write into another sequence's
page, or stale lengths that made the next append overwrite a token."""
import pytest
import torch

import flexfa
from flexfa import mods, paged
from flexfa.errors import InputError, InputTypeError


def _cache(num_pages=4, batch=1, **kwargs):
    return flexfa.PagedKVCache(num_pages, 16, batch, 1, 16, dtype=torch.float32, **kwargs)


def _kv(batch=1, length=1, dtype=torch.float32):
    return torch.randn(batch, 1, length, 16, dtype=dtype)


def _state(cache) -> tuple:
    return (cache.page_table.clone(), cache.kv_lens.clone(), cache.k_cache.clone(),
            list(cache._free))


def _unchanged(cache, before) -> None:
    after = _state(cache)
    for was, now in zip(before[:3], after[:3]):
        assert torch.equal(was, now)
    assert before[3] == after[3]


def _refusals():
    """name: (build the cache, the refused call on it, error type, message pattern)."""
    def reserved(pages=1, **kwargs):
        def make():
            cache = _cache(**kwargs)
            cache.reserve(0, 16 * pages)
            return cache
        return make
    kv = _kv()
    return {
        "negative_batch_idx": (lambda: _cache(batch=2), lambda c: c.reserve(-1, 16),
                               InputError, r"batch_idx -1 is outside 0..1"),
        "past_max_pages_per_seq": (lambda: _cache(8, max_pages_per_seq=2),
                                   lambda c: c.reserve(0, 48), InputError,
                                   r"seq_len 48 needs 3 pages; a sequence has at most 2"),
        "length_past_reserved": (reserved(), lambda c: c.set_length(0, 20), InputError,
                                 r"seq_len 20 is past sequence 0's 16 reserved keys"),
        "assign_batch_idx_past_the_batch": (
            lambda: _cache(batch=2), lambda c: c.assign(torch.tensor([2]), torch.tensor([[0]]),
                                                        kv, kv),
            InputError, r"batch_idx \[2\] has entries outside the cache's sequences 0..1"),
        "assign_negative_position": (
            reserved(2, max_pages_per_seq=2),
            lambda c: c.assign(torch.tensor([0]), torch.tensor([[-1]]), kv, kv), InputError,
            r"input_pos has positions outside 0..31"),
        "assign_unreserved_page": (
            lambda: _cache(2, batch=2),
            lambda c: c.assign(torch.tensor([0]), torch.tensor([[3]]), kv, kv), InputError,
            "assign writes positions outside the pages reserved for their sequences"),
        "float64_values": (
            reserved(), lambda c: c.assign(torch.tensor([0]), torch.tensor([[0]]),
                                           _kv(dtype=torch.float64), _kv(dtype=torch.float64)),
            InputTypeError, "k_val has dtype torch.float64"),
        "append_more_sequences": (lambda: _cache(batch=2), lambda c: c.append(_kv(3), _kv(3)),
                                  InputError, r"k_val has 3 sequences but the cache holds 2"),
        "mask_of_other_length": (
            _cache, lambda c: c.convert_logical_block_mask(flexfa.create_block_mask(
                mods.causal, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)),
            InputError, "block_mask covers 32 keys but the cache's sequences hold 64"),
    }


@pytest.mark.parametrize("name", sorted(_refusals()))
def test_bad_arguments_are_refused_and_change_nothing(name):
    make, call, error, message = _refusals()[name]
    cache = make()
    before = _state(cache)
    with pytest.raises(error, match=message):
        call(cache)
    _unchanged(cache, before)


def test_page_size_must_be_a_multiple_of_16():
    with pytest.raises(InputError, match="page_size is 24; the decode kernel needs a multiple "
                                         "of 16"):
        flexfa.PagedKVCache(4, 24, 1, 1, 16, dtype=torch.float32)


def test_each_sequence_may_hold_every_page_by_default():
    """Without max_pages_per_seq one sequence may reserve all num_pages pages."""
    cache = _cache(4)
    assert cache.max_pages_per_seq == 4 and cache.page_table.shape == (1, 4)
    cache.reserve(0, 64)
    assert sorted(cache.page_table[0].tolist()) == [0, 1, 2, 3]


def test_an_unreserved_write_leaves_the_other_sequence_intact():
    """Sequence 1 holds both pages; a write for sequence 0 (no page) went through page -1
    into the cache's last page, sequence 1's key."""
    cache = _cache(2, batch=2)
    cache.reserve(1, 32)
    full = _kv(1, 32)
    cache.assign(torch.tensor([1]), torch.arange(32)[None], full, full)
    before = cache.k_cache.clone()
    with pytest.raises(InputError):
        cache.assign(torch.tensor([0]), torch.tensor([[3]]), _kv(), _kv())
    assert torch.equal(cache.k_cache, before)


def test_append_after_a_device_step_appends_after_its_token():
    """A decode step on the device (assign at kv_lens, then kv_lens += 1) and then append
    with no length() in between: append read the host's stale length and wrote over the
    step's token, leaving kv_lens one short."""
    cache = _cache()
    first = _kv(1, 5)
    cache.append(first, first)
    cache.reserve(0, 16)
    step = _kv()
    cache.assign(torch.tensor([0]), cache.kv_lens[:1, None].long(), step, step, validate=False)
    cache.kv_lens[:1] += 1
    more = _kv(1, 2)
    cache.append(more, more)
    page = int(cache.page_table[0, 0])
    assert cache.kv_lens.tolist() == [8]
    assert torch.equal(cache.k_cache[page, 5], step[0, :, 0])
    assert torch.equal(cache.k_cache[page, 6:8], more[0].transpose(0, 1))


def test_set_length_of_one_sequence_keeps_a_device_advance_of_another():
    """kv_lens[0] += 1 on the device, then set_length(1, ...): the host must still see
    sequence 0's 6 keys (set_length hid the device write, and the next append overwrote)."""
    cache = _cache(batch=2)
    kv = _kv(2, 5)
    cache.append(kv, kv)
    cache.kv_lens[:1] += 1
    cache.set_length(1, 3)
    assert cache.length(0) == 6
    one = _kv(2)
    cache.append(one, one)
    assert cache.kv_lens.tolist() == [7, 4]


def test_lengths_set_on_the_host_need_no_read_back_inside_a_capture(monkeypatch):
    """After set_length (a host write the cache knows of) length() inside a CUDA-graph
    capture answers from the host (a read-back there would be refused)."""
    cache = _cache()
    cache.reserve(0, 16)
    cache.set_length(0, 5)
    monkeypatch.setattr(paged, "capturing", lambda: True)
    assert cache.length(0) == 5


def test_lengths_are_read_back_after_attend_under_capture(monkeypatch):
    """attend inside a capture: the graph's replays advance kv_lens with no version change
    (as a write through .data), so length() afterwards must read the device's values."""
    cache = _cache()
    kv = _kv(1, 5)
    cache.append(kv, kv)
    cache.reserve(0, 32)
    monkeypatch.setattr(paged, "capturing", lambda: True)
    cache.attend(torch.randn(1, 2, 1, 16), validate=False)
    monkeypatch.setattr(paged, "capturing", lambda: False)
    cache.kv_lens.data += 3  # three replays' kv_lens += 1, unseen by the version counter
    assert cache.length(0) == 8
