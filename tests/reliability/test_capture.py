"""Inside a CUDA graph capture nothing the host derives from the block mask's values is taken
from a memo (a replay would run with today's values baked in, whatever the tables then hold)
and nothing is read back to the host: the coarser mask of untileable blocks is built again
(its ops are recorded, so each replay rebuilds it from the tables), the prepared call that
holds one is not taken (nor recorded), the tuning's density class is not read, no config is
timed, a table check (a device-side assert run at replay) is not remembered, and the dS
workspace, sized on the host from the tables, is refused. The capture is simulated on the CPU (each module's
``capturing``); tests/gpu/test_capture_gpu.py records real graphs and edits the tables."""
import pytest
import torch

import flexfa
from flexfa import mods, prepared
from flexfa.blockmask import coarsen, density
from flexfa.runtime import autotune, ds_workspace

L = 40
TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def _mask():
    return flexfa.create_block_mask(mods.causal, 1, 1, L, L, device="cpu", BLOCK_SIZE=8)


def test_coarse_mask_is_built_again_while_capturing(monkeypatch):
    mask, q = _mask(), torch.randn(1, 1, L, 16)
    eager = flexfa.flex_attention(q, q, q, block_mask=mask)  # memoized: the prepared call too
    kept = mask._flexfa_coarse[2]
    monkeypatch.setattr(coarsen, "capturing", lambda: True)
    monkeypatch.setattr(prepared, "capturing", lambda: True)
    built = []
    original = coarsen.coarsened
    monkeypatch.setattr(coarsen, "coarsened", lambda *a: built.append(a) or original(*a))
    for _ in range(2):
        torch.testing.assert_close(flexfa.flex_attention(q, q, q, block_mask=mask), eager)
    assert len(built) == 2 and mask._flexfa_coarse[2] is kept  # no memo read or written
    monkeypatch.setattr(coarsen, "capturing", lambda: False)
    monkeypatch.setattr(prepared, "capturing", lambda: False)
    flexfa.flex_attention(q, q, q, block_mask=mask)
    assert len(built) == 2  # outside a capture the memo serves again


def test_density_class_reads_nothing_while_capturing(monkeypatch):
    made = _mask()  # created: its class is recorded
    mask = flexfa.BlockMask(made.seq_lengths, *(getattr(made, n).clone() for n in TABLES),
                            BLOCK_SIZE=made.BLOCK_SIZE, mask_mod=made.mask_mod)  # unknown
    monkeypatch.setattr(density, "capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: pytest.fail("read"), raising=False)
    assert density.density_class(mask) == "masked"
    assert getattr(mask, "_flexfa_density_class", None) is None  # not kept: computed later
    monkeypatch.undo()
    assert density.density_class(mask) == "masked"  # 15 of 25 tiles, read now
    assert mask._flexfa_density_class == "masked"


def test_ds_workspace_is_refused_while_capturing(monkeypatch):
    mask = _mask()
    assert ds_workspace.bands_of(mask, L, L, 16, 16, torch.device("cpu"))[1] > 0
    monkeypatch.setattr(ds_workspace, "capturing", lambda: True)
    with pytest.raises(flexfa.InputError, match="DS_WORKSPACE=True cannot run inside a CUDA"):
        ds_workspace.bands_of(mask, L, L, 16, 16, torch.device("cpu"))


def test_dense_ds_bands_made_while_capturing_are_not_kept(monkeypatch):
    """Without a block mask the dS workspace's bands are device tensors made from the sizes:
    made inside a capture they are a recorded kernel's output, written at each replay, not
    before; kept in the memo they served a later call (outside the capture, before a replay)
    unwritten memory. They are made again on each call inside a capture, and kept outside."""
    cpu = torch.device("cpu")
    args = (None, 2 * L + 3, L, 16, 16, cpu)  # a geometry not met before in this process
    monkeypatch.setattr(ds_workspace, "capturing", lambda: True)
    inside = [ds_workspace.bands_of(*args) for _ in range(2)]
    assert inside[0][0] is not inside[1][0] and torch.equal(inside[0][0], inside[1][0])
    monkeypatch.setattr(ds_workspace, "capturing", lambda: False)
    outside = ds_workspace.bands_of(*args)
    assert outside[0] is not inside[0][0] and torch.equal(outside[0], inside[0][0])
    assert ds_workspace.bands_of(*args)[0] is outside[0]  # kept outside a capture


def test_nothing_is_tuned_while_capturing(monkeypatch, tmp_path):
    """A key not tuned yet takes the first config inside a capture (timing would synchronize)
    and stores nothing: the next call outside a capture tunes it."""
    monkeypatch.setenv("FLEXFA_CACHE_DIR", str(tmp_path))
    autotune.clear_memo()
    timed = []

    def time_config(config):
        timed.append(config)
        return float(config[0])

    monkeypatch.setattr(autotune, "capturing", lambda: True)
    assert autotune.tune("capture-test", [(2,), (1,)], time_config, label=str) == (2,)
    assert timed == [] and autotune.lookup("capture-test", 1) is None
    monkeypatch.setattr(autotune, "capturing", lambda: False)
    assert autotune.tune("capture-test", [(2,), (1,)], time_config, label=str) == (1,)
    assert timed == [(2,), (1,)]


def test_a_check_inside_a_capture_is_not_remembered(monkeypatch):
    """Inside a capture the table check is a device-side assert that runs at replay: the
    tables are not remembered as checked (by the mask or by their storages), so the next call
    outside the capture checks them; nor is a prepared call recorded."""
    from flexfa.blockmask import validate
    made = _mask()
    mask = flexfa.BlockMask(made.seq_lengths, *(getattr(made, n).clone() for n in TABLES),
                            BLOCK_SIZE=made.BLOCK_SIZE, mask_mod=made.mask_mod)  # unchecked
    checks = []
    original = validate.check_contents
    monkeypatch.setattr(validate, "check_contents",
                        lambda *a, **k: checks.append(a) or original(*a, **k))
    monkeypatch.setattr(validate, "_capturing", lambda tensor: True)
    monkeypatch.setattr(prepared, "capturing", lambda: True)
    q = torch.randn(1, 1, L, 16)
    entries = len(prepared.PREPARED)
    flexfa.flex_attention(q, q, q, block_mask=mask)
    assert len(checks) == 1 and validate.table_state(mask) is None
    assert len(prepared.PREPARED) == entries  # no prepared call recorded
    monkeypatch.setattr(validate, "_capturing", lambda tensor: False)
    monkeypatch.setattr(prepared, "capturing", lambda: False)
    validate.check_tables(mask, L, L)
    assert len(checks) == 2 and validate.table_state(mask) is not None
