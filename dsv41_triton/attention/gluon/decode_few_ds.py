"""Few-heads sparse MLA decode for Hopper in Gluon whose dequant warpgroups also compute the
logits: ``decode_few_ws.py``'s kernel on its persistent grid (same arguments, grid and results)
with the dequant partition split into two warpgroups that take the blocks in turn (block ``G``
of the CTA's run: warpgroup ``G % 2``, ring stage and key tile ``G % 2``):

* **producer** (``decode_few_ws._producer_items``, unchanged).
* **dequant + S** (two 4-warp workers): waits ``ready[k]`` and ``tfree[k]``, converts each 64-dim
  group of the stage's records in registers, stores it into the bf16 key tile (the ``O^T``
  product's operand) and feeds the same registers to ``S^T = K Q^T`` as the wgmma's A operand
  (no shared-memory read of K for S), then stores ``S^T [64 keys, BH]`` fp32 beside the tile
  (``S_MASK``: ``-inf`` at the keys that do not count) and hands both over (``tready[k]``).
  Each warpgroup keeps its own copy of Q, loaded one item ahead, in the permuted dim order
  below.
* **MMA** (the default warpgroup, ``decode_few_ws._mma_items`` with ``S_GIVEN``): per block the
  online softmax of the handed-over ``S^T`` and ``O^T += K^T P^T``, then the prior merge and
  the epilogue. ``PV_SYNC``: every warp runs the softmax on all 64 keys (P stays in registers
  as the B operand) and its own 16 dims of each group's ``O^T`` by ``mma.sync``, so a block
  has no cross-warp reduction, no P store and no wgmma chain to wait for.

A thread of a dequant warpgroup holds, per group, keys ``16 w + l // 4`` and ``+ 8`` and the 16
consecutive dims ``16 (l % 4) ..`` (``_ds_layout``): one 16-byte read of the raw group, two
16-byte stores of bf16. The wgmma A fragment wants dims ``2 (l % 4) + {0, 1, 8, 9}`` of each
16-dim step, so the contraction runs over the dims of a group in the order ``L = 16 i + 8 h + 2
c + e`` <-> dim ``16 c + 4 i + 2 h + e`` (``_ds_perm``), Q stored in that order. The sum is the
same; the register tensor is only renamed (``_ds_a``: no data moves).

Shared memory (584 records): the ring 2 x 37.8 KB, two key tiles of 64 KB, two Q copies of 8 KB,
``S^T`` 2 x 2 KB, P 1 KB (none with ``PV_SYNC``): ~222 KB, one CTA per SM.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ._api import barrier, reinterpret
from .decode import _acc_layout, _q_group, _q_rows
from .dequant import R_MIN, _E4M3_ASM, _E4M3_F16_ASM, _block_exp, _exp2i, _ue8m0_f32
from .gather import _alloc_rings, _item_ids, _pick
from .decode_heads_ws import PRODUCER_WARPS, _alloc_ids_pre
from .decode_few_ws import _item_lens, _item_step, _mma_items, _producer_items

#: warps of each dequant + S partition (one warpgroup: the wgmma's A rows)
DS_WARPS = gl.constexpr(4)
#: registers per dequant + S thread (setmaxnreg; 104 spills around the block loop with the
#: group prefetch)
DS_REGS = gl.constexpr(112)
#: registers per producer thread (``decode_few_ws``'s on the persistent grid); the MMA
#: partition gets ``65536 / 128 - PRODUCER_REGS_DS - 2 * DS_REGS``: 208
PRODUCER_REGS_DS = gl.constexpr(80)


@gluon.constexpr_function
def _ds_layout():
    """``[64 keys, 64 dims]`` per warpgroup: warp ``w``, lane ``l`` holds keys ``16 w + l // 4``
    and ``+ 8``, dims ``16 (l % 4) .. + 15`` (registers: the 16 dims, then the second key)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64])


