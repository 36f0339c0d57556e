"""Merge of split-K partials of the sparse MLA forward kernel (``_sparse_kernel.py``)."""
from __future__ import annotations

import triton
import triton.language as tl

from ..ops._codecs import f32_to_bf16

try:  # programmatic dependent launch (Triton >= 3.4): the merge waits on the split kernel
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: launches stay stream-ordered
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False


@triton.jit
def _merge_kernel(po_ptr, pl_ptr, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh,
                  lse_ptr, stride_lt, stride_lh, H, num_splits, num_ht,
                  NSP: tl.constexpr, BH: tl.constexpr, HAS_SINK: tl.constexpr,
                  SW: tl.constexpr, DC: tl.constexpr = 512, PDL: tl.constexpr = False):
    """Combine split partials: ``po [T, NS, H, 512]`` (each normalized by its own sum) and
    ``pl [T, NS, H]`` (log2-sum-exp, -inf = empty) -> out bf16, lse fp32 (natural log), with
    the sink in the denominator. Empty rows: out 0 (NaN under a NaN sink), lse +inf; a NaN
    partial: NaN. Grid ``T * num_ht * (512 // DC)``: one program per (token, head tile, ``DC``
    value dims); ``DC`` 512 loops over the splits, a smaller ``DC`` loads every split's
    partial at once (one round trip: for launches of few programs). ``PDL``: launched as a
    programmatic dependent of the split kernel; it waits for that grid (and its writes) before
    reading the partials."""
    pid = tl.program_id(0)
    dc = pid % (512 // DC)
    rest = pid // (512 // DC)
    ht = rest % num_ht
    t = (rest // num_ht).to(tl.int64)
    h = ht * BH + tl.arange(0, BH)
    hmask = h < H
    h64 = h.to(tl.int64)
    sp = tl.arange(0, NSP)
    d = dc * DC + tl.arange(0, DC)
    lrow = (t * num_splits + sp[:, None]) * H + h64[None, :]
    smask = (sp[:, None] < num_splits) & hmask[None, :]
    if PDL:
        gdc_wait()
    lse2 = tl.load(pl_ptr + lrow, mask=smask, other=float("-inf"))
    if DC < 512:
        o_all = tl.load(po_ptr + lrow[:, :, None] * 512 + d[None, None, :],
                        mask=smask[:, :, None], other=0.0)
    m = tl.max(lse2, 0)
    # a NaN partial makes the row NaN (the GPU max would skip it)
    m = tl.where(tl.sum((lse2 != lse2).to(tl.int32), 0) > 0, float("nan"), m)
    has = m != float("-inf")
    m_safe = tl.where(has, m, 0.0)
    w = tl.exp2(lse2 - m_safe[None, :])
    l_sum = tl.sum(w, 0)
    den = tl.where(has, l_sum, 1.0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h64 * sink_st, mask=hmask, other=float("-inf"))
        den = den + tl.exp2(sink * 1.4426950408889634 - m_safe)
        # a NaN sink: NaN rows without keys too (docs/semantics.md)
        inv = tl.where(has, 1.0 / den, tl.where(sink != sink, float("nan"), 0.0))
    else:
        inv = tl.where(has, 1.0 / den, 0.0)
    if DC < 512:
        acc = tl.sum(w[:, :, None] * o_all, 0)
    else:
        acc = tl.zeros([BH, DC], tl.float32)
        for s in range(num_splits):
            prow = (t * num_splits + s) * H + h64
            ls = tl.load(pl_ptr + prow, mask=hmask, other=float("-inf"))
            ws = tl.exp2(ls - m_safe)
            o = tl.load(po_ptr + prow[:, None] * 512 + d[None, :], mask=hmask[:, None],
                        other=0.0)
            acc += ws[:, None] * o
    o = f32_to_bf16(acc * inv[:, None], SW)
    tl.store(out_ptr + t * stride_ot + h64[:, None] * stride_oh + d[None, :], o,
             mask=hmask[:, None])
    lse = tl.where(has, (m + tl.log2(tl.where(has, l_sum, 1.0))) * 0.6931471805599453,
                   float("inf"))
    # lse once per row, by the first value-dim chunk (a tensor mask: the interpreter refuses a
    # scalar term in it)
    tl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask & (h * 0 + dc == 0))
