"""Warp-specialized many-heads sparse MLA decode for Hopper in Gluon: ``sparse_mla_decode``'s
contract, the grid, the per-block math and the results of ``decode_heads.py`` (one CTA = one
query token x 64 heads x one key split, heads on the wgmma M), with the global-memory work moved
out of the MMA warps by ``gl.warp_specialize``:

* **consumers** (the default partition, the kernel's 8 warps = two warpgroups): Q into shared
  memory once, then per 64-key block ``j`` (ring stage ``j % NS``): wait ``ready[s]``, dequantize
  the raw records into registers (``decode_heads._dequant_keys``), read the block's slot ids,
  release the stage (``free[s]``), store the bf16 key tile, ``S = Q K^T``, online softmax, P,
  ``O += P K`` (``decode_heads._qk_softmax``), then the row epilogue (``_heads_epilogue``).
* **producer** (a worker of ``PRODUCER_WARPS`` warps, ``PRODUCER_REGS`` registers): per block,
  wait ``free[s]``, store the block's checked slot ids (loaded one block ahead, or
  with ``IDX_AHEAD = 0`` read from a chunk of ``PRELOAD_BLOCKS`` blocks' ids loaded at once) to
  the ring, ``cp.async`` the raw records (``gather._copy_keys``; invalid keys zero-filled), then
  each thread's ``cp.async.mbarrier.arrive.noinc`` (its copies landed) and, after a producer
  barrier, one plain arrive (the id stores): ``ready[s]`` has ``32 * PRODUCER_WARPS + 1`` arrivals.

Synchronization is mbarriers between the partitions (``ready`` / ``free`` per stage, phase
``(j // NS) & 1``; the producer's first ``NS`` waits pass on a fresh barrier) and named
barriers inside each. ``NS`` ring stages: 2 fit in the 227 KB of one CTA (Q 64 KB + key tile
64 KB + P 8 KB + 2 x 40 KB for 584 records); 3 do not for any record pair the kernel takes.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ._api import barrier, reinterpret
from .gather import (_alloc_rings, _check_idx, _copy_block, _copy_layout, _idx_at, _key_ranges,
                     _load_idx_raw, _program_ids)
from .decode_heads import (BH, NW, _alloc_tiles, _dequant_keys, _heads_epilogue, _qk_softmax,
                           _thread_sums)

#: warps of the producer partition (a worker; the kernel's own 8 warps are the consumers)
PRODUCER_WARPS = gl.constexpr(4)
#: registers per producer thread (setmaxnreg: 48 -> the consumers get 224, Triton 3.6; 40 gives
#: them 232 but the producer spills, 24 leaves them at 240 and spills 104 bytes)
PRODUCER_REGS = gl.constexpr(48)


@gluon.jit
def _fill_stage(j, s, idx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride, b_page,
                r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, ready,
                SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr):
    """Block ``j``'s checked slot ids ``idx`` and its records' ``cp.async`` into (free) stage
    ``s``; ``ready[s]`` once every producer thread's copies landed and the ids are stored."""
    _copy_block(j, s, idx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride, b_page,
                r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, SRC_A, SRC_B,
                HAS_B, PRODUCER_WARPS, False)
    cp.mbarrier_arrive(ready.index(s), increment_count=False)
    barrier()  # every producer thread's id stores precede the one arrive
    mbarrier.arrive(ready.index(s))


@gluon.jit
def _alloc_ids_pre(idx_ring, IDX_AHEAD: gl.constexpr):
    """``[PRELOAD_BLOCKS, 64]`` int32 slot ids for ``IDX_AHEAD = 0`` (else ``idx_ring``,
    unused)."""
    if IDX_AHEAD == 0:
        return gl.allocate_shared_memory(gl.int32, [PRELOAD_BLOCKS, 64],
                                         gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    else:
        return idx_ring


@gluon.jit
def _load_idx_chunk(j, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row, lo_b, hi_b,
                    b_rows, HAS_B: gl.constexpr, P: gl.constexpr, NWP: gl.constexpr):
    """Checked slot ids of blocks ``j .. j + P - 1`` as one ``[P, 64]`` int32 tile (``-1``
    where a key is not read): ``_load_idx`` of ``P`` blocks in one pass of vector loads."""
    ia, ib = _load_idx_chunk_raw(j, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b,
                                 HAS_B, P, NWP)
    return _check_idx(ia, ib, a_rows, b_rows, HAS_B)


@gluon.jit
def _load_idx_chunk_raw(j, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b,
                        HAS_B: gl.constexpr, P: gl.constexpr, NWP: gl.constexpr):
    """``_load_idx_chunk``'s ids as stored (checked later, by ``_check_idx``)."""
    L2: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [NWP, 1], [1, 0])
    k = j + gl.arange(0, P, layout=gl.SliceLayout(1, L2))[:, None]
    r = gl.arange(0, 64, layout=gl.SliceLayout(0, L2))[None, :]
    return _idx_at(k, r, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b, HAS_B)


