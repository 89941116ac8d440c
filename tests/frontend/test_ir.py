"""The IR itself: hash-consing, stable structural keys, immutability, the printer, rewrite."""
import os
import subprocess
import sys
import threading

import pytest

from flexfa.frontend import ir, trace
from flexfa.frontend.ir import DType, Node, Op
from threads import run_in_threads

# builds _example() in a fresh interpreter from ir.py alone (no torch import: fast)
_KEY_SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("standalone_ir", sys.argv[1])
ir = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ir)
Op, DType = ir.Op, ir.DType
q, kv = ir.index(Op.Q_IDX), ir.index(Op.KV_IDX)
diff = ir.binary(Op.SUB, q, kv)
bias = ir.load(0, (ir.binary(Op.MOD, diff, ir.const(7)),), DType.FLOAT)
print(ir.binary(Op.ADD, ir.score(), ir.binary(Op.MUL, bias, ir.const(0.5))).key)
"""


def _example() -> Node:
    q, kv = ir.index(Op.Q_IDX), ir.index(Op.KV_IDX)
    diff = ir.binary(Op.SUB, q, kv)
    bias = ir.load(0, (ir.binary(Op.MOD, diff, ir.const(7)),), DType.FLOAT)
    return ir.binary(Op.ADD, ir.score(), ir.binary(Op.MUL, bias, ir.const(0.5)))


def test_equal_structure_is_the_same_object():
    assert _example() is _example()
    assert ir.const(1) is ir.const(1)
    # 1, 1.0 and True are different constants; so are 0.0 and -0.0, and nan is one node
    assert len({ir.const(1), ir.const(1.0), ir.const(True)}) == 3
    assert ir.const(0.0) is not ir.const(-0.0)
    assert ir.const(float("nan")) is ir.const(float("nan"))


def test_threads_building_one_structure_at_once_get_one_node():
    """Hash-consing holds across threads: when several build a structure no one holds yet
    (the first traces of two mods both make the score leaf), all get one object. Two copies
    made ``id(ir.score())`` miss one trace's score leaf: its score_mod got a zero gradient."""
    threads, rounds = 8, 5000
    barrier = threading.Barrier(threads)
    built = [[None] * threads for _ in range(rounds)]
    base = 0.5 + id(built)  # values no other test holds a node of

    def build(i):
        for r in range(rounds):
            barrier.wait()
            built[r][i] = Node.make(Op.CONST, DType.FLOAT, (), base + r)

    run_in_threads(build, [(i,) for i in range(threads)])
    split = [r for r, nodes in enumerate(built) if len({id(n) for n in nodes}) > 1]
    assert not split, f"{len(split)} of {rounds} rounds built several nodes for one structure"


def test_key_differs_with_structure_and_is_stable_across_processes():
    a = _example()
    b = ir.binary(Op.ADD, ir.score(), ir.const(0.5))
    assert a.key != b.key and len(a.key) == 64
    # another interpreter (another PYTHONHASHSEED, other object ids) computes the same key
    other = subprocess.run([sys.executable, "-c", _KEY_SCRIPT, ir.__file__], capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.stdout.strip() == a.key


def test_traced_mod_key_is_its_ir_key_plus_buffer_specs():
    import torch

    bias = torch.zeros(3, 7)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, (q_idx - kv_idx) % 7]

    traced = trace(biased)
    assert traced.buffer_specs == (((3, 7), torch.float32),)
    assert traced.key != traced.root.key and len(traced.key) == 64


def test_nodes_are_immutable_and_built_only_by_make():
    node = _example()
    with pytest.raises(AttributeError, match="immutable"):
        node.op = Op.SUB
    with pytest.raises(TypeError, match="Node.make"):
        Node(Op.CONST, DType.INT)


def test_promotion_and_casts():
    q = ir.index(Op.Q_IDX)
    assert ir.binary(Op.ADD, q, ir.const(1.5)).dtype is DType.FLOAT
    assert ir.binary(Op.DIV, q, ir.const(2)).dtype is DType.FLOAT
    assert ir.binary(Op.LT, q, ir.const(2.5)).dtype is DType.BOOL
    assert ir.binary(Op.ADD, ir.const(True), ir.const(True)).dtype is DType.INT
    assert ir.cast(ir.const(3), DType.FLOAT) is ir.const(3.0)
    assert ir.unary(Op.FLOOR, q) is q  # floor of an int is the int
    with pytest.raises(TypeError, match="negation of a bool"):
        ir.unary(Op.NEG, ir.binary(Op.LT, q, ir.const(1)))


def test_toposort_lists_sources_before_users_once():
    root = _example()
    order = root.toposort()
    position = {id(n): i for i, n in enumerate(order)}
    assert len(position) == len(order) and order[-1] is root
    for node in order:
        assert all(position[id(s)] < position[id(node)] for s in node.src)


def test_printer_output():
    expected = "\n".join([
        "%0: int = sub(q_idx, kv_idx)",
        "%1: int = mod(%0, 7)",
        "%2: float = bias[%1]",
        "%3: float = mul(%2, 0.5)",
        "%4: float = add(score, %3)",
        "return %4",
    ])
    assert ir.format_ir(_example(), ["bias"]) == expected
    assert ir.format_ir(_example()).splitlines()[2] == "%2: float = buf0[%1]"
    assert ir.format_ir(ir.const(True)) == "return True"


def test_rewrite_rebuilds_only_what_changed():
    root = _example()
    assert ir.rewrite(root, lambda n: n) is root
    seven_to_five = ir.rewrite(root, lambda n: ir.const(5) if n is ir.const(7) else n)
    assert "mod(%0, 5)" in ir.format_ir(seven_to_five)
    assert seven_to_five.src[0] is root.src[0]  # the score leaf is shared, not copied
