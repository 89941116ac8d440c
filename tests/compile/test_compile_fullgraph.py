"""flexfa inside torch.compile(fullgraph=True): the flexfa:: operators are captured (no graph
break), outputs and gradients (captured tensors' included) equal eager flexfa's, captured
tensors are read fresh, and varying lengths under dynamic=True compile once. CPU backends:
aot_eager (Dynamo + AOTAutograd) and Inductor's C++ backend."""
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

import flexfa
from flexfa import BlockMask, mods
from flexfa.errors import InputError

# pytest puts this folder on sys.path (it has no __init__.py)
from compile_utils import assert_same, make_inputs, run_step


class Attention(torch.nn.Module):
    """A learnable ALiBi-like bias (a bound-method score_mod reading a parameter) and a
    document mask built inside forward from a captured tensor."""

    def __init__(self, heads: int, doc_ids: torch.Tensor):
        super().__init__()
        self.slopes = torch.nn.Parameter(torch.linspace(0.05, 0.2, heads))
        self.doc_ids = doc_ids

    def alibi(self, score, b, h, q_idx, kv_idx):
        return score - self.slopes[h] * (q_idx - kv_idx).abs()

    def document(self, b, h, q_idx, kv_idx):
        return (self.doc_ids[q_idx] == self.doc_ids[kv_idx]) & (q_idx >= kv_idx)

    def forward(self, q, k, v):
        mask = flexfa.create_block_mask(self.document, None, None, q.shape[2], k.shape[2],
                                        device="cpu", BLOCK_SIZE=32)
        return torch.tanh(flexfa.flex_attention(q * 2, k, v, self.alibi, mask)) + 1


