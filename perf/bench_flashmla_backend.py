"""The ``flashmla`` backend's decode against FlashMLA's bare kernel, side by side (issue 12).

    python perf/bench_flashmla_backend.py [--heads 64] [--tokens 128] [--layers 8] [--out DIR]

V4.1 decode shapes: ``T`` query tokens, each its own request with a window of 128 consecutive
positions in its own pages plus 512 random compressed slots, 584-byte records, pages of 64,
sink on. Method as in PERF-NOTES: each variant is captured in a CUDA graph and replayed with a
256 MiB L2 flush before every replay (``dsv41_triton.perf.timing.time_cuda``), median.

Variants (µs per call; the "step" rows are per step of ``--layers`` layers, divided by it):
  bare              flash_mla_with_kvcache on prepared inputs, schedule reused, topk lengths
  bare, no lengths  the same without topk_length (what the backend passes)
  backend           FlashMLABackend.sparse_mla_decode with the step's cache warm (a layer after
                    the first of its step), no out= buffer
  backend, out=     the same writing into a given buffer (as the layer calls it)
  backend, no step  no step cache: the schedule the backend keeps per shape
  backend, fresh    a fresh schedule every call (the behaviour before this change)
  step (backend)    ``--layers`` calls sharing one new step cache: one schedule per step
  step (bare)       ``--layers`` bare calls, schedule reused
Needs CUDA and ``flash_mla`` (see third_party/FLASHMLA.txt for the device build).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41_triton.attention.ref import sparse_mla_decode_ref  # noqa: E402
from dsv41_triton.backends.flashmla import FlashMLABackend  # noqa: E402
from dsv41_triton.backends._flashmla_common import load_flashmla  # noqa: E402
from dsv41_triton.ops.kv_cache_ref import quantize_and_insert_k_cache_ref  # noqa: E402
from dsv41_triton.ops.records import allocate_k_cache  # noqa: E402
from dsv41_triton.perf.timing import time_cuda  # noqa: E402
from dsv41_triton.testing import rel_err  # noqa: E402

PAGE, WINDOW, TOPK, RECORD = 64, 128, 512, 584


def build_case(T: int, H: int, seed: int = 0, device="cuda"):
    """Decode inputs: q [T, H, 512] bf16, window cache (each token's 128 positions in its own 2
    pages), compressed cache (64 x T / 8 pages) with 512 random slots per token, lens, sink."""
    g = torch.Generator().manual_seed(seed)
    wblocks = T * (WINDOW // PAGE)
    cblocks = max(64, T // 2)
    swa = allocate_k_cache(wblocks, PAGE, RECORD, device)
    comp = allocate_k_cache(cblocks, PAGE, RECORD, device)
    for cache, n in ((swa, wblocks), (comp, cblocks)):
        k = (torch.randn(n * PAGE, 512, generator=g) * 2).bfloat16().to(device)
        quantize_and_insert_k_cache_ref(k, cache, torch.arange(n * PAGE, device=device))
    swa_idx = torch.arange(T * WINDOW, dtype=torch.int32).view(T, WINDOW).to(device)
    ext_idx = torch.stack([torch.randperm(cblocks * PAGE, generator=g)[:TOPK]
                           for _ in range(T)]).int().to(device)
    return dict(
        q=torch.randn(T, H, 512, generator=g).bfloat16().to(device),
        swa_cache=swa, swa_indices=swa_idx,
        swa_lens=torch.full((T,), WINDOW, dtype=torch.int32, device=device),
        extra_cache=comp, extra_indices=ext_idx,
        extra_lens=torch.full((T,), TOPK, dtype=torch.int32, device=device),
        attn_sink=torch.randn(H, generator=g).float().to(device))


def bare_call(case, with_lengths: bool):
    """FlashMLA's kernel on prepared inputs (heads already 64/128), one schedule reused."""
    ops, why = load_flashmla()
    if ops is None:
        raise SystemExit(f"FlashMLA is not available: {why}")
    q = case["q"].unsqueeze(1)
    swa = case["swa_cache"].unsqueeze(2)
    ext = case["extra_cache"].unsqueeze(2)
    idx = case["swa_indices"].unsqueeze(1).contiguous()
    eidx = case["extra_indices"].unsqueeze(1).contiguous()
    meta = ops.get_metadata()
    meta = meta[0] if isinstance(meta, tuple) else meta
    scale = 512 ** -0.5

    def call():
        return ops.with_kvcache(
            q, swa, None, None, 512, meta, None, softmax_scale=scale, causal=False,
            is_fp8_kvcache=True, indices=idx, attn_sink=case["attn_sink"], extra_k_cache=ext,
            extra_indices_in_kvcache=eidx,
            topk_length=case["swa_lens"] if with_lengths else None,
            extra_topk_length=case["extra_lens"] if with_lengths else None)

    call()  # fills the schedule outside any capture
    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default=None, help="directory for results.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    ops, why = load_flashmla()
    if ops is None:
        print(f"FlashMLA is not available: {why}")
        return 2
    T, H, L = args.tokens, args.heads, args.layers
    case = build_case(T, H)
    be = FlashMLABackend()
    warm_step: dict = {}
    be.sparse_mla_decode(**case, step_cache=warm_step)  # the step's first layer
    out_buf = torch.empty_like(case["q"])

    # correctness: backend = bare kernel = float64 reference
    o_b, l_b = be.sparse_mla_decode(**case, step_cache=warm_step)
    o_k, l_k = bare_call(case, True)()
    o_r, l_r = sparse_mla_decode_ref(**case)
    err = {"backend_vs_ref": rel_err(o_b, o_r), "bare_vs_ref": rel_err(o_k[:, 0], o_r),
           "backend_vs_bare": rel_err(o_b, o_k[:, 0]),
           "lse_backend_vs_ref": float((l_b.double() - l_r.double()).abs().max())}

    bare_l, bare_n = bare_call(case, True), bare_call(case, False)

    def step_backend():
        sc: dict = {}
        for _ in range(L):
            be.sparse_mla_decode(**case, step_cache=sc)

    def step_bare():
        for _ in range(L):
            bare_l()

    variants = [
        ("bare", bare_l, 1),
        ("bare, no lengths", bare_n, 1),
        ("backend", lambda: be.sparse_mla_decode(**case, step_cache=warm_step), 1),
        ("backend, out=", lambda: be.sparse_mla_decode(**case, step_cache=warm_step,
                                                      out=out_buf), 1),
        ("backend, no step", lambda: be.sparse_mla_decode(**case), 1),
        ("backend, fresh", lambda: be.sparse_mla_decode(**case, step_cache={}), 1),
        (f"step of {L} (backend)", step_backend, L),
        (f"step of {L} (bare)", step_bare, L),
    ]
    rows = []
    for name, fn, per in variants:
        t = time_cuda(fn, use_graph=True)
        rows.append({"variant": name, "us_per_call": t.median_us / per, "method": t.method,
                     "note": t.note, "reps": t.reps})
    base = rows[0]["us_per_call"]
    print(f"decode, {H} heads, T = {T}, {WINDOW} window + {TOPK} compressed keys, {RECORD}-byte "
          f"records, pages of {PAGE}, sink on ({torch.cuda.get_device_name()})")
    print(f"checks: {', '.join(f'{k} {v:.2e}' for k, v in err.items())}")
    print(f"{'variant':<26}{'us/call':>10}{'vs bare':>9}  method")
    for r in rows:
        print(f"{r['variant']:<26}{r['us_per_call']:>10.1f}{r['us_per_call'] / base:>9.3f}  "
              f"{r['method']} {r['note']}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_flashmla_backend.json"), "w") as f:
            json.dump({"heads": H, "tokens": T, "layers": L, "checks": err, "rows": rows}, f,
                      indent=1)
    ok = err["backend_vs_ref"] <= 1e-2 and err["backend_vs_bare"] <= 1e-2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
