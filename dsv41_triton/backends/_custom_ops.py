"""The backend entry points as ``torch.library`` custom ops, for callers that are compiled
(the layer): ``torch.ops.dsv41.backend_<entry point>(backend_name, ...)`` runs
``get_backend(backend_name).<entry point>(...)`` eagerly behind the op boundary, into
caller-given outputs.

Why an op and not the Python call: Dynamo skips every file under a path containing
``triton/backends`` (it means Triton's own ``triton/backends``; ``dsv41_triton/backends`` matches
too), so a traced call into a backend method is a graph break; and the dispatcher (probing,
FlashMLA's padding, per-step caches) should not be traced anyway. Callers must call
``torch.ops.dsv41.backend_*`` from their own (traced) file, not through a helper defined here.

A backend's per-step cache (``StepMetadata.backend_cache``, e.g. FlashMLA's scheduler metadata)
cannot cross an op boundary; :func:`step_cache_key` registers it and the ops take the key.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Optional

import torch

from .registry import get_backend

#: step caches by key, the most recent ones (a step's layers share one)
_STEP_CACHES: "OrderedDict[int, Dict]" = OrderedDict()
_MAX_STEP_CACHES = 16


def step_cache_key(cache: Optional[Dict]) -> int:
    """An int that stands for ``cache`` in the ops (``-1`` for None)."""
    if cache is None:
        return -1
    key = id(cache)
    _STEP_CACHES[key] = cache
    _STEP_CACHES.move_to_end(key)
    while len(_STEP_CACHES) > _MAX_STEP_CACHES:
        _STEP_CACHES.popitem(last=False)
    return key


def _step_kw(key: int) -> dict:
    cache = _STEP_CACHES.get(key) if key >= 0 else None
    return {} if cache is None else {"step_cache": cache}


def _fill(dst: torch.Tensor, got: torch.Tensor) -> None:
    if got.data_ptr() != dst.data_ptr() or got.stride() != dst.stride():
        dst.copy_(got)


@torch.library.custom_op("dsv41::backend_sparse_mla_decode", mutates_args=("out", "lse"))
def backend_sparse_mla_decode(
        backend: str, q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
        swa_lens: Optional[torch.Tensor], extra_cache: Optional[torch.Tensor],
        extra_indices: Optional[torch.Tensor], extra_lens: Optional[torch.Tensor],
        attn_sink: Optional[torch.Tensor], softmax_scale: Optional[float], step_key: int,
        out: torch.Tensor, lse: torch.Tensor) -> None:
    o, l = get_backend(backend).sparse_mla_decode(
        q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
        attn_sink=attn_sink, softmax_scale=softmax_scale, out=out, **_step_kw(step_key))
    _fill(out, o)
    lse.copy_(l)


@backend_sparse_mla_decode.register_fake
def _(backend, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
      attn_sink, softmax_scale, step_key, out, lse) -> None:
    return None


@torch.library.custom_op("dsv41::backend_sparse_mla_prefill", mutates_args=("out", "lse"))
def backend_sparse_mla_prefill(
        backend: str, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
        lens: Optional[torch.Tensor], attn_sink: Optional[torch.Tensor],
        softmax_scale: Optional[float], out: torch.Tensor, lse: torch.Tensor) -> None:
    o, l = get_backend(backend).sparse_mla_prefill(q, kv, indices, lens, attn_sink=attn_sink,
                                                   softmax_scale=softmax_scale, out=out)
    _fill(out, o)
    lse.copy_(l)


@backend_sparse_mla_prefill.register_fake
def _(backend, q, kv, indices, lens, attn_sink, softmax_scale, out, lse) -> None:
    return None


@torch.library.custom_op("dsv41::backend_sparse_mla_prefill_shared_window",
                         mutates_args=("out", "lse"))
def backend_sparse_mla_prefill_shared_window(
        backend: str, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
        lens: Optional[torch.Tensor], window_rows: torch.Tensor, query_start_loc: torch.Tensor,
        attn_sink: Optional[torch.Tensor], softmax_scale: Optional[float], out: torch.Tensor,
        lse: torch.Tensor) -> None:
    o, l = get_backend(backend).sparse_mla_prefill_shared_window(
        q, kv, indices, lens, window_rows, query_start_loc, attn_sink=attn_sink,
        softmax_scale=softmax_scale, out=out)
    _fill(out, o)
    lse.copy_(l)


@backend_sparse_mla_prefill_shared_window.register_fake
def _(backend, q, kv, indices, lens, window_rows, query_start_loc, attn_sink, softmax_scale,
      out, lse) -> None:
    return None


@torch.library.custom_op("dsv41::backend_sparse_mla_prefill_paged_window",
                         mutates_args=("out", "lse"))
def backend_sparse_mla_prefill_paged_window(
        backend: str, q: torch.Tensor, kv: torch.Tensor, window_rows: torch.Tensor,
        query_start_loc: torch.Tensor, topk_cache: torch.Tensor, topk_slots: torch.Tensor,
        topk_lens: Optional[torch.Tensor], attn_sink: Optional[torch.Tensor],
        softmax_scale: Optional[float], out: torch.Tensor, lse: torch.Tensor) -> None:
    o, l = get_backend(backend).sparse_mla_prefill_paged_window(
        q, kv, window_rows, query_start_loc, topk_cache, topk_slots, topk_lens,
        attn_sink=attn_sink, softmax_scale=softmax_scale, out=out)
    _fill(out, o)
    lse.copy_(l)


@backend_sparse_mla_prefill_paged_window.register_fake
def _(backend, q, kv, window_rows, query_start_loc, topk_cache, topk_slots, topk_lens,
      attn_sink, softmax_scale, out, lse) -> None:
    return None


@torch.library.custom_op("dsv41::backend_sparse_mla_decode_fused",
                         mutates_args=("data", "scale", "lse"))
def backend_sparse_mla_decode_fused(
        backend: str, q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
        swa_cache: torch.Tensor, swa_indices: torch.Tensor, swa_lens: Optional[torch.Tensor],
        extra_cache: Optional[torch.Tensor], extra_indices: Optional[torch.Tensor],
        extra_lens: Optional[torch.Tensor], attn_sink: Optional[torch.Tensor],
        softmax_scale: Optional[float], q_norm_eps: Optional[float], layout: str,
        data: torch.Tensor, scale: torch.Tensor, lse: torch.Tensor) -> None:
    d, s, l = get_backend(backend).sparse_mla_decode_fused(
        q, positions, cos_sin_cache, swa_cache, swa_indices, swa_lens, extra_cache,
        extra_indices, extra_lens, attn_sink=attn_sink, softmax_scale=softmax_scale,
        q_norm_eps=q_norm_eps, layout=layout, data=data, scale=scale)
    _fill(data, d)
    _fill(scale, s)
    lse.copy_(l)


@backend_sparse_mla_decode_fused.register_fake
def _(backend, q, positions, cos_sin_cache, swa_cache, swa_indices, swa_lens, extra_cache,
      extra_indices, extra_lens, attn_sink, softmax_scale, q_norm_eps, layout, data, scale,
      lse) -> None:
    return None


@torch.library.custom_op("dsv41::backend_sparse_mla_prefill_fused",
                         mutates_args=("data", "scale", "lse"))
def backend_sparse_mla_prefill_fused(
        backend: str, q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
        kv: torch.Tensor, indices: torch.Tensor, lens: Optional[torch.Tensor],
        attn_sink: Optional[torch.Tensor], softmax_scale: Optional[float],
        q_norm_eps: Optional[float], layout: str, data: torch.Tensor, scale: torch.Tensor,
        lse: torch.Tensor) -> None:
    d, s, l = get_backend(backend).sparse_mla_prefill_fused(
        q, positions, cos_sin_cache, kv, indices, lens, attn_sink=attn_sink,
        softmax_scale=softmax_scale, q_norm_eps=q_norm_eps, layout=layout, data=data,
        scale=scale)
    _fill(data, d)
    _fill(scale, s)
    lse.copy_(l)


@backend_sparse_mla_prefill_fused.register_fake
def _(backend, q, positions, cos_sin_cache, kv, indices, lens, attn_sink, softmax_scale,
      q_norm_eps, layout, data, scale, lse) -> None:
    return None
