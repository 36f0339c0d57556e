"""A few-heads sparse MLA kernel over 584-byte records whose wgmma A operands are built from the
raw record bytes in registers (sm_90, Gluon, Triton 3.6). A design probe for the 8-head
prefill. On the H200 it agrees with ``sparse_mla_decode`` (ragged, empty and hostile rows, 1 /
3 / 8 heads, one and two key sets) and takes 610 µs for the 8-head paged prefill's attention,
as long as the decode kernel (607): perf/NOTES.md, session 15, says where the time goes.
``record_regs_replay.py`` checks its index algebra on the CPU.

    python perf/record_regs_probe.py            # GPU: check against sparse_mla_decode, time
    python perf/record_regs_probe.py --compile  # CPU: registers, shared memory, loop SASS
                                                # (--json: one JSON line per key-set count)

One CTA = one warpgroup = one query token, H <= 8 heads (the wgmma N), one or two key sets (slot
ids into paged caches, ``lens``; one softmax, as ``sparse_mla_decode``), the sink. Per 64-key
block (a two-stage cp.async ring, one block ahead; the slot ids two blocks ahead):

* ring: e4m3 part ``[8 groups, 64 keys, 64 bytes]`` swizzled ``(16, 2, 4)`` (group 7
  zero-filled), the RoPE tail ``[64, 64]`` bf16 (NVMMA), the scales ``[64, 8]``;
* ``S^T [64 keys, 8] = sum_g scale_g * (K_g Q_g^T)`` (one fp16 product per group, A from
  registers, each group's dims permuted: logical ``16 b + 8 u + 2 c + v`` is byte ``16 c + 4 b
  + 2 u + v``; the UE8M0 scale applied to the fp32 product) ``+ K_rope Q_rope^T`` (bf16, both
  operands in shared memory);
* softmax over the keys; ``P^T`` stored as fp16 with key bits 0 and 1 swapped and as bf16;
* ``O^T_t [64, 8] += V^T_t P^T`` for 8 dim tiles (fp16, A from registers, 4 k16 steps; thread
  ``(warp w, lane quad q)`` owns record dims ``16 (8 w + q) .. + 15``), ``O^T_rope += V_rope^T
  P^T`` (bf16, shared memory). The output dims are un-permuted at the store.

O's scales multiply in fp16: ``2**(e - 127)`` must be within fp16's range (V4 keys' are).
"""
from __future__ import annotations

import os
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv41_triton.attention.gluon.common import _finish_rows  # noqa: E402
from dsv41_triton.attention.gluon.gather import _key_ranges, _pick  # noqa: E402
from dsv41_triton.attention.gluon._api import async_load, barrier  # noqa: E402

NUM_WARPS = 4
DATA = gl.constexpr(576)
SCALE_W = gl.constexpr(8)
# the ring copies' layouts (e4m3 groups, RoPE tail, scales), the accumulator's, and their key
# axes: a block's slot ids are loaded once per layout that uses them
L3 = gl.constexpr(gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, 4, 1], [2, 1, 0]))
LR = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0]))
LS = gl.constexpr(gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0]))
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                              instr_shape=[16, 8, 16]))
K3 = gl.constexpr(gl.SliceLayout(0, gl.SliceLayout(2, L3)))
KR = gl.constexpr(gl.SliceLayout(1, LR))
KS = gl.constexpr(gl.SliceLayout(1, LS))
KM = gl.constexpr(gl.SliceLayout(1, MMA))


@gluon.jit
def _block_ids(idx_row, b_row, n, n_b, j, nblk_a, nblk, LAY: gl.constexpr):
    """Slot ids of 64-key block j (of the first key set, then the second) in layout LAY, as
    loaded (-1 past the block's keys). They are checked against the rows where they are used
    (the next iteration), so that the load stays in flight under this block's products."""
    k = gl.arange(0, 64, layout=LAY)
    if j < nblk_a:
        c = j * 64 + k
        m = c < n
        v = gl.load(idx_row + c, mask=m, other=-1)
    else:
        c = (j - nblk_a) * 64 + k
        m = (c < n_b) & (j < nblk)
        v = gl.load(b_row + c, mask=m, other=-1)
    return v


