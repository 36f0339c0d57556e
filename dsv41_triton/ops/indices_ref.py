"""Plain PyTorch references of the two index ops of SPEC §5 (vectorized, any device).

* :func:`combine_topk_swa_indices_ref` — prefill: top-k compressed entries, then the sliding
  window, as rows of the flat gathered workspace.
* :func:`compute_global_topk_indices_and_lens_ref` — decode: local compressed indices to
  paged slot ids, survivors packed to the left.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._utils import round_up

COMBINED_ALIGN = 128  # row width of the combined indices: round_up(topk + window, 128)


def combined_width(topk: int, window_size: int) -> int:
    """Row width of :func:`combine_topk_swa_indices`: ``round_up(topk + window_size, 128)``."""
    return round_up(topk + window_size, COMBINED_ALIGN)


def token_requests_ref(query_start_loc: torch.Tensor, num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(req [T] int64, owned [T] bool)``: the request of each token (the last ``b`` with
    ``query_start_loc[b] - query_start_loc[0] <= t``, so empty requests are skipped) and whether
    the token lies inside ``[0, query_start_loc[B] - query_start_loc[0])``."""
    qsl = query_start_loc.long() - query_start_loc[0].long()
    B = qsl.numel() - 1
    tok = torch.arange(num_tokens, device=qsl.device)
    if B == 0:
        z = torch.zeros(num_tokens, dtype=torch.int64, device=qsl.device)
        return z, torch.zeros(num_tokens, dtype=torch.bool, device=qsl.device)
    req = torch.searchsorted(qsl[:B].contiguous(), tok, right=True) - 1
    return req.clamp(0, B - 1), tok < qsl[B]


def combine_topk_swa_indices_ref(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: Optional[torch.Tensor],
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    window_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`dsv41_triton.ops.indices.combine_topk_swa_indices` (``out`` and
    ``window_rows [3, T]``, when given, are filled as there).

    For token ``t`` of request ``b`` at position ``pos = seq_len - query_len + i``:
    ``topk_len = min((pos+1) // r, topk)`` (0 if ``r == 0``); columns ``< topk_len`` hold
    ``M*b + e`` for top-k entry ``e`` when ``0 <= e < N`` else ``-1`` (still counted); then
    window positions ``p = max(pos-W+1, 0, seq_len-gather_len) .. pos`` as rows
    ``M*b + N + p - (seq_len - gather_len)``; ``-1`` elsewhere. Tokens past the last request
    get a ``-1`` row and length 0. Returns ``(indices [T, width] int32, lens [T] int32)``;
    ``window_rows`` gets ``M*b + N + p_first - (seq_len - gather_len)``, the window's length
    and ``topk_len`` (0 / 0 / 0 past the last request).
    """
    idx, lens, win = _combine_ref(topk_indices, query_start_loc, seq_lens, gather_lens,
                                  window_size, compress_ratio, topk, M, N)
    if window_rows is not None:
        window_rows.copy_(win)
    if out is None:
        return idx, lens
    out[0].copy_(idx)
    out[1].copy_(lens)
    return out[0], out[1]


def _combine_ref(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                 compress_ratio, topk, M, N):
    """``(indices, lens, window_rows [3, T])`` of :func:`combine_topk_swa_indices_ref`."""
    T = topk_indices.shape[0]
    dev = topk_indices.device
    width = combined_width(topk, window_size)
    req, owned = token_requests_ref(query_start_loc.to(dev), T)
    if T == 0:
        return (torch.empty(0, width, dtype=torch.int32, device=dev),
                torch.empty(0, dtype=torch.int32, device=dev),
                torch.empty(3, 0, dtype=torch.int32, device=dev))
    qsl = query_start_loc.to(dev).long() - query_start_loc[0].to(dev).long()
    if qsl.numel() > 1:
        sl = seq_lens.to(dev).long()[req]
        gl = sl if gather_lens is None else gather_lens.to(dev).long()[req]
        qs, qe = qsl[req], qsl[req + 1]
    else:
        sl = gl = qs = qe = torch.zeros(T, dtype=torch.int64, device=dev)
    tok = torch.arange(T, device=dev)
    pos = sl - (qe - qs) + tok - qs
    if compress_ratio > 0:
        topk_len = torch.div((pos + 1).clamp_min(0), compress_ratio, rounding_mode="floor").clamp(max=topk)
    else:
        topk_len = torch.zeros_like(pos)
    topk_len = torch.where(owned, topk_len, 0)
    gs = sl - gl
    swa_start = torch.maximum(torch.maximum(pos - window_size + 1, torch.zeros_like(pos)), gs)
    swa_len = torch.where(owned, (pos - swa_start + 1).clamp_min(0), 0)

    cols = torch.arange(width, device=dev)[None, :]
    base = (M * req)[:, None]
    K = topk_indices.shape[1]
    if K > 0:
        tv = topk_indices.long()[:, cols[0].clamp(max=K - 1)]
    else:
        tv = torch.full((T, width), -1, dtype=torch.int64, device=dev)
    topk_val = torch.where((tv >= 0) & (tv < N), base + tv, -1)
    swa_val = base + N + swa_start[:, None] + (cols - topk_len[:, None]) - gs[:, None]
    in_topk = cols < topk_len[:, None]
    in_swa = cols < (topk_len + swa_len)[:, None]
    val = torch.where(in_topk, topk_val, torch.where(in_swa, swa_val, -1))
    win_start = torch.where(owned, M * req + N + swa_start - gs, 0)
    win = torch.stack([win_start, swa_len, topk_len]).to(torch.int32)
    return val.to(torch.int32), (topk_len + swa_len).to(torch.int32), win


def compute_global_topk_indices_and_lens_ref(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`dsv41_triton.ops.indices.compute_global_topk_indices_and_lens`.

    Local index ``i >= 0`` of token ``t`` (request ``r = token_to_req_indices[t]``) becomes
    ``block_table[r, i // bs] * bs + i % bs``; it is dropped when ``r`` is outside
    ``[0, block_table.shape[0])``, ``i // bs >= block_table.shape[1]`` or the slot is negative or
    past int32.
    Survivors are packed to the left in their original order, ``-1`` after; ``lens`` counts
    them (0 where ``is_valid_token`` is False). Returns ``(indices [T, K] int32, lens [T] int32)``.
    """
    T, K = topk_indices.shape
    dev = topk_indices.device
    local = topk_indices.long()
    req = token_to_req_indices[:T].to(dev).long()
    R, MB = block_table.shape
    ok = (local >= 0) & ((req >= 0) & (req < R))[:, None]
    col = torch.div(local.clamp_min(0), block_size, rounding_mode="floor")
    ok &= col < MB
    if R > 0 and MB > 0:
        rows = block_table.to(dev).long()[req.clamp(0, R - 1)]  # [T, MB]
        blk = torch.gather(rows, 1, col.clamp(max=MB - 1))
        slot = blk * block_size + local.clamp_min(0) % block_size
    else:
        slot = torch.full_like(local, -1)
    ok &= (slot >= 0) & (slot <= 2**31 - 1)
    # stable sort on "dropped" moves survivors left, keeping their order
    order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices
    packed = torch.gather(torch.where(ok, slot, -1), 1, order)
    count = ok.sum(1)
    packed = torch.where(torch.arange(K, device=dev)[None, :] < count[:, None], packed, -1)
    if is_valid_token is not None:
        count = torch.where(is_valid_token[:T].to(dev).bool(), count, 0)
    return packed.to(torch.int32), count.to(torch.int32)
