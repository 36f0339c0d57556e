"""Host side of the Gluon decode kernels (decode.py's head tiles of 8/16/32, decode_heads.py's
64-head tiles): when they apply, the pick table, the launch.

``usable(q, a, b)`` says whether the kernel can run these arguments (sm_90, Gluon present,
16-byte aligned caches and block strides); ``pick(T, H, a, b, device)`` says whether it should
(``PICK``: measured on an H200, keyed by (arch, heads bucket, records)); ``launch`` runs it on
arguments that ``decode.py`` already validated. Importing this module never fails: without a
usable Gluon every query answers False.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..._utils import cdiv, is_interpreter
from . import AVAILABLE, REASON

#: launch shapes the GPU tests run (tests/attention/test_decode_gluon.py,
#: test_decode_gluon_heads.py); PICK uses only these. ``block_h`` 64 (``HEADS_SHAPE``) is the
#: many-heads kernel of decode_heads.py (8 warps, heads on the wgmma M).
HEADS_SHAPE = "8:64:2"
#: the warp-specialized many-heads kernel (decode_heads_ws.py: a cp.async producer partition
#: beside the 8 MMA warps), selectable only by the launch shape for now
HEADS_WS_SHAPE = "8:64:2:3"
#: the warp-specialized few-heads kernel (decode_few_ws.py: producer, dequant and MMA
#: partitions; 8-head tiles, two ring stages, two key tiles)
FEW_WS_SHAPE = "4:8:2:w"
#: the same with 16-head tiles (8 where 584 records meet 528 ones: ``few_ws_block_h``)
FEW_WS16_SHAPE = "4:16:2:w"
#: the few-heads kernel with its slot ids preloaded 8 blocks at a time (``IDX_AHEAD`` 0) and
#: with the dequant partition's group prefetch (``DEQ_PREFETCH``)
FEW_WS_PRELOAD_SHAPE = "4:8:2:w:0"
FEW_WS_PREFETCH_SHAPE = "4:8:2:w:1:p"
#: both: ids preloaded and the dequant group prefetch (8- and 16-head tiles)
FEW_WS_PRELOAD_PREFETCH_SHAPE = "4:8:2:w:0:p"
FEW_WS16_PRELOAD_PREFETCH_SHAPE = "4:16:2:w:0:p"
TESTED_SHAPES = ("4:0:3", "4:16:2", "8:16:3", "8:16:2", "8:32:3", "4:0:3:h", "4:8:3:h",
                 "4:0:1", "4:0:1:h", HEADS_SHAPE, HEADS_WS_SHAPE, FEW_WS_SHAPE, FEW_WS16_SHAPE,
                 FEW_WS_PRELOAD_SHAPE, FEW_WS_PREFETCH_SHAPE, FEW_WS_PRELOAD_PREFETCH_SHAPE,
                 FEW_WS16_PRELOAD_PREFETCH_SHAPE)
#: the many-heads kernel's dequant order by default: True = block j + 1's keys are dequantized
#: into registers while block j's O wgmma runs, False = after it (serial). A 4th shape field
#: forces one (benchmark sweeps, tests): "8:64:2:1" serial, "8:64:2:2" overlapped, "8:64:2:3"
#: the warp-specialized kernel (``HEADS_WS_SHAPE``: its own producer warps gather, the 8 MMA
#: warps dequantize in the serial order; two ring stages only: three need ~264 KB of shared
#: memory). Serial: on the H200 (one run, T = 128) 55.9 / 103.6 / 56.6 us against 59.2 / 107.1
#: / 58.9 overlapped for 64 h 584+584, 128 h 584+584, 64 h 528+288 (the overlapped order spills).
HEADS_OVERLAP = False
HEADS_VARIANTS = {1: False, 2: True, 3: "ws"}
#: how the warp-specialized kernels' producer loads slot ids (its ``IDX_AHEAD``): 1 = one
#: 64-key block ahead, 0 = those of ``decode_heads_ws.PRELOAD_BLOCKS`` blocks at once into
#: shared memory; a 5th shape field sets it ("4:8:2:w:0", "8:64:2:3:0")
IDX_AHEAD = 1
#: the warp-specialized few-heads kernel's ``DEQ_PREFETCH`` (the dequant partition loads group
#: ``g + 1``'s bytes before it converts group ``g``); a 6th shape field ``p`` sets it
#: ("4:8:2:w:1:p")
DEQ_PREFETCH = False

#: the pick table: (major, minor) -> {(heads bucket, swa record, extra record or 0, tokens
#: bucket): launch shape "num_warps:block_h:stages[:h|:b|:w|:1|:2|:3]" (0 = default; ":h" = fp16
#: wgmma operands of the few-heads kernel, its ``F16``; ":w" the warp-specialized few-heads
#: kernel; ":1"/":2"/":3" the many-heads kernel's serial / overlapped / warp-specialized
#: variant)}. Heads buckets: 8 (H <= 8), 16, 32, 64, 128 (larger); tokens buckets:
#: 1, 7 (2..7), 32 (8..32), 128, 1 << 30. Only shapes where a Gluon kernel measured faster than
#: the tl kernel and the other Gluon variants on the H200 are listed (perf/NOTES.md, "Gluon
#: decode for Hopper", "Gluon decode, many heads", "Gluon decode, fp16 operands (few heads)");
#: a missing key means the tl kernel.
PICK = {
    # H200, triton 3.6, 2026-12-01 (CUDA graph, L2 flushed, median of 30), one run per group.
    # Few heads, perf/bench_decode_hopper.py --few, fp16 Gluon vs bf16 Gluon vs tl (us):
    # 8 heads 584+584 T=1 / 32: 14.7 / 23.4 vs 15.4 / 23.5 vs 15.6 / 25.7 (T=128 / 512 fp16
    # slower: 47.3 / 157.8 vs 42.0 / 148.7 vs 41.8 / 121.2: tl);
    # 8 heads 528+288 T=1 / 32 / 128 / 512: 14.7 / 22.0 / 43.9 / 152.8 vs 15.3 / 24.1 / 49.4 /
    # 174.1 vs 16.2 / 35.8 / 68.5 / 219.7; 16 heads 528+288 T=128: 57.7 vs 62.0 vs 70.3
    # (16 heads 584+584 T=128: tl 43.2 fastest).
    # Many-heads kernel (decode_heads.py, HEADS_SHAPE), T = 128 / 512, us, heads vs tl vs old
    # Gluon (4:0:3) vs FlashMLA: 64 h 584+584 66.2 / 224.5 vs 92.1 / 335.7 vs 127.4 / 479.3 vs
    # 50.8 / 174.6; 128 h 584+584 117.2 / 428.3 vs 168.9 / 641.2 vs 239.0 / 927.8 vs 68.7 /
    # 252.1; 64 h 528+288 65.7 / 228.9 vs 105.6 / 395.6 vs 146.3 / 558.2; 128 h 528+288 119.2 /
    # 441.6 vs 198.2 / 769.8 vs 278.1 / 1089.1; 64 h 584+584 T = 8 / 16 / 32: 24.7 / 27.3 /
    # 32.1 vs tl 26.3 / 29.2 / 38.7 (picked for 8..32 tokens). Not picked: T <= 7 (T = 1: 21.3
    # vs tl 18.8), 17..32 heads (32 h T=128: 61.1 vs 62.4), T <= 32 at 128 heads and at
    # 528+288 (untimed).
    # One ring stage, two CTAs per SM (perf/NOTES.md, "Gluon decode, one ring stage"), session
    # 4 sweep (us): 8 h 584+584 T=128 / 512: 4:0:1 39.0 / 107.4 vs 4:0:3 48.3 / 164.5 (tl: 40.8
    # at T=128 in the same call, 121.1 at T=512 in session 3's table); 8 h 528+288 T=128:
    # 4:0:1:h 36.1 vs 4:0:3:h 46.8; T=512: 102.1 vs 163.0. Warp-specialized many-heads kernel
    # (HEADS_WS_SHAPE) vs the serial one (HEADS_SHAPE), 584+584: 64 h T=128 / 512 53.7 / 187.8
    # vs 56.2 / 197.0, 128 h T=128 100.5 vs 103.0 (64 h 528+288 T=128: 58.0 vs 56.6, T=1 20.5 vs
    # 19.9: serial stays).
    # One token (session 5, tl with its merge as a programmatic dependent launch, one run,
    # us): 64 h 584+584 T=1 4:8:3:h 16.7 vs tl 17.5 (4:8:3 17.3, 4:16:2 19.1, 4:0:3:h 21.6;
    # at T=2 / 7 4:8:3:h loses: 22.2 / 38.2 vs tl 18.4 / 26.7); 64 h 528+288 T=1 16.8 vs 17.9;
    # 16 h 584+584 T=1 16.1 vs 17.4; 128 h T=1: tl (18.3 vs 22.1).
    # Warp-specialized few-heads kernel (FEW_WS_SHAPE), session 6, one run, us, vs the picks
    # before it: 8 h 584+584 T=1 / 7 / 32 / 128 / 512: 12.4 / 13.6 / 18.2 / 30.5 / 96.5 vs
    # 13.4 / 14.6 / 22.7 / 38.8 / 107.7; 8 h 528+288 T=1 / 7 / 32 / 128: 13.5 / 14.0 / 19.2 /
    # 31.7 vs 13.9 / 14.8 / 22.9 / 36.0 (T=512: 110.4 vs 102.6, and 16 h 584+584 T=128: 50.2
    # vs 43.0, stay). With 16-head tiles (FEW_WS16_SHAPE), same session, one run, us, vs the
    # picks before: 16 h 584+584 T=7 / 32 / 128 / 512: 15.1 / 20.5 / 32.0 / 101.7 vs 18.0 / 27.6
    # / 43.3 / 121.2; 16 h 528+288 T=32 / 128 / 512: 21.0 / 33.1 / 117.0 vs 38.5 / 55.9 / 221.8;
    # 32 h 584+584 T=128: 52.9 vs 62.5. One token, 8-head tiles: 16 h 584+584 12.9 vs 13.4, 16 h
    # 528+288 13.5 vs 15.3, 64 h 584+584 13.5 vs 14.4, 64 h 528+288 13.7 vs 14.5.
    # Session 9, one sweep (median of 20), 8 h, us: 584+584 T=128 / 512 4:8:2:w:0 27.7 / 92.0
    # vs 4:8:2:w 28.8 / 93.0 (session 8: 28.2 / 92.8 vs 29.1 / 92.8); 528+288 T=128
    # 4:8:2:w:1:p 27.0 vs 28.5 (T=512 93.9 vs 100.3, but 4:0:1:h, picked there, was not in that
    # run); 584+584 T=32: 17.9 (w) / 18.5 (:0) / 17.7 (:1:p): unchanged.
    # Session 10, one sweep (median of 20), 8 h 584+584 T=128 / 512, us: 4:8:2:w:0:p 27.5 /
    # 89.4 vs 4:8:2:w:0 28.0 / 92.1 vs 4:8:2:w 29.2 / 95.1 (session 9: 27.2 / 88.9 vs 27.7 /
    # 92.0); 528+288 T=512: 4:0:1:h 85.2 vs 4:8:2:w:1:p 94.4 (stays). A second sweep, us:
    # 8 h 528+288 T=32 4:8:2:w:1:p 17.2 vs 4:8:2:w 17.8; 16 h 528+288 T=128 4:16:2:w:0:p 29.3
    # vs 4:16:2:w 30.8 (:0 31.0); unchanged: 8 h 584+584 T=7 / 32 (w 12.6 / 17.7 fastest),
    # 16 h 584+584 T=32 / 128 / 512 (w 20.1 / 30.2 / 99.5; :0:p 20.6 / 30.6 / 100.3).
    (9, 0): {
        (8, 584, 584, 1): FEW_WS_SHAPE,
        (8, 528, 288, 1): FEW_WS_SHAPE,
        (16, 584, 584, 1): FEW_WS_SHAPE,
        (16, 528, 288, 1): FEW_WS_SHAPE,
        (64, 584, 584, 1): FEW_WS_SHAPE,
        (64, 528, 288, 1): FEW_WS_SHAPE,
        (16, 584, 584, 7): FEW_WS16_SHAPE,
        (16, 584, 584, 32): FEW_WS16_SHAPE,
        (16, 584, 584, 128): FEW_WS16_SHAPE,
        (16, 584, 584, 1 << 30): FEW_WS16_SHAPE,
        (16, 528, 288, 32): FEW_WS16_SHAPE,
        (16, 528, 288, 1 << 30): FEW_WS16_SHAPE,
        (32, 584, 584, 128): FEW_WS16_SHAPE,
        (8, 584, 584, 7): FEW_WS_SHAPE,
        (8, 584, 584, 32): FEW_WS_SHAPE,
        (8, 584, 584, 128): FEW_WS_PRELOAD_PREFETCH_SHAPE,
        (8, 584, 584, 1 << 30): FEW_WS_PRELOAD_PREFETCH_SHAPE,
        (8, 528, 288, 7): FEW_WS_SHAPE,
        (8, 528, 288, 32): FEW_WS_PREFETCH_SHAPE,
        (8, 528, 288, 128): FEW_WS_PREFETCH_SHAPE,
        (8, 528, 288, 1 << 30): "4:0:1:h",
        (16, 528, 288, 128): FEW_WS16_PRELOAD_PREFETCH_SHAPE,
        (64, 584, 584, 32): HEADS_SHAPE,
        (64, 584, 584, 128): HEADS_WS_SHAPE,
        (64, 584, 584, 1 << 30): HEADS_WS_SHAPE,
        (128, 584, 584, 128): HEADS_WS_SHAPE,
        (128, 584, 584, 1 << 30): HEADS_WS_SHAPE,
        (64, 528, 288, 128): HEADS_SHAPE,
        (64, 528, 288, 1 << 30): HEADS_SHAPE,
        (128, 528, 288, 128): HEADS_SHAPE,
        (128, 528, 288, 1 << 30): HEADS_SHAPE,
    },
}


#: DSV41_DECODE_KERNEL=tl|gluon|auto overrides the pick (benchmarks, tests)
ENV = "DSV41_DECODE_KERNEL"

_SM = {}


def _sms(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM:
        _SM[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM[i]


def _cap(device: torch.device):
    return torch.cuda.get_device_capability(device)


def f16_supported(a, b) -> bool:
    """The fp16-operand variant covers 584-only and 528/288-only record pairs (not 584 mixed
    with 528/288: measured wrong on the H200, perf/NOTES.md); elsewhere it falls back to bf16."""
    srcs = {a.src} | ({b.src} if b is not None else set())
    return srcs == {584} or 584 not in srcs


#: the pick tables' heads buckets: a bucket holds the head counts up to its value
HEADS_BUCKETS = (8, 16, 32, 64, 128)


def heads_bucket(H: int, beyond: int = 128) -> int:
    """The smallest of ``HEADS_BUCKETS`` holding ``H``; ``beyond`` for more heads (the decode
    table's 128 bucket takes them)."""
    return next((b for b in HEADS_BUCKETS if H <= b), beyond)


def tokens_bucket(T: int) -> int:
    """The pick table's tokens bucket: 1, 7 (2..7), 32, 128 or ``1 << 30``."""
    return 1 if T <= 1 else 7 if T <= 7 else 32 if T <= 32 else 128 if T <= 128 else 1 << 30


def usable(q: torch.Tensor, a, b) -> bool:
    """True when the Gluon kernel can run these (validated) arguments on this machine."""
    if not AVAILABLE or q.device.type != "cuda" or is_interpreter():
        return False
    if _cap(q.device) != (9, 0):
        return False
    for ks in (a, b):
        if ks is None:
            continue
        if ks.src not in (584, 528, 288) or ks.k.data_ptr() % 16 or ks.bstride % 16:
            return False
        if ks.rows >= 2 ** 31:
            return False
    return a.src in (584, 528)


def table_shape(T: int, H: int, a, b, device: torch.device) -> Optional[str]:
    """The ``PICK`` entry for these shapes (a launch shape string) or None."""
    table = PICK.get(_cap(device), {})
    return table.get((heads_bucket(H), a.src, b.src if b is not None else 0, tokens_bucket(T)))


def pick(T: int, H: int, a, b, device: torch.device) -> bool:
    """Whether the auto path should take the Gluon kernel (``PICK``; ``DSV41_DECODE_KERNEL``
    overrides)."""
    mode = os.environ.get(ENV, "auto")
    if mode == "tl":
        return False
    if mode == "gluon":
        return True
    return table_shape(T, H, a, b, device) is not None


#: launch-shape override for benchmarks: keys block_h, num_warps, stages, f16 and variant
#: (absent = default), ``persist`` (the few-heads ws kernel's persistent grid), ``mode``
#: (its ``MODE``: 1 the copies alone, 2 copies and dequant, 3 copies and products) and ``ds``
#: (its dequant + S form where it applies, ``FEW_DS``), ``dsmode`` (that form's ``MODE``: 1 no
#: conversion, 2 no S products, 3 neither, 4 the fp16 operands' conversion with wrong values),
#: ``ds_f16`` (that form with fp16 operands, ``FEW_DS_F16``);
#: DSV41_GLUON_SHAPE="num_warps:block_h:stages[:x]" (0 = default) sets it from the environment
OVERRIDE = {}

#: whether ``launch(prior=True)`` (the paged prefill's top-k records) with 8-head tiles and one
#: e4m3 record width runs the few-heads ws kernel's dequant + S form on its persistent grid
#: (``decode_few_ds.py``: the dequant warpgroups compute the logits from the registers they
#: converted, so K is read from shared memory once, for O^T); decodes take it only through the
#: override key ``ds``. On with the three settings below: H100, 2048 tokens x 512 records,
#: 228.7 us against 238.2 for the record kernel; layer chunk at 8K 270.8 against 281.8
#: (perf/NOTES.md, "Session 33")
FEW_DS = True

#: whether that form runs with fp16 operands (``decode_few_ds``'s ``F16``: each block's tiles in
#: its own power-of-two units, one ``cvt`` and one multiply per two bytes); override key
#: ``ds_f16``. With bf16 operands the form is no faster than the record kernel
FEW_DS_F16 = True
#: that form's key tiles freed and retaken in two parts (0: off; 1 or 4: groups ``0 .. n - 1``
#: once their ``O^T`` products are done, then the rest), so a block's first conversion
#: overlaps the products of the block two back; override key ``ds_split``
FEW_DS_FREE_SPLIT = 4
#: the producer's slot-id lead in blocks for that form with fp16 operands and 584 records (1 or
#: 2; the preload, 0, does not fit beside the RoPE group's bf16 P); override key ``ds_ahead``
FEW_DS_F16_AHEAD = 2
#: that form's MMA warpgroup: the softmax in each warp on all of a block's logits (P stays in
#: registers) and the ``O^T`` products by ``mma.sync`` (``decode._pv_sync``: each warp's 16
#: dims of a group against the block's 64 keys) instead of a cross-warp softmax, P through
#: shared memory and 32 m64n8k16 wgmmas waited as one chain; override key ``ds_pvsync``.
#: H100, 2048 tokens x 512 records: 220.2 against 230.8 us (perf/NOTES.md, "Session 35")
FEW_DS_PV_SYNC = True
#: that form's logits masked (``-inf`` where a key does not count) by the dequant + S
#: warpgroups, so the MMA warpgroup reads no key ids; override key ``ds_smask``. With
#: ``FEW_DS_PV_SYNC``: 218.5 against 220.9 us
FEW_DS_S_MASK = True

#: whether ``launch(prior=True)`` runs the few-heads ws kernel on a persistent grid (at most
#: one CTA per SM looping over tokens: a token's first gathers overlap the previous token's
#: last products). H200, the paged prefill chunk (2048 tokens x 8 heads): 278.4 against
#: 292.4 us per token CTA at 8K (perf/NOTES.md, "Session 23")
PRIOR_PERSIST = True

#: whether a decode launch (no prior) of the few-heads ws kernel with more items than SMs runs
#: on the persistent grid. H100, one sweep (median of 20), per-item vs persistent grid, us:
#: 8 h 584+584 T=512 / 2048 4:8:2:w:0:p 99.1 / 389.8 vs 91.9 / 335.8; 16 h 584+584 T=512
#: 4:16:2:w:0:p 108.8 vs 101.8, 4:8:2:w 174.9 vs 156.5; 8 h 528+288 T=512 4:8:2:w:0:p 99.0 vs
#: 90.3 (T=128, one item per SM or fewer: 31.4 vs 31.3; perf/NOTES.md, "Session 26")
DECODE_PERSIST = True


def parse_shape(text: str) -> dict:
    """``"8:16:3"`` -> ``{num_warps: 8, block_h: 16, stages: 3}`` (0 or empty = default);
    a 4th field ``h`` adds ``f16: True`` (fp16 wgmma operands), ``b`` ``f16: False``, ``w``
    ``few_ws: True`` (the warp-specialized few-heads kernel), ``W`` the same on its persistent
    grid (``persist: True``); ``1`` / ``2``
    / ``3`` is the many-heads kernel's variant (``HEADS_VARIANTS``); after ``w`` / ``W`` or ``3``
    a 5th field 0 or 1 is the producer's ``idx_ahead`` (``IDX_AHEAD``; 0: the ids of 8 blocks
    at once into shared memory, 1: one block ahead); after ``w`` / ``W`` and a 5th field, a 6th
    ``p`` adds ``deq_prefetch: True`` (the dequant partition loads each group's bytes one group
    ahead)."""
    if not text:
        return {}
    parts = text.split(":")
    extra = parts[3] if len(parts) >= 4 else None
    ahead = parts[4] if len(parts) >= 5 else None
    prefetch = parts[5] if len(parts) == 6 else None
    if (len(parts) not in (3, 4, 5, 6)
            or extra not in (None, "h", "b", "w", "W", *map(str, HEADS_VARIANTS))
            or (ahead is not None
                and (extra not in ("w", "W", "3") or ahead not in ("0", "1")))
            or (prefetch is not None and (extra not in ("w", "W") or prefetch != "p"))):
        raise ValueError(f"launch shape {text!r}: expected num_warps:block_h:stages"
                         "[:h|:b|:w|:W|:1|:2|:3] (after :w, :W or :3 optionally :0|:1, the "
                         "slot-id lead, 0 = preloaded; after :w / :W and a lead optionally :p, "
                         "the dequant prefetch)")
    nw, bh, st = (int(x) for x in parts[:3])
    out = {k: v for k, v in (("num_warps", nw), ("block_h", bh), ("stages", st)) if v}
    if extra in ("h", "b"):
        out["f16"] = extra == "h"
    elif extra in ("w", "W"):
        out["few_ws"] = True
        if extra == "W":
            out["persist"] = True
    elif extra is not None:
        out["variant"] = int(extra)
    if ahead is not None:
        out["idx_ahead"] = int(ahead)
    if prefetch is not None:
        out["deq_prefetch"] = True
    return out


def default_block_h(H: int, num_warps: int = 4) -> int:
    """Head tiles of 8/16/32 heads (at least 16 with 8 warps: 8 per warpgroup)."""
    bh = 8 if H <= 8 else 16 if H <= 16 else 32
    return max(bh, 16) if num_warps == 8 else bh


def default_shape(T: int, H: int, total_width: int, slots: int, num_warps: int = 4):
    """(block_h, num_splits): ``default_block_h``; splits fill at most one wave of ``slots``
    resident CTAs (``ctas_per_sm`` times the SMs)."""
    bh = default_block_h(H, num_warps)
    return bh, default_splits(T, cdiv(H, bh), total_width, slots)


def default_splits(T: int, head_tiles: int, total_width: int, slots: int) -> int:
    """Key splits that fill at most one wave of ``slots`` resident CTAs (64-key blocks, at
    most 32)."""
    progs = T * head_tiles
    splits = 1
    if progs < slots:
        splits = max(1, min(slots // progs, cdiv(max(total_width, 1), 64), 32))
    return splits


def ctas_per_sm(stages: int, num_warps: int, block_h: int, a, b) -> int:
    """Resident CTAs per SM of the few-heads kernel: two with one ring stage, 4 warps and
    8-head tiles (<= 113 KB of shared memory, 255 registers x 128 threads) unless 584 records
    meet 528/288 ones (8 byte tiles and the RoPE ring: 117 KB); one otherwise (~180-225 KB)."""
    srcs = {a.src} | ({b.src} if b is not None else set())
    mixed = 584 in srcs and len(srcs) > 1
    return 2 if (stages, num_warps, block_h) == (1, 4, 8) and not mixed else 1


def few_ws_block_h(block_h: int, a, b) -> int:
    """The warp-specialized few-heads kernel's head tile: 16 where asked and its shared memory
    fits (not for 584 records mixed with 528 ones: 8 byte tiles and the RoPE ring per stage
    leave room for 8-head Q and P tiles only), else 8."""
    srcs = {a.src} | ({b.src} if b is not None else set())
    return 16 if block_h >= 16 and not {584, 528} <= srcs else 8


#: the last launch's compiled kernel and (block_h, splits) (benchmarks read registers)
LAST_LAUNCH = {}


def launch(q: torch.Tensor, a, b, sink: Optional[torch.Tensor], softmax_scale: float,
           out: torch.Tensor, lse: torch.Tensor, block_h: Optional[int] = None,
           num_splits: Optional[int] = None, stages: Optional[int] = None,
           num_warps: Optional[int] = None, f16: Optional[bool] = None,
           prior: bool = False) -> None:
    """Run the Gluon decode on validated arguments (``a``/``b``: ``KeySet``s of decode.py).
    ``prior``: out / lse hold a normalized partial of other keys (bf16, natural lse, +inf =
    none) to merge in; it runs the warp-specialized few-heads kernel (8- or 16-head tiles),
    unsplit."""
    if not AVAILABLE:
        raise RuntimeError(f"gluon decode unavailable: {REASON}")
    from .._launch import kernel_args, merge_splits
    from .decode import _sparse_mla_decode_gluon_kernel

    T, H, _ = q.shape
    if T == 0 or H == 0:
        return
    width = a.indices.shape[1] + (b.indices.shape[1] if b is not None else 0)
    over = (OVERRIDE or parse_shape(os.environ.get("DSV41_GLUON_SHAPE", ""))
            or parse_shape(table_shape(T, H, a, b, q.device) or ""))
    if prior and not over.get("few_ws") and b is None:
        # one key set: the few-heads shape picked for a pair of the same records
        pair = parse_shape(table_shape(T, H, a, a, q.device) or "")
        over = {**pair, **over} if pair.get("few_ws") else over
    nw = num_warps or over.get("num_warps") or 4
    stages = stages or over.get("stages") or 3
    bh = block_h or over.get("block_h") or default_block_h(H, nw)
    slots = _sms(q.device) * ctas_per_sm(stages, nw, bh, a, b)
    ns = default_shape(T, H, width, slots, nw)[1]
    bb = b if b is not None else a
    flags = dict(SRC_A=a.src, SRC_B=bb.src, HAS_B=b is not None, HAS_LEN_A=a.lens is not None,
                 HAS_LEN_B=bb.lens is not None, HAS_SINK=sink is not None)
    qk_scale = float(softmax_scale) * 1.4426950408889634  # log2(e): the kernels use exp2
    ahead = over.get("idx_ahead", IDX_AHEAD)
    if prior:
        bh = min(bh, 16)
        num_splits = 1
    if (over.get("few_ws") and bh != 64) or prior:
        # the warp-specialized few-heads kernel: 8- or 16-head tiles, two ring stages, two key
        # tiles (~210-227 KB of shared memory: one CTA per SM)
        from .decode_few_ws import MMA_WARPS, _sparse_mla_decode_few_ws_kernel
        bh = few_ws_block_h(bh, a, b)
        stages, nt = 2, 2
        n_ht = cdiv(H, bh)
        sms = _sms(q.device)
        ns = num_splits or default_splits(T, n_ht, width, sms)
        args, po, pl, sink_arg, sink_st = kernel_args(q, a, b, sink, out, lse, ns)
        items = T * ns * n_ht
        persist = bool(over.get("persist", PRIOR_PERSIST if prior
                                else DECODE_PERSIST and items > sms))
        grid = (min(sms, items),) if persist else (items,)
        srcs = {a.src, bb.src}
        mode = over.get("mode", 0)
        if (over.get("ds", FEW_DS and prior) and persist and bh == 8 and mode == 0
                and len(srcs) == 1 and 288 not in srcs):
            # the dequant + S form: persistent, two stages and tiles by construction
            from .decode_few_ds import _sparse_mla_decode_few_ds_kernel as kern
            f16 = bool(over.get("ds_f16", FEW_DS_F16))
            kind, form = "few_ds", dict(MODE=over.get("dsmode", 0), F16=f16,
                                        FREE_SPLIT=int(over.get("ds_split", FEW_DS_FREE_SPLIT)),
                                        PV_SYNC=bool(over.get("ds_pvsync", FEW_DS_PV_SYNC)),
                                        S_MASK=bool(over.get("ds_smask", FEW_DS_S_MASK)))
            if f16 and a.src == 584:
                # the bf16 P of the RoPE group takes the preload's shared memory
                ahead = int(over.get("ds_ahead", FEW_DS_F16_AHEAD))
        else:
            kern, kind = _sparse_mla_decode_few_ws_kernel, "few_ws"
            form = dict(NS=stages, NT=nt, PERSIST=persist, MODE=mode)
        k = kern[grid](
            *args, H, qk_scale, ns, n_ht, items, **flags, SPLIT=ns > 1, BH=bh,
            IDX_AHEAD=ahead, DEQ_PREFETCH=over.get("deq_prefetch", DEQ_PREFETCH), PRIOR=prior,
            **form, num_warps=MMA_WARPS.value)
        LAST_LAUNCH["fwd"] = (k, (bh, ns, MMA_WARPS.value, stages, kind))
        LAST_LAUNCH["persist"] = persist
    elif bh == 64:
        # the many-heads kernel: 64-head tiles, two warpgroups (the warp-specialized variant: a
        # producer partition besides), two ring stages (shared memory)
        nw, stages = 8, 2
        n_ht = cdiv(H, 64)
        ns = num_splits or default_splits(T, n_ht, width, _sms(q.device))
        args, po, pl, sink_arg, sink_st = kernel_args(q, a, b, sink, out, lse, ns)
        overlap = HEADS_VARIANTS.get(over.get("variant"), HEADS_OVERLAP)
        grid = (T * ns * n_ht,)
        if overlap == "ws":
            from .decode_heads_ws import _sparse_mla_decode_heads_ws_kernel
            if ahead == 0 and {a.src, bb.src} == {584, 528}:
                ahead = 1  # the preload's 2 KB of shared memory do not fit beside both rings
            k = _sparse_mla_decode_heads_ws_kernel[grid](
                *args, H, qk_scale, ns, n_ht, **flags, SPLIT=ns > 1, NS=stages,
                IDX_AHEAD=ahead, num_warps=nw)
        else:
            from .decode_heads import _sparse_mla_decode_heads_kernel
            k = _sparse_mla_decode_heads_kernel[grid](
                *args, H, qk_scale, ns, n_ht, **flags, SPLIT=ns > 1, NS=stages, OVERLAP=overlap,
                num_warps=nw)
        LAST_LAUNCH["heads_overlap"] = overlap
        LAST_LAUNCH["fwd"] = (k, (bh, ns, nw, stages))
    else:
        if nw == 8:
            bh = max(bh, 16)  # two warpgroups split the heads: at least 8 each
        ns = num_splits or ns
        f16 = bool(over.get("f16", False)) if f16 is None else f16
        f16 = f16 and f16_supported(a, b)
        n_ht = cdiv(H, bh)
        args, po, pl, sink_arg, sink_st = kernel_args(q, a, b, sink, out, lse, ns)
        k = _sparse_mla_decode_gluon_kernel[(T * ns * n_ht,)](
            *args, H, qk_scale, ns, n_ht, **flags,
            SPLIT=ns > 1, BH=bh, NS=stages, NW=nw, F16=f16, num_warps=nw)
        LAST_LAUNCH["fwd"] = (k, (bh, ns, nw, stages, "f16" if f16 else "bf16"))
    if ns > 1:
        merge_splits(po, pl, sink, sink_arg, sink_st, out, lse, ns, sw=False)


__all__ = ["PICK", "ENV", "OVERRIDE", "usable", "pick", "launch", "default_block_h",
           "default_shape", "default_splits", "HEADS_SHAPE", "HEADS_WS_SHAPE", "FEW_WS_SHAPE",
           "FEW_WS16_SHAPE", "few_ws_block_h", "HEADS_OVERLAP", "IDX_AHEAD", "DEQ_PREFETCH",
           "HEADS_VARIANTS", "f16_supported", "heads_bucket", "tokens_bucket", "table_shape",
           "parse_shape", "TESTED_SHAPES", "ctas_per_sm", "PRIOR_PERSIST", "FEW_DS",
           "DECODE_PERSIST"]
