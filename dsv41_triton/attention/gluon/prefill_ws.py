"""Warp-specialized sparse MLA prefill for Hopper in Gluon: ``sparse_mla_prefill``'s contract.

Same contract, grid and results as ``prefill.py`` (one CTA = one query token x a 64-head
tile, 64-key blocks, exp2 online softmax, the sink in the epilogue); the work is split over
three warpgroups by ``gl.warp_specialize`` and synchronized by ``mbarrier``s only:

* **producer** (the default partition, 4 warps, 72 registers): cp.async of Q, then per block
  pair the four value-dim halves (``[64 keys, 256]``, 1 KB rows as 16-byte copies, invalid
  columns zero-filled) of ring stages 0 (even block) and 1 (odd block), each once its readers
  freed it; each thread's ``cp.async.mbarrier.arrive.noinc`` completes the half's ``ready``
  barrier when its copies landed.
* **consumer 0** (worker, 4 warps, 216 registers) owns the even blocks and value dims
  ``0..255``, **consumer 1** the odd blocks and value dims ``256..511``; each computes the full
  ``S [64 heads, 64 keys]`` of its block (``HGMMA.64x64x16``, Q resident). Per block pair the
  running max is handed 0 -> 1 -> 0 through shared memory (consumer 1 starts from consumer 0's
  new max, consumer 0 rescales its P and O to consumer 1's); each consumer accumulates
  ``O[:, its dims] += P_own V_own`` (P from registers) ``+ P_other V_other`` (P from the other
  consumer's shared tile). Row sums are per consumer and added in the epilogue.

QK of one consumer runs while the other does its softmax / PV (ping-pong), the producer's
copies of the next pair while both compute. No CTA-wide barrier in the loop.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ._api import async_load, barrier
from .common import _finish_rows, row_store_layout

BN = gl.constexpr(64)
BH = gl.constexpr(64)
#: warps of the default partition (the producer); each consumer warpgroup adds 4
NUM_WARPS = 4
#: registers per thread of each consumer (setmaxnreg; the producer keeps the rest: 72)
CONSUMER_REGS = gl.constexpr(216)
#: a consumer's layouts: S ``[BH, BN]`` and O ``[BH, 256]`` wgmma accumulators, P as the PV's
#: register operand, O's rows, S's rows and columns
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                             instr_shape=[16, 64, 16]))
O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                             instr_shape=[16, 256, 16]))
P_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2))
ROW_O = gl.constexpr(gl.SliceLayout(1, O_L))
ROW_S = gl.constexpr(gl.SliceLayout(1, S_L))
COL_S = gl.constexpr(gl.SliceLayout(0, S_L))
#: O's rows for the store (8 consecutive columns a thread: 16-byte stores)
O_ST = gl.constexpr(row_store_layout(256, [[16, 0], [32, 0]]))



@gluon.jit
def _producer(q_ptr, stride_qt, stride_qh, kv_ptr, kv_stride, rows, idx_ptr, idx_st, n, t, ht,
              H, q_smem, ring, q_bar, ready, free):
    """4 warps: Q, then every block's rows into the ring (stage ``j % 2``) in value-dim halves
    (``ready`` / ``free`` index ``2 * stage + half``), each half as soon as its readers freed
    it: per block pair the halves go (0, 0), (1, 1), (0, 1), (1, 0), the order they free up."""
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    idx_row = idx_ptr + t * idx_st
    hq = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, LC))
    d = gl.arange(0, 256, layout=gl.SliceLayout(0, LC))
    q_off = gl.multiple_of(t * stride_qt + hq.to(gl.int64) * stride_qh, 8)
    for h in gl.static_range(2):
        async_load(q_smem.index(0).slice(256 * h, 256, dim=1),
                   q_ptr + q_off[:, None] + (256 * h + d)[None, :],
                   mask=(hq < H)[:, None], eviction_policy="evict_first")
    cp.mbarrier_arrive(q_bar, increment_count=False)
    npair = gl.cdiv(n, 2 * BN)
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, LC))
    _fill_pairs(kv_ptr, kv_stride, rows, idx_row, n, npair, 0, r, d, ring, ready, free)


@gluon.jit
def _pair_ids(idx_row, n, i, r):
    """Block pair ``i``'s ids as stored (even block's, odd block's; ``r``: a block's 64 row
    offsets; ``-1`` past ``n``)."""
    c0 = (2 * i) * BN + r
    c1 = c0 + BN
    ix0 = gl.load(idx_row + c0, mask=c0 < n, other=-1)
    ix1 = gl.load(idx_row + c1, mask=c1 < n, other=-1)
    return ix0, ix1


@gluon.jit
def _row_offsets(ix, rows, kv_stride):
    """Ids as stored -> (element offsets of their rows, 0 where skipped; kept: ``0 <= id <
    rows``)."""
    j = ix.to(gl.int64)
    ok = (j >= 0) & (j < rows)
    return gl.multiple_of(gl.where(ok, j * kv_stride, 0), 8), ok


@gluon.jit
def _fill_pairs(kv_ptr, kv_stride, rows, idx_row, n, npair, g, r, d, ring, ready, free,
                BAND: gl.constexpr = False, base=0):
    """Block pairs ``0 .. npair - 1`` of one item (``g``: pairs this CTA filled before it, for
    the ``free`` phases) into ring stages 0 (even block) and 1 (odd block), each pair's halves
    in the order they free up: (0, 0), (1, 1), (0, 1), (1, 0); each pair's ids loaded just
    before its first wait. ``BAND``: the ids are the rows ``base, base + 1, ..`` (no index
    row)."""
    for i in range(npair):
        ph = ((g + i) & 1) ^ 1
        if BAND:
            c0 = (2 * i) * BN + r
            ix0 = gl.where(c0 < n, base + c0, -1)
            ix1 = gl.where(c0 + BN < n, base + c0 + BN, -1)
        else:
            ix0, ix1 = _pair_ids(idx_row, n, i, r)
        off0, ok0 = _row_offsets(ix0, rows, kv_stride)
        off1, ok1 = _row_offsets(ix1, rows, kv_stride)
        _fill(kv_ptr, off0, ok0, d, ring, ready, free, 0, 0, ph)
        _fill(kv_ptr, off1, ok1, d, ring, ready, free, 1, 1, ph)
        _fill(kv_ptr, off0, ok0, d, ring, ready, free, 0, 1, ph)
        _fill(kv_ptr, off1, ok1, d, ring, ready, free, 1, 0, ph)


@gluon.jit
def _fill(kv_ptr, off, ok, d, ring, ready, free, S: gl.constexpr, HF: gl.constexpr, ph):
    """Value-dim half ``HF`` of the rows at element offsets ``off`` (``ok``: copy, else zero
    fill) into ring stage ``S`` once it is free; its ``ready`` barrier completes when every
    producer thread's copies landed."""
    mbarrier.wait(free.index(2 * S + HF), ph)
    async_load(ring.index(S).slice(256 * HF, 256, dim=1),
               kv_ptr + off[:, None] + (256 * HF + d)[None, :],
               mask=ok[:, None], eviction_policy="evict_last")
    cp.mbarrier_arrive(ready.index(2 * S + HF), increment_count=False)


