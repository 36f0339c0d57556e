"""Prefill paths on V4.1 shapes: workspace vs shared window vs paged, and a layer chunk.

    python perf/bench_prefill.py [--warm 8] [--kernels-only | --layer-only] [--quick]
    python perf/bench_prefill.py --profile [--contexts 8192]

Kernels: 4096 query tokens of one request x 640 keys each (the V4.1 pattern: the token's
128-position window, contiguous, plus 512 random top-k compressed entries of 32768), sink on,
8 / 64 / 128 heads:

* ``workspace``: ``sparse_mla_prefill`` over a bf16 workspace (32768 compressed rows, then the
  window rows) with the combined index rows (top-k first, then the window), the ``tl`` kernel;
  ``gluon-lazy`` / ``gluon-eager`` / ``gluon-ws``: the same call on the Gluon sm_90 kernels (two
  rescale variants and the warp-specialized kernel; sm_90 only; ``BENCH_GLUON_VARIANTS=eager,ws,wsp``
  picks which); ``flashmla``: FlashMLA's ``flash_mla_sparse_fwd`` on the same workspace
  and index rows, called directly (heads zero-padded to 64 / 128 outside the timed call; when
  ``flash_mla`` imports);
* ``shared``: ``sparse_mla_prefill_shared_window`` on the same workspace (<= 16 heads), the
  window as a row range per token, tiles of ``block_t`` tokens;
* ``paged``: ``sparse_mla_prefill_paged`` over 584-byte record caches (``--paged-records
  528,288``: V4.1's window and compressed records; 131072-position request, pages of 64: slot
  rows + the decode kernel); ``paged-attn``: its attention launch alone (slot rows
  precomputed); ``paged-window`` (<= 16 heads): the layer's paged path, the tokens' window
  rows gathered into a small bf16 workspace (``T + W - 1`` rows) and shared by consecutive
  tokens, the top-k records as slot ids (``sparse_mla_prefill_shared_window(...,
  topk_cache=)``; gather + window rows and slot ids in one launch + attention);
  ``paged-window-attn``: its attention alone; ``-persist``: the same with the few-heads decode kernel on its persistent grid (sm_90).

Each is captured as a CUDA graph of one call and replayed 15 times; a 512 MB buffer is
written before every replay (outside the timed events) so that L2 starts cold. Median us,
TFLOP/s of ``4 * H * 640 * 512`` per token.

Layer chunk: ``DeepseekV41Attention.forward_mqa`` of one prefill chunk (2048 new tokens of a
request at 8K / 128K / 1M context; V4-flash ratio-4 layer, TP 8 = 8 local heads, top-k 512),
``prefill_path="paged"`` (window and top-k as slot ids) vs ``paged-window`` (the same with
``paged_window_rows = True``: the chunk's window rows in a small bf16 workspace, shared by
consecutive tokens, the top-k records as slot ids), both also ``-persist`` (the few-heads
decode kernel on its persistent grid) vs ``"workspace"`` (gather + bf16 workspace, window rows
shared by consecutive tokens) vs ``workspace-general`` (the same with ``share_window_keys =
False``) vs ``auto`` (the layer's default: paged or workspace per chunk):
peak memory allocated during the call (above what was allocated before it), eager time
(median of 9, L2 flushed before each; the host's launch work is part of it) and the GPU time
of the call captured as a CUDA graph (as the kernels).

``--quick`` times only ``workspace``, the Gluon variants and FlashMLA.
``--warm N`` compiles every kernel first in N processes (on the same shapes), then times;
``--paged-candidates`` adds other (GPU-tested decode) launch shapes on the paged prefill, each
compared with the default paged output ("vs-family"; shared rows compare with workspace).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List

import torch

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41_triton.attention._configs import KernelConfig  # noqa: E402
from dsv41_triton.attention.decode import sparse_mla_decode  # noqa: E402
from dsv41_triton.attention.prefill import sparse_mla_prefill  # noqa: E402
from dsv41_triton.attention.prefill_paged import sparse_mla_prefill_paged  # noqa: E402
from dsv41_triton.attention.prefill_shared import sparse_mla_prefill_shared_window  # noqa: E402
from dsv41_triton.ops.kv_cache import dequantize_and_gather_k_cache  # noqa: E402
from dsv41_triton.ops.prefill_indices import (  # noqa: E402
    prefill_slot_indices, prefill_window_slot_indices)
from dsv41_triton.testing import random_k_cache, rel_err  # noqa: E402

T, W, TOPK, NCOMP, PAGE, RATIO = 4096, 128, 512, 32768, 64, 4
HEADS = (8, 64, 128)
#: shared-window launch shapes timed: (block_t, block_n, num_warps)
SHARED_SHAPES = ((None, 64, None), (4, 64, 4), (2, 64, 4))
CONTEXTS = (8192, 131072, 1 << 20)
#: ``--paged-candidates``: decode launch shapes (GPU-tested with 584 records) also timed on the
#: paged prefill, few heads / many heads
PAGED_SHAPES_FEW = (("group", 16, 64, 4, 2, True), ("group", 16, 32, 4, 3, True),
                    ("group", 16, 64, 8, 3, False))
PAGED_SHAPES_MANY = (("group", 32, 64, 8, 3, False), ("group", 32, 64, 8, 3, True),
                     ("group", 64, 32, 8, 2, False), ("group", 64, 64, 8, 2, True))
PAGED_CANDIDATES = False
#: record widths of the paged rows' window and compressed caches (``--paged-records``)
PAGED_RECORDS = (584, 584)
NO_SHARED = False
QUICK = False
CHUNK = 2048
FLUSH_BYTES = 512 << 20


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
_FLUSH = {}


def _flush():
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    _FLUSH["buf"].fill_(1)


def time_graph_flushed(fn: Callable[[], object], replays: int = 15) -> float:
    """One call captured as a CUDA graph; median us of ``replays`` replays, L2 flushed
    before each (outside the events)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        _flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def time_eager_flushed(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        _flush()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


# --------------------------------------------------------------------------------------------
# kernel cases
# --------------------------------------------------------------------------------------------
def build_kernel_inputs(H: int, device="cuda", seed=0) -> Dict[str, object]:
    """One request: positions P .. P+T-1 of a 131072-position sequence (32768 compressed
    entries at ratio 4); each token's 128-position window and 512 random causal entries."""
    g = torch.Generator(device=device).manual_seed(seed)
    seq = NCOMP * RATIO
    P = seq - T
    pos = torch.arange(P, P + T, device=device)
    nent = (pos + 1) // RATIO
    local = (torch.rand(T, TOPK, device=device, generator=g) * nent[:, None]).long()
    local = local.clamp(max=NCOMP - 1).to(torch.int32)
    q = torch.randn(T, H, 512, device=device, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, device=device, generator=g)
    # workspace: NCOMP compressed rows, then positions P - W + 1 .. seq - 1
    kv = torch.randn(NCOMP + T + W - 1, 512, device=device, generator=g).to(torch.bfloat16)
    win_start = (NCOMP + torch.arange(T, device=device)).to(torch.int32)
    win = win_start[:, None].long() + torch.arange(W, device=device)[None, :]
    idx = torch.cat([local.long(), win], 1).to(torch.int32).contiguous()
    # paged caches
    nb = seq // PAGE
    swa = random_k_cache(nb, PAGE, PAGED_RECORDS[0], device)
    comp = random_k_cache(NCOMP // PAGE, PAGE, PAGED_RECORDS[1], device)
    sbt = torch.randperm(nb, device=device, generator=g).to(torch.int32)[None, :]
    cbt = torch.randperm(NCOMP // PAGE, device=device, generator=g).to(torch.int32)[None, :]
    ttr = torch.zeros(T, dtype=torch.int32, device=device)
    seq_lens = torch.tensor([seq], dtype=torch.int32, device=device)
    paged = dict(q=q, positions=pos, token_to_req=ttr, seq_lens=seq_lens, swa_cache=swa,
                 swa_block_table=sbt, window_size=W, compressed_cache=comp,
                 compressed_block_table=cbt, topk_indices=local, compress_ratio=RATIO,
                 attn_sink=sink)
    slots = prefill_slot_indices(pos, ttr, seq_lens, sbt, PAGE, W, local, cbt, PAGE, RATIO)
    # the paged path's window workspace: positions P - W + 1 .. seq - 1 (token i: rows i ..)
    glen = torch.tensor([T + W - 1], dtype=torch.int32, device=device)
    wws = torch.empty(1, T + W - 1, 512, dtype=torch.bfloat16, device=device)
    dequantize_and_gather_k_cache(wws, swa, seq_lens, glen, sbt, PAGE, 0)
    return dict(H=H, q=q, sink=sink, kv=kv, idx=idx, local=local, win_start=win_start,
                qsl=torch.tensor([0, T], dtype=torch.int32, device=device), paged=paged,
                slots=slots, glen=glen, wws=wws,
                wrow=torch.arange(T, dtype=torch.int32, device=device),
                out=torch.empty(T, H, 512, dtype=torch.bfloat16, device=device))


def _gluon_fn(inp, variant: str):
    """The workspace prefill pinned to the Gluon kernel's ``variant`` (None off sm_90)."""
    from dsv41_triton.attention.gluon import prefill_launch as pl
    q = inp["q"]
    if not pl.usable(q, inp["kv"], inp["idx"]):
        return None

    def fn():
        old = os.environ.get(pl.VARIANT_ENV)
        os.environ[pl.VARIANT_ENV] = variant
        try:
            return sparse_mla_prefill(q, inp["kv"], inp["idx"], None, inp["sink"], None,
                                      inp["out"], _kernel="gluon")
        finally:
            if old is None:
                del os.environ[pl.VARIANT_ENV]
            else:
                os.environ[pl.VARIANT_ENV] = old
    return fn


def _flashmla_fn(inp):
    """FlashMLA's sparse prefill kernel on the same inputs (None when flash_mla is missing);
    returns ``(out [T, H, 512], lse [T, H])`` like ours."""
    try:
        from dsv41_triton.backends._flashmla_common import (load_flashmla, pad_heads,
                                                            pad_sink, padded_heads)
    except Exception as e:  # noqa: BLE001
        print(f"# FlashMLA helpers unavailable: {e}")
        return None
    ops, why = load_flashmla()
    if ops is None or ops.sparse_fwd is None:
        print(f"# FlashMLA unavailable: {why}")
        return None
    H, q = inp["H"], inp["q"]
    hp = padded_heads(H)
    qp = pad_heads(q, hp)
    sink = pad_sink(inp["sink"], H, hp)
    kv3 = inp["kv"].reshape(-1, 1, 512)
    idx3 = inp["idx"].unsqueeze(1)
    scale = 512 ** -0.5

    def fn():
        o, _, lse = ops.sparse_fwd(qp, kv3, idx3, scale, 512, sink, None)
        return o[:, :H], lse[:, :H]
    return fn


def persistent(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the Gluon few-heads decode kernel on its persistent grid (sm_90): the prior
    launches of the paged-window path (``PRIOR_PERSIST``) and the decode launches (the picked
    shape plus ``persist``)."""
    def run():
        from dsv41_triton.attention.gluon import launch as dl
        old_p, old_o = dl.PRIOR_PERSIST, dict(dl.OVERRIDE)
        dl.PRIOR_PERSIST = True
        dl.OVERRIDE.clear()
        dl.OVERRIDE.update(dl.parse_shape("4:8:2:W:0:p"))
        try:
            return fn()
        finally:
            dl.PRIOR_PERSIST = old_p
            dl.OVERRIDE.clear()
            dl.OVERRIDE.update(old_o)
    return run


def kernel_fns(inp) -> List[tuple]:
    """[(label, fn)] for one head count."""
    H, q, out = inp["H"], inp["q"], inp["out"]
    wl = torch.full((T,), W, dtype=torch.int32, device=q.device)
    fns = [("workspace", lambda: sparse_mla_prefill(q, inp["kv"], inp["idx"], None, inp["sink"],
                                                    None, out, _kernel="tl"))]
    for variant in os.environ.get("BENCH_GLUON_VARIANTS", "eager,lazy,ws,wsp").split(","):
        fn = _gluon_fn(inp, variant) if variant else None
        if fn is not None:
            fns.append((f"gluon-{variant}", fn))
    fm = _flashmla_fn(inp)
    if fm is not None:
        fns.append(("flashmla", fm))
    if QUICK:
        return fns
    if H <= 16 and not NO_SHARED:
        for bt, bn, warps in SHARED_SHAPES:
            lab = f"shared-bt{bt or 'def'}"
            fns.append((lab, lambda bt=bt, bn=bn, warps=warps: sparse_mla_prefill_shared_window(
                q, inp["kv"], inp["win_start"], wl, inp["local"], None, inp["qsl"], inp["sink"],
                None, out, block_t=bt, block_n=bn, num_warps=warps)))
    pg = inp["paged"]
    fns.append(("paged", lambda: sparse_mla_prefill_paged(**pg, out=out)))
    si, sl, ei, el = inp["slots"]
    fns.append(("paged-attn", lambda: sparse_mla_decode(q, pg["swa_cache"], si, sl,
                                                        pg["compressed_cache"], ei, el,
                                                        inp["sink"], None, out)))
    if H <= 16:
        wws, wrow, qsl, sink = inp["wws"], inp["wrow"], inp["qsl"], inp["sink"]

        def paged_window_attn(e_i=ei, e_l=el, w_s=wrow, w_l=wl):
            return sparse_mla_prefill_shared_window(q, wws.view(-1, 512), w_s, w_l, e_i, e_l,
                                                    qsl, sink, None, out,
                                                    topk_cache=pg["compressed_cache"])

        def paged_window():
            dequantize_and_gather_k_cache(wws, pg["swa_cache"], pg["seq_lens"], inp["glen"],
                                          pg["swa_block_table"], PAGE, 0)
            w, e_i, e_l = prefill_window_slot_indices(
                pg["positions"], pg["token_to_req"], pg["seq_lens"], inp["glen"], 0,
                wws.shape[1], W, pg["topk_indices"], pg["compressed_block_table"], PAGE, RATIO)
            return paged_window_attn(e_i, e_l, w[0], w[1])
        fns.append(("paged-window", paged_window))
        fns.append(("paged-window-attn", paged_window_attn))
        fns.append(("paged-window-persist", persistent(paged_window)))
        fns.append(("paged-window-attn-persist", persistent(paged_window_attn)))
        fns.append(("paged-attn-persist", persistent(
            lambda: sparse_mla_decode(q, pg["swa_cache"], si, sl, pg["compressed_cache"], ei, el,
                                      inp["sink"], None, out))))
    if PAGED_CANDIDATES:
        for shape in (PAGED_SHAPES_FEW if H <= 16 else PAGED_SHAPES_MANY):
            _, bh, bn, warps, stages, lazy = shape
            cfg = KernelConfig(bh, bn, 1, warps, stages, lazy_rescale=lazy)
            fns.append(("paged-" + "-".join(map(str, shape[1:])),
                        lambda cfg=cfg: sparse_mla_decode(q, pg["swa_cache"], si, sl,
                                                          pg["compressed_cache"], ei, el,
                                                          inp["sink"], None, out, _config=cfg)))
    return fns


def run_kernels(lines: List[str]):
    for H in HEADS:
        inp = build_kernel_inputs(H)
        ref = ref_paged = None
        for lab, fn in kernel_fns(inp):
            try:
                us = time_graph_flushed(fn)
                o = fn()[0].clone()
                torch.cuda.synchronize()
            except Exception as e:  # report and go on
                lines.append(f"kernel H={H:<3d} {lab:14s} FAILED {type(e).__name__}: "
                             f"{str(e)[:200]}")
                print(lines[-1], flush=True)
                continue
            if ref is None and lab == "workspace":
                ref = o
            # paged reads other (record-encoded) keys: compare within each family
            if lab == "paged":
                ref_paged = o
            base = ref_paged if lab.startswith("paged") else ref
            agree = rel_err(o, base) if base is not None else 0.0
            tf = 4.0 * H * (TOPK + W) * 512 * T / (us * 1e-6) / 1e12
            info = _kernel_info(lab)
            lines.append(f"kernel H={H:<3d} {lab:14s} {us:9.1f} us {tf:6.1f} TFLOP/s "
                         f"vs-family {agree:.1e} {info}")
            print(lines[-1], flush=True)
        del inp
        torch.cuda.empty_cache()


def _kernel_info(lab: str) -> str:
    from dsv41_triton.attention._launch import LAST_LAUNCH
    if lab == "flashmla":
        return ""
    if lab.startswith("gluon"):
        from dsv41_triton.attention.gluon.prefill_launch import LAST_LAUNCH
    k = LAST_LAUNCH.get("shared" if lab.startswith("shared") else "fwd", (None, None))[0]
    try:
        return f"| regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}"
    except Exception:
        return ""


# --------------------------------------------------------------------------------------------
# layer chunk
# --------------------------------------------------------------------------------------------
def build_layer_case(ctx: int, device="cuda", seed=0):
    from dsv41_triton.layers.config import DeepseekV41AttentionConfig
    from dsv41_triton.layers.layer import DeepseekV41Attention
    from dsv41_triton.layers.metadata import RequestSpec, build_step_metadata

    cfg = DeepseekV41AttentionConfig.v4_flash()
    layer_id = 2
    r = cfg.compress_ratio(layer_id)
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // PAGE)
    ncb = -(-(ctx // r) // PAGE)
    layers = {p: DeepseekV41Attention(cfg, layer_id, tp_size=8, backend="triton", device=device,
                                      max_model_len=ctx + 64, prefill_path=p.split("-")[0])
              for p in ("paged", "paged-persist", "paged-window", "paged-window-persist",
                        "workspace", "workspace-general", "auto")}
    layers["workspace-general"].share_window_keys = False
    layers["paged-window"].paged_window_rows = True
    layers["paged-window-persist"].paged_window_rows = True
    swa = random_k_cache(nb, PAGE, 584, device)
    comp = random_k_cache(ncb, PAGE, 584, device)
    for lay in layers.values():
        lay.bind_kv_caches(swa, comp)
    req = RequestSpec(CHUNK, prefix_len=ctx - CHUNK,
                      swa_block_table=torch.randperm(nb, generator=g).tolist(),
                      compressed_block_tables={r: torch.randperm(ncb, generator=g).tolist()})
    md = build_step_metadata([req], window_size=cfg.sliding_window, swa_page_size=PAGE,
                             compressed_page_sizes={r: PAGE}, device=device)
    H = layers["paged"].n_local_heads
    nent = (md.positions + 1) // r
    tk = (torch.rand(CHUNK, cfg.index_topk, generator=g).to(device) * nent[:, None]).long()
    tk = tk.to(torch.int32)
    q = torch.randn(CHUNK, H, 512, device=device).to(torch.bfloat16)
    return layers, md, q, tk


def profile_layer(lines: List[str], contexts=CONTEXTS, paths=("paged-window", "workspace"),
                  calls: int = 10):
    """Per-kernel GPU time of one layer chunk per path (``torch.profiler``, warm, no flush):
    where a path's time goes, the paged-only launches included."""
    from torch.profiler import ProfilerActivity, profile

    for ctx in contexts:
        layers, md, q, tk = build_layer_case(ctx)
        for path in paths:
            lay = layers[path]
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)

            def fn(lay=lay, out=out, q=q, md=md, tk=tk):
                lay.forward_mqa(q, None, md.positions, out, metadata=md, topk_indices=tk)

            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            per: Dict[str, List[float]] = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    per.setdefault(ev.name[:60], []).append(ev.device_time)
            rows = sorted(((sum(v) / calls, len(v) // calls, k) for k, v in per.items()),
                          reverse=True)
            lines.append(f"profile ctx={ctx:<8d} {path:12s} total {sum(r[0] for r in rows):7.1f}"
                         f" us per chunk")
            lines.extend(f"profile ctx={ctx:<8d} {path:12s} {us:7.1f} us  x{n}  {name}"
                         for us, n, name in rows)
            for line in lines[-len(rows) - 1:]:
                print(line, flush=True)
        del layers, md, q, tk
        torch.cuda.empty_cache()


def run_layer(lines: List[str], contexts=CONTEXTS):
    for ctx in contexts:
        layers, md, q, tk = build_layer_case(ctx)
        outs = {}
        for path, lay in layers.items():
            out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)

            def fn(lay=lay, out=out, q=q, md=md, tk=tk):
                lay.forward_mqa(q, None, md.positions, out, metadata=md, topk_indices=tk)

            if path.endswith("-persist"):
                fn = persistent(fn)

            try:
                fn()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                us = time_eager_flushed(fn, reps=9)
                gus = time_graph_flushed(fn)
            except Exception as e:
                lines.append(f"layer ctx={ctx:<8d} {path:17s} FAILED {type(e).__name__}: "
                             f"{str(e)[:200]}")
                print(lines[-1], flush=True)
                continue
            outs[path] = out.clone()
            lines.append(f"layer ctx={ctx:<8d} {path:17s} eager {us:7.1f} us  graph {gus:7.1f} us  "
                         f"peak +{peak / 2**20:8.1f} MiB  (chunk {CHUNK} tokens, {q.shape[1]} heads)")
            print(lines[-1], flush=True)
        for other in ("paged", "paged-persist", "paged-window", "paged-window-persist",
                      "workspace-general", "auto"):
            if other in outs and "workspace" in outs:
                lines.append(f"layer ctx={ctx:<8d} {other} vs workspace out rel "
                             f"{rel_err(outs[other], outs['workspace']):.1e}")
                print(lines[-1], flush=True)
        del layers, md, q, tk, outs
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# warm-up: compile in parallel processes on the same shapes
# --------------------------------------------------------------------------------------------
def _settings() -> dict:
    """The module settings ``main`` sets from the command line (a spawned warm process starts
    from the defaults and gets them with its task)."""
    return dict(PAGED_CANDIDATES=PAGED_CANDIDATES, PAGED_RECORDS=PAGED_RECORDS,
                NO_SHARED=NO_SHARED, QUICK=QUICK, HEADS=HEADS)


def _warm_task(task):
    kind, arg, settings = task
    globals().update(settings)
    try:
        if kind == "kernel":
            inp = build_kernel_inputs(arg)
            for _, fn in kernel_fns(inp):
                fn()
        else:
            run_layer([], contexts=(arg,))
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"warm {kind} {arg}: {type(e).__name__}: {str(e)[:200]}"


def warm(procs: int, kernels: bool, layer: bool):
    import concurrent.futures as cf
    import multiprocessing as mp
    settings = _settings()
    tasks = ([("kernel", H, settings) for H in HEADS] if kernels else []) + \
        ([("layer", 8192, settings)] if layer else [])
    with cf.ProcessPoolExecutor(max_workers=procs, mp_context=mp.get_context("spawn")) as ex:
        return [r for r in ex.map(_warm_task, tasks) if r]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm", type=int, default=0, help="compile first in N processes")
    ap.add_argument("--warm-only", action="store_true")
    ap.add_argument("--kernels-only", action="store_true")
    ap.add_argument("--layer-only", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="kernels only: workspace (tl), Gluon, FlashMLA")
    ap.add_argument("--heads", type=str, default="",
                    help="comma-separated head counts (default 8,64,128)")
    ap.add_argument("--paged-candidates", action="store_true",
                    help="also time other launch shapes on the paged prefill")
    ap.add_argument("--paged-records", default="584,584",
                    help="window,compressed record widths of the paged rows (e.g. 528,288)")
    ap.add_argument("--no-shared", action="store_true", help="skip the shared-window rows")
    ap.add_argument("--few-ds", choices=("0", "1", "f16"), default=None,
                    help="the record kernel's dequant + S form off / on / on with fp16 "
                         "operands (launch.FEW_DS, FEW_DS_F16; default: the package's)")
    ap.add_argument("--ds-split", type=int, default=None,
                    help="with --few-ds: launch.FEW_DS_FREE_SPLIT (0, 1 or 4)")
    ap.add_argument("--ds-ahead", type=int, default=None,
                    help="with --few-ds f16: launch.FEW_DS_F16_AHEAD (1 or 2)")
    ap.add_argument("--ds-pvsync", choices=("0", "1"), default=None,
                    help="the dequant + S form's MMA warpgroup: softmax per warp and O^T by "
                         "mma.sync (launch.FEW_DS_PV_SYNC; default: the package's)")
    ap.add_argument("--ds-smask", choices=("0", "1"), default=None,
                    help="the dequant + S form's logits masked by its dequant warpgroups "
                         "(launch.FEW_DS_S_MASK; default: the package's)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel GPU times of the layer chunk (paged-window, workspace) at "
                         "--contexts instead of the tables")
    ap.add_argument("--contexts", default="",
                    help="layer rows: comma-separated context lengths (default 8192,131072,"
                         "1048576)")
    args = ap.parse_args(argv)
    contexts = tuple(int(c) for c in args.contexts.split(",")) if args.contexts else CONTEXTS
    from dsv41_triton.attention.gluon import launch as gl_launch
    if args.few_ds is not None:
        gl_launch.FEW_DS = args.few_ds != "0"
        gl_launch.FEW_DS_F16 = args.few_ds == "f16"
    if args.ds_split is not None:
        gl_launch.FEW_DS_FREE_SPLIT = args.ds_split
    if args.ds_ahead is not None:
        gl_launch.FEW_DS_F16_AHEAD = args.ds_ahead
    if args.ds_pvsync is not None:
        gl_launch.FEW_DS_PV_SYNC = args.ds_pvsync == "1"
    if args.ds_smask is not None:
        gl_launch.FEW_DS_S_MASK = args.ds_smask == "1"
    global PAGED_CANDIDATES, PAGED_RECORDS, NO_SHARED, QUICK, HEADS
    NO_SHARED = args.no_shared
    PAGED_CANDIDATES = args.paged_candidates
    PAGED_RECORDS = tuple(int(x) for x in args.paged_records.split(","))
    QUICK = args.quick
    if args.heads:
        HEADS = tuple(int(h) for h in args.heads.split(","))
    if not torch.cuda.is_available():
        print("bench_prefill: no CUDA device; nothing to time")
        return 0
    import triton
    t0 = time.time()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}  paged records {PAGED_RECORDS[0]}+{PAGED_RECORDS[1]}",
          flush=True)
    kernels, layer = not args.layer_only, not (args.kernels_only or args.quick)
    if args.warm:
        for line in warm(args.warm, kernels, layer):
            print(line, flush=True)
        print(f"warm: {time.time() - t0:.0f} s", flush=True)
        if args.warm_only:
            return 0
    lines: List[str] = []
    if args.profile:
        profile_layer(lines, contexts)
        return 0
    if kernels:
        run_kernels(lines)
    if layer:
        run_layer(lines, contexts)
    print(f"\n==== summary ({time.time() - t0:.0f} s) ====")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
