"""Decode benchmark (issue 24): flexfa's decode family against torch FlexAttention (compiled)
and SDPA's flash backend, side by side in one process, on serving-shaped calls (few query rows
against long KV caches, GQA, sliding-window and document masks, contiguous and paged caches),
with the effective bandwidth (bytes of K+V the call must read / time) next to the copy
bandwidth measured in the same run; also a captured (CUDA graph) flex_decode call against the
same call run eagerly.

    python benchmarks/decode_bench.py results/decode.json [--budget 420] [--quick]

``--sweep`` runs chunked prefill over B in {1, 4}, L in {128, 512, 2048}, S in {8k, 32k}
instead (with ``--variants`` forcing each forward family) to place BACKEND="AUTO"'s line.

The chunked prefill (L = 512 against 8192 keys) with split-KV variants of the Hopper family,
each line naming the plan it ran (family, splits, tiles):

    python benchmarks/decode_bench.py results/chunked.json --cases chunked --budget 500 \
        --variants '[{"SPLIT_KV": 0}, {"BACKEND": "HOPPER", "SPLIT_KV": 2},
                     {"BACKEND": "HOPPER", "SPLIT_KV": 3}, {"BACKEND": "HOPPER", "SPLIT_KV": 4},
                     {"SPLIT_KV": "AUTO"}, {"SPLIT_KV": 2, "maxnreg": 0},
                     {"BLOCK_M": 64, "num_warps": 4},
                     {"SPLIT_KV": 2, "BLOCK_M": 64, "num_warps": 4},
                     {"BACKEND": "AMPERE"}, {"BACKEND": "AMPERE", "SPLIT_KV": 2}]'

Every peer of every case is guarded (an error is recorded, the run goes on); the JSON is
rewritten after each case, and cases stop once ``--budget`` seconds have passed, so one
8-minute GPU call always leaves a result.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, B, Hq, Hkv, L, S, mask, paged); E = 128, bf16
CASES = [
    ("decode_b16_32x8_s8k", 16, 32, 8, 1, 8192, None, False),
    ("decode_b16_32x8_s8k_paged", 16, 32, 8, 1, 8192, None, True),
    ("decode_b1_32x8_s128k", 1, 32, 8, 1, 131072, None, False),
    ("decode_b1_32x8_s128k_paged", 1, 32, 8, 1, 131072, None, True),
    ("decode_b64_32x8_s4k", 64, 32, 8, 1, 4096, None, False),
    ("decode_b8_40x8_s32k_l4", 8, 40, 8, 4, 32768, None, False),
    ("decode_b32_64x8_s8k", 32, 64, 8, 1, 8192, None, False),
    ("decode_b16_8x8_s8k", 16, 8, 8, 1, 8192, None, False),
    ("verify_b16_32x8_s8k_l16", 16, 32, 8, 16, 8192, None, False),
    ("decode_b16_32x8_s32k_sliding4k", 16, 32, 8, 1, 32768, "sliding", False),
    ("decode_b8_32x8_s32k_document", 8, 32, 8, 1, 32768, "document", False),
    ("chunked_prefill_b1_32x8_l512_s8k", 1, 32, 8, 512, 8192, "causal", False),
]
E = 128
# --sweep: chunked prefill over B x L x S (causal at offset, 32x8 GQA) to place the line
# between the Hopper family (split-KV) and the Gluon forward (one CTA per SM) in BACKEND="AUTO"
SWEEP = [(f"prefill_b{B}_32x8_l{L}_s{S // 1024}k", B, 32, 8, L, S, "causal", False)
         for B in (1, 4) for L in (128, 512, 2048) for S in (8192, 32768)]


def copy_bandwidth(torch, triton) -> float:
    """GB/s of a 2 GiB device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


