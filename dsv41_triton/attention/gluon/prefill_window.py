"""The shared-window partial of the few-heads prefill for Hopper in Gluon: ``prefill_wsp.py``'s
persistent three-warpgroup kernel over tiles of consecutive tokens.

A work item is a tile of ``sparse_mla_prefill_shared_window``'s tiles (``BH // HP`` consecutive
tokens of one request, ``HP = next_power_of_2(H)``): its 64 wgmma rows are (token ``t0 + r //
HP``, head ``r % HP``), its keys the union of its tokens' window row ranges ``[lo, lo + n)``
(ids ``lo + column``, no index row), and row ``r`` sees only its token's range (a per-row band
on the scores). The result is the tl window kernel's (``_shared_window_kernel.py``): each
token's normalized partial over its window rows in out, its natural lse in lse (``+inf``: no
rows), no sink; ``sparse_mla_prefill_shared_window``'s top-k kernel merges it (its prior).
Partitions, barriers and phases are ``prefill_wsp.py``'s (items renumber the block pairs).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ._api import async_load, barrier
from .prefill_ws import (BH, BN, CONSUMER_REGS, NUM_WARPS, O_L, ROW_S, _consumer_pair,
                         _consumer_rows, _fill_pairs)

__all__ = ["NUM_WARPS", "_shared_window_gluon_kernel"]

INT_MAX = gl.constexpr(2147483647)


@gluon.jit
def _tile(item, tiles_ptr, ws_ptr, ws_st, wl_ptr, wl_st, HP: gl.constexpr, L: gl.constexpr):
    """(first token as int64, token count, union start ``lo``, union length ``n``, and per row
    ``r`` in layout ``L`` its band ``[lo_c, hi_c)`` of union columns) of tile ``item``."""
    t0 = gl.load(tiles_ptr + 2 * item).to(gl.int64)
    nt = gl.load(tiles_ptr + 2 * item + 1)
    r = gl.arange(0, BH, layout=L)
    j = r // HP
    tok = t0 + j.to(gl.int64)
    live = j < nt
    ws = gl.load(ws_ptr + tok * ws_st, mask=live, other=0).to(gl.int32)
    wl = gl.load(wl_ptr + tok * wl_st, mask=live, other=0).to(gl.int32)
    has = live & (wl > 0)
    lo = gl.min(gl.where(has, ws, INT_MAX), axis=0)
    hi = gl.max(gl.where(has, ws + wl, -INT_MAX), axis=0)
    n = gl.where(lo < hi, hi - lo, 0)
    lo = gl.where(lo < hi, lo, 0)
    lo_c = gl.where(has, ws - lo, 0)
    hi_c = gl.where(has, ws + wl - lo, 0)
    return t0, nt, lo, n, lo_c, hi_c


@gluon.jit
def _producer(pid, grid, num_items, tiles_ptr, ws_ptr, ws_st, wl_ptr, wl_st, q_ptr, stride_qt,
              stride_qh, kv_ptr, kv_stride, rows, H, q_smem, ring, q_ready, q_free, ready, free,
              HP: gl.constexpr):
    """4 warps: per tile, its Q rows once both consumers freed Q, then the union's blocks into
    the ring as ``prefill_wsp._producer``."""
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    rq = gl.arange(0, BH, layout=gl.SliceLayout(1, LC))
    d = gl.arange(0, 256, layout=gl.SliceLayout(0, LC))
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, LC))
    g = 0
    k = 0
    for item in range(pid, num_items, grid):
        t0, nt, lo, n, lo_c, hi_c = _tile(item, tiles_ptr, ws_ptr, ws_st, wl_ptr, wl_st, HP,
                                          gl.SliceLayout(1, LC))
        q_off = gl.multiple_of((t0 + (rq // HP).to(gl.int64)) * stride_qt
                               + (rq % HP).to(gl.int64) * stride_qh, 8)
        qm = (rq % HP < H) & (rq // HP < nt)
        mbarrier.wait(q_free, (k & 1) ^ 1)
        for h in gl.static_range(2):
            async_load(q_smem.index(0).slice(256 * h, 256, dim=1),
                       q_ptr + q_off[:, None] + (256 * h + d)[None, :],
                       mask=qm[:, None], eviction_policy="evict_first")
        cp.mbarrier_arrive(q_ready, increment_count=False)
        npair = gl.cdiv(n, 2 * BN)
        _fill_pairs(kv_ptr, kv_stride, rows, kv_ptr, n, npair, g, r, d, ring, ready, free, True,
                    lo)
        g += npair
        k += 1


@gluon.jit
def _consumer(C: gl.constexpr, pid, grid, num_items, tiles_ptr, ws_ptr, ws_st, wl_ptr, wl_st,
              rows, H, qk_scale, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
              q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free, m_bar, p_bar,
              l_bar, HP: gl.constexpr):
    """One consumer warpgroup (``prefill_wsp._consumer`` over tiles, the band on the scores)."""
    g = 0
    k = 0
    for item in range(pid, num_items, grid):
        t0, nt, lo, n, lo_c, hi_c = _tile(item, tiles_ptr, ws_ptr, ws_st, wl_ptr, wl_st, HP,
                                          ROW_S)
        npair = gl.cdiv(n, 2 * BN)
        m_i = gl.full([BH], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.full([BH], 0.0, gl.float32, layout=ROW_S)
        o = gl.full([BH, 256], 0.0, gl.float32, layout=O_L)
        mbarrier.wait(q_ready, k & 1)
        barrier()
        mbarrier.arrive(q_free, pred=npair == 0)
        for i in range(npair):
            m_i, l_i, o = _consumer_pair(C, i, (g + i) & 1, i == npair - 1, n, ws_ptr, rows,
                                         qk_scale, q_smem, ring, p_smem, m_smem, ready, free,
                                         m_bar, p_bar, q_free, m_i, l_i, o, True, True, lo,
                                         lo_c, hi_c)
        g += npair
        lb = k & 1
        _consumer_rows(C, l_i, m_i, o, t0, 0, H, lse_ptr, 0, out_ptr, stride_ot, stride_oh,
                       lse_ptr, stride_lt, stride_lh, l_smem.index(lb),
                       l_bar.index(2 * lb + C), l_bar.index(2 * lb + 1 - C), (k >> 1) & 1,
                       False, HP, nt)
        k += 1


@gluon.jit
def _shared_window_gluon_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, kv_stride, rows,
    ws_ptr, ws_st, wl_ptr, wl_st, tiles_ptr, num_items,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    H, qk_scale,
    HP: gl.constexpr,
):
    """q ``[T, H, 512]`` bf16 (16-byte aligned rows); kv ``[rows, 512]`` bf16; win_start /
    win_len ``[T]`` int; tiles ``[num_items, 2]`` int32 (first token, count <= ``64 // HP``);
    out ``[T, H, 512]`` bf16, lse ``[T, H]`` fp32; ``qk_scale`` = scale * log2(e). Launch
    ``min(SMs, num_items)`` CTAs with ``num_warps=NUM_WARPS`` (12 warps run)."""
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
    mbarrier.init(q_ready, count=128)
    mbarrier.init(q_free, count=2)
    for s in gl.static_range(4):
        mbarrier.init(ready.index(s), count=128)
    mbarrier.init(free.index(0), count=1)
    mbarrier.init(free.index(1), count=2)
    mbarrier.init(free.index(2), count=2)
    mbarrier.init(free.index(3), count=1)
    for s in gl.static_range(2):
        mbarrier.init(m_bar.index(s), count=1)
        mbarrier.init(p_bar.index(s), count=1)
    for s in gl.static_range(4):
        mbarrier.init(l_bar.index(s), count=1)

    gl.warp_specialize([
        (_producer, (pid, grid, num_items, tiles_ptr, ws_ptr, ws_st, wl_ptr, wl_st, q_ptr,
                     stride_qt, stride_qh, kv_ptr, kv_stride, rows, H, q_smem, ring, q_ready,
                     q_free, ready, free, HP)),
        (_consumer, (0, pid, grid, num_items, tiles_ptr, ws_ptr, ws_st, wl_ptr, wl_st, rows, H,
                     qk_scale, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
                     q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free, m_bar,
                     p_bar, l_bar, HP)),
        (_consumer, (1, pid, grid, num_items, tiles_ptr, ws_ptr, ws_st, wl_ptr, wl_st, rows, H,
                     qk_scale, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
                     q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free, m_bar,
                     p_bar, l_bar, HP)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