@gluon.jit
def _first_ids(nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b,
               HAS_B: gl.constexpr, AHEAD: gl.constexpr):
    """The raw ids ``_producer(..., FIRST=True)`` takes: block 0's (``AHEAD = 1``) or chunk
    0's (``AHEAD = 0``)."""
    if AHEAD == 0:
        return _load_idx_chunk_raw(0, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b,
                                   hi_b, HAS_B, PRELOAD_BLOCKS, PRODUCER_WARPS)
    else:
        return _load_idx_raw(0, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b,
                             HAS_B, gl.SliceLayout(1, _copy_layout(16, PRODUCER_WARPS)))


@gluon.jit
def _first_ids_unmasked(a_idx_row, a_width, AHEAD: gl.constexpr):
    """``_first_ids`` of one unsplit key set before its length is known: columns ``0 ..`` of
    the row, masked only by its width (in bounds); ``_first_ids_masked`` applies the length."""
    if AHEAD == 0:
        L2: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [PRODUCER_WARPS, 1], [1, 0])
        c = (gl.arange(0, PRELOAD_BLOCKS, layout=gl.SliceLayout(1, L2))[:, None] * 64
             + gl.arange(0, 64, layout=gl.SliceLayout(0, L2))[None, :])
    else:
        c = gl.arange(0, 64, layout=gl.SliceLayout(1, _copy_layout(16, PRODUCER_WARPS)))
    return gl.load(a_idx_row + c, mask=c < a_width, other=-1), c


@gluon.jit
def _first_ids_masked(ids, c, hi_a):
    """``_first_ids_unmasked``'s ids with columns ``>= hi_a`` (the length) as ``-1``: equal
    to ``_first_ids`` of one unsplit key set."""
    return gl.where(c < hi_a, ids, -1)


#: blocks whose slot ids the producer loads at once into shared memory (``IDX_AHEAD = 0``)
PRELOAD_BLOCKS = gl.constexpr(8)


