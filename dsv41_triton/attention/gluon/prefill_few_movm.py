"""Few-heads (H <= 8) sparse MLA prefill for Hopper that reads each key tile from shared memory
once (form ``"movm"`` of ``prefill_launch._launch_few``; not picked: 1.6x the wgmma form's time
at the issue's 8-head shape on the H100, perf/NOTES.md "Session 27").

The same producer, ring, index and Q slots as ``prefill_few.py``. Two ``mma.sync`` consumer
warpgroups split the 512 dims (consumer ``C``: dim groups ``4C .. 4C + 3``); in each, warp ``w``
owns keys ``16w .. 16w + 15`` of every 64-key block:

* ``S^T`` partial ``[64 keys, 8 heads]`` over the consumer's 256 dims, its 4 key tiles kept in
  registers (``[64, 64]`` A fragments, 64 registers a thread);
* the two partials swapped through shared memory (``sx``, one ``x_ready`` barrier per consumer
  and block parity) and added, in the same order in both, so both run the same softmax;
* each warp keeps its own online softmax over its 16 keys of each block (no cross-warp step
  per block), ``P^T`` in the B layout;
* ``O^T`` of its 16 keys for the consumer's dims: the A operand ``K^T [64 dims, 16 keys]`` of
  each dim group is the warp's S fragment transposed by ``movmatrix`` (8 x 8 blocks across the
  warp) and renamed by a reshape / permute (no data moves; ``perf/movmatrix_probe.py``), and
  the warps' tiles are one batched ``[4, 64, 16] x [4, 16, 8]`` product;
* at the token's end the 4 warps' states are merged (a reduction over the warp axis), the
  consumer stores its 256 dims, consumer 0 the lse.

A stage is freed as soon as both consumers hold its keys in registers (after S). ``MODE`` as in
``prefill_few.py`` (1: copies alone, 2: products alone). No ``PRIOR``.

Why it loses: the swap makes both consumers work on the same block in lock step, so an SM has
one block in flight, and a block's dependent chain (ldmatrix, S, swap, softmax, 64 movmatrix,
O) takes ~4100 cycles; ``movmatrix`` itself issues at ~1 per clock per SM, i.e. it costs about
the shared-memory bandwidth the second read it replaces would have.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ._api import barrier
from .common import _finish_rows
from .prefill_few import (A2, K2, MMA2, _block_keys, _consumer_consts, _consumer_token,
                          _producer, _q_b, _shared, _token_len, _token_slots)

__all__ = ["MOVM_REGS", "_sparse_mla_prefill_gluon_few_movm_kernel"]

MOVM_REGS = gl.constexpr(224)
#: warp ``w``'s own products: batch ``w`` of ``[4, M, N]`` (mma.sync, 16 rows a step)
MMA3 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1],
                                               instr_shape=[1, 16, 8]))
A3 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA3, k_width=2))
B3 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA3, k_width=2))
W3 = gl.constexpr(gl.SliceLayout(1, MMA3))  # [4 warps, 8 heads]: a warp's softmax state
OT = gl.constexpr(gl.SliceLayout(0, MMA3))  # [64 dims, 8 heads]: a merged O^T tile
HO = gl.constexpr(gl.SliceLayout(0, OT))


@gluon.jit
def _transpose_blocks(x):
    """Each 8 x 8 block of an ``mma.sync`` fragment transposed across the warp (``movmatrix``)."""
    return gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
                                     [x], dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def _keys_t(kf):
    """A ``[64 keys, 64 dims]`` A fragment (warp ``w``: keys ``16w ..``) as each warp's ``K^T
    [4, 64 dims, 16 keys]`` A fragment: ``movmatrix``, then a renaming that moves no data."""
    t = _transpose_blocks(kf)
    vt = gl.reshape(gl.permute(gl.reshape(t, [4, 2, 8, 8, 8]), (0, 3, 2, 1, 4)), [4, 64, 16])
    return gl.convert_layout(vt, A3)


@gluon.jit
def _consumer_movm(pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr, sink_st,
                   out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, q_smem, ring,
                   idx_rows, sx, q_ready, q_free, i_ready, i_free, ready, free, x_ready,
                   HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, NS: gl.constexpr,
                   WB: gl.constexpr, MODE: gl.constexpr, C: gl.constexpr):
    zero2 = gl.full([64, 8], 0.0, gl.float32, layout=MMA2)
    zero3 = gl.full([4, 64, 8], 0.0, gl.float32, layout=MMA3)
    dr, h64, hmask, om, sink = _consumer_consts(H, sink_ptr, sink_st, HAS_SINK,
                                                gl.SliceLayout(1, OT), HO)
    n_next = _token_len(pid, T, len_ptr, len_st, width, HAS_LEN)
    g = 0
    k = 0
    for item in range(pid, T, grid):
        t, n, n_next, nblk, qs, si = _consumer_token(item, grid, k, n_next, T, len_ptr, len_st,
                                                     width, HAS_LEN)
        m_i = gl.full([4, 8], float("-inf"), gl.float32, layout=W3)
        l_i = gl.full([4, 8], 0.0, gl.float32, layout=W3)
        o0 = zero3
        o1 = zero3
        o2 = zero3
        o3 = zero3
        _token_slots(q_ready, i_ready, q_free, i_free, qs, si, k, nblk == 0)
        for b in range(nblk):
            s = g % NS
            x = g % 2
            base = s * 8 + 4 * C
            qb = qs * 8 + 4 * C
            ok = _block_keys(idx_rows, si * WB + b, b, n, rows, K2)
            mbarrier.wait(ready.index(s), (g // NS) & 1)
            last = b == nblk - 1
            if MODE == 1:
                barrier()
                mbarrier.arrive(free.index(s))
                mbarrier.arrive(q_free.index(qs), pred=last)
                mbarrier.arrive(i_free.index(si), pred=last)
            else:
                k0 = ring.index(base).load(A2)
                k1 = ring.index(base + 1).load(A2)
                k2 = ring.index(base + 2).load(A2)
                k3 = ring.index(base + 3).load(A2)
                s0 = mma_v2(k0, _q_b(q_smem, qb), zero2)
                s1 = mma_v2(k1, _q_b(q_smem, qb + 1), zero2)
                s0 = mma_v2(k2, _q_b(q_smem, qb + 2), s0)
                s1 = mma_v2(k3, _q_b(q_smem, qb + 3), s1)
                sp = s0 + s1
                sx.index(2 * C + x).store(sp)
                barrier()
                mbarrier.arrive(free.index(s))
                mbarrier.arrive(q_free.index(qs), pred=last)
                mbarrier.arrive(i_free.index(si), pred=last)
                mbarrier.arrive(x_ready.index(2 * C + x))
                mbarrier.wait(x_ready.index(2 * (1 - C) + x), (g // 2) & 1)
                so = sx.index(2 * (1 - C) + x).load(MMA2)
                acc = (sp + so) if C == 0 else (so + sp)
                sc = gl.where(ok[:, None], acc * qk_scale, float("-inf"))
                sc3 = gl.convert_layout(gl.reshape(sc, [4, 16, 8]), MMA3)
                m_new = gl.maximum(m_i, gl.max(sc3, axis=1))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(sc3 - m_safe[:, None, :])
                l_i = l_i * alpha + gl.sum(p, axis=1)
                pb = gl.convert_layout(p.to(gl.bfloat16), B3)
                a3 = alpha[:, None, :]
                o0 = mma_v2(_keys_t(k0), pb, o0 * a3)
                o1 = mma_v2(_keys_t(k1), pb, o1 * a3)
                o2 = mma_v2(_keys_t(k2), pb, o2 * a3)
                o3 = mma_v2(_keys_t(k3), pb, o3 * a3)
                m_i = m_new
            g += 1
        # the 4 warps' states merged
        m_c = gl.max(m_i, axis=0)
        m_cs = gl.where(m_c == float("-inf"), 0.0, m_c)
        w = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - m_cs[None, :]))
        l_c = gl.convert_layout(gl.sum(l_i * w, axis=0), HO)
        inv, lse = _finish_rows(l_c, gl.convert_layout(m_c, HO), h64, hmask, sink_ptr, sink_st,
                                HAS_SINK, True, sink)
        if C == 0:
            gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
        w3 = w[:, None, :]
        iv = inv[None, :]
        orow = out_ptr + t * stride_ot + h64[None, :] * stride_oh + (256 * C + dr)[:, None]
        gl.store(orow, (gl.sum(o0 * w3, axis=0) * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 64, (gl.sum(o1 * w3, axis=0) * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 128, (gl.sum(o2 * w3, axis=0) * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 192, (gl.sum(o3 * w3, axis=0) * iv).to(gl.bfloat16), mask=om)
        k += 1


@gluon.jit
def _sparse_mla_prefill_gluon_few_movm_kernel(
        q_ptr, stride_qt, stride_qh, kv_ptr, kv_stride, rows, idx_ptr, idx_st, width, len_ptr,
        len_st, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
        T, H, qk_scale, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, PRIOR: gl.constexpr,
        NS: gl.constexpr, WB: gl.constexpr, MODE: gl.constexpr):
    """``prefill_few._sparse_mla_prefill_gluon_few_kernel``'s arguments and producer (``PRIOR``
    must be False); the products by the two dim-split ``mma.sync`` consumers above."""
    gl.static_assert(not PRIOR, "the movm form has no prior")
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    ring, q_smem, idx_smem, idx_rows, q_ready, q_free, i_ready, i_free, ready, free = _shared(
        NS, WB, 2, 2)
    sx = gl.allocate_shared_memory(gl.float32, [4, 64, 8], SL)
    x_ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(x_ready.index(i), count=1)
    gl.warp_specialize([
        (_producer, (pid, grid, T, width, len_ptr, len_st, q_ptr, stride_qt, stride_qh, kv_ptr,
                     kv_stride, rows, idx_ptr, idx_st, H, q_smem, ring, idx_smem, idx_rows,
                     q_ready, q_free, i_ready, i_free, ready, free, HAS_LEN, NS, WB, MODE)),
        (_consumer_movm, (pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr,
                          sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                          stride_lh, q_smem, ring, idx_rows, sx, q_ready, q_free, i_ready,
                          i_free, ready, free, x_ready, HAS_LEN, HAS_SINK, NS, WB, MODE, 0)),
        (_consumer_movm, (pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr,
                          sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt,
                          stride_lh, q_smem, ring, idx_rows, sx, q_ready, q_free, i_ready,
                          i_free, ready, free, x_ready, HAS_LEN, HAS_SINK, NS, WB, MODE, 1)),
    ], [4, 4], [MOVM_REGS, MOVM_REGS])