def test_aot_eager_fullgraph_equals_eager_and_reads_fresh_contents():
    doc_ids = torch.tensor([0] * 20 + [1] * 28)
    model = Attention(2, doc_ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    inputs = make_inputs(48)
    assert_same(run_step(compiled, inputs, [model.slopes]),
                run_step(model, inputs, [model.slopes]))
    before = run_step(model, inputs, [model.slopes])[0]
    doc_ids[36:] = 2  # new contents of a captured tensor: the compiled graph reads them
    after = run_step(compiled, inputs, [model.slopes])
    assert (after[0] - before).abs().max() > 1e-3
    assert_same(after, run_step(model, inputs, [model.slopes]))
    with torch.no_grad():
        model.slopes.mul_(3.0)  # and a parameter updated in place
    assert_same(run_step(compiled, inputs, [model.slopes]),
                run_step(model, inputs, [model.slopes]))


def test_mask_built_outside_and_a_closure_over_a_learnable_tensor():
    """Closures over locals of the calling function (cells Dynamo also sees by inlining the
    mod), a mask built outside, then one built inside from a closure, and a rebound cell."""
    mask = flexfa.create_block_mask(mods.causal, 1, None, 40, 40, device="cpu", BLOCK_SIZE=32)
    bias = torch.zeros(2, requires_grad=True)
    with torch.no_grad():
        bias += torch.tensor([0.1, -0.2])
    limit = torch.tensor(24)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    def below(b, h, q_idx, kv_idx):
        return (kv_idx < limit) & (kv_idx <= q_idx)

    def layer(q, k, v):
        return flexfa.flex_attention(q, k, v, learnable, mask) * 2

    def layer_inside(q, k, v):
        inner = flexfa.create_block_mask(below, 1, None, 40, 40, device="cpu", BLOCK_SIZE=32)
        return flexfa.flex_attention(q, k, v, learnable, inner) * 2

    torch._dynamo.reset()
    inputs = make_inputs(40, seed=1)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert_same(run_step(compiled, inputs, [bias]), run_step(layer, inputs, [bias]))
    assert_same(run_step(torch.compile(layer_inside, backend="aot_eager", fullgraph=True), inputs,
                      [bias]), run_step(layer_inside, inputs, [bias]))
    bias = torch.tensor([-0.3, 0.2], requires_grad=True)  # the cell now holds another tensor
    assert_same(run_step(compiled, inputs, [bias]), run_step(layer, inputs, [bias]))


def test_a_compiled_step_checks_no_tables_of_a_mask_built_outside(monkeypatch):
    """The operators rebuild the mask once per step, and the backward's call finds the
    forward's (autograd's saved aliases of the tables, same storages): its plans and memos are
    reused, and the tables create_block_mask built are not checked again (a device sync per
    call on a GPU)."""
    from flexfa import ops
    from flexfa.blockmask import validate
    checks, built = [], []
    original = validate.check_contents
    monkeypatch.setattr(validate, "check_contents",
                        lambda *a, **k: checks.append(a) or original(*a, **k))
    monkeypatch.setattr(ops, "BlockMask", lambda *a, **k: built.append(a) or BlockMask(*a, **k))
    bias = torch.tensor([0.1, -0.2], requires_grad=True)

    def learnable(score, b, h, q_idx, kv_idx):
        return score + bias[h] * (q_idx - kv_idx)

    def layer(q, k, v, mask):
        return flexfa.flex_attention(q, k, v, learnable, mask) * 2

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for seed in (4, 5):  # a new mask per step, as a training loop builds one per batch
        mask = flexfa.create_block_mask(mods.causal, 1, None, 40, 40, device="cpu",
                                        BLOCK_SIZE=32)
        inputs = make_inputs(40, seed=seed)
        assert_same(run_step(lambda *qkv: compiled(*qkv, mask), inputs, [bias]),
                    run_step(lambda *qkv: layer(*qkv, mask), inputs, [bias]))
    assert checks == [] and len(built) == 2, (len(checks), len(built))


def test_captured_tensors_without_a_differentiable_read_get_zero_gradients():
    """Compiled as eager (tests/kernels/test_backward_edge.py): a learnable tensor read only
    in a branch the trace removes (it got None; the operator now takes it after the read
    ones) and one read only through a step (``floor``: the backward operator raised KeyError)
    get torch's zero gradient; a tensor computed inside the mod in a removed branch, needing
    no gradient, still compiles; one that needs a gradient is refused by name."""
    t = torch.tensor(0.5, requires_grad=True)
    bias = torch.zeros(2, requires_grad=True)

    def removed(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx < q_idx, t, score) + score

    def floored(score, b, h, q_idx, kv_idx):
        return score + bias[h].floor()

    def inner(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx < q_idx, torch.ones(()), score)

    def computed(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx < q_idx, torch.ones(2, requires_grad=True)[h], score)

    inputs = make_inputs(40, seed=4)
    # a tensor that requires grad in a removed branch and that the graph cannot reach (made
    # inside the mod): its zero gradient cannot be given, so the call is refused
    torch._dynamo.reset()
    with pytest.raises(flexfa.InputError, match="requires? grad in a branch its trace removes"):
        torch.compile(lambda q, k, v: flexfa.flex_attention(q, k, v, computed),
                      backend="aot_eager", fullgraph=True)(*inputs)
    for mod, param in ((removed, t), (floored, bias), (inner, None)):
        def layer(q, k, v):
            return flexfa.flex_attention(q, k, v, mod) * 2

        torch._dynamo.reset()
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        for fn in (layer, compiled):
            if param is not None:
                param.grad = None
            out = fn(*inputs)
            out.sum().backward()
            if param is not None:
                assert param.grad is not None and torch.equal(param.grad,
                                                              torch.zeros_like(param))
        for x in inputs:
            x.grad = None


def test_explain_reports_no_graph_break():
    model = Attention(2, torch.arange(64) // 30)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*make_inputs(64, seed=2))
    assert explained.graph_break_count == 0, [r.reason[:400] for r in explained.break_reasons]
    assert explained.graph_count == 1


def test_varying_lengths_compile_once_with_dynamic_shapes():
    model = Attention(2, torch.arange(72) // 20)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for length in (48, 72, 56):  # 2, 3, 2 blocks: one block would specialize
        inputs = make_inputs(length, seed=length)
        assert_same(run_step(compiled, inputs, [model.slopes]),
                    run_step(model, inputs, [model.slopes]))
    assert counters["stats"]["unique_graphs"] == 1


def test_inductor_cpu_fullgraph_equals_eager():
    pytest.importorskip("torch._inductor")
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        pytest.skip("Inductor's CPU backend compiles C++: no C++ compiler on PATH")
    model = Attention(2, torch.tensor([0] * 30 + [1] * 34))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    inputs = make_inputs(64, seed=3)
    assert_same(run_step(compiled, inputs, [model.slopes]),
                run_step(model, inputs, [model.slopes]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_inductor_gradient_of_a_transposed_captured_tensor(device):
    """A captured tensor that requires grad and is dense but not contiguous (a T5-style
    [buckets, heads] embedding's weight read as .t()): the backward operator's fake kernel
    gave its gradient the tensor's strides where the kernels return it contiguous, so
    Inductor's generated backward failed its size asserts (and without them read the
    gradient transposed: 18.4 off)."""
    pytest.importorskip("torch._inductor")
    if device == "cpu" and not any(shutil.which(c) for c in (
            os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        pytest.skip("Inductor's CPU backend compiles C++: no C++ compiler on PATH")
    length = 32
    embedding = torch.nn.Embedding(2 * length - 1, 2, device=device)

    def layer(q, k, v):
        table = embedding.weight.t()

        def relative(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + length - 1]
        return flexfa.flex_attention(q, k, v, relative)

    torch._dynamo.reset()
    inputs = [t.detach().to(device).requires_grad_() for t in make_inputs(length, seed=7)]
    assert_same(run_step(torch.compile(layer, fullgraph=True), inputs, [embedding.weight]),
                run_step(layer, inputs, [embedding.weight]))


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_float_scale_argument_that_changes(dynamic):
    """A scale passed as a float argument of the compiled function that changes between calls
    (Dynamo makes it symbolic from the second value, or from the first with dynamic=True):
    the scale check's math.isfinite could not be traced, an Unsupported error under
    fullgraph=True. Out-of-range values stay InputErrors."""
    q, k, v = (t.detach() for t in make_inputs(32, seed=8))

    def layer(q, k, v, scale):
        return flexfa.flex_attention(q, k, v, scale=scale)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for scale in (0.25, 0.3, 0.35):
        torch.testing.assert_close(compiled(q, k, v, scale), layer(q, k, v, scale),
                                   rtol=0, atol=0)
    for scale, match in ((float("inf"), "finite"), (float("nan"), "finite"),
                         (1e-50, "at least"), (1e39, "at most")):
        with pytest.raises(InputError, match=match):
            compiled(q, k, v, scale)


def test_fp8_attention_is_still_a_graph_break():
    from flexfa.fp8 import flex_attention_fp8

    q, k, v = (t.detach().to(torch.bfloat16) for t in make_inputs(64, seed=6))

    def layer(q, k, v):
        return flex_attention_fp8(q, k, v, mods.softcap(5.0)) * 2

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(layer, backend="aot_eager")(q, k, v), layer(q, k, v),
                               rtol=0, atol=0)


class RelativeBias:
    table = None  # [2 L - 1], set per length


relative = RelativeBias()


def relative_bias(score, b, h, q_idx, kv_idx):
    # the table's centre is read in Python: the trace holds it as a constant
    return score + relative.table[q_idx - kv_idx + relative.table.shape[0] // 2]


def relative_mask(b, h, q_idx, kv_idx):
    # the same read in a mask_mod
    return relative.table[q_idx - kv_idx + relative.table.shape[0] // 2] > -0.5


def _relative_layer(kind: str):
    """flex_attention with the relative table read by the score_mod, or by the mask_mod of
    a block mask built inside the compiled function."""
    def layer(q, k, v):
        if kind == "score_mod":
            return flexfa.flex_attention(q, k, v, relative_bias)
        mask = flexfa.create_block_mask(relative_mask, None, None, q.shape[2], k.shape[2],
                                        device="cpu", BLOCK_SIZE=16)
        return flexfa.flex_attention(q, k, v, block_mask=mask)
    return layer


@pytest.mark.parametrize("kind", ["score_mod", "mask_mod"])
def test_a_size_the_trace_read_is_guarded_under_dynamic_shapes(kind):
    """A mod whose IR holds a captured tensor's size (the centre of a relative-bias table of
    2 L - 1 entries) compiles again for a new size: the graph ran the first length's IR
    (a wrong offset) for every later length (a mask_mod's too, through the mask's sized
    paths)."""
    layer = _relative_layer(kind)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for length in (32, 48, 40):
        q, k, v = (t.detach() for t in make_inputs(length, seed=length))
        relative.table = torch.randn(2 * length - 1, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(compiled(q, k, v), layer(q, k, v), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def _bad_calls():
    """(name, function of q, k, v, error message) of calls eager flexfa refuses."""
    learnable = torch.zeros(40, requires_grad=True)

    def learnable_mask(b, h, q_idx, kv_idx):
        return (learnable[kv_idx] >= 0) & (q_idx >= kv_idx)

    mask = flexfa.create_block_mask(learnable_mask, None, None, 40, 40, device="cpu",
                                    BLOCK_SIZE=16)
    short = flexfa.create_block_mask(mods.causal, None, None, 32, 32, device="cpu",
                                     BLOCK_SIZE=16)
    sliced = flexfa.create_block_mask(mods.causal, None, 2, 40, 40, device="cpu",
                                      BLOCK_SIZE=16)[:, :1]
    return [
        ("mask_grad", lambda q, k, v: flexfa.flex_attention(q, k, v, block_mask=mask),
         "reads captured tensors that require grad"),
        ("score_mod", lambda q, k, v: flexfa.flex_attention(q, k, v, 3),
         "score_mod must be callable or None, got int"),
        ("enable_gqa", lambda q, k, v: flexfa.flex_attention(q, k, v, enable_gqa="yes"),
         "enable_gqa must be a bool"),
        ("scale", lambda q, k, v: flexfa.flex_attention(q, k, v, scale=torch.tensor(0.5)),
         "scale must be a float or None, got Tensor"),
        ("block_mask", lambda q, k, v: flexfa.flex_attention(q, k, v, block_mask=3),
         "block_mask must be a BlockMask"),
        ("3-D", lambda q, k, v: flexfa.flex_attention(q[0], k[0], v[0]),
         "query must be 4-D"),
        # raised while describe traces the mods and options (Dynamo does not trace it)
        ("kernel_options", lambda q, k, v: flexfa.flex_attention(q, k, v,
                                                                  kernel_options={"NOPE": 1}),
         "kernel_options has an unknown key 'NOPE'"),
        ("mask_lengths", lambda q, k, v: flexfa.flex_attention(q, k, v, block_mask=short),
         r"block_mask was built for \(B=1, H=1, Q_LEN=32, KV_LEN=32\) but flex_attention "
         r"got \(B=1, H=2, Q_LEN=40, KV_LEN=40\)"),
        ("sliced_mask", lambda q, k, v: flexfa.flex_attention(q, k, v, block_mask=sliced),
         "block_mask was sliced with"),
        ("create_block_mask", lambda q, k, v: flexfa.create_block_mask(
            mods.causal, 0, None, 40, 40, device="cpu"), "B must be positive, got B=0"),
        ("flex_decode", lambda q, k, v: flexfa.flex_decode(q[:, :, :1], k, v, return_lse="x"),
         "return_lse must be a bool, got str 'x'"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())),
                         ids=[c[0] for c in _bad_calls()])
def test_compiled_calls_refuse_what_eager_refuses(case):
    """Checked before the operator as eagerly: a mask_mod reading a tensor that requires grad
    compiled and its tensor got no gradient; a bool given as "yes" was taken as true; the
    others failed inside Dynamo or fake-tensor propagation with no flexfa message. With and
    without fullgraph the error is eager flexfa's type and message (fullgraph=True raised
    Dynamo's "Unsupported: Observed exception", or an InternalTorchDynamoError for errors of
    the mods' trace and the options; a mask of other B, H or a sliced one had other messages
    than eagerly, or none)."""
    _, call, message = _bad_calls()[case]
    inputs = make_inputs(40, seed=7)
    with pytest.raises(flexfa.FlexFAError, match=message) as eager:
        call(*inputs)
    for fullgraph in (False, True):
        torch._dynamo.reset()
        with pytest.raises(eager.type, match=message):
            torch.compile(call, backend="aot_eager", fullgraph=fullgraph)(*inputs)


def test_a_negated_view_compiles_to_the_resolved_inputs_result():
    """Eager flexfa refuses a lazily negated view (its kernels would read the memory, which
    holds the negations); under torch.compile the check cannot run while Dynamo traces
    (``is_neg``), and the graph gives the operator the resolved values: the result is that of
    ``q.resolve_neg()``, in one graph."""
    q, k, v = make_inputs(40, seed=9)
    negated = torch.complex(torch.zeros_like(q), -q).conj().imag  # values q, negative bit set
    assert negated.is_neg() and torch.equal(negated, q)
    with pytest.raises(flexfa.InputError, match="lazily negated view"):
        flexfa.flex_attention(negated, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flexfa.flex_attention(q, k, v),
                             backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(negated, k, v), flexfa.flex_attention(q, k, v),
                               atol=0, rtol=0)
