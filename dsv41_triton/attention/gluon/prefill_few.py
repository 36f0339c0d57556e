"""Few-heads (H <= 8) sparse MLA prefill over the bf16 workspace for Hopper, keys as the wgmma M
(variant ``"few"``).

The many-heads kernels put the heads on the wgmma M (64 rows), so 8 heads pay 8x the products.
Here the block's keys are the M and the heads the N: ``S^T [64 keys, 8] = sum_g K_g Q_g^T`` over
the 8 dim groups, the online softmax down the keys, ``O^T_g [64 dims, 8] += K_g^T P^T``; a
block's 1 KB rows are the A operand of both products (``m64n8k16``).

Persistent and warp-specialized: ``min(SMs, T)`` CTAs with ``NS`` ring stages, or ``min(2 SMs,
T)`` with one stage each (``prefill_launch.few_ctas_per_sm``: two independent product chains per
SM); CTA ``pid`` takes tokens ``pid, pid + grid, ...`` (its ``k``-th token). Partitions:

* producer (default, 4 warps): token ``k + 2``'s index row by cp.async into index slot
  ``(k + 2) % 3``, token ``k``'s Q as 8 ``[8 heads, 64 dims]`` tiles into Q slot ``k % 2``,
  then each 64-key block's rows by cp.async into ring stage ``g % NS`` (8 ``[64, 64]`` tiles),
  the row addresses read from the index slot in shared memory.
* consumer (worker, 4 warps): per block the 8 S products, the softmax (validity from the index
  slot), ``P^T`` to shared memory, the 8 O products, then it frees the stage. ``PRIOR``: out /
  lse already hold a normalized partial of other keys for the token (bf16, natural lse, +inf =
  none), loaded before the key loop and merged after it. The epilogue is ``_finish_rows``
  (sink, empty rows 0 / +inf).

Barriers (``wait(bar, p)`` returns once the phase of parity ``p`` completed; a fresh barrier
passes ``p = 1``; the ``*_ready`` ones complete when all 128 producer threads' copies landed,
by cp.async's noinc arrive): ``ready[s]`` / ``free[s]`` per block ``g`` (use ``g // NS``),
``q_ready[k % 2]`` / ``q_free[k % 2]`` per token (use ``k // 2``; the consumer frees Q after the
token's last S, or at once when the token has no keys), ``i_ready[k % 3]`` / ``i_free[k % 3]``
per token (use ``k // 3``; both partitions wait ``i_ready``, the consumer frees it).
``MODE`` (benchmarks only): 1 times the copies alone (the consumer frees each stage unread), 2
the products alone (no row copies); 0 is the kernel.

``_sparse_mla_prefill_gluon_few_sync_kernel`` (not picked; ``perf/prefill_few_probe.py``): the
same producer with two ``mma.sync`` consumer warpgroups on alternate blocks, each with its own
softmax state, merged at the token's end; faster products alone, slower whole on the H200
(perf/NOTES.md, "Session 18"; a form whose two consumers split every block's dims was slower
still: "Session 20").
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ._api import async_load, barrier, reinterpret
from .common import _finish_rows, _load_sink, _merge_prior, _prior_group, _prior_tiles

__all__ = ["NUM_WARPS", "MAX_HEADS", "MAX_WIDTH", "NS", "TWO_CTAS_MAX_WIDTH", "index_blocks",
           "_sparse_mla_prefill_gluon_few_kernel"]

NUM_WARPS = 4
#: most heads (the wgmma N)
MAX_HEADS = 8
#: most index columns per token (3 index slots of ``index_blocks(K) * 64`` int32)
MAX_WIDTH = 4096
#: ring stages (64 KB each; 3 measured no faster)
NS = 2
#: most index columns at two CTAs per SM (one stage each: 3 index slots of 32 blocks fit twice)
TWO_CTAS_MAX_WIDTH = 2048
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                              instr_shape=[16, 8, 16]))
KM = gl.constexpr(gl.SliceLayout(1, MMA))  # keys (S^T rows) / dims (O^T rows)
HM = gl.constexpr(gl.SliceLayout(0, MMA))  # heads
#: [64, 64] bf16 row copies: a warp instruction covers 4 rows x 128 contiguous bytes (8 rows x
#: 64 bytes copied 12 % slower on an H100, perf/NOTES.md "Session 28")
LR = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
LQ = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # [8, 64] bf16 Q copies
LI = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0]))  # [WB, 64] int32, 4 B each
IDX_SLOTS = gl.constexpr(3)  # a token's index row is copied two tokens ahead


def index_blocks(width: int) -> int:
    """``WB``: 64-column blocks an index slot holds for ``width`` columns (a power of 2, >= 4)."""
    return max(4, 1 << max(0, -(-width // 64) - 1).bit_length())


@gluon.jit
def _token_len(item, T, len_ptr, len_st, width, HAS_LEN: gl.constexpr):
    """Columns token ``item`` reads (0 past ``T``)."""
    if HAS_LEN:
        n = gl.load(len_ptr + item.to(gl.int64) * len_st, mask=item < T, other=0).to(gl.int32)
        n = gl.minimum(gl.maximum(n, 0), width)
    else:
        n = width + 0
    return gl.where(item < T, n, 0)


@gluon.jit
def _consumer_token(item, grid, k, n_next, T, len_ptr, len_st, width, HAS_LEN: gl.constexpr):
    """A consumer's ``k``-th token ``item`` (its columns ``n_next``, read one token ahead):
    ``(t`` int64, ``n``, the next token's columns, ``nblk`` 64-key blocks, Q slot, index
    slot``)``."""
    t = item.to(gl.int64)
    n = n_next
    n_after = _token_len(item + grid, T, len_ptr, len_st, width, HAS_LEN)
    nblk = gl.cdiv(n, 64)
    return t, n, n_after, nblk, k % 2, k % IDX_SLOTS


@gluon.jit
def _copy_index_row(k, item, T, idx_ptr, idx_st, width, idx_smem, i_ready, i_free,
                    WB: gl.constexpr):
    """The CTA's ``k``-th token's index row (``item``) into slot ``k % IDX_SLOTS``."""
    if item < T:
        s = k % IDX_SLOTS
        mbarrier.wait(i_free.index(s), ((k // IDX_SLOTS) & 1) ^ 1)
        rb = gl.arange(0, WB, layout=gl.SliceLayout(1, LI))
        cb = gl.arange(0, 64, layout=gl.SliceLayout(0, LI))
        col = rb[:, None] * 64 + cb[None, :]
        async_load(idx_smem.index(s),
                   idx_ptr + item.to(gl.int64) * idx_st + col,
                   mask=col < width)
        cp.mbarrier_arrive(i_ready.index(s), increment_count=False)


@gluon.jit
def _producer(pid, grid, T, width, len_ptr, len_st, q_ptr, stride_qt, stride_qh, kv_ptr,
              kv_stride, rows, idx_ptr, idx_st, H, q_smem, ring, idx_smem, idx_rows, q_ready,
              q_free, i_ready, i_free, ready, free, HAS_LEN: gl.constexpr, NS: gl.constexpr,
              WB: gl.constexpr, MODE: gl.constexpr):
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, LR))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, LR))
    hq = gl.arange(0, 8, layout=gl.SliceLayout(1, LQ))
    dq = gl.arange(0, 64, layout=gl.SliceLayout(0, LQ))
    qmask = (hq < H)[:, None] & (dq < 64)[None, :]
    _copy_index_row(0, pid, T, idx_ptr, idx_st, width, idx_smem, i_ready, i_free, WB)
    _copy_index_row(1, pid + grid, T, idx_ptr, idx_st, width, idx_smem, i_ready, i_free, WB)
    n_next = _token_len(pid, T, len_ptr, len_st, width, HAS_LEN)
    g = 0
    k = 0
    for item in range(pid, T, grid):
        n = n_next
        n_next = _token_len(item + grid, T, len_ptr, len_st, width, HAS_LEN)
        _copy_index_row(k + 2, item + 2 * grid, T, idx_ptr, idx_st, width, idx_smem, i_ready,
                        i_free, WB)
        qs = k % 2
        mbarrier.wait(q_free.index(qs), ((k // 2) & 1) ^ 1)
        qrow = q_ptr + item.to(gl.int64) * stride_qt + hq.to(gl.int64)[:, None] * stride_qh
        for grp in gl.static_range(8):
            async_load(q_smem.index(qs * 8 + grp),
                       qrow + (grp * 64 + dq)[None, :], mask=qmask)
        cp.mbarrier_arrive(q_ready.index(qs), increment_count=False)
        si = k % IDX_SLOTS
        mbarrier.wait(i_ready.index(si), (k // IDX_SLOTS) & 1)
        for b in range(gl.cdiv(n, 64)):
            s = g % NS
            col = b * 64 + r
            ix = idx_rows.index(si * WB + b).load(gl.SliceLayout(1, LR))
            ok = (col < n) & (ix >= 0) & (ix < rows)
            off = gl.multiple_of(gl.where(ok, ix.to(gl.int64) * kv_stride, 0), 8)
            mbarrier.wait(free.index(s), ((g // NS) & 1) ^ 1)
            if MODE != 2:
                for grp in gl.static_range(8):
                    async_load(
                        ring.index(s * 8 + grp), kv_ptr + off[:, None] + (grp * 64 + c)[None, :],
                        mask=ok[:, None], eviction_policy="evict_last")
            cp.mbarrier_arrive(ready.index(s), increment_count=False)
            g += 1
        k += 1


@gluon.jit
def _cta_sink(sink_ptr, sink_st, h64, hmask, HAS_SINK: gl.constexpr):
    """The 8 heads' sink (every token's), loaded once per CTA before its token loop: loaded
    in each token's epilogue it cost a round trip there that nothing covered (0 without a
    sink)."""
    if HAS_SINK:
        return _load_sink(sink_ptr, sink_st, h64, hmask)
    else:
        return 0


@gluon.jit
def _consumer_consts(H, sink_ptr, sink_st, HAS_SINK: gl.constexpr, RL: gl.constexpr,
                     HL: gl.constexpr):
    """A consumer's per-CTA constants: ``(rows`` ``arange(64)`` in ``RL``, the 8 heads as int64
    in ``HL``, the live heads' mask, the ``[64, 8]`` store mask of the live heads, the sink row
    (``_cta_sink``)``)``."""
    r = gl.arange(0, 64, layout=RL)
    h = gl.arange(0, 8, layout=HL)
    hmask = h < H
    h64 = h.to(gl.int64)
    om = hmask[None, :] & (r >= 0)[:, None]
    return r, h64, hmask, om, _cta_sink(sink_ptr, sink_st, h64, hmask, HAS_SINK)


@gluon.jit
def _store_token(l_i, m_i, o0, o1, o2, o3, o4, o5, o6, o7, t, h64, hmask, orow, om, sink_ptr,
                 sink_st, lse_ptr, stride_lt, stride_lh, HAS_SINK: gl.constexpr, sink):
    """A token's epilogue: ``_finish_rows`` (the sink row ``sink``, loaded once per CTA by
    ``_cta_sink``; empty rows 0 / +inf), its lse and its 8 ``O^T [64 dims, 8 heads]`` tiles as
    bf16 at ``orow`` (``om``: live heads)."""
    inv, lse = _finish_rows(l_i, m_i, h64, hmask, sink_ptr, sink_st, HAS_SINK, True, sink)
    gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
    iv = inv[None, :]
    gl.store(orow + 0, (o0 * iv).to(gl.bfloat16), mask=om)
    gl.store(orow + 64, (o1 * iv).to(gl.bfloat16), mask=om)
    gl.store(orow + 128, (o2 * iv).to(gl.bfloat16), mask=om)
    gl.store(orow + 192, (o3 * iv).to(gl.bfloat16), mask=om)
    gl.store(orow + 256, (o4 * iv).to(gl.bfloat16), mask=om)
    gl.store(orow + 320, (o5 * iv).to(gl.bfloat16), mask=om)
    gl.store(orow + 384, (o6 * iv).to(gl.bfloat16), mask=om)
    gl.store(orow + 448, (o7 * iv).to(gl.bfloat16), mask=om)


@gluon.jit
def _token_slots(q_ready, i_ready, q_free, i_free, qs, si, k, hand_back):
    """A consumer's wait for its ``k``-th token's Q slot ``qs`` and index slot ``si``; both
    handed back at once when ``hand_back`` (a token without blocks of this consumer's)."""
    mbarrier.wait(q_ready.index(qs), (k // 2) & 1)
    mbarrier.wait(i_ready.index(si), (k // IDX_SLOTS) & 1)
    barrier()
    mbarrier.arrive(q_free.index(qs), pred=hand_back)
    mbarrier.arrive(i_free.index(si), pred=hand_back)


@gluon.jit
def _block_keys(idx_rows, row, b, n, rows, L: gl.constexpr):
    """Which of block ``b``'s 64 keys count (column ``< n``, id in ``[0, rows)``), in ``L``;
    ``row``: the block's row of the index slots."""
    kr = gl.arange(0, 64, layout=L)
    ix = idx_rows.index(row).load(L)
    return (b * 64 + kr < n) & (ix >= 0) & (ix < rows)


@gluon.jit
def _consumer(pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr, sink_st,
              out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, q_smem, ring,
              idx_rows, p_smem, q_ready, q_free, i_ready, i_free, ready, free,
              HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, NS: gl.constexpr,
              WB: gl.constexpr, MODE: gl.constexpr, PRIOR: gl.constexpr):
    zero = gl.full([64, 8], 0.0, gl.float32, layout=MMA)
    kr, h64, hmask, om, sink = _consumer_consts(H, sink_ptr, sink_st, HAS_SINK, KM, HM)
    n_next = _token_len(pid, T, len_ptr, len_st, width, HAS_LEN)
    g = 0
    k = 0
    for item in range(pid, T, grid):
        t, n, n_next, nblk, qs, si = _consumer_token(item, grid, k, n_next, T, len_ptr, len_st,
                                                     width, HAS_LEN)
        orow = out_ptr + t * stride_ot + h64[None, :] * stride_oh + kr[:, None]
        if PRIOR:  # issued before the key loop, merged after it
            lp = gl.load(lse_ptr + t * stride_lt + h64 * stride_lh, mask=hmask,
                         other=float("inf"))
            p0, p1, p2, p3, p4, p5, p6, p7 = _prior_tiles(orow, om)
        m_i = gl.full([8], float("-inf"), gl.float32, layout=HM)
        l_i = gl.full([8], 0.0, gl.float32, layout=HM)
        o0 = zero
        o1 = zero
        o2 = zero
        o3 = zero
        o4 = zero
        o5 = zero
        o6 = zero
        o7 = zero
        _token_slots(q_ready, i_ready, q_free, i_free, qs, si, k, nblk == 0)
        for b in range(nblk):
            s = g % NS
            ok = _block_keys(idx_rows, si * WB + b, b, n, rows, KM)
            base = s * 8 + (b >> 30)  # opaque 0: the descriptors stay in the loop
            qb = qs * 8 + (b >> 30)
            mbarrier.wait(ready.index(s), (g // NS) & 1)
            last = b == nblk - 1
            if MODE == 1:
                barrier()
                mbarrier.arrive(free.index(s))
                mbarrier.arrive(q_free.index(qs), pred=last)
                mbarrier.arrive(i_free.index(si), pred=last)
            else:
                fence_async_shared()
                acc = warpgroup_mma(ring.index(base), q_smem.index(qb).permute((1, 0)), zero,
                                    use_acc=False, is_async=True)
                for grp in gl.static_range(1, 8):
                    acc = warpgroup_mma(ring.index(base + grp),
                                        q_smem.index(qb + grp).permute((1, 0)), acc,
                                        is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                barrier()
                mbarrier.arrive(q_free.index(qs), pred=last)
                mbarrier.arrive(i_free.index(si), pred=last)
                sc = gl.where(ok[:, None], acc * qk_scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(sc, axis=0))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(sc - m_safe[None, :])
                l_i = l_i * alpha + gl.sum(p, axis=0)
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                barrier()
                a2 = alpha[None, :]
                o0 = warpgroup_mma(ring.index(base).permute((1, 0)), p_smem, o0 * a2,
                                   is_async=True)
                o1 = warpgroup_mma(ring.index(base + 1).permute((1, 0)), p_smem, o1 * a2,
                                   is_async=True)
                o2 = warpgroup_mma(ring.index(base + 2).permute((1, 0)), p_smem, o2 * a2,
                                   is_async=True)
                o3 = warpgroup_mma(ring.index(base + 3).permute((1, 0)), p_smem, o3 * a2,
                                   is_async=True)
                o4 = warpgroup_mma(ring.index(base + 4).permute((1, 0)), p_smem, o4 * a2,
                                   is_async=True)
                o5 = warpgroup_mma(ring.index(base + 5).permute((1, 0)), p_smem, o5 * a2,
                                   is_async=True)
                o6 = warpgroup_mma(ring.index(base + 6).permute((1, 0)), p_smem, o6 * a2,
                                   is_async=True)
                o7 = warpgroup_mma(ring.index(base + 7).permute((1, 0)), p_smem, o7 * a2,
                                   is_async=True)
                o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(
                    0, deps=[o0, o1, o2, o3, o4, o5, o6, o7])
                barrier()
                mbarrier.arrive(free.index(s))
                m_i = m_new
            g += 1
        if PRIOR:
            l_i, m_i, o0, o1, o2, o3, o4, o5, o6, o7 = _merge_prior(
                l_i, m_i, lp, o0, o1, o2, o3, o4, o5, o6, o7, p0, p1, p2, p3, p4, p5, p6, p7)
        _store_token(l_i, m_i, o0, o1, o2, o3, o4, o5, o6, o7, t, h64, hmask, orow, om,
                     sink_ptr, sink_st, lse_ptr, stride_lt, stride_lh, HAS_SINK, sink)
        k += 1


@gluon.jit
def _shared(NS: gl.constexpr, WB: gl.constexpr, TOKEN_FREES: gl.constexpr,
            STAGE_FREES: gl.constexpr):
    """The shared memory every form's producer fills, its barriers initialized (``q_free`` and
    ``i_free`` take ``TOKEN_FREES`` arrivals, ``free`` ``STAGE_FREES``): the ring ``[NS * 8, 64,
    64]``, two Q slots ``[2 * 8, 8, 64]``, the index slots ``[IDX_SLOTS, WB, 64]`` and the same
    bytes as one 64-index row per block."""
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, 64], gl.bfloat16)
    IL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [NS * 8, 64, 64], KL)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * 8, 8, 64], QL)
    idx_smem = gl.allocate_shared_memory(gl.int32, [IDX_SLOTS, WB, 64], IL)
    idx_rows = reinterpret(idx_smem, gl.int32, [IDX_SLOTS * WB, 64],
                           gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    i_ready = gl.allocate_shared_memory(gl.int64, [IDX_SLOTS, 1], mbarrier.MBarrierLayout())
    i_free = gl.allocate_shared_memory(gl.int64, [IDX_SLOTS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(q_ready.index(s), count=128)
        mbarrier.init(q_free.index(s), count=TOKEN_FREES)
    for s in gl.static_range(IDX_SLOTS):
        mbarrier.init(i_ready.index(s), count=128)
        mbarrier.init(i_free.index(s), count=TOKEN_FREES)
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=128)
        mbarrier.init(free.index(s), count=STAGE_FREES)
    return ring, q_smem, idx_smem, idx_rows, q_ready, q_free, i_ready, i_free, ready, free


@gluon.jit
def _sparse_mla_prefill_gluon_few_kernel(
        q_ptr, stride_qt, stride_qh, kv_ptr, kv_stride, rows, idx_ptr, idx_st, width, len_ptr,
        len_st, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
        T, H, qk_scale, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, PRIOR: gl.constexpr,
        NS: gl.constexpr, WB: gl.constexpr, MODE: gl.constexpr,
        CREGS: gl.constexpr = 232):
    """Grid ``min(SMs, T)``. q ``[T, H <= 8, 512]`` bf16 (rows 16-byte aligned); kv ``[rows,
    512]`` bf16; idx ``[T, width]`` int32 (``< 0`` or ``>= rows`` skipped); lens ``[T]`` int;
    sink ``[H]`` fp32; out ``[T, H, 512]`` bf16, lse ``[T, H]`` fp32 (read first with
    ``PRIOR``); ``qk_scale`` = scale * log2(e); ``WB`` =
    ``index_blocks(width)``; ``CREGS``: the consumer's registers (200 with ``NS = 1`` and the
    launch option ``maxnreg=128``: two CTAs per SM, grid ``min(2 SMs, T)``)."""
    PL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 8], gl.bfloat16)
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    ring, q_smem, idx_smem, idx_rows, q_ready, q_free, i_ready, i_free, ready, free = _shared(
        NS, WB, 1, 1)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 8], PL)
    gl.warp_specialize([
        (_producer, (pid, grid, T, width, len_ptr, len_st, q_ptr, stride_qt, stride_qh, kv_ptr,
                     kv_stride, rows, idx_ptr, idx_st, H, q_smem, ring, idx_smem, idx_rows,
                     q_ready, q_free, i_ready, i_free, ready, free, HAS_LEN, NS, WB, MODE)),
        (_consumer, (pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr,
                     sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
                     q_smem, ring, idx_rows, p_smem, q_ready, q_free, i_ready, i_free, ready,
                     free, HAS_LEN, HAS_SINK, NS, WB, MODE, PRIOR)),
    ], [4], [CREGS])


# ---- two mma.sync consumers on alternate blocks ---------------------------------------------
MMA2 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1],
                                               instr_shape=[16, 8]))  # mma.sync, 16 rows a warp
