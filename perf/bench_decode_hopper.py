"""Decode on Hopper: the issue-10 table re-measured, ours (tl and Gluon) beside FlashMLA's kernel.

    python perf/bench_decode_hopper.py            # the table (+ FlashMLA when flash_mla imports)
    python perf/bench_decode_hopper.py --quick    # the four key rows
    python perf/bench_decode_hopper.py --csv out.csv
    python perf/bench_decode_hopper.py --few      # few heads: 8 h T=1..512 both pairs, 16 h

Method (issue 10): a CUDA graph of one call, a 512 MB L2 flush before every replay (outside
the timed events), median of 30. Each query token: 128 window keys (consecutive positions in
its own random pages) + 512 random compressed slots, pages of 64, sink on, real encoded
records. FlashMLA 9241ae3's kernel is called directly with heads zero-padded to 64/128 and its
scheduler metadata built once (584 records only: its SM90 kernels cannot read 528/288).
Also printed: the bytes floor (unique key records + q + out at 4.2 TB/s) and the launch
shape / registers of the Gluon kernels. Columns: ``tl``; ``gluon``: the head-tiled Gluon
kernel of decode.py with bf16 operands (the pick table's shape for the row, else its default
``4:0:3``); ``fp16``: the same kernel with fp16 operands (its ``F16``, ``4:0:3:h``; rows of
<= 16 heads: at block_h 32 it spills); ``heads``: the many-heads Gluon kernel of
decode_heads.py (``launch.HEADS_SHAPE``; rows with 16 or more heads); FlashMLA; ``auto``: what
``sparse_mla_decode`` picks.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv41_triton.attention.decode import sparse_mla_decode  # noqa: E402
from dsv41_triton.attention.gluon import launch as gluon_launch  # noqa: E402
from dsv41_triton.attention.ref import sparse_mla_decode_ref  # noqa: E402
from dsv41_triton.testing import max_abs_err, random_k_cache, rel_err  # noqa: E402

COPY_BW = 4.249e12
#: (heads, tokens, swa record, extra record)
TABLE = [(8, 1, 584, 584), (8, 32, 584, 584), (8, 128, 584, 584), (8, 512, 584, 584),
         (16, 128, 584, 584), (64, 1, 584, 584), (64, 128, 584, 584), (64, 512, 584, 584),
         (128, 128, 584, 584), (128, 512, 584, 584), (8, 128, 528, 288), (64, 128, 528, 288)]
#: the many-heads rows (issue 10's must-rows and their neighbours)
HEADS = [(32, 128, 584, 584), (64, 1, 584, 584), (64, 8, 584, 584), (64, 16, 584, 584),
         (64, 32, 584, 584), (64, 128, 584, 584), (64, 512, 584, 584), (128, 1, 584, 584),
         (128, 128, 584, 584), (128, 512, 584, 584), (64, 1, 528, 288), (64, 128, 528, 288),
         (64, 512, 528, 288), (128, 128, 528, 288), (128, 512, 528, 288)]
QUICK = [(8, 128, 584, 584), (8, 128, 528, 288), (64, 128, 584, 584), (64, 128, 528, 288)]
FEW = [(8, T, ra, rb) for ra, rb in ((584, 584), (528, 288)) for T in (1, 32, 128, 512)] + [
    (16, 128, 584, 584), (16, 128, 528, 288)]
W, K, PAGE = 128, 512, 64


def build_case(T, H, swa_rec, extra_rec, device="cuda"):
    nb_w = T * 3 + 8  # window: 128 consecutive positions in 2-3 pages of its own
    nb_c = max(2048, T * 8)
    ca = random_k_cache(nb_w, PAGE, swa_rec, device)
    cb = random_k_cache(nb_c, PAGE, extra_rec, device)
    start = torch.randint(0, PAGE, (T,), device=device) + torch.arange(T, device=device) * 3 * PAGE
    ia = (start[:, None] + torch.arange(W, device=device)[None, :]).to(torch.int32)
    ib = torch.randint(0, nb_c * PAGE, (T, K), dtype=torch.int32, device=device)
    return dict(q=torch.randn(T, H, 512, device=device).to(torch.bfloat16), swa_cache=ca,
                swa_indices=ia, swa_lens=torch.full((T,), W, dtype=torch.int32, device=device),
                extra_cache=cb, extra_indices=ib,
                extra_lens=torch.full((T,), K, dtype=torch.int32, device=device),
                attn_sink=torch.randn(H, device=device))


def bytes_floor_us(case, swa_rec, extra_rec):
    T, H = case["q"].shape[:2]
    nbytes = (torch.unique(case["swa_indices"]).numel() * swa_rec
              + torch.unique(case["extra_indices"]).numel() * extra_rec + 2 * T * H * 512 * 2)
    return nbytes / COPY_BW * 1e6


def time_graph(fn, reps=30):
    """Median µs of one graph replay, a 512 MB L2 flush before each (outside the events)."""
    flush = torch.empty(512 * 2 ** 20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps + 3):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times[3:])


def flashmla_fn(case):
    """A zero-argument call of FlashMLA's decode kernel (None when flash_mla is missing)."""
    try:
        from dsv41_triton.backends._flashmla_common import (as_cache4, lens_i32, load_flashmla,
                                                            new_sched_meta, pad_heads,
                                                            pad_indices, pad_sink,
                                                            padded_heads)
        from dsv41_triton.backends.flashmla import _DECODE_TOPK_MULTIPLE
    except Exception as e:  # noqa: BLE001
        print(f"# FlashMLA helpers unavailable: {e}")
        return None
    ops, why = load_flashmla()
    if ops is None or ops.with_kvcache is None:
        return None
    q = case["q"]
    T, H, _ = q.shape
    hp = padded_heads(H)
    qp = pad_heads(q, hp).unsqueeze(1).contiguous()
    idx = pad_indices(case["swa_indices"], _DECODE_TOPK_MULTIPLE).unsqueeze(1).contiguous()
    eidx = pad_indices(case["extra_indices"], _DECODE_TOPK_MULTIPLE).unsqueeze(1).contiguous()
    sink = pad_sink(case["attn_sink"], H, hp)
    meta = new_sched_meta(ops.get_metadata)
    ca, cb = as_cache4(case["swa_cache"]), as_cache4(case["extra_cache"])
    la, lb = lens_i32(case["swa_lens"]), lens_i32(case["extra_lens"])

    def fn():
        return ops.with_kvcache(qp, ca, None, None, 512, meta, None, softmax_scale=512 ** -0.5,
                                causal=False, is_fp8_kvcache=True, indices=idx, attn_sink=sink,
                                extra_k_cache=cb, extra_indices_in_kvcache=eidx, topk_length=la,
                                extra_topk_length=lb)
    return fn


