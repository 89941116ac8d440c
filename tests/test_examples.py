"""The examples run at tiny sizes and do what they say."""
import collections
import contextlib
import importlib.util
import math
import pathlib

import pytest
import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_block_trains_the_bias():
    train_block = load("train_block")
    model, losses = train_block.train(steps=2, seq_len=49, device="cpu", dim=16, heads=2,
                                      block_size=32)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert all(loss < 2 * math.log(16) for loss in losses), f"losses out of range: {losses}"
    assert model.rel_bias.abs().sum() > 0, "the optimizer never moved the bias"
    assert model.rel_bias.grad is not None and model.rel_bias.grad.abs().sum() > 0, \
        "the learnable bias got no gradient through flexfa"


def test_module_wrapper_matches_dense_attention():
    flex_module = load("flex_module")
    from flexfa import mods
    from flexfa.reference import attention_reference
    torch.manual_seed(0)
    attn = flex_module.FlexAttention(32, 2, score_mod=mods.softcap(10.0),
                                     mask_mod=mods.sliding_window(20), block_size=32)
    assert "softcap_10" in repr(attn) and "sliding_window_20" in repr(attn)
    x = torch.randn(2, 70, 32, requires_grad=True)
    y = attn(x)
    q, k, v = attn.qkv(x).view(2, 70, 3, 2, 16).permute(2, 0, 3, 1, 4)
    dense = attention_reference(q, k, v, attn.score_mod, attn.mask_mod, dtype=torch.float32)
    want = attn.out(dense.transpose(1, 2).reshape(2, 70, 32))
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    y.square().mean().backward()
    assert x.grad is not None and attn.qkv.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="num_heads"):
        flex_module.FlexAttention(30, 4)


@pytest.mark.parametrize("name,argv", [
    ("flex_module", ["--seq-len", "40", "--dim", "32"]),
    ("compare_torch", ["--seq-len", "48", "--heads", "1", "--head-dim", "16"]),
    ("train_block", ["--steps", "1", "--seq-len", "32"]),
])
def test_example_scripts_run(name, argv, capsys):
    assert load(name).main(argv) == 0
    assert capsys.readouterr().out.strip()


def test_decode_paged_generates_tokens():
    decode_paged = load("decode_paged")
    tokens, rate = decode_paged.generate(batch=2, layers=1, dim=32, heads=4, kv_heads=2,
                                         prompt=10, steps=2, window=8)
    assert tokens.shape == (2, 2) and rate > 0
    assert bool(((tokens >= 0) & (tokens < 97)).all())


def test_compiled_transformer_matches_eager_without_recompiling(tmp_path, capsys):
    import json
    from torch._dynamo.utils import counters
    counters.clear()
    assert load("compiled_transformer").main(["--steps", "2", "--json",
                                              str(tmp_path / "r.json")]) == 0
    assert "compiled - eager" in capsys.readouterr().out
    results = json.loads((tmp_path / "r.json").read_text())
    eager, compiled = results["flexfa eager"]["losses"], results["flexfa compiled"]["losses"]
    assert len(eager) == 2 and all(math.isfinite(loss) for loss in eager)
    assert max(abs(a - b) for a, b in zip(eager, compiled)) < 1e-4, (eager, compiled)
    assert counters["stats"]["unique_graphs"] == 1  # new documents each step, one graph
    assert results["flexfa compiled"]["graphs"] == 1


def test_compile_probe_passes_on_the_cpu(tmp_path, capsys):
    import json
    assert load("compile_probe").main(["--device", "cpu", "--json",
                                       str(tmp_path / "p.json")]) == 0
    assert "FAIL" not in capsys.readouterr().out
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert len(rows) == 6 and all(row["passed"] for row in rows), rows


# reads of a tensor's values back to the host, which a CUDA graph cannot capture: aten ops,
# and Tensor.tolist (which reads a CPU tensor's memory without an aten op)
HOST_SYNCS = ("aten.item", "aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero",
              "aten.equal", "Tensor.tolist")


