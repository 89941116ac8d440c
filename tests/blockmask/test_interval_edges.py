"""The block-mask interval rules and tile passes at their edges, each against the exact dense
mask (every listed-full tile all True, every unlisted tile all False, the rest partial), the
element mask a coarsened mask runs, or flex_decode's output. From the forty-seventh session's
mutation audit of blockmask/intervals.py, analysis.py, coarsen.py and derive.py: each test
failed under a mutant the rest of the suite let pass (the hypothesis soundness tests of
test_intervals.py draw one or two examples per rule in CI), every one of which listed a wrong
tile: floor division and modulo by divisors spanning 0, varying or negative; fmod; a power
of a base below 1; a float comparison decided by the int rule; bitwise and / or / xor past
their operands; int not; casts to bool and to int; sin; a q range cut per chunk; a coarse
mask's full blocks; decode rows at negative positions."""
import torch

import flexfa
from flexfa import BlockMask
from flexfa.blockmask import analysis
from flexfa.blockmask.coarsen import runnable_block_mask
from flexfa.blockmask.tables import dense_to_ordered
from flexfa.frontend import dense_mask, ir, trace
from flexfa.frontend.ir import DType, Op
from flexfa.frontend.trace import MASK_MOD, TracedMod


# ---- helpers -------------------------------------------------------------------------------

def _classes_from_tables(m, B, H, rows, cols):
    """[B, H, rows, cols]: 0 not listed, 1 partial, 2 full, read from the kv tables."""
    cls = torch.zeros(B, H, rows, cols, dtype=torch.int64)
    pairs = [(m.kv_num_blocks, m.kv_indices, 1)]
    if m.full_kv_num_blocks is not None:
        pairs.append((m.full_kv_num_blocks, m.full_kv_indices, 2))
    for num, idx, val in pairs:
        num = num.expand(B, H, num.shape[2])
        idx = idx.expand(B, H, *idx.shape[2:])
        for b in range(B):
            for h in range(H):
                for r in range(min(rows, num.shape[2])):
                    for j in range(int(num[b, h, r])):
                        if int(idx[b, h, r, j]) < cols:
                            cls[b, h, r, int(idx[b, h, r, j])] = val
    return cls


def _dense(mask_mod, B, H, L, S):
    if isinstance(mask_mod, TracedMod):
        return dense_mask(mask_mod, B, H, L, S)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q, kv = torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)
    return torch.as_tensor(mask_mod(b, h, q, kv)).bool().expand(B, H, L, S)


