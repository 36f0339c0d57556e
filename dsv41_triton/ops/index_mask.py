"""Index rows masked for kernels that skip ``-1`` entries (FlashMLA's sparse decode), in one
Triton launch.

:func:`mask_index_rows`: ``idx [T, K]`` -> ``[T, Kp]`` int32 with negative entries, entries
``>= num_rows`` (the rows the kernel may read), int64 entries past int32 and columns past
``lens[t]`` set to ``-1``, and the row padded with ``-1`` to a multiple of ``multiple``.
Reference: :func:`dsv41_triton.ops.index_mask_ref.mask_index_rows_ref`. Each program writes
only its own ``[BLOCK_T, BLOCK_C]`` tile of the output; nothing synchronizes with the host.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._utils import (
    INT_DTYPES,
    call_op,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
    use_reference,
)
from .index_mask_ref import INT32_MAX, mask_index_rows_ref, masked_width

MASK_BLOCK_T = 16
MASK_BLOCK_C = 128
MASK_NUM_WARPS = 4


@triton.jit(do_not_specialize=["T", "LAST"])
def _mask_index_rows_kernel(
    idx_ptr, lens_ptr, out_ptr,
    T, K, Kp, LAST,
    s_it, s_ik, s_l, s_ot,
    HAS_LENS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One ``[BLOCK_T, BLOCK_C]`` tile of the output per program; comparisons in int64; ``LAST``
    the largest id kept."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    rvalid = rows < T
    v = tl.load(idx_ptr + r64[:, None] * s_it + c64[None, :] * s_ik,
                mask=rvalid[:, None] & (cols < K)[None, :], other=-1).to(tl.int64)
    keep = (v >= 0) & (v <= LAST.to(tl.int64))
    if HAS_LENS:
        n = tl.load(lens_ptr + r64 * s_l, mask=rvalid, other=0).to(tl.int64)
        keep = keep & (c64[None, :] < n[:, None])
    res = tl.where(keep, v, -1).to(tl.int32)
    tl.store(out_ptr + r64[:, None] * s_ot + c64[None, :], res,
             mask=rvalid[:, None] & (cols < Kp)[None, :])


def mask_index_rows(idx: torch.Tensor, lens: Optional[torch.Tensor], multiple: int,
                    out: Optional[torch.Tensor] = None,
                    num_rows: Optional[int] = None) -> torch.Tensor:
    """Mask and pad index rows (one launch).

    Args:
        idx: ``[T, K]`` int32 or int64 (rows may be strided); entries ``< 0`` are skipped.
        lens: ``[T]`` int or None: row ``t`` keeps its first ``lens[t]`` columns (clamped:
            ``>= K`` keeps all, ``<= 0`` none; see docs/semantics.md).
        multiple: the output width is ``K`` rounded up to it, at least one ``multiple``.
        out: optional ``[T, Kp]`` int32 tensor (last dim contiguous) to fill.
        num_rows: the rows the ids address (a cache's slots, a workspace's rows); an id
            ``>= num_rows`` is skipped. None: every id int32 can hold.

    Returns ``[T, Kp]`` int32: ``idx[t, c]`` where kept, else ``-1`` (also where an int64 entry
    exceeds int32: it is past every cache).
    """
    check_tensor("idx", idx, dtypes=INT_DTYPES, ndims=2, contiguous_last=False)
    check_int("multiple", multiple, lo=1)
    if num_rows is not None:
        check_int("num_rows", num_rows, lo=0)
    T, K = idx.shape
    if lens is not None:
        check_tensor("lens", lens, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
        check_shape("lens", lens, [T])
    Kp = masked_width(K, multiple)
    dev = check_same_device(idx=idx, lens=lens, out=out)
    if out is None:
        out = torch.empty((T, Kp), dtype=torch.int32, device=dev)
    else:
        check_tensor("out", out, dtypes=(torch.int32,), ndims=2)
        check_shape("out", out, [T, Kp])
    last = INT32_MAX if num_rows is None else min(num_rows, INT32_MAX + 1) - 1
    call_op(_mask_op, idx, lens, multiple, out, last)
    return out


@torch.library.custom_op("dsv41::mask_index_rows", mutates_args=("out",))
def _mask_op(idx: torch.Tensor, lens: Optional[torch.Tensor], multiple: int,
             out: torch.Tensor, last: int) -> None:
    if use_reference(idx.device, _mask_index_rows_kernel):
        mask_index_rows_ref(idx, lens, multiple, out=out, num_rows=last + 1)
        return
    T, K = idx.shape
    Kp = out.shape[1]
    if T == 0:
        return
    grid = (triton.cdiv(T, MASK_BLOCK_T), triton.cdiv(Kp, MASK_BLOCK_C))
    _mask_index_rows_kernel[grid](
        idx, lens if lens is not None else idx, out,
        T, K, Kp, last,
        idx.stride(0), idx.stride(1), 0 if lens is None else lens.stride(0), out.stride(0),
        HAS_LENS=lens is not None,
        BLOCK_T=MASK_BLOCK_T,
        BLOCK_C=MASK_BLOCK_C,
        num_warps=MASK_NUM_WARPS,
    )


@_mask_op.register_fake
def _mask_fake(idx, lens, multiple, out, last) -> None:
    return None
