"""Warp-specialized few-heads sparse MLA decode for Hopper in Gluon: ``sparse_mla_decode``'s
contract, the grid, the per-block math and the results of ``decode.py``'s kernel (one CTA =
one query token x ``BH`` heads x one key split, swap-AB wgmmas with the keys on M), with the
three stages of a block in three partitions (``gl.warp_specialize``) so that they overlap
across blocks instead of running as one serial chain:

* **producer** (``decode_heads_ws._producer``, its 4 warps and register budget): slot ids and ``cp.async`` gathers of
  the raw records into byte-ring stage ``j % NS``; ``ready[s]`` when they landed.
* **dequant** (``DEQUANT_WARPS`` warps): waits ``ready[s]`` and ``tfree[t]``, turns the stage's
  bytes into the bf16 key tile ``t = j % NT`` (eight ``[64, 64]`` groups; 584's RoPE tail
  copied), copies the block's slot ids beside it, releases the stage (``free[s]``) and hands
  the tile over (``tready[t]``).
* **MMA** (the default partition, one warpgroup): Q into shared memory once, then per block:
  waits ``tready[t]``, ``S^T = K Q^T``, online softmax, ``O^T += K^T P^T``, releases the tile
  (``tfree[t]``); then the epilogue (``decode._few_heads_epilogue``). ``PRIOR``: out / lse
  already hold a normalized partial of other keys (bf16, natural lse, +inf = none), loaded
  before the key loop and merged after it (the sink applied once, in the epilogue, loaded
  before the key loop too). With ``PRIOR`` (one key set, unsplit) on the per-token grid each
  partition loads the token's length itself (``_*_token``), the producer its first slot ids
  and the MMA partition Q in flight together with it.

Shared memory (8-head tiles, ``NS = NT = 2``): the ring 2 x 37 KB (584) + two key tiles of
64 KB + Q 8 KB: ~217 KB, one CTA per SM.

``PERSIST``: a grid of at most one CTA per SM whose three partitions loop over the same items
(token x split x head tile) with their ring and key-tile positions running on from item to
item, so that the producer gathers an item's first blocks while the MMA warpgroup finishes the
previous one (without it each item's CTA starts with an empty pipeline). No partition starts
an item on a global load: each loads the next item's lens ahead (the producer two items ahead,
and the next item's first slot ids), the MMA partition also the next 8-head Q, and it loads an
item's sink before the item's key loop instead of in its epilogue.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma_wait)

from ._api import barrier
from .common import _load_sink, _merge_prior, _prior_tiles
from .decode import (B2_8, P_B8, _acc_layout, _few_heads_epilogue, _online_softmax, _pv,
                     _pv_sync, _q_group, _q_rows, _qk, _store_q)
from .dequant import R_MIN, _convert_group, _dequant_group, _exp2i, _load_group
from .gather import (_alloc_rings, _item_ids, _key_ranges, _lens_ranges, _load_lens,
                     _program_ids, _put)
from .decode_heads_ws import (PRODUCER_REGS, PRODUCER_WARPS, _alloc_ids_pre, _first_ids,
                              _first_ids_masked, _first_ids_unmasked, _producer)

#: warps of the dequant partition (8: one key row of 64 dims per thread and group)
DEQUANT_WARPS = gl.constexpr(8)
#: registers per dequant thread (setmaxnreg)
DEQUANT_REGS = gl.constexpr(96)
#: warps of the MMA partition (the kernel's ``num_warps``)
MMA_WARPS = gl.constexpr(4)
#: registers per producer thread on the persistent grid: it carries the next items' lens and
#: first slot ids, and the MMA partition gets the rest (``(65536 - 128 * regs - 256 *
#: DEQUANT_REGS) / 128``). 8-head tiles: 80 (MMA 240). 16-head tiles: 72 with two key sets
#: (64 spills 8-16 bytes there; MMA 248), 64 with one (its MMA partition, with the prior,
#: spills 8 bytes at 248)
PERSIST_PRODUCER_REGS_8 = gl.constexpr(80)
PERSIST_PRODUCER_REGS_16_AB = gl.constexpr(72)
PERSIST_PRODUCER_REGS_16_A = gl.constexpr(64)


@gluon.jit
def _dequant_block(s, t, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, k0, k1, k2, k3,
                   k4, k5, k6, k7, SRC: gl.constexpr, PREFETCH: gl.constexpr = False):
    """Ring stage ``s`` (records ``SRC``) -> the eight bf16 groups of key tile ``t``.
    ``PREFETCH``: group ``g + 1``'s bytes are loaded before group ``g`` is converted and
    stored (ptxas keeps shared-memory loads and stores in program order, so the serial form
    waits out one shared-load latency per group)."""
    if PREFETCH:
        raw, sb = _load_group(0, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC,
                              DEQUANT_WARPS)
        for g in gl.static_range(8):
            if g < 7:
                nraw, nsb = _load_group(g + 1, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring,
                                        scale_s, SRC, DEQUANT_WARPS)
            x = _convert_group(g, raw, sb, SRC, DEQUANT_WARPS)
            _put(x, g, k0.index(t), k1.index(t), k2.index(t), k3.index(t), k4.index(t),
                 k5.index(t), k6.index(t), k7.index(t))
            if g < 7:
                raw = nraw
                sb = nsb
    else:
        for g in gl.static_range(8):
            x = _dequant_group(g, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC,
                               DEQUANT_WARPS)
            _put(x, g, k0.index(t), k1.index(t), k2.index(t), k3.index(t), k4.index(t),
                 k5.index(t), k6.index(t), k7.index(t))


@gluon.jit
def _dequant_part(nblk_a, nblk, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring,
                  idx_ring, k0, k1, k2, k3, k4, k5, k6, k7, kid, ready, free, tready, tfree,
                  SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
                  NS: gl.constexpr, NT: gl.constexpr, PREFETCH: gl.constexpr, g0=0,
                  MODE: gl.constexpr = 0):
    """Every block's raw records -> bf16 key tile ``(g0 + j) % NT`` (and its slot ids);
    ``g0``: blocks before this token's; ``MODE`` 1 / 3: the stage handed on unconverted."""
    LI: gl.constexpr = gl.BlockedLayout([1], [32], [DEQUANT_WARPS], [0])
    for j in range(nblk):
        s = (g0 + j) % NS
        t = (g0 + j) % NT
        mbarrier.wait(ready.index(s), ((g0 + j) // NS) & 1)
        mbarrier.wait(tfree.index(t), (((g0 + j) // NT) & 1) ^ 1)
        scale_s = scale_ring.index(s)
        if MODE == 1 or MODE == 3:
            pass
        elif HAS_B and SRC_A != SRC_B:
            if j < nblk_a:
                _dequant_block(s, t, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, k0, k1,
                               k2, k3, k4, k5, k6, k7, SRC_A, PREFETCH)
            else:
                _dequant_block(s, t, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, k0, k1,
                               k2, k3, k4, k5, k6, k7, SRC_B, PREFETCH)
        else:
            _dequant_block(s, t, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, k0, k1, k2,
                           k3, k4, k5, k6, k7, SRC_A, PREFETCH)
        kid.index(t).store(idx_ring.index(s).load(LI))
        fence_async_shared()
        barrier()  # every thread's stage reads and tile stores precede the arrives
        mbarrier.arrive(free.index(s))
        mbarrier.arrive(tready.index(t))


@gluon.jit
def _mma_part(q_ptr, stride_qt, stride_qh, t_tok, split, ht, H, qk_scale, num_splits, nblk,
              sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
              po_ptr, pl_ptr, k0, k1, k2, k3, k4, k5, k6, k7, kid, q_smem, p_smem, tready,
              tfree, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, BH: gl.constexpr,
              NT: gl.constexpr, PRIOR: gl.constexpr, g0=0, QREGS: gl.constexpr = False,
              q0=0, q1=0, q2=0, q3=0, q4=0, q5=0, q6=0, q7=0, SINK_AHEAD: gl.constexpr = False,
              MODE: gl.constexpr = 0, s_buf=None, S_GIVEN: gl.constexpr = False,
              p_r=None, r_buf=None, S_F16: gl.constexpr = False,
              F16_ROPE: gl.constexpr = False, FREE_SPLIT: gl.constexpr = 0, tfree_b=None,
              PV_SYNC: gl.constexpr = False, S_MASKED: gl.constexpr = False):
    """One warpgroup: Q, then both swap-AB wgmmas and the softmax of every block (key tile
    ``(g0 + j) % NT``), then the epilogue. ``QREGS``: Q's eight 64-dim groups are ``q0..q7``
    (``_load_q``, loaded by the caller ahead of time). ``SINK_AHEAD``: the sink is loaded
    before the key loop, not in the epilogue (its latency hidden under the blocks). ``MODE``
    1 / 2: each key tile released unread (no products). ``S_GIVEN`` (``decode_few_ds.py``): no
    Q and no ``S^T`` product here, each block's ``S^T [64, BH]`` fp32 is read from ``s_buf[t]``
    (handed over with the tile). ``S_F16`` (with ``S_GIVEN``): fp16 key tiles holding ``value *
    2**(127 - r_buf[t])`` (the block's own exponent); ``O^T`` is kept in units of ``2**(127 -
    R)`` with ``R`` the running maximum of the blocks' exponents (``P * 2**(r - R)`` in fp16 in
    ``p_smem``, the accumulators rescaled with ``alpha`` when ``R`` grows); ``F16_ROPE``: group
    7 is the bf16 RoPE tile against ``P * 2**(127 - R)`` in bf16 (``p_r``). ``FREE_SPLIT`` (1
    or 4; 0 off): the tile is freed in two parts, ``tfree[t]`` once the ``O^T`` products of
    groups ``0 .. FREE_SPLIT - 1`` are done, ``tfree_b[t]`` after all (its next writer waits
    for each part before storing it). ``PV_SYNC`` (8-head tiles, ``S_GIVEN``): the softmax in
    each warp on all of the block's logits (``decode.P_B8``: P stays in registers as the
    products' B operand; no cross-warp reduction, no P through shared memory) and the ``O^T``
    products by ``mma.sync`` (``decode._pv_sync``) instead of wgmma. ``S_MASKED`` (with
    ``S_GIVEN``): the handed-over ``S^T`` is ``-inf`` at the keys that do not count (``kid``
    not read)."""
    gl.static_assert(not PV_SYNC or (S_GIVEN and BH == 8), "PV_SYNC: 8-head tiles, S given")
    ACC: gl.constexpr = _acc_layout(BH, MMA_WARPS)
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [MMA_WARPS, 1], [1, 0])
    SINK_GIVEN: gl.constexpr = SINK_AHEAD and HAS_SINK and not SPLIT
    sk = 0
    if SINK_GIVEN:
        hs = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, ACC))
        sk = _load_sink(sink_ptr, sink_st, hs.to(gl.int64), hs < H)
    if PRIOR:  # issued before the key loop, merged after it
        hp = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, ACC))
        hpm = hp < H
        hp64 = hp.to(gl.int64)
        dp = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        prow = out_ptr + t_tok * stride_ot + hp64[None, :] * stride_oh + dp[:, None]
        pm = hpm[None, :] & (dp >= 0)[:, None]
        lp = gl.load(lse_ptr + t_tok * stride_lt + hp64 * stride_lh, mask=hpm, other=float("inf"))
        p0, p1, p2, p3, p4, p5, p6, p7 = _prior_tiles(prow, pm)
    if S_GIVEN:
        pass
    elif QREGS:
        q_smem.index(0).store(q0)
        q_smem.index(1).store(q1)
        q_smem.index(2).store(q2)
        q_smem.index(3).store(q3)
        q_smem.index(4).store(q4)
        q_smem.index(5).store(q5)
        q_smem.index(6).store(q6)
        q_smem.index(7).store(q7)
    else:
        qrow, hq, dq = _q_rows(q_ptr, t_tok, stride_qt, stride_qh, ht, BH, LQ)
        _store_q(qrow, hq, dq, H, q_smem)
    if not S_GIVEN:
        fence_async_shared()
        barrier()

    SL: gl.constexpr = P_B8 if PV_SYNC else ACC  # the softmax's layout
    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, SL))
    zero = gl.full([64, BH], 0.0, gl.float32, layout=ACC)
    # per-thread partial sums of p, reduced once after the loop
    l_part = gl.full([64, BH], 0.0, gl.float32, layout=SL)
    o0 = zero
    o1 = zero
    o2 = zero
    o3 = zero
    o4 = zero
    o5 = zero
    o6 = zero
    o7 = zero
    r_run = gl.full([BH], R_MIN, gl.int32, layout=gl.SliceLayout(0, SL))
    for j in range(nblk):
        t = (g0 + j) % NT
        mbarrier.wait(tready.index(t), ((g0 + j) // NT) & 1)
        if MODE == 0 or MODE == 3:
            kt0 = k0.index(t)
            kt1 = k1.index(t)
            kt2 = k2.index(t)
            kt3 = k3.index(t)
            kt4 = k4.index(t)
            kt5 = k5.index(t)
            kt6 = k6.index(t)
            kt7 = k7.index(t)
            if S_GIVEN:
                sT = s_buf.index(t).load(SL)
            else:
                sT = _qk(kt0, kt1, kt2, kt3, kt4, kt5, kt6, kt7, q_smem, zero)  # [64 keys, BH]
            if S_MASKED:
                ok = None
            else:
                ok = kid.index(t).load(gl.SliceLayout(1, SL)) >= 0
            p, alpha, m_i, l_part = _online_softmax(sT * qk_scale, ok, m_i, l_part,
                                                    not S_MASKED)
            if S_F16:
                rb = r_buf.index(t).load(gl.SliceLayout(0, SL))
                r_new = gl.maximum(r_run, rb)
                p16 = (p * _exp2i(rb - r_new)[None, :]).to(gl.float16)  # the tiles' units
                p_rope = p16
                if F16_ROPE:  # against the bf16 RoPE tile: P * 2**(127 - R)
                    p_rope = (p * _exp2i(127 - r_new)[None, :]).to(gl.bfloat16)
                alpha = alpha * _exp2i(r_run - r_new)
                r_run = r_new
            else:
                p16 = p.to(gl.bfloat16)
                p_rope = p16
            if PV_SYNC:  # P stays in registers, as the products' B operand
                pb = gl.convert_layout(p16, B2_8)
                pr = pb
                if F16_ROPE:
                    pr = gl.convert_layout(p_rope, B2_8)
            else:
                p_smem.store(gl.permute(p16, (1, 0)))
                if F16_ROPE:
                    p_r.store(gl.permute(p_rope, (1, 0)))
                fence_async_shared()
                barrier()
            # O^T_g = O^T_g * alpha + K_g^T P^T (waited: the tile and P are free after it)
            if PV_SYNC:
                o0, o1, o2, o3, o4, o5, o6, o7 = _pv_sync(
                    kt0, kt1, kt2, kt3, kt4, kt5, kt6, kt7, pb, pr, o0, o1, o2, o3, o4, o5, o6,
                    o7, gl.convert_layout(alpha, gl.SliceLayout(0, ACC)), tfree.index(t), ACC,
                    F16_ROPE, FREE_SPLIT)
            elif F16_ROPE:
                o0, o1, o2, o3, o4, o5, o6, o7 = _pv(kt0, kt1, kt2, kt3, kt4, kt5, kt6, kt7,
                                                     kt7, p_smem, p_r, o0, o1, o2, o3, o4, o5,
                                                     o6, o7, alpha, True, FREE_SPLIT == 0)
            else:
                o0, o1, o2, o3, o4, o5, o6, o7 = _pv(kt0, kt1, kt2, kt3, kt4, kt5, kt6, kt7,
                                                     kt7, p_smem, p_smem, o0, o1, o2, o3, o4,
                                                     o5, o6, o7, alpha, False, FREE_SPLIT == 0)
            if FREE_SPLIT == 1 and not PV_SYNC:
                o0 = warpgroup_mma_wait(7, deps=[o0])
                barrier()  # every warp's products of group 0 are done
                mbarrier.arrive(tfree.index(t))
                o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(
                    0, deps=[o1, o2, o3, o4, o5, o6, o7])
            elif FREE_SPLIT == 4 and not PV_SYNC:
                o0, o1, o2, o3 = warpgroup_mma_wait(4, deps=[o0, o1, o2, o3])
                barrier()  # every warp's products of groups 0..3 are done
                mbarrier.arrive(tfree.index(t))
                o4, o5, o6, o7 = warpgroup_mma_wait(0, deps=[o4, o5, o6, o7])
            barrier()
        elif FREE_SPLIT > 0:
            mbarrier.arrive(tfree.index(t))
        if FREE_SPLIT > 0:
            mbarrier.arrive(tfree_b.index(t))
        else:
            mbarrier.arrive(tfree.index(t))
    l_i = gl.sum(l_part, axis=0)
    if PV_SYNC:
        l_i = gl.convert_layout(l_i, gl.SliceLayout(0, ACC))
        m_i = gl.convert_layout(m_i, gl.SliceLayout(0, ACC))
        r_run = gl.convert_layout(r_run, gl.SliceLayout(0, ACC))
    o_unit = 1.0
    if S_F16:
        o_unit = _exp2i(r_run - 127)
        if PRIOR:  # the prior is in true units
            u = o_unit[None, :]
            o0 = o0 * u
            o1 = o1 * u
            o2 = o2 * u
            o3 = o3 * u
            o4 = o4 * u
            o5 = o5 * u
            o6 = o6 * u
            o7 = o7 * u
            o_unit = 1.0
    if PRIOR:
        l_i, m_i, o0, o1, o2, o3, o4, o5, o6, o7 = _merge_prior(
            l_i, m_i, lp, o0, o1, o2, o3, o4, o5, o6, o7, p0, p1, p2, p3, p4, p5, p6, p7)
    _few_heads_epilogue(o0, o1, o2, o3, o4, o5, o6, o7, l_i, m_i, o_unit, t_tok, split, ht, H,
                        num_splits, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr,
                        stride_lt, stride_lh, po_ptr, pl_ptr, ACC, HAS_SINK, SPLIT, BH,
                        SINK_GIVEN, sk)


@gluon.jit
def _item_lens(item, num_items, num_ht, num_splits, a_len_ptr, a_len_st, b_len_ptr, b_len_st,
               HAS_B: gl.constexpr, HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr):
    """The raw lens (``gather._load_lens``) of item ``min(item, num_items - 1)``, loaded ahead:
    a partition on the persistent grid loads an item's lens while it works on an earlier
    item, so their latency is not paid at the item's start."""
    ht, split, t = _item_ids(gl.minimum(item, num_items - 1), num_ht, num_splits)
    return _load_lens(t, a_len_ptr, a_len_st, b_len_ptr, b_len_st, HAS_B, HAS_LEN_A, HAS_LEN_B)


@gluon.jit
def _item_ranges(item, la, lb, num_ht, num_splits, a_width, b_width, HAS_B: gl.constexpr,
                 HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, SPLIT: gl.constexpr):
    """Item ``item``'s (head tile, split, token) and its key ranges (``gather._key_ranges``)
    from its lens ``la`` / ``lb`` (``_item_lens``)."""
    ht, split, t = _item_ids(item, num_ht, num_splits)
    lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _lens_ranges(
        la, lb, split, num_splits, a_width, b_width, HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
    return ht, split, t, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk


@gluon.jit
def _item_step(item, grid, num_items, la, lb, num_ht, num_splits, a_len_ptr, a_len_st,
               a_width, b_len_ptr, b_len_st, b_width, HAS_B: gl.constexpr,
               HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, SPLIT: gl.constexpr):
    """``_item_ranges`` of item ``item`` (its lens ``la`` / ``lb``, loaded ahead), then the
    raw lens of item ``item + grid`` (the CTA's next), loaded now: ``(ht, split, t, lo_a,
    hi_a, lo_b, hi_b, nblk_a, nblk, next la, next lb)``."""
    ht, split, t, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _item_ranges(
        item, la, lb, num_ht, num_splits, a_width, b_width, HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
    la, lb = _item_lens(item + grid, num_items, num_ht, num_splits, a_len_ptr, a_len_st,
                        b_len_ptr, b_len_st, HAS_B, HAS_LEN_A, HAS_LEN_B)
    return ht, split, t, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk, la, lb


@gluon.jit
def _load_q(q_ptr, item, num_items, num_ht, num_splits, stride_qt, stride_qh, H,
            BH: gl.constexpr):
    """``_q_regs`` of item ``min(item, num_items - 1)`` (an item ahead, clamped to the last)."""
    ht, split, t = _item_ids(gl.minimum(item, num_items - 1), num_ht, num_splits)
    return _q_regs(q_ptr, t, ht, stride_qt, stride_qh, H, BH)


@gluon.jit
def _q_regs(q_ptr, t, ht, stride_qt, stride_qh, H, BH: gl.constexpr):
    """Q of token ``t``, head tile ``ht`` as eight ``[BH, 64]`` groups in registers (the MMA
    partition's layout), loaded ahead for ``_mma_part(..., QREGS=True)``."""
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [MMA_WARPS, 1], [1, 0])
    qrow, hq, dq = _q_rows(q_ptr, t, stride_qt, stride_qh, ht, BH, LQ)
    return (_q_group(qrow, hq, dq, H, 0), _q_group(qrow, hq, dq, H, 1),
            _q_group(qrow, hq, dq, H, 2), _q_group(qrow, hq, dq, H, 3),
            _q_group(qrow, hq, dq, H, 4), _q_group(qrow, hq, dq, H, 5),
            _q_group(qrow, hq, dq, H, 6), _q_group(qrow, hq, dq, H, 7))


@gluon.jit
def _producer_items(num_items, num_ht, num_splits, a_ptr, a_idx_ptr, a_idx_st, a_len_ptr,
                    a_len_st, a_width, a_bstride, a_page, a_rows, b_ptr, b_idx_ptr, b_idx_st,
                    b_len_ptr, b_len_st, b_width, b_bstride, b_page, b_rows, r0, r1, r2, r3, r4,
                    r5, r6, r7, rope_ring, scale_ring, idx_ring, ids_pre, ready, free,
                    SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
                    HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, SPLIT: gl.constexpr,
                    NS: gl.constexpr, IDX_AHEAD: gl.constexpr):
    """``PERSIST``: the producer over this CTA's items, its ring position running on (the next
    item's first blocks are gathered while the MMA warpgroup finishes this one). The lens
    run two items ahead and the first slot ids one item ahead, so an item starts gathering
    without waiting on a global load."""
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    la, lb = _item_lens(pid, num_items, num_ht, num_splits, a_len_ptr, a_len_st, b_len_ptr,
                        b_len_st, HAS_B, HAS_LEN_A, HAS_LEN_B)
    la1, lb1 = _item_lens(pid + grid, num_items, num_ht, num_splits, a_len_ptr, a_len_st,
                          b_len_ptr, b_len_st, HAS_B, HAS_LEN_A, HAS_LEN_B)
    ht, split, t, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _item_ranges(
        pid, la, lb, num_ht, num_splits, a_width, b_width, HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
    fa, fb = _first_ids(nblk_a, nblk, a_idx_ptr + t * a_idx_st, lo_a, hi_a,
                        b_idx_ptr + t * b_idx_st, lo_b, hi_b, HAS_B, IDX_AHEAD)
    g = 0
    for item in range(pid, num_items, grid):
        # the next item's ranges (its lens arrived during the previous item) and first ids,
        # and the lens of the one after it
        nxt = gl.minimum(item + grid, num_items - 1)
        ht1, split1, t1, lo_a1, hi_a1, lo_b1, hi_b1, nblk_a1, nblk1 = _item_ranges(
            nxt, la1, lb1, num_ht, num_splits, a_width, b_width, HAS_B, HAS_LEN_A, HAS_LEN_B,
            SPLIT)
        la1, lb1 = _item_lens(item + 2 * grid, num_items, num_ht, num_splits, a_len_ptr,
                              a_len_st, b_len_ptr, b_len_st, HAS_B, HAS_LEN_A, HAS_LEN_B)
        fa1, fb1 = _first_ids(nblk_a1, nblk1, a_idx_ptr + t1 * a_idx_st, lo_a1, hi_a1,
                              b_idx_ptr + t1 * b_idx_st, lo_b1, hi_b1, HAS_B, IDX_AHEAD)
        _producer(a_ptr, a_idx_ptr + t * a_idx_st, a_bstride, a_page, a_rows, b_ptr,
                  b_idx_ptr + t * b_idx_st, b_bstride, b_page, b_rows, lo_a, hi_a, lo_b, hi_b,
                  nblk_a, nblk, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring,
                  ids_pre, ready, free, SRC_A, SRC_B, HAS_B, NS, IDX_AHEAD, g, True, fa, fb)
        g += nblk
        t = t1
        lo_a = lo_a1
        hi_a = hi_a1
        lo_b = lo_b1
        hi_b = hi_b1
        nblk_a = nblk_a1
        nblk = nblk1
        fa = fa1
        fb = fb1


@gluon.jit
def _dequant_items(num_items, num_ht, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr,
                   b_len_st, b_width, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring,
                   idx_ring, k0, k1, k2, k3, k4, k5, k6, k7, kid, ready, free, tready, tfree,
                   SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
                   HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, SPLIT: gl.constexpr,
                   NS: gl.constexpr, NT: gl.constexpr, PREFETCH: gl.constexpr,
                   MODE: gl.constexpr = 0):
    """``PERSIST``: the dequant partition over this CTA's items (lens one item ahead)."""
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    la, lb = _item_lens(pid, num_items, num_ht, num_splits, a_len_ptr, a_len_st, b_len_ptr,
                        b_len_st, HAS_B, HAS_LEN_A, HAS_LEN_B)
    g = 0
    for item in range(pid, num_items, grid):
        ht, split, t, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk, la, lb = _item_step(
            item, grid, num_items, la, lb, num_ht, num_splits, a_len_ptr, a_len_st, a_width,
            b_len_ptr, b_len_st, b_width, HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
        _dequant_part(nblk_a, nblk, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring,
                      idx_ring, k0, k1, k2, k3, k4, k5, k6, k7, kid, ready, free, tready, tfree,
                      SRC_A, SRC_B, HAS_B, NS, NT, PREFETCH, g, MODE)
        g += nblk


@gluon.jit
def _mma_items(num_items, num_ht, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr,
               b_len_st, b_width, q_ptr, stride_qt, stride_qh, H, qk_scale, sink_ptr, sink_st,
               out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, po_ptr, pl_ptr, k0,
               k1, k2, k3, k4, k5, k6, k7, kid, q_smem, p_smem, tready, tfree,
               HAS_B: gl.constexpr, HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr,
               HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, BH: gl.constexpr,
               NT: gl.constexpr, PRIOR: gl.constexpr, MODE: gl.constexpr = 0, s_buf=None,
               S_GIVEN: gl.constexpr = False, p_r=None, r_buf=None, S_F16: gl.constexpr = False,
               F16_ROPE: gl.constexpr = False, FREE_SPLIT: gl.constexpr = 0, tfree_b=None,
               PV_SYNC: gl.constexpr = False, S_MASKED: gl.constexpr = False):
    """``PERSIST``: the MMA warpgroup over this CTA's items, with the next item's lens (and,
    for 8-head tiles, its Q) loaded into registers while it works on this one (Q stored
    again per item: the previous item's products that read it were waited before its last
    block's warpgroup barrier; an item without blocks reads no Q). A 16-head tile's next Q
    (32 more registers) would spill the partition's 240 registers, so it loads Q per item.
    ``S_GIVEN`` / ``S_F16`` / ``F16_ROPE`` / ``PV_SYNC`` / ``S_MASKED``: ``_mma_part``'s (no Q;
    each block's S^T from ``s_buf``; fp16 key tiles in the block's own units; the softmax per
    warp and ``O^T`` by ``mma.sync``; ``S^T`` masked)."""
    QAHEAD: gl.constexpr = BH <= 8 and not S_GIVEN
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    la, lb = _item_lens(pid, num_items, num_ht, num_splits, a_len_ptr, a_len_st, b_len_ptr,
                        b_len_st, HAS_B, HAS_LEN_A, HAS_LEN_B)
    if QAHEAD:
        q0, q1, q2, q3, q4, q5, q6, q7 = _load_q(q_ptr, pid, num_items, num_ht, num_splits,
                                                 stride_qt, stride_qh, H, BH)
    else:
        q0 = 0
        q1 = 0
        q2 = 0
        q3 = 0
        q4 = 0
        q5 = 0
        q6 = 0
        q7 = 0
    g = 0
    for item in range(pid, num_items, grid):
        ht, split, t, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk, la, lb = _item_step(
            item, grid, num_items, la, lb, num_ht, num_splits, a_len_ptr, a_len_st, a_width,
            b_len_ptr, b_len_st, b_width, HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
        if QAHEAD:
            n0, n1, n2, n3, n4, n5, n6, n7 = _load_q(q_ptr, item + grid, num_items, num_ht,
                                                     num_splits, stride_qt, stride_qh, H, BH)
        _mma_part(q_ptr, stride_qt, stride_qh, t, split, ht, H, qk_scale, num_splits, nblk,
                  sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                  stride_lh, po_ptr, pl_ptr, k0, k1, k2, k3, k4, k5, k6, k7, kid, q_smem,
                  p_smem, tready, tfree, HAS_SINK, SPLIT, BH, NT, PRIOR, g, QAHEAD, q0, q1,
                  q2, q3, q4, q5, q6, q7, True, MODE, s_buf, S_GIVEN, p_r, r_buf, S_F16,
                  F16_ROPE, FREE_SPLIT, tfree_b, PV_SYNC, S_MASKED)
        g += nblk
        if QAHEAD:
            q0 = n0
            q1 = n1
            q2 = n2
            q3 = n3
            q4 = n4
            q5 = n5
            q6 = n6
            q7 = n7


@gluon.jit
def _token_blocks(t, split, num_splits, a_len_ptr, a_len_st, a_width, HAS_LEN_A: gl.constexpr):
    """``(nblk_a, nblk)`` of token ``t`` over one unsplit key set (``_key_ranges``)."""
    lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _key_ranges(
        t, split, num_splits, a_len_ptr, a_len_st, a_width, a_len_ptr, a_len_st, 0, False,
        HAS_LEN_A, False, False)
    return nblk_a, nblk


@gluon.jit
def _producer_token(num_ht, num_splits, a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st,
                    a_width, a_bstride, a_page, a_rows, r0, r1, r2, r3, r4, r5, r6, r7,
                    rope_ring, scale_ring, idx_ring, ids_pre, ready, free, SRC_A: gl.constexpr,
                    HAS_LEN_A: gl.constexpr, NS: gl.constexpr, IDX_AHEAD: gl.constexpr):
    """``PRIOR`` on the per-token grid (one unsplit key set): the producer of this CTA's
    token, its first slot ids loaded together with its length (masked by it after), so its
    first gathers wait on one global load, not two in a row."""
    ht, split, t = _program_ids(num_ht, num_splits)
    a_idx_row = a_idx_ptr + t * a_idx_st
    la, lb = _load_lens(t, a_len_ptr, a_len_st, a_len_ptr, a_len_st, False, HAS_LEN_A, False)
    raw, c = _first_ids_unmasked(a_idx_row, a_width, IDX_AHEAD)
    lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _lens_ranges(la, lb, split, num_splits, a_width,
                                                        0, False, HAS_LEN_A, False, False)
    fa = _first_ids_masked(raw, c, hi_a)
    _producer(a_ptr, a_idx_row, a_bstride, a_page, a_rows, a_ptr, a_idx_row, a_bstride, a_page,
              a_rows, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk, r0, r1, r2, r3, r4, r5, r6, r7,
              rope_ring, scale_ring, idx_ring, ids_pre, ready, free, SRC_A, SRC_A, False, NS,
              IDX_AHEAD, 0, True, fa, fa)


@gluon.jit
def _dequant_token(num_ht, num_splits, a_len_ptr, a_len_st, a_width, r0, r1, r2, r3, r4, r5,
                   r6, r7, rope_ring, scale_ring, idx_ring, k0, k1, k2, k3, k4, k5, k6, k7, kid,
                   ready, free, tready, tfree, SRC_A: gl.constexpr, HAS_LEN_A: gl.constexpr,
                   NS: gl.constexpr, NT: gl.constexpr, PREFETCH: gl.constexpr,
                   MODE: gl.constexpr = 0):
    """``PRIOR`` on the per-token grid: the dequant partition, its block count from its own
    length load (under its wait for the first ring stage)."""
    ht, split, t = _program_ids(num_ht, num_splits)
    nblk_a, nblk = _token_blocks(t, split, num_splits, a_len_ptr, a_len_st, a_width, HAS_LEN_A)
    _dequant_part(nblk_a, nblk, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring,
                  k0, k1, k2, k3, k4, k5, k6, k7, kid, ready, free, tready, tfree, SRC_A, SRC_A,
                  False, NS, NT, PREFETCH, 0, MODE)


@gluon.jit
def _mma_token(num_ht, num_splits, a_len_ptr, a_len_st, a_width, q_ptr, stride_qt, stride_qh,
               H, qk_scale, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr,
               stride_lt, stride_lh, po_ptr, pl_ptr, k0, k1, k2, k3, k4, k5, k6, k7, kid,
               q_smem, p_smem, tready, tfree, HAS_LEN_A: gl.constexpr,
               HAS_SINK: gl.constexpr, BH: gl.constexpr, NT: gl.constexpr,
               MODE: gl.constexpr = 0):
    """``PRIOR`` on the per-token grid: the MMA warpgroup, its Q loads issued before its
    length load is waited (they do not depend on it), then ``_mma_part`` with the prior and
    the sink."""
    ht, split, t = _program_ids(num_ht, num_splits)
    q0, q1, q2, q3, q4, q5, q6, q7 = _q_regs(q_ptr, t, ht, stride_qt, stride_qh, H, BH)
    nblk_a, nblk = _token_blocks(t, split, num_splits, a_len_ptr, a_len_st, a_width, HAS_LEN_A)
    _mma_part(q_ptr, stride_qt, stride_qh, t, split, ht, H, qk_scale, num_splits, nblk,
              sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
              po_ptr, pl_ptr, k0, k1, k2, k3, k4, k5, k6, k7, kid, q_smem, p_smem, tready,
              tfree, HAS_SINK, False, BH, NT, True, 0, True, q0, q1, q2, q3, q4, q5, q6, q7,
              True, MODE)


@gluon.jit
def _sparse_mla_decode_few_ws_kernel(
    q_ptr, stride_qt, stride_qh,
    a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows,
    b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride, b_page, b_rows,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    po_ptr, pl_ptr,
    H, qk_scale, num_splits, num_ht, num_items,
    SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
    HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr,
    SPLIT: gl.constexpr, BH: gl.constexpr, NS: gl.constexpr, NT: gl.constexpr,
    IDX_AHEAD: gl.constexpr = 1, DEQ_PREFETCH: gl.constexpr = False,
    PRIOR: gl.constexpr = False, PERSIST: gl.constexpr = False, MODE: gl.constexpr = 0,
):
    """Grid ``T * num_splits * num_ht`` (head tile fastest, then split, then token); launch with
    ``num_warps=MMA_WARPS``. Arguments as ``decode._sparse_mla_decode_gluon_kernel``'s; ``NS``
    byte-ring stages, ``NT`` bf16 key tiles, slot ids loaded one block ahead (``IDX_AHEAD``
    1) or 8 blocks at once (0); ``DEQ_PREFETCH``: the dequant partition loads each group's
    bytes one group ahead; ``PRIOR`` (not with ``SPLIT``): merge the partial out / lse hold;
    ``PERSIST``: a grid of at most one CTA per SM, each looping over items ``pid, pid + grid,
    ..`` of the ``num_items = T * num_splits * num_ht`` (the ring and key tiles run on across
    items, so an item's first gathers overlap the previous item's last products). ``MODE``
    (benchmarks only): 1 times the copies alone (each stage handed on unconverted, each key
    tile released unread), 2 the copies and the dequant (no products), 3 the copies and the
    products (of whatever the key tiles hold: no dequant); 0 is the kernel."""
    ht, split, t = _program_ids(num_ht, num_splits)

    USE_288: gl.constexpr = SRC_A == 288 or (HAS_B and SRC_B == 288)
    r0, r1, r2, r3, r4, r5, r6, r7, scale_ring, rope_ring, idx_ring = _alloc_rings(
        SRC_A, SRC_B, HAS_B, NS, 32 if USE_288 else 16, False)
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 64], gl.bfloat16)
    # one allocation per 64-dim group (no false write-after-write barriers), NT tiles each
    k0 = gl.allocate_shared_memory(gl.bfloat16, [NT, 64, 64], KL)
    k1 = gl.allocate_shared_memory(gl.bfloat16, [NT, 64, 64], KL)
    k2 = gl.allocate_shared_memory(gl.bfloat16, [NT, 64, 64], KL)
    k3 = gl.allocate_shared_memory(gl.bfloat16, [NT, 64, 64], KL)
    k4 = gl.allocate_shared_memory(gl.bfloat16, [NT, 64, 64], KL)
    k5 = gl.allocate_shared_memory(gl.bfloat16, [NT, 64, 64], KL)
    k6 = gl.allocate_shared_memory(gl.bfloat16, [NT, 64, 64], KL)
    k7 = gl.allocate_shared_memory(gl.bfloat16, [NT, 64, 64], KL)
    kid = gl.allocate_shared_memory(gl.int32, [NT, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [8, BH, 64], QL)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 64], QL)
    ids_pre = _alloc_ids_pre(idx_ring, IDX_AHEAD)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    tready = gl.allocate_shared_memory(gl.int64, [NT, 1], mbarrier.MBarrierLayout())
    tfree = gl.allocate_shared_memory(gl.int64, [NT, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        # every producer thread's cp.async completion (noinc) + one arrive for the id stores
        mbarrier.init(ready.index(i), count=32 * PRODUCER_WARPS + 1)
        mbarrier.init(free.index(i), count=1)
    for i in gl.static_range(NT):
        mbarrier.init(tready.index(i), count=1)
        mbarrier.init(tfree.index(i), count=1)

    if PERSIST:
        gl.warp_specialize([
            (_mma_items, (num_items, num_ht, num_splits, a_len_ptr, a_len_st, a_width,
                          b_len_ptr, b_len_st, b_width, q_ptr, stride_qt, stride_qh, H, qk_scale,
                          sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                          stride_lh, po_ptr, pl_ptr, k0, k1, k2, k3, k4, k5, k6, k7, kid,
                          q_smem, p_smem, tready, tfree, HAS_B, HAS_LEN_A, HAS_LEN_B, HAS_SINK,
                          SPLIT, BH, NT, PRIOR, MODE)),
            (_producer_items, (num_items, num_ht, num_splits, a_ptr, a_idx_ptr, a_idx_st,
                               a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows, b_ptr,
                               b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride,
                               b_page, b_rows, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring,
                               scale_ring, idx_ring, ids_pre, ready, free, SRC_A, SRC_B, HAS_B,
                               HAS_LEN_A, HAS_LEN_B, SPLIT, NS, IDX_AHEAD)),
            (_dequant_items, (num_items, num_ht, num_splits, a_len_ptr, a_len_st, a_width,
                              b_len_ptr, b_len_st, b_width, r0, r1, r2, r3, r4, r5, r6, r7,
                              rope_ring, scale_ring, idx_ring, k0, k1, k2, k3, k4, k5, k6, k7,
                              kid, ready, free, tready, tfree, SRC_A, SRC_B, HAS_B, HAS_LEN_A,
                              HAS_LEN_B, SPLIT, NS, NT, DEQ_PREFETCH, MODE)),
        ], [PRODUCER_WARPS, DEQUANT_WARPS],
            [PERSIST_PRODUCER_REGS_8 if BH <= 8 else
             (PERSIST_PRODUCER_REGS_16_AB if HAS_B else PERSIST_PRODUCER_REGS_16_A),
             DEQUANT_REGS])
        return

    if PRIOR:
        gl.static_assert(not HAS_B and not SPLIT, "PRIOR: one key set, unsplit")
        gl.warp_specialize([
            (_mma_token, (num_ht, num_splits, a_len_ptr, a_len_st, a_width, q_ptr, stride_qt,
                          stride_qh, H, qk_scale, sink_ptr, sink_st, out_ptr, stride_ot,
                          stride_oh, lse_ptr, stride_lt, stride_lh, po_ptr, pl_ptr, k0, k1, k2,
                          k3, k4, k5, k6, k7, kid, q_smem, p_smem, tready, tfree, HAS_LEN_A,
                          HAS_SINK, BH, NT, MODE)),
            (_producer_token, (num_ht, num_splits, a_ptr, a_idx_ptr, a_idx_st, a_len_ptr,
                               a_len_st, a_width, a_bstride, a_page, a_rows, r0, r1, r2, r3, r4,
                               r5, r6, r7, rope_ring, scale_ring, idx_ring, ids_pre, ready, free,
                               SRC_A, HAS_LEN_A, NS, IDX_AHEAD)),
            (_dequant_token, (num_ht, num_splits, a_len_ptr, a_len_st, a_width, r0, r1, r2, r3,
                              r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, k0, k1, k2, k3,
                              k4, k5, k6, k7, kid, ready, free, tready, tfree, SRC_A, HAS_LEN_A,
                              NS, NT, DEQ_PREFETCH, MODE)),
        ], [PRODUCER_WARPS, DEQUANT_WARPS],
            [PERSIST_PRODUCER_REGS_8 if BH <= 8 else PERSIST_PRODUCER_REGS_16_A, DEQUANT_REGS])
        return

    lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _key_ranges(
        t, split, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st, b_width,
        HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
    a_idx_row = a_idx_ptr + t * a_idx_st
    b_idx_row = b_idx_ptr + t * b_idx_st

    gl.warp_specialize([
        (_mma_part, (q_ptr, stride_qt, stride_qh, t, split, ht, H, qk_scale, num_splits, nblk,
                     sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                     stride_lh, po_ptr, pl_ptr, k0, k1, k2, k3, k4, k5, k6, k7, kid, q_smem,
                     p_smem, tready, tfree, HAS_SINK, SPLIT, BH, NT, PRIOR)),
        (_producer, (a_ptr, a_idx_row, a_bstride, a_page, a_rows, b_ptr, b_idx_row, b_bstride,
                     b_page, b_rows, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk,
                     r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, ids_pre,
                     ready, free, SRC_A, SRC_B, HAS_B, NS, IDX_AHEAD)),
        (_dequant_part, (nblk_a, nblk, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring,
                         idx_ring, k0, k1, k2, k3, k4, k5, k6, k7, kid, ready, free, tready,
                         tfree, SRC_A, SRC_B, HAS_B, NS, NT, DEQ_PREFETCH)),
    ], [PRODUCER_WARPS, DEQUANT_WARPS], [PRODUCER_REGS, DEQUANT_REGS])