@gluon.jit
def _issue_ids(cache_ptr, bstride, rows, id3, idr, ids, nope, rope, scl, s,
               PAGE: gl.constexpr, PAGE_LOG2: gl.constexpr):
    """cp.async of one 64-key block into ring stage s from its slot ids (one per copy layout;
    ids outside [0, rows) zero-filled): e4m3 part [8 groups, 64 keys, 64 bytes] (group 7
    zero), RoPE tail [64, 64] bf16 at data + 448, scales [64, 8] after the page's data."""
    ok3 = (id3 >= 0) & (id3 < rows)
    i3 = id3.to(gl.int64)
    pg3 = gl.where(ok3, i3 >> PAGE_LOG2, 0)
    of3 = gl.where(ok3, i3 & (PAGE - 1), 0)
    base3 = gl.multiple_of(pg3 * bstride + of3 * DATA, 16)
    g3 = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    b3 = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    p3 = cache_ptr + base3[None, :, None] + (g3 * 64)[:, None, None] + b3[None, None, :]
    m3 = ok3[None, :, None] & (g3 < 7)[:, None, None] & (b3 >= 0)[None, None, :]
    async_load(nope.index(s), p3, mask=m3)
    okr = (idr >= 0) & (idr < rows)
    ir = idr.to(gl.int64)
    pgr = gl.where(okr, ir >> PAGE_LOG2, 0)
    ofr = gl.where(okr, ir & (PAGE - 1), 0)
    baser = gl.multiple_of(pgr * bstride + ofr * DATA + 448, 16)
    dr = gl.arange(0, 64, layout=gl.SliceLayout(0, LR))
    pr = (cache_ptr + baser[:, None]).to(gl.pointer_type(gl.bfloat16)) + dr[None, :]
    async_load(rope.index(s), pr, mask=okr[:, None] & (dr >= 0)[None, :])
    oks = (ids >= 0) & (ids < rows)
    is_ = ids.to(gl.int64)
    pgs = gl.where(oks, is_ >> PAGE_LOG2, 0)
    ofs = gl.where(oks, is_ & (PAGE - 1), 0)
    bases = gl.multiple_of(pgs * bstride + PAGE * DATA + ofs * SCALE_W, 8)
    ds = gl.arange(0, 8, layout=gl.SliceLayout(0, LS))
    async_load(scl.index(s), cache_ptr + bases[:, None] + ds[None, :],
               mask=oks[:, None] & (ds >= 0)[None, :])
    cp.commit_group()


@gluon.jit
def _ue8m0_f16(e):
    """UE8M0 byte (int32 tensor) -> 2**(e - 127) as fp16 (0 below fp16's range)."""
    x = gl.exp2((e - 127).to(gl.float32))
    return x.to(gl.float16)


