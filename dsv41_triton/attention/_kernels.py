"""The one Triton attention template behind ``sparse_mla_decode`` and ``sparse_mla_prefill``.

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
block stride ``cache.stride(0)``) into one ``[BLOCK_N, 512]`` bf16 key tile that feeds both
dots (``q k^T`` and ``p k``) with an fp32 ``[BLOCK_H, 512]`` accumulator. When a 584 cache is
in play (``HAS_ROPE``) the main tile carries the 448 NoPE dims (the tail is never loaded) and
the raw bf16 RoPE tail goes through its own ``[BLOCK_N, 64]`` tile and ``[BLOCK_H, 64]``
accumulator; other records then split their dims the same way. Dots take bf16 operands with
fp32 accumulation (fp32 operands under the interpreter, whose bf16 dot is wrong).

Two kernel variants share that contract (``KernelConfig.variant``): ``"tile"`` (above: one
``[BLOCK_N, 512]`` tile, ``_sparse_mla_fwd_kernel``) and ``"group"`` (the GPU default,
``_sparse_mla_fwd_grouped_kernel``): the 512 dims as 8 groups of 64 — for 584 records one
UE8M0 scale per group and the bf16 RoPE tail as group 7 — with a ``[BLOCK_N, 64]`` key piece,
a ``[BLOCK_H, 64]`` Q piece and accumulator per group. Each piece is dequantized once (an
opaque bf16 pack stops Triton from re-deriving it per dot operand) and its raw bytes are
pipelined with ``cp.async``; on the H200 this halves decode time (perf/NOTES.md).

With ``num_splits > 1`` each program writes a normalized partial output and its log2-sum-exp
to fp32 workspaces, and ``_merge_kernel`` combines the splits and applies the sink. With one
split the attention kernel applies the sink and writes ``out``/``lse`` itself. No host sync and
no data-dependent shapes anywhere: the launches are CUDA-graph capturable.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .._utils import (HEAD_DIM, INT_DTYPES, cdiv, check_shape, check_tensor, is_interpreter,
                      next_power_of_2)
from ..ops._codecs import e4m3_bits_to_f32, exp2_int, f32_to_bf16

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

SRC_BF16 = 0
#: smallest key block used on a GPU: 16-key blocks (BLOCK_H 16, 584 + 288 caches) gave wrong
#: outputs on an H200 with triton 3.6 while the interpreter and 32/64-key blocks were right
MIN_BLOCK_N_GPU = 32
#: SRC -> (data_bytes, scale_bytes); bf16 rows have neither
_SRC_BYTES = {SRC_BF16: (0, 0), 584: (576, 8), 528: (512, 16), 288: (256, 32)}


# ------------------------------------------------------------------------------------------
# device helpers
# ------------------------------------------------------------------------------------------
@triton.jit
def _load_k_piece(k_ptr, data_off, scale_off, valid, D0: tl.constexpr, DW: tl.constexpr,
                  SRC: tl.constexpr, BN: tl.constexpr, ZERO_TAIL: tl.constexpr,
                  DOT_F32: tl.constexpr):
    """Dims ``[D0, D0 + DW)`` of ``BN`` keys -> ``[BN, DW]`` bf16 (fp32 when DOT_F32).

    ``data_off``/``scale_off`` [BN] int64: byte offsets of each key's data and scale rows
    (element offset of the row for bf16 rows). Invalid keys read nothing and give 0.
    ``ZERO_TAIL``: dims >= 448 are returned as 0 (they are handled by a separate RoPE piece).
    """
    vm = valid[:, None]
    d = D0 + tl.arange(0, DW)
    if SRC == 0:
        x = tl.load(k_ptr + data_off[:, None] + d[None, :], mask=vm, other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
    elif SRC == 584 and D0 >= 448:
        # RoPE tail: 64 raw bf16 at byte 448 of the data row
        rp = (k_ptr + (data_off + 448))[:, None].to(tl.pointer_type(tl.bfloat16))
        x = tl.load(rp + (d - 448)[None, :], mask=vm, other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
    elif SRC == 288:
        NG: tl.constexpr = DW // 16
        j = tl.arange(0, DW // 2)
        jm = vm
        if ZERO_TAIL:  # dims >= 448 are bytes >= 224: not loaded (zero-filled)
            jm = vm & ((D0 // 2 + j)[None, :] < 224)
        b = tl.load(k_ptr + data_off[:, None] + (D0 // 2 + j)[None, :], mask=jm, other=0)
        c = tl.join(b & 15, b >> 4).reshape(BN, DW).to(tl.int32)  # even element = low nibble
        # e2m1 code -> fp16 bits (magnitude bits at 9..11, sign at 15) is the value * 2**-14,
        # subnormal 0.5 included; the 2**14 is folded into the scale.
        bits = ((c & 7) << 9) | ((c & 8) << 12)
        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        g = tl.arange(0, NG)
        sb = tl.load(k_ptr + scale_off[:, None] + (D0 // 16 + g)[None, :], mask=vm, other=0)
        s = e4m3_bits_to_f32(sb) * 16384.0
        x = tl.reshape(tl.reshape(v, (BN, NG, 16)) * s[:, :, None], (BN, DW))
        if not DOT_F32:
            x = x.to(tl.bfloat16)  # exact: <= 6 significant bits
    else:
        # e4m3 data with power-of-two UE8M0 scales: 64 dims per scale (584) or 32 (528).
        # For 584 the bytes past 448 are the RoPE tail: never loaded here (zero-filled), as
        # with ZERO_TAIL, so that no byte pattern (e4m3 NaN) can leak in.
        GS: tl.constexpr = 64 if SRC == 584 else 32
        NG: tl.constexpr = DW // GS
        dm = vm
        if ZERO_TAIL or SRC == 584:
            dm = vm & (d[None, :] < 448)
        b = tl.load(k_ptr + data_off[:, None] + d[None, :], mask=dm, other=0)
        g = tl.arange(0, NG)
        sb = tl.load(k_ptr + scale_off[:, None] + (D0 // GS + g)[None, :], mask=vm, other=0)
        s = exp2_int(sb.to(tl.int32) - 127)  # byte 0 (masked) -> 0.0
        v = e4m3_bits_to_f32(b)
        x = tl.reshape(tl.reshape(v, (BN, NG, GS)) * s[:, :, None], (BN, DW))
        if not DOT_F32:
            x = x.to(tl.bfloat16)  # exact: e4m3 * 2**e fits bf16
    return x


@triton.jit
def _attend_keyset(acc, acc_r, m_i, l_i, q, q_r,
                   k_ptr, idx_row_ptr, lo, hi, bstride, page, nrows, qk_scale,
                   SRC: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                   HAS_ROPE: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr):
    """Online softmax over key columns ``[lo, hi)`` of one index row; returns the new state.

    ``acc [BH, 512]`` and ``q [BH, 512]`` cover all dims; with ``HAS_ROPE`` (a 584 cache is in
    play) the main key tile has dims >= 448 zeroed and the RoPE dims go through ``q_r``/``acc_r``
    ``[BH, 64]`` instead.
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
            blk = idx // page
            off = idx - blk * page
            base = blk.to(tl.int64) * bstride
            data_off = tl.multiple_of(base + off.to(tl.int64) * DATA_BYTES, 16)
            scale_off = tl.multiple_of(base + page * DATA_BYTES + off.to(tl.int64) * SCALE_BYTES, 8)
        k = _load_k_piece(k_ptr, data_off, scale_off, valid, 0, 512, SRC, BN, HAS_ROPE, DOT_F32)
        s = tl.dot(q, tl.trans(k))
        if HAS_ROPE:
            kr = _load_k_piece(k_ptr, data_off, scale_off, valid, 448, 64, SRC, BN, False,
                               DOT_F32)
            s = tl.dot(q_r, tl.trans(kr), s)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_F32:
            pk = p
        else:
            pk = p.to(tl.bfloat16)
        acc = tl.dot(pk, k, acc * alpha[:, None])
        if HAS_ROPE:
            acc_r = tl.dot(pk, kr, acc_r * alpha[:, None])
        m_i = m_new
    return acc, acc_r, m_i, l_i


