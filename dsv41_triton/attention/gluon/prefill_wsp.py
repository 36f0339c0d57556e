"""Persistent warp-specialized sparse MLA prefill for Hopper in Gluon (variant ``"wsp"``).

``prefill_ws.py``'s three warpgroups and per-pair recipe (producer gathering the value-dim
halves of two ring stages, consumer 0 on the even blocks / value dims ``0..255``, consumer 1 on
the odd blocks / ``256..511``, max handed 0 -> 1 -> 0, P exchanged through shared memory), but
the grid is ``min(SMs, items)`` CTAs and each CTA loops over the work items ``item = pid + k *
grid`` (``k = 0, 1, ...``; item = token ``item // num_ht`` x head tile ``item % num_ht``): a
static stride, no atomics, CUDA-graph safe. The producer runs ahead across item boundaries: it
refills the one Q buffer as soon as both consumers' last QK of an item has finished, and the
ring blocks of the next item flow without a break while the consumers finish the last PVs and
the epilogue of the previous one. Per item the arithmetic is ``"ws"``'s (same blocks in the
same order, same epilogue ``_finish_rows``); items with no keys write 0 / +inf rows.

Phase bookkeeping (``mbarrier.wait(bar, p)`` returns once the phase of parity ``p`` has
completed: a fresh barrier passes ``p = 1`` at once). Every partition derives the same two
counters from the same ``lens``: ``k`` = items this CTA has done, ``g`` = block pairs this CTA
has done over all earlier items (``npair = cdiv(n, 128)`` per item, 0 for an empty item).

=========  =====  ====================  ==============================  ====================
barrier    count  completes              waited by (parity)              arrived by
=========  =====  ====================  ==============================  ====================
q_ready    128    once per item k        consumers: ``k & 1``            producer threads,
                                                                         cp.async noinc
q_free     2      once per item k        producer before Q of item k:    each consumer once:
                                         ``(k & 1) ^ 1`` (k=0 passes)    after its QK of the
                                                                         last pair, or right
                                                                         after q_ready when
                                                                         npair = 0
ready[s]   128    once per pair g        consumers: ``g & 1``            producer, noinc
free[s]    1 / 2  once per pair g        producer: ``(g & 1) ^ 1``       consumers (as ws)
m_bar[c]   1      once per pair g        the other consumer: ``g & 1``   consumer c
p_bar[c]   1      once per pair g        the other consumer: ``g & 1``   consumer c
l_bar[b,c] 1      once per item with     the other consumer:             consumer c
                  ``k & 1 == b``         ``(k >> 1) & 1``
=========  =====  ====================  ==============================  ====================

No barrier can run two phases ahead of a waiter: every arrive that completes phase ``x + 1``
is ordered (through a chain of waits) after every waiter of phase ``x`` has passed, and every
consumer arrive follows a warpgroup ``thread_barrier`` placed after all its warps' waits (one
thread arrives for the warpgroup). The row-sum exchange is double-buffered by item parity
(``l_smem[k & 1]``, ``l_bar[k & 1]``): with empty items between them the two consumers are not
otherwise ordered, and with one buffer consumer c could overwrite its sum of item k before the
other read it; with two, consumer c reaches item k + 2 only after the other consumer arrived
for item k + 1, i.e. after it read item k's sum. The ring, max and P exchanges keep ``ws``'s
per-pair argument unchanged (each waits on the other partition's arrive of the same pair;
items only renumber the pairs).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ._api import async_load, barrier
from .prefill_ws import (BH, BN, CONSUMER_REGS, NUM_WARPS, O_L, ROW_S, _consumer_pair,
                         _consumer_rows, _fill_pairs)

__all__ = ["NUM_WARPS", "_sparse_mla_prefill_gluon_wsp_kernel"]


@gluon.jit
def _item(item, num_ht, len_ptr, len_st, width, HAS_LEN: gl.constexpr):
    """(token as int64, head tile, key count clamped to ``[0, width]``) of a work item."""
    ht = item % num_ht
    t = (item // num_ht).to(gl.int64)
    if HAS_LEN:
        n = gl.load(len_ptr + t * len_st).to(gl.int32)
        n = gl.minimum(gl.maximum(n, 0), width)
    else:
        n = width + 0
    return t, ht, n


@gluon.jit
def _producer(pid, grid, num_items, num_ht, width, len_ptr, len_st, q_ptr, stride_qt,
              stride_qh, kv_ptr, kv_stride, rows, idx_ptr, idx_st, H, q_smem, ring, q_ready,
              q_free, ready, free, HAS_LEN: gl.constexpr):
    """4 warps: per item, Q once both consumers freed it, then the item's blocks into the ring
    as ``prefill_ws._producer`` does (phases from the CTA's running pair count ``g``)."""
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    hh = gl.arange(0, BH, layout=gl.SliceLayout(1, LC))
    d = gl.arange(0, 256, layout=gl.SliceLayout(0, LC))
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, LC))
    g = 0
    k = 0
    for item in range(pid, num_items, grid):
        t, ht, n = _item(item, num_ht, len_ptr, len_st, width, HAS_LEN)
        hq = ht * BH + hh
        q_off = gl.multiple_of(t * stride_qt + hq.to(gl.int64) * stride_qh, 8)
        mbarrier.wait(q_free, (k & 1) ^ 1)
        for h in gl.static_range(2):
            async_load(q_smem.index(0).slice(256 * h, 256, dim=1),
                       q_ptr + q_off[:, None] + (256 * h + d)[None, :],
                       mask=(hq < H)[:, None], eviction_policy="evict_first")
        cp.mbarrier_arrive(q_ready, increment_count=False)
        idx_row = idx_ptr + t * idx_st
        npair = gl.cdiv(n, 2 * BN)
        _fill_pairs(kv_ptr, kv_stride, rows, idx_row, n, npair, g, r, d, ring, ready, free)
        g += npair
        k += 1


