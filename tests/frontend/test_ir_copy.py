"""IR nodes under copy and pickle: a node is unique per structure, so copies are the node
itself and a pickle rebuilds the same node (a mask or model holding a trace can be copied)."""
import copy
import pickle

import torch

from flexfa import mods
from flexfa.frontend.trace import trace


def long_chain(score, b, h, q_idx, kv_idx):
    for step in range(2000):  # a graph deeper than pickle's recursion limit
        score = score * 0.999 + step * 1e-6 * q_idx
    return score


def test_copies_are_the_node():
    root = trace(mods.alibi(4)).root
    assert copy.copy(root) is root and copy.deepcopy(root) is root
    assert copy.deepcopy({"ir": [root]})["ir"][0] is root


def test_pickle_rebuilds_the_same_node():
    for mod in (mods.sliding_window(20), long_chain):
        traced = trace(mod)
        assert pickle.loads(pickle.dumps(traced.root)) is traced.root
        loaded = pickle.loads(pickle.dumps(traced))
        assert loaded.root is traced.root and loaded.key == traced.key


def test_a_traced_mod_deep_copies_with_its_nodes():
    bias = torch.randn(16)

    def key_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]
    traced = trace(key_bias)
    copied = copy.deepcopy(traced)
    assert copied.root is traced.root and torch.equal(copied.buffers[0], bias)