@triton.jit
def _store_rows(ptr_row, acc, acc_r, hmask, scale, HAS_ROPE: tl.constexpr,
                TO_BF16: tl.constexpr, SW: tl.constexpr):
    """Write ``acc * scale`` (and the RoPE part ``acc_r * scale`` to dims 448..511)."""
    d = tl.arange(0, 512)
    v = acc * scale[:, None]
    if TO_BF16:
        v = f32_to_bf16(v, SW)
    if HAS_ROPE:
        tl.store(ptr_row + d[None, :], v, mask=hmask[:, None] & (d[None, :] < 448))
        dr = 448 + tl.arange(0, 64)
        vr = acc_r * scale[:, None]
        if TO_BF16:
            vr = f32_to_bf16(vr, SW)
        tl.store(ptr_row + dr[None, :], vr, mask=hmask[:, None])
    else:
        tl.store(ptr_row + d[None, :], v, mask=hmask[:, None])


# ------------------------------------------------------------------------------------------
# kernels
# ------------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_fwd_kernel(
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
    HAS_SINK: tl.constexpr, HAS_ROPE: tl.constexpr, SPLIT: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr, SW: tl.constexpr,
):
    """Grid: ``T * num_splits * num_ht`` programs (head tile fastest, then split, then token).

    q ``[T, H, 512]`` bf16; key set A (and B when HAS_B): cache/workspace pointer, index rows
    ``[T, width]`` (int32/int64), lens ``[T]``; out ``[T, H, 512]`` bf16, lse ``[T, H]`` fp32
    (not SPLIT) or partials ``po [T, NS, H, 512]`` / ``pl [T, NS, H]`` fp32 (log2 domain).
    """
    pid = tl.program_id(0)
    ht = pid % num_ht
    rest = pid // num_ht
    split = rest % num_splits
    t = (rest // num_splits).to(tl.int64)

    h = ht * BH + tl.arange(0, BH)
    hmask = h < H
    h64 = h.to(tl.int64)
    qrow = q_ptr + t * stride_qt + h64[:, None] * stride_qh
    q = tl.load(qrow + tl.arange(0, 512)[None, :], mask=hmask[:, None], other=0.0)
    if HAS_ROPE:
        q_r = tl.load(qrow + (448 + tl.arange(0, 64))[None, :], mask=hmask[:, None], other=0.0)
    else:
        q_r = tl.zeros([BH, 64], tl.bfloat16)
    if DOT_F32:
        # the interpreter's bf16 dot is wrong (see module doc); fp32 operands are exact there
        q = q.to(tl.float32)
        q_r = q_r.to(tl.float32)

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
    # this split's share of the combined column space [0, len_a + len_b)
    total = len_a + len_b
    if not SPLIT:
        lo = total * 0
        hi = total
    else:
        chunk = tl.cdiv(tl.cdiv(total, num_splits), BN) * BN
        lo = split * chunk
        hi = tl.minimum(lo + chunk, total)

    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, 512], tl.float32)
    acc_r = tl.zeros([BH, 64], tl.float32)

    acc, acc_r, m_i, l_i = _attend_keyset(
        acc, acc_r, m_i, l_i, q, q_r,
        a_ptr, a_idx_ptr + t * a_idx_st, lo, tl.minimum(hi, len_a), a_bstride, a_page, a_rows,
        qk_scale, SRC_A, DATA_A, SCALE_A, HAS_ROPE, BN, DOT_F32)
    if HAS_B:
        b_lo = tl.maximum(lo, len_a) - len_a
        acc, acc_r, m_i, l_i = _attend_keyset(
            acc, acc_r, m_i, l_i, q, q_r,
            b_ptr, b_idx_ptr + t * b_idx_st, b_lo, hi - len_a, b_bstride, b_page, b_rows,
            qk_scale, SRC_B, DATA_B, SCALE_B, HAS_ROPE, BN, DOT_F32)

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    if not SPLIT:
        den = l_safe
        if HAS_SINK:
            m_safe = tl.where(has, m_i, 0.0)
            sink = tl.load(sink_ptr + h64 * sink_st, mask=hmask, other=float("-inf"))
            den = den + tl.exp2(sink * 1.4426950408889634 - m_safe)  # inf for a huge sink -> 0
        inv = tl.where(has, 1.0 / den, 0.0)
        orow = out_ptr + t * stride_ot + h64[:, None] * stride_oh
        _store_rows(orow, acc, acc_r, hmask, inv, HAS_ROPE, True, SW)
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("inf"))
        tl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
    else:
        inv = tl.where(has, 1.0 / l_safe, 0.0)
        prow_idx = (t * num_splits + split) * H + h64
        orow = po_ptr + prow_idx[:, None] * 512
        _store_rows(orow, acc, acc_r, hmask, inv, HAS_ROPE, False, SW)
        lse2 = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(pl_ptr + prow_idx, lse2, mask=hmask)


