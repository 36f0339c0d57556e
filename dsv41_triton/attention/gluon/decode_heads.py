"""Sparse MLA decode for Hopper in Gluon, many heads: ``sparse_mla_decode``'s contract (SPEC §3,
§4, §6) with heads on the wgmma M.

One CTA (8 warps: two warpgroups) owns one query token, a tile of 64 heads and one key split;
it walks the window keys then the extra keys of its split in blocks of 64 keys through one
online softmax. Per block:

1. **gather** (``NS`` blocks ahead; block ``j + NS`` is issued into block ``j``'s consumed
   stage while block ``j``'s O wgmma runs): the block's slot ids become byte offsets and
   ``cp.async`` copies the raw records into stage ``k % NS`` of a shared ring
   (``gather._issue`` / ``gather._copy_keys``).
2. **dequant** by all 8 warps (exact, ``dequant._dequant``'s arithmetic) of the eight 64-dim
   groups into registers (for 584 records group 7 is the raw bf16 RoPE tail of the ring), then
   ONE store of the whole bf16 key tile ``[64 keys, 512]`` (NVMMA-swizzled): no CTA barriers
   between the groups. With ``OVERLAP`` (the default) block ``j + 1``'s registers are computed
   while block ``j``'s O wgmma runs and stored once that wgmma is done; without it, after.
3. ``S [64 heads, 64 keys] = Q [64, 512] · K^T`` in one async wgmma whose accumulator layout
   has ``warps_per_cta = [4, 2]``: each warpgroup computes 32 of the keys over all 512 dims.
   Online exp2 softmax (each warpgroup's row max in-warp, exchanged through a ``[64, 2]``
   shared tile: one barrier), P (bf16) stored to a ``[64, 64]`` shared tile; the row sums stay
   per thread until the epilogue.
4. ``O [64 heads, 512] += P · K`` in one async wgmma with ``warps_per_cta = [4, 2]``: each
   warpgroup owns 256 value dims (128 fp32 registers per thread).

Q stays in shared memory (64 KB). Splits write normalized fp32 partials and their
log2-sum-exp, combined (with the sink) by the ``tl`` merge kernel. No host sync, fixed launch
shapes: CUDA-graph safe.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ._api import barrier
from .common import _finish_rows, row_store_layout
from .dequant import _dequant_group
from .gather import _alloc_rings, _copy_layout, _issue, _key_ranges, _load_idx, _program_ids

#: heads per CTA (the wgmma M)
BH = gl.constexpr(64)
#: warps per CTA (two warpgroups)
NW = gl.constexpr(8)
#: the epilogue's store layout of the ``[64, 512]`` O accumulator (two warpgroups side by side)
O_ST = gl.constexpr(row_store_layout(256, [[16, 0], [32, 0], [0, 256]]))


@gluon.jit
def _cat4(x0, x1, x2, x3):
    """Four ``[64, 64]`` register tiles side by side -> ``[64, 256]`` (no data movement: the
    group index becomes register bits of the layout)."""
    a = gl.join(gl.join(x0, x1), gl.join(x2, x3))  # [64, 64, 2 (g & 1), 2 (g >> 1)]
    return gl.reshape(gl.permute(a, (0, 3, 2, 1)), [64, 256])


@gluon.jit
def _dequant_src(s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC: gl.constexpr):
    """Stage ``s`` (records ``SRC``) as the bf16 key tile ``[64 keys, 512]`` in registers (64
    per thread), stored by the caller in ONE shared store: membar puts a CTA barrier between
    any two stores into one allocation, even into disjoint column slices."""
    x0 = _dequant_group(0, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC, NW)
    x1 = _dequant_group(1, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC, NW)
    x2 = _dequant_group(2, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC, NW)
    x3 = _dequant_group(3, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC, NW)
    lo = _cat4(x0, x1, x2, x3)
    x4 = _dequant_group(4, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC, NW)
    x5 = _dequant_group(5, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC, NW)
    x6 = _dequant_group(6, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC, NW)
    x7 = _dequant_group(7, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC, NW)
    hi = _cat4(x4, x5, x6, x7)
    return gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [64, 512])


@gluon.jit
def _dequant_keys(j, nblk_a, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring,
                  SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
                  NS: gl.constexpr):
    """Block ``j`` (window keys below ``nblk_a``, then extra keys; ring stage ``j % NS``) as the
    bf16 key tile ``[64, 512]`` in registers."""
    s = j % NS
    scale_s = scale_ring.index(s)
    if HAS_B and SRC_A != SRC_B:
        if j < nblk_a:
            x = _dequant_src(s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC_A)
        else:
            x = _dequant_src(s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC_B)
    else:
        x = _dequant_src(s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC_A)
    return x


@gluon.jit
def _thread_sums(p):
    """``p [64 heads, 64 keys]`` in the S accumulator layout -> ``[64, 2, 4]``: each thread's
    sum of its own 8 keys (no data movement: in that layout key = warpgroup * 32 + 8 * i +
    2 * (lane % 4) + e with ``i``, ``e`` register bits)."""
    return gl.sum(gl.sum(gl.reshape(p, [64, 2, 4, 4, 2]), axis=4), axis=2)


@gluon.jit
def _alloc_tiles():
    """The bf16 key tile ``[64 keys, 512]``, Q ``[64 heads, 512]`` (NVMMA-swizzled), P ``[64,
    64]`` and the two warpgroups' row maxima of S ``[64, 2]`` fp32 (one exchange, one barrier
    per block)."""
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    WL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], WL)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], WL)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 64], KL)
    mx_smem = gl.allocate_shared_memory(gl.float32, [BH, 2], PLAIN2)
    return k_smem, q_smem, p_smem, mx_smem


@gluon.jit
def _qk_softmax(q_smem, k_smem, p_smem, mx_smem, kidx, m_i, l_part, zero_s, qk_scale):
    """One block's ``S = Q K^T`` (the key tile stored and fenced, all warps past a barrier),
    online exp2 softmax, P (bf16) stored to ``p_smem`` and fenced behind a barrier. ``kidx``:
    the block's ids (``-1`` = no key) along S's columns. Returns (alpha, m_i, l_part)."""
    SACC: gl.constexpr = zero_s.type.layout
    # [64 heads, 2 warpgroups]: the S accumulator's row distribution with both warpgroups'
    # entries in each thread's registers (SliceLayout(1, MX2) == SliceLayout(1, SACC))
    MX2: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0], [0, 1]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0], [0, 0]], block_bases=[], shape=[64, 2])
    LROW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, l_part.type.layout))
    # S = Q K^T [64 heads, 64 keys]
    acc = warpgroup_mma(q_smem, k_smem.permute((1, 0)), zero_s, use_acc=False,
                        is_async=True)
    sc = warpgroup_mma_wait(0, deps=[acc])

    sc = gl.where((kidx >= 0)[None, :], sc * qk_scale, float("-inf"))
    # row max: each warpgroup's over its 32 keys (in-warp), exchanged through shared memory
    mx_smem.store(gl.max(gl.reshape(sc, [BH, 2, 32]), axis=2))
    barrier()
    m_blk = gl.convert_layout(gl.max(mx_smem.load(MX2), axis=1), gl.SliceLayout(1, SACC))
    m_new = gl.maximum(m_i, m_blk)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(sc - m_safe[:, None])
    l_part = l_part * gl.convert_layout(alpha, LROW)[:, None, None] + _thread_sums(p)
    m_i = m_new
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    barrier()
    return alpha, m_i, l_part


@gluon.jit
def _heads_epilogue(o, l_part, m_i, t, split, ht, H, num_splits, sink_ptr, sink_st, out_ptr,
                    stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, po_ptr, pl_ptr, k_smem,
                    HAS_SINK: gl.constexpr, SPLIT: gl.constexpr):
    """Rows of one 64-head tile from ``o [64, 512]`` (O accumulator layout), the per-thread
    row sums ``l_part`` and the row maxima ``m_i``: normalized fp32 partials + log2-sum-exp
    (``SPLIT``) or bf16 out + lse with the sink (``_finish_rows``). The bf16 rows go through
    the (then unused) key tile ``k_smem`` into ``O_ST`` for 16-byte stores; the caller's
    warps have all waited their last wgmma on ``k_smem``."""
    OACC: gl.constexpr = o.type.layout
    l_i = gl.convert_layout(gl.sum(gl.sum(l_part, axis=2), axis=1), gl.SliceLayout(1, OACC))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, OACC))
    h = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, OACC))
    hmask = h < H
    h64 = h.to(gl.int64)
    has = l_i != 0.0  # no key <=> l == 0 exactly; a NaN l propagates (docs/semantics.md)
    l_safe = gl.where(has, l_i, 1.0)
    if SPLIT:
        inv = gl.where(has, 1.0 / l_safe, 0.0)
        prow = (t * num_splits + split) * H + h64
        lse2 = gl.where(has, m_o + gl.log2(l_safe), float("-inf"))
        gl.store(pl_ptr + prow, lse2, mask=hmask)
        d = gl.arange(0, 512, layout=gl.SliceLayout(0, OACC))
        gl.store(po_ptr + (prow * 512)[:, None] + d[None, :], o * inv[:, None],
                 mask=hmask[:, None])
    else:
        inv, lse = _finish_rows(l_i, m_o, h64, hmask, sink_ptr, sink_st, HAS_SINK)
        gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
        barrier()  # every warp's last O wgmma has read k_smem
        k_smem.store((o * inv[:, None]).to(gl.bfloat16))
        barrier()
        hs = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, O_ST))
        ds = gl.arange(0, 512, layout=gl.SliceLayout(0, O_ST))
        orow = out_ptr + t * stride_ot + hs.to(gl.int64) * stride_oh
        gl.store(orow[:, None] + ds[None, :], k_smem.load(O_ST), mask=(hs < H)[:, None])


@gluon.jit
def _sparse_mla_decode_heads_kernel(
    q_ptr, stride_qt, stride_qh,
    a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows,
    b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride, b_page, b_rows,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    po_ptr, pl_ptr,
    H, qk_scale, num_splits, num_ht,
    SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
    HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr,
    SPLIT: gl.constexpr, NS: gl.constexpr, OVERLAP: gl.constexpr = True,
):
    """Grid ``T * num_splits * num_ht`` (head tile of 64 fastest, then split, then token), 8
    warps. Arguments as the ``tl`` decode kernel's (``_sparse_mla_fwd_grouped_kernel``)."""
    SACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                   instr_shape=[16, 32, 16])
    OACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                   instr_shape=[16, 256, 16])
    L16: gl.constexpr = _copy_layout(16, NW)
    LI: gl.constexpr = gl.SliceLayout(1, L16)
    LB: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])
    ht, split, t = _program_ids(num_ht, num_splits)

    # ---- shared memory ----------------------------------------------------------------
    r0, r1, r2, r3, r4, r5, r6, r7, scale_ring, rope_ring, idx_ring = _alloc_rings(
        SRC_A, SRC_B, HAS_B, NS, 64, False)
    k_smem, q_smem, p_smem, mx_smem = _alloc_tiles()

    # ---- this program's column ranges ---------------------------------------------------
    lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _key_ranges(
        t, split, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st, b_width,
        HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
    a_idx_row = a_idx_ptr + t * a_idx_st
    b_idx_row = b_idx_ptr + t * b_idx_st

    # ---- prologue: NS blocks in flight, then Q (resident) -------------------------------
    nidx = _load_idx(0, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row, lo_b, hi_b,
                     b_rows, HAS_B, LI)
    for i in gl.static_range(NS):
        _issue(i, nidx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride, b_page,
               r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, SRC_A, SRC_B,
               HAS_B, NS, NW)
        nidx = _load_idx(i + 1, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row, lo_b,
                         hi_b, b_rows, HAS_B, LI)
    hq = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, LB))
    dq = gl.arange(0, 512, layout=gl.SliceLayout(0, LB))
    qrow = q_ptr + t * stride_qt + hq.to(gl.int64)[:, None] * stride_qh
    # one store (64 registers per thread; nothing else is live yet): no barriers between slices
    q_smem.store(gl.load(qrow + dq[None, :], mask=(hq < H)[:, None], other=0.0))

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, SACC))
    zero_s = gl.full([BH, 64], 0.0, gl.float32, layout=SACC)
    l_part = _thread_sums(zero_s)  # per-thread partial sums of p, reduced once after the loop
    o = gl.full([BH, 512], 0.0, gl.float32, layout=OACC)

    if OVERLAP:
        # block 0's keys into registers; each later block's under the previous O wgmma
        cp.wait_group(NS - 1)
        barrier()
        kt = _dequant_keys(0, nblk_a, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring,
                           SRC_A, SRC_B, HAS_B, NS)

    for j in range(nblk):
        s = j % NS
        if not OVERLAP:
            cp.wait_group(NS - 1)
            barrier()
            kt = _dequant_keys(j, nblk_a, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring,
                               SRC_A, SRC_B, HAS_B, NS)
        # read before the next block's ids overwrite the other stage (no extra barrier)
        kidx = idx_ring.index(s).load(gl.SliceLayout(0, SACC))
        # the ids of block j + NS + 1, loaded a whole block before their checks are needed
        kn = j + NS
        nidx_next = _load_idx(kn + 1, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row,
                              lo_b, hi_b, b_rows, HAS_B, LI)
        if OVERLAP:
            barrier()  # both warpgroups' O wgmmas of block j - 1 are done with k_smem
        k_smem.store(kt)
        fence_async_shared()
        barrier()

        alpha, m_i, l_part = _qk_softmax(q_smem, k_smem, p_smem, mx_smem, kidx, m_i, l_part,
                                         zero_s, qk_scale)

        # O = O * alpha + P K  [64 heads, 512]
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, OACC))
        o = warpgroup_mma(p_smem, k_smem, o * alpha_o[:, None], is_async=True)
        # block j + NS's gathers go into this block's (consumed) stage, under the O wgmma
        _issue(kn, nidx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride, b_page,
               r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, SRC_A, SRC_B,
               HAS_B, NS, NW)
        nidx = nidx_next
        if OVERLAP:
            # block j + 1's raw bytes -> bf16 registers while the O wgmma runs
            cp.wait_group(NS - 1)
            barrier()
            if j + 1 < nblk:
                kt = _dequant_keys(j + 1, nblk_a, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring,
                                   scale_ring, SRC_A, SRC_B, HAS_B, NS)
        o = warpgroup_mma_wait(0, deps=[o])
    cp.wait_group(0)
    _heads_epilogue(o, l_part, m_i, t, split, ht, H, num_splits, sink_ptr, sink_st, out_ptr,
                    stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, po_ptr, pl_ptr, k_smem,
                    HAS_SINK, SPLIT)