def mask_mod_of(kind, L, S, torch):
    offset = S - L  # the queries are the last L positions

    if kind == "sliding":
        def mask(b, h, q_idx, kv_idx):
            pos = q_idx + offset
            return (pos >= kv_idx) & (pos - kv_idx < 4096)
        return mask, min(S, 4096 + L)
    if kind == "document":
        doc = (torch.arange(S, device="cuda") // 4096).to(torch.int32)  # 4096-key documents

        def mask(b, h, q_idx, kv_idx):
            return doc[q_idx + offset] == doc[kv_idx]
        return mask, min(S, 4096)
    if kind == "causal":
        def mask(b, h, q_idx, kv_idx):
            return q_idx + offset >= kv_idx
        return mask, S
    return None, S


def plans_made(fn) -> list[str]:
    """Run ``fn`` once; the plans flexfa made for it, as 'family xN BMxBN wW sS rR' (N the
    splits, R the register cap)."""
    from flexfa.runtime import plans
    made, keep = [], plans.keep

    def spy(call, key, plan):
        spec = plan.spec
        made.append(f"{plan.family.name} x{plan.fixed.get('splits') or 1} "
                    f"{spec.block_m}x{spec.block_n} w{spec.num_warps} s{spec.num_stages} "
                    f"r{getattr(spec, 'max_registers', 0)}")
        return keep(call, key, plan)
    plans.keep = spy
    try:
        fn()
    finally:
        plans.keep = keep
    return made


def run_case(case, torch, triton, flexfa, peers, variants=()) -> dict:
    name, B, Hq, Hkv, L, S, kind, paged = case
    bf16 = torch.bfloat16
    q = torch.randn(B, Hq, L, E, device="cuda", dtype=bf16)
    k = torch.randn(B, Hkv, S, E, device="cuda", dtype=bf16)
    v = torch.randn_like(k)
    mask_mod, live_keys = mask_mod_of(kind, L, S, torch)
    result = {"case": name, "B": B, "Hq": Hq, "Hkv": Hkv, "L": L, "S": S, "mask": kind,
              "paged": paged, "kv_bytes": 2 * B * Hkv * live_keys * E * 2}
    bench = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=100)  # noqa: E731

    def record(peer, fn):
        try:
            made = plans_made(fn) if peer.startswith("flexfa") else []
            torch.cuda.synchronize()
            ms = bench(fn)
            result[peer] = {"ms": ms, "GBps": result["kv_bytes"] / (ms * 1e-3) / 1e9,
                            "plans": made}
        except Exception as exc:  # one failing peer never loses the run
            result[peer] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}

    flex_mask = torch_mask = None
    if mask_mod is not None:
        try:
            flex_mask = flexfa.create_block_mask(mask_mod, None, None, L, S, device="cuda")
        except Exception as exc:
            result["flexfa_mask_error"] = str(exc)[:200]
        try:
            from torch.nn.attention.flex_attention import create_block_mask
            torch_mask = create_block_mask(mask_mod, None, None, L, S, device="cuda")
        except Exception as exc:
            result["torch_mask_error"] = str(exc)[:200]
    if paged:
        page = 64
        pages = S // page
        table = torch.randperm(B * pages, device="cuda").view(B, pages).to(torch.int32)
        k_cache = torch.empty(B * pages, page, Hkv, E, device="cuda", dtype=bf16)
        v_cache = torch.empty_like(k_cache)
        flat = table.flatten().long()
        k_cache[flat] = k.view(B, Hkv, pages, page, E).permute(0, 2, 3, 1, 4).reshape(-1, page, Hkv, E)
        v_cache[flat] = v.view(B, Hkv, pages, page, E).permute(0, 2, 3, 1, 4).reshape(-1, page, Hkv, E)
        record("flexfa", lambda: flexfa.flex_decode(q, k_cache, v_cache, page_table=table,
                                                    validate=False))
        return result
    record("flexfa", lambda: flexfa.flex_attention(q, k, v, block_mask=flex_mask,
                                                   enable_gqa=Hq != Hkv))
    for options in variants:  # the same call with kernel_options (--variants)
        record(f"flexfa {json.dumps(options)}", lambda options=options: flexfa.flex_attention(
            q, k, v, block_mask=flex_mask, enable_gqa=Hq != Hkv, kernel_options=options))
    if "flex" in peers:
        record("torch_flex_compiled", lambda: peers["flex"](q, k, v, block_mask=torch_mask,
                                                            enable_gqa=Hq != Hkv))
    if mask_mod is None and "sdpa" in peers:
        record("sdpa_flash", lambda: peers["sdpa"](q, k, v, Hq != Hkv))
    return result