@triton.jit
def _merge_kernel(po_ptr, pl_ptr, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh,
                  lse_ptr, stride_lt, stride_lh, H, num_splits, num_ht,
                  NSP: tl.constexpr, BH: tl.constexpr, HAS_SINK: tl.constexpr,
                  SW: tl.constexpr):
    """Combine split partials: ``po [T, NS, H, 512]`` (each normalized by its own sum) and
    ``pl [T, NS, H]`` (log2-sum-exp, -inf = empty) -> out bf16, lse fp32 (natural log), with
    the sink in the denominator. Empty rows: out 0, lse +inf. Grid ``T * num_ht``."""
    pid = tl.program_id(0)
    ht = pid % num_ht
    t = (pid // num_ht).to(tl.int64)
    h = ht * BH + tl.arange(0, BH)
    hmask = h < H
    h64 = h.to(tl.int64)
    sp = tl.arange(0, NSP)
    lrow = (t * num_splits + sp[:, None]) * H + h64[None, :]
    lse2 = tl.load(pl_ptr + lrow, mask=(sp[:, None] < num_splits) & hmask[None, :],
                   other=float("-inf"))
    m = tl.max(lse2, 0)
    has = m > float("-inf")
    m_safe = tl.where(has, m, 0.0)
    w = tl.exp2(lse2 - m_safe[None, :])
    l_sum = tl.sum(w, 0)
    den = tl.where(has, l_sum, 1.0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h64 * sink_st, mask=hmask, other=float("-inf"))
        den = den + tl.exp2(sink * 1.4426950408889634 - m_safe)
    inv = tl.where(has, 1.0 / den, 0.0)
    d = tl.arange(0, 512)
    acc = tl.zeros([BH, 512], tl.float32)
    for s in range(num_splits):
        prow = (t * num_splits + s) * H + h64
        ls = tl.load(pl_ptr + prow, mask=hmask, other=float("-inf"))
        ws = tl.exp2(ls - m_safe)
        o = tl.load(po_ptr + prow[:, None] * 512 + d[None, :], mask=hmask[:, None], other=0.0)
        acc += ws[:, None] * o
    o = f32_to_bf16(acc * inv[:, None], SW)
    tl.store(out_ptr + t * stride_ot + h64[:, None] * stride_oh + d[None, :], o,
             mask=hmask[:, None])
    lse = tl.where(has, (m + tl.log2(tl.where(has, l_sum, 1.0))) * 0.6931471805599453,
                   float("inf"))
    tl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)


