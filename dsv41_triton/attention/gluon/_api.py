"""Gluon names that differ between the Triton releases the kernels compile with.

Triton 3.6 spells them ``gl.thread_barrier``, ``async_copy.async_copy_global_to_shared`` and
``shared_memory_descriptor._reinterpret``; Triton 3.9 ``gl.barrier``, ``async_copy.async_load``
(its old copy name only raises) and ``.reinterpret``. The kernels call the names bound here,
which are the installed release's builtins themselves (``reinterpret``: a constexpr branch).
``ROW_POINTER_HINT``: whether gathered row pointers need a contiguity hint (3.9's cp.async
lowering does).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp

#: a CTA-wide barrier (``bar.sync 0``)
barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
#: ``cp.async`` of ``pointer`` (masked by ``mask``) into the shared buffer ``smem``
async_load = _cp.async_load if hasattr(_cp, "async_load") else _cp.async_copy_global_to_shared

_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
#: the releases that spell ``async_load`` (3.9) lower a cp.async of gathered rows with 2-byte
#: pieces unless its pointers say they run 8 elements contiguous (``max_contiguous`` /
#: ``multiple_of``, set in the kernel where the pointers are made); 3.6 needs no hint and
#: builds differently with one
ROW_POINTER_HINT = gl.constexpr(hasattr(_cp, "async_load"))


@gluon.jit
def reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """The shared buffer ``buf`` viewed as ``shape`` elements of ``dtype`` in ``layout`` (the
    same bytes)."""
    if _PUBLIC_REINTERPRET:
        return buf.reinterpret(dtype, shape, layout)
    else:
        return buf._reinterpret(dtype, shape, layout)


__all__ = ["barrier", "async_load", "reinterpret", "ROW_POINTER_HINT"]
