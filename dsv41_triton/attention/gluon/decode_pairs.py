"""Many-heads sparse MLA decode for Hopper on the prefill's block-pair schedule, in Gluon.

``sparse_mla_decode``'s contract for 64-head tiles (the results of ``decode_heads.py``), run the
way the persistent prefill (``prefill_wsp.py``) runs: ``min(SMs, items)`` CTAs loop over the
work items (token ``item // num_ht`` x head tile ``item % num_ht``), three warpgroups:

* **producer** (the default partition, 4 warps): per item Q by ``cp.async`` once both
  consumers freed it, then per block pair the four value-dim halves (``[64 keys, 256]`` bf16)
  of ring stages 0 (even block) and 1 (odd block) in the order they free up. For one half it
  loads the raw record bytes and scale bytes of the block's 64 keys from global memory into
  registers (zero where a key is not read), waits for the half to be free, dequantizes them
  exactly (``dequant._convert_group``), stores them, fences and arrives on the half's
  ``ready`` (count 1). The loads are issued before the wait, so their latency passes in it.
* **consumers 0 / 1** (4 warps each): ``prefill_ws._consumer_pair`` per block pair (consumer
  ``C`` owns block ``2 i + C``'s QK and value dims ``256 C ..``; the max handed 0 -> 1 -> 0,
  P through shared memory) with the key validity of the block's slot ids
  (``gather._load_idx``), then ``_consumer_rows`` (sink, lse, the output rows).

Barriers, counts and phases are ``prefill_wsp.py``'s (its table) except ``ready``: one arrive
of the producer after its stores. Keys are the window's (cache ``a``, blocks below
``nblk_a``) then the extra ones (cache ``b``); a block past the last is zero-filled and masked.
Shared memory: Q 64 KB, two 64 KB ring stages, P 16 KB: one CTA per SM.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from .dequant import _convert_group
from .gather import _copy_layout, _key_ranges, _load_idx, _record_offsets
from .prefill_ws import (BH, BN, COL_S, O_L, ROW_S, _consumer_pair,
                         _consumer_rows)

__all__ = ["NUM_WARPS", "_sparse_mla_decode_pairs_kernel"]

#: warps of the default partition (the producer); each consumer warpgroup adds 4
NUM_WARPS = 4
#: registers per consumer thread (setmaxnreg; the producer keeps the rest)
PAIRS_CONSUMER_REGS = gl.constexpr(192)
#: the producer's copy layout: 16 bytes a thread, 4 threads per key row, 4 warps
PW = gl.constexpr(4)


@gluon.jit
def _load_group_global(g: gl.constexpr, base, valid, data_off, scale_off, SRC: gl.constexpr):
    """Group ``g`` (64 dims) of 64 keys' ``SRC`` records from global memory, in the layouts of
    ``dequant._load_group`` (``_convert_group``'s input); zero where ``valid`` is false
    (584: group 7 is the raw bf16 RoPE tail)."""
    L16: gl.constexpr = _copy_layout(16, PW)
    if SRC == 288:
        L8: gl.constexpr = _copy_layout(8, PW)
        do = gl.convert_layout(data_off, gl.SliceLayout(1, L8))
        vm = gl.convert_layout(valid, gl.SliceLayout(1, L8))
        c8 = gl.arange(0, 32, layout=gl.SliceLayout(0, L8))
        raw = gl.load(base + (do + 32 * g)[:, None] + c8[None, :], mask=vm[:, None], other=0)
        raw = gl.reshape(raw, [64, 4, 8])
        SL: gl.constexpr = gl.SliceLayout(2, raw.type.layout)
        so = gl.convert_layout(scale_off, gl.SliceLayout(1, SL))
        vs = gl.convert_layout(valid, gl.SliceLayout(1, SL))
        c4 = gl.arange(0, 4, layout=gl.SliceLayout(0, SL))
        sb = gl.load(base + (so + 4 * g)[:, None] + c4[None, :], mask=vs[:, None], other=0)
    elif SRC == 584 and g == 7:
        c16 = gl.arange(0, 64, layout=gl.SliceLayout(0, L16))
        rp = (base + (data_off + 448)).to(gl.pointer_type(gl.bfloat16))
        raw = gl.load(rp[:, None] + c16[None, :], mask=valid[:, None], other=0.0)
        sb = raw
    else:
        c16 = gl.arange(0, 64, layout=gl.SliceLayout(0, L16))
        raw = gl.load(base + (data_off + 64 * g)[:, None] + c16[None, :], mask=valid[:, None],
                      other=0)
        if SRC == 584:
            sb = gl.load(gl.expand_dims(base + (scale_off + g), 1),
                         mask=gl.expand_dims(valid, 1), other=0)
        else:
            raw = gl.reshape(raw, [64, 2, 32])
            SL2: gl.constexpr = gl.SliceLayout(2, raw.type.layout)
            so = gl.convert_layout(scale_off, gl.SliceLayout(1, SL2))
            vs = gl.convert_layout(valid, gl.SliceLayout(1, SL2))
            c2 = gl.arange(0, 2, layout=gl.SliceLayout(0, SL2))
            sb = gl.load(base + (so + 2 * g)[:, None] + c2[None, :], mask=vs[:, None], other=0)
    return raw, sb


@gluon.jit
def _store_group(g: gl.constexpr, raw, sb, dst, SRC: gl.constexpr):
    """Group ``g``'s bf16 values into its 64 columns of the ring stage ``dst``."""
    dst.slice(64 * g, 64, dim=1).store(_convert_group(g, raw, sb, SRC, PW))


@gluon.jit
def _load_half(base, idx, bstride, page, HF: gl.constexpr, SRC: gl.constexpr):
    """The raw bytes and scale bytes of value-dim half ``HF`` (groups ``4 HF .. 4 HF + 3``) of
    one block (slot ids ``idx`` of ``SRC`` records) in registers: four (raw, scale) pairs."""
    valid, data_off, scale_off = _record_offsets(idx, bstride, page, SRC)
    g0: gl.constexpr = 4 * HF
    ra, sa = _load_group_global(g0, base, valid, data_off, scale_off, SRC)
    rb, sb = _load_group_global(g0 + 1, base, valid, data_off, scale_off, SRC)
    rc, sc = _load_group_global(g0 + 2, base, valid, data_off, scale_off, SRC)
    rd, sd = _load_group_global(g0 + 3, base, valid, data_off, scale_off, SRC)
    return ra, sa, rb, sb, rc, sc, rd, sd


@gluon.jit
def _store_half(ra, sa, rb, sb, rc, sc, rd, sd, dst, ready, free, H2: gl.constexpr,
                HF: gl.constexpr, ph, SRC: gl.constexpr):
    """``_load_half``'s registers into ring stage ``dst`` once ``free[H2]`` (phase ``ph``)
    passes, then one arrive on ``ready[H2]``."""
    g0: gl.constexpr = 4 * HF
    mbarrier.wait(free.index(H2), ph)
    _store_group(g0, ra, sa, dst, SRC)
    _store_group(g0 + 1, rb, sb, dst, SRC)
    _store_group(g0 + 2, rc, sc, dst, SRC)
    _store_group(g0 + 3, rd, sd, dst, SRC)
    fence_async_shared()
    gl.thread_barrier()  # every producer thread's stores precede the one arrive
    mbarrier.arrive(ready.index(H2))


@gluon.jit
def _two_halves(xb, xi, xs, xp, yb, yi, ys, yp, ring, ready, free, SX: gl.constexpr,
                HX: gl.constexpr, SY: gl.constexpr, HY: gl.constexpr, ph,
                SRC_X: gl.constexpr, SRC_Y: gl.constexpr):
    """Two halves (block x's half ``HX`` into stage ``SX``, block y's half ``HY`` into ``SY``):
    both halves' loads first, so that their latencies overlap each other and the waits."""
    x = _load_half(xb, xi, xs, xp, HX, SRC_X)
    y = _load_half(yb, yi, ys, yp, HY, SRC_Y)
    _store_half(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], ring.index(SX), ready, free,
                2 * SX + HX, HX, ph, SRC_X)
    _store_half(y[0], y[1], y[2], y[3], y[4], y[5], y[6], y[7], ring.index(SY), ready, free,
                2 * SY + HY, HY, ph, SRC_Y)