@contextlib.contextmanager
def ops_inside(module, names: tuple):
    """A Counter of the aten ops (and ``Tensor.tolist`` calls) that ``module``'s functions
    ``names`` run while active (recorded inside them, at run time: a compiled graph calling
    them is not retraced)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    ops, depth = collections.Counter(), [0]

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[str(func).rsplit(".", 1)[0]] += 1
            return func(*args, **(kwargs or {}))

    def recorded(fn):
        def call(*args, **kwargs):
            depth[0] += 1
            try:
                with Record():
                    return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        ops["Tensor.tolist"] += depth[0] > 0
        return tolist(tensor)

    originals = {name: getattr(module, name) for name in names}
    for name, fn in originals.items():
        setattr(module, name, recorded(fn))
    torch.Tensor.tolist = counted_tolist
    try:
        yield ops
    finally:
        torch.Tensor.tolist = tolist
        for name, fn in originals.items():
            setattr(module, name, fn)


def test_compiled_decode_step_equals_eager_in_one_graph():
    """examples/compiled_decode.py: a decode step compiled whole (aot_eager, fullgraph) gives
    eager's logits at every position, which are the full-sequence model's; one graph serves
    every position (the position is tensor contents); without CUDA graphs each compiled step
    still launches flexfa's kernel from Python, once per layer, as eager does; a repeated
    step's operator call reads nothing back to the host (what a CUDA graph capture needs);
    the flex_decode step (kv_lens from the position) gives the same logits."""
    from torch._dynamo.utils import counters
    import flexfa
    import flexfa.ops
    from flexfa import mods
    example = load("compiled_decode")
    torch.manual_seed(0)
    model = example.Transformer(32, 32, 2, 2, flexfa.flex_attention)
    decoder = example.Decoder(model, batch=2, max_len=64, block=32)
    tokens = torch.randint(0, 32, (2, 3))
    eager = example.decode(decoder, decoder, tokens, warmup=1, cuda_graphs=False)
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(decoder, backend="aot_eager", fullgraph=True)
    compiled = example.decode(step, decoder, tokens[:, :2], warmup=1, cuda_graphs=False)
    with ops_inside(flexfa.ops, ("_call", "run_forward")) as ops, torch.no_grad():
        for position in range(2, 3):
            compiled["logits"] = torch.cat([compiled["logits"], step(tokens[:, position])[None]])
    assert ops["aten.empty"] and not any(ops[name] for name in HOST_SYNCS), ops
    assert decoder.pos.tolist() == [3, 3]
    torch.testing.assert_close(compiled["logits"], eager["logits"], rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert eager["launches_per_step"] == compiled["launches_per_step"] == 2  # no splits here
    mask = flexfa.create_block_mask(mods.causal, None, None, 3, 3, device="cpu", BLOCK_SIZE=32)
    with torch.no_grad():
        full = model(tokens, mask).transpose(0, 1)  # [steps, B, vocab]
    torch.testing.assert_close(eager["logits"], full, rtol=1e-5, atol=1e-5)
    # flex_decode with kv_lens = pos + 1 (the flexfa::flex_decode operator): the same logits
    decoder = example.Decoder(model, batch=2, max_len=64, block=32, lengths=True)
    torch._dynamo.reset()
    step = torch.compile(decoder, backend="aot_eager", fullgraph=True)
    lengths = example.decode(step, decoder, tokens[:, :2], warmup=1, cuda_graphs=False)
    with ops_inside(flexfa.ops, ("decode_call",)) as ops, torch.no_grad():
        last = step(tokens[:, 2])
    assert ops["aten.empty"] and not any(ops[name] for name in HOST_SYNCS), ops
    torch.testing.assert_close(torch.cat([lengths["logits"], last[None]]), full, rtol=1e-5,
                               atol=1e-5)