@gluon.jit
def _producer_preload(a_ptr, a_idx_row, a_bstride, a_page, a_rows, b_ptr, b_idx_row, b_bstride,
                      b_page, b_rows, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk,
                      r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, ids_pre,
                      ready, free, SRC_A: gl.constexpr, SRC_B: gl.constexpr,
                      HAS_B: gl.constexpr, NS: gl.constexpr, g0=0, FIRST: gl.constexpr = False,
                      fa=0, fb=0):
    """``_producer`` with the checked slot ids of ``PRELOAD_BLOCKS`` blocks loaded in one pass
    (one global-load latency per chunk, not one per block) into ``ids_pre``; ``FIRST``: the
    first chunk's raw ids are ``fa`` / ``fb`` (``_load_idx_chunk_raw``, loaded by the caller
    ahead of time)."""
    LI: gl.constexpr = gl.SliceLayout(1, _copy_layout(16, PRODUCER_WARPS))
    # row views of the chunk (the same bytes: both layouts unswizzled row-major)
    rows = reinterpret(ids_pre, gl.int32, [PRELOAD_BLOCKS, 64],
                       gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if FIRST:  # chunk 0 stored before the loop (fa / fb not live in it)
        chunk = _check_idx(fa, fb, a_rows, b_rows, HAS_B)
        barrier()  # the last chunk's rows are read
        ids_pre.store(chunk)
        barrier()
    for j in range(nblk):
        s = (g0 + j) % NS
        c = j % PRELOAD_BLOCKS
        if c == 0:
            if FIRST:
                if j > 0:
                    _store_idx_chunk(j, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row,
                                     lo_b, hi_b, b_rows, ids_pre, HAS_B)
            else:
                _store_idx_chunk(j, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row,
                                 lo_b, hi_b, b_rows, ids_pre, HAS_B)
        idx = rows.index(c).load(LI)
        mbarrier.wait(free.index(s), (((g0 + j) // NS) & 1) ^ 1)
        _fill_stage(j, s, idx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride, b_page,
                    r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, ready,
                    SRC_A, SRC_B, HAS_B)


@gluon.jit
def _store_idx_chunk(j, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row, lo_b, hi_b,
                     b_rows, ids_pre, HAS_B: gl.constexpr):
    """The checked ids of the ``PRELOAD_BLOCKS`` blocks from ``j`` into ``ids_pre``."""
    chunk = _load_idx_chunk(j, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row, lo_b,
                            hi_b, b_rows, HAS_B, PRELOAD_BLOCKS, PRODUCER_WARPS)
    barrier()  # the last chunk's rows are read
    ids_pre.store(chunk)
    barrier()


@gluon.jit
def _producer(a_ptr, a_idx_row, a_bstride, a_page, a_rows, b_ptr, b_idx_row, b_bstride, b_page,
              b_rows, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk,
              r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, ids_pre, ready,
              free, SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
              NS: gl.constexpr, AHEAD: gl.constexpr = 1, g0=0, FIRST: gl.constexpr = False,
              fa=0, fb=0):
    """Every block's slot ids and raw records into ring stage ``(g0 + j) % NS`` once it is
    free (``g0``: blocks the ring took before this token's); a block's ids are loaded one or two
    blocks before it (``AHEAD = 1 | 2``: two keep a block's time between a load and its use),
    or (``AHEAD = 0``) those of ``PRELOAD_BLOCKS`` blocks at once into ``ids_pre``. ``FIRST``:
    the first block's (chunk's) raw ids are ``fa`` / ``fb``, loaded by the caller ahead of
    time (``_first_ids``)."""
    gl.static_assert(AHEAD == 0 or AHEAD == 1 or AHEAD == 2, "AHEAD: 0 (preload), 1 or 2")
    LI: gl.constexpr = gl.SliceLayout(1, _copy_layout(16, PRODUCER_WARPS))
    if AHEAD == 0:
        _producer_preload(a_ptr, a_idx_row, a_bstride, a_page, a_rows, b_ptr, b_idx_row,
                          b_bstride, b_page, b_rows, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk,
                          r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring,
                          ids_pre, ready, free, SRC_A, SRC_B, HAS_B, NS, g0, FIRST, fa, fb)
    else:
        # block j's raw ids (checked only when the block is issued)
        if FIRST:
            a0 = fa
            b0 = fb
        else:
            a0, b0 = _load_idx_raw(0, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b,
                                   hi_b, HAS_B, LI)
        a1 = a0
        b1 = b0
        if AHEAD == 2:
            a1, b1 = _load_idx_raw(1, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b,
                                   hi_b, HAS_B, LI)
        for j in range(nblk):
            s = (g0 + j) % NS
            mbarrier.wait(free.index(s), (((g0 + j) // NS) & 1) ^ 1)
            idx = _check_idx(a0, b0, a_rows, b_rows, HAS_B)
            _fill_stage(j, s, idx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride,
                        b_page, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring,
                        ready, SRC_A, SRC_B, HAS_B)
            if AHEAD == 2:
                # block j + 2's ids: a whole block passes before their use
                a0 = a1
                b0 = b1
                a1, b1 = _load_idx_raw(j + 2, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row,
                                       lo_b, hi_b, HAS_B, LI)
            else:
                # block j + 1's ids: their latency passes under the next wait and this block's
                # copies
                a0, b0 = _load_idx_raw(j + 1, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row,
                                       lo_b, hi_b, HAS_B, LI)


@gluon.jit
def _consumer(q_ptr, stride_qt, stride_qh, t, split, ht, H, qk_scale, num_splits, nblk_a, nblk,
              sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
              po_ptr, pl_ptr, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring,
              k_smem, q_smem, p_smem, mx_smem, ready, free,
              SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
              HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, NS: gl.constexpr):
    """8 warps: Q, then dequant + both wgmmas + softmax of every block, then the epilogue."""
    SACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                   instr_shape=[16, 32, 16])
    OACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                   instr_shape=[16, 256, 16])
    LB: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])
    hq = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, LB))
    dq = gl.arange(0, 512, layout=gl.SliceLayout(0, LB))
    qrow = q_ptr + t * stride_qt + hq.to(gl.int64)[:, None] * stride_qh
    # one store; fenced and behind a barrier before the first S wgmma (the key tile's)
    q_smem.store(gl.load(qrow + dq[None, :], mask=(hq < H)[:, None], other=0.0))

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, SACC))
    zero_s = gl.full([BH, 64], 0.0, gl.float32, layout=SACC)
    l_part = _thread_sums(zero_s)  # per-thread partial sums of p, reduced once after the loop
    o = gl.full([BH, 512], 0.0, gl.float32, layout=OACC)
    for j in range(nblk):
        s = j % NS
        if j > 0:
            # block j - 1's ring reads are long done: the producer may refill its stage
            mbarrier.arrive(free.index((j + NS - 1) % NS))
        mbarrier.wait(ready.index(s), (j // NS) & 1)
        kt = _dequant_keys(j, nblk_a, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring,
                           SRC_A, SRC_B, HAS_B, NS)
        kidx = idx_ring.index(s).load(gl.SliceLayout(0, SACC))
        # (the key tile's write-after-read on block j - 1's O wgmmas, which each warpgroup
        # waited: membar's barrier around the mbarrier ops above orders it)
        k_smem.store(kt)
        fence_async_shared()
        barrier()
        alpha, m_i, l_part = _qk_softmax(q_smem, k_smem, p_smem, mx_smem, kidx, m_i, l_part,
                                         zero_s, qk_scale)
        # O = O * alpha + P K  [64 heads, 512]
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, OACC))
        o = warpgroup_mma(p_smem, k_smem, o * alpha_o[:, None], is_async=True)
        o = warpgroup_mma_wait(0, deps=[o])
    _heads_epilogue(o, l_part, m_i, t, split, ht, H, num_splits, sink_ptr, sink_st, out_ptr,
                    stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, po_ptr, pl_ptr, k_smem,
                    HAS_SINK, SPLIT)