@gluon.jit
def _qk_half(q_smem, kt, ready, S: gl.constexpr, HF: gl.constexpr, ph, acc,
             FIRST: gl.constexpr):
    """Issues ``acc (+)= Q[:, half] K[half]^T`` of ring stage ``S`` (``kt``), value-dim half
    ``HF``, once that half has landed (``ready`` phase ``ph``); returns the async
    accumulator (``FIRST``: ``acc`` only gives the layout)."""
    mbarrier.wait(ready.index(2 * S + HF), ph)
    fence_async_shared()
    return warpgroup_mma(q_smem.slice(256 * HF, 256, dim=1),
                         kt.slice(256 * HF, 256, dim=1).permute((1, 0)), acc,
                         use_acc=not FIRST, is_async=True)


@gluon.jit
def _qk(q_smem, kt, ready, C: gl.constexpr, ph, s_zero):
    """``S = Q K^T`` of stage ``C`` over both value-dim halves, own half (``C``) first, each
    issued as soon as it has landed; waited."""
    acc = _qk_half(q_smem, kt, ready, C, C, ph, s_zero, True)
    acc = _qk_half(q_smem, kt, ready, C, 1 - C, ph, acc, False)
    return warpgroup_mma_wait(0, deps=[acc])


@gluon.jit
def _block_ok(C: gl.constexpr, i, n, idx_row, rows, BAND: gl.constexpr = False, base=0):
    """Column validity of consumer ``C``'s block of pair ``i`` in the S accumulator's column
    layout ``COL_S``: loaded one column a thread pair and moved there (the load's latency
    hides behind the QK product); ``BAND``: the ids are the rows ``base + column``."""
    IL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    # (+ i >> 30, i.e. 0: keeps the column pointers from being hoisted to the kernel's entry,
    # where they stay live in every partition and make ptxas spill)
    c = (2 * i + C) * BN + (gl.arange(0, BN, layout=IL) + (i >> 30))
    cm = c < n
    if BAND:
        ci = base + c
    else:
        ci = gl.load(idx_row + c, mask=cm, other=-1)
    return gl.convert_layout(cm & (ci >= 0) & (ci < rows), COL_S)


