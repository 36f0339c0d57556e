"""The few-heads Gluon prefill (``dsv41_triton/attention/gluon/prefill_few.py``, H <= 8, keys as
the wgmma M): its sm_90a compile facts on the CPU, and on an H200 its outputs against
``sparse_mla_prefill``'s ``tl`` kernel and its time at the issue's 8-head shape beside ``tl``,
with the copies alone (``MODE=1``) and the products alone (``MODE=2``), and the shared-window
entry (window partial + this kernel with its prior) beside the same entry on ``tl``.

    python perf/prefill_few_probe.py            # GPU: check, then time (CUDA graph, L2 flushed)
    python perf/prefill_few_probe.py --compile  # CPU: registers, stack, shared memory, SASS ops
                                                # (the few-heads and the window kernels)
    python perf/prefill_few_probe.py --ncu      # GPU: one launch of each, for ncu
                                                # (perf/ncu_prefill_few.sh)
                                                # (--json: one JSON line per configuration)
"""
from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ARGS = [("q_ptr", "*bf16"), ("stride_qt", "i64"), ("stride_qh", "i64"), ("kv_ptr", "*bf16"),
        ("kv_stride", "i64"), ("rows", "i32"), ("idx_ptr", "*i32"), ("idx_st", "i64"),
        ("width", "i32"), ("len_ptr", "*i32"), ("len_st", "i64"), ("sink_ptr", "*fp32"),
        ("sink_st", "i64"), ("out_ptr", "*bf16"), ("stride_ot", "i64"), ("stride_oh", "i64"),
        ("lse_ptr", "*fp32"), ("stride_lt", "i64"), ("stride_lh", "i64"), ("T", "i32"),
        ("H", "i32"), ("qk_scale", "fp32")]
#: (ring stages, mode, prior, form) compiled by --compile / --json
CONFIGS = ((2, 0, False, "wgmma"), (2, 0, True, "wgmma"), (3, 0, False, "wgmma"),
           (2, 1, False, "wgmma"), (2, 0, False, "sync"), (2, 0, True, "sync"),
           (2, 0, False, "movm"), (2, 1, False, "movm"), (1, 0, True, "wgmma2"))


def compile_stats(ns=2, mode=0, prior=False, form="wgmma"):
    """Registers, stack, shared memory and SASS opcode counts of an sm_90a compile (640 keys)."""
    from dsv41_triton.attention.gluon import compile_check as cc
    from dsv41_triton.attention.gluon import prefill_few as pf
    from dsv41_triton.attention.gluon import prefill_few_movm as pm
    kern = {"wgmma": pf._sparse_mla_prefill_gluon_few_kernel,
            "wgmma2": pf._sparse_mla_prefill_gluon_few_kernel,
            "sync": pf._sparse_mla_prefill_gluon_few_sync_kernel,
            "movm": pm._sparse_mla_prefill_gluon_few_movm_kernel}[form]
    two = form == "wgmma2"  # as _launch_few(ctas_per_sm=2) launches it
    k = cc._compile(kern, ARGS,
                    ("stride_qt", "stride_qh", "kv_stride", "idx_st"), None,
                    dict(HAS_LEN=True, HAS_SINK=True, PRIOR=prior, NS=ns, WB=16, MODE=mode,
                         **(dict(CREGS=200) if two else {})),
                    pf.NUM_WARPS, 90, maxnreg=128 if two else None)
    return dict(kind="few", ns=ns, mode=mode, prior=prior, form=form, **_facts(cc, k))


WINDOW_ARGS = [("q_ptr", "*bf16"), ("stride_qt", "i64"), ("stride_qh", "i64"),
               ("kv_ptr", "*bf16"), ("kv_stride", "i64"), ("rows", "i32"), ("ws_ptr", "*i32"),
               ("ws_st", "i64"), ("wl_ptr", "*i32"), ("wl_st", "i64"), ("tiles_ptr", "*i32"),
               ("num_items", "i32"), ("out_ptr", "*bf16"), ("stride_ot", "i64"),
               ("stride_oh", "i64"), ("lse_ptr", "*fp32"), ("stride_lt", "i64"),
               ("stride_lh", "i64"), ("H", "i32"), ("qk_scale", "fp32")]