@gluon.jit
def _rec_regs_kernel(
    q_ptr, stride_qt, stride_qh,
    cache_ptr, bstride, rows,
    idx_ptr, idx_st, width, len_ptr, len_st,
    b_cache_ptr, b_bstride, b_rows,
    b_idx_ptr, b_idx_st, b_width, b_len_ptr, b_len_st,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    H, qk_scale,
    PAGE: gl.constexpr, PAGE_LOG2: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
    HAS_B: gl.constexpr = False, HAS_LEN_B: gl.constexpr = False,
):
    AL16: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    RL: gl.constexpr = gl.SwizzledSharedLayout(16, 2, 4, [2, 1, 0])
    RPL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    SCL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    BQ16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 8], gl.float16)
    BQBF: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 8], gl.bfloat16)
    # S operand of one group: [64 keys, 64 bytes]; a thread: 16 bytes of keys r, r + 8
    SL3: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 8, 0]],
        lane_bases=[[0, 0, 16], [0, 0, 32], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[0, 16, 0], [0, 32, 0]], block_bases=[], shape=[1, 64, 64])
    # O operand of one k16 step: [8 groups, 16 keys, 64 bytes]
    OLK: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 2, 0], [0, 8, 0]],
        lane_bases=[[0, 1, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [1, 0, 0]],
        warp_bases=[[2, 0, 0], [4, 0, 0]], block_bases=[], shape=[8, 16, 64])
    SC8: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 8])
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 4], [1, 0])

    t = gl.program_id(0).to(gl.int64)
    nope = gl.allocate_shared_memory(gl.uint8, [2, 8, 64, 64], RL)
    rope = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], RPL)
    scl = gl.allocate_shared_memory(gl.uint8, [2, 64, 8], SCL)
    qn = gl.allocate_shared_memory(gl.float16, [7, 64, 8], BQ16)
    qr = gl.allocate_shared_memory(gl.bfloat16, [64, 8], BQBF)
    p16 = gl.allocate_shared_memory(gl.float16, [64, 8], BQ16)
    pbf = gl.allocate_shared_memory(gl.bfloat16, [64, 8], BQBF)

    # columns read: [0, n) of the first key set, [0, n_b) of the second (one split)
    _, n, _, n_b, nblk_a, nblk = _key_ranges(t, 0, 1, len_ptr, len_st, width, b_len_ptr,
                                             b_len_st, b_width, HAS_B, HAS_LEN, HAS_LEN_B,
                                             False)
    idx_row = idx_ptr + t * idx_st
    b_row = b_idx_ptr + t * b_idx_st
    id3 = _block_ids(idx_row, b_row, n, n_b, 0, nblk_a, nblk, K3)
    idr = _block_ids(idx_row, b_row, n, n_b, 0, nblk_a, nblk, KR)
    ids = _block_ids(idx_row, b_row, n, n_b, 0, nblk_a, nblk, KS)
    ci_cur = _block_ids(idx_row, b_row, n, n_b, 0, nblk_a, nblk, KM)
    if nblk_a > 0:
        _issue_ids(cache_ptr, bstride, rows, id3, idr, ids, nope, rope, scl, 0, PAGE,
                   PAGE_LOG2)
    else:
        _issue_ids(b_cache_ptr, b_bstride, b_rows, id3, idr, ids, nope, rope, scl, 0, PAGE,
                   PAGE_LOG2)
    id3 = _block_ids(idx_row, b_row, n, n_b, 1, nblk_a, nblk, K3)
    idr = _block_ids(idx_row, b_row, n, n_b, 1, nblk_a, nblk, KR)
    ids = _block_ids(idx_row, b_row, n, n_b, 1, nblk_a, nblk, KS)
    ci_nxt = _block_ids(idx_row, b_row, n, n_b, 1, nblk_a, nblk, KM)

    # Q^T tiles: per group, dims in the S operand's logical order (k = 16b + 8u + 2c + v is
    # byte 16c + 4b + 2u + v); heads past H are zero
    hq = gl.arange(0, 8, layout=gl.SliceLayout(1, LQ))
    dq = gl.arange(0, 64, layout=gl.SliceLayout(0, LQ))
    qrow = q_ptr + t * stride_qt + hq.to(gl.int64)[:, None] * stride_qh + dq[None, :]
    hm = (hq < H)[:, None] & (dq >= 0)[None, :]
    for g in gl.static_range(7):
        qx = gl.load(qrow + 64 * g, mask=hm, other=0.0).to(gl.float16)
        qx = gl.reshape(gl.permute(gl.reshape(qx, [8, 4, 4, 2, 2]), (0, 2, 3, 1, 4)), [8, 64])
        qn.index(g).store(gl.permute(qx, (1, 0)))
    qr.store(gl.permute(gl.load(qrow + 448, mask=hm, other=0.0), (1, 0)))

    m_i = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    # per-thread partial sums, reduced over the keys once after the loop
    l_part = gl.full([64, 8], 0.0, gl.float32, layout=MMA)
    zero = gl.full([64, 8], 0.0, gl.float32, layout=MMA)
    o0 = zero
    o1 = zero
    o2 = zero
    o3 = zero
    o4 = zero
    o5 = zero
    o6 = zero
    o7 = zero
    orp = zero

    for j in range(nblk):
        s = j % 2
        cp.wait_group(0)
        fence_async_shared()
        barrier()
        if j + 1 < nblk_a:
            _issue_ids(cache_ptr, bstride, rows, id3, idr, ids, nope, rope, scl, 1 - s, PAGE,
                       PAGE_LOG2)
        elif j + 1 < nblk:
            _issue_ids(b_cache_ptr, b_bstride, b_rows, id3, idr, ids, nope, rope, scl, 1 - s,
                       PAGE, PAGE_LOG2)
        if j < nblk_a:
            ok = (ci_cur >= 0) & (ci_cur < rows)
        else:
            ok = (ci_cur >= 0) & (ci_cur < b_rows)
        ci_cur = ci_nxt
        id3 = _block_ids(idx_row, b_row, n, n_b, j + 2, nblk_a, nblk, K3)
        idr = _block_ids(idx_row, b_row, n, n_b, j + 2, nblk_a, nblk, KR)
        ids = _block_ids(idx_row, b_row, n, n_b, j + 2, nblk_a, nblk, KS)
        ci_nxt = _block_ids(idx_row, b_row, n, n_b, j + 2, nblk_a, nblk, KM)
        ns = nope.index(s)
        sc_t = scl.index(s)
        # ---- S^T = K Q^T
        acc_r = warpgroup_mma(rope.index(s), qr, zero, use_acc=False, is_async=True)
        # the scales of a thread's two keys, per group, as fp32 powers of two (bits e << 23)
        e8 = sc_t.load(SC8).to(gl.int32)
        f8 = (e8 << 23).to(gl.float32, bitcast=True)
        f8 = gl.reshape(f8, [64, 2, 2, 2])
        fa, fb = gl.split(f8)
        faa, fab = gl.split(fa)
        fba, fbb = gl.split(fb)
        s0, s4 = gl.split(faa)
        s2, s6 = gl.split(fab)
        s1, s5 = gl.split(fba)
        s3, s7 = gl.split(fbb)
        sco = zero
        prev = acc_r
        for g in gl.static_range(7):
            raw = gl.reshape(ns.slice(g, 1, dim=0).load(SL3), [64, 64])
            x = raw.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            x = gl.reshape(gl.permute(gl.reshape(x, [64, 4, 4, 2, 2]), (0, 2, 3, 1, 4)), [64, 64])
            acc_g = warpgroup_mma(gl.convert_layout(x, AL16), qn.index(g), zero, use_acc=False,
                                  is_async=True)
            # the previous product is done (at most this one in flight): fold it in
            prev = warpgroup_mma_wait(1, deps=[prev])
            if g == 0:
                sco = prev
            else:
                sg = gl.convert_layout(_pick(g - 1, s0, s1, s2, s3, s4, s5, s6, s7), KM)
                sco = sco + prev * sg[:, None]
            prev = acc_g
        prev = warpgroup_mma_wait(0, deps=[prev])
        sco = sco + prev * gl.convert_layout(s6, KM)[:, None]
        sco = gl.where(ok[:, None], sco * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sco, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(sco - m_safe[None, :])
        l_part = l_part * alpha[None, :] + p
        m_i = m_new
        o0 = o0 * alpha[None, :]
        o1 = o1 * alpha[None, :]
        o2 = o2 * alpha[None, :]
        o3 = o3 * alpha[None, :]
        o4 = o4 * alpha[None, :]
        o5 = o5 * alpha[None, :]
        o6 = o6 * alpha[None, :]
        o7 = o7 * alpha[None, :]
        orp = orp * alpha[None, :]
        # ---- P^T: bf16 in key order (rope product), fp16 with key bits 0 and 1 swapped
        pbf.store(p.to(gl.bfloat16))
        pp = gl.reshape(gl.permute(gl.reshape(p.to(gl.float16), [16, 2, 2, 8]), (0, 2, 1, 3)),
                        [64, 8])
        p16.store(pp)
        fence_async_shared()
        barrier()
        # ---- O^T
        orp = warpgroup_mma(rope.index(s).permute((1, 0)), pbf, orp, is_async=True)
        for b in gl.static_range(4):
            raw = ns.slice(16 * b, 16, dim=1).load(OLK)
            e = sc_t.slice(16 * b, 16, dim=0).permute((1, 0)).load(gl.SliceLayout(2, OLK))
            x = raw.to(gl.float8e4nv, bitcast=True).to(gl.float16)
            x = x * _ue8m0_f16(e.to(gl.int32))[:, :, None]
            x = gl.reshape(x, [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
            # g = w1 w0 q2 | key = u c1 v c0 | byte = q1 q0 t2 t1 t0 s
            x = gl.permute(x, (0, 1, 12, 2, 7, 8, 3, 4, 6, 5, 9, 10, 11))
            # -> w1 w0 s q2 q1 q0 | u c1 c0 v | t2 t1 t0
            x = gl.reshape(x, [64, 16, 2, 2, 2])
            xa, xb = gl.split(x)
            xaa, xab = gl.split(xa)
            xba, xbb = gl.split(xb)
            a000, a001 = gl.split(xaa)
            a010, a011 = gl.split(xab)
            a100, a101 = gl.split(xba)
            a110, a111 = gl.split(xbb)
            pb = p16.slice(16 * b, 16, dim=0)
            o0 = warpgroup_mma(gl.convert_layout(a000, AL16), pb, o0, is_async=True)
            o1 = warpgroup_mma(gl.convert_layout(a001, AL16), pb, o1, is_async=True)
            o2 = warpgroup_mma(gl.convert_layout(a010, AL16), pb, o2, is_async=True)
            o3 = warpgroup_mma(gl.convert_layout(a011, AL16), pb, o3, is_async=True)
            o4 = warpgroup_mma(gl.convert_layout(a100, AL16), pb, o4, is_async=True)
            o5 = warpgroup_mma(gl.convert_layout(a101, AL16), pb, o5, is_async=True)
            o6 = warpgroup_mma(gl.convert_layout(a110, AL16), pb, o6, is_async=True)
            o7 = warpgroup_mma(gl.convert_layout(a111, AL16), pb, o7, is_async=True)
            # this step's 8 products may stay in flight; the previous step's A registers free
            o0, o1, o2, o3, o4, o5, o6, o7, orp = warpgroup_mma_wait(
                8, deps=[o0, o1, o2, o3, o4, o5, o6, o7, orp])
        o0, o1, o2, o3, o4, o5, o6, o7, orp = warpgroup_mma_wait(
            0, deps=[o0, o1, o2, o3, o4, o5, o6, o7, orp])
    cp.wait_group(0)

    # ---- epilogue: the sink, lse, O^T tiles back to record dims
    h = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    hmask = h < H
    h64 = h.to(gl.int64)
    inv, lse = _finish_rows(gl.sum(l_part, axis=0), m_i, h64, hmask, sink_ptr, sink_st,
                            HAS_SINK)
    gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
    m = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    # tile row m = 16 w + 8 s + q -> record dim 16 (8 w + q) + 2 tt + s
    dbase = 16 * (8 * (m // 16) + (m % 8)) + (m // 8) % 2
    orow = out_ptr + t * stride_ot + h64[None, :] * stride_oh
    om = hmask[None, :] & (dbase < 448)[:, None]
    # the splits leave o_i holding dim tile t = 4 (i % 2) + 2 ((i // 2) % 2) + i // 4 -> +2 t
    gl.store(orow + (dbase + 0)[:, None], (o0 * inv[None, :]).to(gl.bfloat16), mask=om)
    gl.store(orow + (dbase + 8)[:, None], (o1 * inv[None, :]).to(gl.bfloat16), mask=om)
    gl.store(orow + (dbase + 4)[:, None], (o2 * inv[None, :]).to(gl.bfloat16), mask=om)
    gl.store(orow + (dbase + 12)[:, None], (o3 * inv[None, :]).to(gl.bfloat16), mask=om)
    gl.store(orow + (dbase + 2)[:, None], (o4 * inv[None, :]).to(gl.bfloat16), mask=om)
    gl.store(orow + (dbase + 10)[:, None], (o5 * inv[None, :]).to(gl.bfloat16), mask=om)
    gl.store(orow + (dbase + 6)[:, None], (o6 * inv[None, :]).to(gl.bfloat16), mask=om)
    gl.store(orow + (dbase + 14)[:, None], (o7 * inv[None, :]).to(gl.bfloat16), mask=om)
    gl.store(orow + (448 + m)[:, None], (orp * inv[None, :]).to(gl.bfloat16),
             mask=hmask[None, :] & (m >= 0)[:, None])


def launch(q, cache, idx, lens, sink, scale, out, lse, b_cache=None, b_idx=None, b_lens=None):
    """q [T, H <= 8, 512] bf16; cache uint8 [nb, page, 584] (page a power of two, the same for
    b_cache); idx [T, K] int32 slot ids; lens [T] int32 or None; sink [H] fp32 or None; an
    optional second key set (b_cache, b_idx, b_lens) in one softmax, as sparse_mla_decode."""
    T, H, _ = q.shape
    page = cache.shape[1]
    if not 1 <= H <= 8 or page & (page - 1) or (b_cache is not None and b_cache.shape[1] != page):
        raise ValueError(f"q / caches: expected 1..8 heads and one power-of-two page, got H = {H}, "
                         f"pages {page} / {None if b_cache is None else b_cache.shape[1]}")
    LOG2E = 1.4426950408889634
    bc = b_cache if b_cache is not None else cache
    bi = b_idx if b_idx is not None else idx
    return _rec_regs_kernel[(T,)](
        q, q.stride(0), q.stride(1), cache, cache.stride(0), cache.shape[0] * page,
        idx, idx.stride(0), idx.shape[1], lens if lens is not None else idx,
        lens.stride(0) if lens is not None else 0,
        bc, bc.stride(0), bc.shape[0] * bc.shape[1],
        bi, bi.stride(0), bi.shape[1], b_lens if b_lens is not None else bi,
        b_lens.stride(0) if b_lens is not None else 0,
        sink if sink is not None else lse, sink.stride(0) if sink is not None else 0,
        out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1),
        H, scale * LOG2E, PAGE=page, PAGE_LOG2=page.bit_length() - 1,
        HAS_LEN=lens is not None, HAS_SINK=sink is not None, HAS_B=b_cache is not None,
        HAS_LEN_B=b_lens is not None, num_warps=NUM_WARPS)


#: (name, type) of the kernel's arguments, for the CPU compile
ARGS = [("q_ptr", "*bf16"), ("stride_qt", "i64"), ("stride_qh", "i64"),
        ("cache_ptr", "*u8"), ("bstride", "i64"), ("rows", "i32"),
        ("idx_ptr", "*i32"), ("idx_st", "i64"), ("width", "i32"), ("len_ptr", "*i32"),
        ("len_st", "i64"),
        ("b_cache_ptr", "*u8"), ("b_bstride", "i64"), ("b_rows", "i32"),
        ("b_idx_ptr", "*i32"), ("b_idx_st", "i64"), ("b_width", "i32"), ("b_len_ptr", "*i32"),
        ("b_len_st", "i64"),
        ("sink_ptr", "*fp32"), ("sink_st", "i64"),
        ("out_ptr", "*bf16"), ("stride_ot", "i64"), ("stride_oh", "i64"),
        ("lse_ptr", "*fp32"), ("stride_lt", "i64"), ("stride_lh", "i64"),
        ("H", "i32"), ("qk_scale", "fp32")]


def compile_stats(has_b: bool = True) -> dict:
    """Registers, stack, shared memory and the main loop's SASS of an sm_90a compile."""
    from dsv41_triton.attention.gluon import compile_check as cc

    k = cc._compile(_rec_regs_kernel, ARGS, ("stride_qt", "stride_qh", "bstride", "b_bstride"),
                    None, dict(PAGE=64, PAGE_LOG2=6, HAS_LEN=True, HAS_SINK=True, HAS_B=has_b,
                               HAS_LEN_B=has_b), NUM_WARPS, 90)
    regs, stack = cc._regs_stack(k)
    return dict(regs=regs, stack=stack, smem=k.metadata.shared, loop=cc.loop_sass(k))


def check_and_time() -> None:
    """On an sm_90 GPU: outputs against sparse_mla_decode (ragged lens, -1 and out-of-range
    ids, 1 / 3 / 8 heads, one and two key sets), then the 8-head paged prefill's attention
    (4096 tokens x (128 window + 512 compressed) slots) timed beside the decode kernel."""
    import torch
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_prefill as bp
    from dsv41_triton.attention.decode import sparse_mla_decode
    from dsv41_triton.testing import random_k_cache, rel_err

    torch.manual_seed(0)
    dev = "cuda"
    for T, H, K, NB, two in [(5, 8, 640, 64, False), (3, 3, 70, 16, True), (1, 1, 1, 4, False),
                             (64, 8, 512, 512, True)]:
        caches = [random_k_cache(NB, 64, 584, dev) for _ in range(2)]
        sets = []
        for c in caches[:2 if two else 1]:
            rows = NB * 64
            idx = torch.randint(0, rows, (T, K), device=dev, dtype=torch.int32)
            idx[torch.rand(T, K, device=dev) < 0.1] = -1
            idx[0, :3] = rows + 5
            sets.append((c, idx, torch.randint(0, K + 1, (T,), device=dev, dtype=torch.int32)))
        q = torch.randn(T, H, 512, device=dev).to(torch.bfloat16)
        sink = torch.randn(H, device=dev)
        b = sets[1] if two else (None, None, None)
        ref, rl = sparse_mla_decode(q, *sets[0], *b, sink)
        out = torch.full_like(ref, float("nan"))
        lse = torch.full_like(rl, float("nan"))
        try:
            launch(q, *sets[0], sink, 512 ** -0.5, out, lse, *b)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - report and go on to the next case
            print(f"T={T} H={H} K={K}: FAILED {type(e).__name__}: {str(e)[-400:]}", flush=True)
            continue
        fin = torch.isfinite(rl)
        dl = (lse - rl)[fin].abs().max().item() if fin.any() else 0.0
        print(f"T={T} H={H} K={K} sets={1 + two}: out rel {rel_err(out, ref):.2e}, lse max "
              f"{dl:.2e}, empty rows agree {torch.equal(torch.isinf(lse), torch.isinf(rl))}",
              flush=True)
    inp = bp.build_kernel_inputs(8)
    pg = inp["paged"]
    si, sl, ei, el = inp["slots"]
    q, sink = inp["q"], inp["sink"]
    ref, _ = sparse_mla_decode(q, pg["swa_cache"], si, sl, pg["compressed_cache"], ei, el, sink)
    out = torch.empty_like(ref)
    lse = torch.empty(ref.shape[:2], device=dev)

    def fn():
        return launch(q, pg["swa_cache"], si, sl, sink, 512 ** -0.5, out, lse,
                      pg["compressed_cache"], ei, el)
    fn()
    torch.cuda.synchronize()
    print(f"paged prefill rows: out rel {rel_err(out, ref):.2e}", flush=True)
    t_ref = bp.time_graph_flushed(lambda: sparse_mla_decode(
        q, pg["swa_cache"], si, sl, pg["compressed_cache"], ei, el, sink, None, ref))
    t_new = bp.time_graph_flushed(fn)
    k = fn()
    print(f"8-head paged prefill attention: decode kernel {t_ref:.1f} us, this kernel "
          f"{t_new:.1f} us (regs {k.n_regs}, spills {k.n_spills})", flush=True)


if __name__ == "__main__":
    if "--json" in sys.argv:  # one line per key-set count, for tests/perf
        import json
        for has_b in (False, True):
            st = compile_stats(has_b)
            print(json.dumps(dict(has_b=has_b, regs=st["regs"], stack=st["stack"],
                                  smem=st["smem"], spills=st["loop"]["spill_ld_st"],
                                  hgmma=st["loop"]["ops"].get("HGMMA", 0))))
    elif "--compile" in sys.argv:
        for has_b in (False, True):
            st = compile_stats(has_b)
            lp = st["loop"]
            print(f"key sets {1 + has_b}: {st['regs']} registers, {st['stack']} B stack, "
                  f"{st['smem']} B shared; loop {lp['loop']} instructions, branches "
                  f"{lp['branches'][:2]}, {lp['bar_sync']} barriers, {lp['ops']}")
    else:
        check_and_time()
