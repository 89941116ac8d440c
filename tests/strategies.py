"""Shared hypothesis strategies: random score_mods and mask_mods as real Python functions.

Use::

    from tests.strategies import score_mods, mask_mods, SMOOTH_OPS

    @given(data=st.data())
    def test_kernel(data):
        score_mod = data.draw(score_mods(B=2, H=4, L=100, S=232))
        mask_mod = data.draw(mask_mods(B=2, H=4, L=100, S=232))

What a drawn mod is
    A plain closure generated from Python source (``exec`` of a small factory), calling torch
    functions and operators the way a user would write them: call it with real broadcast
    index tensors (``b`` [B,1,1,1], ``h`` [1,H,1,1], ``q_idx`` [1,1,L,1], ``kv_idx``
    [1,1,1,S], ``score`` [B,H,L,S]) for the direct torch answer, or hand it to ``trace``,
    ``flex_attention`` or ``create_block_mask``. Captured tensors (``t0``, ``t1``, ...) live in
    its closure; ``trace(mod).buffers`` returns the same tensor objects.

Attributes for debugging and for tests
    ``__name__``: ``random_score_mod_<hash of source>`` (an identifier); ``__doc__`` and
    ``mod.source``: the factory source plus the captured tensors' dtypes and shapes, also
    passed to ``hypothesis.note`` so a failing example prints it; ``mod.captured``: {name:
    tensor}; ``mod.sizes``: (B, H, L, S) the mod is valid for.

Guarantees for those sizes (and any smaller ones)
    * every captured-tensor index is in range for all b < B, h < H, q_idx < L, kv_idx < S
      (indices are leaves of a matching extent, ``expr % n``, ``clamp(expr, 0, n - 1)``, or
      expressions whose interval fits the dimension): no negative or wrapped index;
    * float values stay finite and moderate (|x| <= about 64) as long as |score| <=
      ``score_bound``: interval bounds are tracked through the tree; exp/log/sqrt/rsqrt/tan
      are used only on arguments where they are safe, large values are squashed with tanh;
    * integer values stay below 2**20 (int32-safe in kernels); divisors are nonzero constants;
    * score_mods always use ``score``; masks mix empty, partial and full tiles (causal,
      windows, documents, prefixes, chunks, modulo patterns, head- and batch-dependent tables,
      boolean tables) combined with & | ^ ~ and torch.where.

Knobs
    ``ops``: the allowed operations, a subset of ``ALL_OPS`` (names below). Presets:
    ``SMOOTH_OPS`` (``smooth=True``): only ops with derivatives everywhere, for gradient tests
    (no abs/min/max/clamp/relu, no float comparisons); ``CONTINUOUS_OPS`` (the default): no
    op whose result jumps when a float input moves slightly (floor, ceil, sign, float->int,
    float //, float %, float comparisons), so fp16/bf16 kernels can be compared with a float64
    reference; ``ALL_OPS``: everything the tracer supports, for frontend tests.
    ``max_depth``: expression depth; ``max_buffers``: captured tensors per mod (0 = none);
    ``max_rank``: captured tensor rank (0..3); ``float_dtypes`` / ``int_dtypes``: dtypes of
    captured tensors (float32 by default: torch computes bf16 x bf16 in bf16, flexfa in fp32);
    ``grad_buffers``: float captured tensors require grad; ``score_bound``: assumed |score|.

Not generated: chained indexing ``t[b][h]`` (it means something else on broadcast tensors
than on scalars, so the direct call would not be a reference) and calls of other mods; the
frontend tests cover those by hand.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math

import torch
from hypothesis import note
from hypothesis import strategies as st

INT_OPS = frozenset({"int_add", "int_sub", "int_mul", "int_floordiv", "int_mod", "int_abs",
                     "int_minmax", "int_clamp", "int_where", "int_bitwise", "int_load"})
FLOAT_OPS = frozenset({"add", "sub", "mul", "div", "pow", "neg", "tanh", "sigmoid", "exp",
                       "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tan", "erf",
                       "where", "float_load", "int_to_float", "abs", "minmax", "clamp", "relu",
                       "floor", "ceil", "sign", "float_floordiv", "float_mod", "float_compare",
                       "float_to_int"})
BOOL_OPS = frozenset({"and", "or", "xor", "not", "bool_where", "bool_load"})
ALL_OPS = INT_OPS | FLOAT_OPS | BOOL_OPS
DISCONTINUOUS = frozenset({"floor", "ceil", "sign", "float_floordiv", "float_mod",
                           "float_compare", "float_to_int"})
CONTINUOUS_OPS = ALL_OPS - DISCONTINUOUS
SMOOTH_OPS = CONTINUOUS_OPS - {"abs", "minmax", "clamp", "relu"}

FLOAT_LIMIT = 64.0  # squash float values beyond this
INT_LIMIT = 1 << 20
_FLOAT_CONSTS = (0.5, 2.0, -1.5, 0.1, 3.0, -0.25, 1.0 / 3.0, 30.0, 0.0, -2.0)
_SPELLED_CONSTS = {"math.pi": math.pi, "math.e": math.e, "math.log(2.0)": math.log(2.0)}


@dataclasses.dataclass(frozen=True)
class Expr:
    """Generated source text with its dtype and an interval holding every value it takes."""
    src: str
    kind: str  # "int", "float", "bool"
    lo: float = 0.0
    hi: float = 0.0


# ---- public strategies ---------------------------------------------------------------------

def score_mods(B=2, H=3, L=100, S=232, *, ops=None, smooth=False, max_depth=4, max_buffers=3,
               max_rank=3, float_dtypes=(torch.float32,), int_dtypes=(torch.int32, torch.int64),
               grad_buffers=False, score_bound=8.0):
    """Random score_mods ``(score, b, h, q_idx, kv_idx) -> float`` valid for B, H, L, S."""
    config = _Config(B, H, L, S, _ops(ops, smooth), max_depth, max_buffers, max_rank,
                     tuple(float_dtypes), tuple(int_dtypes), grad_buffers, score_bound, True)
    return _mods(config)


def mask_mods(B=2, H=3, L=100, S=232, *, ops=None, max_depth=3, max_buffers=3, max_rank=3,
              float_dtypes=(torch.float32,), int_dtypes=(torch.int32, torch.int64)):
    """Random mask_mods ``(b, h, q_idx, kv_idx) -> bool`` valid for B, H, L, S."""
    config = _Config(B, H, L, S, _ops(ops, False), max_depth, max_buffers, max_rank,
                     tuple(float_dtypes), tuple(int_dtypes), False, 0.0, False)
    return _mods(config)


def _ops(ops, smooth):
    chosen = frozenset(ops) if ops is not None else (SMOOTH_OPS if smooth else CONTINUOUS_OPS)
    unknown = chosen - ALL_OPS
    assert not unknown, f"unknown ops {sorted(unknown)}; choose from {sorted(ALL_OPS)}"
    return chosen


@dataclasses.dataclass(frozen=True)
class _Config:
    B: int
    H: int
    L: int
    S: int
    ops: frozenset
    max_depth: int
    max_buffers: int
    max_rank: int
    float_dtypes: tuple
    int_dtypes: tuple
    grad_buffers: bool
    score_bound: float
    is_score_mod: bool


@st.composite
def _mods(draw, config: _Config):
    gen = _Generator(draw, config)
    if config.is_score_mod:
        expr = gen.float_expr(config.max_depth)
        if "score" not in expr.src:
            bound = config.score_bound
            expr = _add(Expr("score", "float", -bound, bound), expr)
        expr = gen.moderate(expr)
        params = "score, b, h, q_idx, kv_idx"
    else:
        expr = gen.mask_expr(config.max_depth)
        params = "b, h, q_idx, kv_idx"
    return _build(config, params, expr.src, gen.tensors)


def _build(config: _Config, params: str, body: str, tensors: dict):
    kind = "score_mod" if config.is_score_mod else "mask_mod"
    digest = hashlib.sha256(body.encode()).hexdigest()[:8]
    name = f"random_{kind}_{digest}"
    args = ", ".join(tensors) or ""
    source = (f"def make({args}):\n    def {name}({params}):\n        return {body}\n"
              f"    return {name}")
    described = "".join(f"\n# {n}: {str(t.dtype).replace('torch.', '')}{list(t.shape)}"
                        for n, t in tensors.items())
    namespace = {"torch": torch, "F": torch.nn.functional, "math": math}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102 - generated test code
    mod = namespace["make"](*tensors.values())
    B, H, L, S = config.B, config.H, config.L, config.S
    mod.source = mod.__doc__ = f"{source}\n# valid for B={B}, H={H}, L={L}, S={S}{described}"
    mod.captured = dict(tensors)
    mod.sizes = (B, H, L, S)
    try:
        note(mod.source)
    except Exception:  # drawn outside a test (strategy.example()): nothing to note into
        pass
    return mod


# ---- interval arithmetic -------------------------------------------------------------------

def _atomic(src: str) -> bool:
    """True for a name, number, call or subscript: safe as an operand without parentheses."""
    i = 0
    while i < len(src) and (src[i].isalnum() or src[i] in "._"):
        i += 1
    if i == len(src):
        return bool(src)
    if src[i] not in "([":
        return False
    depth = 0
    for j in range(i, len(src)):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(src[j], 0)
        if depth == 0:
            return j == len(src) - 1
    return False


def _p(e) -> str:
    """The source of ``e`` (an Expr or a string), parenthesized unless atomic."""
    src = e.src if isinstance(e, Expr) else e
    return src if _atomic(src) else f"({src})"


def _add(a: Expr, b: Expr, minus: bool = False) -> Expr:
    """``a + b`` or ``a - b`` (the kind is a's: b is a's kind or a constant)."""
    if minus:
        return Expr(f"{_p(a)} - {_p(b)}", a.kind, a.lo - b.hi, a.hi - b.lo)
    return Expr(f"{_p(a)} + {_p(b)}", a.kind, a.lo + b.lo, a.hi + b.hi)


def _span(values):
    return min(values), max(values)


def _mul(a: Expr, b_lo: float, b_hi: float):
    return _span([a.lo * b_lo, a.lo * b_hi, a.hi * b_lo, a.hi * b_hi])


# ---- the generator -------------------------------------------------------------------------

class _Generator:
    """Draws expressions top-down; lower choice indices are simpler (hypothesis shrinks there)."""

    def __init__(self, draw, config: _Config):
        self.draw, self.config, self.ops = draw, config, config.ops
        self.tensors: dict[str, torch.Tensor] = {}
        self.torch_gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def pick(self, options):
        return options[self.draw(st.integers(0, len(options) - 1))]

    def allowed(self, *names):
        return [n for n in names if n in self.ops]

    # -- leaves
    def index_leaf(self) -> Expr:
        c = self.config
        name, extent = self.pick([("q_idx", c.L), ("kv_idx", c.S), ("h", c.H), ("b", c.B)])
        return Expr(name, "int", 0, extent - 1)

    def int_const(self) -> int:
        return self.pick([1, 2, 3, -1, 7, 16, -5, 0, 64])

    def float_const(self) -> tuple[str, float]:
        if self.draw(st.integers(0, 5)) == 5:
            src = self.pick(list(_SPELLED_CONSTS))
            return src, _SPELLED_CONSTS[src]
        value = self.pick(list(_FLOAT_CONSTS))
        return repr(value), value

    # -- integers
    def int_expr(self, depth: int) -> Expr:
        choices = ["leaf"]
        if depth > 0:
            choices += self.allowed("int_add", "int_sub", "int_mul", "int_floordiv", "int_mod",
                                    "int_abs", "int_minmax", "int_clamp", "int_where",
                                    "int_bitwise", "int_load", "float_to_int")
        what = self.pick(choices)
        if what == "leaf":
            return self.index_leaf()
        expr = getattr(self, "_" + what)(depth - 1)
        if max(abs(expr.lo), abs(expr.hi)) >= INT_LIMIT:
            return Expr(f"{_p(expr)} % 1024", "int", 0, 1023)
        return expr

    def _int_add(self, depth):
        return _add(self.int_expr(depth), self.int_operand(depth))

    def _int_sub(self, depth):
        return _add(self.int_expr(depth), self.int_operand(depth), minus=True)

    def int_operand(self, depth) -> Expr:
        """An int expression or a constant, for the right side of a binary op."""
        if self.draw(st.booleans()):
            c = self.int_const()
            return Expr(str(c), "int", c, c)
        return self.int_expr(depth)

    def _int_mul(self, depth):
        a, c = self.int_expr(depth), self.pick([2, 3, -1, 0, 5])
        lo, hi = _mul(a, c, c)
        return Expr(f"{_p(a)} * {c}", "int", lo, hi)

    def _int_floordiv(self, depth):
        a, c = self.int_expr(depth), self.pick([2, 3, 16, -2, 1, 7])
        lo, hi = _span([a.lo // c, a.hi // c])
        return Expr(f"{_p(a)} // {c}", "int", lo, hi)

    def _int_mod(self, depth):
        a, c = self.int_expr(depth), self.pick([2, 3, 8, -3, 1, 5])
        return Expr(f"{_p(a)} % {c}", "int", *((0, c - 1) if c > 0 else (c + 1, 0)))

    def _int_abs(self, depth):
        a = self.int_expr(depth)
        lo = 0 if a.lo <= 0 <= a.hi else min(abs(a.lo), abs(a.hi))
        spelled = self.pick(["abs({})", "torch.abs({})", "{p}.abs()"])
        return Expr(spelled.format(a.src, p=_p(a)), "int", lo, max(abs(a.lo), abs(a.hi)))

    def _int_minmax(self, depth):
        a, b = self.int_expr(depth), self.int_expr(depth)
        if self.draw(st.booleans()):
            return Expr(f"torch.minimum({a.src}, {b.src})", "int", min(a.lo, b.lo), min(a.hi, b.hi))
        return Expr(f"torch.maximum({a.src}, {b.src})", "int", max(a.lo, b.lo), max(a.hi, b.hi))

    def _int_clamp(self, depth):
        a, lo = self.int_expr(depth), self.pick([0, -3, 5])
        hi = lo + self.pick([0, 4, 31])
        return Expr(f"torch.clamp({a.src}, {lo}, {hi})", "int", lo, hi)

    def _int_where(self, depth):
        cond, a, b = self.bool_expr(depth), self.int_expr(depth), self.int_operand(depth)
        return Expr(f"torch.where({cond.src}, {a.src}, {b.src})", "int",
                    min(a.lo, b.lo), max(a.hi, b.hi))

    def _int_bitwise(self, depth):
        # on nonnegative operands below 2**k every result is too; ~x = -x - 1
        a = self.nonnegative(self.int_expr(depth))
        b = self.nonnegative(self.int_expr(depth))
        top = 2 ** int(max(a.hi, b.hi, 1)).bit_length() - 1
        op = self.pick(["&", "|", "^", "~"])
        if op == "~":
            return Expr(f"~{_p(a)}", "int", -a.hi - 1, -a.lo - 1)
        return Expr(f"({_p(a)} {op} {_p(b)})", "int", 0, top)

    def nonnegative(self, a: Expr) -> Expr:
        return a if a.lo >= 0 else Expr(f"{_p(a)} % 64", "int", 0, 63)

    def _int_load(self, depth):
        return self.load("int", depth)

    def _float_to_int(self, depth):
        a = self.float_expr(depth)
        spelled = self.pick(["{p}.int()", "{p}.long()", "{p}.to(torch.int32)"])
        return Expr(spelled.format(a.src, p=_p(a)), "int", math.trunc(a.lo), math.trunc(a.hi))

    # -- floats
    def float_expr(self, depth: int) -> Expr:
        leaves = ["score"] if self.config.is_score_mod else []
        leaves += self.allowed("float_load", "int_to_float")
        if depth <= 0 or not leaves or self.draw(st.integers(0, 3)) == 0:
            if not leaves:  # a mask without float loads: floats come from indices
                return self._int_to_float(depth)
            what = self.pick(leaves)
            if what == "score":
                bound = self.config.score_bound
                return Expr("score", "float", -bound, bound)
            return self.load("float", depth - 1) if what == "float_load" else \
                self.moderate(self._int_to_float(depth - 1))
        choices = self.allowed("add", "sub", "mul", "div", "tanh", "sigmoid", "exp", "exp2",
                               "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tan", "erf",
                               "neg", "pow", "where", "abs", "minmax", "clamp", "relu",
                               "floor", "ceil", "sign", "float_floordiv", "float_mod")
        if not choices:
            return self.float_expr(0)
        what = self.pick(choices)
        method = getattr(self, "_f_" + what, None)
        expr = method(depth - 1) if method else self._f_unary(what, depth - 1)
        return self.moderate(expr)

    def moderate(self, e: Expr) -> Expr:
        bound = max(abs(e.lo), abs(e.hi))
        if bound <= FLOAT_LIMIT:
            return e
        return Expr(f"torch.tanh({_p(e)} * {1.0 / bound!r}) * 8.0", "float", -8.0, 8.0)

    def float_operand(self, depth) -> Expr:
        if self.draw(st.booleans()):
            src, value = self.float_const()
            return Expr(src, "float", value, value)
        return self.float_expr(depth)

    def _int_to_float(self, depth):
        a = self.int_expr(max(depth, 0))
        spelled = self.pick(["{p}.float()", "{p}.to(torch.float32)", "{p} * 1.0"])
        return Expr(spelled.format(a.src, p=_p(a)), "float", a.lo, a.hi)

    def _f_add(self, depth):
        return _add(self.float_expr(depth), self.float_operand(depth))

    def _f_sub(self, depth):
        return _add(self.float_expr(depth), self.float_operand(depth), minus=True)

    def _f_mul(self, depth):
        a, b = self.float_expr(depth), self.float_operand(depth)
        return Expr(f"{_p(a)} * {_p(b)}", "float", *_mul(a, b.lo, b.hi))

    def _f_div(self, depth):
        a = self.float_expr(depth)
        if self.draw(st.booleans()):
            c = self.pick([2.0, -3.0, 0.5, 30.0, 7.5])
            return Expr(f"{_p(a)} / {c!r}", "float", *_span([a.lo / c, a.hi / c]))
        d = self.float_expr(depth)  # a / (1 + d * d): the denominator is in [1, 1 + max d^2]
        top = 1.0 + max(d.lo ** 2, d.hi ** 2)
        return Expr(f"{_p(a)} / (1.0 + {_p(d)} ** 2)", "float",
                    *_span([a.lo, a.hi, a.lo / top, a.hi / top]))

    _UNARY = {  # name -> (spellings, domain check, monotone image or None)
        "tanh": (["torch.tanh({})", "F.tanh({})", "{p}.tanh()"], None, math.tanh),
        "sigmoid": (["torch.sigmoid({})", "F.sigmoid({})", "torch.special.expit({})"], None,
                    lambda x: 1.0 / (1.0 + math.exp(-x))),
        "exp": (["torch.exp({})", "{p}.exp()"], lambda lo, hi: hi <= 6.0, math.exp),
        "exp2": (["torch.exp2({})"], lambda lo, hi: hi <= 8.0, lambda x: 2.0 ** x),
        "log": (["torch.log({})"], lambda lo, hi: lo >= 0.05, math.log),
        "log2": (["torch.log2({})"], lambda lo, hi: lo >= 0.05, math.log2),
        "sqrt": (["torch.sqrt({})"], lambda lo, hi: lo >= 0.05, math.sqrt),
        "rsqrt": (["torch.rsqrt({})"], lambda lo, hi: lo >= 0.05, lambda x: -1.0 / math.sqrt(x)),
        "tan": (["torch.tan({})"], lambda lo, hi: -1.2 <= lo and hi <= 1.2, math.tan),
        "erf": (["torch.erf({})", "torch.special.erf({})"], None, math.erf),
        "neg": (["-{p}", "torch.neg({})"], None, lambda x: -x),
        "relu": (["torch.relu({})", "F.relu({})"], None, lambda x: max(x, 0.0)),
        "floor": (["torch.floor({})", "{p}.floor()"], None, math.floor),
        "ceil": (["torch.ceil({})"], None, math.ceil),
        "sign": (["torch.sign({})"], None, lambda x: float((x > 0) - (x < 0))),
        "sin": (["torch.sin({})"], None, None),
        "cos": (["torch.cos({})"], None, None),
    }

    def _f_unary(self, what, depth):
        spellings, domain, image = self._UNARY[what]
        a = self.float_expr(depth)
        if domain is not None and not domain(a.lo, a.hi):
            a = self.into_domain(what, a)
        src = self.pick(spellings).format(a.src, p=_p(a))
        if image is None:  # sin, cos
            return Expr(src, "float", -1.0, 1.0)
        lo, hi = _span([image(a.lo), image(a.hi)])
        if what == "rsqrt":
            lo, hi = 1.0 / math.sqrt(a.hi), 1.0 / math.sqrt(a.lo)
        if what == "neg":
            lo, hi = -a.hi, -a.lo
        return Expr(src, "float", lo, hi)

    def into_domain(self, what, a: Expr) -> Expr:
        """Reshape ``a`` into the op's safe domain, smoothly."""
        if what in ("log", "log2", "sqrt", "rsqrt"):  # 0.5 + sigmoid(a) in [0.5, 1.5]
            return Expr(f"0.5 + torch.sigmoid({a.src})", "float", 0.5, 1.5)
        return Expr(f"torch.tanh({a.src})", "float", math.tanh(a.lo), math.tanh(a.hi))

    def _f_pow(self, depth):
        a = self.float_expr(depth)
        form = self.pick(["square", "cube", "sqrt", "base2"])
        if form == "square":
            top = max(a.lo ** 2, a.hi ** 2)
            return Expr(f"{_p(a)} ** 2", "float", 0.0 if a.lo <= 0 <= a.hi else
                        min(a.lo ** 2, a.hi ** 2), top)
        if form == "cube" and max(abs(a.lo), abs(a.hi)) <= 4.0:
            return Expr(f"torch.pow({a.src}, 3)", "float", a.lo ** 3, a.hi ** 3)
        if form == "sqrt" and a.lo >= 0.05:
            return Expr(f"{_p(a)} ** 0.5", "float", a.lo ** 0.5, a.hi ** 0.5)
        t = Expr(f"torch.tanh({a.src})", "float", math.tanh(a.lo), math.tanh(a.hi))
        return Expr(f"2.0 ** {t.src}", "float", 2.0 ** t.lo, 2.0 ** t.hi)

    def _f_where(self, depth):
        cond, a, b = self.bool_expr(depth), self.float_expr(depth), self.float_operand(depth)
        return Expr(f"torch.where({cond.src}, {a.src}, {b.src})", "float",
                    min(a.lo, b.lo), max(a.hi, b.hi))

    def _f_abs(self, depth):
        a = self.float_expr(depth)
        lo = 0.0 if a.lo <= 0 <= a.hi else min(abs(a.lo), abs(a.hi))
        return Expr(self.pick(["abs({})", "torch.abs({})"]).format(a.src, p=_p(a)), "float", lo,
                    max(abs(a.lo), abs(a.hi)))

    def _f_minmax(self, depth):
        a, b = self.float_expr(depth), self.float_expr(depth)
        if self.draw(st.booleans()):
            return Expr(f"torch.minimum({a.src}, {b.src})", "float", min(a.lo, b.lo),
                        min(a.hi, b.hi))
        return Expr(f"torch.max({a.src}, {b.src})", "float", max(a.lo, b.lo), max(a.hi, b.hi))

    def _f_clamp(self, depth):
        a = self.float_expr(depth)
        lo, hi = self.pick([(-1.0, 1.0), (0.0, 5.0), (-20.0, -2.0)])
        spelled = self.pick([f"torch.clamp({{}}, {lo}, {hi})", f"{{p}}.clamp(min={lo}, max={hi})",
                             f"F.hardtanh({{}}, {lo}, {hi})"])
        return Expr(spelled.format(a.src, p=_p(a)), "float", lo, hi)

    def _f_float_floordiv(self, depth):
        a, c = self.float_expr(depth), self.pick([0.5, 3.0, -2.0])
        return Expr(f"{_p(a)} // {c!r}", "float", *_span([math.floor(a.lo / c),
                                                             math.floor(a.hi / c)]))

    def _f_float_mod(self, depth):
        a, c = self.float_expr(depth), self.pick([0.5, 3.0, -2.0])
        return Expr(f"{_p(a)} % {c!r}", "float", *_span([0.0, c]))

    # -- booleans
    def bool_expr(self, depth: int) -> Expr:
        choices = ["compare"]
        if depth > 0:
            choices += self.allowed("and", "or", "xor", "not", "bool_where", "bool_load",
                                    "float_compare")
        what = self.pick(choices)
        d = depth - 1
        if what == "compare":
            a, b = self.int_expr(max(d, 0)), self.int_operand(max(d, 0))
            return Expr(f"{_p(a)} {self.pick(['<', '>=', '==', '!=', '<=', '>'])} {_p(b)}",
                        "bool")
        if what == "float_compare":
            a, b = self.float_expr(d), self.float_operand(d)
            return Expr(f"{_p(a)} {self.pick(['>', '<=', '<'])} {_p(b)}", "bool")
        return self.bool_combination(what, d, self.bool_expr)

    def bool_combination(self, what, depth, sub) -> Expr:
        if what == "bool_load":
            return self.load("bool", depth)
        if what == "not":
            x = sub(depth)
            return Expr(self.pick(["~{p}", "torch.logical_not({})"]).format(x.src, p=_p(x)), "bool")
        if what == "bool_where":
            c, a, b = sub(depth), sub(depth), sub(depth)
            return Expr(f"torch.where({c.src}, {a.src}, {b.src})", "bool")
        symbol = {"and": "&", "or": "|", "xor": "^"}[what]
        a, b = sub(depth), sub(depth)
        if self.draw(st.integers(0, 3)) == 0:
            return Expr(f"torch.logical_{what}({a.src}, {b.src})", "bool")
        return Expr(f"{_p(a)} {symbol} {_p(b)}", "bool")

    def mask_expr(self, depth: int) -> Expr:
        """Attention-shaped patterns combined with logic, for a mix of tile kinds."""
        choices = ["pattern"]
        if depth > 0:
            choices += self.allowed("and", "or", "xor", "not", "bool_where") + ["generic"]
        what = self.pick(choices)
        if what == "pattern":
            return self.pattern()
        if what == "generic":
            return self.bool_expr(depth - 1)
        return self.bool_combination(what, depth - 1, self.mask_expr)

    def threshold(self, extent: int) -> int:
        return self.pick([0, 1, extent // 4, extent // 2, 7, extent - 1, extent, 2 * extent, -3])

    def pattern(self) -> Expr:
        c = self.config
        kind = self.pick(["causal", "window", "prefix", "chunk", "document", "dilated",
                          "head_window", "batch_length", "head_batch", "bidirectional"])
        if kind == "causal":
            offset = self.pick([0, c.S - c.L, 1, -16])
            return Expr(f"q_idx + {offset} >= kv_idx" if offset else "q_idx >= kv_idx", "bool")
        if kind == "window":
            return Expr(f"q_idx - kv_idx < {self.threshold(c.L)}", "bool")
        if kind == "bidirectional":
            return Expr(f"torch.abs(q_idx - kv_idx) <= {self.threshold(c.L)}", "bool")
        if kind == "prefix":
            leaf = self.pick(["kv_idx", "q_idx"])
            return Expr(f"{leaf} < {self.threshold(c.S if leaf == 'kv_idx' else c.L)}", "bool")
        if kind == "chunk":
            size = self.pick([16, 1, 50, 128, 7])
            return Expr(f"q_idx // {size} {self.pick(['==', '>='])} kv_idx // {size}", "bool")
        if kind == "dilated":
            m = self.pick([2, 3, 64])
            return Expr(f"(q_idx - kv_idx) % {m} == {self.pick([0, 1])}", "bool")
        if kind == "document" and self.room():
            n = max(c.L, c.S)
            docs = self.pick([1, 3, 10, n])
            ids = torch.sort(torch.randint(0, docs, (n,), generator=self.torch_gen)).values
            name = self.add_tensor(ids.to(self.pick(list(c.int_dtypes))))
            return Expr(f"{name}[q_idx] == {name}[kv_idx]", "bool")
        if kind == "head_window" and self.room():
            widths = torch.randint(0, c.L + 1, (c.H,), generator=self.torch_gen)
            name = self.add_tensor(widths.to(self.pick(list(c.int_dtypes))))
            return Expr(f"q_idx - kv_idx < {name}[h]", "bool")
        if kind == "batch_length" and self.room():
            lengths = torch.randint(0, c.S + 1, (c.B,), generator=self.torch_gen)
            name = self.add_tensor(lengths.to(self.pick(list(c.int_dtypes))))
            return Expr(f"kv_idx < {name}[b]", "bool")
        return Expr(self.pick(["((b + h) % 2 == 0)", f"(h < {max(c.H // 2, 1)})", "(b == 0)"]) +
                    " | (q_idx >= kv_idx)", "bool")

    # -- captured tensors
    def room(self) -> bool:
        return len(self.tensors) < self.config.max_buffers

    def add_tensor(self, tensor: torch.Tensor) -> str:
        name = f"t{len(self.tensors)}"
        self.tensors[name] = tensor
        return name

    def load(self, kind: str, depth: int) -> Expr:
        """``t_k[i0, i1, ...]`` of a new captured tensor, every index in range."""
        c = self.config
        if not self.room():  # no tensor left: a value of the same kind without one
            if kind == "float":
                return self._int_to_float(depth)
            return self.index_leaf() if kind == "int" else self.bool_expr(0)
        rank = self.draw(st.integers(0, c.max_rank))
        indices, shape = [], []
        for _ in range(rank):
            src, size = self.index(depth)
            indices.append(src)
            shape.append(size)
        if math.prod(shape) > 1 << 20:  # keep captured tensors small
            indices, shape = [f"({i}) % 5" for i in indices], [5] * rank
        gen = self.torch_gen
        if kind == "float":
            scale = self.pick([1.0, 0.5, 3.0])
            values = torch.randn(shape, generator=gen).clamp(-3.0, 3.0) * scale
            values = values.to(self.pick(list(c.float_dtypes)))
            values.requires_grad_(c.grad_buffers)
            lo, hi = -3.0 * scale, 3.0 * scale
        elif kind == "int":
            lo, hi = self.pick([(0, 9), (-5, 5), (0, max(c.L, c.S) - 1)])
            values = torch.randint(lo, hi + 1, shape, generator=gen)
            values = values.to(self.pick(list(c.int_dtypes)))
        else:
            values = torch.rand(shape, generator=gen) < self.pick([0.5, 0.1, 0.9])
            lo = hi = 0
        name = self.add_tensor(values)
        src = f"{name}[{', '.join(indices)}]" if rank else name
        return Expr(src, kind, lo, hi)

    def index(self, depth: int) -> tuple[str, int]:
        """An index expression and the dimension size that keeps it in range."""
        how = self.pick(["leaf", "const", "mod", "fit", "clamp"] if depth > 0 else
                        ["leaf", "const"])
        if how == "leaf":
            leaf = self.index_leaf()
            return leaf.src, int(leaf.hi) + 1 + self.pick([0, 1, 3])
        if how == "const":
            value = self.pick([0, 1, 4])
            return str(value), value + 1 + self.pick([0, 2])
        expr = self.int_expr(depth - 1)
        if how == "fit" and expr.hi - expr.lo < 4 * (self.config.L + self.config.S):
            shift = -int(expr.lo)
            src = f"{_p(expr)} + {shift}" if shift > 0 else (
                f"{_p(expr)} - {-shift}" if shift < 0 else expr.src)
            return src, int(expr.hi - expr.lo) + 1
        if how == "clamp":
            n = self.pick([1, 8, 33])
            return f"torch.clamp({expr.src}, 0, {n - 1})", n
        n = self.pick([1, 5, 8, 13])
        return f"{_p(expr)} % {n}", n