A2 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA2, k_width=2))
B2 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA2, k_width=2))
K2 = gl.constexpr(gl.SliceLayout(1, MMA2))
H2 = gl.constexpr(gl.SliceLayout(0, MMA2))
SYNC_REGS = gl.constexpr(200)


@gluon.jit
def _q_b(q_smem, i):
    """Q slot tile ``i`` transposed: an ``mma.sync`` B operand ``[64 dims, 8 heads]``."""
    return q_smem.index(i).permute((1, 0)).load(B2)


@gluon.jit
def _o_sync(ring, i, pb, o, a2):
    """``O^T_i * alpha + K_i^T P^T`` by ``mma.sync`` (A: ring tile ``i`` transposed)."""
    return mma_v2(ring.index(i).permute((1, 0)).load(A2), pb, o * a2)


@gluon.jit
def _consumer_sync(pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr, sink_st,
                   out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, q_smem, ring,
                   idx_rows, mg_o, mg_ml, q_ready, q_free, i_ready, i_free, ready, free,
                   mg_ready, mg_free, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
                   NS: gl.constexpr, WB: gl.constexpr, MODE: gl.constexpr,
                   PRIOR: gl.constexpr, C: gl.constexpr):
    """Consumer ``C`` of two: the token's blocks ``b`` with ``(g + b) % 2 == C`` (``g``: the
    CTA's blocks before the token), its own softmax state; consumer 1 hands (m, l, O^T) to
    consumer 0 through ``mg_*`` at the token's end, which merges, applies prior and sink, and
    stores."""
    zero = gl.full([64, 8], 0.0, gl.float32, layout=MMA2)
    kr, h64, hmask, om, sink = _consumer_consts(H, sink_ptr, sink_st, HAS_SINK, K2, H2)
    n_next = _token_len(pid, T, len_ptr, len_st, width, HAS_LEN)
    g = 0
    k = 0
    for item in range(pid, T, grid):
        t, n, n_next, nblk, qs, si = _consumer_token(item, grid, k, n_next, T, len_ptr, len_st,
                                                     width, HAS_LEN)
        b0 = (C - g) & 1
        nb = gl.maximum(nblk - b0 + 1, 0) // 2
        orow = out_ptr + t * stride_ot + h64[None, :] * stride_oh + kr[:, None]
        if PRIOR and C == 0:
            lp = gl.load(lse_ptr + t * stride_lt + h64 * stride_lh, mask=hmask,
                         other=float("inf"))
        m_i = gl.full([8], float("-inf"), gl.float32, layout=H2)
        l_i = gl.full([8], 0.0, gl.float32, layout=H2)
        o0 = zero
        o1 = zero
        o2 = zero
        o3 = zero
        o4 = zero
        o5 = zero
        o6 = zero
        o7 = zero
        _token_slots(q_ready, i_ready, q_free, i_free, qs, si, k, nb == 0)
        for j in range(nb):
            b = b0 + 2 * j
            gg = g + b
            s = gg % NS
            ok = _block_keys(idx_rows, si * WB + b, b, n, rows, K2)
            base = s * 8
            qb = qs * 8
            mbarrier.wait(ready.index(s), (gg // NS) & 1)
            last = j == nb - 1
            if MODE == 1:
                barrier()
                mbarrier.arrive(free.index(s))
                mbarrier.arrive(q_free.index(qs), pred=last)
                mbarrier.arrive(i_free.index(si), pred=last)
            else:
                # four independent S chains (adjacent mma.sync never wait on each other)
                s0 = mma_v2(ring.index(base).load(A2), _q_b(q_smem, qb), zero)
                s1 = mma_v2(ring.index(base + 1).load(A2), _q_b(q_smem, qb + 1), zero)
                s2 = mma_v2(ring.index(base + 2).load(A2), _q_b(q_smem, qb + 2), zero)
                s3 = mma_v2(ring.index(base + 3).load(A2), _q_b(q_smem, qb + 3), zero)
                s0 = mma_v2(ring.index(base + 4).load(A2), _q_b(q_smem, qb + 4), s0)
                s1 = mma_v2(ring.index(base + 5).load(A2), _q_b(q_smem, qb + 5), s1)
                s2 = mma_v2(ring.index(base + 6).load(A2), _q_b(q_smem, qb + 6), s2)
                s3 = mma_v2(ring.index(base + 7).load(A2), _q_b(q_smem, qb + 7), s3)
                barrier()
                mbarrier.arrive(q_free.index(qs), pred=last)
                mbarrier.arrive(i_free.index(si), pred=last)
                acc = (s0 + s1) + (s2 + s3)
                sc = gl.where(ok[:, None], acc * qk_scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(sc, axis=0))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(sc - m_safe[None, :])
                l_i = l_i * alpha + gl.sum(p, axis=0)
                a2 = alpha[None, :]
                pb = gl.convert_layout(p.to(gl.bfloat16), B2)
                o0 = _o_sync(ring, base, pb, o0, a2)
                o1 = _o_sync(ring, base + 1, pb, o1, a2)
                o2 = _o_sync(ring, base + 2, pb, o2, a2)
                o3 = _o_sync(ring, base + 3, pb, o3, a2)
                o4 = _o_sync(ring, base + 4, pb, o4, a2)
                o5 = _o_sync(ring, base + 5, pb, o5, a2)
                o6 = _o_sync(ring, base + 6, pb, o6, a2)
                o7 = _o_sync(ring, base + 7, pb, o7, a2)
                barrier()
                mbarrier.arrive(free.index(s))
                m_i = m_new
        if C == 1:  # hand this token's state to consumer 0
            mbarrier.wait(mg_free, (k & 1) ^ 1)
            mg_ml.index(0).store(m_i)
            mg_ml.index(1).store(l_i)
            mg_o.index(0).store(o0)
            mg_o.index(1).store(o1)
            mg_o.index(2).store(o2)
            mg_o.index(3).store(o3)
            mg_o.index(4).store(o4)
            mg_o.index(5).store(o5)
            mg_o.index(6).store(o6)
            mg_o.index(7).store(o7)
            barrier()
            mbarrier.arrive(mg_ready)
        else:
            mbarrier.wait(mg_ready, k & 1)
            m_1 = mg_ml.index(0).load(H2)
            l_1 = mg_ml.index(1).load(H2)
            m_c = gl.maximum(m_i, m_1)
            m_cs = gl.where(m_c == float("-inf"), 0.0, m_c)
            w_i = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - m_cs))
            w_1 = gl.where(m_1 == float("-inf"), 0.0, gl.exp2(m_1 - m_cs))
            wi = w_i[None, :]
            w1 = w_1[None, :]
            o0 = o0 * wi + mg_o.index(0).load(MMA2) * w1
            o1 = o1 * wi + mg_o.index(1).load(MMA2) * w1
            o2 = o2 * wi + mg_o.index(2).load(MMA2) * w1
            o3 = o3 * wi + mg_o.index(3).load(MMA2) * w1
            o4 = o4 * wi + mg_o.index(4).load(MMA2) * w1
            o5 = o5 * wi + mg_o.index(5).load(MMA2) * w1
            o6 = o6 * wi + mg_o.index(6).load(MMA2) * w1
            o7 = o7 * wi + mg_o.index(7).load(MMA2) * w1
            barrier()
            mbarrier.arrive(mg_free)
            l_i = l_i * w_i + l_1 * w_1
            m_i = m_c
            if PRIOR:
                l_i, m_i, o0, o1, o2, o3, o4, o5, o6, o7 = _merge_prior(
                    l_i, m_i, lp, o0, o1, o2, o3, o4, o5, o6, o7, _prior_group(orow, om, 0),
                    _prior_group(orow, om, 1), _prior_group(orow, om, 2),
                    _prior_group(orow, om, 3), _prior_group(orow, om, 4),
                    _prior_group(orow, om, 5), _prior_group(orow, om, 6),
                    _prior_group(orow, om, 7))
            _store_token(l_i, m_i, o0, o1, o2, o3, o4, o5, o6, o7, t, h64, hmask, orow, om,
                         sink_ptr, sink_st, lse_ptr, stride_lt, stride_lh, HAS_SINK, sink)
        g += nblk
        k += 1


