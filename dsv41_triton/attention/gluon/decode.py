"""Sparse MLA decode for Hopper in Gluon: ``sparse_mla_decode``'s contract (SPEC §3, §4, §6).

One CTA (one warpgroup, or two with ``NW = 8``) owns ``BH`` heads of one query token and one
key split; it
walks the window keys then the extra keys of its split in blocks of ``BN = 64`` keys through one
online softmax. Per block:

1. **gather** (issued ``NS - 1`` blocks ahead): the block's slot ids (loaded one more block
   ahead, into registers) become byte offsets of each key's data and scale rows; ``cp.async``
   copies the raw record bytes into stage ``k % NS`` of a shared ring: ``[64, 64]`` byte tiles,
   each its own allocation (one per 64 dims; 288 records use four), the scale row (8/16/32 bytes)
   and, for 584 records, the raw bf16 RoPE tail straight into a ``[64, 64]`` bf16 wgmma tile.
   Invalid keys (``< 0``, past ``rows``, past ``len``) copy nothing (zero fill) and are marked
   ``-1`` in the stage's index row.
2. **dequant**: each byte tile becomes exact bf16 in registers (e4m3: ``cvt`` to f16x2, to fp32,
   times the scale, one rounding pack; e2m1 through ``prmt`` byte tables and one multiply by the
   scale) and is stored to its bf16 key tile (NVMMA-swizzled).
3. **swap-AB wgmma**: keys are the MMA's M (64), heads its N (``BH`` = 8/16/32):
   ``S^T [64, BH] = K [64, 512] · Q^T`` (Q resident in shared memory), softmax along M,
   ``O^T_g [64, BH] += K_g^T · P^T`` for each 64-dim group ``g`` (K read transposed from the
   same tile), so few heads do not pay for 64 MMA rows.

Splits write normalized fp32 partials and their log2-sum-exp, combined (with the sink) by the
``tl`` merge kernel. No host sync, fixed launch shapes: CUDA-graph safe.

**One ring stage** (``NS = 1``, 8-head tiles, 4 warps): ~110 KB of shared memory, so two CTAs
share an SM (``launch.ctas_per_sm``) and cover each other's latencies; block ``j + 1``'s
gathers go into the stage as soon as block ``j``'s dequant has read it (584's RoPE tail is
first copied into a key tile of its own), under block ``j``'s products.

**fp16 operands** (``F16``): the key tiles are fp16 and hold ``value * 2**(127 - R)``, where
``R`` is a running maximum (like the softmax max) of the blocks' largest UE8M0 scale byte
(``R_MIN`` at least; e2m1 blocks count as 127): e4m3 bytes become fp16 with one ``cvt`` per two
(exact, NaN kept) and one multiply by ``2**(scale byte - R) <= 1``; e2m1 values times their
e4m3 scale are exact fp16 products. Each head's Q is scaled by a power of two that puts its
amax in ``[2**14, 2**15)`` (no fp16 overflow or underflow) and the logit scale undoes it and
``R``; when ``R`` grows the accumulators are rescaled with the softmax's ``alpha``. ``P`` is fp16
(``p <= 1``). The 584 records' bf16 RoPE tail stays a bf16 wgmma (bf16 Q tail, its own logit
accumulator; ``P * 2**(127 - R)`` in bf16 for the value side). Exact as the bf16 path except
where ``value * 2**(127 - R)`` is an fp16 subnormal: a key whose scale is ``2**14`` or more
below the largest scale seen so far in its split. Record pairs: 584 only or 528/288 only (584
mixed with 528/288 needs a per-block choice of the group-7 wgmma types; that version measured
wrong on the H200 and is refused at compile time; the launch uses bf16 operands there).
"""
from __future__ import annotations


from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ._api import barrier, reinterpret
from .common import _finish_rows
from .dequant import R_MIN, _dequant, _exp2i, _prep_f16
from .gather import (_alloc_rings, _check_idx, _copy_layout, _issue, _key_ranges, _load_idx_raw,
                     _program_ids)


