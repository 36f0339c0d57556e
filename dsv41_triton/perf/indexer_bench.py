"""Benchmark of the lightning-indexer ops: index logits and top-k at 8K, 128K and 1M
compressed positions, against their bytes / FLOP floors.

    python -m dsv41_triton.perf.indexer_bench [--heads 64] [--out results.json] [--quick]

Cases (V4-Flash / V4.1 index shape: ``Di = 128``, ``Hi`` heads, top-k 512 / 1024):

* ``logits decode``: ``T`` decode tokens, one request each, every request with ``N`` cached
  index keys (all visible). Floor bytes = the keys (``T * N * (Di + 4)``) + the logits written
  (``T * N * 4``); FLOPs = ``2 * T * N * Hi * Di``.
* ``logits prefill``: one request, the last ``T`` positions of ``N * ratio`` tokens (causal).
* ``topk``: ``index_topk`` (Triton radix select) and ``index_topk_torch`` (``torch.topk`` +
  the ascending sort) and bare ``torch.topk`` on the decode logits. Floor bytes = the logits
  read once (``T * N * 4``).

Each row: median µs (CUDA events, L2 flushed; see :mod:`dsv41_triton.perf.timing`), GB/s and
TFLOP/s of the floor counts, and their fraction of the device ceilings
(:mod:`dsv41_triton.perf.ceilings`). Every Triton result is checked against the reference
first (top-k bit-exact, logits rel <= 1e-4); a failed check marks the row.
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

from ..ops.indexer import index_logits, index_topk, index_topk_torch
from ..ops.indexer_ref import INDEX_SCALE_BYTES, index_logits_ref, index_topk_ref
from .timing import time_call

PAGE = 64
DIM = 128


def _random_index_cache(num_blocks: int, g: torch.Generator, device) -> torch.Tensor:
    """Valid FP8 rows (no NaN bytes) with power-of-two scales in every slot."""
    cache = torch.empty(num_blocks, PAGE, DIM + INDEX_SCALE_BYTES, dtype=torch.uint8, device=device)
    data = cache.view(num_blocks, -1)[:, : PAGE * DIM]
    data.copy_(torch.randint(0, 256, data.shape, generator=g, device=device, dtype=torch.uint8))
    data.masked_fill_((data & 0x7F) == 0x7F, 0)
    sc = cache.view(num_blocks, -1)[:, PAGE * DIM:].view(torch.float32)
    e = torch.randint(-10, -4, sc.shape, generator=g, device=device)
    sc.copy_(torch.ldexp(torch.ones_like(sc), e))
    return cache


def _case_inputs(T: int, n_req: int, N: int, H: int, g, device, prefill: bool, ratio: int = 1):
    blocks_per_req = -(-N // PAGE)
    cache = _random_index_cache(n_req * blocks_per_req, g, device)
    bt = torch.randperm(n_req * blocks_per_req, generator=g, device=device).int().view(n_req, blocks_per_req)
    q = torch.randn(T, H, DIM, generator=g, device=device).bfloat16()
    w = torch.rand(T, H, generator=g, device=device) - 0.3
    if prefill:
        req = torch.zeros(T, dtype=torch.int32, device=device)
        pos = N * ratio - T + torch.arange(T, device=device)
        vis = ((pos + 1) // ratio).int()
    else:
        req = torch.arange(T, dtype=torch.int32, device=device)
        vis = torch.full((T,), N, dtype=torch.int32, device=device)
    return cache, bt, q, w, req, vis


def _row(name, N, T, H, t, bytes_, flops, ceil, ok, note=""):
    us = t.median_us
    gbps = bytes_ / us / 1e3
    tf = flops / us / 1e6
    return {"case": name, "N": N, "T": T, "heads": H, "us": round(us, 2), "GB/s": round(gbps, 1),
            "TFLOP/s": round(tf, 2), "pct_copy": round(gbps / ceil["copy_gbps"], 3) if ceil else None,
            "pct_mm": round(tf / ceil["matmul_tflops"], 3) if ceil and flops else None,
            "check": ok, "method": t.method, "note": note}


def run(heads: int = 64, quick: bool = False, device="cuda", decode_shapes=None,
        prefill_shapes=None) -> list[dict]:
    """The rows of every case; ``decode_shapes`` / ``prefill_shapes``: ``[(N, T)]`` overrides."""
    g = torch.Generator(device=device)
    g.manual_seed(0)
    try:
        from .ceilings import get_ceilings

        ceil = get_ceilings(device).to_dict()
    except Exception:  # noqa: BLE001 - the ceilings are informative only
        ceil = None
    rows = []
    if decode_shapes is None:
        decode_shapes = [(8192, 8), (131072, 4)] if quick else [(8192, 64), (131072, 64), (1048576, 16)]
    for N, T in decode_shapes:
        cache, bt, q, w, req, vis = _case_inputs(T, T, N, heads, g, device, prefill=False)
        out = torch.empty(T, N, device=device)
        index_logits(q, w, cache, bt, req, vis, out=out)
        rs = slice(0, 2)
        want = index_logits_ref(q[rs], w[rs], cache, bt, req[rs], vis[rs], max_len=N)
        ok = bool(torch.allclose(out[rs], want, rtol=1e-4, atol=1e-3 * want.abs().max().item()))
        t = time_call(partial(index_logits, q, w, cache, bt, req, vis, out=out), device)
        rows.append(_row("logits decode", N, T, heads, t, T * N * (DIM + 4 + 4), 2 * T * N * heads * DIM,
                         ceil, ok))
        for k in (512, 1024):
            res = torch.empty(T, k, dtype=torch.int32, device=device)
            index_topk(out, vis, k, out=res)
            ok = bool(torch.equal(res[rs], index_topk_ref(out[rs], vis[rs], k)))
            t = time_call(partial(index_topk, out, vis, k, out=res), device)
            rows.append(_row(f"topk triton k={k}", N, T, heads, t, T * N * 4, 0, ceil, ok))
            t = time_call(partial(index_topk_torch, out, vis, k), device)
            rows.append(_row(f"topk torch k={k}", N, T, heads, t, T * N * 4, 0, ceil, None,
                             "masking + torch.topk + sort"))
            t = time_call(partial(torch.topk, out, min(k, N), dim=1), device)
            rows.append(_row(f"torch.topk bare k={k}", N, T, heads, t, T * N * 4, 0, ceil, None))
        del cache, out
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    if prefill_shapes is None:
        prefill_shapes = [(8192, 256)] if quick else [(8192, 1024), (131072, 1024)]
    for N, T in prefill_shapes:
        cache, bt, q, w, req, vis = _case_inputs(T, 1, N, heads, g, device, prefill=True)
        out = torch.empty(T, N, device=device)
        index_logits(q, w, cache, bt, req, vis, out=out)
        rs = slice(T - 2, T)
        want = index_logits_ref(q[rs], w[rs], cache, bt, req[rs], vis[rs], max_len=N)
        ok = bool(torch.allclose(out[rs], want, rtol=1e-4, atol=1e-3 * want.abs().max().item()))
        t = time_call(partial(index_logits, q, w, cache, bt, req, vis, out=out), device)
        nvis = int(vis.sum())
        rows.append(_row("logits prefill", N, T, heads, t, N * (DIM + 4) + T * N * 4,
                         2 * nvis * heads * DIM, ceil, ok, "1 request, causal"))
        del cache, out
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("indexer_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(a.heads, a.quick)
    cols = ["case", "N", "T", "heads", "us", "GB/s", "TFLOP/s", "pct_copy", "pct_mm", "check", "note"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0 if all(r["check"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
