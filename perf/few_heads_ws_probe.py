"""A persistent warp-specialized few-heads (H <= 8) prefill over the bf16 workspace with the keys
as the wgmma M (sm_90, Gluon, Triton 3.6). A design probe for the 8-head prefill (issue 11's
<= 300 µs); it compiles for sm_90a (``tests/perf/test_few_heads_ws_probe.py``) and matches
``sparse_mla_prefill`` on the H200 (ragged / empty / -1 / out-of-range rows, 1-8 heads, more
tokens than SMs). Measured there: 490.7 µs at 4096 tokens x 640 keys, 401.0 at 512 (the general
kernel 553.1 / 458.1); the row copies alone 341 / 278, the products alone 413 / 336 (perf/NOTES.md,
"Session 17").

    python perf/few_heads_ws_probe.py            # GPU: check against sparse_mla_prefill, time
    python perf/few_heads_ws_probe.py --compile  # CPU: registers, stack, shared memory, SASS
                                                 # (--json: one JSON line per configuration)

Why: the general kernel pads 8 heads to a 16-row ``mma.sync`` M and runs latency-bound at 2 CTAs
per SM; the Gluon many-heads kernels pad them to a 64-row ``wgmma`` M (8x the products). With
the keys as M (S^T = K Q^T, O^T = K^T P^T, N = 8 heads) the products cost 1/8 of that, and the
block's 1 KB rows are the A operand of both. ``launch(..., mode=1)`` runs the copies alone (the
consumer frees each stage unread), ``mode=2`` the products alone (no row copies).
``a_regs=True`` loads each product's A (a ring tile, transposed for O^T) into registers with
``ldmatrix`` and waits until one product is in flight before the next tile's load (compiled
for sm_90a without local memory; not yet run on a GPU): the products alone are bound at ~39
cycles per m64n8k16 with A read from shared memory.

Grid: min(SMs, T) CTAs; CTA ``pid`` takes tokens ``pid, pid + grid, ...`` (its ``k``-th token).

* producer (default partition, 4 warps): token ``k + 2``'s index row by cp.async into slot
  ``(k + 2) % 3`` (so neither side waits on a global load of indices per block), token ``k``'s
  Q as 8 ``[8 heads, 64 dims]`` tiles by cp.async into Q slot ``k % 2``, then each 64-key block's
  rows by cp.async into ring stage ``g % NS`` (8 ``[64 keys, 64 dims]`` NVMMA tiles), the row
  addresses read from the index slot in shared memory.
* consumer (worker, 4 warps): per block, ``S^T [64 keys, 8] = sum_g K_g Q_g^T`` (8 products from
  shared memory, B = the Q tile transposed), the online softmax down the keys (the block's
  validity from the index slot), ``P^T`` to shared memory, ``O^T_g [64 dims, 8] += K_g^T P^T``
  for the 8 dim tiles (A = the ring tile transposed); then it frees the stage. The epilogue is
  the package's (``_finish_rows``: sink, empty rows 0 / +inf).

Barriers (``wait(bar, p)`` returns once the phase of parity ``p`` completed; a fresh barrier
passes ``p = 1``; the ``*_ready`` ones complete when all 128 producer threads' copies landed,
by cp.async's noinc arrive): ``ready[s]`` / ``free[s]`` per block ``g`` (use ``g // NS``),
``q_ready[k % 2]`` / ``q_free[k % 2]`` per token (use ``k // 2``; the consumer frees Q after the
token's last S, or at once when the token has no keys), ``i_ready[k % 3]`` / ``i_free[k % 3]``
per token (use ``k // 3``; the producer and the consumer both wait ``i_ready``).
"""
from __future__ import annotations

import os
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv41_triton.attention.gluon.common import _finish_rows  # noqa: E402