@gluon.jit
def _fill_two(k, ix0, ix1, HX: gl.constexpr, ph, nblk_a, a_ptr, a_bstride, a_page, b_ptr,
              b_bstride, b_page, ring, ready, free, SRC_A: gl.constexpr, SRC_B: gl.constexpr,
              HAS_B: gl.constexpr):
    """Half ``HX`` of block ``k`` (ids ``ix0``) into stage 0 and half ``1 - HX`` of block
    ``k + 1`` (``ix1``) into stage 1: window records below ``nblk_a``, else the extra ones (a
    block past the last has no valid id: zeros)."""
    HY: gl.constexpr = 1 - HX
    if HAS_B:
        if k + 1 < nblk_a:
            _two_halves(a_ptr, ix0, a_bstride, a_page, a_ptr, ix1, a_bstride, a_page, ring,
                        ready, free, 0, HX, 1, HY, ph, SRC_A, SRC_A)
        elif k >= nblk_a:
            _two_halves(b_ptr, ix0, b_bstride, b_page, b_ptr, ix1, b_bstride, b_page, ring,
                        ready, free, 0, HX, 1, HY, ph, SRC_B, SRC_B)
        else:
            _two_halves(a_ptr, ix0, a_bstride, a_page, b_ptr, ix1, b_bstride, b_page, ring,
                        ready, free, 0, HX, 1, HY, ph, SRC_A, SRC_B)
    else:
        _two_halves(a_ptr, ix0, a_bstride, a_page, a_ptr, ix1, a_bstride, a_page, ring, ready,
                    free, 0, HX, 1, HY, ph, SRC_A, SRC_A)


