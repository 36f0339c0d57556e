"""Sparse MLA prefill over a gathered bf16 workspace (SPEC §3, §6).

The same Triton kernel as decode (``_sparse_kernel.py``) with bf16 rows as the key source:
``indices`` are rows of ``kv``; an index ``< 0`` or ``>= S`` is skipped.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._utils import HEAD_DIM, check_same_device, check_tensor
from ._kernels import (SRC_BF16, KernelConfig, KeySet, check_common, check_indices,
                       check_lens, launch, new_outputs)


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    *,
    _config: Optional[KernelConfig] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill with a sink.

    Args:
        q: ``[T, H, 512]`` bf16, RoPE'd.
        kv: ``[S, 512]`` or ``[S, 1, 512]`` bf16 workspace (rows may be strided; last dim
            contiguous).
        indices: ``[T, K]`` or ``[T, 1, K]`` int32 rows of ``kv``; ``< 0`` or ``>= S`` skipped.
        lens: ``[T]`` int32, columns read per row, or None (all ``K``).
        attn_sink: ``[H]`` fp32 or None.
        softmax_scale: default ``512 ** -0.5``.
        out: optional ``[T, H, 512]`` bf16.

    Returns:
        ``(out [T, H, 512] bf16, lse [T, H] fp32)`` (natural log, sink excluded; empty rows
        give 0 and +inf).
    """
    T, H, scale = check_common(q, attn_sink, softmax_scale, out, "prefill")
    check_tensor("kv", kv, dtypes=(torch.bfloat16,), ndims=(2, 3), last_dim=HEAD_DIM)
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"kv: a 3-D workspace must be [S, 1, 512], got {tuple(kv.shape)}")
        kv = kv[:, 0, :]
    check_tensor("indices", indices, dtypes=(torch.int32, torch.int64), ndims=(2, 3))
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"indices: 3-D indices must be [T, 1, K], got "
                             f"{tuple(indices.shape)}")
        indices = indices[:, 0, :]
    check_indices("indices", indices, T)
    check_lens("lens", lens, T)
    check_same_device(q=q, kv=kv, indices=indices, lens=lens, attn_sink=attn_sink, out=out)
    S = int(kv.shape[0])
    row_stride = int(kv.stride(0)) if S > 1 else HEAD_DIM
    a = KeySet(src=SRC_BF16, k=kv, indices=indices, lens=lens, bstride=row_stride, page=1,
               rows=S)
    out, lse = new_outputs(q, out)
    launch(q, a, None, attn_sink, scale, out, lse, _config)
    return out, lse


__all__ = ["sparse_mla_prefill"]
