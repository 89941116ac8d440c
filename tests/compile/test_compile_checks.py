"""flexfa under torch.compile refuses what eager flexfa refuses, runs what it runs, and sees
what a mask_mod reads. Each test here was a mutant of flexfa/compiled.py that the compile
tests let through (the forty-sixth session's mutation audit): a stale mask, swapped tables,
a missed error, or a valid call that failed to compile."""
import math
import weakref

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks

import flexfa
from flexfa import compiled as compiled_module


def _inputs(length=64, kv_length=None, requires_grad=False):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, length, 16, generator=generator)
    k, v = (torch.randn(1, 2, kv_length or length, 16, generator=generator) for _ in range(2))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _compiled(function, backend="eager"):
    torch._dynamo.reset()
    return torch.compile(function, backend=backend, fullgraph=True)


@pytest.fixture(autouse=True)
def dynamo_reset():
    yield
    torch._dynamo.reset()


class _Holder:
    pass


def test_a_mask_mod_reading_through_a_weak_reference_is_refused():
    """A mask_mod reading a number through weakref.ref: flexfa cannot follow it to guard on
    it, so a compiled call would keep the first value (1.34 off as it changed)."""
    holder = _Holder()
    holder.w = 8.0
    reference = weakref.ref(holder)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx) * reference().w < 64.0)

    def layer(q, k, v):
        mask = flexfa.create_block_mask(window, None, None, q.shape[2], k.shape[2],
                                        device="cpu", BLOCK_SIZE=32)
        return flexfa.flex_attention(q, k, v, block_mask=mask)
    with pytest.raises(flexfa.InputError, match="weak reference"):
        _compiled(layer)(*_inputs())


class _Masker:
    def __init__(self):
        self.causal = True

    def mask(self, b, h, q_idx, kv_idx):
        if self.causal:
            return kv_idx <= q_idx
        return (q_idx - kv_idx).abs() <= 40


def test_a_bool_a_mask_mod_reads_is_guarded():
    """A block mask built outside from a method reading a bool flag, rebuilt after the flag
    flips: the compiled call runs the mask_mod as it is now (0.95 off when Dynamo never saw
    the mask_mod read the flag)."""
    masker = _Masker()

    def layer(q, k, v, block_mask):
        return flexfa.flex_attention(q, k, v, block_mask=block_mask)
    compiled = _compiled(layer)
    q, k, v = _inputs()
    for flag in (True, False):
        masker.causal = flag
        mask = flexfa.create_block_mask(masker.mask, None, None, 64, 64, device="cpu",
                                        BLOCK_SIZE=16)
        torch.testing.assert_close(compiled(q, k, v, mask), layer(q, k, v, mask),
                                   rtol=1e-5, atol=1e-5, msg=lambda m: f"causal={flag}: {m}")


def _sliding(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 40)


def test_a_mask_without_separate_full_blocks_built_inside():
    """create_block_mask(separate_full_blocks=False) inside the compiled function: forward
    and gradients equal eager's (its kv and q tables were swapped, and a mutant that always
    separated them failed to compile)."""
    def layer(q, k, v):
        mask = flexfa.create_block_mask(_sliding, None, None, q.shape[2], k.shape[2],
                                        device="cpu", BLOCK_SIZE=16,
                                        separate_full_blocks=False)
        return flexfa.flex_attention(q, k, v, block_mask=mask)

    def step(function):
        inputs = _inputs(requires_grad=True)
        out = function(*inputs)
        out.backward(torch.ones_like(out))
        return [out.detach(), *(t.grad for t in inputs)]
    for name, got, want in zip(("out", "dq", "dk", "dv"), step(_compiled(layer, "aot_eager")),
                               step(layer)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_a_non_square_mask_built_inside_keeps_its_lengths():
    """A mask of 64 queries over 128 keys built inside: its seq_lengths are (64, 128), and the
    call runs (lengths (KV, Q) raised a spurious length mismatch)."""
    def offset_causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 64

    def layer(q, k, v):
        mask = flexfa.create_block_mask(offset_causal, None, None, q.shape[2], k.shape[2],
                                        device="cpu", BLOCK_SIZE=32)
        return flexfa.flex_attention(q, k, v, block_mask=mask), mask.seq_lengths
    inputs = _inputs(64, 128)
    got, got_lengths = _compiled(layer)(*inputs)
    want, want_lengths = layer(*inputs)
    assert tuple(got_lengths) == tuple(want_lengths) == (64, 128)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compute_dq_write_order_inside_is_refused():
    def build(q):
        mask = flexfa.create_block_mask(flexfa.mods.causal, None, None, q.shape[2], q.shape[2],
                                        device="cpu", BLOCK_SIZE=32,
                                        compute_dq_write_order=True)
        return mask.kv_num_blocks
    with pytest.raises(flexfa.InputError, match="compute_dq_write_order"):
        _compiled(build)(torch.randn(1, 2, 64, 16))


@pytest.mark.parametrize("scale", [True, "0.5", 2])
def test_scale_is_checked_as_eagerly(scale):
    """scale=True ran with scale 1.0 and "0.5" failed inside Dynamo when the compiled path
    skipped the scale check; an int is taken as a float, as eagerly."""
    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, scale=scale)
    inputs = _inputs()
    try:
        want = layer(*inputs)
    except flexfa.FlexFAError as error:
        with pytest.raises(type(error), match="scale must be a float or None"):
            _compiled(layer)(*inputs)
    else:
        torch.testing.assert_close(_compiled(layer)(*inputs), want, rtol=1e-5, atol=1e-5)