NUM_WARPS = 4
CONSUMER_REGS = gl.constexpr(232)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                              instr_shape=[16, 8, 16]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))  # A in registers
KM = gl.constexpr(gl.SliceLayout(1, MMA))  # keys (S^T rows) / dims (O^T rows)
HM = gl.constexpr(gl.SliceLayout(0, MMA))  # heads
LR = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))  # [64, 64] bf16 row copies
LQ = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))  # [8, 64] bf16 Q copies
LI = gl.constexpr(gl.BlockedLayout([1, 2], [1, 32], [4, 1], [1, 0]))  # [WB, 64] int32 copies
IDX_SLOTS = gl.constexpr(3)  # a token's index row is copied two tokens ahead


@gluon.jit
def _k_operand(tile, A_REGS: gl.constexpr):
    """A product's A: a ring tile (or its transpose) from shared memory, or loaded into registers
    (``ldmatrix``) with ``A_REGS``."""
    if A_REGS:
        return tile.load(A_OP)
    else:
        return tile


@gluon.jit
def _o_step(tile, p_smem, o, prev, A_REGS: gl.constexpr):
    """Issues ``O^T_i += K_i^T P^T`` (``tile`` = K_i); with ``A_REGS`` it then waits until at
    most this product is in flight (retiring ``prev``, so one tile's registers are live)."""
    a = _k_operand(tile.permute((1, 0)), A_REGS)
    o = warpgroup_mma(a, p_smem, o, is_async=True)
    if A_REGS:
        o, a, prev = warpgroup_mma_wait(1, deps=[o, a, prev])
    return o, prev


@gluon.jit
def _token_len(item, T, len_ptr, len_st, width, HAS_LEN: gl.constexpr):
    """Columns token ``item`` reads (0 past ``T``)."""
    if HAS_LEN:
        n = gl.load(len_ptr + item.to(gl.int64) * len_st, mask=item < T, other=0).to(gl.int32)
        n = gl.minimum(gl.maximum(n, 0), width)
    else:
        n = width + 0
    return gl.where(item < T, n, 0)