@gluon.jit
def _sparse_mla_prefill_gluon_few_sync_kernel(
        q_ptr, stride_qt, stride_qh, kv_ptr, kv_stride, rows, idx_ptr, idx_st, width, len_ptr,
        len_st, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
        T, H, qk_scale, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, PRIOR: gl.constexpr,
        NS: gl.constexpr, WB: gl.constexpr, MODE: gl.constexpr):
    """``_sparse_mla_prefill_gluon_few_kernel``'s arguments and producer; the products by
    ``mma.sync`` in two consumer warpgroups on alternate blocks."""
    IL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    ring, q_smem, idx_smem, idx_rows, q_ready, q_free, i_ready, i_free, ready, free = _shared(
        NS, WB, 2, 1)
    mg_o = gl.allocate_shared_memory(gl.float32, [8, 64, 8], IL)
    mg_ml = gl.allocate_shared_memory(gl.float32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    mg_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mg_ready = mg_bar.index(0)
    mg_free = mg_bar.index(1)
    mbarrier.init(mg_ready, count=1)
    mbarrier.init(mg_free, count=1)
    gl.warp_specialize([
        (_producer, (pid, grid, T, width, len_ptr, len_st, q_ptr, stride_qt, stride_qh, kv_ptr,
                     kv_stride, rows, idx_ptr, idx_st, H, q_smem, ring, idx_smem, idx_rows,
                     q_ready, q_free, i_ready, i_free, ready, free, HAS_LEN, NS, WB, MODE)),
        (_consumer_sync, (pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr,
                          sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                          stride_lh, q_smem, ring, idx_rows, mg_o, mg_ml, q_ready, q_free,
                          i_ready, i_free, ready, free, mg_ready, mg_free, HAS_LEN, HAS_SINK,
                          NS, WB, MODE, PRIOR, 0)),
        (_consumer_sync, (pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr,
                          sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                          stride_lh, q_smem, ring, idx_rows, mg_o, mg_ml, q_ready, q_free,
                          i_ready, i_free, ready, free, mg_ready, mg_free, HAS_LEN, HAS_SINK,
                          NS, WB, MODE, PRIOR, 1)),
    ], [4, 4], [SYNC_REGS, SYNC_REGS])
