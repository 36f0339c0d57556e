"""Argument checks of the backends: the contract's checks (``dsv41_triton._contract``), in the
form the backends call them, and those of the prefill's key-sharing hint. Every backend takes
int32 and int64 indices and lens; the FlashMLA ones convert them to FlashMLA's int32 on the
device (``_flashmla_common.index_rows_i32`` / ``lens_i32``)."""
from __future__ import annotations

import torch

from .._contract import (INT_DTYPES, check_decode_args, check_out, check_prefill_args, check_q,
                         check_same_device, check_shape, check_sink, check_tensor)

__all__ = ["check_q", "check_sink", "check_out", "check_decode", "check_prefill",
           "check_window_rows", "check_shared_window_hint"]


def check_decode(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                 attn_sink, out, *, softmax_scale=None):
    """``(window record, compressed record or None)`` after every decode check."""
    a = check_decode_args(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                          extra_lens, attn_sink, softmax_scale, out, index_dtypes=INT_DTYPES)
    return a.swa_fmt, a.extra_fmt


def check_prefill(q, kv, indices, lens, attn_sink, out, *, softmax_scale=None):
    check_prefill_args(q, kv, indices, lens, attn_sink, softmax_scale, out,
                       index_dtypes=INT_DTYPES)


def check_window_rows(window_rows, q) -> None:
    """``window_rows [3, T]`` int32 (the key-sharing hint of the prefill entry points)."""
    check_tensor("window_rows", window_rows, dtypes=(torch.int32,), ndims=2)
    check_shape("window_rows", window_rows, [3, q.shape[0]])


def check_shared_window_hint(q, window_rows, query_start_loc) -> None:
    """The hint of ``sparse_mla_prefill_shared_window`` / ``_paged_window``: ``q`` a query,
    ``window_rows [3, T]`` int32 and ``query_start_loc [B + 1]`` int (``B >= 0``, as
    ``combine_topk_swa_indices`` takes it), both on ``q``'s device."""
    check_q(q)
    check_window_rows(window_rows, q)
    check_tensor("query_start_loc", query_start_loc, dtypes=INT_DTYPES, ndims=1,
                 contiguous_last=False)
    if query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc: expected [B + 1] request starts (at least one "
                         f"entry), got shape {tuple(query_start_loc.shape)}")
    check_same_device(q=q, window_rows=window_rows, query_start_loc=query_start_loc)