# ------------------------------------------------------------------------------------------
# grouped variant: the 512 dims as 8 groups of 64 (one UE8M0 scale per group for 584)
# ------------------------------------------------------------------------------------------
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
        # e2m1 code -> fp16 bits is the value * 2**-14 (see _load_k_piece); 2**14 in the scale
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
    """fp32 -> bf16 (round to nearest even) as an opaque op (GPU only).

    Without it Triton re-derives the dequantized key tile once per dot-operand layout (it
    moves the layout conversions above the dequant), i.e. dequantizes every key twice, and
    the raw byte loads stop being pipelined. An asm with side effects cannot be duplicated,
    so the tile is dequantized once in its load layout and converted once per use.
    """
    return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x],
                                     dtype=tl.bfloat16, is_pure=False, pack=2)


@triton.jit
def _qk_group(s, q, k, FIRST: tl.constexpr):
    if FIRST:
        return tl.dot(q, tl.trans(k))
    else:
        return tl.dot(q, tl.trans(k), s)


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
            m_i = m_new
    return a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i


@triton.jit
def _load_q_group(qrow, hmask, G: tl.constexpr, DOT_F32: tl.constexpr):
    q = tl.load(qrow + (G * 64 + tl.arange(0, 64))[None, :], mask=hmask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)  # the interpreter's bf16 dot is wrong (see module doc)
    return q


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
):
    """Same contract and grid as ``_sparse_mla_fwd_kernel`` (variant "group"): eight
    ``[BH, 64]`` accumulators and Q pieces, eight ``[BN, 64]`` key pieces per step."""
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

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    if not SPLIT:
        den = l_safe
        if HAS_SINK:
            m_safe = tl.where(has, m_i, 0.0)
            sink = tl.load(sink_ptr + h64 * sink_st, mask=hmask, other=float("-inf"))
            den = den + tl.exp2(sink * 1.4426950408889634 - m_safe)
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


