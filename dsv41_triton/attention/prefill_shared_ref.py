"""Float64 reference of ``sparse_mla_prefill_shared_window``: each token's top-k rows and
window rows as one index row of ``sparse_mla_prefill_ref`` (with ``topk_cache``: the top-k
records decoded by ``records.read_slots_ref`` and the window rows in one softmax)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._utils import HEAD_DIM
from ..ops.records import check_k_cache, read_slots_ref
from .ref import _attend, _chunks, _column_mask, _empty, sparse_mla_prefill_ref


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
    topk_cache: Optional[torch.Tensor] = None,
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
    if topk_cache is None:
        return sparse_mla_prefill_ref(q, kv, torch.cat([idx, win], 1), None, attn_sink,
                                      softmax_scale)
    if T == 0:
        return _empty(q)
    scale = HEAD_DIM ** -0.5 if softmax_scale is None else float(softmax_scale)
    _, c3 = check_k_cache("topk_cache", topk_cache)
    tmask = _column_mask(idx, None, c3.shape[0] * c3.shape[1])
    kv2 = kv.reshape(kv.shape[0], HEAD_DIM)
    wmask = _column_mask(win, None, kv2.shape[0])
    outs, lses = [], []
    for a, b in _chunks(T, K + width):
        tkeys = read_slots_ref(c3, torch.where(tmask[a:b], idx[a:b], -1), torch.float32)
        wkeys = (kv2[torch.where(wmask[a:b], win[a:b], 0)] if kv2.shape[0] else
                 torch.zeros(b - a, width, HEAD_DIM, device=dev))
        o, l = _attend(q[a:b].double(), [tkeys.double(), wkeys.double()],
                       [tmask[a:b], wmask[a:b]], attn_sink, scale)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, 0), torch.cat(lses, 0)


__all__ = ["sparse_mla_prefill_shared_window_ref"]