def test_the_first_bad_argument_is_reported_as_eagerly():
    """A non-callable score_mod and a bad block_mask: the score_mod's error, as eagerly."""
    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, 5, block_mask=7)
    with pytest.raises(flexfa.InputTypeError, match="score_mod must be callable"):
        layer(*_inputs())
    with pytest.raises(flexfa.InputTypeError, match="score_mod must be callable"):
        _compiled(layer)(*_inputs())


def test_decode_refuses_a_query_that_requires_grad():
    """flex_decode has no backward: compiled, a query requiring grad gave an output that
    silently carried no gradient; eager refuses it."""
    q = torch.randn(1, 2, 1, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)

    def step(q, k, v):
        return flexfa.flex_decode(q, k, v)
    for function in (step, _compiled(step)):
        with pytest.raises(flexfa.InputError, match="flex_attention, which has gradients"):
            function(q, k, v)


def test_return_aux_gives_only_what_it_asks_for():
    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, return_aux=flexfa.AuxRequest(lse=True))
    inputs = _inputs()
    (got, got_aux), (want, want_aux) = _compiled(layer)(*inputs), layer(*inputs)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_aux.lse, want_aux.lse)
    assert got_aux.max_scores is None and want_aux.max_scores is None


_CONFIG = {"window": 16, "unused": math.nan}


def _nan_beside(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx).abs() < _CONFIG["window"], score, score - 1.0)


class _Base:
    window = 8


class _Sub(_Base):
    window = 24


def _overridden(score, b, h, q_idx, kv_idx):
    return torch.where((q_idx - kv_idx).abs() <= _Sub.window, score, score - 2.0)


def _at_the_pin_limit():
    """A mod whose trace reads exactly MAX_PINNED Python numbers (the documented limit)."""
    def make(n):
        table = [0.001 * i for i in range(n)]

        def mod(score, b, h, q_idx, kv_idx):
            return score + table[1] * (q_idx - kv_idx)
        return mod

    def pinned(mod):
        return len(compiled_module.number_paths(mod, compiled_module.functions_run(mod)[1]))
    limit = compiled_module.MAX_PINNED
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled_module, "MAX_PINNED", 10 ** 6)  # (only while counting)
        mod = make(limit)
        mod = make(limit - (pinned(mod) - limit))
        assert pinned(mod) == limit
    return mod


@pytest.mark.parametrize("name", ["nan_beside", "overridden_class_attribute", "pin_limit"])
def test_valid_mods_compile_and_equal_eager(name):
    """A NaN beside the number a mod reads (pinned, it failed every guard), a subclass's
    override of a class attribute (both definitions pinned), exactly MAX_PINNED numbers
    (refused at the limit)."""
    mod = {"nan_beside": _nan_beside, "overridden_class_attribute": _overridden,
           "pin_limit": None}[name] or _at_the_pin_limit()

    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, mod)
    inputs = _inputs()
    torch.testing.assert_close(_compiled(layer)(*inputs), layer(*inputs), rtol=1e-5, atol=1e-5)


def test_torch_and_masks_of_a_mask_capturing_a_tensor():
    """torch's and_masks over a document mask capturing its ids: flexfa walks the library
    function's closure to the user's masks (a mutant that did not raised "cannot reach"),
    and the compiled call follows the ids edited in place."""
    doc_ids = torch.tensor([0] * 20 + [1] * 44)

    def same_doc(b, h, q_idx, kv_idx):
        return doc_ids[q_idx] == doc_ids[kv_idx]

    combined = and_masks(flexfa.mods.causal, same_doc)

    def layer(q, k, v):
        mask = flexfa.create_block_mask(combined, None, None, q.shape[2], k.shape[2],
                                        device="cpu", BLOCK_SIZE=32)
        return flexfa.flex_attention(q, k, v, block_mask=mask)
    compiled = _compiled(layer)
    inputs = _inputs()
    torch.testing.assert_close(compiled(*inputs), layer(*inputs))
    doc_ids[40:] = 2
    torch.testing.assert_close(compiled(*inputs), layer(*inputs))


def test_a_parameter_list_item_a_mod_reads():
    """A score_mod reading an nn.ParameterList's item (a container module's parameter, read
    through its own __getitem__): the compiled call equals eager and follows an item
    replaced by a new parameter. (The audit's mutant taking only a container's modules, not
    its parameters, passes this too: no result of it was found to differ.)"""
    biases = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(2))])

    def biased(score, b, h, q_idx, kv_idx):
        return score + biases[0][h]

    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, biased)
    compiled = _compiled(layer)
    inputs = _inputs()
    with torch.no_grad():
        for value in ([0.0, 1.0], [3.0, -2.0]):
            biases[0] = torch.nn.Parameter(torch.tensor(value))
            torch.testing.assert_close(compiled(*inputs), layer(*inputs), rtol=1e-5,
                                       atol=1e-5, msg=lambda m: f"biases {value}: {m}")