@gluon.constexpr_function
def _acc_layout(bh, nw):
    """wgmma accumulator ``[64, bh]``: one warpgroup per ``bh * 4 / nw`` heads."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, nw // 4],
                                     instr_shape=[16, bh * 4 // nw, 16])


@gluon.jit
def _qk_f16(k0, k1, k2, k3, k4, k5, k6, k7, rope_s, q16, q_r, zero, cq, qk_scale,
            ROPE: gl.constexpr):
    """Logits ``S^T [64 keys, BH]`` (log2 units) of one block from the fp16 tiles: ``cq[h]``
    undoes the head's fp16 shift and the tiles' ``2**(127 - R)``; with ``ROPE`` (584 records)
    group 7 is the raw bf16 RoPE tile against the bf16 Q tail (its own accumulator)."""
    if not ROPE:
        return _qk(k0, k1, k2, k3, k4, k5, k6, k7, q16, zero) * cq[None, :]
    acc = _qk_groups7(k0, k1, k2, k3, k4, k5, k6, q16, zero)
    acr = warpgroup_mma(rope_s, q_r.permute((1, 0)), zero, use_acc=False, is_async=True)
    acc, acr = warpgroup_mma_wait(0, deps=[acc, acr])
    return acc * cq[None, :] + acr * qk_scale


@gluon.jit
def _q_rows(q_ptr, t, stride_qt, stride_qh, ht, BH: gl.constexpr, LQ: gl.constexpr):
    """Row pointers ``[BH, 1]`` of token ``t``'s heads in head tile ``ht``, the heads ``[BH]`` and
    the dims ``[64]`` of one 64-dim group, in the Q load layout ``LQ``."""
    hq = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, LQ))
    dq = gl.arange(0, 64, layout=gl.SliceLayout(0, LQ))
    return q_ptr + t * stride_qt + hq.to(gl.int64)[:, None] * stride_qh, hq, dq


@gluon.jit
def _store_q(qrow, hq, dq, H, q_smem):
    """The bf16 Q rows (``_q_rows``; heads ``>= H`` as 0) into ``q_smem [8, BH, 64]``."""
    for g in gl.static_range(8):
        q_smem.index(g).store(_q_group(qrow, hq, dq, H, g))


@gluon.jit
def _q_group(qrow, hq, dq, H, g: gl.constexpr):
    """64-dim group ``g`` of the Q rows (``_q_rows``; heads ``>= H`` as 0), ``[BH, 64]``."""
    return gl.load(qrow + (g * 64 + dq)[None, :], mask=(hq < H)[:, None], other=0.0)


@gluon.jit
def _qk_groups7(k0, k1, k2, k3, k4, k5, k6, q_smem, zero):
    """The wgmmas of 64-dim groups 0..6 of ``S^T = K Q^T`` (``_qk``), issued, not waited."""
    acc = warpgroup_mma(k0, q_smem.index(0).permute((1, 0)), zero, use_acc=False,
                        is_async=True)
    acc = warpgroup_mma(k1, q_smem.index(1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(k2, q_smem.index(2).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(k3, q_smem.index(3).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(k4, q_smem.index(4).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(k5, q_smem.index(5).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(k6, q_smem.index(6).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _qk(k0, k1, k2, k3, k4, k5, k6, k7, q_smem, zero):
    """Logits ``S^T [64 keys, BH] = K Q^T`` of one block from the bf16 key tiles ``k0..k7``
    (raw dot products; Q ``[8, BH, 64]`` in shared memory), waited."""
    acc = _qk_groups7(k0, k1, k2, k3, k4, k5, k6, q_smem, zero)
    acc = warpgroup_mma(k7, q_smem.index(7).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(0, deps=[acc])


@gluon.jit
def _online_softmax(sT, ok, m_i, l_part, MASK: gl.constexpr = True):
    """One key block's online-softmax step on the swap-AB logits ``sT [64 keys, BH]`` (scaled,
    log2 domain; ``ok [64]``: the keys that count, unless not ``MASK``: then ``sT`` is ``-inf``
    where they do not): ``(p, alpha, m_new, l_part)`` with the running max ``m_i [BH]`` and the
    per-key partial sums ``l_part [64, BH]`` rescaled."""
    if MASK:
        sT = gl.where(ok[:, None], sT, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sT, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(sT - m_safe[None, :])
    return p, alpha, m_new, l_part * alpha[None, :] + p


@gluon.jit
def _pv(k0, k1, k2, k3, k4, k5, k6, k7, rope_s, p16, p_r, o0, o1, o2, o3, o4, o5, o6, o7,
        alpha, ROPE: gl.constexpr, WAIT: gl.constexpr = True):
    """``O^T_g = O^T_g * alpha + K_g^T P^T`` for the 8 groups, one wgmma group each in order
    and waited unless ``WAIT`` is off (``P`` in ``p16``, bf16 or fp16 as the key tiles; with
    ``ROPE`` group 7 is the bf16 RoPE tile ``rope_s`` against the bf16 ``P * 2**(127 - R)`` in
    ``p_r``, else ``k7`` against ``p16``)."""
    pT = p16.permute((1, 0))
    o0 = warpgroup_mma(k0.permute((1, 0)), pT, o0 * alpha[None, :], is_async=True)
    o1 = warpgroup_mma(k1.permute((1, 0)), pT, o1 * alpha[None, :], is_async=True)
    o2 = warpgroup_mma(k2.permute((1, 0)), pT, o2 * alpha[None, :], is_async=True)
    o3 = warpgroup_mma(k3.permute((1, 0)), pT, o3 * alpha[None, :], is_async=True)
    o4 = warpgroup_mma(k4.permute((1, 0)), pT, o4 * alpha[None, :], is_async=True)
    o5 = warpgroup_mma(k5.permute((1, 0)), pT, o5 * alpha[None, :], is_async=True)
    o6 = warpgroup_mma(k6.permute((1, 0)), pT, o6 * alpha[None, :], is_async=True)
    if ROPE:
        o7 = warpgroup_mma(rope_s.permute((1, 0)), p_r.permute((1, 0)), o7 * alpha[None, :],
                           is_async=True)
    else:
        o7 = warpgroup_mma(k7.permute((1, 0)), pT, o7 * alpha[None, :], is_async=True)
    if WAIT:
        o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(
            0, deps=[o0, o1, o2, o3, o4, o5, o6, o7])
    return o0, o1, o2, o3, o4, o5, o6, o7


#: ``mma.sync`` ``m16n8k16`` over ``[64 dims, 8 heads]``: 16 dims a warp, the same registers
#: as the 8-head wgmma accumulator (``_acc_layout(8, 4)``), so the two convert for free
MMA2_8 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 8]))
A2_8 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA2_8, k_width=2))
B2_8 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA2_8, k_width=2))
#: ``[64 keys, 8 heads]`` as ``B2_8`` places them (every warp all of them): logits and P of a
#: block in the layout of the ``O^T`` products' B operand
P_B8 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]], lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2],
                                                              [0, 4]],
    warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[64, 8]))


@gluon.jit
def _o_sync(kt, pb, o, alpha, ACC: gl.constexpr):
    """``O^T_g * alpha + K_g^T P^T`` by ``mma.sync`` (A: the key tile ``kt [64 keys, 64]``
    transposed, from shared memory; ``pb``: ``P^T`` as the B operand), in ``ACC``."""
    a = kt.permute((1, 0)).load(A2_8)
    return gl.convert_layout(mma_v2(a, pb, gl.convert_layout(o * alpha[None, :], MMA2_8)), ACC)


@gluon.jit
def _pv_sync(k0, k1, k2, k3, k4, k5, k6, k7, pb, pr, o0, o1, o2, o3, o4, o5, o6, o7, alpha,
             tfree_t, ACC: gl.constexpr, ROPE: gl.constexpr, FREE_SPLIT: gl.constexpr):
    """``_pv`` at 8 heads by ``mma.sync``: each warp's 16 dims of every group against all 64
    keys (32 ``HMMA`` and their ``ldmatrix`` a warp), done when it returns; ``pb``: ``P^T
    [64 keys, 8]`` as the B operand (``B2_8``). ``FREE_SPLIT`` (1 / 4): ``tfree_t`` is arrived
    on once every warp has read groups ``0 .. FREE_SPLIT - 1`` (0: not at all). With ``ROPE``
    group 7 is the bf16 tile ``k7`` against ``pr``."""
    o0 = _o_sync(k0, pb, o0, alpha, ACC)
    if FREE_SPLIT == 1:
        barrier()
        mbarrier.arrive(tfree_t)
    o1 = _o_sync(k1, pb, o1, alpha, ACC)
    o2 = _o_sync(k2, pb, o2, alpha, ACC)
    o3 = _o_sync(k3, pb, o3, alpha, ACC)
    if FREE_SPLIT == 4:
        barrier()
        mbarrier.arrive(tfree_t)
    o4 = _o_sync(k4, pb, o4, alpha, ACC)
    o5 = _o_sync(k5, pb, o5, alpha, ACC)
    o6 = _o_sync(k6, pb, o6, alpha, ACC)
    if ROPE:
        o7 = _o_sync(k7, pr, o7, alpha, ACC)
    else:
        o7 = _o_sync(k7, pb, o7, alpha, ACC)
    return o0, o1, o2, o3, o4, o5, o6, o7


@gluon.jit
def _store_out(orow_ptr, d0, acc, inv, hmask, ACC: gl.constexpr, TO_BF16: gl.constexpr):
    """``acc [64 dims, BH] * inv[BH]`` -> rows ``orow_ptr[h] + d0 + d``."""
    d = d0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    v = acc * inv[None, :]
    if TO_BF16:
        v = v.to(gl.bfloat16)
    gl.store(orow_ptr[None, :] + d[:, None], v, mask=hmask[None, :])


@gluon.jit
def _few_heads_epilogue(o0, o1, o2, o3, o4, o5, o6, o7, l_i, m_i, o_unit, t, split, ht, H,
                        num_splits, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr,
                        stride_lt, stride_lh, po_ptr, pl_ptr, ACC: gl.constexpr,
                        HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, BH: gl.constexpr,
                        SINK_GIVEN: gl.constexpr = False, sink_given=0):
    """Swap-AB accumulators ``o0..o7 [64 dims, BH]`` (group ``g`` = dims ``64 g ..``), the
    softmax sums ``l_i`` and maxima ``m_i [BH]`` of head tile ``ht`` -> the token's bf16 rows and
    lse (with the sink), or with ``SPLIT`` the normalized fp32 partial and its log2-sum-exp;
    ``o_unit`` multiplies the outputs (the key tiles' units). ``SINK_GIVEN``: the head tile's
    sink is ``sink_given`` (loaded ahead; ``_finish_rows``)."""
    h = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, ACC))
    hmask = h < H
    h64 = h.to(gl.int64)
    has = l_i != 0.0  # no key <=> l == 0 exactly; a NaN l propagates (docs/semantics.md)
    l_safe = gl.where(has, l_i, 1.0)
    if SPLIT:
        inv = gl.where(has, 1.0 / l_safe, 0.0)
        prow = (t * num_splits + split) * H + h64
        orow = po_ptr + prow * 512
        lse2 = gl.where(has, m_i + gl.log2(l_safe), float("-inf"))
        gl.store(pl_ptr + prow, lse2, mask=hmask)
        TO_BF16: gl.constexpr = False
    else:
        inv, lse = _finish_rows(l_i, m_i, h64, hmask, sink_ptr, sink_st, HAS_SINK, SINK_GIVEN,
                                sink_given)
        orow = out_ptr + t * stride_ot + h64 * stride_oh
        gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
        TO_BF16: gl.constexpr = True
    inv = inv * o_unit
    _store_out(orow, 0, o0, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 64, o1, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 128, o2, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 192, o3, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 256, o4, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 320, o5, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 384, o6, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 448, o7, inv, hmask, ACC, TO_BF16)


@gluon.jit
def _sparse_mla_decode_gluon_kernel(
    q_ptr, stride_qt, stride_qh,
    a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows,
    b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride, b_page, b_rows,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    po_ptr, pl_ptr,
    H, qk_scale, num_splits, num_ht,
    SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
    HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr,
    SPLIT: gl.constexpr, BH: gl.constexpr, NS: gl.constexpr, NW: gl.constexpr,
    F16: gl.constexpr = False,
):
    """Grid ``T * num_splits * num_ht`` (head tile fastest, then split, then token); ``NW``
    warps (4 or 8: with 8, two warpgroups split the copies and the dequant by keys and the
    heads of the tile in the products; ``BH >= 16``).
    ``F16``: fp16 wgmma operands (module docstring, "fp16 operands").
    Arguments as the ``tl`` decode kernel's (``_sparse_mla_fwd_grouped_kernel``)."""
    ACC: gl.constexpr = _acc_layout(BH, NW)
    L16: gl.constexpr = _copy_layout(16, NW)
    LI: gl.constexpr = gl.SliceLayout(1, L16)
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 64], gl.bfloat16)
    KDT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
    # F16: every block of 584 records (group 7 = the bf16 RoPE tail) or none
    ALL584: gl.constexpr = SRC_A == 584 and ((not HAS_B) or SRC_B == 584)
    if F16:
        gl.static_assert(ALL584 or (SRC_A != 584 and ((not HAS_B) or SRC_B != 584)),
                         "F16: 584 records mixed with 528/288 records are not supported")

    ht, split, t = _program_ids(num_ht, num_splits)

    # ---- shared memory ----------------------------------------------------------------
    USE_584: gl.constexpr = SRC_A == 584 or (HAS_B and SRC_B == 584)
    USE_288: gl.constexpr = SRC_A == 288 or (HAS_B and SRC_B == 288)
    r0, r1, r2, r3, r4, r5, r6, r7, scale_ring, rope_ring, idx_ring = _alloc_rings(
        SRC_A, SRC_B, HAS_B, NS, 32 if USE_288 else 16, True)
    k0 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k1 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k2 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k3 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k4 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k5 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k6 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    q_smem = gl.allocate_shared_memory(KDT, [8, BH, 64], QL)
    p_smem = gl.allocate_shared_memory(KDT, [BH, 64], QL)
    if F16:
        # the bf16 RoPE operands (584 records); 528/288 records put group 7 as fp16 into the
        # RoPE ring stage (reinterpreted: same bytes, same swizzle)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [BH, 64], QL)
        p_r = gl.allocate_shared_memory(gl.bfloat16, [BH, 64], QL)
    # one ring stage (``NS == 1``): the next block's gathers are issued right after this
    # block's dequant, so the RoPE tail the products read is first copied out of the ring
    ONE: gl.constexpr = NS == 1
    if ONE and USE_584:
        k7t = gl.allocate_shared_memory(gl.bfloat16, [64, 64], KL)

    # ---- this program's column ranges ---------------------------------------------------
    lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _key_ranges(
        t, split, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st, b_width,
        HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
    a_idx_row = a_idx_ptr + t * a_idx_st
    b_idx_row = b_idx_ptr + t * b_idx_st

    # ---- Q (resident) -------------------------------------------------------------------
    qrow, hq, dq = _q_rows(q_ptr, t, stride_qt, stride_qh, ht, BH, LQ)
    if F16:
        # fp16 Q: each head times 2**(141 - e) (e: the biased exponent of its amax, clamped to
        # [15, 255]) puts its amax in [2**14, 2**15); qk_h = qk_scale * 2**(e - 141) undoes it.
        # 584-only kernels leave the bf16 RoPE tail out of the amax.
        NQ: gl.constexpr = 7 if ALL584 else 8
        amax = gl.full([BH], 0.0, gl.float32, layout=gl.SliceLayout(1, LQ))
        for g in gl.static_range(NQ):
            qg = gl.load(qrow + (g * 64 + dq)[None, :], mask=(hq < H)[:, None], other=0.0)
            amax = gl.maximum(amax, gl.max(gl.abs(qg.to(gl.float32)), axis=1))
        ea = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        ea = gl.minimum(gl.maximum(ea, 15), 255)
        qmul = ((268 - ea) << 23).to(gl.float32, bitcast=True)
        for g in gl.static_range(8):
            qg = gl.load(qrow + (g * 64 + dq)[None, :], mask=(hq < H)[:, None], other=0.0)
            q_smem.index(g).store((qg.to(gl.float32) * qmul[:, None]).to(gl.float16))
            if g == 7:
                if ALL584:
                    q_r.store(qg)
        qk_h = gl.convert_layout(((ea - 14) << 23).to(gl.float32, bitcast=True),
                                 gl.SliceLayout(0, ACC)) * qk_scale
    else:
        _store_q(qrow, hq, dq, H, q_smem)

    # ---- prologue: NS - 1 blocks in flight (one with a single stage) ---------------------
    # the next block's raw ids (checked when issued, so their load's latency is not waited
    # for where they are loaded)
    na, nb = _load_idx_raw(0, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b, HAS_B,
                           LI)
    for i in gl.static_range(1 if ONE else NS - 1):
        _issue(i, _check_idx(na, nb, a_rows, b_rows, HAS_B), nblk_a, nblk, a_ptr, a_bstride,
               a_page, b_ptr, b_bstride, b_page, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring,
               scale_ring, idx_ring, SRC_A, SRC_B, HAS_B, NS, NW)
        na, nb = _load_idx_raw(i + 1, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b,
                               hi_b, HAS_B, LI)
    fence_async_shared()
    barrier()

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ACC))
    zero = gl.full([64, BH], 0.0, gl.float32, layout=ACC)
    l_part = zero  # per-thread partial sums of p, reduced once after the loop
    o0 = zero
    o1 = zero
    o2 = zero
    o3 = zero
    o4 = zero
    o5 = zero
    o6 = zero
    o7 = zero
    R = nblk * 0 + R_MIN  # F16: the running scale exponent of the key tiles

    for j in range(nblk):
        s = j % NS
        if not ONE:
            kn = j + NS - 1
            _issue(kn, _check_idx(na, nb, a_rows, b_rows, HAS_B), nblk_a, nblk, a_ptr,
                   a_bstride, a_page, b_ptr, b_bstride, b_page, r0, r1, r2, r3, r4, r5, r6, r7,
                   rope_ring, scale_ring, idx_ring, SRC_A, SRC_B, HAS_B, NS, NW)
            na, nb = _load_idx_raw(kn + 1, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row,
                                   lo_b, hi_b, HAS_B, LI)
        cp.wait_group(0 if ONE else NS - 1)
        barrier()
        scale_s = scale_ring.index(s)
        if USE_584:
            rope_s = rope_ring.index(s)
        else:
            rope_s = rope_ring.index(0)
        # the group-7 wgmma operand: the ring's RoPE tile, or (one stage) its copy
        if ONE and USE_584:
            g7 = k7t
        else:
            g7 = rope_s
        if F16:
            k7 = reinterpret(rope_s, gl.float16, [64, 64], KL)
            r_old = R
            if HAS_B and SRC_A != SRC_B:
                if j < nblk_a:
                    R = _prep_f16(s, r0, r1, r2, r3, r4, r5, r6, r7, scale_s, k0, k1, k2, k3, k4,
                                  k5, k6, k7, R, SRC_A, NW)
                else:
                    R = _prep_f16(s, r0, r1, r2, r3, r4, r5, r6, r7, scale_s, k0, k1, k2, k3, k4,
                                  k5, k6, k7, R, SRC_B, NW)
            else:
                R = _prep_f16(s, r0, r1, r2, r3, r4, r5, r6, r7, scale_s, k0, k1, k2, k3, k4, k5,
                              k6, k7, R, SRC_A, NW)
        else:
            if HAS_B and SRC_A != SRC_B:
                if j < nblk_a:
                    _dequant(s, r0, r1, r2, r3, r4, r5, r6, r7, g7, scale_s, k0, k1, k2, k3, k4,
                             k5, k6, SRC_A, NW)
                else:
                    _dequant(s, r0, r1, r2, r3, r4, r5, r6, r7, g7, scale_s, k0, k1, k2, k3, k4,
                             k5, k6, SRC_B, NW)
            else:
                _dequant(s, r0, r1, r2, r3, r4, r5, r6, r7, g7, scale_s, k0, k1, k2, k3, k4,
                         k5, k6, SRC_A, NW)
        if ONE:
            # the stage is read out (RoPE tail copied, ids in registers): the next block's
            # gathers go into it now, under this block's products
            if USE_584:
                if HAS_B and SRC_A != SRC_B:
                    if SRC_A == 584:
                        if j < nblk_a:
                            k7t.store(rope_s.load(L16))
                    else:
                        if j >= nblk_a:
                            k7t.store(rope_s.load(L16))
                else:
                    k7t.store(rope_s.load(L16))
            kidx = idx_ring.index(s).load(gl.SliceLayout(1, ACC))
        fence_async_shared()
        barrier()
        if ONE:
            _issue(j + 1, _check_idx(na, nb, a_rows, b_rows, HAS_B), nblk_a, nblk, a_ptr,
                   a_bstride, a_page, b_ptr, b_bstride, b_page, r0, r1, r2, r3, r4, r5, r6, r7,
                   rope_ring, scale_ring, idx_ring, SRC_A, SRC_B, HAS_B, NS, NW)
            na, nb = _load_idx_raw(j + 2, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row,
                                   lo_b, hi_b, HAS_B, LI)
        if F16:
            cq = qk_h * _exp2i(R - 127)
            sT = _qk_f16(k0, k1, k2, k3, k4, k5, k6, k7, g7, q_smem, q_r, zero, cq, qk_scale,
                         ALL584)
            if not ONE:
                kidx = idx_ring.index(s).load(gl.SliceLayout(1, ACC))
            p, alpha, m_i, l_part = _online_softmax(sT, kidx >= 0, m_i, l_part)
            p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
            if ALL584:
                p_r.store(gl.permute((p * _exp2i(127 - R)).to(gl.bfloat16), (1, 0)))
            fence_async_shared()
            barrier()
            alpha = alpha * _exp2i(r_old - R)
            o0, o1, o2, o3, o4, o5, o6, o7 = _pv(k0, k1, k2, k3, k4, k5, k6, k7, g7, p_smem,
                                                 p_r, o0, o1, o2, o3, o4, o5, o6, o7, alpha,
                                                 ALL584)
            barrier()
        else:
            sT = _qk(k0, k1, k2, k3, k4, k5, k6, g7, q_smem, zero)

            if not ONE:
                kidx = idx_ring.index(s).load(gl.SliceLayout(1, ACC))
            p, alpha, m_i, l_part = _online_softmax(sT * qk_scale, kidx >= 0, m_i, l_part)
            p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
            fence_async_shared()
            barrier()

            # O^T_g = O^T_g * alpha + K_g^T P^T
            o0, o1, o2, o3, o4, o5, o6, o7 = _pv(k0, k1, k2, k3, k4, k5, k6, g7, g7, p_smem,
                                                 p_smem, o0, o1, o2, o3, o4, o5, o6, o7, alpha,
                                                 False)
            barrier()
    cp.wait_group(0)
    l_i = gl.sum(l_part, axis=0)
    if F16:
        o_unit = _exp2i(R - 127)  # the key tiles' units
    else:
        o_unit = 1.0

    # ---- epilogue -----------------------------------------------------------------------
    _few_heads_epilogue(o0, o1, o2, o3, o4, o5, o6, o7, l_i, m_i, o_unit, t, split, ht, H,
                        num_splits, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr,
                        stride_lt, stride_lh, po_ptr, pl_ptr, ACC, HAS_SINK, SPLIT, BH)
