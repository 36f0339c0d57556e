"""Sparse MLA prefill straight from the paged caches (no gathered workspace).

A prefill token attends like a decode token: its window positions and its top-k compressed
entries become slot ids (``ops.prefill_indices.prefill_slot_indices``) and
``sparse_mla_decode`` dequantizes the records inside the attention kernel. Memory is
``T * (W + K) * 4`` bytes of indices (plus the outputs), independent of the context length;
the gather + workspace path needs ``requests * (seq_len // r + gather_len) * 1 KiB``.
Reference: ``prefill_paged_ref.py``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._utils import INT_DTYPES, check_int, check_tensor
from ..ops.prefill_indices import prefill_slot_indices
from ..ops.records import check_k_cache
from ._configs import KernelConfig
from ._kernels import check_common
from .decode import EXTRA_RECORDS, SWA_RECORDS, sparse_mla_decode


def sparse_mla_prefill_paged(
    q: torch.Tensor,
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_block_table: torch.Tensor,
    window_size: int,
    compressed_cache: Optional[torch.Tensor] = None,
    compressed_block_table: Optional[torch.Tensor] = None,
    topk_indices: Optional[torch.Tensor] = None,
    compress_ratio: int = 0,
    attn_sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    *,
    _config: Optional[KernelConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill over the paged window and compressed caches.

    Args:
        q: ``[T, H, 512]`` bf16, RoPE'd.
        positions, token_to_req, seq_lens: ``[T]``, ``[>= T]``, ``[B]`` int: each token's
            position and request, each request's total length.
        swa_cache: ``[blocks, page, 584 | 528]`` uint8 window cache; ``swa_block_table [R,
            max_blocks]`` its blocks by position; ``window_size``: ``W``.
        compressed_cache, compressed_block_table, topk_indices ``[T, K]`` (local entries,
            ``-1`` = none), compress_ratio: the compressed key set (``compress_ratio = 0``:
            window only; the cache's page size is its ``shape[1]``).
        attn_sink: ``[H]`` fp32 or None; softmax_scale: default ``512 ** -0.5``;
        out: optional ``[T, H, 512]`` bf16.

    Token ``t`` reads window positions ``max(pos - W + 1, 0) .. pos`` and its first
    ``min((pos + 1) // r, K)`` top-k entries that are ``< seq_len // r`` (the same keys as
    the gather + workspace path). Returns ``(out [T, H, 512] bf16, lse [T, H] fp32)``
    (empty rows: 0 and +inf).
    """
    # everything sparse_mla_decode checks that the index launch would otherwise precede
    T, _, _ = check_common(q, attn_sink, softmax_scale, out, "prefill")
    caches = [("swa_cache", swa_cache, SWA_RECORDS)]
    r = check_int("compress_ratio", compress_ratio, lo=0)
    if r:
        if compressed_cache is None:
            raise ValueError("compressed_cache: required for compress_ratio > 0")
        caches.append(("compressed_cache", compressed_cache, EXTRA_RECORDS))
    for name, cache, allowed in caches:
        fmt, _ = check_k_cache(name, cache)
        if fmt.record_bytes not in allowed:
            raise ValueError(f"{name}: expected a record width in {allowed}, got "
                             f"{fmt.record_bytes} ({fmt.name})")
    check_tensor("positions", positions, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    if positions.shape[0] != T:
        raise ValueError(f"positions: expected {T} entries (one per query token), got "
                         f"{positions.shape[0]}")
    si, sl, ei, el = prefill_slot_indices(
        positions, token_to_req, seq_lens, swa_block_table, int(swa_cache.shape[1]),
        window_size, topk_indices, compressed_block_table,
        int(compressed_cache.shape[1]) if r else 1, r)
    return sparse_mla_decode(q, swa_cache, si, sl, compressed_cache if r else None, ei, el,
                             attn_sink, softmax_scale, out, _config=_config)


__all__ = ["sparse_mla_prefill_paged"]
