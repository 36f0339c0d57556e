"""Sparse MLA decode for Hopper in Gluon, many heads: ``sparse_mla_decode``'s contract (SPEC §3,
§4, §6) with heads on the wgmma M.

One CTA (8 warps: two warpgroups) owns one query token, a tile of 64 heads and one key split;
it walks the window keys then the extra keys of its split in blocks of 64 keys through one
online softmax. Per block:

1. **gather** (``NS`` blocks ahead; block ``j + NS`` is issued into block ``j``'s consumed
   stage while block ``j``'s O wgmma runs): the block's slot ids become byte offsets and
   ``cp.async`` copies the raw records into stage ``k % NS`` of a shared ring
   (``decode._issue`` / ``decode._copy_keys``).
2. **dequant** by all 8 warps (``decode._dequant``, exact) into one bf16 key tile
   ``[64 keys, 512]`` (NVMMA-swizzled); for 584 records the raw bf16 RoPE tail is copied from
   the ring into the tile's last 64 dims.
3. ``S [64 heads, 64 keys] = Q [64, 512] · K^T`` in one async wgmma whose accumulator layout
   has ``warps_per_cta = [4, 2]``: each warpgroup computes 32 of the keys over all 512 dims.
   Online exp2 softmax (the row max crosses the two warpgroups), P (bf16) stored to a
   ``[64, 64]`` shared tile.
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

from .decode import LOG2E, _copy_layout, _dequant, _issue, _load_idx

#: heads per CTA (the wgmma M)
BH = gl.constexpr(64)
#: warps per CTA (two warpgroups)
NW = gl.constexpr(8)


@gluon.jit
def _dequant_src(s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, k0, k1, k2, k3, k4, k5,
                 k6, k7, SRC: gl.constexpr):
    """Stage ``s`` (records ``SRC``) into the key tile slices ``k0..k7`` (584: group 7 is the
    raw RoPE tail, copied from the ring)."""
    _dequant(s, r0, r1, r2, r3, r4, r5, r6, r7, k7, scale_s, k0, k1, k2, k3, k4, k5, k6, SRC, NW)
    if SRC == 584:
        k7.store(rope_ring.index(s).load(gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0])))


@gluon.jit
def _dequant_keys(j, s, nblk_a, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, k0, k1, k2,
                  k3, k4, k5, k6, k7, SRC_A: gl.constexpr, SRC_B: gl.constexpr,
                  HAS_B: gl.constexpr):
    """Block ``j`` (window keys below ``nblk_a``, then extra keys) into the key tile."""
    if HAS_B and SRC_A != SRC_B:
        if j < nblk_a:
            _dequant_src(s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, k0, k1, k2, k3,
                         k4, k5, k6, k7, SRC_A)
        else:
            _dequant_src(s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, k0, k1, k2, k3,
                         k4, k5, k6, k7, SRC_B)
    else:
        _dequant_src(s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, k0, k1, k2, k3, k4,
                     k5, k6, k7, SRC_A)


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
    SPLIT: gl.constexpr, NS: gl.constexpr,
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
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    WL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    # raw byte tiles per stage the record pair needs (584: 7, 528: 8, 288: 4) and the RoPE ring
    USE_584: gl.constexpr = SRC_A == 584 or (HAS_B and SRC_B == 584)
    USE_528: gl.constexpr = SRC_A == 528 or (HAS_B and SRC_B == 528)
    NRAW: gl.constexpr = 8 if USE_528 else (7 if USE_584 else 4)

    pid = gl.program_id(0)
    ht = pid % num_ht
    rest = pid // num_ht
    split = rest % num_splits
    t = (rest // num_splits).to(gl.int64)

    # ---- shared memory ----------------------------------------------------------------
    r0 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    r1 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    r2 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    r3 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    if NRAW > 4:
        r4 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
        r5 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
        r6 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    else:
        r4 = r0
        r5 = r0
        r6 = r0
    if NRAW > 7:
        r7 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    else:
        r7 = r0
    scale_ring = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    if USE_584:
        rope_ring = gl.allocate_shared_memory(gl.bfloat16, [NS, 64, 64], KL)
    else:
        rope_ring = scale_ring  # never written: only 584 records copy a RoPE tail
    idx_ring = gl.allocate_shared_memory(gl.int32, [NS, 64], PLAIN1)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], WL)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], WL)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 64], KL)
    k0 = k_smem.slice(0, 64, dim=1)
    k1 = k_smem.slice(64, 64, dim=1)
    k2 = k_smem.slice(128, 64, dim=1)
    k3 = k_smem.slice(192, 64, dim=1)
    k4 = k_smem.slice(256, 64, dim=1)
    k5 = k_smem.slice(320, 64, dim=1)
    k6 = k_smem.slice(384, 64, dim=1)
    k7 = k_smem.slice(448, 64, dim=1)

    # ---- this program's column ranges ---------------------------------------------------
    if HAS_LEN_A:
        len_a = gl.load(a_len_ptr + t * a_len_st).to(gl.int32)
        len_a = gl.minimum(gl.maximum(len_a, 0), a_width)
    else:
        len_a = a_width + 0
    len_b = len_a * 0
    if HAS_B:
        if HAS_LEN_B:
            len_b = gl.load(b_len_ptr + t * b_len_st).to(gl.int32)
            len_b = gl.minimum(gl.maximum(len_b, 0), b_width)
        else:
            len_b = len_b + b_width
    total = len_a + len_b
    if SPLIT:
        chunk = gl.cdiv(gl.cdiv(total, num_splits), 64) * 64
        lo = split * chunk
        hi = gl.minimum(lo + chunk, total)
    else:
        lo = total * 0
        hi = total
    lo_a = gl.minimum(lo, len_a)
    hi_a = gl.maximum(gl.minimum(hi, len_a), lo_a)
    lo_b = gl.maximum(lo, len_a) - len_a
    hi_b = gl.maximum(hi - len_a, lo_b)
    nblk_a = gl.cdiv(hi_a - lo_a, 64)
    nblk = nblk_a + gl.cdiv(hi_b - lo_b, 64)
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
    dq = gl.arange(0, 64, layout=gl.SliceLayout(0, LB))
    qrow = q_ptr + t * stride_qt + hq.to(gl.int64)[:, None] * stride_qh
    for g in gl.static_range(8):
        qg = gl.load(qrow + (g * 64 + dq)[None, :], mask=(hq < H)[:, None], other=0.0)
        q_smem.slice(g * 64, 64, dim=1).store(qg)

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, SACC))
    zero_s = gl.full([BH, 64], 0.0, gl.float32, layout=SACC)
    l_part = zero_s  # per-thread partial sums of p, reduced once after the loop
    o = gl.full([BH, 512], 0.0, gl.float32, layout=OACC)

    for j in range(nblk):
        cp.wait_group(NS - 1)
        gl.thread_barrier()
        s = j % NS
        scale_s = scale_ring.index(s)
        # read before the next block's ids overwrite the other stage (no extra barrier)
        kidx = idx_ring.index(s).load(gl.SliceLayout(0, SACC))
        # the ids of block j + NS + 1, loaded a whole block before their checks are needed
        kn = j + NS
        nidx_next = _load_idx(kn + 1, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row,
                              lo_b, hi_b, b_rows, HAS_B, LI)
        _dequant_keys(j, s, nblk_a, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s,
                      k0, k1, k2, k3, k4, k5, k6, k7, SRC_A, SRC_B, HAS_B)
        fence_async_shared()
        gl.thread_barrier()

        # S = Q K^T [64 heads, 64 keys]
        acc = warpgroup_mma(q_smem, k_smem.permute((1, 0)), zero_s, use_acc=False,
                            is_async=True)
        sc = warpgroup_mma_wait(0, deps=[acc])

        sc = gl.where((kidx >= 0)[None, :], sc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(sc - m_safe[:, None])
        l_part = l_part * alpha[:, None] + p
        m_i = m_new
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()

        # O = O * alpha + P K  [64 heads, 512]
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, OACC))
        o = warpgroup_mma(p_smem, k_smem, o * alpha_o[:, None], is_async=True)
        # block j + NS's gathers go into this block's (consumed) stage, under the O wgmma
        _issue(kn, nidx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride, b_page,
               r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, SRC_A, SRC_B,
               HAS_B, NS, NW)
        nidx = nidx_next
        o = warpgroup_mma_wait(0, deps=[o])
    cp.wait_group(0)
    l_i = gl.convert_layout(gl.sum(l_part, axis=1), gl.SliceLayout(1, OACC))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, OACC))

    # ---- epilogue -----------------------------------------------------------------------
    h = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, OACC))
    hmask = h < H
    h64 = h.to(gl.int64)
    d = gl.arange(0, 512, layout=gl.SliceLayout(0, OACC))
    has = l_i != 0.0  # no key <=> l == 0 exactly; a NaN l propagates (docs/semantics.md)
    l_safe = gl.where(has, l_i, 1.0)
    if SPLIT:
        inv = gl.where(has, 1.0 / l_safe, 0.0)
        prow = (t * num_splits + split) * H + h64
        lse2 = gl.where(has, m_o + gl.log2(l_safe), float("-inf"))
        gl.store(pl_ptr + prow, lse2, mask=hmask)
        gl.store(po_ptr + (prow * 512)[:, None] + d[None, :], o * inv[:, None],
                 mask=hmask[:, None])
    else:
        den = l_safe
        if HAS_SINK:
            m_safe = gl.where(has, m_o, 0.0)
            sink = gl.load(sink_ptr + h64 * sink_st, mask=hmask, other=float("-inf"))
            den = den + gl.exp2(sink * LOG2E - m_safe)
            # a NaN sink: NaN rows without keys too (docs/semantics.md)
            inv = gl.where(has, 1.0 / den, gl.where(sink != sink, float("nan"), 0.0))
        else:
            inv = gl.where(has, 1.0 / den, 0.0)
        lse = gl.where(has, (m_o + gl.log2(l_safe)) * 0.6931471805599453, float("inf"))
        gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
        orow = out_ptr + t * stride_ot + h64 * stride_oh
        gl.store(orow[:, None] + d[None, :], (o * inv[:, None]).to(gl.bfloat16),
                 mask=hmask[:, None])