class _Keys:
    """The record widths of a case, as the pick table reads them (``.src``)."""

    def __init__(self, src):
        self.src = src




def time_gluon(case, ref, shape, reps):
    """(µs, launch shape text, error text) of the Gluon decode at launch shape ``shape``."""
    gluon_launch.OVERRIDE.clear()
    gluon_launch.OVERRIDE.update(gluon_launch.parse_shape(shape))
    try:
        o, lse = sparse_mla_decode(**case, _kernel="gluon")
        err = f"{rel_err(o, ref[0]):.1e}/{max_abs_err(lse, ref[1]):.1e}"
        t = time_graph(lambda: sparse_mla_decode(**case, _kernel="gluon"), reps)
        k, sh = gluon_launch.LAST_LAUNCH["fwd"]
        text = f"{sh} r{getattr(k, 'n_regs', '?')} sp{getattr(k, 'n_spills', '?')}"
    except Exception as e:  # noqa: BLE001 - print and go on with the table
        t, text, err = float("nan"), "-", f"{type(e).__name__}: {str(e)[:80]}"
    finally:
        gluon_launch.OVERRIDE.clear()
    return t, text, err


def _warm_one(spec):
    """Compile one (row, launch shape) in a fresh process (fills Triton's cache)."""
    import subprocess
    shape = spec[1]
    env = dict(os.environ, DSV41_GLUON_SHAPE="" if shape == "tl" else shape)
    row = spec[0] + (",tl" if shape == "tl" else "")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--_warm", row], env=env,
                       capture_output=True, text=True)
    return spec, r.returncode, r.stderr[-300:]