# ------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeySet:
    """One key source for the template. ``src``: 0 (bf16 rows), 584, 528 or 288.
    ``k``: the cache ``[nb, page, bytes]`` uint8 or the workspace ``[S, 512]`` bf16;
    ``indices [T, width]``; ``lens [T]`` or None; ``bstride``: block stride in bytes (rows:
    row stride in elements); ``rows``: number of valid slots / rows."""

    src: int
    k: torch.Tensor
    indices: torch.Tensor
    lens: Optional[torch.Tensor]
    bstride: int
    page: int
    rows: int


#: kernel variants a KernelConfig can name
VARIANTS = ("tile", "group")


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: heads per program, keys per step, key splits, warps, pipeline stages, and
    the kernel ``variant``: ``"tile"`` (one ``[BN, 512]`` key tile, ``_sparse_mla_fwd_kernel``)
    or ``"group"`` (eight ``[BN, 64]`` key pieces, ``_sparse_mla_fwd_grouped_kernel``);
    ``lazy_rescale`` (group only): skip the accumulator rescale unless a row max grows by more
    than 2**8 (exact: out, l and lse all use the kept max)."""

    block_h: int
    block_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2
    variant: str = "tile"
    lazy_rescale: bool = False

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if not (isinstance(v, int) and 16 <= v <= 256 and v & (v - 1) == 0):
                raise ValueError(f"KernelConfig.{name}: expected a power of two in [16, 256], "
                                 f"got {v!r}")
        if not (isinstance(self.num_splits, int) and 1 <= self.num_splits <= 64):
            raise ValueError(f"KernelConfig.num_splits: expected 1..64, got {self.num_splits!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps: expected 1, 2, 4, 8 or 16, got "
                             f"{self.num_warps!r}")
        if not (isinstance(self.num_stages, int) and 1 <= self.num_stages <= 6):
            raise ValueError(f"KernelConfig.num_stages: expected 1..6, got {self.num_stages!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"KernelConfig.variant: expected one of {VARIANTS}, got "
                             f"{self.variant!r}")
        if not isinstance(self.lazy_rescale, bool) or (self.lazy_rescale
                                                       and self.variant != "group"):
            raise ValueError(f"KernelConfig.lazy_rescale: a bool, True only with variant "
                             f"'group', got {self.lazy_rescale!r} ({self.variant!r})")


_SM_COUNT = {}
#: the last attention launch's compiled kernel and config (for benchmarks: registers, spills)
LAST_LAUNCH = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


#: GPU launch templates by (paged, block_h): ((variant, block_h, block_n, num_warps,
#: num_stages, lazy_rescale), resident programs per SM). The split count is derived from the
#: last number (splitting the keys pays only up to about one wave of resident programs: the
#: fp32 partials cost bandwidth). Every shape here is in ``GPU_CANDIDATES``.
#: Measured (H200, triton 3.6, CUDA graph; perf/NOTES.md "Session 2 results"): decode 8 heads
#: x 128 tokens 82.8 -> 39.2 us, 64 heads 208.8 -> 89.4 us; prefill 8 heads 733 -> 528 us,
#: 64 heads 1548 -> 1472 us. The 32-head templates were timed at 64/128 heads (two tiles).
_GPU_TEMPLATES = {
    (True, 16): (("group", 16, 64, 4, 2, False), 2),
    (True, 32): (("group", 32, 64, 8, 3, False), 1),
    (True, 64): (("group", 64, 64, 8, 2, False), 1),
    (False, 16): (("group", 16, 64, 4, 3, True), 2),
    (False, 32): (("group", 32, 64, 4, 3, False), 2),
    (False, 64): (("group", 64, 64, 8, 3, False), 1),
}

#: launch shapes (variant, block_h, block_n, num_warps, num_stages, lazy_rescale) that the GPU
#: tests check (with and without splits, every record width) and
#: ``perf/bench_attention.py --sweep`` times; ``default_config`` only ever returns one of
#: these. Registers / spills / shared memory from an sm_90 compile are in perf/NOTES.md.
GPU_CANDIDATES = {
    "decode": (
        ("tile", 16, 32, 4, 3, False), ("tile", 32, 32, 4, 3, False),
        ("tile", 64, 32, 8, 2, False), ("tile", 64, 64, 8, 2, False),
        ("group", 16, 32, 4, 3, False), ("group", 16, 32, 4, 3, True),
        ("group", 16, 64, 4, 2, False), ("group", 16, 64, 4, 2, True),
        ("group", 16, 64, 8, 3, False), ("group", 32, 64, 8, 3, False),
        ("group", 32, 64, 8, 3, True), ("group", 64, 32, 8, 2, False),
        ("group", 64, 64, 8, 2, False), ("group", 64, 64, 8, 2, True),
    ),
    "prefill": (
        ("tile", 16, 32, 4, 3, False), ("tile", 32, 32, 4, 3, False),
        ("tile", 64, 64, 8, 2, False),
        ("group", 16, 32, 4, 3, False), ("group", 16, 64, 4, 3, False),
        ("group", 16, 64, 4, 3, True), ("group", 32, 64, 4, 3, False),
        ("group", 32, 64, 8, 3, False), ("group", 64, 64, 8, 2, False),
        ("group", 64, 64, 8, 2, True), ("group", 64, 64, 8, 3, False),
    ),
}


def config_shape(cfg: "KernelConfig") -> tuple:
    """The launch shape of ``cfg`` as in ``GPU_CANDIDATES`` (everything but the split)."""
    return (cfg.variant, cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages,
            cfg.lazy_rescale)


def _default_block_h(T: int, H: int, paged: bool) -> int:
    # decode, 64 heads: 16-head tiles win at 1 and 32 tokens (16.0 vs 24.1 / 37.4 vs 45.8 us
    # for 64-head tiles), 64-head tiles at 128 (89.4 vs 115.1 us)
    if H <= 16 or (paged and T * cdiv(H, 64) <= 32):
        return 16  # few heads, or few tokens: more (smaller) programs
    if H <= 32:
        return 32
    return 64


def config_from_template(T: int, H: int, total_width: int, sms: int, shape: tuple,
                         resident: int, block_n: Optional[int] = None) -> KernelConfig:
    """A KernelConfig for one launch shape (a ``GPU_CANDIDATES`` tuple), with the split
    count of ``default_config`` for ``resident`` programs per SM."""
    variant, bh, bn, warps, stages, lazy = shape
    bn = block_n or bn
    progs = max(1, T * cdiv(H, bh))
    slots = sms * resident
    splits = 1
    if progs < slots:
        splits = max(1, min(slots // progs, cdiv(max(total_width, 1), bn), 32))
    return KernelConfig(block_h=bh, block_n=bn, num_splits=splits, num_warps=warps,
                        num_stages=stages, variant=variant, lazy_rescale=lazy)


@functools.lru_cache(maxsize=4096)
def default_config(T: int, H: int, total_width: int, device: torch.device, *,
                   paged: bool, block_h: Optional[int] = None,
                   block_n: Optional[int] = None) -> KernelConfig:
    """The launch shape used when the caller passes none: a pure function of the shapes (so a
    captured graph replays the same launch). ``block_h``/``block_n`` pin those two.

    GPU: ``_GPU_TEMPLATES`` (H200 measurements, perf/NOTES.md) for the head tile chosen by
    ``_default_block_h``; the key split count fills about one wave of resident programs.
    """
    if device.type != "cuda" or is_interpreter():
        # the interpreter: few, large steps; split only when asked; the variant the GPU
        # defaults use, so that CPU runs exercise it
        return KernelConfig(block_h=block_h or min(64, max(16, next_power_of_2(H))),
                            block_n=block_n or 64, num_splits=1, num_warps=4, num_stages=1,
                            variant="group")
    bh = block_h or _default_block_h(T, H, paged)
    shape, resident = _GPU_TEMPLATES[(paged, min(64, max(16, bh)))]
    shape = (shape[0], bh) + shape[2:]
    return config_from_template(T, H, total_width, _sm_count(device), shape, resident,
                                block_n)


def _page_log2(page: int) -> int:
    """log2(page) for a power of two (the kernel shifts instead of dividing), else -1."""
    return page.bit_length() - 1 if page > 0 and page & (page - 1) == 0 else -1


def launch(q: torch.Tensor, a: KeySet, b: Optional[KeySet], sink: Optional[torch.Tensor],
           softmax_scale: float, out: torch.Tensor, lse: torch.Tensor,
           config: Optional[KernelConfig] = None) -> None:
    """Run the template on validated arguments (no checks here; see decode.py/prefill.py)."""
    T, H, _ = q.shape
    if T == 0 or H == 0:
        return
    cfg = config or default_config(T, H, a.indices.shape[1] + (b.indices.shape[1] if b else 0),
                                   q.device, paged=a.src != SRC_BF16)
    if q.device.type == "cuda" and not is_interpreter() and cfg.block_n < MIN_BLOCK_N_GPU:
        raise ValueError(f"config: block_n must be >= {MIN_BLOCK_N_GPU} on a GPU, got "
                         f"{cfg.block_n} (16-key blocks gave wrong results on an H200 with "
                         f"triton 3.6)")
    bh, ns = cfg.block_h, cfg.num_splits
    n_ht = cdiv(H, bh)
    interp = is_interpreter()
    bb = b if b is not None else a
    if ns > 1:
        po = torch.empty((T, ns, H, HEAD_DIM), dtype=torch.float32, device=q.device)
        pl = torch.empty((T, ns, H), dtype=torch.float32, device=q.device)
    else:
        po = pl = lse  # unused
    sink_arg = sink if sink is not None else lse
    sink_st = sink.stride(0) if sink is not None else 0

    def _lens(ks):
        return (ks.lens if ks.lens is not None else ks.indices,
                ks.lens.stride(0) if ks.lens is not None else 0)

    a_len, a_len_st = _lens(a)
    b_len, b_len_st = _lens(bb)
    da, sa = _SRC_BYTES[a.src]
    db, sbb = _SRC_BYTES[bb.src]
    grid = (T * ns * n_ht,)
    args = (
        q, q.stride(0), q.stride(1),
        a.k, a.indices, a.indices.stride(0), a_len, a_len_st, a.indices.shape[1], a.bstride,
        a.page, a.rows,
        bb.k, bb.indices, bb.indices.stride(0), b_len, b_len_st, bb.indices.shape[1],
        bb.bstride, bb.page, bb.rows,
        sink_arg, sink_st,
        out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1),
        po, pl,
        H, float(softmax_scale) * LOG2E, ns, n_ht,
    )
    kw = dict(SRC_A=a.src, DATA_A=da, SCALE_A=sa, SRC_B=bb.src, DATA_B=db, SCALE_B=sbb,
              HAS_B=b is not None, HAS_LEN_A=a.lens is not None,
              HAS_LEN_B=bb.lens is not None, HAS_SINK=sink is not None,
              SPLIT=ns > 1, BH=bh, BN=cfg.block_n, DOT_F32=interp, SW=interp,
              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.variant == "group":
        k = _sparse_mla_fwd_grouped_kernel[grid](*args, PAGE_LOG2_A=_page_log2(a.page),
                                                 PAGE_LOG2_B=_page_log2(bb.page),
                                                 LAZY=cfg.lazy_rescale, **kw)
    else:
        k = _sparse_mla_fwd_kernel[grid](
            *args, HAS_ROPE=(a.src == 584) or (b is not None and b.src == 584), **kw)
    LAST_LAUNCH["fwd"] = (k, cfg)
    if ns > 1:
        mbh = min(16, next_power_of_2(H))
        m_ht = cdiv(H, mbh)
        _merge_kernel[(T * m_ht,)](
            po, pl, sink_arg, sink_st, out, out.stride(0), out.stride(1),
            lse, lse.stride(0), lse.stride(1), H, ns, m_ht,
            NSP=max(2, next_power_of_2(ns)), BH=mbh,
            HAS_SINK=sink is not None, SW=interp, num_warps=4,
        )


def check_common(q, attn_sink, softmax_scale, out, what: str):
    """Validate ``q``, ``attn_sink``, ``softmax_scale`` and ``out`` (shared by decode and
    prefill); return ``(T, H, scale, out or None)``."""
    check_tensor("q", q, dtypes=(torch.bfloat16,), ndims=3)
    if q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q: expected head_dim {HEAD_DIM} (last dim), got shape {tuple(q.shape)}")
    check_tensor("q", q, last_dim=HEAD_DIM)
    T, H = int(q.shape[0]), int(q.shape[1])
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtypes=(torch.float32,), ndims=1,
                     contiguous_last=False)
        if attn_sink.shape[0] != H:
            raise ValueError(f"attn_sink: expected shape [{H}] (one per head of q), got "
                             f"{tuple(attn_sink.shape)}")
    if softmax_scale is None:
        scale = HEAD_DIM ** -0.5
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale: expected a float or None, got "
                            f"{type(softmax_scale).__name__}")
        scale = float(softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale: expected a finite number, got {scale}")
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,), ndims=3, last_dim=HEAD_DIM)
        check_shape("out", out, (T, H, HEAD_DIM))
    return T, H, scale


def check_lens(name: str, lens, T: int):
    if lens is None:
        return
    check_tensor(name, lens, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    if lens.shape[0] != T:
        raise ValueError(f"{name}: expected shape [{T}] (one per query token), got "
                         f"{tuple(lens.shape)}")


def check_indices(name: str, idx, T: int):
    check_tensor(name, idx, dtypes=INT_DTYPES, ndims=2)
    if idx.shape[0] != T:
        raise ValueError(f"{name}: expected {T} rows (one per query token), got "
                         f"{tuple(idx.shape)}")


def new_outputs(q: torch.Tensor, out: Optional[torch.Tensor]):
    T, H = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    return out, lse


__all__ = ["KeySet", "KernelConfig", "default_config", "launch", "SRC_BF16", "VARIANTS",
           "GPU_CANDIDATES", "config_from_template", "config_shape"]