@gluon.jit
def _ds_perm(L):
    """Contraction position ``L`` of a 64-dim group -> its dim (``16 c + 4 i + 2 h + e`` for
    ``L = 16 i + 8 h + 2 c + e``)."""
    return 16 * ((L // 2) % 4) + 4 * (L // 16) + 2 * ((L // 8) % 2) + L % 2


@gluon.jit
def _ds_a(x, BH: gl.constexpr):
    """A group ``x [64, 64]`` in ``_ds_layout`` -> the wgmma A operand over the permuted dims
    (``_ds_perm``): a reshape / permute that renames registers."""
    DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_acc_layout(BH, 4),
                                              k_width=2)
    y = gl.permute(gl.reshape(x, [64, 4, 4, 2, 2]), (0, 2, 3, 1, 4))
    return gl.convert_layout(gl.reshape(y, [64, 64]), DOT_A)


@gluon.jit
def _ds_load(g: gl.constexpr, s: gl.constexpr, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring,
             scale_s, SRC: gl.constexpr):
    """Group ``g`` of stage ``s`` in registers (``_ds_convert``'s input): its raw bytes and
    scale bytes, ``[64, 1 | 2, 64 | 32]`` (584 / 528), or the bf16 RoPE tile (584, group 7)
    twice."""
    LX: gl.constexpr = _ds_layout()
    if SRC == 584 and g == 7:
        raw3 = rope_ring.index(s).load(LX)
        sb = raw3
    else:
        raw = _pick(g, r0, r1, r2, r3, r4, r5, r6, r7).index(s).load(LX)
        if SRC == 584:
            raw3 = gl.reshape(raw, [64, 1, 64])
            sb = scale_s.slice(g, 1, dim=1).load(gl.SliceLayout(2, raw3.type.layout))
        else:
            # 528: two scales per 64 dims; a thread's 16 dims lie in one half
            raw3 = gl.reshape(raw, [64, 2, 32])
            sb = scale_s.slice(2 * g, 2, dim=1).load(gl.SliceLayout(2, raw3.type.layout))
    return raw3, sb


#: benchmarks only (``MODE`` 1 / 3): a group's bytes spread into bf16 halves, unconverted
_SPREAD_ASM = gl.constexpr("prmt.b32 $0, $2, 0, 0x4140; prmt.b32 $1, $2, 0, 0x4342;")


@gluon.jit
def _ds_convert_f16(g: gl.constexpr, raw3, sb, R, SRC: gl.constexpr):
    """``_ds_load``'s registers -> fp16 ``[64 keys, 64]`` holding ``value * 2**(127 - R)`` in
    ``_ds_layout`` (``R``: the block's largest scale byte, at least ``R_MIN``; one ``cvt`` per
    two bytes and one multiply), or the 584 records' bf16 RoPE group as it is."""
    if SRC == 584 and g == 7:
        x = raw3
    else:
        sc = gl.broadcast(gl.expand_dims(_exp2i(sb.to(gl.int32) - R).to(gl.float16), 2),
                          raw3)[0]
        x = gl.inline_asm_elementwise(_E4M3_F16_ASM, "=r,=r,r,r,r", [raw3, sc],
                                      dtype=gl.float16, is_pure=True, pack=4)
        x = gl.convert_layout(gl.reshape(x, [64, 64]), _ds_layout())
    return x


@gluon.jit
def _ds_convert(g: gl.constexpr, raw3, sb, SRC: gl.constexpr, MODE: gl.constexpr = 0):
    """``_ds_load``'s registers -> exact bf16 ``[64 keys, 64]`` in ``_ds_layout`` (``MODE`` 1 /
    3: the bytes unconverted; 4: the fp16 conversion's instructions, values wrong)."""
    if SRC == 584 and g == 7:
        x = raw3
    elif MODE == 1 or MODE == 3:
        x = gl.inline_asm_elementwise(_SPREAD_ASM, "=r,=r,r", [raw3], dtype=gl.bfloat16,
                                      is_pure=True, pack=4)
        x = gl.convert_layout(gl.reshape(x, [64, 64]), _ds_layout())
    elif MODE == 4:
        # fp16 operands' conversion cost (the values as bf16 bits: timing only)
        x = _ds_convert_f16(g, raw3, sb, 127, SRC).to(gl.bfloat16, bitcast=True)
    else:
        sc = gl.broadcast(gl.expand_dims(_ue8m0_f32(sb), 2), raw3)[0]
        x = gl.inline_asm_elementwise(_E4M3_ASM, "=r,=r,r,r,r,r,r", [raw3, sc],
                                      dtype=gl.bfloat16, is_pure=True, pack=4)
        x = gl.convert_layout(gl.reshape(x, [64, 64]), _ds_layout())
    return x


@gluon.jit
def _ds_block(K: gl.constexpr, G, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring,
              idx_ring, k0, k1, k2, k3, k4, k5, k6, k7, kid, qp, s_buf, ready, free, tready,
              tfree, SRC: gl.constexpr, BH: gl.constexpr, PREFETCH: gl.constexpr,
              MODE: gl.constexpr = 0, F16: gl.constexpr = False, qr=None, r_buf=None, cqh=1.0,
              FREE_SPLIT: gl.constexpr = 0, tfree_b=None, S_MASK: gl.constexpr = False):
    """Block ``G`` (``G % 2 == K``): stage ``K``'s records -> bf16 key tile ``K`` and ``S^T``
    (raw dot products, fp32) into ``s_buf[K]``; ``free[K]`` once the stage is read,
    ``tready[K]`` once both are stored. The stage is freed as soon as its last group is loaded
    (before groups 6 and 7 are converted). ``PREFETCH``: each group's bytes are loaded one
    group ahead. ``MODE`` (benchmarks only): 1 no conversion, 2 no ``S^T`` products (``S^T``
    zero), 3 neither, 4 the fp16 operands' conversion (wrong values), 5 (``F16``) ``R = 127``
    without the block's maximum (wrong values where a scale byte exceeds it). ``F16``: fp16
    key tiles holding ``value * 2**(127 - R)`` (``R``: the block's largest scale byte, at
    least ``R_MIN``, stored to ``r_buf[K]``) against the fp16 Q groups of ``qp`` (each head
    times ``1 / cqh``); 584 records' bf16 RoPE group against the bf16 Q tail ``qr`` in an
    accumulator of its own; ``S^T`` stored in true units. ``FREE_SPLIT`` (1 or 4; 0 off): tile
    ``K`` is taken in two parts, groups ``0 .. FREE_SPLIT - 1`` (with ``kid[K]``) after
    ``tfree[K]``, the rest after ``tfree_b[K]`` (the MMA warpgroup's ``FREE_SPLIT``), so the
    block's first loads, conversion and products overlap the ``O^T`` products still reading
    the tile. ``S_MASK``: ``S^T`` stored ``-inf`` at the keys that do not count (their ids read
    from the stage before it is freed) and ``kid[K]`` not written."""
    ACC: gl.constexpr = _acc_layout(BH, 4)
    ROPE: gl.constexpr = F16 and SRC == 584
    LI: gl.constexpr = gl.BlockedLayout([1], [32], [DS_WARPS], [0])
    mbarrier.wait(ready.index(K), (G // 2) & 1)
    scale_s = scale_ring.index(K)
    if S_MASK:
        okk = idx_ring.index(K).load(gl.SliceLayout(1, ACC)) >= 0
    if FREE_SPLIT == 0:
        mbarrier.wait(tfree.index(K), ((G // 2) & 1) ^ 1)
        if not S_MASK:
            kid.index(K).store(idx_ring.index(K).load(LI))
    acc = gl.full([64, BH], 0.0, gl.float32, layout=ACC)
    acr = acc
    prev = acc
    R = 0
    if F16 and MODE == 5:
        R = 127
    elif F16:
        R = gl.maximum(_block_exp(scale_s, SRC, DS_WARPS), R_MIN)
    raw, sb = _ds_load(0, K, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC)
    for g in gl.static_range(8):
        if PREFETCH and g < 7:
            # group g + 1's loads ahead of group g's stores (ptxas keeps shared loads and
            # stores in program order)
            nraw, nsb = _ds_load(g + 1, K, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s,
                                 SRC)
        if F16 and (MODE == 1 or MODE == 3):
            x = _ds_convert(g, raw, sb, SRC, MODE)
            if SRC != 584 or g < 7:
                x = x.to(gl.float16, bitcast=True)
        elif F16:
            x = _ds_convert_f16(g, raw, sb, R, SRC)
        else:
            x = _ds_convert(g, raw, sb, SRC, MODE)
        if FREE_SPLIT == 0:
            _pick(g, k0, k1, k2, k3, k4, k5, k6, k7).index(K).store(x)
        if MODE != 2 and MODE != 3:
            a = _ds_a(x, BH)
            if ROPE and g == 7:
                acr = warpgroup_mma(a, qr.permute((1, 0)), acr, use_acc=False, is_async=True)
            else:
                acc = warpgroup_mma(a, qp.index(g).permute((1, 0)), acc, use_acc=g > 0,
                                    is_async=True)
            if g > 0:
                acc, prev = warpgroup_mma_wait(1, deps=[acc, prev])
            prev = a
        if FREE_SPLIT > 0:
            # the products are issued first: the conversion precedes the waits (a pure value
            # used only by the store would be sunk past them)
            if g == 0:
                mbarrier.wait(tfree.index(K), ((G // 2) & 1) ^ 1)
                if not S_MASK:
                    kid.index(K).store(idx_ring.index(K).load(LI))
            if g == FREE_SPLIT:
                mbarrier.wait(tfree_b.index(K), ((G // 2) & 1) ^ 1)
            _pick(g, k0, k1, k2, k3, k4, k5, k6, k7).index(K).store(x)
        if g < 7:
            if PREFETCH:
                raw = nraw
                sb = nsb
            else:
                raw, sb = _ds_load(g + 1, K, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring,
                                   scale_s, SRC)
        if g == 6:
            # the last group is in registers: the stage is refilled while groups 6 and 7
            # are converted and multiplied
            barrier()  # every thread's stage reads precede the release
            mbarrier.arrive(free.index(K))
    if MODE != 2 and MODE != 3:
        acc, acr, prev = warpgroup_mma_wait(0, deps=[acc, acr, prev])
    if F16:
        # true units: the fp16 groups times 2**(R - 127) and the head's cqh
        acc = acc * (cqh * _exp2i(R - 127))[None, :]
        if ROPE:
            acc = acc + acr
        r_buf.index(K).store(gl.full([BH], 0, gl.int32, layout=gl.SliceLayout(0, ACC)) + R)
    if S_MASK:
        acc = gl.where(okk[:, None], acc, float("-inf"))
    s_buf.index(K).store(acc)
    fence_async_shared()  # the key tiles are read by the MMA partition's products
    barrier()  # every thread's tile and S^T stores precede the hand-over
    mbarrier.arrive(tready.index(K))


@gluon.jit
def _ds_q(q_ptr, item, num_items, num_ht, num_splits, stride_qt, stride_qh, H,
          BH: gl.constexpr):
    """Q of item ``min(item, num_items - 1)``: eight ``[BH, 64]`` groups, each group's dims in
    the contraction order of ``_ds_perm`` (heads ``>= H`` as 0)."""
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [DS_WARPS, 1], [1, 0])
    ht, split, t = _item_ids(gl.minimum(item, num_items - 1), num_ht, num_splits)
    qrow, hq, dq = _q_rows(q_ptr, t, stride_qt, stride_qh, ht, BH, LQ)
    dq = _ds_perm(dq)
    return (_q_group(qrow, hq, dq, H, 0), _q_group(qrow, hq, dq, H, 1),
            _q_group(qrow, hq, dq, H, 2), _q_group(qrow, hq, dq, H, 3),
            _q_group(qrow, hq, dq, H, 4), _q_group(qrow, hq, dq, H, 5),
            _q_group(qrow, hq, dq, H, 6), _q_group(qrow, hq, dq, H, 7))


@gluon.jit
def _ds_q_store(qp, q0, q1, q2, q3, q4, q5, q6, q7, SRC: gl.constexpr, BH: gl.constexpr,
                F16: gl.constexpr):
    """An item's Q groups (``_ds_q``) into the warpgroup's copy ``qp``; with ``F16`` as fp16,
    each head times ``2**(141 - e)`` (``e``: the biased exponent of its amax over the fp16
    groups, clamped to ``[15, 255]``: the amax lands in ``[2**14, 2**15)``), 584 records' RoPE
    tail as bf16 into ``qp[7]`` (same bytes); returns ``cqh = 2**(e - 141) [BH]`` (1 without
    ``F16``) in the accumulator's head layout."""
    ACC: gl.constexpr = _acc_layout(BH, 4)
    if F16:
        NQ: gl.constexpr = 7 if SRC == 584 else 8
        amax = gl.max(gl.abs(q0.to(gl.float32)), axis=1)
        for g in gl.static_range(1, NQ):
            qg = _pick(g, q0, q1, q2, q3, q4, q5, q6, q7)
            amax = gl.maximum(amax, gl.max(gl.abs(qg.to(gl.float32)), axis=1))
        ea = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        ea = gl.minimum(gl.maximum(ea, 15), 255)
        qm = ((268 - ea) << 23).to(gl.float32, bitcast=True)[:, None]
        for g in gl.static_range(NQ):
            qg = _pick(g, q0, q1, q2, q3, q4, q5, q6, q7)
            qp.index(g).store((qg.to(gl.float32) * qm).to(gl.float16))
        if NQ == 7:
            _ds_q_rope(qp, BH).store(q7)
        cqh = gl.convert_layout(((ea - 14) << 23).to(gl.float32, bitcast=True),
                                gl.SliceLayout(0, ACC))
    else:
        for g in gl.static_range(8):
            qp.index(g).store(_pick(g, q0, q1, q2, q3, q4, q5, q6, q7))
        cqh = gl.full([BH], 1.0, gl.float32, layout=gl.SliceLayout(0, ACC))
    return cqh


@gluon.jit
def _ds_q_rope(qp, BH: gl.constexpr):
    """``qp[7]`` (fp16 Q copy) viewed as the bf16 RoPE tail ``[BH, 64]`` (same bytes)."""
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 64], gl.bfloat16)
    return reinterpret(qp.index(7), gl.bfloat16, [BH, 64], QL)


@gluon.jit
def _ds_items(K: gl.constexpr, num_items, num_ht, num_splits, a_len_ptr, a_len_st, a_width,
              b_len_ptr, b_len_st, b_width, q_ptr, stride_qt, stride_qh, H, r0, r1, r2, r3, r4,
              r5, r6, r7, rope_ring, scale_ring, idx_ring, k0, k1, k2, k3, k4, k5, k6, k7, kid,
              qp, s_buf, ready, free, tready, tfree, SRC: gl.constexpr, HAS_B: gl.constexpr,
              HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, SPLIT: gl.constexpr,
              BH: gl.constexpr, PREFETCH: gl.constexpr, MODE: gl.constexpr = 0,
              F16: gl.constexpr = False, r_buf=None, FREE_SPLIT: gl.constexpr = 0,
              tfree_b=None, S_MASK: gl.constexpr = False):
    """Dequant + S warpgroup ``K`` over this CTA's items: the blocks ``G`` of the CTA's run with
    ``G % 2 == K``, all of one record width ``SRC``. Its Q copy ``qp`` is rewritten at the
    start of an item it has blocks in (its previous wgmmas were waited), from registers loaded
    one item ahead."""
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    la, lb = _item_lens(pid, num_items, num_ht, num_splits, a_len_ptr, a_len_st, b_len_ptr,
                        b_len_st, HAS_B, HAS_LEN_A, HAS_LEN_B)
    q0, q1, q2, q3, q4, q5, q6, q7 = _ds_q(q_ptr, pid, num_items, num_ht, num_splits,
                                           stride_qt, stride_qh, H, BH)
    if F16 and SRC == 584:
        qr = _ds_q_rope(qp, BH)
    else:
        qr = qp.index(7)
    cqh = gl.full([BH], 1.0, gl.float32, layout=gl.SliceLayout(0, _acc_layout(BH, 4)))
    g = 0
    for item in range(pid, num_items, grid):
        ht, split, t, lo_a, hi_a, lo_b, hi_b, nblk_a, nblk, la, lb = _item_step(
            item, grid, num_items, la, lb, num_ht, num_splits, a_len_ptr, a_len_st, a_width,
            b_len_ptr, b_len_st, b_width, HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
        n0, n1, n2, n3, n4, n5, n6, n7 = _ds_q(q_ptr, item + grid, num_items, num_ht,
                                               num_splits, stride_qt, stride_qh, H, BH)
        j0 = (K + 2 - g % 2) % 2
        if j0 < nblk:
            cqh = _ds_q_store(qp, q0, q1, q2, q3, q4, q5, q6, q7, SRC, BH, F16)
            fence_async_shared()
            barrier()
        for j in range(j0, nblk, 2):
            _ds_block(K, g + j, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring,
                      k0, k1, k2, k3, k4, k5, k6, k7, kid, qp, s_buf, ready, free, tready, tfree,
                      SRC, BH, PREFETCH, MODE, F16, qr, r_buf, cqh, FREE_SPLIT,
                      tfree_b, S_MASK)
        g += nblk
        q0 = n0
        q1 = n1
        q2 = n2
        q3 = n3
        q4 = n4
        q5 = n5
        q6 = n6
        q7 = n7


@gluon.jit
def _sparse_mla_decode_few_ds_kernel(
    q_ptr, stride_qt, stride_qh,
    a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows,
    b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride, b_page, b_rows,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    po_ptr, pl_ptr,
    H, qk_scale, num_splits, num_ht, num_items,
    SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
    HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr,
    SPLIT: gl.constexpr, BH: gl.constexpr, IDX_AHEAD: gl.constexpr = 1,
    DEQ_PREFETCH: gl.constexpr = True, PRIOR: gl.constexpr = False, MODE: gl.constexpr = 0,
    F16: gl.constexpr = False, FREE_SPLIT: gl.constexpr = 0, PV_SYNC: gl.constexpr = False,
    S_MASK: gl.constexpr = False,
):
    """Persistent grid of at most one CTA per SM over the ``num_items = T * num_splits *
    num_ht`` items (``decode_few_ws``'s ``PERSIST``); launch with ``num_warps=MMA_WARPS``.
    Arguments as ``decode_few_ws._sparse_mla_decode_few_ws_kernel``'s (two ring stages, two key
    tiles; 8-head tiles; e4m3 records, 584 or 528); ``DEQ_PREFETCH``: the dequant + S
    warpgroups load each group's bytes one group ahead; ``MODE`` (benchmarks only): see
    ``_ds_block``; ``F16``: fp16 operands in each block's own units (``_ds_block``,
    ``decode_few_ws._mma_part``'s ``S_F16``; with 584 records it fits with ``IDX_AHEAD`` 1 or
    2, not the preload);
    ``FREE_SPLIT``: each key tile freed and retaken in two parts (``_ds_block``); ``PV_SYNC``:
    the MMA warpgroup's softmax per warp and its ``O^T`` products by ``mma.sync``
    (``decode_few_ws._mma_part``); ``S_MASK``: the keys that do not count masked in ``S^T``
    by the dequant + S warpgroups, not by the MMA warpgroup."""
    gl.static_assert(BH == 8, "8-head tiles")
    gl.static_assert(FREE_SPLIT == 0 or FREE_SPLIT == 1 or FREE_SPLIT == 4, "FREE_SPLIT 0, 1, 4")
    gl.static_assert(SRC_A != 288 and (not HAS_B or SRC_B != 288), "e4m3 records")
    gl.static_assert(not HAS_B or SRC_A == SRC_B, "one record width (two rings do not fit)")
    r0, r1, r2, r3, r4, r5, r6, r7, scale_ring, rope_ring, idx_ring = _alloc_rings(
        SRC_A, SRC_B, HAS_B, 2, 16, False)
    ROPE: gl.constexpr = F16 and SRC_A == 584  # fp16 tiles beside the bf16 RoPE group
    KDT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
    K7T: gl.constexpr = gl.bfloat16 if ROPE else KDT
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], KDT)
    K7L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], K7T)
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 64], KDT)
    k0 = gl.allocate_shared_memory(KDT, [2, 64, 64], KL)
    k1 = gl.allocate_shared_memory(KDT, [2, 64, 64], KL)
    k2 = gl.allocate_shared_memory(KDT, [2, 64, 64], KL)
    k3 = gl.allocate_shared_memory(KDT, [2, 64, 64], KL)
    k4 = gl.allocate_shared_memory(KDT, [2, 64, 64], KL)
    k5 = gl.allocate_shared_memory(KDT, [2, 64, 64], KL)
    k6 = gl.allocate_shared_memory(KDT, [2, 64, 64], KL)
    k7 = gl.allocate_shared_memory(K7T, [2, 64, 64], K7L)
    kid = gl.allocate_shared_memory(gl.int32, [2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    qp0 = gl.allocate_shared_memory(KDT, [8, BH, 64], QL)
    qp1 = gl.allocate_shared_memory(KDT, [8, BH, 64], QL)
    s_buf = gl.allocate_shared_memory(gl.float32, [2, 64, BH],
                                      gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    if PV_SYNC:  # P stays in registers
        p_smem = s_buf
    else:
        p_smem = gl.allocate_shared_memory(KDT, [BH, 64], QL)
    if F16:
        r_buf = gl.allocate_shared_memory(gl.int32, [2, BH],
                                          gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        r_buf = kid
    if ROPE and not PV_SYNC:
        p_r = gl.allocate_shared_memory(gl.bfloat16, [BH, 64],
                                        gl.NVMMASharedLayout.get_default_for([BH, 64],
                                                                             gl.bfloat16))
    else:
        p_r = p_smem
    ids_pre = _alloc_ids_pre(idx_ring, IDX_AHEAD)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if FREE_SPLIT > 0:
        tfree_b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    else:
        tfree_b = tfree
    for i in gl.static_range(2):
        mbarrier.init(ready.index(i), count=32 * PRODUCER_WARPS + 1)
        mbarrier.init(free.index(i), count=1)
        mbarrier.init(tready.index(i), count=1)
        mbarrier.init(tfree.index(i), count=1)
        if FREE_SPLIT > 0:
            mbarrier.init(tfree_b.index(i), count=1)

    gl.warp_specialize([
        (_mma_items, (num_items, num_ht, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr,
                      b_len_st, b_width, q_ptr, stride_qt, stride_qh, H, qk_scale, sink_ptr,
                      sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
                      po_ptr, pl_ptr, k0, k1, k2, k3, k4, k5, k6, k7, kid, p_smem, p_smem,
                      tready, tfree, HAS_B, HAS_LEN_A, HAS_LEN_B, HAS_SINK, SPLIT, BH, 2, PRIOR,
                      0, s_buf, True, p_r, r_buf, F16, ROPE, FREE_SPLIT,
                      tfree_b, PV_SYNC, S_MASK)),
        (_producer_items, (num_items, num_ht, num_splits, a_ptr, a_idx_ptr, a_idx_st,
                           a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows, b_ptr,
                           b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride,
                           b_page, b_rows, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring,
                           scale_ring, idx_ring, ids_pre, ready, free, SRC_A, SRC_B, HAS_B,
                           HAS_LEN_A, HAS_LEN_B, SPLIT, 2, IDX_AHEAD)),
        (_ds_items, (0, num_items, num_ht, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr,
                       b_len_st, b_width, q_ptr, stride_qt, stride_qh, H, r0, r1, r2, r3, r4,
                       r5, r6, r7, rope_ring, scale_ring, idx_ring, k0, k1, k2, k3, k4, k5, k6,
                       k7, kid, qp0, s_buf, ready, free, tready, tfree, SRC_A, HAS_B,
                       HAS_LEN_A, HAS_LEN_B, SPLIT, BH, DEQ_PREFETCH, MODE, F16, r_buf,
                       FREE_SPLIT, tfree_b, S_MASK)),
        (_ds_items, (1, num_items, num_ht, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr,
                       b_len_st, b_width, q_ptr, stride_qt, stride_qh, H, r0, r1, r2, r3, r4,
                       r5, r6, r7, rope_ring, scale_ring, idx_ring, k0, k1, k2, k3, k4, k5, k6,
                       k7, kid, qp1, s_buf, ready, free, tready, tfree, SRC_A, HAS_B,
                       HAS_LEN_A, HAS_LEN_B, SPLIT, BH, DEQ_PREFETCH, MODE, F16, r_buf,
                       FREE_SPLIT, tfree_b, S_MASK)),
    ], [PRODUCER_WARPS, DS_WARPS, DS_WARPS],
        [PRODUCER_REGS_DS, DS_REGS, DS_REGS])
