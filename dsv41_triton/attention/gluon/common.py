"""Gluon device helpers shared by the sm_90 decode and prefill kernels."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _finish_rows(l_i, m_i, h64, hmask, sink_ptr, sink_st, HAS_SINK: gl.constexpr):
    """Per head row, from the online softmax's log2-domain max ``m_i`` and sum ``l_i`` (fp32):
    ``(inv, lse)`` with ``inv`` = 1 / the denominator (the sink ``exp(sink - m)`` added) and
    ``lse`` natural-log, sink excluded. A row without keys (``l == 0``) gets ``inv`` 0 (NaN for a
    NaN sink) and ``lse`` +inf; a NaN ``l`` propagates (docs/semantics.md)."""
    has = l_i != 0.0
    l_safe = gl.where(has, l_i, 1.0)
    den = l_safe
    if HAS_SINK:
        m_safe = gl.where(has, m_i, 0.0)
        sink = gl.load(sink_ptr + h64 * sink_st, mask=hmask, other=float("-inf"))
        den = den + gl.exp2(sink * LOG2E - m_safe)
        inv = gl.where(has, 1.0 / den, gl.where(sink != sink, float("nan"), 0.0))
    else:
        inv = gl.where(has, 1.0 / den, 0.0)
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * LN2, float("inf"))
    return inv, lse


@gluon.jit
def _fence_gpu(x):
    """A ``fence.acq_rel.gpu`` in every thread holding ``x`` (int32; returned unchanged)."""
    return gl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.b32 $0, $1;", "=r,r", [x],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _merge_if_last(cnt_ptr, po_ptr, pl_ptr, t, ht, num_splits, num_ht, H, sink_ptr, sink_st,
                   out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
                   BH: gl.constexpr, NW: gl.constexpr, HAS_SINK: gl.constexpr):
    """Split keys without a merge launch. Called by every split CTA of (token ``t``, head tile
    ``ht``) once its partial rows (``po [T, num_splits, H, 512]`` normalized, ``pl`` log2-sum-exp)
    are stored: it counts itself in ``cnt_ptr[t * num_ht + ht]`` (int32, zero between launches);
    the last one merges the ``num_splits`` partials as the ``tl`` merge kernel does (the sink in
    the denominator, empty rows 0 / +inf, NaN partials NaN) into ``out`` / ``lse`` and resets
    the counter to 0."""
    ML: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
    ROW: gl.constexpr = gl.SliceLayout(1, ML)
    h = ht * BH + gl.arange(0, BH, layout=ROW)
    hmask = h < H
    h64 = h.to(gl.int64)
    # every thread's partial stores are visible GPU-wide before the count is raised
    _fence_gpu(h)
    gl.thread_barrier()
    cnt = cnt_ptr + t * num_ht + ht
    done = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if done == num_splits - 1:
        _fence_gpu(h)
        m = gl.full([BH], float("-inf"), gl.float32, layout=ROW)
        nan = gl.full([BH], 0, gl.int32, layout=ROW)
        for s in range(num_splits):
            ls = gl.load(pl_ptr + (t * num_splits + s) * H + h64, mask=hmask,
                         other=float("-inf"), cache_modifier=".cg")
            m = gl.maximum(m, ls)
            nan = nan | (ls != ls).to(gl.int32)
        m = gl.where(nan != 0, float("nan"), m)  # the GPU max skips NaN
        has = m != float("-inf")
        m_safe = gl.where(has, m, 0.0)
        d = gl.arange(0, 512, layout=gl.SliceLayout(0, ML))
        acc = gl.full([BH, 512], 0.0, gl.float32, layout=ML)
        l_sum = gl.full([BH], 0.0, gl.float32, layout=ROW)
        for s in range(num_splits):
            prow = (t * num_splits + s) * H + h64
            ws = gl.exp2(gl.load(pl_ptr + prow, mask=hmask, other=float("-inf"),
                                 cache_modifier=".cg") - m_safe)
            l_sum = l_sum + ws
            o = gl.load(po_ptr + (prow * 512)[:, None] + d[None, :], mask=hmask[:, None],
                        other=0.0, cache_modifier=".cg")
            acc = acc + ws[:, None] * o
        den = gl.where(has, l_sum, 1.0)
        if HAS_SINK:
            sink = gl.load(sink_ptr + h64 * sink_st, mask=hmask, other=float("-inf"))
            den = den + gl.exp2(sink * LOG2E - m_safe)
            inv = gl.where(has, 1.0 / den, gl.where(sink != sink, float("nan"), 0.0))
        else:
            inv = gl.where(has, 1.0 / den, 0.0)
        orow = out_ptr + t * stride_ot + h64 * stride_oh
        gl.store(orow[:, None] + d[None, :], (acc * inv[:, None]).to(gl.bfloat16),
                 mask=hmask[:, None])
        lse = gl.where(has, (m + gl.log2(gl.where(has, l_sum, 1.0))) * LN2, float("inf"))
        gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
        gl.store(cnt, 0)
