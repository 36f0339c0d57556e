"""Argument checks for backends that call external kernels (which would otherwise fail with a
C++ assertion or, worse, read out of bounds): the contract's checks
(``dsv41_triton._contract``), narrowed to int32 indices and lens, which FlashMLA reads."""
from __future__ import annotations

from typing import Optional

import torch

from .._contract import (INT_DTYPES, check_decode_args, check_lens, check_out, check_prefill_args,
                         check_q, check_shape, check_sink, check_tensor)

FLASHMLA_INDEX_DTYPES = (torch.int32,)

__all__ = ["check_q", "check_rows", "check_sink", "check_out", "check_decode", "check_prefill",
           "check_window_rows"]


def check_rows(name: str, t: Optional[torch.Tensor], T, *, ndims=2) -> None:
    if t is None:
        return
    if ndims == 1:
        check_lens(name, t, T, FLASHMLA_INDEX_DTYPES)
    else:
        from .._contract import check_indices

        check_indices(name, t, T, FLASHMLA_INDEX_DTYPES)


def check_decode(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                 attn_sink, out, *, index_dtypes=FLASHMLA_INDEX_DTYPES, softmax_scale=None):
    """``(window record, compressed record or None)`` after every decode check."""
    a = check_decode_args(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                          extra_lens, attn_sink, softmax_scale, out, index_dtypes=index_dtypes)
    return a.swa_fmt, a.extra_fmt


def check_prefill(q, kv, indices, lens, attn_sink, out, *, index_dtypes=FLASHMLA_INDEX_DTYPES,
                  softmax_scale=None):
    check_prefill_args(q, kv, indices, lens, attn_sink, softmax_scale, out,
                       index_dtypes=index_dtypes)


#: what the torch backend accepts (the same as the Triton kernels)
TORCH_INDEX_DTYPES = INT_DTYPES


def check_window_rows(window_rows, q) -> None:
    """``window_rows [3, T]`` int32 (the key-sharing hint of the prefill entry points)."""
    check_tensor("window_rows", window_rows, dtypes=(torch.int32,), ndims=2)
    check_shape("window_rows", window_rows, [3, q.shape[0]])