def window_compile_stats(hp=8):
    """The same facts for the shared-window kernel (``prefill_window.py``) at ``HP`` heads."""
    from dsv41_triton.attention.gluon import compile_check as cc
    from dsv41_triton.attention.gluon import prefill_window as pw
    k = cc._compile(pw._shared_window_gluon_kernel, WINDOW_ARGS,
                    ("stride_qt", "stride_qh", "kv_stride"), None, dict(HP=hp), pw.NUM_WARPS, 90)
    return dict(kind="window", hp=hp, **_facts(cc, k))


def _facts(cc, k):
    regs, stack = cc._regs_stack(k)
    ops = {}
    for line in cc.resource_usage(k, "-sass").splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)(\.\S+)?", line)
        if m:
            op = m.group(2) + ("" if m.group(2) != "HGMMA" else m.group(3).split(".")[1])
            ops[op] = ops.get(op, 0) + 1
    return dict(regs=regs, stack=stack, smem=k.metadata.shared, ops=ops)


#: the few-heads kernel's forms (``_launch_few`` keywords): wgmma, wgmma at two CTAs per SM
#: (one ring stage each), two mma.sync consumers on alternate blocks, two mma.sync consumers on
#: the dim halves reading each key tile once (no prior)
FORMS = {"wgmma": {}, "wgmma2": dict(ctas_per_sm=2), "sync": dict(form="sync"),
         "movm": dict(form="movm")}
PRIOR_FORMS = ("wgmma", "wgmma2", "sync")
if "--forms" in sys.argv:  # e.g. --forms wgmma,rows
    _keep = sys.argv[sys.argv.index("--forms") + 1].split(",")
    FORMS = {f: FORMS[f] for f in _keep}
    PRIOR_FORMS = tuple(f for f in PRIOR_FORMS if f in _keep)
QUICK = "--quick" in sys.argv  # the checks and the 8-head timings only


