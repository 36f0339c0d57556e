"""Few-head prefill with a shared window (Triton): one program per tile of ``BT``
consecutive query tokens of one request over a bf16 workspace ``kv [S, 512]``.

Phase 1 (window, shared): the tile's ``BT * HP`` query rows (token-major, ``HP`` = heads
padded to a power of two) walk the union of the tokens' window row ranges ``[win_start,
win_start + win_len)`` once, ``BN`` rows at a time: each window key is loaded once for every
query of the tile (the general kernel loads it once per query). Each row masks the keys
outside its own range. The normalized partial output and its log2-sum-exp go to an fp32
scratch row of the token (``[T, H, 512]`` / ``[T, H]``, read back by the same program).

Phase 2 (top-k, per token): each token of the tile, as ``BH`` (>= 16) head rows, resumes its
softmax state from the scratch and walks its own top-k row list with the general kernel's
loop (``_attend_grouped``), then applies the sink and writes ``out``/``lse``.

Dims as 8 groups of 64 as in ``_sparse_kernel.py``; fp32 dot operands under the interpreter.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._sparse_kernel import _attend_grouped, _load_group, _load_q_group, _store_groups


@triton.jit
def _window_step(a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i,
                 q0, q1, q2, q3, q4, q5, q6, q7,
                 kv_ptr, kstride, S, start, hi, ws_r, we_r, qk_scale,
                 BN: tl.constexpr, DOT_F32: tl.constexpr):
    """One ``BN``-row step of the window phase: keys ``start .. start + BN`` (< hi) for all
    rows; row ``r`` keeps keys in ``[ws_r, we_r)``."""
    key = start + tl.arange(0, BN)
    kvalid = (key < hi) & (key >= 0) & (key < S)
    off = tl.where(kvalid, key, 0).to(tl.int64) * kstride
    rv = kvalid[None, :] & (key[None, :] >= ws_r[:, None]) & (key[None, :] < we_r[:, None])
    k0 = _load_group(kv_ptr, off, off, off, off, kvalid, 0, 0, BN, DOT_F32)
    s = tl.dot(q0, tl.trans(k0))
    k1 = _load_group(kv_ptr, off, off, off, off, kvalid, 1, 0, BN, DOT_F32)
    s = tl.dot(q1, tl.trans(k1), s)
    k2 = _load_group(kv_ptr, off, off, off, off, kvalid, 2, 0, BN, DOT_F32)
    s = tl.dot(q2, tl.trans(k2), s)
    k3 = _load_group(kv_ptr, off, off, off, off, kvalid, 3, 0, BN, DOT_F32)
    s = tl.dot(q3, tl.trans(k3), s)
    k4 = _load_group(kv_ptr, off, off, off, off, kvalid, 4, 0, BN, DOT_F32)
    s = tl.dot(q4, tl.trans(k4), s)
    k5 = _load_group(kv_ptr, off, off, off, off, kvalid, 5, 0, BN, DOT_F32)
    s = tl.dot(q5, tl.trans(k5), s)
    k6 = _load_group(kv_ptr, off, off, off, off, kvalid, 6, 0, BN, DOT_F32)
    s = tl.dot(q6, tl.trans(k6), s)
    k7 = _load_group(kv_ptr, off, off, off, off, kvalid, 7, 0, BN, DOT_F32)
    s = tl.dot(q7, tl.trans(k7), s)
    s = tl.where(rv, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
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
def _load_state_group(srow, hmask, G: tl.constexpr):
    return tl.load(srow + (G * 64 + tl.arange(0, 64))[None, :], mask=hmask[:, None], other=0.0)


@triton.jit
def _shared_window_fwd_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, kstride, S,
    ws_ptr, wl_ptr, idx_ptr, idx_st, len_ptr, len_st, K,
    tiles_ptr,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    scr_ptr, scl_ptr,
    H, qk_scale,
    HP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, LAZY: tl.constexpr,
    DOT_F32: tl.constexpr, SW: tl.constexpr,
):
    """Grid: one program per tile (``tiles [NT, 2]`` int32: first token, token count; count 0
    = nothing to do). q ``[T, H, 512]`` bf16; ``ws``/``wl`` ``[T]`` int32 window row start and
    length; ``idx [T, K]`` top-k rows, ``lens [T]``; out ``[T, H, 512]`` bf16, lse ``[T, H]``
    fp32; scratch ``scr [T, H, 512]`` / ``scl [T, H]`` fp32."""
    tile = tl.program_id(0)
    t0 = tl.load(tiles_ptr + 2 * tile).to(tl.int64)
    cnt = tl.load(tiles_ptr + 2 * tile + 1)
    if cnt > 0:
        # ---- phase 1: the tile's window, rows (token j, head h) = (r // HP, r % HP)
        R: tl.constexpr = BT * HP
        r = tl.arange(0, R)
        j = r // HP
        h = r % HP
        rmask = (j < cnt) & (h < H)
        t = t0 + j.to(tl.int64)
        h64 = h.to(tl.int64)
        ws_r = tl.load(ws_ptr + t, mask=rmask, other=0)
        wl_r = tl.load(wl_ptr + t, mask=rmask, other=0)
        wl_r = tl.where(rmask, tl.maximum(wl_r, 0), 0)
        we_r = ws_r + wl_r
        has_w = wl_r > 0
        lo = tl.maximum(tl.min(tl.where(has_w, ws_r, 2147483647), 0), 0)
        hi = tl.minimum(tl.max(tl.where(has_w, we_r, -2147483647), 0), S)
        qrow = (q_ptr + t * stride_qt + h64 * stride_qh)[:, None]
        q0 = _load_q_group(qrow, rmask, 0, DOT_F32)
        q1 = _load_q_group(qrow, rmask, 1, DOT_F32)
        q2 = _load_q_group(qrow, rmask, 2, DOT_F32)
        q3 = _load_q_group(qrow, rmask, 3, DOT_F32)
        q4 = _load_q_group(qrow, rmask, 4, DOT_F32)
        q5 = _load_q_group(qrow, rmask, 5, DOT_F32)
        q6 = _load_q_group(qrow, rmask, 6, DOT_F32)
        q7 = _load_q_group(qrow, rmask, 7, DOT_F32)
        m_i = tl.full([R], float("-inf"), tl.float32)
        l_i = tl.zeros([R], tl.float32)
        a0 = tl.zeros([R, 64], tl.float32)
        a1 = tl.zeros([R, 64], tl.float32)
        a2 = tl.zeros([R, 64], tl.float32)
        a3 = tl.zeros([R, 64], tl.float32)
        a4 = tl.zeros([R, 64], tl.float32)
        a5 = tl.zeros([R, 64], tl.float32)
        a6 = tl.zeros([R, 64], tl.float32)
        a7 = tl.zeros([R, 64], tl.float32)
        for start in range(lo, hi, BN):
            a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i = _window_step(
                a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i, q0, q1, q2, q3, q4, q5, q6, q7,
                kv_ptr, kstride, S, start, hi, ws_r, we_r, qk_scale, BN, DOT_F32)
        has = l_i != 0.0  # a NaN window state is stored as NaN and stays NaN
        l_safe = tl.where(has, l_i, 1.0)
        inv = tl.where(has, 1.0 / l_safe, 0.0)
        srow = scr_ptr + ((t * H + h64) * 512)[:, None]
        _store_groups(srow, a0, a1, a2, a3, a4, a5, a6, a7, rmask, inv, False, SW)
        tl.store(scl_ptr + t * H + h64, tl.where(has, m_i + tl.log2(l_safe), float("-inf")),
                 mask=rmask)
        tl.debug_barrier()

        # ---- phase 2: each token's top-k rows, resuming from its window state
        hh = tl.arange(0, BH)
        hm = hh < H
        hh64 = hh.to(tl.int64)
        for jj in range(0, cnt):
            tt = t0 + jj
            qr = q_ptr + tt * stride_qt + hh64[:, None] * stride_qh
            p0 = _load_q_group(qr, hm, 0, DOT_F32)
            p1 = _load_q_group(qr, hm, 1, DOT_F32)
            p2 = _load_q_group(qr, hm, 2, DOT_F32)
            p3 = _load_q_group(qr, hm, 3, DOT_F32)
            p4 = _load_q_group(qr, hm, 4, DOT_F32)
            p5 = _load_q_group(qr, hm, 5, DOT_F32)
            p6 = _load_q_group(qr, hm, 6, DOT_F32)
            p7 = _load_q_group(qr, hm, 7, DOT_F32)
            sr = scr_ptr + ((tt * H + hh64) * 512)[:, None]
            b0 = _load_state_group(sr, hm, 0)
            b1 = _load_state_group(sr, hm, 1)
            b2 = _load_state_group(sr, hm, 2)
            b3 = _load_state_group(sr, hm, 3)
            b4 = _load_state_group(sr, hm, 4)
            b5 = _load_state_group(sr, hm, 5)
            b6 = _load_state_group(sr, hm, 6)
            b7 = _load_state_group(sr, hm, 7)
            mm = tl.load(scl_ptr + tt * H + hh64, mask=hm, other=float("-inf"))
            ll = tl.where(mm == float("-inf"), 0.0, 1.0)  # a NaN state stays NaN below
            if HAS_LEN:
                n = tl.load(len_ptr + tt * len_st).to(tl.int32)
                n = tl.minimum(tl.maximum(n, 0), K)
            else:
                n = K + 0
            b0, b1, b2, b3, b4, b5, b6, b7, mm, ll = _attend_grouped(
                b0, b1, b2, b3, b4, b5, b6, b7, mm, ll, p0, p1, p2, p3, p4, p5, p6, p7,
                kv_ptr, idx_ptr + tt * idx_st, 0, n, kstride, 1, S, qk_scale,
                0, 0, 0, -1, BN, DOT_F32, LAZY)
            ok = ll != 0.0  # no key <=> l == 0 exactly; NaN propagates
            ls = tl.where(ok, ll, 1.0)
            den = ls
            if HAS_SINK:
                ms = tl.where(ok, mm, 0.0)
                sink = tl.load(sink_ptr + hh64 * sink_st, mask=hm, other=float("-inf"))
                den = den + tl.exp2(sink * 1.4426950408889634 - ms)
                # a NaN sink: NaN rows without keys too (docs/semantics.md)
                iv = tl.where(ok, 1.0 / den, tl.where(sink != sink, float("nan"), 0.0))
            else:
                iv = tl.where(ok, 1.0 / den, 0.0)
            orow = out_ptr + tt * stride_ot + hh64[:, None] * stride_oh
            _store_groups(orow, b0, b1, b2, b3, b4, b5, b6, b7, hm, iv, True, SW)
            lse = tl.where(ok, (mm + tl.log2(ls)) * 0.6931471805599453, float("inf"))
            tl.store(lse_ptr + tt * stride_lt + hh64 * stride_lh, lse, mask=hm)
