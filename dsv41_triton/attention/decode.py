"""Sparse MLA decode over paged record caches (SPEC §3, §6), one Triton launch (+ a merge
launch when the keys are split across programs).

The records are dequantized inside the attention kernel; the window keys and the extra
(compressed / top-k) keys share one online softmax; the sink only enters the denominator.
Fixed shapes in, fixed shapes out, no host sync: safe to capture in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._utils import check_same_device
from ..ops.records import check_k_cache
from ._kernels import (KernelConfig, KeySet, check_common, check_indices, check_lens, launch,
                       new_outputs)

#: record widths accepted for each cache (SPEC §4: nvfp4 is for the compressed cache only)
SWA_RECORDS = (584, 528)
EXTRA_RECORDS = (584, 528, 288)


def _keyset(name: str, cache, indices, lens, allowed, T: int, idx_name: str, len_name: str):
    fmt, c3 = check_k_cache(name, cache)
    if fmt.record_bytes not in allowed:
        raise ValueError(f"{name}: expected a record width in {allowed}, got "
                         f"{fmt.record_bytes} ({fmt.name})")
    check_indices(idx_name, indices, T)
    check_lens(len_name, lens, T)
    nb, page = int(c3.shape[0]), int(c3.shape[1])
    bstride = int(c3.stride(0)) if nb > 1 else page * fmt.record_bytes
    return KeySet(src=fmt.record_bytes, k=c3, indices=indices, lens=lens, bstride=bstride,
                  page=page, rows=nb * page)


def sparse_mla_decode(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: Optional[torch.Tensor],
    extra_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_lens: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    *,
    _config: Optional[KernelConfig] = None,
    _kernel: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode with a sink over one or two paged caches.

    Args:
        q: ``[T, H, 512]`` bf16, RoPE'd (any ``H >= 1``; last dim contiguous).
        swa_cache: window cache, uint8 ``[num_blocks, page, 584|528]`` (or ``[nb, page, 1, b]``).
        swa_indices: ``[T, Ws]`` int32 slot ids (``block * page + offset``); ``< 0`` skipped.
        swa_lens: ``[T]`` int32, columns read per row (None = all ``Ws``).
        extra_cache: optional compressed cache, ``584|528|288`` records.
        extra_indices: ``[T, K]`` int32 slot ids into ``extra_cache`` (needed with it).
        extra_lens: ``[T]`` int32 or None (all ``K``).
        attn_sink: ``[H]`` fp32 or None; ``-inf`` = no sink.
        softmax_scale: default ``512 ** -0.5``.
        out: optional ``[T, H, 512]`` bf16 output (any strides, last dim contiguous).

    ``_kernel``: ``"tl"`` or ``"gluon"`` forces a kernel family (``"gluon"`` raises
    ``ValueError`` where it cannot run); None picks: the Gluon Hopper kernel
    (``attention/gluon``) on sm_90 for the shapes where it measured faster, else ``tl``.

    Returns:
        ``(out [T, H, 512] bf16, lse [T, H] fp32)``; ``lse`` is the natural log-sum-exp of the
        scaled logits without the sink; a token with no valid key gets ``out = 0``,
        ``lse = +inf``. Slot ids past the end of a cache are skipped too.
    """
    T, H, scale = check_common(q, attn_sink, softmax_scale, out, "decode")
    a = _keyset("swa_cache", swa_cache, swa_indices, swa_lens, SWA_RECORDS, T,
                "swa_indices", "swa_lens")
    b = None
    if extra_cache is not None or extra_indices is not None or extra_lens is not None:
        if extra_cache is None:
            raise ValueError("extra_cache: required when extra_indices/extra_lens are given")
        if extra_indices is None:
            raise ValueError("extra_indices: required when extra_cache is given")
        b = _keyset("extra_cache", extra_cache, extra_indices, extra_lens, EXTRA_RECORDS, T,
                    "extra_indices", "extra_lens")
    check_same_device(q=q, swa_cache=swa_cache, swa_indices=swa_indices, swa_lens=swa_lens,
                      extra_cache=extra_cache, extra_indices=extra_indices,
                      extra_lens=extra_lens, attn_sink=attn_sink, out=out)
    if _kernel not in (None, "tl", "gluon"):
        raise ValueError(f"_kernel: expected None, 'tl' or 'gluon', got {_kernel!r}")
    use_gluon = False
    if _config is None and _kernel != "tl":
        from .gluon import launch as gluon_launch
        ok = gluon_launch.usable(q, a, b)
        if _kernel == "gluon" and not ok:
            raise ValueError("_kernel: 'gluon' needs an sm_90 GPU, a Triton with Gluon and "
                             "16-byte aligned caches/block strides")
        use_gluon = ok and (_kernel == "gluon" or gluon_launch.pick(q.shape[0], q.shape[1], a,
                                                                      b, q.device))
    out, lse = new_outputs(q, out)
    if use_gluon:
        gluon_launch.launch(q, a, b, attn_sink, scale, out, lse)
    else:
        launch(q, a, b, attn_sink, scale, out, lse, _config)
    return out, lse


__all__ = ["sparse_mla_decode"]