@gluon.jit
def _copy_index_row(k, item, T, idx_ptr, idx_st, width, idx_smem, i_ready, i_free,
                    WB: gl.constexpr):
    """The CTA's ``k``-th token's index row (``item``) into slot ``k % IDX_SLOTS``."""
    if item < T:
        s = k % IDX_SLOTS
        mbarrier.wait(i_free.index(s), ((k // IDX_SLOTS) & 1) ^ 1)
        rb = gl.arange(0, WB, layout=gl.SliceLayout(1, LI))
        cb = gl.arange(0, 64, layout=gl.SliceLayout(0, LI))
        col = rb[:, None] * 64 + cb[None, :]
        cp.async_copy_global_to_shared(idx_smem.index(s),
                                       idx_ptr + item.to(gl.int64) * idx_st + col,
                                       mask=col < width)
        cp.mbarrier_arrive(i_ready.index(s), increment_count=False)


@gluon.jit
def _producer(pid, grid, T, width, len_ptr, len_st, q_ptr, stride_qt, stride_qh, kv_ptr,
              kv_stride, rows, idx_ptr, idx_st, H, q_smem, ring, idx_smem, idx_rows, q_ready,
              q_free, i_ready, i_free, ready, free, HAS_LEN: gl.constexpr, NS: gl.constexpr,
              WB: gl.constexpr, MODE: gl.constexpr):
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, LR))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, LR))
    hq = gl.arange(0, 8, layout=gl.SliceLayout(1, LQ))
    dq = gl.arange(0, 64, layout=gl.SliceLayout(0, LQ))
    qmask = (hq < H)[:, None] & (dq < 64)[None, :]
    _copy_index_row(0, pid, T, idx_ptr, idx_st, width, idx_smem, i_ready, i_free, WB)
    _copy_index_row(1, pid + grid, T, idx_ptr, idx_st, width, idx_smem, i_ready, i_free, WB)
    n_next = _token_len(pid, T, len_ptr, len_st, width, HAS_LEN)
    g = 0
    k = 0
    for item in range(pid, T, grid):
        n = n_next
        n_next = _token_len(item + grid, T, len_ptr, len_st, width, HAS_LEN)
        _copy_index_row(k + 2, item + 2 * grid, T, idx_ptr, idx_st, width, idx_smem, i_ready,
                        i_free, WB)
        qs = k % 2
        mbarrier.wait(q_free.index(qs), ((k // 2) & 1) ^ 1)
        qrow = q_ptr + item.to(gl.int64) * stride_qt + hq.to(gl.int64)[:, None] * stride_qh
        for grp in gl.static_range(8):
            cp.async_copy_global_to_shared(q_smem.index(qs * 8 + grp),
                                           qrow + (grp * 64 + dq)[None, :], mask=qmask)
        cp.mbarrier_arrive(q_ready.index(qs), increment_count=False)
        si = k % IDX_SLOTS
        mbarrier.wait(i_ready.index(si), (k // IDX_SLOTS) & 1)
        for b in range(gl.cdiv(n, 64)):
            s = g % NS
            col = b * 64 + r
            ix = idx_rows.index(si * WB + b).load(gl.SliceLayout(1, LR))
            ok = (col < n) & (ix >= 0) & (ix < rows)
            off = gl.multiple_of(gl.where(ok, ix.to(gl.int64) * kv_stride, 0), 8)
            mbarrier.wait(free.index(s), ((g // NS) & 1) ^ 1)
            if MODE != 2:
                for grp in gl.static_range(8):
                    cp.async_copy_global_to_shared(
                        ring.index(s * 8 + grp), kv_ptr + off[:, None] + (grp * 64 + c)[None, :],
                        mask=ok[:, None], eviction_policy="evict_last")
            cp.mbarrier_arrive(ready.index(s), increment_count=False)
            g += 1
        k += 1


@gluon.jit
def _consumer(pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr, sink_st,
              out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, q_smem, ring,
              idx_rows, p_smem, q_ready, q_free, i_ready, i_free, ready, free,
              HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, NS: gl.constexpr,
              WB: gl.constexpr, MODE: gl.constexpr, A_REGS: gl.constexpr):
    zero = gl.full([64, 8], 0.0, gl.float32, layout=MMA)
    kr = gl.arange(0, 64, layout=KM)
    h = gl.arange(0, 8, layout=HM)
    hmask = h < H
    h64 = h.to(gl.int64)
    n_next = _token_len(pid, T, len_ptr, len_st, width, HAS_LEN)
    g = 0
    k = 0
    for item in range(pid, T, grid):
        t = item.to(gl.int64)
        n = n_next
        n_next = _token_len(item + grid, T, len_ptr, len_st, width, HAS_LEN)
        nblk = gl.cdiv(n, 64)
        qs = k % 2
        si = k % IDX_SLOTS
        m_i = gl.full([8], float("-inf"), gl.float32, layout=HM)
        l_i = gl.full([8], 0.0, gl.float32, layout=HM)
        o0 = zero
        o1 = zero
        o2 = zero
        o3 = zero
        o4 = zero
        o5 = zero
        o6 = zero
        o7 = zero
        mbarrier.wait(q_ready.index(qs), (k // 2) & 1)
        mbarrier.wait(i_ready.index(si), (k // IDX_SLOTS) & 1)
        gl.thread_barrier()
        mbarrier.arrive(q_free.index(qs), pred=nblk == 0)
        mbarrier.arrive(i_free.index(si), pred=nblk == 0)
        for b in range(nblk):
            s = g % NS
            col = b * 64 + kr
            ix = idx_rows.index(si * WB + b).load(KM)
            ok = (col < n) & (ix >= 0) & (ix < rows)
            base = s * 8 + (b >> 30)  # opaque 0: the descriptors stay in the loop
            qb = qs * 8 + (b >> 30)
            mbarrier.wait(ready.index(s), (g // NS) & 1)
            if MODE == 1:
                gl.thread_barrier()
                mbarrier.arrive(free.index(s))
                mbarrier.arrive(q_free.index(qs), pred=b == nblk - 1)
                mbarrier.arrive(i_free.index(si), pred=b == nblk - 1)
            else:
                fence_async_shared()
                acc = warpgroup_mma(_k_operand(ring.index(base), A_REGS),
                                    q_smem.index(qb).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                for grp in gl.static_range(1, 8):
                    a = _k_operand(ring.index(base + grp), A_REGS)
                    acc = warpgroup_mma(a, q_smem.index(qb + grp).permute((1, 0)), acc,
                                        is_async=True)
                    if A_REGS:  # one tile's registers in flight behind the current product
                        acc, a = warpgroup_mma_wait(1, deps=[acc, a])
                acc = warpgroup_mma_wait(0, deps=[acc])
                gl.thread_barrier()
                mbarrier.arrive(q_free.index(qs), pred=b == nblk - 1)
                mbarrier.arrive(i_free.index(si), pred=b == nblk - 1)
                sc = gl.where(ok[:, None], acc * qk_scale, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(sc, axis=0))
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_safe)
                p = gl.exp2(sc - m_safe[None, :])
                l_i = l_i * alpha + gl.sum(p, axis=0)
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                gl.thread_barrier()
                a2 = alpha[None, :]
                o0 = warpgroup_mma(_k_operand(ring.index(base).permute((1, 0)), A_REGS), p_smem,
                                   o0 * a2, is_async=True)
                o1, o0 = _o_step(ring.index(base + 1), p_smem, o1 * a2, o0, A_REGS)
                o2, o1 = _o_step(ring.index(base + 2), p_smem, o2 * a2, o1, A_REGS)
                o3, o2 = _o_step(ring.index(base + 3), p_smem, o3 * a2, o2, A_REGS)
                o4, o3 = _o_step(ring.index(base + 4), p_smem, o4 * a2, o3, A_REGS)
                o5, o4 = _o_step(ring.index(base + 5), p_smem, o5 * a2, o4, A_REGS)
                o6, o5 = _o_step(ring.index(base + 6), p_smem, o6 * a2, o5, A_REGS)
                o7, o6 = _o_step(ring.index(base + 7), p_smem, o7 * a2, o6, A_REGS)
                o0, o1, o2, o3, o4, o5, o6, o7 = warpgroup_mma_wait(
                    0, deps=[o0, o1, o2, o3, o4, o5, o6, o7])
                gl.thread_barrier()
                mbarrier.arrive(free.index(s))
                m_i = m_new
            g += 1
        inv, lse = _finish_rows(l_i, m_i, h64, hmask, sink_ptr, sink_st, HAS_SINK)
        gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
        orow = out_ptr + t * stride_ot + h64[None, :] * stride_oh + kr[:, None]
        om = hmask[None, :] & (kr >= 0)[:, None]
        iv = inv[None, :]
        gl.store(orow + 0, (o0 * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 64, (o1 * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 128, (o2 * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 192, (o3 * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 256, (o4 * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 320, (o5 * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 384, (o6 * iv).to(gl.bfloat16), mask=om)
        gl.store(orow + 448, (o7 * iv).to(gl.bfloat16), mask=om)
        k += 1


@gluon.jit
def _few_ws_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, kv_stride, rows,
                   idx_ptr, idx_st, width, len_ptr, len_st, sink_ptr, sink_st,
                   out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
                   T, H, qk_scale, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
                   NS: gl.constexpr, WB: gl.constexpr, MODE: gl.constexpr,
                   A_REGS: gl.constexpr):
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, 64], gl.bfloat16)
    PL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 8], gl.bfloat16)
    IL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.bfloat16, [NS * 8, 64, 64], KL)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * 8, 8, 64], QL)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 8], PL)
    idx_smem = gl.allocate_shared_memory(gl.int32, [IDX_SLOTS, WB, 64], IL)
    # the same bytes as one 64-index row per block (plain row-major, no swizzle)
    idx_rows = idx_smem._reinterpret(gl.int32, [IDX_SLOTS * WB, 64],
                                     gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    i_ready = gl.allocate_shared_memory(gl.int64, [IDX_SLOTS, 1], mbarrier.MBarrierLayout())
    i_free = gl.allocate_shared_memory(gl.int64, [IDX_SLOTS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(q_ready.index(s), count=128)
        mbarrier.init(q_free.index(s), count=1)
    for s in gl.static_range(IDX_SLOTS):
        mbarrier.init(i_ready.index(s), count=128)
        mbarrier.init(i_free.index(s), count=1)
    for s in gl.static_range(NS):
        mbarrier.init(ready.index(s), count=128)
        mbarrier.init(free.index(s), count=1)
    gl.warp_specialize([
        (_producer, (pid, grid, T, width, len_ptr, len_st, q_ptr, stride_qt, stride_qh, kv_ptr,
                     kv_stride, rows, idx_ptr, idx_st, H, q_smem, ring, idx_smem, idx_rows,
                     q_ready, q_free, i_ready, i_free, ready, free, HAS_LEN, NS, WB, MODE)),
        (_consumer, (pid, grid, T, width, len_ptr, len_st, rows, H, qk_scale, sink_ptr,
                     sink_st, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
                     q_smem, ring, idx_rows, p_smem, q_ready, q_free, i_ready, i_free, ready,
                     free, HAS_LEN, HAS_SINK, NS, WB, MODE, A_REGS)),
    ], [4], [CONSUMER_REGS])


ARGS = [("q_ptr", "*bf16"), ("stride_qt", "i64"), ("stride_qh", "i64"), ("kv_ptr", "*bf16"),
        ("kv_stride", "i64"), ("rows", "i32"), ("idx_ptr", "*i32"), ("idx_st", "i64"),
        ("width", "i32"), ("len_ptr", "*i32"), ("len_st", "i64"), ("sink_ptr", "*fp32"),
        ("sink_st", "i64"), ("out_ptr", "*bf16"), ("stride_ot", "i64"), ("stride_oh", "i64"),
        ("lse_ptr", "*fp32"), ("stride_lt", "i64"), ("stride_lh", "i64"), ("T", "i32"),
        ("H", "i32"), ("qk_scale", "fp32")]


def launch(q, kv, idx, lens, sink, scale, out, lse, ns=2, mode=0, a_regs=False):
    """q [T, H <= 8, 512] bf16; kv [S, 512] bf16 rows; idx [T, K] int32 rows (``< 0`` or
    ``>= S`` skipped); lens [T] int32 or None; sink [H] fp32 or None; out / lse as
    ``sparse_mla_prefill``'s; ``ns`` ring stages (64 KB each); ``mode`` 1: the copies alone (the
    consumer frees each stage unread), 2: the products alone (no row copies), 0: both;
    ``a_regs``: the products' A (the ring tiles) loaded into registers (``ldmatrix``) first."""
    import torch
    T, H, _ = q.shape
    if not 1 <= H <= 8:
        raise ValueError(f"q: expected 1..8 heads, got {H}")
    if T == 0:
        return None
    K = idx.shape[1]
    wb = max(4, 1 << max(0, (-(-K // 64)) - 1).bit_length())
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return _few_ws_kernel[(min(sms, T),)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.shape[0], idx, idx.stride(0),
        K, lens if lens is not None else idx, lens.stride(0) if lens is not None else 0,
        sink if sink is not None else lse, sink.stride(0) if sink is not None else 0,
        out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1), T, H,
        scale * 1.4426950408889634, HAS_LEN=lens is not None, HAS_SINK=sink is not None, NS=ns,
        WB=wb, MODE=mode, A_REGS=a_regs, num_warps=NUM_WARPS)


def compile_stats(ns=2, mode=0, a_regs=False):
    """Registers, stack, shared memory and SASS opcode counts of an sm_90a compile (640 keys)."""
    import re

    from dsv41_triton.attention.gluon import compile_check as cc
    k = cc._compile(_few_ws_kernel, ARGS, ("stride_qt", "stride_qh", "kv_stride", "idx_st"),
                    None, dict(HAS_LEN=True, HAS_SINK=True, NS=ns, WB=16, MODE=mode, A_REGS=a_regs),
                    NUM_WARPS,
                    90)
    regs, stack = cc._regs_stack(k)
    ops = {}
    for line in cc.resource_usage(k, "-sass").splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)(\.\S+)?", line)
        if m:
            op = m.group(2) + ("" if m.group(2) != "HGMMA" else m.group(3).split(".")[1])
            ops[op] = ops.get(op, 0) + 1
    return dict(ns=ns, mode=mode, a_regs=a_regs, regs=regs, stack=stack, smem=k.metadata.shared, ops=ops)


def check_and_time():
    """On an sm_90 GPU: outputs against sparse_mla_prefill (ragged lens, an empty row, -1 and
    out-of-range rows, 1 / 3 / 8 heads, more tokens than SMs), then the issue's 8-head shape
    (4096 tokens x 640 / the 512 top-k keys) timed beside the general kernel, with the copies
    alone and the products alone."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_prefill as bp
    from dsv41_triton.attention.prefill import sparse_mla_prefill
    from dsv41_triton.testing import rel_err
    torch.manual_seed(0)
    dev = "cuda"
    for T, H, K, S in [(5, 8, 640, 3000), (3, 3, 70, 100), (1, 1, 1, 10), (300, 8, 200, 5000),
                       (700, 2, 1100, 9000)]:
        q = torch.randn(T, H, 512, device=dev).to(torch.bfloat16)
        kv = torch.randn(S, 512, device=dev).to(torch.bfloat16)
        idx = torch.randint(-2, S + 3, (T, K), device=dev, dtype=torch.int32)
        lens = torch.randint(0, K + 1, (T,), device=dev, dtype=torch.int32)
        lens[0] = 0
        sink = torch.randn(H, device=dev)
        for ln, ar in ((lens, False), (None, False), (lens, True), (None, True)):
            ref, rl = sparse_mla_prefill(q, kv, idx, ln, sink)
            out = torch.full_like(ref, float("nan"))
            lse = torch.full_like(rl, float("nan"))
            try:
                launch(q, kv, idx, ln, sink, 512 ** -0.5, out, lse, a_regs=ar)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(f"T={T} H={H}: FAILED {type(e).__name__}: {str(e)[-800:]}", flush=True)
                continue
            fin = torch.isfinite(rl)
            print(f"T={T} H={H} K={K} lens={ln is not None} a_regs={ar}: out rel {rel_err(out, ref):.2e} "
                  f"lse max {(lse - rl)[fin].abs().max().item() if fin.any() else 0:.2e} empty "
                  f"rows agree {torch.equal(torch.isinf(lse), torch.isinf(rl))}", flush=True)
    inp = bp.build_kernel_inputs(8)
    q, kv, sink = inp["q"], inp["kv"], inp["sink"]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], device=dev)
    for lab, idx in (("640", inp["idx"]), ("512", inp["local"])):
        ref = sparse_mla_prefill(q, kv, idx, None, sink)[0]
        t_ref = bp.time_graph_flushed(lambda: sparse_mla_prefill(q, kv, idx, None, sink, None, out,
                                                                 _kernel="tl"))
        for ns, mode, ar in ((2, 0, False), (3, 1, False), (3, 2, False), (2, 0, True),
                             (3, 0, True), (3, 2, True)):
            k = launch(q, kv, idx, None, sink, 512 ** -0.5, out, lse, ns, mode, ar)
            err = rel_err(out, ref) if mode == 0 else float("nan")
            t_new = bp.time_graph_flushed(lambda: launch(q, kv, idx, None, sink, 512 ** -0.5, out,
                                                         lse, ns, mode, ar))
            print(f"8 heads, {lab} keys: tl {t_ref:.1f} us, few_ws NS={ns} mode={mode} a_regs={ar} "
                  f"{t_new:.1f} us (rel {err:.1e}, regs {k.n_regs}, spills {k.n_spills})",
                  flush=True)


#: (ring stages, mode, A in registers) compiled by --compile / --json
CONFIGS = ((2, 0, False), (3, 0, False), (2, 1, False), (2, 0, True))

if __name__ == "__main__":
    if "--json" in sys.argv:  # one line per (ring depth, S chains), for tests/perf
        import json
        for ns, mode, ar in CONFIGS:
            print(json.dumps(compile_stats(ns, mode, ar)))
    elif "--compile" in sys.argv:
        for ns, mode, ar in CONFIGS:
            print(compile_stats(ns, mode, ar))
    else:
        check_and_time()
