"""``torch.utils.flop_counter.FlopCounterMode`` counts flexfa's attention (flexfa.flops).

Regression: the mode counts the aten operators it sees, and flexfa's kernels are Triton
launches it never saw, so a model using flexfa counted no attention FLOPs (an MFU of 0 for
its attention). Each call now reports torch's counts for flex_attention: dense over the
shapes, forward ``2 B Hq L S (E + Ev)``, backward ``2 B Hq L S (3 E + 2 Ev)``; packed
documents per document; under the module that made the call."""
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import flexfa
from flexfa import mods

B, HQ, HKV, L, S, E, EV = 1, 4, 2, 40, 56, 16, 32


def forward_flops(batch_heads, pairs, e=E, ev=EV):
    return 2 * batch_heads * pairs * (e + ev)


def backward_flops(batch_heads, pairs, e=E, ev=EV):
    return 2 * batch_heads * pairs * (3 * e + 2 * ev)


def inputs(requires_grad=True, seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, HQ, L, E), (B, HKV, S, E), (B, HKV, S, EV))
    return [torch.randn(shape, generator=generator).to(device).requires_grad_(requires_grad)
            for shape in shapes]


def counts(mode) -> dict:
    return {str(op): n for op, n in mode.get_flop_counts().get("Global", {}).items()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_training_step_counts_the_forward_and_the_backward(device):
    """(On a GPU the backward runs on autograd's device thread: the mode reaches it too.)"""
    q, k, v = inputs(device=device)
    with FlopCounterMode(display=False) as mode:
        out = flexfa.flex_attention(q, k, v, enable_gqa=True)
        out.sum().backward()
    assert counts(mode) == {"flexfa.attention_forward": forward_flops(B * HQ, L * S),
                            "flexfa.attention_backward": backward_flops(B * HQ, L * S)}


def test_a_masked_call_counts_as_torch_counts_flex_attention_dense():
    """A block mask skips tiles but the count stays torch's (dense over the shapes), so a
    model counts the same under flexfa as under torch's flex_attention."""
    q, k, v = (t.detach() for t in inputs())
    mask = flexfa.create_block_mask(mods.causal, None, None, L, S, device="cpu", BLOCK_SIZE=16)
    with FlopCounterMode(display=False) as mode:
        flexfa.flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    assert mode.get_total_flops() == forward_flops(B * HQ, L * S)


def test_no_counting_and_no_extra_operator_without_a_flop_counter():
    """Only a FlopCounterMode gets the counting operators: another dispatch mode on the stack
    (a logging one here) sees none, and the call's results are the same under the mode."""
    q, k, v = inputs()

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))
    with Log() as log:
        out = flexfa.flex_attention(q, k, v, enable_gqa=True)
        out.sum().backward()
    assert log.ops and not [op for op in log.ops if "flexfa" in op]
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with FlopCounterMode(display=False):
        counted = flexfa.flex_attention(q, k, v, enable_gqa=True)
        counted.sum().backward()
    assert torch.equal(out, counted)
    for grad, t in zip(grads, (q, k, v)):
        assert torch.equal(grad, t.grad)


def test_counts_go_to_the_module_that_made_the_call():
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return flexfa.flex_attention(q, k, v, enable_gqa=True)
    model = Attention()
    q, k, v = inputs()
    with FlopCounterMode(display=False) as mode:
        model(q, k, v).sum().backward()
    per_module = mode.get_flop_counts()["Attention"]
    assert sum(per_module.values()) == (forward_flops(B * HQ, L * S)
                                        + backward_flops(B * HQ, L * S))


def test_packed_documents_count_each_document_against_its_own_keys():
    """As torch counts flash_attn_varlen: sum(lq_i * lk_i), not total_q * total_k."""
    lq, lk = [10, 0, 25], [12, 7, 30]
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lq), HQ, E, generator=generator, requires_grad=True)
    k = torch.randn(sum(lk), HKV, E, generator=generator, requires_grad=True)
    v = torch.randn(sum(lk), HKV, EV, generator=generator, requires_grad=True)
    pairs = sum(a * b for a, b in zip(lq, lk))
    with FlopCounterMode(display=False) as mode:
        out = flexfa.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
        out.sum().backward()
    assert counts(mode) == {"flexfa.attention_forward": forward_flops(HQ, pairs),
                            "flexfa.attention_backward": backward_flops(HQ, pairs)}
    mask = flexfa.varlen_block_mask(cu_q, cu_k)
    with FlopCounterMode(display=False) as mode:
        flexfa.flex_attention(*(t.detach().transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                              block_mask=mask, enable_gqa=True)
    assert mode.get_total_flops() == forward_flops(HQ, pairs)


def test_a_decode_step_counts_its_cache():
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, HQ, 1, E, generator=generator)
    k = torch.randn(2, HKV, S, E, generator=generator)
    v = torch.randn(2, HKV, S, EV, generator=generator)
    with FlopCounterMode(display=False) as mode:
        flexfa.flex_decode(q, k, v, kv_lens=torch.tensor([S, 9], dtype=torch.int32))
    assert counts(mode) == {"flexfa.attention_forward": forward_flops(2 * HQ, S)}


def test_the_operators_of_compiled_graphs_count_as_eager_calls():
    """The flexfa:: operators torch.compile captures, run eagerly (as an exported program
    runs them) under the mode, count what the eager call counts."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward
    q, k, v = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flexfa.flex_attention(q, k, v, enable_gqa=True),
                             backend=keep, fullgraph=True)
    compiled(q, k, v)
    (gm, example), = graphs
    assert any("flexfa.flex_attention" in str(node.target) for node in gm.graph.nodes)
    with FlopCounterMode(display=False) as mode:
        out = gm(*example)
        (out[0] if isinstance(out, (tuple, list)) else out).sum().backward()
    assert counts(mode) == {"flexfa.flex_attention": forward_flops(B * HQ, L * S),
                            "flexfa.flex_attention_backward": backward_flops(B * HQ, L * S)}
    torch._dynamo.reset()


def test_a_mode_made_before_flexfas_first_count_counts_it():
    """A FlopCounterMode copies torch's formulas when it is made; in a new process the
    counting operators do not exist yet then, and the first call must still count."""
    code = (
        "import torch, flexfa\n"
        "from torch.utils.flop_counter import FlopCounterMode\n"
        "q = torch.randn(1, 2, 32, 16, requires_grad=True)\n"
        "with FlopCounterMode(display=False) as mode:\n"
        "    flexfa.flex_attention(q, q, q).sum().backward()\n"
        "print(mode.get_total_flops())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    want = 2 * 2 * 32 * 32 * (16 + 16) + 2 * 2 * 32 * 32 * (3 * 16 + 2 * 16)
    assert int(done.stdout.split()[-1]) == want


def test_the_fp8_forward_counts_the_unpadded_head_dim():
    """The rotation pads E = 16 to 32 columns of e4m3; the count is the call's, at E = 16."""
    q, k, v = (t.detach().to(torch.bfloat16) for t in inputs())
    x = flexfa.fp8.quantize(q, k, v)
    assert x.q.shape[3] > E
    with FlopCounterMode(display=False) as mode:
        flexfa.fp8.flex_attention_fp8(x, enable_gqa=True)
    assert counts(mode) == {"flexfa.attention_forward": forward_flops(B * HQ, L * S)}
