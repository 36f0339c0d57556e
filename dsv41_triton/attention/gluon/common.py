"""Gluon device helpers shared by the sm_90 decode and prefill kernels."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _finish_rows(l_i, m_i, h64, hmask, sink_ptr, sink_st, HAS_SINK: gl.constexpr,
                 SINK_GIVEN: gl.constexpr = False, sink_given=0):
    """Per head row, from the online softmax's log2-domain max ``m_i`` and sum ``l_i`` (fp32):
    ``(inv, lse)`` with ``inv`` = 1 / the denominator (the sink ``exp(sink - m)`` added) and
    ``lse`` natural-log, sink excluded. A row without keys (``l == 0``) gets ``inv`` 0 (NaN for a
    NaN sink) and ``lse`` +inf; a NaN ``l`` propagates (docs/semantics.md). ``SINK_GIVEN``: the
    sink row is ``sink_given`` (``_load_sink``, loaded by the caller ahead of time)."""
    has = l_i != 0.0
    l_safe = gl.where(has, l_i, 1.0)
    den = l_safe
    if HAS_SINK:
        m_safe = gl.where(has, m_i, 0.0)
        if SINK_GIVEN:
            sink = sink_given
        else:
            sink = _load_sink(sink_ptr, sink_st, h64, hmask)
        den = den + gl.exp2(sink * LOG2E - m_safe)
        inv = gl.where(has, 1.0 / den, gl.where(sink != sink, float("nan"), 0.0))
    else:
        inv = gl.where(has, 1.0 / den, 0.0)
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * LN2, float("inf"))
    return inv, lse


@gluon.jit
def _load_sink(sink_ptr, sink_st, h64, hmask):
    """The sink of heads ``h64`` (``-inf`` where not ``hmask``), fp32."""
    return gl.load(sink_ptr + h64 * sink_st, mask=hmask, other=float("-inf"))


@gluon.jit
def _prior_group(prow, pm, grp: gl.constexpr):
    """Dims ``grp * 64 ..`` of a prior output (pointer tile ``prow [64 dims, heads]``, mask
    ``pm``) as fp32."""
    return gl.load(prow + grp * 64, mask=pm, other=0.0).to(gl.float32)


@gluon.jit
def _prior_tiles(prow, pm):
    """The 8 ``[64 dims, heads]`` fp32 tiles (dims ``64 g ..``) of a prior output."""
    return (_prior_group(prow, pm, 0), _prior_group(prow, pm, 1), _prior_group(prow, pm, 2),
            _prior_group(prow, pm, 3), _prior_group(prow, pm, 4), _prior_group(prow, pm, 5),
            _prior_group(prow, pm, 6), _prior_group(prow, pm, 7))


@gluon.jit
def _merge_prior(l_i, m_i, lp, o0, o1, o2, o3, o4, o5, o6, o7, p0, p1, p2, p3, p4, p5, p6, p7):
    """The online state (log2-domain max ``m_i``, sum ``l_i``, ``O^T`` tiles ``o*``) merged with
    a normalized prior (natural lse ``lp``, ``+inf``: none; its output tiles ``p*``)."""
    m_p = gl.where(lp == float("inf"), float("-inf"), lp * LOG2E)
    m_c = gl.maximum(m_i, m_p)
    m_c = gl.where(m_p != m_p, m_p, m_c)  # the GPU max drops a NaN partial
    m_cs = gl.where(m_c == float("-inf"), 0.0, m_c)
    w_i = gl.where(m_i == float("-inf"), 0.0, gl.exp2(m_i - m_cs))
    w_p = gl.where(m_p == float("-inf"), 0.0, gl.exp2(m_p - m_cs))
    l_i = l_i * w_i + w_p
    wi = w_i[None, :]
    wp = w_p[None, :]
    return (l_i, m_c, o0 * wi + p0 * wp, o1 * wi + p1 * wp, o2 * wi + p2 * wp,
            o3 * wi + p3 * wp, o4 * wi + p4 * wp, o5 * wi + p5 * wp, o6 * wi + p6 * wp,
            o7 * wi + p7 * wp)


def row_store_layout(n: int, warp_bases) -> gl.DistributedLinearLayout:
    """The store layout of a ``[64, n * 2**(extra warp column bits)]`` wgmma accumulator
    (``instr_shape [16, n, 16]``, 4 warps down the 64 rows, ``warp_bases`` as its linear
    layout's): column bits 1-2 (lanes in the accumulator) and 3-4 (registers) exchanged, so a
    thread holds 8 consecutive columns (one 16-byte bf16 store, two fp32 ones) and a warp's
    store covers 8 rows x 32 columns. ``gl.convert_layout`` moves the accumulator there within
    each warp (a 512-byte-per-warp scratch for bf16); storing from the accumulator layout itself
    writes 4 bytes at a time and stalls the warps on the store queue."""
    cols = [[0, 1 << b] for b in range(n.bit_length() - 1)]
    width = max([n] + [2 * b[1] for b in warp_bases if b[1]])
    return gl.DistributedLinearLayout(
        reg_bases=cols[:3] + [[8, 0]] + cols[5:],
        lane_bases=cols[3:5] + [[1, 0], [2, 0], [4, 0]],
        warp_bases=warp_bases, block_bases=[], shape=[64, width])
