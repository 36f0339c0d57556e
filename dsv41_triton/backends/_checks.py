"""Argument checks for backends that call external kernels (which would otherwise fail with a
C++ assertion or, worse, read out of bounds). TypeError/ValueError naming the argument."""
from __future__ import annotations

from typing import Optional

import torch

from .._utils import HEAD_DIM, check_same_device, check_tensor
from ..ops.records import check_k_cache


def check_q(q) -> None:
    check_tensor("q", q, dtypes=(torch.bfloat16,), ndims=3, last_dim=HEAD_DIM)


def check_rows(name: str, t: Optional[torch.Tensor], T: int, *, ndims=2) -> None:
    if t is None:
        return
    check_tensor(name, t, dtypes=(torch.int32,), ndims=ndims)
    if t.shape[0] != T:
        raise ValueError(f"{name}: expected {T} rows (one per query token), got {t.shape[0]}")


def check_sink(attn_sink, H: int) -> None:
    if attn_sink is None:
        return
    check_tensor("attn_sink", attn_sink, dtypes=(torch.float32,), ndims=1)
    if attn_sink.shape[0] != H:
        raise ValueError(f"attn_sink: expected {H} entries (one per head), got {attn_sink.shape[0]}")


def check_out(out, q) -> None:
    if out is None:
        return
    check_tensor("out", out, dtypes=(torch.bfloat16,), ndims=3, last_dim=HEAD_DIM)
    if tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"out: expected shape {tuple(q.shape)}, got {tuple(out.shape)}")


def check_decode(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                 attn_sink, out):
    check_q(q)
    T, H = q.shape[:2]
    swa_fmt, _ = check_k_cache("swa_cache", swa_cache)
    check_rows("swa_indices", swa_indices, T)
    check_rows("swa_lens", swa_lens, T, ndims=1)
    extra_fmt = None
    if extra_cache is not None:
        extra_fmt, _ = check_k_cache("extra_cache", extra_cache)
        if extra_indices is None:
            raise ValueError("extra_indices: required when extra_cache is given")
        check_rows("extra_indices", extra_indices, T)
        check_rows("extra_lens", extra_lens, T, ndims=1)
    elif extra_indices is not None or extra_lens is not None:
        raise ValueError("extra_indices/extra_lens: given without extra_cache")
    check_sink(attn_sink, H)
    check_out(out, q)
    check_same_device(q=q, swa_cache=swa_cache, swa_indices=swa_indices, swa_lens=swa_lens,
                      extra_cache=extra_cache, extra_indices=extra_indices, extra_lens=extra_lens,
                      attn_sink=attn_sink, out=out)
    return swa_fmt, extra_fmt


def check_prefill(q, kv, indices, lens, attn_sink, out):
    check_q(q)
    T, H = q.shape[:2]
    check_tensor("kv", kv, dtypes=(torch.bfloat16,), ndims=(2, 3), last_dim=HEAD_DIM)
    if kv.dim() == 3 and kv.shape[1] != 1:
        raise ValueError(f"kv: a 3-D kv must be [S, 1, 512], got {tuple(kv.shape)}")
    check_tensor("indices", indices, dtypes=(torch.int32,), ndims=(2, 3))
    if indices.dim() == 3 and indices.shape[1] != 1:
        raise ValueError(f"indices: a 3-D indices must be [T, 1, K], got {tuple(indices.shape)}")
    if indices.shape[0] != T:
        raise ValueError(f"indices: expected {T} rows, got {indices.shape[0]}")
    check_rows("lens", lens, T, ndims=1)
    check_sink(attn_sink, H)
    check_out(out, q)
    check_same_device(q=q, kv=kv, indices=indices, lens=lens, attn_sink=attn_sink, out=out)
