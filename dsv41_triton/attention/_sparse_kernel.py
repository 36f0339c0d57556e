"""The Triton sparse MLA forward kernel behind ``sparse_mla_decode`` and ``sparse_mla_prefill``.

One program owns ``BLOCK_H`` heads of one query token and one key split. It walks up to two
key sets (the window cache, then the extra / compressed cache; prefill has one) ``BLOCK_N``
keys at a time with one online softmax (exp2 domain, fp32 state). Where the keys come from is
a constexpr ``SRC``:

=====  ==================================================================================
SRC    key source (``k_ptr``)
=====  ==================================================================================
0      bf16 rows of a workspace ``kv [S, 512]`` (prefill); ``bstride`` = row stride
584    paged ``fp8_ds_mla`` records: 448 e4m3 (UE8M0 per 64) + 64 raw bf16
528    paged ``mxfp8`` records: 512 e4m3 (UE8M0 per 32)
288    paged ``nvfp4`` records: 512 e2m1 (e4m3 scale per 16)
=====  ==================================================================================

Records are dequantized in registers (block-split page layout of SPEC §4, int64 byte offsets,
block stride ``cache.stride(0)``). The 512 dims are handled as 8 groups of 64 — for 584
records one UE8M0 scale per group and the raw bf16 RoPE tail as group 7 — with a
``[BLOCK_N, 64]`` key piece, a ``[BLOCK_H, 64]`` Q piece and an fp32 ``[BLOCK_H, 64]``
accumulator per group. Each piece is dequantized once (an opaque bf16 pack stops Triton from
re-deriving it per dot operand) and its raw bytes are pipelined with ``cp.async``. Dots take
bf16 operands with fp32 accumulation (fp32 operands under the interpreter, whose bf16 dot is
wrong).

With ``num_splits > 1`` each program writes a normalized partial output and its log2-sum-exp
to fp32 workspaces, which ``_merge_kernel.py`` combines (applying the sink). With one split
the kernel applies the sink and writes ``out``/``lse`` itself. No host sync and no
data-dependent shapes: the launches are CUDA-graph capturable.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..ops._codecs import _TARGET_INFO, e4m3_bits_to_f32, exp2_int, f32_to_bf16, rocm_target
from ._merge_kernel import gdc_launch_dependents

SRC_BF16 = 0
#: SRC -> (data_bytes, scale_bytes); bf16 rows have neither
SRC_BYTES = {SRC_BF16: (0, 0), 584: (576, 8), 528: (512, 16), 288: (256, 32)}


@triton.jit
def _load_group(k_ptr, data_off, scale_off, sw0, sw1, valid, G: tl.constexpr,
                SRC: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr):
    """Dims ``[64G, 64G + 64)`` of ``BN`` keys -> ``[BN, 64]`` bf16 (fp32 when DOT_F32).

    Every source yields all 8 groups: for 584 group 7 is the raw bf16 RoPE tail, groups 0..6
    are e4m3 times their one UE8M0 scale (a ``[BN]`` vector broadcast along the group: no
    reshape, so the tile keeps a plain 16-byte-per-thread layout); 528 has two scales per
    group, 288 four. ``sw0``/``sw1`` [BN] int64: the key's scale row read as 8-byte words
    (584: word 0 holds all 7 scales; 528: words 0 and 1), so that no 1-byte load (which the
    pipeliner cannot turn into an async copy) sits in the loop. Invalid keys give 0.
    """
    j = tl.arange(0, 64)
    vm = valid[:, None]
    if SRC == 0:
        x = tl.load(k_ptr + data_off[:, None] + (G * 64 + j)[None, :], mask=vm, other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
    elif SRC == 584 and G == 7:
        rp = (k_ptr + (data_off + 448)).to(tl.pointer_type(tl.bfloat16))
        x = tl.load(rp[:, None] + j[None, :], mask=vm, other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
    elif SRC == 288:
        jb = tl.arange(0, 32)
        b = tl.load(k_ptr + data_off[:, None] + (G * 32 + jb)[None, :], mask=vm, other=0)
        c = tl.join(b & 15, b >> 4).reshape(BN, 64).to(tl.int32)  # even element = low nibble
        # e2m1 code -> fp16 bits is the value * 2**-14; 2**14 goes in the scale
        bits = ((c & 7) << 9) | ((c & 8) << 12)
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        g4 = tl.arange(0, 4)
        sb = tl.load(k_ptr + scale_off[:, None] + (G * 4 + g4)[None, :], mask=vm, other=0)
        s = e4m3_bits_to_f32(sb) * 16384.0
        x = tl.reshape(tl.reshape(v, (BN, 4, 16)) * s[:, :, None], (BN, 64))
        if not DOT_F32:
            x = _f32_to_bf16_pinned(x)  # exact: <= 6 significant bits
    else:
        b = tl.load(k_ptr + data_off[:, None] + (G * 64 + j)[None, :], mask=vm, other=0)
        if SRC == 584:
            sb = ((sw0 >> (8 * G)) & 255).to(tl.int32)
            s = exp2_int(sb - 127)[:, None]  # byte 0 (masked key) -> 0.0
        else:  # 528: one scale per 32 dims, bytes 2G and 2G + 1 of the row
            if G < 4:
                w = sw0
            else:
                w = sw1
            s0 = ((w >> (16 * (G % 4))) & 255).to(tl.int32)
            s1 = ((w >> (16 * (G % 4) + 8)) & 255).to(tl.int32)
            s = tl.where(j[None, :] < 32, exp2_int(s0 - 127)[:, None],
                         exp2_int(s1 - 127)[:, None])
        x = e4m3_bits_to_f32(b) * s
        if not DOT_F32:
            x = _f32_to_bf16_pinned(x)  # exact: e4m3 * 2**e fits bf16
    return x


@triton.jit
def _f32_to_bf16_pinned(x):
    """fp32 -> bf16 (round to nearest even) as an opaque op on CUDA GPUs.

    Without it Triton re-derives the dequantized key tile once per dot-operand layout (it
    moves the layout conversions above the dequant), i.e. dequantizes every key twice, and
    the raw byte loads stop being pipelined. An asm with side effects cannot be duplicated,
    so the tile is dequantized once in its load layout and converted once per use. AMD GPUs
    have no PTX: there it is the plain cast.
    """
    if _TARGET_INFO:
        if rocm_target():
            return x.to(tl.bfloat16)
        else:
            return _cvt_bf16x2(x)
    else:
        return _cvt_bf16x2(x)


@triton.jit
def _cvt_bf16x2(x):
    return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                     dtype=tl.bfloat16, is_pure=False, pack=2)


@triton.jit
def _qk_group(s, q, k, FIRST: tl.constexpr):
    if FIRST:
        return tl.dot(q, tl.trans(k))
    else:
        return tl.dot(q, tl.trans(k), s)


@triton.jit
def _scores_grouped(q0, q1, q2, q3, q4, q5, q6, q7, k_ptr, data_off, scale_off, sw0, sw1, valid,
                    SRC: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr):
    """One key block's raw scores ``s = sum_g q_g k_g^T`` ``[BH, BN]`` fp32 and its 8 loaded
    groups ``k_g`` ``[BN, 64]`` (each group loaded just before its product)."""
    k0 = _load_group(k_ptr, data_off, scale_off, sw0, sw1, valid, 0, SRC, BN, DOT_F32)
    s = _qk_group(None, q0, k0, True)
    k1 = _load_group(k_ptr, data_off, scale_off, sw0, sw1, valid, 1, SRC, BN, DOT_F32)
    s = _qk_group(s, q1, k1, False)
    k2 = _load_group(k_ptr, data_off, scale_off, sw0, sw1, valid, 2, SRC, BN, DOT_F32)
    s = _qk_group(s, q2, k2, False)
    k3 = _load_group(k_ptr, data_off, scale_off, sw0, sw1, valid, 3, SRC, BN, DOT_F32)
    s = _qk_group(s, q3, k3, False)
    k4 = _load_group(k_ptr, data_off, scale_off, sw0, sw1, valid, 4, SRC, BN, DOT_F32)
    s = _qk_group(s, q4, k4, False)
    k5 = _load_group(k_ptr, data_off, scale_off, sw0, sw1, valid, 5, SRC, BN, DOT_F32)
    s = _qk_group(s, q5, k5, False)
    k6 = _load_group(k_ptr, data_off, scale_off, sw0, sw1, valid, 6, SRC, BN, DOT_F32)
    s = _qk_group(s, q6, k6, False)
    k7 = _load_group(k_ptr, data_off, scale_off, sw0, sw1, valid, 7, SRC, BN, DOT_F32)
    s = _qk_group(s, q7, k7, False)
    return s, k0, k1, k2, k3, k4, k5, k6, k7


@triton.jit
def _eager_update(s, m_new, k0, k1, k2, k3, k4, k5, k6, k7, a0, a1, a2, a3, a4, a5, a6, a7,
                  m_i, l_i, DOT_F32: tl.constexpr):
    """The online-softmax step with the new max ``m_new`` applied at once: ``s`` ``[BH, BN]``
    (log2 domain, ``-inf`` where masked), ``k_g`` the block's groups, ``a_g`` ``[BH, 64]``;
    returns the updated ``a_0 .. a_7, m_i, l_i``."""
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        pk = p
    else:
        pk = p.to(tl.bfloat16)
    a0 = tl.dot(pk, k0, a0 * alpha[:, None])
    a1 = tl.dot(pk, k1, a1 * alpha[:, None])
    a2 = tl.dot(pk, k2, a2 * alpha[:, None])
    a3 = tl.dot(pk, k3, a3 * alpha[:, None])
    a4 = tl.dot(pk, k4, a4 * alpha[:, None])
    a5 = tl.dot(pk, k5, a5 * alpha[:, None])
    a6 = tl.dot(pk, k6, a6 * alpha[:, None])
    a7 = tl.dot(pk, k7, a7 * alpha[:, None])
    return a0, a1, a2, a3, a4, a5, a6, a7, m_new, l_i


@triton.jit
def _attend_grouped(a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i,
                    q0, q1, q2, q3, q4, q5, q6, q7,
                    k_ptr, idx_row_ptr, lo, hi, bstride, page, nrows, qk_scale,
                    SRC: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                    PAGE_LOG2: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr,
                    LAZY: tl.constexpr):
    """Online softmax over key columns ``[lo, hi)`` of one index row, the 512 dims as 8
    groups: ``s = sum_g q_g k_g^T`` and ``a_g += p k_g`` (``a_g``, ``q_g`` ``[BH, 64]``).
    ``PAGE_LOG2``: log2 of the page size when it is a power of two (shift instead of an
    integer division per slot), else -1. ``LAZY``: rescale only when a max grows by > 2**8.
    """
    for start in range(lo, hi, BN):
        cols = start + tl.arange(0, BN)
        cm = cols < hi
        idx = tl.load(idx_row_ptr + cols, mask=cm, other=-1)
        valid = cm & (idx >= 0) & (idx < nrows)
        idx = tl.where(valid, idx, 0)
        if SRC == 0:
            data_off = idx.to(tl.int64) * bstride
            scale_off = data_off
        else:
            if PAGE_LOG2 >= 0:
                blk = idx >> PAGE_LOG2
                off = idx & ((1 << PAGE_LOG2) - 1)
            else:
                blk = idx // page
                off = idx - blk * page
            base = blk.to(tl.int64) * bstride
            data_off = tl.multiple_of(base + off.to(tl.int64) * DATA_BYTES, 16)
            scale_off = tl.multiple_of(
                base + page * DATA_BYTES + off.to(tl.int64) * SCALE_BYTES, 8)
        if SRC == 584 or SRC == 528:
            sp = (k_ptr + scale_off).to(tl.pointer_type(tl.int64))
            sw0 = tl.load(sp, mask=valid, other=0)
            if SRC == 528:
                sw1 = tl.load(sp + 1, mask=valid, other=0)
            else:
                sw1 = sw0
        else:
            sw0 = scale_off
            sw1 = scale_off
        s, k0, k1, k2, k3, k4, k5, k6, k7 = _scores_grouped(
            q0, q1, q2, q3, q4, q5, q6, q7, k_ptr, data_off, scale_off, sw0, sw1, valid, SRC,
            BN, DOT_F32)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if LAZY:
            # rescale the state only when some row's max grew by more than 2**8; otherwise
            # keep the stale max (p <= 2**8, exact enough in bf16 and harmless in fp32):
            # the final out/lse use the same max as l and the accumulators, so this is exact
            grow = tl.max((m_new > m_i + 8.0).to(tl.int32), 0)
            if grow > 0:
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                l_i = l_i * alpha
                a0 = a0 * alpha[:, None]
                a1 = a1 * alpha[:, None]
                a2 = a2 * alpha[:, None]
                a3 = a3 * alpha[:, None]
                a4 = a4 * alpha[:, None]
                a5 = a5 * alpha[:, None]
                a6 = a6 * alpha[:, None]
                a7 = a7 * alpha[:, None]
                m_i = m_new
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i + tl.sum(p, 1)
            if DOT_F32:
                pk = p
            else:
                pk = p.to(tl.bfloat16)
            a0 = tl.dot(pk, k0, a0)
            a1 = tl.dot(pk, k1, a1)
            a2 = tl.dot(pk, k2, a2)
            a3 = tl.dot(pk, k3, a3)
            a4 = tl.dot(pk, k4, a4)
            a5 = tl.dot(pk, k5, a5)
            a6 = tl.dot(pk, k6, a6)
            a7 = tl.dot(pk, k7, a7)
        else:
            a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i = _eager_update(
                s, m_new, k0, k1, k2, k3, k4, k5, k6, k7, a0, a1, a2, a3, a4, a5, a6, a7, m_i,
                l_i, DOT_F32)
    return a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i


@triton.jit
def _load_q_group(qrow, hmask, G: tl.constexpr, DOT_F32: tl.constexpr):
    q = tl.load(qrow + (G * 64 + tl.arange(0, 64))[None, :], mask=hmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)  # the interpreter's bf16 dot is wrong (see module doc)
    return q


@triton.jit
def _load_prior_group(ptr_row, hmask, G: tl.constexpr):
    return tl.load(ptr_row + (G * 64 + tl.arange(0, 64))[None, :], mask=hmask[:, None],
                   other=0.0)


@triton.jit
def _merge_prior_group(a, w_a, p, w_p):
    # a zero weight drops its side (an unwritten or garbage partial row included)
    pp = tl.where(w_p[:, None] != 0.0, p.to(tl.float32) * w_p[:, None], 0.0)
    return a * w_a[:, None] + pp


@triton.jit
def _store_group(ptr_row, a, hmask, scale, G: tl.constexpr, TO_BF16: tl.constexpr,
                 SW: tl.constexpr):
    v = a * scale[:, None]
    if TO_BF16:
        v = f32_to_bf16(v, SW)
    tl.store(ptr_row + (G * 64 + tl.arange(0, 64))[None, :], v, mask=hmask[:, None])


@triton.jit
def _store_groups(orow, a0, a1, a2, a3, a4, a5, a6, a7, hmask, inv, TO_BF16: tl.constexpr,
                  SW: tl.constexpr):
    _store_group(orow, a0, hmask, inv, 0, TO_BF16, SW)
    _store_group(orow, a1, hmask, inv, 1, TO_BF16, SW)
    _store_group(orow, a2, hmask, inv, 2, TO_BF16, SW)
    _store_group(orow, a3, hmask, inv, 3, TO_BF16, SW)
    _store_group(orow, a4, hmask, inv, 4, TO_BF16, SW)
    _store_group(orow, a5, hmask, inv, 5, TO_BF16, SW)
    _store_group(orow, a6, hmask, inv, 6, TO_BF16, SW)
    _store_group(orow, a7, hmask, inv, 7, TO_BF16, SW)


@triton.jit
def _sparse_mla_fwd_grouped_kernel(
    q_ptr, stride_qt, stride_qh,
    a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows,
    b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride, b_page, b_rows,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    po_ptr, pl_ptr,
    H, qk_scale, num_splits, num_ht,
    SRC_A: tl.constexpr, DATA_A: tl.constexpr, SCALE_A: tl.constexpr,
    SRC_B: tl.constexpr, DATA_B: tl.constexpr, SCALE_B: tl.constexpr,
    HAS_B: tl.constexpr, HAS_LEN_A: tl.constexpr, HAS_LEN_B: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr, SW: tl.constexpr,
    PAGE_LOG2_A: tl.constexpr, PAGE_LOG2_B: tl.constexpr, LAZY: tl.constexpr,
    PDL: tl.constexpr = False, PRIOR: tl.constexpr = False,
):
    """Grid: ``T * num_splits * num_ht`` programs (head tile fastest, then split, then token).

    q ``[T, H, 512]`` bf16; key set A (and B when HAS_B): cache/workspace pointer, index rows
    ``[T, width]`` (int32/int64), lens ``[T]``; out ``[T, H, 512]`` bf16, lse ``[T, H]`` fp32
    (not SPLIT) or partials ``po [T, NS, H, 512]`` / ``pl [T, NS, H]`` fp32 (log2 domain).
    Eight ``[BH, 64]`` accumulators and Q pieces, eight ``[BN, 64]`` key pieces per step.
    ``PDL``: lets the split merge (a programmatic dependent launch) start its launch now.
    ``PRIOR`` (one split only): ``out``/``lse`` already hold a normalized partial of other
    keys (bf16, natural lse, ``+inf`` = none); it is merged with this program's keys after
    the key loop and the result (sink applied) overwrites it.
    """
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    ht = pid % num_ht
    rest = pid // num_ht
    split = rest % num_splits
    t = (rest // num_splits).to(tl.int64)

    h = ht * BH + tl.arange(0, BH)
    hmask = h < H
    h64 = h.to(tl.int64)
    qrow = q_ptr + t * stride_qt + h64[:, None] * stride_qh
    q0 = _load_q_group(qrow, hmask, 0, DOT_F32)
    q1 = _load_q_group(qrow, hmask, 1, DOT_F32)
    q2 = _load_q_group(qrow, hmask, 2, DOT_F32)
    q3 = _load_q_group(qrow, hmask, 3, DOT_F32)
    q4 = _load_q_group(qrow, hmask, 4, DOT_F32)
    q5 = _load_q_group(qrow, hmask, 5, DOT_F32)
    q6 = _load_q_group(qrow, hmask, 6, DOT_F32)
    q7 = _load_q_group(qrow, hmask, 7, DOT_F32)

    if HAS_LEN_A:
        len_a = tl.load(a_len_ptr + t * a_len_st).to(tl.int32)
        len_a = tl.minimum(tl.maximum(len_a, 0), a_width)
    else:
        len_a = a_width + 0
    len_b = len_a * 0
    if HAS_B:
        if HAS_LEN_B:
            len_b = tl.load(b_len_ptr + t * b_len_st).to(tl.int32)
            len_b = tl.minimum(tl.maximum(len_b, 0), b_width)
        else:
            len_b = len_b + b_width
    total = len_a + len_b
    if not SPLIT:
        lo = total * 0
        hi = total
    else:
        chunk = tl.cdiv(tl.cdiv(total, num_splits), BN) * BN
        lo = split * chunk
        hi = tl.minimum(lo + chunk, total)

    if PRIOR:
        # issued before the key loop (its latency hides under it), merged after it
        lp = tl.load(lse_ptr + t * stride_lt + h64 * stride_lh, mask=hmask,
                     other=float("inf"))
        prow = out_ptr + t * stride_ot + h64[:, None] * stride_oh
        p0 = _load_prior_group(prow, hmask, 0)
        p1 = _load_prior_group(prow, hmask, 1)
        p2 = _load_prior_group(prow, hmask, 2)
        p3 = _load_prior_group(prow, hmask, 3)
        p4 = _load_prior_group(prow, hmask, 4)
        p5 = _load_prior_group(prow, hmask, 5)
        p6 = _load_prior_group(prow, hmask, 6)
        p7 = _load_prior_group(prow, hmask, 7)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    a0 = tl.zeros([BH, 64], tl.float32)
    a1 = tl.zeros([BH, 64], tl.float32)
    a2 = tl.zeros([BH, 64], tl.float32)
    a3 = tl.zeros([BH, 64], tl.float32)
    a4 = tl.zeros([BH, 64], tl.float32)
    a5 = tl.zeros([BH, 64], tl.float32)
    a6 = tl.zeros([BH, 64], tl.float32)
    a7 = tl.zeros([BH, 64], tl.float32)

    a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i = _attend_grouped(
        a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i, q0, q1, q2, q3, q4, q5, q6, q7,
        a_ptr, a_idx_ptr + t * a_idx_st, lo, tl.minimum(hi, len_a), a_bstride, a_page, a_rows,
        qk_scale, SRC_A, DATA_A, SCALE_A, PAGE_LOG2_A, BN, DOT_F32, LAZY)
    if HAS_B:
        b_lo = tl.maximum(lo, len_a) - len_a
        a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i = _attend_grouped(
            a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i, q0, q1, q2, q3, q4, q5, q6, q7,
            b_ptr, b_idx_ptr + t * b_idx_st, b_lo, hi - len_a, b_bstride, b_page, b_rows,
            qk_scale, SRC_B, DATA_B, SCALE_B, PAGE_LOG2_B, BN, DOT_F32, LAZY)

    if PRIOR:
        # the partial is an online state of max lse2 and sum 1; +inf lse: no partial
        m_p = tl.where(lp == float("inf"), float("-inf"), lp * 1.4426950408889634)
        m_c = tl.maximum(m_i, m_p)
        m_c = tl.where(m_p != m_p, m_p, m_c)  # the GPU max drops a NaN partial
        m_cs = tl.where(m_c == float("-inf"), 0.0, m_c)
        w_i = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - m_cs))
        w_p = tl.where(m_p == float("-inf"), 0.0, tl.exp2(m_p - m_cs))
        l_i = l_i * w_i + w_p
        a0 = _merge_prior_group(a0, w_i, p0, w_p)
        a1 = _merge_prior_group(a1, w_i, p1, w_p)
        a2 = _merge_prior_group(a2, w_i, p2, w_p)
        a3 = _merge_prior_group(a3, w_i, p3, w_p)
        a4 = _merge_prior_group(a4, w_i, p4, w_p)
        a5 = _merge_prior_group(a5, w_i, p5, w_p)
        a6 = _merge_prior_group(a6, w_i, p6, w_p)
        a7 = _merge_prior_group(a7, w_i, p7, w_p)
        m_i = m_c
    # no key <=> l == 0 exactly; a NaN l (NaN in q or a key) propagates to out and lse
    has = l_i != 0.0
    l_safe = tl.where(has, l_i, 1.0)
    if not SPLIT:
        den = l_safe
        if HAS_SINK:
            m_safe = tl.where(has, m_i, 0.0)
            sink = tl.load(sink_ptr + h64 * sink_st, mask=hmask, other=float("-inf"))
            den = den + tl.exp2(sink * 1.4426950408889634 - m_safe)
            # a NaN sink: NaN rows without keys too (docs/semantics.md)
            inv = tl.where(has, 1.0 / den, tl.where(sink != sink, float("nan"), 0.0))
        else:
            inv = tl.where(has, 1.0 / den, 0.0)
        orow = out_ptr + t * stride_ot + h64[:, None] * stride_oh
        _store_groups(orow, a0, a1, a2, a3, a4, a5, a6, a7, hmask, inv, True, SW)
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("inf"))
        tl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
    else:
        inv = tl.where(has, 1.0 / l_safe, 0.0)
        prow_idx = (t * num_splits + split) * H + h64
        orow = po_ptr + prow_idx[:, None] * 512
        _store_groups(orow, a0, a1, a2, a3, a4, a5, a6, a7, hmask, inv, False, SW)
        lse2 = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(pl_ptr + prow_idx, lse2, mask=hmask)