@gluon.jit
def _sparse_mla_decode_heads_ws_kernel(
    q_ptr, stride_qt, stride_qh,
    a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows,
    b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride, b_page, b_rows,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    po_ptr, pl_ptr,
    H, qk_scale, num_splits, num_ht,
    SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
    HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr,
    SPLIT: gl.constexpr, NS: gl.constexpr, IDX_AHEAD: gl.constexpr = 1,
):
    """Grid ``T * num_splits * num_ht`` (head tile of 64 fastest, then split, then token);
    launch with ``num_warps=NW`` (8 consumer warps; the producer's ``PRODUCER_WARPS`` run
    besides). Arguments as ``decode_heads._sparse_mla_decode_heads_kernel``'s; slot ids are
    loaded one block ahead (``IDX_AHEAD = 1``) or ``PRELOAD_BLOCKS`` blocks at once (0)."""
    ht, split, t = _program_ids(num_ht, num_splits)

    r0, r1, r2, r3, r4, r5, r6, r7, scale_ring, rope_ring, idx_ring = _alloc_rings(
        SRC_A, SRC_B, HAS_B, NS, 64, False)
    k_smem, q_smem, p_smem, mx_smem = _alloc_tiles()
    ids_pre = _alloc_ids_pre(idx_ring, IDX_AHEAD)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        # every producer thread's cp.async completion (noinc) + one arrive for the id stores
        mbarrier.init(ready.index(i), count=32 * PRODUCER_WARPS + 1)
        mbarrier.init(free.index(i), count=1)

    lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _key_ranges(
        t, split, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st, b_width,
        HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
    a_idx_row = a_idx_ptr + t * a_idx_st
    b_idx_row = b_idx_ptr + t * b_idx_st

    gl.warp_specialize([
        (_consumer, (q_ptr, stride_qt, stride_qh, t, split, ht, H, qk_scale, num_splits, nblk_a,
                     nblk, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                     stride_lh, po_ptr, pl_ptr, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring,
                     scale_ring, idx_ring, k_smem, q_smem, p_smem, mx_smem, ready, free,
                     SRC_A, SRC_B, HAS_B, HAS_SINK, SPLIT, NS)),
        (_producer, (a_ptr, a_idx_row, a_bstride, a_page, a_rows, b_ptr, b_idx_row, b_bstride,
                     b_page, b_rows, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk,
                     r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, ids_pre,
                     ready, free, SRC_A, SRC_B, HAS_B, NS, IDX_AHEAD)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