def assert_tables_exact(mask_mod, L, S, block, B=1, H=1):
    bq, bk = block
    mask = flexfa.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)
    rows, cols = -(-L // bq), -(-S // bk)
    padded = torch.zeros(B, H, rows * bq, cols * bk, dtype=torch.bool)
    padded[..., :L, :S] = _dense(mask_mod, B, H, L, S)
    kept = padded.view(B, H, rows, bq, cols, bk).sum((3, 5))
    want = torch.where(kept == 0, 0, torch.where(kept == bq * bk, 2, 1))
    got = _classes_from_tables(mask, B, H, rows, cols)
    wrong = (got != want).nonzero().tolist()
    assert not wrong, (f"tiles {wrong[:4]}: listed {[int(got[tuple(t)]) for t in wrong[:4]]}, "
                       f"dense kept {[int(kept[tuple(t)]) for t in wrong[:4]]} of {bq * bk}")


# ---- interval rules (intervals.py) ---------------------------------------------------------

def test_float_floordiv_by_a_divisor_spanning_zero():
    """q // (kv - 3) with the divisor in [-3, 12] is unbounded (kv = 4: q // 1)."""
    assert_tables_exact(lambda b, h, q, kv: (q.float() // (kv.float() - 3.0)) < 3.0, 32, 16,
                        (16, 16))


def test_mod_by_a_varying_divisor_within_one_period_of_its_smallest():
    """q in [10, 14], divisor kv + 5 in [5, 9]: 13 % 7 = 6, not in [0, 4]."""
    assert_tables_exact(lambda b, h, q, kv: (q % (kv + 5)) < 5, 15, 5, (5, 5))


def test_mod_by_a_varying_negative_divisor():
    """q % (-1 - kv), divisor in [-8, -1]: results down to -7, not just 0."""
    assert_tables_exact(lambda b, h, q, kv: (q % (-1 - kv)) == 0, 16, 8, (8, 8))


def test_mod_by_a_negative_constant_can_be_zero():
    """(q - kv) % -4 lies in [-3, 0]; 0 on the diagonal."""
    assert_tables_exact(lambda b, h, q, kv: ((q - kv) % -4) < 0, 16, 16, (8, 8))


def test_fmod_by_a_varying_divisor():
    """fmod(q, kv + 1), divisor in [1, 8]: |result| up to 7 (fmod(5, 3) = 2)."""
    assert_tables_exact(lambda b, h, q, kv: torch.fmod(q, kv + 1) == 0, 16, 16, (8, 8))


def test_fmod_of_a_positive_dividend_can_be_zero():
    """fmod(q, kv + 4) for q in [8, 15] can be 0 (fmod(8, 4))."""
    assert_tables_exact(lambda b, h, q, kv: torch.fmod(q, kv + 4) >= 4, 16, 16, (8, 8))


def test_pow_of_a_base_below_one_falls_with_the_exponent():
    """a base in [0.1, 0.45] to kv + 1 in [1, 8] lies in [0.0017, 0.45]."""
    assert_tables_exact(lambda b, h, q, kv: (q.float() * 0.05 + 0.1) ** (kv.float() + 1.0) < 0.05,
                        8, 8, (8, 8))


def test_float_le_is_not_decided_by_the_int_rule():
    """q * 0.1 in [4.8, 5.5] <= kv + 5 in [5, 12] is not always True (5.5 > 5)."""
    assert_tables_exact(lambda b, h, q, kv: q.float() * 0.1 <= kv.float() + 5.0, 64, 16, (8, 8))


def test_bitwise_and_of_a_negative_value():
    """(kv - q - 1) in [-16, -2] & 12 reaches 12 ((-2) & 12)."""
    assert_tables_exact(lambda b, h, q, kv: ((kv - q - 1) & 12) > 0, 16, 8, (8, 8))


def test_bitwise_or_exceeds_both_operands():
    """q in [16, 23] | kv in [8, 15] reaches 31 (16 | 8 = 24)."""
    assert_tables_exact(lambda b, h, q, kv: (q | kv) < 24, 24, 16, (8, 8))


def test_bitwise_xor_exceeds_both_operands():
    """q in [16, 23] ^ kv in [8, 15] reaches 31 (16 ^ 8 = 24)."""
    assert_tables_exact(lambda b, h, q, kv: (q ^ kv) < 24, 24, 16, (8, 8))


def test_int_not_reaches_minus_hi_minus_one():
    """~(q - kv) for q - kv in [-7, 7] reaches -8."""
    assert_tables_exact(lambda b, h, q, kv: ~(q - kv) > -8, 8, 8, (8, 8))


def test_traced_cast_to_bool_of_a_range_touching_zero():
    """a TracedMod whose root casts q - kv (in [0, 15] on a tile) to bool (the
    tracer writes != 0, so the CAST rule is reached through a hand-built TracedMod only)."""
    root = ir.cast(ir.binary(Op.SUB, ir.index(Op.Q_IDX), ir.index(Op.KV_IDX)), DType.BOOL)
    assert_tables_exact(TracedMod(MASK_MOD, root, (), "nonzero_difference"), 16, 9, (8, 9))


def test_float_to_int_truncates_the_lower_bound():
    """int(0.5 * (q - kv)) for values [0.5, 7.5] reaches 0."""
    assert_tables_exact(lambda b, h, q, kv: (q.float() * 0.5 - kv.float() * 0.5).long() >= 1,
                        16, 8, (8, 8))


def test_sin_is_negative_too():
    """sin(q - kv) on the diagonal tile reaches sin(-1) = -0.84."""
    assert_tables_exact(lambda b, h, q, kv: torch.sin((q - kv).float()) > -0.5, 8, 8, (8, 8))


# ---- the tile pass (analysis.py) -----------------------------------------------------------

def test_two_q_tiles_built_one_row_per_chunk(monkeypatch):
    """a q-only node's 2-row range must be cut to each 1-row chunk (rows_per_chunk
    is 1 when B * H * KV_TILES > 2**21 / 2; forced here with the module's knob)."""
    monkeypatch.setattr(analysis, "MAX_GRID_ELEMENTS", 4)  # 4 kv tiles: one q tile per chunk
    assert_tables_exact(lambda b, h, q, kv: q // 3 >= kv, 16, 16, (8, 4))


# ---- coarsening (coarsen.py) ---------------------------------------------------------------

def _meaning(block_mask, B, H, traced):
    L, S = (int(n) for n in block_mask.seq_lengths)
    bq, bk = (int(b) for b in block_mask.BLOCK_SIZE)
    classes = _classes_from_tables(block_mask, B, H, -(-L // bq), -(-S // bk))
    per = classes.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[..., :L, :S]
    return (per == 2) | ((per == 1) & dense_mask(traced, B, H, L, S))


def test_odd_blocks_full_blocks_skip_the_mask_mod():
    """a (24, 40) mask's full blocks keep every element (the mask_mod is skipped,
    as in torch) in the coarse mask the kernels run; the expectation reads the tables
    directly, not through coarsen.block_classes."""
    def every_third(b, h, q_idx, kv_idx):
        return (q_idx + 2 * kv_idx + h) % 3 != 0
    classes = torch.tensor([[[[2, 1], [0, 2], [1, 0]]]])
    mask = BlockMask.from_kv_blocks(*dense_to_ordered(classes == 1),
                                    *dense_to_ordered(classes == 2), BLOCK_SIZE=(24, 40),
                                    mask_mod=every_third, seq_lengths=(50, 70))
    traced = trace(every_third, "mask_mod")
    run = runnable_block_mask(mask, traced)
    assert tuple(int(b) for b in run.BLOCK_SIZE) == (48, 80)
    assert torch.equal(_meaning(run, 1, 1, run.traced_mask), _meaning(mask, 1, 1, traced))


def test_decode_rows_at_negative_positions_read_q_block_zero():
    """flex_decode with BLOCK_SIZE (1, 64) (coarsened) and kv_lens < L puts rows at
    positions -2 and -1; they read q block 0's class (FULL here), not an out-of-range one."""
    def any_key(b, h, q_idx, kv_idx):
        return kv_idx >= 0
    L, S, kv_len = 4, 64, 2
    classes = torch.zeros(1, 1, S, 1, dtype=torch.long)
    classes[0, 0, 0, 0] = 2
    mask = BlockMask.from_kv_blocks(*dense_to_ordered(classes == 1),
                                    *dense_to_ordered(classes == 2), BLOCK_SIZE=(1, 64),
                                    mask_mod=any_key, seq_lengths=(S, S))
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, L, 16), torch.randn(1, 1, S, 16), torch.randn(1, 1, S, 16)
    out = flexfa.flex_decode(q, k, v, block_mask=mask,
                             kv_lens=torch.tensor([kv_len], dtype=torch.int32))
    expected = torch.zeros(1, 1, L, 16, dtype=torch.float64)
    for i in range(L):
        if int(classes[0, 0, max(kv_len - L + i, 0), 0]) == 2:
            s = q[0, 0, i].double() @ k[0, 0, :kv_len].double().T / 4.0
            expected[0, 0, i] = torch.softmax(s, -1) @ v[0, 0, :kv_len].double()
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