def check_and_time():
    """On an sm_90 GPU: the kernel against ``tl`` (ragged lens, an empty row, -1 and
    out-of-range rows, 1 / 2 / 3 / 8 heads, more tokens than SMs, a prior), then the issue's
    8-head shape (4096 tokens x 640 / the 512 top-k keys) timed beside ``tl``, a sweep of
    smaller shapes for the pick, and the shared-window entry on both kernels."""
    import torch

    import bench_prefill as bp
    from dsv41_triton.attention.gluon import prefill_launch as pl
    from dsv41_triton.attention.prefill import sparse_mla_prefill
    from dsv41_triton.attention.prefill_shared import sparse_mla_prefill_shared_window
    from dsv41_triton.testing import rel_err
    torch.manual_seed(0)
    dev = "cuda"
    scale = 512 ** -0.5
    for T, H, K, S in [(5, 8, 640, 3000), (3, 3, 70, 100), (1, 1, 1, 10), (300, 8, 200, 5000),
                       (700, 2, 1100, 9000)]:
        q = torch.randn(T, H, 512, device=dev).to(torch.bfloat16)
        kv = torch.randn(S, 512, device=dev).to(torch.bfloat16)
        idx = torch.randint(-2, S + 3, (T, K), device=dev, dtype=torch.int32)
        lens = torch.randint(0, K + 1, (T,), device=dev, dtype=torch.int32)
        lens[0] = 0
        sink = torch.randn(H, device=dev)
        for ln, form in [(x, f) for f in FORMS for x in (lens, None)]:
            ref, rl = sparse_mla_prefill(q, kv, idx, ln, sink, _kernel="tl")
            out = torch.full_like(ref, float("nan"))
            lse = torch.full_like(rl, float("nan"))
            pl._launch_few(q, kv, idx, ln, sink, scale, out, lse, False, **FORMS[form])
            torch.cuda.synchronize()
            fin = torch.isfinite(rl)
            print(f"T={T} H={H} K={K} lens={ln is not None} {form}: out rel "
                  f"{rel_err(out, ref):.2e} "
                  f"lse max {(lse - rl)[fin].abs().max().item() if fin.any() else 0:.2e} empty "
                  f"rows agree {torch.equal(torch.isinf(lse), torch.isinf(rl))}", flush=True)
    # a prior: the partial of a first key set (no sink), merged with a second set's keys
    T, H, S = 400, 8, 4000
    q = torch.randn(T, H, 512, device=dev).to(torch.bfloat16)
    kv = torch.randn(S, 512, device=dev).to(torch.bfloat16)
    ia = torch.randint(-1, S + 2, (T, 130), device=dev, dtype=torch.int32)
    ib = torch.randint(-1, S + 2, (T, 300), device=dev, dtype=torch.int32)
    ib[:7] = -1
    ia[3:10] = -1
    lb = torch.randint(0, 301, (T,), device=dev, dtype=torch.int32)
    sink = torch.randn(H, device=dev)
    ref, rl = sparse_mla_prefill(q, kv, torch.cat([ia, torch.where(
        torch.arange(300, device=dev)[None, :] < lb[:, None], ib, -1)], 1), None, sink,
        _kernel="tl")
    for form in PRIOR_FORMS:
        out, lse = sparse_mla_prefill(q, kv, ia, None, None, _kernel="tl")
        pl._launch_few(q, kv, ib, lb, sink, scale, out, lse, True, **FORMS[form])
        fin = torch.isfinite(rl)
        print(f"prior {form}: out rel {rel_err(out, ref):.2e} lse max "
              f"{(lse - rl)[fin].abs().max().item():.2e} empty rows agree "
              f"{torch.equal(torch.isinf(lse), torch.isinf(rl))}", flush=True)
    inp = bp.build_kernel_inputs(8)
    q, kv, sink = inp["q"], inp["kv"], inp["sink"]
    T = q.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=dev)
    for lab, idx in (("640", inp["idx"]), ("512", inp["local"])):
        ref = sparse_mla_prefill(q, kv, idx, None, sink, _kernel="tl")[0]
        t_ref = bp.time_graph_flushed(lambda: sparse_mla_prefill(q, kv, idx, None, sink, None, out,
                                                                 _kernel="tl"))
        for form in FORMS:
            kw = FORMS[form]
            for ns_mode in (0, 1, 2):
                k = pl._launch_few(q, kv, idx, None, sink, scale, out, lse, False, ns_mode, **kw)
                err = rel_err(out, ref) if ns_mode == 0 else float("nan")
                t_new = bp.time_graph_flushed(lambda: pl._launch_few(
                    q, kv, idx, None, sink, scale, out, lse, False, ns_mode, **kw))
                print(f"8 heads, {lab} keys: tl {t_ref:.1f} us, few mode={ns_mode} {form} "
                      f"{t_new:.1f} us "
                      f"(rel {err:.1e}, regs {k.n_regs}, spills {k.n_spills})", flush=True)
    if QUICK:
        return
    # the shared-window entry: window partial, then the top-k rows with the prior
    win_len = torch.full((T,), bp.W, dtype=torch.int32, device=dev)
    args = (q, kv, inp["win_start"], win_len, inp["local"], None, inp["qsl"], sink)
    ref = sparse_mla_prefill(q, kv, inp["idx"], None, sink, _kernel="tl")[0]
    for env in ("tl", "auto"):
        os.environ[pl.ENV] = env
        pl.LAST_LAUNCH.clear()
        o = sparse_mla_prefill_shared_window(*args)[0]
        t = bp.time_graph_flushed(lambda: sparse_mla_prefill_shared_window(*args, out=out))
        print(f"shared window, {env}: {t:.1f} us (rel to tl 640 {rel_err(o, ref):.1e}; Gluon "
              f"launches {sorted(pl.LAST_LAUNCH)})", flush=True)
    os.environ[pl.ENV] = "auto"
    from dsv41_triton.attention.prefill_shared import shared_window_tiles
    tiles = shared_window_tiles(inp["qsl"], T, 8)
    t_w = bp.time_graph_flushed(lambda: pl.launch_window(q, kv, inp["win_start"], win_len, tiles,
                                                         scale, out, lse))
    for form in PRIOR_FORMS:
        t_k = bp.time_graph_flushed(lambda: pl._launch_few(q, kv, inp["local"], None, sink,
                                                           scale, out, lse, True, **FORMS[form]))
        print(f"shared window parts: Gluon window {t_w:.1f} us, few top-k with prior ({form}) "
              f"{t_k:.1f} us", flush=True)
    # the pick: smaller shapes, random rows of a 32768-row workspace
    from dsv41_triton.attention.gluon.prefill_few import TWO_CTAS_MAX_WIDTH
    for T, H, K in [(1, 8, 640), (128, 8, 640), (264, 8, 640), (512, 8, 640), (1024, 8, 640),
                    (2048, 8, 640), (1024, 8, 2048), (512, 8, 4096)]:
        q = torch.randn(T, H, 512, device=dev).to(torch.bfloat16)
        idx = torch.randint(0, kv.shape[0], (T, K), device=dev, dtype=torch.int32)
        o = torch.empty_like(q)
        ls = torch.empty(T, H, device=dev)
        t_tl = bp.time_graph_flushed(lambda: sparse_mla_prefill(q, kv, idx, None, sink[:H], None,
                                                                o, _kernel="tl"))
        times = ", ".join(
            f"few {form} " + format(bp.time_graph_flushed(lambda: pl._launch_few(
                q, kv, idx, None, sink[:H], scale, o, ls, False, **FORMS[form])), ".1f") + " us"
            for form in FORMS
            if FORMS[form].get("ctas_per_sm", 1) == 1 or K <= TWO_CTAS_MAX_WIDTH)
        print(f"pick T={T} H={H} K={K}: tl {t_tl:.1f} us, {times}", flush=True)


