"""PyTorch reference of :func:`dsv41_triton.ops.index_mask.mask_index_rows`."""
from __future__ import annotations

from typing import Optional

import torch

from .._utils import round_up

#: the largest id a kept entry can have (the output is int32)
INT32_MAX = 2 ** 31 - 1


def masked_width(K: int, multiple: int) -> int:
    """Columns of the masked rows: ``K`` rounded up to ``multiple``, at least ``multiple``."""
    return max(round_up(K, multiple), multiple)


def mask_index_rows_ref(idx: torch.Tensor, lens: Optional[torch.Tensor], multiple: int,
                        out: Optional[torch.Tensor] = None,
                        num_rows: Optional[int] = None) -> torch.Tensor:
    """``idx [T, K]`` int32/int64 -> ``[T, Kp]`` int32, ``Kp = masked_width(K, multiple)``.

    Entry ``[t, c]`` is ``idx[t, c]`` when ``c < K``, ``0 <= idx[t, c] <= INT32_MAX`` (an int64
    id past int32 is past every cache, so skipped, never truncated into one),
    ``idx[t, c] < num_rows`` (None: no bound) and
    ``c < lens[t]`` (``lens`` None: every column), else ``-1``. ``lens [T]`` int is clamped
    by the comparison itself: ``lens[t] >= K`` keeps every column, ``lens[t] <= 0`` none.
    ``out``: an optional ``[T, Kp]`` int32 tensor to fill (returned)."""
    T, K = idx.shape
    Kp = masked_width(K, multiple)
    src = torch.nn.functional.pad(idx.to(torch.int64), (0, Kp - K), value=-1)
    keep = (src >= 0) & (src <= INT32_MAX)
    if num_rows is not None:
        keep = keep & (src < num_rows)
    if lens is not None:
        cols = torch.arange(Kp, device=idx.device, dtype=torch.int64)
        keep = keep & (cols[None, :] < lens.to(torch.int64)[:, None])
    res = torch.where(keep, src, torch.full_like(src, -1)).to(torch.int32)
    if out is None:
        return res
    out.copy_(res)
    return out
