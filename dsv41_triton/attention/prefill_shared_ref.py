"""Float64 reference of ``sparse_mla_prefill_shared_window``: each token's top-k rows and
window rows as one index row of ``sparse_mla_prefill_ref``."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .ref import sparse_mla_prefill_ref


def sparse_mla_prefill_shared_window_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    win_start: torch.Tensor,
    win_len: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_lens: Optional[torch.Tensor],
    query_start_loc: torch.Tensor,
    attn_sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Same arguments as the kernel entry point (``query_start_loc`` only shapes its tiles);
    returns ``(out [T, H, 512] float64, lse [T, H] float64)``."""
    del query_start_loc
    T, K = topk_indices.shape
    dev = q.device
    idx = topk_indices.long()
    if topk_lens is not None:
        cols = torch.arange(K, device=dev)[None, :]
        idx = torch.where(cols < topk_lens.long().clamp(0, K)[:, None], idx, -1)
    wl = win_len.long().clamp_min(0)
    width = int(wl.max().item()) if T else 0
    cw = torch.arange(width, device=dev)[None, :]
    win = torch.where(cw < wl[:, None], win_start.long()[:, None] + cw, -1)
    return sparse_mla_prefill_ref(q, kv, torch.cat([idx, win], 1), None, attn_sink,
                                  softmax_scale)


__all__ = ["sparse_mla_prefill_shared_window_ref"]
