"""What the benchmarks share: the variants they time and the run's versions and commit."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess

from . import config

VARIANTS = ("full", "causal", "sliding", "alibi", "softcap", "document", "prefix")


def bench_variants(S: int, H: int, device):
    import torch

    lengths = torch.randint(256, 2048, (S // 256 + 2,), generator=torch.Generator().manual_seed(0))
    doc_id = torch.searchsorted(lengths.cumsum(0), torch.arange(S), right=True).to(device)
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device, dtype=torch.float32) / H)
    prefix = S // 4

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window_1024(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap_30(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    return {"full": (None, None), "causal": (None, causal), "sliding": (None, sliding_window_1024),
            "alibi": (alibi, causal), "softcap": (softcap_30, causal),
            "document": (None, document_causal), "prefix": (None, prefix_lm)}


def learnable_mod(Hq: int, L: int, S: int, seed: int, device="cpu", vectors: bool = True,
                  base=None):
    """(score_mod, its learnable captured tensors), one per way a gradient load can depend on
    the score tile: rel[q - kv] (every element), scale[h] (the score times it: one sum a
    tile, its derivative the score), a 0-d gain (times rel: a sum of a full tile) and, with
    ``vectors``, row[h, q] (a sum over keys) and col[kv] (over queries); ``base``: a
    score_mod whose output takes the score's place. A row bias's exact gradient is 0 unless
    lse's is not (softmax ignores a row-wide shift): check it through lse."""
    import torch
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape, mean=0.0, std=1.0):
        return (mean + std * torch.randn(*shape, generator=generator)).to(device).requires_grad_()
    rel, scale = leaf(L + S - 1, std=0.5), leaf(Hq, mean=1.0, std=0.3)
    row, col = leaf(Hq, L), leaf(S)
    gain = torch.tensor(0.7, device=device, requires_grad=True)
    base = base or (lambda score, b, h, q_idx, kv_idx: score)

    def full_tiles(score, b, h, q_idx, kv_idx):
        return base(score, b, h, q_idx, kv_idx) * scale[h] + rel[q_idx - kv_idx + S - 1] * gain

    def learnable(score, b, h, q_idx, kv_idx):
        return full_tiles(score, b, h, q_idx, kv_idx) + row[h, q_idx] + col[kv_idx]
    if vectors:
        return learnable, (rel, scale, gain, row, col)
    return full_tiles, (rel, scale, gain)


def split_variant(variant: str, heads: int) -> tuple[str, int, bool, bool]:
    """(base variant, GQA group, dropout, without the mask_mod) of a benchmark variant with
    suffixes: ``+gqaG`` (G query heads per kv head), ``+drop`` (dropout 0.1, a fixed seed),
    ``+nomask`` (the variant's score_mod without its mask_mod), e.g. ``causal+gqa4+drop``."""
    base, *suffixes = variant.split("+")
    groups = [x[3:] for x in suffixes if x.startswith("gqa")]
    unknown = [x for x in suffixes if x not in ("drop", "nomask") and not x.startswith("gqa")]
    if (unknown or base not in VARIANTS or len(groups) > 1
            or not all(g.isdigit() and int(g) > 0 for g in groups)):
        raise ValueError(f"variant {variant!r}: base must be one of {VARIANTS}, suffixes "
                         f"+gqaG, +drop, +nomask; got base {base!r}, suffixes {suffixes}")
    group = int(groups[0]) if groups else 1
    if heads % group:
        raise ValueError(f"variant {variant!r}: heads {heads} not a multiple of the GQA "
                         f"group {group}")
    return base, group, "drop" in suffixes, "nomask" in suffixes


def source_digest() -> str:
    """sha256 over flexfa's own files (package-relative path and bytes of every .py and
    .tmpl), which names the code that ran even where the commit cannot be trusted (a copy of
    the tree whose git metadata is stale reports the wrong commit)."""
    import hashlib

    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith((".py", ".tmpl")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    return digest.hexdigest()


def versions() -> dict:
    import torch
    import triton

    import flexfa

    commit = config.environment("FLEXFA_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(__file__), check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "flexfa": flexfa.__version__, "python": platform.python_version(),
            "commit": commit, "source_digest": source_digest(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
