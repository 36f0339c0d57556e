"""Float64 reference of ``sparse_mla_prefill_paged``: the reference slot rows
(``ops.prefill_indices_ref``) fed to ``sparse_mla_decode_ref``."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..ops.prefill_indices_ref import prefill_slot_indices_ref
from .ref import sparse_mla_decode_ref


def sparse_mla_prefill_paged_ref(
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
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Same arguments as ``sparse_mla_prefill_paged`` (no ``out``); returns ``(out [T, H,
    512] float64, lse [T, H] float64)``."""
    r = compress_ratio
    si, sl, ei, el = prefill_slot_indices_ref(
        positions, token_to_req, seq_lens, swa_block_table, int(swa_cache.shape[1]),
        window_size, topk_indices, compressed_block_table,
        int(compressed_cache.shape[1]) if r else 1, r)
    return sparse_mla_decode_ref(q, swa_cache, si, sl, compressed_cache if r else None, ei, el,
                                 attn_sink, softmax_scale)


__all__ = ["sparse_mla_prefill_paged_ref"]
