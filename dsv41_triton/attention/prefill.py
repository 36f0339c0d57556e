"""Sparse MLA prefill over a gathered bf16 workspace (SPEC §3, §6).

The same Triton kernel as decode (``_sparse_kernel.py``) with bf16 rows as the key source:
``indices`` are rows of ``kv``; an index ``< 0`` or ``>= S`` is skipped.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._contract import HEAD_DIM, check_prefill_args, new_outputs
from .._utils import call_op, use_reference
from ._kernels import SRC_BF16, KernelConfig, KeySet, launch
from ._sparse_kernel import _sparse_mla_fwd_grouped_kernel


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
    _kernel: Optional[str] = None,
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
        give 0 and +inf; other edge cases as :func:`sparse_mla_decode`).

    The ``torch.library`` op ``dsv41::sparse_mla_prefill``; CPU tensors run the reference
    when the kernels are not in the Triton interpreter. On sm_90 the Gluon kernel
    (``attention/gluon/prefill.py``) runs the head counts where it measured faster;
    ``_kernel='tl'`` / ``'gluon'`` pins one (tests and benchmarks).
    """
    args = check_prefill_args(q, kv, indices, lens, attn_sink, softmax_scale, out)
    if _kernel not in (None, "tl", "gluon"):
        raise ValueError(f"_kernel: expected None, 'tl' or 'gluon', got {_kernel!r}")
    out, lse = new_outputs(q, out)
    if _config is not None or _kernel is not None:  # pinned by a test/benchmark: no op boundary
        _prefill_impl(q, kv, indices, lens, attn_sink, args.scale, out, lse, _config, _kernel)
    else:
        call_op(_prefill_op, q, kv, indices, lens, attn_sink, args.scale, out,
                                           lse)
    return out, lse


def _prefill_impl(q, kv, indices, lens, attn_sink, scale, out, lse, config=None,
                  kernel=None) -> None:
    if kernel != "gluon" and use_reference(q.device, _sparse_mla_fwd_grouped_kernel):
        from .ref import sparse_mla_prefill_ref

        o, l = sparse_mla_prefill_ref(q, kv, indices, lens, attn_sink, scale)
        out.copy_(o)
        lse.copy_(l)
        return
    kv2 = kv[:, 0, :] if kv.dim() == 3 else kv
    idx2 = indices[:, 0, :] if indices.dim() == 3 else indices
    if config is None and kernel != "tl":
        from .gluon import prefill_launch as gluon_launch

        ok = gluon_launch.usable(q, kv2, idx2)
        if kernel == "gluon" and not ok:
            raise ValueError("_kernel: 'gluon' needs an sm_90 GPU, a Triton with Gluon and "
                             "16-byte aligned q / workspace rows")
        if ok and (kernel == "gluon" or gluon_launch.pick(q.shape[0], q.shape[1], q.device, idx2)):
            gluon_launch.launch(q, kv2, idx2, lens, attn_sink, scale, out, lse)
            return
    S = kv2.shape[0]
    row_stride = kv2.stride(0) if S > 1 else HEAD_DIM
    a = KeySet(src=SRC_BF16, k=kv2, indices=idx2, lens=lens, bstride=row_stride, page=1,
               rows=S)
    launch(q, a, None, attn_sink, scale, out, lse, config)


@torch.library.custom_op("dsv41::sparse_mla_prefill", mutates_args=("out", "lse"))
def _prefill_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                lens: Optional[torch.Tensor], attn_sink: Optional[torch.Tensor],
                softmax_scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    _prefill_impl(q, kv, indices, lens, attn_sink, softmax_scale, out, lse)


@_prefill_op.register_fake
def _prefill_fake(q, kv, indices, lens, attn_sink, softmax_scale, out, lse) -> None:
    return None


__all__ = ["sparse_mla_prefill"]
