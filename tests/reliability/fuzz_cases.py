"""Random front-door calls for test_fuzz: mods written as Python source (so a failing example
prints readable code), supported or not, and argument faults, each with the words the
resulting error message must contain."""
import math

import torch
from hypothesis import strategies as st

# ---- mods -----------------------------------------------------------------------------------

TABLE = torch.linspace(-1.0, 1.0, 8)  # captured by score_mods: table[i % 8]
DOCS = torch.arange(300) // 37  # captured by mask_mods: document ids per position

FLOATS = st.sampled_from([0.25, 0.5, 1.5, -0.75, 3.0])
SMALL_INTS = st.integers(1, 9)

SCORE_TERMS = st.one_of(
    FLOATS.map(lambda f: f"score * {f}"),
    FLOATS.map(lambda f: f"(q_idx - kv_idx) * {f / 16}"),
    FLOATS.map(lambda f: f"torch.tanh(score / {abs(f)}) * {abs(f)}"),
    st.just("torch.where(q_idx >= kv_idx, score, score - 2.0)"),
    st.just("table[(q_idx + 3 * kv_idx) % 8]"),
    st.just("table[h % 8] * score"),
    SMALL_INTS.map(lambda i: f"((q_idx // {i}) == (kv_idx // {i})).float()"),
    st.just("torch.sigmoid(score) + (b + h) * 0.125"),
    st.just("torch.clamp(score, min=-1.0, max=2.0)"),
    st.just("score ** 2 * 0.25"),
    st.just("torch.sqrt(torch.abs(score) + 1.0)"),
)

MASK_TERMS = st.one_of(
    st.just("q_idx >= kv_idx"),
    SMALL_INTS.map(lambda w: f"(q_idx - kv_idx) < {w * 7}"),
    SMALL_INTS.map(lambda i: f"(q_idx // {i * 5}) == (kv_idx // {i * 5})"),
    st.just("docs[q_idx] == docs[kv_idx]"),
    SMALL_INTS.map(lambda i: f"kv_idx % {i + 1} == 0"),
    st.just("(b == 0) | (h >= 1)"),
    st.just("(q_idx * 10 ** 12 + kv_idx * 3000017) % 3 != 1"),  # int64 math in the kernel
)

# (expression that cannot become a kernel, words the error must contain: any of them)
UNSUPPORTED_SCORE = [
    ("(score if score > 0 else -score)", ("control flow",)),
    ("float(score)", ("float()",)),
    ("math.exp(score)", ("float()",)),
    ("torch.softmax(score, -1)", ("is a reduction",)),
    ("score.item()", ("not supported",)),
    ("torch.atan2(score, score)", ("not supported",)),
    ("len(q_idx)", ("len()",)),
    ("table[score]", ("float value",)),
    ("table", ("captured tensor",)),
    ("q_idx * 10 ** 30", ("int64",)),  # beyond int64 (10 ** 12 runs: int64 in the kernel)
    ("(q_idx // 0)", ("division by zero",)),
    ("torch.zeros(4, device='meta')[kv_idx % 4]", ("meta",)),
    ("score @ score", ("tracing raised",)),
    ("[score]", ("returned a list",)),
    ("torch.zeros(0, 4)[q_idx, kv_idx % 4]", ("no elements",)),
]
UNSUPPORTED_MASK = [
    ("q_idx - kv_idx", ("must return bool",)),
    ("(q_idx > kv_idx) if b == 0 else True", ("control flow",)),
    ("torch.isin(q_idx, kv_idx)", ("not supported",)),
    ("docs", ("captured tensor",)),
]
# fine for create_block_mask, rejected when a kernel is generated: none since integer math
# beyond int32 runs in int64 in kernels too (codegen.ranges)
KERNEL_ONLY_WORDS = ("int32",)
UNSUPPORTED_MASK_KERNEL: list = []


def make_mod(kind: str, body: str):
    """A function named ``fuzz_<kind>`` whose body is ``return <body>``."""
    params = "score, b, h, q_idx, kv_idx" if kind == "score" else "b, h, q_idx, kv_idx"
    source = f"def fuzz_{kind}({params}):\n    return {body}\n"
    namespace = {"torch": torch, "math": math, "table": TABLE, "docs": DOCS}
    exec(compile(source, f"<fuzz {kind}_mod>", "exec"), namespace)
    return namespace[f"fuzz_{kind}"], source


@st.composite
def mod_sources(draw, kind: str, allow_unsupported: bool = True):
    """(expression, expected error words or None)."""
    terms, unsupported = (SCORE_TERMS, UNSUPPORTED_SCORE) if kind == "score" else \
        (MASK_TERMS, UNSUPPORTED_MASK)
    parts = draw(st.lists(terms, min_size=1, max_size=3))
    joiner = " + " if kind == "score" else draw(st.sampled_from([" & ", " | "]))
    body = joiner.join(f"({p})" for p in parts)
    if kind == "mask" and allow_unsupported:
        unsupported = unsupported + UNSUPPORTED_MASK_KERNEL
    if allow_unsupported and draw(st.integers(0, 3)) == 0:
        bad, words = draw(st.sampled_from(unsupported))
        if kind == "score" and not bad.startswith("["):
            bad = f"{body} + {bad}"
        return bad, words
    return body, None


# ---- argument faults: (description, words) applied to a valid call ---------------------------

def _retype(args, dtype):
    args["query"], args["key"], args["value"] = (t.to(dtype) for t in
                                                 (args["query"], args["key"], args["value"]))


FAULTS = {
    "float64 inputs": (lambda a: _retype(a, torch.float64), ("dtype",)),
    "int inputs": (lambda a: _retype(a, torch.int32), ("dtype",)),
    "key dtype differs": (lambda a: a.update(key=a["key"].to(
        torch.float16 if a["query"].dtype != torch.float16 else torch.float32)), ("dtype",)),
    "3-D query": (lambda a: a.update(query=a["query"][0]), ("4-D",)),
    "list query": (lambda a: a.update(query=a["query"].tolist()), ("torch.Tensor",)),
    "key head_dim differs": (lambda a: a.update(key=a["key"][..., :-1]), ("head_dim",)),
    "key batch differs": (lambda a: a.update(key=torch.cat([a["key"]] * 2)), ("batch",)),
    "value length differs": (lambda a: a.update(value=a["value"][:, :, :-1]),
                             ("sequence length", "lengths")),
    "meta inputs": (lambda a: [a.update({n: a[n].to("meta")}) for n in
                               ("query", "key", "value")], ("meta",)),
    "nan scale": (lambda a: a.update(scale=float("nan")), ("scale",)),
    "inf scale": (lambda a: a.update(scale=float("-inf")), ("scale",)),
    "huge scale": (lambda a: a.update(scale=1e39), ("scale",)),
    "string scale": (lambda a: a.update(scale="0.5"), ("scale",)),
    "tensor scale": (lambda a: a.update(scale=torch.tensor(0.5)), ("scale",)),
    "unknown kernel option": (lambda a: a.update(kernel_options={"BLOCK_K": 64}),
                              ("kernel_options",)),
    "bad BLOCK_M": (lambda a: a.update(kernel_options={"BLOCK_M": 48}), ("BLOCK_M",)),
    "bool num_warps": (lambda a: a.update(kernel_options={"num_warps": True}), ("num_warps",)),
    "non-callable score_mod": (lambda a: a.update(score_mod=1.5), ("score_mod",)),
    "non-bool enable_gqa": (lambda a: a.update(enable_gqa=1), ("enable_gqa",)),
    "not a block mask": (lambda a: a.update(block_mask=torch.ones(4)), ("block_mask",)),
}