@gluon.jit
def _consumer(C: gl.constexpr, pid, grid, num_items, num_ht, width, len_ptr, len_st, idx_ptr,
              idx_st, rows, H, qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh,
              lse_ptr, stride_lt, stride_lh, q_smem, ring, p_smem, m_smem, l_smem, q_ready,
              q_free, ready, free, m_bar, p_bar, l_bar, HAS_LEN: gl.constexpr,
              HAS_SINK: gl.constexpr):
    """One consumer warpgroup (``prefill_ws._consumer``'s per-pair work) over the CTA's items;
    the softmax state and O restart per item, the phases run on over the pair count ``g``."""

    g = 0
    k = 0
    for item in range(pid, num_items, grid):
        t, ht, n = _item(item, num_ht, len_ptr, len_st, width, HAS_LEN)
        idx_row = idx_ptr + t * idx_st
        npair = gl.cdiv(n, 2 * BN)
        m_i = gl.full([BH], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.full([BH], 0.0, gl.float32, layout=ROW_S)
        o = gl.full([BH, 256], 0.0, gl.float32, layout=O_L)

        mbarrier.wait(q_ready, k & 1)
        # an item without keys reads no Q: hand it back at once (after every warp's wait)
        barrier()
        mbarrier.arrive(q_free, pred=npair == 0)
        for i in range(npair):
            m_i, l_i, o = _consumer_pair(C, i, (g + i) & 1, i == npair - 1, n, idx_row, rows,
                                         qk_scale, q_smem, ring, p_smem, m_smem, ready, free,
                                         m_bar, p_bar, q_free, m_i, l_i, o, True)
        g += npair

        # ---- the item's rows: both consumers' row sums (buffer k & 1), sink, stores ------
        lb = k & 1
        _consumer_rows(C, l_i, m_i, o, t, ht, H, sink_ptr, sink_st, out_ptr, stride_ot,
                       stride_oh, lse_ptr, stride_lt, stride_lh, l_smem.index(lb),
                       l_bar.index(2 * lb + C), l_bar.index(2 * lb + 1 - C), (k >> 1) & 1,
                       HAS_SINK, BH, 1)
        k += 1


@gluon.jit
def _consumer0(pid, grid, num_items, num_ht, width, len_ptr, len_st, idx_ptr, idx_st, rows, H,
               qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
               stride_lh, q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free,
               m_bar, p_bar, l_bar, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr):
    _consumer(0, pid, grid, num_items, num_ht, width, len_ptr, len_st, idx_ptr, idx_st, rows,
              H, qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr,
              stride_lt, stride_lh, q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free,
              ready, free, m_bar, p_bar, l_bar, HAS_LEN, HAS_SINK)


@gluon.jit
def _consumer1(pid, grid, num_items, num_ht, width, len_ptr, len_st, idx_ptr, idx_st, rows, H,
               qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
               stride_lh, q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free,
               m_bar, p_bar, l_bar, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr):
    _consumer(1, pid, grid, num_items, num_ht, width, len_ptr, len_st, idx_ptr, idx_st, rows,
              H, qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr,
              stride_lt, stride_lh, q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free,
              ready, free, m_bar, p_bar, l_bar, HAS_LEN, HAS_SINK)


@gluon.jit
def _sparse_mla_prefill_gluon_wsp_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, kv_stride, rows,
    idx_ptr, idx_st, width, len_ptr, len_st,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    H, qk_scale, num_ht, num_items,
    HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, LAZY: gl.constexpr,
):
    """Arguments as ``prefill_ws._sparse_mla_prefill_gluon_ws_kernel`` plus ``num_items`` (=
    tokens x ``num_ht``); launch ``min(SMs, num_items)`` CTAs with ``num_warps=NUM_WARPS``
    (12 warps run). ``LAZY`` is ignored."""
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 512], gl.bfloat16)
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 512], gl.bfloat16)
    PL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BN], gl.bfloat16)
    VL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    pid = gl.program_id(0)
    grid = gl.num_programs(0)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BH, 512], QL)
    ring = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 512], KL)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BH, BN], PL)
    m_smem = gl.allocate_shared_memory(gl.float32, [2 * BH], VL)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, 2 * BH], VL)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    m_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=128)  # every producer thread, cp.async noinc arrive
    mbarrier.init(q_free, count=2)  # each consumer once per item
    for s in gl.static_range(4):
        mbarrier.init(ready.index(s), count=128)
    # readers of ring stage s // 2, value dims 256 (s % 2) ..: as prefill_ws
    mbarrier.init(free.index(0), count=1)
    mbarrier.init(free.index(1), count=2)
    mbarrier.init(free.index(2), count=2)
    mbarrier.init(free.index(3), count=1)
    for s in gl.static_range(2):
        mbarrier.init(m_bar.index(s), count=1)
        mbarrier.init(p_bar.index(s), count=1)
    for s in gl.static_range(4):
        mbarrier.init(l_bar.index(s), count=1)

    cargs = (pid, grid, num_items, num_ht, width, len_ptr, len_st, idx_ptr, idx_st, rows, H,
             qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
             stride_lh, q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free,
             m_bar, p_bar, l_bar, HAS_LEN, HAS_SINK)
    gl.warp_specialize([
        (_producer, (pid, grid, num_items, num_ht, width, len_ptr, len_st, q_ptr, stride_qt,
                     stride_qh, kv_ptr, kv_stride, rows, idx_ptr, idx_st, H, q_smem, ring,
                     q_ready, q_free, ready, free, HAS_LEN)),
        (_consumer0, cargs),
        (_consumer1, cargs),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
