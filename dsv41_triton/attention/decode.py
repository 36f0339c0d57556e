"""Sparse MLA decode over paged record caches (SPEC §3, §6), one Triton launch (+ a merge
launch when the keys are split across programs).

The records are dequantized inside the attention kernel; the window keys and the extra
(compressed / top-k) keys share one online softmax; the sink only enters the denominator.
Fixed shapes in, fixed shapes out, no host sync: safe to capture in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._contract import EXTRA_RECORDS, SWA_RECORDS, check_decode_args, new_outputs
from .._utils import call_op, use_reference
from ._kernels import KernelConfig, KeySet, launch
from ._sparse_kernel import _sparse_mla_fwd_grouped_kernel


def _keyset(cache, indices, lens) -> KeySet:
    """A checked cache (3-D or 4-D), its slot ids and lens -> the kernel's key source."""
    c3 = cache.squeeze(2) if cache.dim() == 4 else cache
    nb, page, rb = c3.shape
    bstride = c3.stride(0) if nb > 1 else page * rb
    return KeySet(src=rb, k=c3, indices=indices, lens=lens, bstride=bstride, page=page,
                  rows=nb * page)


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

    Returns:
        ``(out [T, H, 512] bf16, lse [T, H] fp32)``; ``lse`` is the natural log-sum-exp of the
        scaled logits without the sink; a token with no valid key gets ``out = 0``,
        ``lse = +inf``. Slot ids past the end of a cache are skipped too. Lens are clamped
        to ``[0, width]``; NaN in ``q`` or a key propagates to ``out`` and ``lse``; ``T = 0``
        and width 0 are fine; ``H = 0`` is a ValueError (docs/semantics.md).

    The ``torch.library`` op ``dsv41::sparse_mla_decode`` (fills ``out`` and ``lse``); CPU
    tensors run the float64 reference when the kernels are not in the Triton interpreter.
    On sm_90 the Gluon kernel (``attention/gluon``) runs the shapes where it measured faster;
    ``_kernel='tl'`` / ``'gluon'`` pins one (tests and benchmarks).
    """
    args = check_decode_args(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                             extra_lens, attn_sink, softmax_scale, out)
    if _kernel not in (None, "tl", "gluon"):
        raise ValueError(f"_kernel: expected None, 'tl' or 'gluon', got {_kernel!r}")
    out, lse = new_outputs(q, out)
    if _config is not None or _kernel is not None:  # pinned by a test/benchmark: no op boundary
        _decode_impl(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                     extra_lens, attn_sink, args.scale, out, lse, _config, _kernel)
    else:
        call_op(_decode_op, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                extra_lens, attn_sink, args.scale, out, lse)
    return out, lse


def _decode_impl(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                 attn_sink, scale, out, lse, config=None, kernel=None) -> None:
    if kernel != "gluon" and use_reference(q.device, _sparse_mla_fwd_grouped_kernel):
        from .ref import sparse_mla_decode_ref

        o, l = sparse_mla_decode_ref(q, swa_cache, swa_indices, swa_lens, extra_cache,
                                     extra_indices, extra_lens, attn_sink, scale)
        out.copy_(o)
        lse.copy_(l)
        return
    a = _keyset(swa_cache, swa_indices, swa_lens)
    b = None if extra_cache is None else _keyset(extra_cache, extra_indices, extra_lens)
    if config is None and kernel != "tl":
        from .gluon import launch as gluon_launch

        ok = gluon_launch.usable(q, a, b)
        if kernel == "gluon" and not ok:
            raise ValueError("_kernel: 'gluon' needs an sm_90 GPU, a Triton with Gluon and "
                             "16-byte aligned caches/block strides")
        if ok and (kernel == "gluon" or gluon_launch.pick(q.shape[0], q.shape[1], a, b,
                                                          q.device)):
            gluon_launch.launch(q, a, b, attn_sink, scale, out, lse)
            return
    launch(q, a, b, attn_sink, scale, out, lse, config)


@torch.library.custom_op("dsv41::sparse_mla_decode", mutates_args=("out", "lse"))
def _decode_op(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
               swa_lens: Optional[torch.Tensor], extra_cache: Optional[torch.Tensor],
               extra_indices: Optional[torch.Tensor], extra_lens: Optional[torch.Tensor],
               attn_sink: Optional[torch.Tensor], softmax_scale: float, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    _decode_impl(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                 attn_sink, softmax_scale, out, lse)


@_decode_op.register_fake
def _decode_fake(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                 attn_sink, softmax_scale, out, lse) -> None:
    return None


__all__ = ["sparse_mla_decode", "SWA_RECORDS", "EXTRA_RECORDS"]
