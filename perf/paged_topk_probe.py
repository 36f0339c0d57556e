"""The paged prefill's top-k part at 8 heads, taken apart (sm_90): the few-heads decode kernel
with its prior (``decode_few_ws.py``, persistent grid: what ``sparse_mla_prefill_shared_window``
runs with ``topk_cache``) beside the few-heads prefill kernel with its prior over bf16 rows
(what the workspace path runs), on the same tokens and top-k positions.

    python perf/paged_topk_probe.py [--tokens 2048,4096] [--ncu]

Rows (µs, CUDA graph, 512 MB L2 flush before each replay, median):

* ``decode``: the record kernel as launched (``MODE`` 0); ``decode copies``: its copies alone
  (``MODE`` 1: the dequant partition hands each stage on unconverted, the MMA partition frees
  each tile unread); ``decode copies+dequant`` (``MODE`` 2: no products);
* ``... no reads``: the same with every slot id ``-1`` (the copies zero-fill shared memory,
  nothing is read from L2 or HBM): the kernel's work on shared memory and the tensor cores;
* ``decode ds``: the record kernel's dequant + S form (``decode_few_ds.py``); ``... no
  convert`` / ``no S`` / ``neither`` / ``f16 conversion``: its ``MODE`` 1 / 2 / 3 / 4 (the
  bytes stored unconverted, no S^T products, both, the fp16 operands' conversion instead);
  ``decode ds f16``: the form with fp16 operands (``launch.FEW_DS_F16``), its ``no reads``
  row, ``no convert`` / ``neither`` (``MODE`` 1 / 3) and ``no max`` (``MODE`` 5: ``R = 127``
  instead of each block's largest scale byte), ``split4`` / ``split1``
  (``launch.FEW_DS_FREE_SPLIT``: the key tiles freed in two parts, after group 3 / group 0),
  ``ahead2`` (``launch.FEW_DS_F16_AHEAD``: the producer's slot ids two blocks ahead), ``pvsync``
  (``launch.FEW_DS_PV_SYNC``: the MMA warpgroup's softmax per warp and ``O^T`` by
  ``mma.sync``), ``smask`` (``launch.FEW_DS_S_MASK``: the logits masked by the dequant + S
  warpgroups); the rows without ``pvsync`` / ``smask`` run with both off;
* ``prefill few``: the bf16 kernel with its prior on a 32768-row workspace, read at the same
  positions (random rows, not the records' values; ``prefill_launch.launch(..., FEW,
  prior=True)``).

``--ncu``: one launch of each of ``--ncu-rows`` (default ``decode``, ``prefill few``) at the
first token count (for ``ncu -k regex:few``), no timing. ``--json`` (CPU, Triton 3.6): the
sm_90a compile facts of the record kernel as ``paged`` launches it, per ``MODE`` (one JSON
line each: registers, stack, shared memory, SASS opcode counts).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_prefill as bp  # noqa: E402
from dsv41_triton.attention.decode import _keyset  # noqa: E402
from dsv41_triton.attention.gluon import launch as dl  # noqa: E402
from dsv41_triton.attention.gluon import prefill_launch as pl  # noqa: E402
from dsv41_triton.ops.prefill_indices import prefill_window_slot_indices  # noqa: E402


def inputs(T: int):
    """8-head inputs of ``bench_prefill`` at ``T`` tokens: the top-k slot ids into the 584-byte
    compressed cache (``ei`` / ``el``) and the same positions as rows of the bf16 workspace (its
    rows are random, not the records' values)."""
    bp.T = T
    inp = bp.build_kernel_inputs(8)
    pg = inp["paged"]
    _, ei, el = prefill_window_slot_indices(
        pg["positions"], pg["token_to_req"], pg["seq_lens"], inp["glen"], 0,
        inp["wws"].shape[1], bp.W, pg["topk_indices"], pg["compressed_block_table"], bp.PAGE,
        bp.RATIO)
    inp["ei"], inp["el"] = ei, el
    g = torch.Generator(device="cuda").manual_seed(1)
    # a prior partial: normalized bf16 rows and their natural lse
    inp["prior_out"] = torch.randn(T, 8, 512, device="cuda", generator=g).to(torch.bfloat16)
    inp["prior_lse"] = torch.randn(T, 8, device="cuda", generator=g)
    return inp


def compile_facts(mode: int) -> dict:
    """The few-heads decode kernel as the paged prefill's prior launch compiles it (584
    records, one key set, 8-head tiles, persistent, ids preloaded, dequant prefetch) with
    ``MODE = mode``, for sm_90a."""
    from dsv41_triton.attention.gluon import compile_check as cc
    k = cc.compile_decode(584, 584, 8, False, has_b=False, ns=2, nt=2, ahead=0,
                          deq_prefetch=True, prior=True, persist=True, mode=mode)
    regs, stack = cc._regs_stack(k)
    return dict(mode=mode, regs=regs, stack=stack, smem=int(k.metadata.shared),
                ops=dict(cc.sass_op_counts(k)))


def fns(inp):
    q, sink = inp["q"], inp["sink"]
    scale = 512 ** -0.5
    out, lse = inp["out"], torch.empty(q.shape[:2], device="cuda")
    cache = inp["paged"]["compressed_cache"]
    ids = inp["ei"]
    none = torch.full_like(ids, -1)

    def prior():
        out.copy_(inp["prior_out"])
        lse.copy_(inp["prior_lse"])

    def decode(mode, slot_ids, ds=False, dsmode=0, f16=False, split=0, ahead=1, pv=False,
               sm=False):
        def fn():
            prior()
            old = dict(dl.OVERRIDE)
            dl.OVERRIDE.clear()
            dl.OVERRIDE.update({**dl.parse_shape(dl.FEW_WS_PRELOAD_PREFETCH_SHAPE),
                                "persist": True, "mode": mode, "ds": ds, "dsmode": dsmode,
                                "ds_f16": f16, "ds_split": split,
                                "ds_ahead": ahead, "ds_pvsync": pv, "ds_smask": sm})
            try:
                dl.launch(q, _keyset(cache, slot_ids, inp["el"]), None, sink, scale, out, lse,
                          prior=True)
            finally:
                dl.OVERRIDE.clear()
                dl.OVERRIDE.update(old)
            return out, lse
        return fn

    def few():
        prior()
        pl.launch(q, inp["kv"], inp["local"], None, sink, scale, out, lse, pl.FEW, prior=True)
        return out, lse

    def copies():
        prior()
        return out, lse

    return [("prior copy (subtracted below)", copies),
            ("decode", decode(0, ids)), ("decode copies", decode(1, ids)),
            ("decode copies+dequant", decode(2, ids)), ("decode no reads", decode(0, none)),
            ("decode copies+dequant no reads", decode(2, none)), ("prefill few", few),
            ("decode copies+products", decode(3, ids)),
            ("decode copies+products no reads", decode(3, none)),
            ("decode ds", decode(0, ids, True)), ("decode ds no reads", decode(0, none, True)),
            ("decode ds no convert", decode(0, ids, True, 1)),
            ("decode ds no S", decode(0, ids, True, 2)),
            ("decode ds neither", decode(0, ids, True, 3)),
            ("decode ds f16 conversion", decode(0, ids, True, 4)),
            ("decode ds f16", decode(0, ids, True, 0, True)),
            ("decode ds f16 no reads", decode(0, none, True, 0, True)),
            ("decode ds f16 no convert", decode(0, ids, True, 1, True)),
            ("decode ds f16 neither", decode(0, ids, True, 3, True)),
            ("decode ds f16 no max", decode(0, ids, True, 5, True)),
            ("decode ds f16 split4", decode(0, ids, True, 0, True, 4)),
            ("decode ds f16 split1", decode(0, ids, True, 0, True, 1)),
            ("decode ds split4", decode(0, ids, True, 0, False, 4)),
            ("decode ds f16 split4 ahead2", decode(0, ids, True, 0, True, 4, 2)),
            ("decode ds f16 ahead2", decode(0, ids, True, 0, True, 0, 2)),
            ("decode ds f16 split4 ahead2 pvsync", decode(0, ids, True, 0, True, 4, 2, True)),
            ("decode ds f16 split4 ahead2 pvsync smask",
             decode(0, ids, True, 0, True, 4, 2, True, True)),
            ("decode ds f16 split4 ahead2 pvsync smask no reads",
             decode(0, none, True, 0, True, 4, 2, True, True))]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--ncu-rows", default="decode,prefill few",
                    help="with --ncu: the rows launched once each (comma-separated labels)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="first compare the dequant + S forms' outputs with the record "
                         "kernel's")
    ap.add_argument("--rows", default="", help="time only these rows (comma-separated labels)")
    a = ap.parse_args(argv)
    if a.json:
        import json
        for mode in (0, 1, 2, 3):
            print(json.dumps(compile_facts(mode)))
        return
    print(f"device: {torch.cuda.get_device_name()}  triton "
          f"{__import__('triton').__version__}")
    for T in (int(x) for x in a.tokens.split(",")):
        inp = inputs(T)
        rows = fns(inp)
        if a.ncu:
            for lab in a.ncu_rows.split(","):
                dict(rows)[lab]()
            torch.cuda.synchronize()
            return
        if a.check:
            ref = [x.clone() for x in dict(rows)["decode"]()]
            for lab in ("decode ds", "decode ds f16", "decode ds f16 split4",
                        "decode ds f16 split1", "decode ds split4",
                        "decode ds f16 split4 ahead2", "decode ds f16 split4 ahead2 pvsync",
                        "decode ds f16 split4 ahead2 pvsync smask"):
                dl.LAST_LAUNCH.pop("fwd", None)
                o, lse = dict(rows)[lab]()
                kind = dl.LAST_LAUNCH["fwd"][1][4] if "fwd" in dl.LAST_LAUNCH else "-"
                print(f"T={T:<5d} check {lab:20s} out max|diff| vs decode "
                      f"{(o.float() - ref[0].float()).abs().max().item():.3e}  lse "
                      f"{(lse - ref[1]).abs().max().item():.3e}  decode kernel {kind}",
                      flush=True)
        base = None
        for lab, fn in rows:
            if a.rows and lab not in a.rows.split(",") and base is not None:
                continue
            us = bp.time_graph_flushed(fn, replays=20)
            if base is None:
                base = us
                print(f"T={T:<5d} {lab:32s} {us:8.1f} us")
                continue
            print(f"T={T:<5d} {lab:32s} {us - base:8.1f} us  (with the prior copy {us:.1f})",
                  flush=True)
        del inp
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