@gluon.jit
def _pair_max(C: gl.constexpr, sc, ok, qk_scale, m_i, m_smem, m_bar, ph):
    """Masked (``ok``: ``[1 or BH, BN]``), scaled logits of consumer ``C``'s block and the
    running max after them, handed 0 -> 1 (consumer 1 starts from consumer 0's new max;
    ``m_smem[C * BH:]`` holds ``C``'s)."""
    sc = gl.where(ok, sc * qk_scale, float("-inf"))
    if C == 0:
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        m_smem.slice(0, BH).store(m_new)
        barrier()
        mbarrier.arrive(m_bar.index(0))
    else:
        mbarrier.wait(m_bar.index(0), ph)
        m_new = gl.maximum(m_smem.slice(0, BH).load(ROW_S), gl.max(sc, axis=1))
        m_smem.slice(BH, BH).store(m_new)
        barrier()
        mbarrier.arrive(m_bar.index(1))
    return sc, m_new


@gluon.jit
def _pair_probs(sc, m_i, m_new, l_i, o):
    """Online-softmax step: ``(m_safe, l_i, o, P as bf16)`` with O and the row sums rescaled
    from ``m_i`` to ``m_new`` (``-inf`` rows stay 0)."""
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(sc - m_safe[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    o = o * gl.convert_layout(alpha, ROW_O)[:, None]
    return m_safe, l_i, o, p.to(gl.bfloat16)


@gluon.jit
def _scale_to_max1(m_new, m_safe, m_smem, m_bar, ph):
    """Consumer 0: consumer 1's max of the pair (``m_bar[1]`` phase ``ph``) and the factor
    that moves consumer 0's P, O and row sums from ``m_new`` to it."""
    mbarrier.wait(m_bar.index(1), ph)
    m_1 = m_smem.slice(BH, BH).load(ROW_S)
    m1_safe = gl.where(m_1 == float("-inf"), 0.0, m_1)
    scale = gl.where(m_new == float("-inf"), 0.0, gl.exp2(m_safe - m1_safe))
    return m_1, scale


@gluon.jit
def _pair_views(C: gl.constexpr, i, ring):
    """Consumer ``C``'s views of pair ``i``'s ring: ``(opaque, own stage, own value dims of
    the own stage, own value dims of the other stage)``. ``opaque`` (``i >> 30``, i.e. 0)
    indexes Q and the stages through a value the compiler cannot fold: the wgmma descriptors
    are then formed in the loop instead of hoisted (and spilled) out of it."""
    opaque = i >> 30
    mine = ring.index(C + opaque)
    other = ring.index(1 - C + opaque)
    return opaque, mine, mine.slice(256 * C, 256, dim=1), other.slice(256 * C, 256, dim=1)


@gluon.jit
def _consumer_pair(C: gl.constexpr, i, ph, last, n, idx_row, rows, qk_scale, q_smem, ring,
                   p_smem, m_smem, ready, free, m_bar, p_bar, q_free, m_i, l_i, o,
                   FREES_Q: gl.constexpr, BAND: gl.constexpr = False, base=0, lo_c=0, hi_c=0):
    """Consumer ``C``'s share of block pair ``i`` (barrier phase ``ph``): the QK of its own
    block, the running max handed 0 -> 1 -> 0, P (its own from registers, the other's from
    shared memory) times its value dims; frees the ring halves as it is done with them (and,
    with ``FREES_Q``, Q after the QK of the ``last`` pair). ``BAND``: keys are the rows ``base
    + column`` and row ``r`` sees only the columns ``lo_c[r] <= c < hi_c[r]`` (``[BH]`` int32,
    ``ROW_S``). Returns ``(m_i, l_i, o)``."""
    s_zero = gl.full([BH, BN], 0.0, gl.float32, layout=S_L)
    opaque, mine, v_mine, v_other = _pair_views(C, i, ring)
    ok = _block_ok(C, i, n, idx_row, rows, BAND, base)
    sc = _qk(q_smem.index(opaque), mine, ready, C, ph, s_zero)
    barrier()
    if FREES_Q:
        mbarrier.arrive(q_free, pred=last)  # the item's last QK: Q free
    mbarrier.arrive(free.index(2 * C + 1 - C))  # the other half of my stage: QK done
    if BAND:
        c = (2 * i + C) * BN + gl.arange(0, BN, layout=COL_S)
        ok2 = ok[None, :] & (c[None, :] >= lo_c[:, None]) & (c[None, :] < hi_c[:, None])
    else:
        ok2 = ok[None, :]
    sc, m_new = _pair_max(C, sc, ok2, qk_scale, m_i, m_smem, m_bar, ph)
    m_safe, l_i, o, pb = _pair_probs(sc, m_i, m_new, l_i, o)
    o = warpgroup_mma(gl.convert_layout(pb, P_A), v_mine, o, is_async=True)
    if C == 0:
        # consumer 1's max covers both blocks: P and the state move to it
        m_1, scale = _scale_to_max1(m_new, m_safe, m_smem, m_bar, ph)
        # (from the bf16 P: the fp32 one is dead once the local PV is issued)
        p_smem.index(0).store((pb.to(gl.float32) * scale[:, None]).to(gl.bfloat16))
        fence_async_shared()
        barrier()
        mbarrier.arrive(p_bar.index(0))
        o = warpgroup_mma_wait(0, deps=[o])
        o = o * gl.convert_layout(scale, ROW_O)[:, None]
        l_i = l_i * scale
        m_i = m_1
    else:
        p_smem.index(1).store(pb)
        fence_async_shared()
        barrier()
        mbarrier.arrive(p_bar.index(1))
        o = warpgroup_mma_wait(0, deps=[o])
        m_i = m_new
    barrier()
    mbarrier.arrive(free.index(2 * C + C))  # my half of my stage: local PV done
    mbarrier.wait(p_bar.index(1 - C), ph)
    o = warpgroup_mma(p_smem.index(1 - C), v_other, o, is_async=True)
    o = warpgroup_mma_wait(0, deps=[o])
    barrier()
    mbarrier.arrive(free.index(2 * (1 - C) + C))  # my half of the other stage
    return m_i, l_i, o


@gluon.jit
def _consumer_rows(C: gl.constexpr, l_i, m_i, o, t, ht, H, sink_ptr, sink_st, out_ptr, stride_ot,
                   stride_oh, lse_ptr, stride_lt, stride_lh, l_buf, l_mine, l_other, ph,
                   HAS_SINK: gl.constexpr, HP: gl.constexpr, nt):
    """Consumer ``C``'s rows of one (token ``t``, head tile ``ht``): its row sums handed to the
    other consumer through ``l_buf`` (``[2 * BH]`` fp32; ``l_mine`` / ``l_other``: the two
    mbarriers, ``ph`` the other's phase), the sink (``_finish_rows``), lse (consumer 0) and its
    256 value dims of the output. Row ``r`` is token ``t + r // HP`` (of ``nt``), head ``ht *
    BH + r % HP``: ``HP = BH``, ``nt = 1`` for one token's head tile, ``HP`` heads a token for
    the window kernel's tile of tokens (``prefill_window.py``)."""
    l_buf.slice(BH * C, BH).store(l_i)
    barrier()
    mbarrier.arrive(l_mine)
    mbarrier.wait(l_other, ph)
    l_tot = l_i + l_buf.slice(BH * (1 - C), BH).load(ROW_S)
    r = gl.arange(0, BH, layout=ROW_S)
    h = ht * BH + r % HP
    hmask = (h < H) & (r // HP < nt)
    tr = t + (r // HP).to(gl.int64)
    h64 = h.to(gl.int64)
    inv, lse = _finish_rows(l_tot, m_i, h64, hmask, sink_ptr, sink_st, HAS_SINK)
    if C == 0:
        gl.store(lse_ptr + tr * stride_lt + h64 * stride_lh, lse, mask=hmask)
    do = 256 * C + gl.arange(0, 256, layout=gl.SliceLayout(0, O_ST))
    v = gl.convert_layout((o * gl.convert_layout(inv, ROW_O)[:, None]).to(gl.bfloat16), O_ST)
    ro = gl.arange(0, BH, layout=gl.SliceLayout(1, O_ST))
    ho = ht * BH + ro % HP
    om = (ho < H) & (ro // HP < nt)
    orow = (t + (ro // HP).to(gl.int64)) * stride_ot + ho.to(gl.int64) * stride_oh
    op = out_ptr + orow[:, None] + do[None, :]
    gl.store(op, v, mask=om[:, None], cache_modifier=".cs")


@gluon.jit
def _consumer(C: gl.constexpr, idx_ptr, idx_st, n, rows, t, ht, H, qk_scale,
              sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
              q_smem, ring, p_smem, m_smem, l_smem, q_bar, ready, free, m_bar, p_bar, l_bar,
              HAS_SINK: gl.constexpr):
    """One consumer warpgroup: blocks ``j % 2 == C``, value dims ``256 C .. 256 C + 255``.
    Frees (``free[2 * stage + half]``): the other half of its own stage after its QK, its own
    half of its own stage after its local PV, its half of the other stage after the remote
    PV."""
    idx_row = idx_ptr + t * idx_st
    npair = gl.cdiv(n, 2 * BN)

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=ROW_S)
    l_i = gl.full([BH], 0.0, gl.float32, layout=ROW_S)
    o = gl.full([BH, 256], 0.0, gl.float32, layout=O_L)

    mbarrier.wait(q_bar, 0)
    for i in range(npair):
        m_i, l_i, o = _consumer_pair(C, i, i & 1, i == npair - 1, n, idx_row, rows, qk_scale,
                                     q_smem, ring, p_smem, m_smem, ready, free, m_bar, p_bar,
                                     q_bar, m_i, l_i, o, False)

    _consumer_rows(C, l_i, m_i, o, t, ht, H, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh,
                   lse_ptr, stride_lt, stride_lh, l_smem, l_bar.index(C), l_bar.index(1 - C),
                   0, HAS_SINK, BH, 1)


@gluon.jit
def _consumer0(idx_ptr, idx_st, n, rows, t, ht, H, qk_scale, sink_ptr, sink_st, out_ptr,
               stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, q_smem, ring, p_smem,
               m_smem, l_smem, q_bar, ready, free, m_bar, p_bar, l_bar, HAS_SINK: gl.constexpr):
    _consumer(0, idx_ptr, idx_st, n, rows, t, ht, H, qk_scale, sink_ptr, sink_st, out_ptr,
              stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, q_smem, ring, p_smem,
              m_smem, l_smem, q_bar, ready, free, m_bar, p_bar, l_bar, HAS_SINK)


@gluon.jit
def _consumer1(idx_ptr, idx_st, n, rows, t, ht, H, qk_scale, sink_ptr, sink_st, out_ptr,
               stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, q_smem, ring, p_smem,
               m_smem, l_smem, q_bar, ready, free, m_bar, p_bar, l_bar, HAS_SINK: gl.constexpr):
    _consumer(1, idx_ptr, idx_st, n, rows, t, ht, H, qk_scale, sink_ptr, sink_st, out_ptr,
              stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, q_smem, ring, p_smem,
              m_smem, l_smem, q_bar, ready, free, m_bar, p_bar, l_bar, HAS_SINK)


@gluon.jit
def _sparse_mla_prefill_gluon_ws_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, kv_stride, rows,
    idx_ptr, idx_st, width, len_ptr, len_st,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    H, qk_scale, num_ht,
    HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, LAZY: gl.constexpr,
):
    """Arguments as ``prefill._sparse_mla_prefill_gluon_kernel`` (``LAZY`` is ignored: the
    rescale is eager); launch with ``num_warps=NUM_WARPS`` (12 warps run)."""
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 512], gl.bfloat16)
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 512], gl.bfloat16)
    PL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BN], gl.bfloat16)
    VL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    pid = gl.program_id(0)
    ht = pid % num_ht
    t = (pid // num_ht).to(gl.int64)
    if HAS_LEN:
        n = gl.load(len_ptr + t * len_st).to(gl.int32)
        n = gl.minimum(gl.maximum(n, 0), width)
    else:
        n = width + 0

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BH, 512], QL)
    ring = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 512], KL)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BH, BN], PL)
    m_smem = gl.allocate_shared_memory(gl.float32, [2 * BH], VL)
    l_smem = gl.allocate_shared_memory(gl.float32, [2 * BH], VL)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    m_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    l_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=128)  # every producer thread, cp.async noinc arrive
    # ring stage k // 2, value dims 256 (k % 2) ..: filled by every producer thread (cp.async
    # noinc arrive); read by its stage's consumer, and by the other one too where the half is
    # the other's value dims
    for k in gl.static_range(4):
        mbarrier.init(ready.index(k), count=128)
    mbarrier.init(free.index(0), count=1)
    mbarrier.init(free.index(1), count=2)
    mbarrier.init(free.index(2), count=2)
    mbarrier.init(free.index(3), count=1)
    for s in gl.static_range(2):
        mbarrier.init(m_bar.index(s), count=1)
        mbarrier.init(p_bar.index(s), count=1)
        mbarrier.init(l_bar.index(s), count=1)

    cargs = (idx_ptr, idx_st, n, rows, t, ht, H, qk_scale, sink_ptr, sink_st, out_ptr,
             stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, q_smem, ring, p_smem,
             m_smem, l_smem, q_bar, ready, free, m_bar, p_bar, l_bar, HAS_SINK)
    gl.warp_specialize([
        (_producer, (q_ptr, stride_qt, stride_qh, kv_ptr, kv_stride, rows, idx_ptr, idx_st, n,
                     t, ht, H, q_smem, ring, q_bar, ready, free)),
        (_consumer0, cargs),
        (_consumer1, cargs),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
