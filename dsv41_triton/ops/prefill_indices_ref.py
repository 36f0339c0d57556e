"""Plain PyTorch reference of :func:`dsv41_triton.ops.prefill_indices.prefill_slot_indices`.

Prefill straight from the paged caches: per query token, the slot ids of its window positions
and of its top-k compressed entries (what ``sparse_mla_decode`` reads), instead of rows of a
gathered workspace.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def _map_local(local: torch.Tensor, block_table: torch.Tensor, req: torch.Tensor,
               ok: torch.Tensor, page: int) -> torch.Tensor:
    """Local positions / entries ``[T, C]`` int64 of request ``req [T]`` -> slot ids (int64),
    ``-1`` where ``ok [T, C]`` is False, the block column is past the table or the block id is
    negative."""
    R, MB = block_table.shape
    col = torch.div(local.clamp_min(0), page, rounding_mode="floor")
    good = ok & (local >= 0) & (col < MB) & (req < R)[:, None]
    if R == 0 or MB == 0:
        return torch.full_like(local, -1)
    blk = block_table.long()[req.clamp(0, R - 1)[:, None], col.clamp(max=MB - 1)]
    good &= blk >= 0
    return torch.where(good, blk * page + local.clamp_min(0) % page, -1)


def prefill_slot_indices_ref(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    swa_block_table: torch.Tensor,
    swa_page_size: int,
    window_size: int,
    topk_indices: Optional[torch.Tensor] = None,
    compressed_block_table: Optional[torch.Tensor] = None,
    compressed_page_size: int = 1,
    compress_ratio: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Reference (same signature and outputs as ``prefill_slot_indices``).

    Token ``t`` of request ``b = token_to_req[t]`` at ``pos = positions[t]`` (no keys when
    ``b`` is outside ``[0, len(seq_lens))`` or ``pos < 0``):

    * window: positions ``max(pos - W + 1, 0) .. pos`` ascending -> ``swa_block_table[b, p //
      page] * page + p % page`` (``-1`` for a block column past the table or a negative block
      id, still counted), ``-1`` after; ``swa_lens = pos - start + 1``.
    * compressed (``compress_ratio = r > 0``): columns ``c < topk_len = min((pos + 1) // r,
      K)`` of ``topk_indices`` (``[T, K]`` local entries); entry ``e`` becomes its slot in
      ``compressed_block_table`` when ``0 <= e < seq_lens[b] // r`` (else ``-1``, still
      counted); ``-1`` past ``topk_len``; ``extra_lens = topk_len``.

    Returns ``(swa_indices [T, W] int32, swa_lens [T] int32, extra_indices [T, K] int32,
    extra_lens [T] int32)``; the last two are None when ``compress_ratio == 0``.
    """
    T = positions.shape[0]
    dev = positions.device
    B = seq_lens.shape[0]
    pos = positions.long()
    req = token_to_req[:T].to(dev).long()
    ok = (req >= 0) & (req < B) & (pos >= 0)
    rq = req.clamp(0, max(B - 1, 0))
    W = window_size
    start = (pos - W + 1).clamp_min(0)
    wlen = torch.where(ok, pos - start + 1, 0)
    cw = torch.arange(W, device=dev)[None, :]
    in_w = cw < wlen[:, None]
    swa = _map_local(start[:, None] + cw, swa_block_table.to(dev), rq, in_w, swa_page_size)
    swa_idx = torch.where(in_w, swa, -1).to(torch.int32)
    if compress_ratio <= 0:
        return swa_idx, wlen.to(torch.int32), None, None
    K = topk_indices.shape[1]
    nent = torch.div(seq_lens.to(dev).long()[rq], compress_ratio, rounding_mode="floor")
    tlen = torch.where(ok, torch.div(pos + 1, compress_ratio, rounding_mode="floor").clamp(max=K),
                       0)
    ck = torch.arange(K, device=dev)[None, :]
    in_k = ck < tlen[:, None]
    e = topk_indices.to(dev).long()
    good = in_k & (e < nent[:, None])
    ext = _map_local(e, compressed_block_table.to(dev), rq, good, compressed_page_size)
    return swa_idx, wlen.to(torch.int32), ext.to(torch.int32), tlen.to(torch.int32)


def prefill_window_slot_indices_ref(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    first_request: int,
    rows_per_request: int,
    window_size: int,
    topk_indices: Optional[torch.Tensor] = None,
    compressed_block_table: Optional[torch.Tensor] = None,
    compressed_page_size: int = 1,
    compress_ratio: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Reference of ``prefill_window_slot_indices`` (same signature and outputs).

    Token ``t`` of request ``b`` at ``pos`` (``i = b - first_request``; no window when ``b`` is
    invalid, ``pos < 0`` or ``i`` outside ``[0, len(gather_lens))``): with ``g =
    clamp(gather_lens[i], 0, rows_per_request)`` and ``gs = seq_lens[b] - g``, the window
    positions ``max(pos - W + 1, 0, gs) .. min(pos, seq_lens[b] - 1)`` as rows
    ``rows_per_request * i + p - gs``: ``window_rows[0]`` the first (0 when none),
    ``window_rows[1]`` their count, ``window_rows[2]`` the top-k length; the top-k part is
    ``prefill_slot_indices_ref``'s.
    """
    T = positions.shape[0]
    dev = positions.device
    B = seq_lens.shape[0]
    pos = positions.long()
    req = token_to_req[:T].to(dev).long()
    ok = (req >= 0) & (req < B) & (pos >= 0)
    i = req - first_request
    NG = gather_lens.shape[0]
    inw = ok & (i >= 0) & (i < NG)
    ic = i.clamp(0, max(NG - 1, 0))
    g = gather_lens.to(dev).long()[ic] if NG else torch.zeros_like(pos)
    g = g.clamp(0, rows_per_request)
    seq = seq_lens.to(dev).long()[req.clamp(0, max(B - 1, 0))] if B else torch.zeros_like(pos)
    gs = seq - g
    first = torch.maximum((pos - window_size + 1).clamp_min(0), gs)
    last = torch.minimum(pos, seq - 1)
    count = torch.where(inw, (last - first + 1).clamp_min(0), 0)
    row = torch.where(count > 0, rows_per_request * i + first - gs, 0)
    ext = tlen = None
    if compress_ratio > 0:
        # the top-k part does not read the window-cache table: any [B, 1] table will do
        _, _, ext, tlen = prefill_slot_indices_ref(
            positions, token_to_req, seq_lens, torch.zeros(max(B, 1), 1, dtype=torch.int32,
                                                           device=dev), 1, window_size,
            topk_indices, compressed_block_table, compressed_page_size, compress_ratio)
    k = tlen.long() if tlen is not None else torch.zeros_like(pos)
    win = torch.stack([row, count, k]).to(torch.int32)
    return win, ext, tlen


__all__ = ["prefill_slot_indices_ref", "prefill_window_slot_indices_ref"]
