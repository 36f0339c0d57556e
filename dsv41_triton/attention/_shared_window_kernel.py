"""The window half of the few-head shared-window prefill (Triton): one program per tile of
``BT`` consecutive query tokens of one request over a bf16 workspace ``kv [S, 512]``.

The tile's ``BT * HP`` query rows (token-major, ``HP`` = heads padded to a power of two) walk
the union of the tokens' window row ranges ``[win_start, win_start + win_len)`` once, ``BN``
rows at a time: each window key is loaded once for every query of the tile. Each row masks
the keys outside its own range. The result is a normalized partial: ``out`` (bf16) and its
``lse`` (natural log, ``+inf`` for a row without window keys). The general kernel
(``_sparse_kernel.py`` with ``PRIOR``) then walks each token's own top-k rows, merges the
partial in and applies the sink.

``_tiles_kernel`` builds the tile list in one launch.

Dims as 8 groups of 64 as in ``_sparse_kernel.py``; fp32 dot operands under the interpreter.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._sparse_kernel import _eager_update, _load_q_group, _scores_grouped, _store_groups


@triton.jit
def _window_partial_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, kstride, S,
    ws_ptr, wl_ptr, tiles_ptr,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    H, qk_scale,
    HP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
    DOT_F32: tl.constexpr, SW: tl.constexpr,
):
    """Grid: one program per tile (``tiles [NT, 2]`` int32: first token, token count; count 0
    = nothing to do). q ``[T, H, 512]`` bf16; ``ws``/``wl`` ``[T]`` int32 window row start and
    length; writes out ``[T, H, 512]`` bf16 and lse ``[T, H]`` fp32 of the tile's rows."""
    tile = tl.program_id(0)
    t0 = tl.load(tiles_ptr + 2 * tile).to(tl.int64)
    cnt = tl.load(tiles_ptr + 2 * tile + 1)
    if cnt > 0:
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
            key = start + tl.arange(0, BN)
            kvalid = (key < hi) & (key >= 0) & (key < S)
            off = tl.where(kvalid, key, 0).to(tl.int64) * kstride
            rv = (kvalid[None, :] & (key[None, :] >= ws_r[:, None])
                  & (key[None, :] < we_r[:, None]))
            s, k0, k1, k2, k3, k4, k5, k6, k7 = _scores_grouped(
                q0, q1, q2, q3, q4, q5, q6, q7, kv_ptr, off, off, off, off, kvalid, 0, BN,
                DOT_F32)
            s = tl.where(rv, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            a0, a1, a2, a3, a4, a5, a6, a7, m_i, l_i = _eager_update(
                s, m_new, k0, k1, k2, k3, k4, k5, k6, k7, a0, a1, a2, a3, a4, a5, a6, a7, m_i,
                l_i, DOT_F32)
        has = l_i != 0.0  # no key <=> l == 0 exactly; NaN propagates
        l_safe = tl.where(has, l_i, 1.0)
        inv = tl.where(has, 1.0 / l_safe, 0.0)
        orow = (out_ptr + t * stride_ot + h64 * stride_oh)[:, None]
        _store_groups(orow, a0, a1, a2, a3, a4, a5, a6, a7, rmask, inv, True, SW)
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("inf"))
        tl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=rmask)


@triton.jit
def _tiles_kernel(qsl_ptr, nq, T, NT, tiles_ptr, BT: tl.constexpr, BB: tl.constexpr,
                  BI: tl.constexpr):
    """``tiles [NT, 2]`` int32 of ``shared_window_tiles`` (see there) from ``qsl [nq]``:
    request ``b`` (and, as ``b = nq - 1``, the tokens past the last request) gets
    ``cdiv(len_b, BT)`` consecutive tiles; ``BB >= nq`` (a power of two), ``BI`` tiles per
    program."""
    e = tl.arange(0, BB)
    q0 = tl.load(qsl_ptr).to(tl.int32)
    qv = tl.load(qsl_ptr + e, mask=e < nq, other=0).to(tl.int32) - q0
    qn = tl.load(qsl_ptr + e + 1, mask=e + 1 < nq, other=0).to(tl.int32) - q0
    lo = tl.minimum(tl.maximum(qv, 0), T)
    up = tl.where(e + 1 < nq, tl.minimum(tl.maximum(qn, 0), T), T)
    n = tl.where(e < nq, tl.maximum(up - lo, 0), 0)
    nt = (n + BT - 1) // BT
    cum = tl.cumsum(nt, 0)
    total = tl.max(cum, 0)
    i = tl.program_id(0) * BI + tl.arange(0, BI)
    b = tl.sum((cum[None, :] <= i[:, None]).to(tl.int32), 1)
    b = tl.minimum(b, nq - 1)
    hit = e[None, :] == b[:, None]
    lo_b = tl.sum(tl.where(hit, lo[None, :], 0), 1)
    up_b = tl.sum(tl.where(hit, up[None, :], 0), 1)
    first_b = tl.sum(tl.where(hit, (cum - nt)[None, :], 0), 1)
    start = lo_b + (i - first_b) * BT
    cnt = tl.maximum(tl.minimum(up_b - start, BT), 0)
    cnt = tl.where(i < total, cnt, 0)
    im = i < NT
    tl.store(tiles_ptr + 2 * i, tl.where(cnt > 0, start, 0), mask=im)
    tl.store(tiles_ptr + 2 * i + 1, cnt, mask=im)