def warm(rows, variants, jobs=12):
    """Compile every (row, variant) in parallel processes before timing anything (variant
    ``"tl"``: the tl kernel; the many-heads shape only on rows of >= 16 heads)."""
    from concurrent.futures import ThreadPoolExecutor
    specs = [(f"{H},{T},{ra},{rb}", v) for H, T, ra, rb in rows for v in variants
             if H >= 16 or v != gluon_launch.HEADS_SHAPE]
    with ThreadPoolExecutor(jobs) as ex:
        for spec, rc, err in ex.map(_warm_one, specs):
            if rc:
                print(f"# warm {spec} failed: {err}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--heads", action="store_true", help="the many-heads rows only")
    ap.add_argument("--few", action="store_true", help="the few-heads rows (FEW)")
    ap.add_argument("--rows", default="",
                    help="table rows 'H,T,swa,extra;...' in this order (instead of TABLE)")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", default="",
                    help="gluon launch shapes to time on the --quick rows, e.g. "
                         "'4:0:3,8:16:3' (num_warps:block_h(0 = default):stages; "
                         "'flashmla': its kernel)")
    ap.add_argument("--sweep-rows", default="",
                    help="rows for --sweep, e.g. '8,1,528,288;16,128,584,584' (default: --quick's)")
    ap.add_argument("--no-table", action="store_true", help="only the --sweep part")
    ap.add_argument("--_warm", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._warm:
        parts = args._warm.split(",")
        H, T, ra, rb = (int(x) for x in parts[:4])
        sparse_mla_decode(**build_case(T, H, ra, rb), _kernel="tl" if parts[4:] else "gluon")
        torch.cuda.synchronize()
        return
    rows = ([] if args.no_table else QUICK if args.quick else HEADS if args.heads
            else FEW if args.few else TABLE)
    if args.rows and not args.no_table:
        rows = [tuple(int(x) for x in r.split(",")) for r in args.rows.split(";")]
    variants = [v for v in args.sweep.split(",") if v]
    sweep_rows = ([tuple(int(x) for x in r.split(",")) for r in args.sweep_rows.split(";")]
                  if args.sweep_rows else QUICK)
    warm(rows, ["tl", "4:0:3", gluon_launch.HEADS_SHAPE, ""])  # "": the pick table's shape
    warm([r for r in rows if r[0] <= 16], ["4:0:3:h"])
    if variants:
        warm(sweep_rows, [v for v in variants if v != "flashmla"])
    print(f"# {torch.cuda.get_device_name()} | gluon available: {gluon_launch.AVAILABLE} "
          f"{gluon_launch.REASON}")
    print("| heads | tokens | records | tl (µs) | gluon (µs) | fp16 (µs) | gluon shape (bh, splits, "
          "nw, ns) | heads (µs) | heads shape | FlashMLA (µs) | bytes floor (µs) | gluon err | "
          "fp16 err | heads err | auto (µs) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    out_rows = []
    for H, T, ra, rb in rows:
        case = build_case(T, H, ra, rb)
        floor = bytes_floor_us(case, ra, rb)
        ref = sparse_mla_decode_ref(**case)
        t_tl = time_graph(lambda: sparse_mla_decode(**case, _kernel="tl"), args.reps)
        t_auto = time_graph(lambda: sparse_mla_decode(**case), args.reps)
        old = gluon_launch.table_shape(T, H, _Keys(ra), _Keys(rb), case["q"].device) or ""
        if old == gluon_launch.HEADS_SHAPE or old.endswith(":h"):
            old = "4:0:3"
        t_gl, shape, err = time_gluon(case, ref, old or "4:0:3", args.reps)
        t_h, err_h = float("nan"), "-"
        if H <= 16:
            t_h, _, err_h = time_gluon(case, ref, "4:0:3:h", args.reps)
        t_hd, hshape, herr = float("nan"), "-", "-"
        if H >= 16:
            t_hd, hshape, herr = time_gluon(case, ref, gluon_launch.HEADS_SHAPE, args.reps)
        t_fm = float("nan")
        if rb == 584 and ra == 584 and not args.no_flashmla:
            fn = flashmla_fn(case)
            if fn is not None:
                t_fm = time_graph(fn, args.reps)
        print(f"| {H} | {T} | {ra}+{rb} | {t_tl:.1f} | {t_gl:.1f} | {t_h:.1f} | {shape} | "
              f"{t_hd:.1f} | {hshape} | {t_fm:.1f} | {floor:.1f} | {err} | {err_h} | {herr} | "
              f"{t_auto:.1f} |", flush=True)
        out_rows.append((H, T, ra, rb, t_tl, t_gl, t_h, t_hd, t_fm, floor, t_auto))
        case = None
        torch.cuda.empty_cache()
    if args.sweep:
        print("\n| heads | tokens | records | num_warps:block_h:stages | gluon (µs) | err |")
        print("|---|---|---|---|---|---|")
        for H, T, ra, rb in sweep_rows:
            case = build_case(T, H, ra, rb)
            ro, rl = sparse_mla_decode_ref(**case)
            for v in variants:
                if v == "flashmla":  # FlashMLA's kernel on the row (584 records only)
                    fn = flashmla_fn(case) if ra == rb == 584 else None
                    t = time_graph(fn, args.reps) if fn is not None else float("nan")
                    print(f"| {H} | {T} | {ra}+{rb} | flashmla | {t:.1f} | - |", flush=True)
                    continue
                gluon_launch.OVERRIDE.clear()
                gluon_launch.OVERRIDE.update(gluon_launch.parse_shape(v))
                try:
                    o, lse = sparse_mla_decode(**case, _kernel="gluon")
                    err = f"{rel_err(o, ro):.1e}/{max_abs_err(lse, rl):.1e}"
                    t = time_graph(lambda: sparse_mla_decode(**case, _kernel="gluon"), args.reps)
                except Exception as e:  # noqa: BLE001
                    t, err = float("nan"), f"{type(e).__name__}: {str(e)[:80]}"
                print(f"| {H} | {T} | {ra}+{rb} | {v} | {t:.1f} | {err} |", flush=True)
            gluon_launch.OVERRIDE.clear()
            case = None
            torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("heads,tokens,swa,extra,tl_us,gluon_us,gluon_f16_us,heads_us,flashmla_us,"
                    "floor_us,auto_us\n")
            for r in out_rows:
                f.write(",".join(str(x) for x in r) + "\n")


if __name__ == "__main__":
    main()