@gluon.jit
def _item(item, num_ht, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st, b_width,
          HAS_B: gl.constexpr, HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr):
    """(token as int64, head tile, ``_key_ranges``' six values) of a work item."""
    ht = item % num_ht
    t = (item // num_ht).to(gl.int64)
    lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _key_ranges(
        t, 0, 1, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st, b_width, HAS_B, HAS_LEN_A,
        HAS_LEN_B, False)
    return t, ht, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk


@gluon.jit
def _producer(pid, grid, num_items, num_ht, q_ptr, stride_qt, stride_qh,
              a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride, a_page,
              a_rows, b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride,
              b_page, b_rows, H, q_smem, ring, q_ready, q_free, ready, free,
              SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
              HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr):
    """4 warps: per item Q, then every block pair's halves in the order (0, 0), (1, 1), (0, 1),
    (1, 0) (``prefill_ws._fill_pairs``'), the pair's slot ids loaded once."""
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    LI: gl.constexpr = gl.SliceLayout(1, _copy_layout(16, PW))
    hh = gl.arange(0, BH, layout=gl.SliceLayout(1, LC))
    d = gl.arange(0, 256, layout=gl.SliceLayout(0, LC))
    g = 0
    k = 0
    for item in range(pid, num_items, grid):
        t, ht, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _item(
            item, num_ht, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st, b_width, HAS_B,
            HAS_LEN_A, HAS_LEN_B)
        hq = ht * BH + hh
        q_off = gl.multiple_of(t * stride_qt + hq.to(gl.int64) * stride_qh, 8)
        mbarrier.wait(q_free, (k & 1) ^ 1)
        for h in gl.static_range(2):
            cp.async_copy_global_to_shared(q_smem.index(0).slice(256 * h, 256, dim=1),
                                           q_ptr + q_off[:, None] + (256 * h + d)[None, :],
                                           mask=(hq < H)[:, None], eviction_policy="evict_first")
        cp.mbarrier_arrive(q_ready, increment_count=False)
        a_idx_row = a_idx_ptr + t * a_idx_st
        b_idx_row = b_idx_ptr + t * b_idx_st
        npair = gl.cdiv(nblk, 2)
        for i in range(npair):
            ph = ((g + i) & 1) ^ 1
            k0 = 2 * i
            ix0 = _load_idx(k0, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row, lo_b,
                            hi_b, b_rows, HAS_B, LI)
            ix1 = _load_idx(k0 + 1, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row,
                            lo_b, hi_b, b_rows, HAS_B, LI)
            # (0, 0) and (1, 1) first, then (0, 1) and (1, 0): the order they free up
            _fill_two(k0, ix0, ix1, 0, ph, nblk_a, a_ptr, a_bstride, a_page, b_ptr, b_bstride,
                      b_page, ring, ready, free, SRC_A, SRC_B, HAS_B)
            _fill_two(k0, ix0, ix1, 1, ph, nblk_a, a_ptr, a_bstride, a_page, b_ptr, b_bstride,
                      b_page, ring, ready, free, SRC_A, SRC_B, HAS_B)
        g += npair
        k += 1


@gluon.jit
def _block_valid(k, r, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row, lo_b, hi_b,
                 b_rows, HAS_B):
    """Which keys ``r`` of block ``k`` are read (``gather._load_idx(...) >= 0``), written so that
    ``HAS_B`` may be a runtime value (a worker partition's flags are): the two caches' ids
    may differ in width, so they are compared, not merged."""
    ca = lo_a + k * 64 + r
    ia = gl.load(a_idx_row + ca, mask=(ca < hi_a) & (k < nblk_a), other=-1)
    ok = (ia >= 0) & (ia < a_rows)
    if HAS_B:
        cb = lo_b + (k - nblk_a) * 64 + r
        ib = gl.load(b_idx_row + cb, mask=(cb < hi_b) & (k >= nblk_a) & (k < nblk), other=-1)
        ok = ok | ((ib >= 0) & (ib < b_rows))
    return ok


@gluon.jit
def _consumer(C: gl.constexpr, pid, grid, num_items, num_ht, a_idx_ptr, a_idx_st, a_len_ptr,
              a_len_st, a_width, a_rows, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width,
              b_rows, H, qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr,
              stride_lt, stride_lh, q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free,
              ready, free, m_bar, p_bar, l_bar, HAS_B: gl.constexpr, HAS_LEN_A: gl.constexpr,
              HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr):
    """One consumer warpgroup (``prefill_wsp._consumer``'s loop) over the CTA's items; a
    block's key validity from its checked slot ids (loaded before its QK)."""
    IL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    g = 0
    k = 0
    for item in range(pid, num_items, grid):
        t, ht, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _item(
            item, num_ht, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st, b_width, HAS_B,
            HAS_LEN_A, HAS_LEN_B)
        a_idx_row = a_idx_ptr + t * a_idx_st
        b_idx_row = b_idx_ptr + t * b_idx_st
        npair = gl.cdiv(nblk, 2)
        m_i = gl.full([BH], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.full([BH], 0.0, gl.float32, layout=ROW_S)
        o = gl.full([BH, 256], 0.0, gl.float32, layout=O_L)

        mbarrier.wait(q_ready, k & 1)
        # an item without keys reads no Q: hand it back at once (after every warp's wait)
        gl.thread_barrier()
        mbarrier.arrive(q_free, pred=npair == 0)
        for i in range(npair):
            ok = _block_valid(2 * i + C, gl.arange(0, BN, layout=IL), nblk_a, nblk, a_idx_row,
                              lo_a, hi_a, a_rows, b_idx_row, lo_b, hi_b, b_rows, HAS_B)
            ok = gl.convert_layout(ok, COL_S)
            m_i, l_i, o = _consumer_pair(C, i, (g + i) & 1, i == npair - 1, ok, qk_scale,
                                         q_smem, ring, p_smem, m_smem, ready, free, m_bar,
                                         p_bar, q_free, m_i, l_i, o, True)
        g += npair

        lb = k & 1
        _consumer_rows(C, l_i, m_i, o, t, ht, H, sink_ptr, sink_st, out_ptr, stride_ot,
                       stride_oh, lse_ptr, stride_lt, stride_lh, l_smem.index(lb),
                       l_bar.index(2 * lb + C), l_bar.index(2 * lb + 1 - C), (k >> 1) & 1,
                       HAS_SINK)
        k += 1


@gluon.jit
def _consumer0(pid, grid, num_items, num_ht, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width,
               a_rows, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_rows, H, qk_scale,
               sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
               q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free, m_bar,
               p_bar, l_bar, HAS_B: gl.constexpr, HAS_LEN_A: gl.constexpr,
               HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr):
    _consumer(0, pid, grid, num_items, num_ht, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st,
              a_width, a_rows, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_rows, H,
              qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
              stride_lh, q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free,
              m_bar, p_bar, l_bar, HAS_B, HAS_LEN_A, HAS_LEN_B, HAS_SINK)


@gluon.jit
def _consumer1(pid, grid, num_items, num_ht, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width,
               a_rows, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_rows, H, qk_scale,
               sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
               q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free, m_bar,
               p_bar, l_bar, HAS_B: gl.constexpr, HAS_LEN_A: gl.constexpr,
               HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr):
    _consumer(1, pid, grid, num_items, num_ht, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st,
              a_width, a_rows, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_rows, H,
              qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
              stride_lh, q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free,
              m_bar, p_bar, l_bar, HAS_B, HAS_LEN_A, HAS_LEN_B, HAS_SINK)


@gluon.jit
def _sparse_mla_decode_pairs_kernel(
    q_ptr, stride_qt, stride_qh,
    a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows,
    b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride, b_page, b_rows,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    po_ptr, pl_ptr,
    H, qk_scale, num_splits, num_ht, num_items,
    SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
    HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr,
):
    """Arguments as ``decode_heads_ws._sparse_mla_decode_heads_ws_kernel``'s (``num_splits`` 1;
    ``po_ptr`` / ``pl_ptr`` unused) plus ``num_items`` (= tokens x ``num_ht``); launch
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
    mbarrier.init(q_ready, count=128)  # every producer thread, cp.async noinc arrive
    mbarrier.init(q_free, count=2)  # each consumer once per item
    for s in gl.static_range(4):
        mbarrier.init(ready.index(s), count=1)  # the producer, after its stores
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

    cargs = (pid, grid, num_items, num_ht, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width,
             a_rows, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_rows, H, qk_scale,
             sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
             q_smem, ring, p_smem, m_smem, l_smem, q_ready, q_free, ready, free, m_bar, p_bar,
             l_bar, HAS_B, HAS_LEN_A, HAS_LEN_B, HAS_SINK)
    gl.warp_specialize([
        (_producer, (pid, grid, num_items, num_ht, q_ptr, stride_qt, stride_qh,
                     a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride,
                     a_page, a_rows, b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width,
                     b_bstride, b_page, b_rows, H, q_smem, ring, q_ready, q_free, ready, free,
                     SRC_A, SRC_B, HAS_B, HAS_LEN_A, HAS_LEN_B)),
        (_consumer0, cargs),
        (_consumer1, cargs),
    ], [4, 4], [PAIRS_CONSUMER_REGS, PAIRS_CONSUMER_REGS])
