"""Sparse MLA prefill for Hopper in Gluon: ``sparse_mla_prefill``'s contract (SPEC §3, §6).

One CTA (two warpgroups, 8 warps) owns one query token and a tile of 64 heads (the wgmma M;
fewer heads are zero rows, masked on store); it walks the token's index row in blocks of
``BN = 64`` keys through one online softmax. Per block ``j``:

1. **gather** (issued one block ahead, its index loads two blocks ahead): the block's rows of the bf16 workspace are copied by
   ``cp.async`` (16 bytes per copy, 1 KB per key) into stage ``j % 2`` of a ring of
   ``[64 keys, 512]`` NVMMA tiles; invalid columns (index ``< 0``, ``>= rows``, past ``len``)
   copy nothing (zero fill) and are ``-inf`` in S.
2. **S = Q K^T** (``[64 heads, 64 keys]``, Q resident in shared memory): warpgroup ``w``
   computes keys ``32 w .. 32 w + 31`` over all 512 dims (accumulator ``warps_per_cta =
   [4, 2]``), so no partial S is exchanged; the row max crosses the two warpgroups.
3. **exp2 online softmax** in fp32 (optionally lazy: the state is rescaled only when a row's
   max grew by more than ``2**8``); P goes to a ``[64, 64]`` bf16 tile as the A operand.
4. **O += P V** (``[64 heads, 512]``): warpgroup ``w`` owns value dims ``256 w .. 256 w + 255``
   (128 fp32 registers per thread), V read MN-major from the same key tile.

The sink joins the denominator in the epilogue (``exp(sink - m)``); lse is the natural log
without it; a row without keys gives 0 and +inf. No host sync, fixed grid: CUDA-graph safe.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ._api import ROW_POINTER_HINT, async_load, barrier
from .common import _finish_rows

#: keys per block (the N of S, the K of P V)
BN = gl.constexpr(64)
#: heads per CTA (the wgmma M)
BH = gl.constexpr(64)
#: warps per CTA (two warpgroups)
NUM_WARPS = 8



@gluon.jit
def _row_offsets(idx_row, c0, hi, rows, kv_stride, LC: gl.constexpr):
    """Element offsets of the workspace rows of columns ``c0 .. c0 + 63`` of one index row
    (``[64]`` int64 in the copy layout's row slice), ``-1`` where a column is not read."""
    r = c0 + gl.arange(0, 64, layout=gl.SliceLayout(1, LC))
    cm = r < hi
    idx = gl.load(idx_row + r, mask=cm, other=-1).to(gl.int64)
    ok = cm & (idx >= 0) & (idx < rows)
    return gl.where(ok, idx * kv_stride, -1)


@gluon.jit
def _issue_keys(kv_ptr, off, ring, s, LC: gl.constexpr):
    """cp.async the rows at element offsets ``off`` (``-1``: copy nothing, zero fill) into
    ``ring[s]`` and commit them as one group."""
    ok = off >= 0
    row_off = gl.multiple_of(gl.where(ok, off, 0), 8)  # 16-byte rows (host check)
    d = gl.arange(0, 512, layout=gl.SliceLayout(0, LC))
    p = kv_ptr + row_off[:, None] + d[None, :]
    if ROW_POINTER_HINT:  # set where the value is made (a helper's argument drops it)
        p = gl.max_contiguous(gl.multiple_of(p, [1, 8]), [1, 8])
    async_load(ring.index(s), p, mask=ok[:, None])
    cp.commit_group()


@gluon.jit
def _sparse_mla_prefill_gluon_kernel(
    q_ptr, stride_qt, stride_qh,
    kv_ptr, kv_stride, rows,
    idx_ptr, idx_st, width, len_ptr, len_st,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    H, qk_scale, num_ht,
    HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, LAZY: gl.constexpr,
):
    """Grid ``T * num_ht`` (head tile fastest). q ``[T, H, 512]`` bf16 (16-byte aligned rows);
    kv ``[rows, 512]`` bf16 rows ``kv_stride`` elements apart; index rows ``[T, width]``
    int32/int64 ``idx_st`` apart; lens ``[T]``; sink ``[H]`` fp32; out ``[T, H, 512]`` bf16;
    lse ``[T, H]`` fp32. ``qk_scale`` is the softmax scale times log2(e)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, 32, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, 256, 16])
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 512], gl.bfloat16)
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 512], gl.bfloat16)
    PL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BN], gl.bfloat16)

    pid = gl.program_id(0)
    ht = pid % num_ht
    t = (pid // num_ht).to(gl.int64)

    ring = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 512], KL)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, 512], QL)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], PL)

    if HAS_LEN:
        n = gl.load(len_ptr + t * len_st).to(gl.int32)
        n = gl.minimum(gl.maximum(n, 0), width)
    else:
        n = width + 0
    nblk = gl.cdiv(n, BN)
    idx_row = idx_ptr + t * idx_st

    # ---- Q (resident; rows past H are zero) and block 0: one cp.async group ------------
    hq = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, LC))
    dq = gl.arange(0, 512, layout=gl.SliceLayout(0, LC))
    q_off = gl.multiple_of(t * stride_qt + hq.to(gl.int64) * stride_qh, 8)
    qp = q_ptr + q_off[:, None] + dq[None, :]
    async_load(q_smem, qp, mask=(hq < H)[:, None])
    _issue_keys(kv_ptr, _row_offsets(idx_row, 0, n, rows, kv_stride, LC), ring, 0, LC)
    # the row offsets of block 1, loaded a block ahead of their copies (the index loads'
    # latency stays off the loop's critical path)
    nxt = _row_offsets(idx_row, BN, n, rows, kv_stride, LC)

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=ROW_S)
    l_part = gl.full([BH, BN], 0.0, gl.float32, layout=S_L)
    s_zero = gl.full([BH, BN], 0.0, gl.float32, layout=S_L)
    o = gl.full([BH, 512], 0.0, gl.float32, layout=O_L)
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))

    for j in range(nblk):
        s = j % 2
        # block j has landed (every thread's copies) and every warp is past the P V product
        # of block j - 1, the last reader of the other stage
        cp.wait_group(0)
        fence_async_shared()
        barrier()
        kt = ring.index(s)

        # S = Q K^T: each warpgroup its 32 keys over all 512 dims; the next block's rows are
        # gathered into the other stage meanwhile
        acc = warpgroup_mma(q_smem, kt.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if j + 1 < nblk:
            _issue_keys(kv_ptr, nxt, ring, 1 - s, LC)
        nxt = _row_offsets(idx_row, (j + 2) * BN, n, rows, kv_stride, LC)
        # the validity of this block's columns, in the accumulator's column layout
        c = j * BN + cols
        cm = c < n
        ci = gl.load(idx_row + c, mask=cm, other=-1).to(gl.int64)
        ok = cm & (ci >= 0) & (ci < rows)
        sc = warpgroup_mma_wait(0, deps=[acc])
        sc = gl.where(ok[None, :], sc * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        if LAZY:
            # keep the stale max unless some row's grew by more than 2**8 (p <= 2**8 then;
            # out and lse use the same max as l and O, so this is exact)
            grow = gl.max((m_new > m_i + 8.0).to(gl.int32), axis=0) > 0
            m_keep = gl.where(grow, m_new, m_i)
            m_safe = gl.where(m_keep == float("-inf"), 0.0, m_keep)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(sc - m_safe[:, None])
            l_part = l_part * alpha[:, None] + p
            if grow:
                o = o * gl.convert_layout(alpha, ROW_O)[:, None]
            m_i = m_keep
        else:
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(sc - m_safe[:, None])
            l_part = l_part * alpha[:, None] + p
            o = o * gl.convert_layout(alpha, ROW_O)[:, None]
            m_i = m_new
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        barrier()

        # O += P V: each warpgroup its 256 value dims
        o = warpgroup_mma(p_smem, kt, o, is_async=True)
        o = warpgroup_mma_wait(0, deps=[o])
    cp.wait_group(0)
    l_i = gl.sum(l_part, axis=1)

    # ---- epilogue -----------------------------------------------------------------------
    h = ht * BH + gl.arange(0, BH, layout=ROW_S)
    hmask = h < H
    h64 = h.to(gl.int64)
    inv, lse = _finish_rows(l_i, m_i, h64, hmask, sink_ptr, sink_st, HAS_SINK)
    gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)

    ho = ht * BH + gl.arange(0, BH, layout=ROW_O)
    do = gl.arange(0, 512, layout=gl.SliceLayout(0, O_L))
    v = (o * gl.convert_layout(inv, ROW_O)[:, None]).to(gl.bfloat16)
    op = out_ptr + t * stride_ot + ho.to(gl.int64)[:, None] * stride_oh + do[None, :]
    gl.store(op, v, mask=(ho < H)[:, None])