def ncu_launches():
    """One launch of each few-heads kernel (wgmma, then the two mma.sync consumers) and of the
    window kernel at the issue's 8-head shape (512 top-k keys), for ``perf/ncu_prefill_few.sh``."""
    import torch

    import bench_prefill as bp
    from dsv41_triton.attention.gluon import prefill_launch as pl
    from dsv41_triton.attention.prefill_shared import shared_window_tiles
    inp = bp.build_kernel_inputs(8)
    q, kv, sink = inp["q"], inp["kv"], inp["sink"]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=q.device)
    for form in FORMS:
        pl._launch_few(q, kv, inp["local"], None, sink, 512 ** -0.5, out, lse, False,
                       **FORMS[form])
    wl = torch.full((q.shape[0],), bp.W, dtype=torch.int32, device=q.device)
    pl.launch_window(q, kv, inp["win_start"], wl, shared_window_tiles(inp["qsl"], q.shape[0], 8),
                     512 ** -0.5, out, lse)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if "--json" in sys.argv:  # one line per configuration, for tests/perf
        import json
        for c in CONFIGS:
            print(json.dumps(compile_stats(*c)))
        for hp in (8, 1):
            print(json.dumps(window_compile_stats(hp)))
    elif "--ncu" in sys.argv:
        ncu_launches()
    elif "--compile" in sys.argv:
        for c in CONFIGS:
            print(compile_stats(*c))
        for hp in (8, 1):
            print(window_compile_stats(hp))
    else:
        check_and_time()