def graph_case(torch, triton, flexfa) -> dict:
    """B=1, 32/8 heads, S=8192: a flex_decode call with a workspace, eager and replayed."""
    bf16 = torch.bfloat16
    q = torch.randn(1, 32, 1, E, device="cuda", dtype=bf16)
    k = torch.randn(1, 8, 8192, E, device="cuda", dtype=bf16)
    v = torch.randn_like(k)
    lens = torch.tensor([8000], dtype=torch.int32, device="cuda")
    ws = flexfa.DecodeWorkspace()
    call = lambda: flexfa.flex_decode(q, k, v, kv_lens=lens, workspace=ws, validate=False)  # noqa: E731
    call()
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(call, warmup=10, rep=100)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    replay = triton.testing.do_bench(graph.replay, warmup=10, rep=100)
    return {"case": "graph_b1_32x8_s8k", "eager_ms": eager, "graph_ms": replay}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the JSON file to write")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which no new case starts (default 420)")
    parser.add_argument("--quick", action="store_true", help="the first three cases only")
    parser.add_argument("--sweep", action="store_true",
                        help="the chunked-prefill sweep (B x L x S) instead of the cases")
    parser.add_argument("--cases", help="only the cases whose names contain one of these "
                        "comma-separated strings")
    parser.add_argument("--variants", default="[]",
                        help="JSON list of kernel_options dicts: each unpaged case also times "
                             "flexfa with each (e.g. '[{\"BLOCK_M\": 64}]')")
    args = parser.parse_args(argv)
    import torch
    import triton

    import flexfa
    if not torch.cuda.is_available():
        print("decode_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    start = time.time()
    peers = {}
    try:
        from torch.nn.attention.flex_attention import flex_attention
        torch._dynamo.config.cache_size_limit = 64
        peers["flex"] = torch.compile(flex_attention, dynamic=False)
    except Exception as exc:
        print(f"torch FlexAttention unavailable: {exc}", file=sys.stderr)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q, k, v, gqa):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        peers["sdpa"] = sdpa
    except Exception as exc:
        print(f"SDPA unavailable: {exc}", file=sys.stderr)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "copy_GBps": copy_bandwidth(torch, triton),
              "cases": []}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"copy bandwidth {report['copy_GBps']:.0f} GB/s")
    print(f"{'case':36} {'flexfa ms':>10} {'GB/s':>7} {'%copy':>6} {'flex ms':>9} {'sdpa ms':>9}")
    variants = json.loads(args.variants)
    if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
        parser.error(f"--variants must be a JSON list of objects, not {args.variants!r}")
    cases = SWEEP if args.sweep else CASES[:3] if args.quick else CASES
    if args.cases:
        cases = [c for c in cases if any(part in c[0] for part in args.cases.split(","))]
    for case in cases:
        if time.time() - start > args.budget:
            report["stopped"] = f"budget of {args.budget} s reached before {case[0]}"
            break
        result = run_case(case, torch, triton, flexfa, peers, variants)
        report["cases"].append(result)
        out.write_text(json.dumps(report, indent=1))
        cell = lambda peer, key: result.get(peer, {}).get(key, math.nan)  # noqa: E731
        print(f"{case[0]:36} {cell('flexfa', 'ms'):10.4f} {cell('flexfa', 'GBps'):7.0f} "
              f"{100 * cell('flexfa', 'GBps') / report['copy_GBps']:6.1f} "
              f"{cell('torch_flex_compiled', 'ms'):9.4f} {cell('sdpa_flash', 'ms'):9.4f} "
              f"{' '.join(result.get('flexfa', {}).get('plans', []))}", flush=True)
        for options in variants:
            peer = f"flexfa {json.dumps(options)}"
            print(f"  with {json.dumps(options):30} {cell(peer, 'ms'):10.4f} "
                  f"{' '.join(result.get(peer, {}).get('plans', []))} "
                  f"{result.get(peer, {}).get('error', '')}", flush=True)
    try:
        report["graph"] = graph_case(torch, triton, flexfa)
        print(f"flex_decode B=1 eager {report['graph']['eager_ms']:.4f} ms, CUDA graph replay "
              f"{report['graph']['graph_ms']:.4f} ms")
    except Exception as exc:
        report["graph"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
