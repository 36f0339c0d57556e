"""The fused ("mega") contract built from separate steps, for backends without a fused kernel.

``q`` (standard or interleaved layout, NOT RoPE'd) -> optional per-head Q RMSNorm -> RoPE at
``positions`` -> the backend's bf16 sparse attention -> inverse RoPE + MXFP8 cast into the
``(data, scale)`` pair (SPEC §6). ``impl`` selects the step implementations: ``"triton"`` (the
project's kernels) or ``"torch"`` (the references).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .._contract import WV_GROUP_SIZE, check_fused_common  # noqa: F401 (re-exported)


def q_to_standard(q: torch.Tensor, layout: str) -> torch.Tensor:
    """``q [T, H, 512]`` in ``layout`` -> standard (head-major) ``[T, H, 512]``."""
    if layout == "standard":
        return q
    from ..ops import layouts

    return layouts.q_from_interleaved(q)


def q_head_rmsnorm(q: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm without weight (fp32 math, bf16 out)."""
    qf = q.float()
    return (qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + eps)).to(q.dtype)


def fused_via_steps(
    attn: Callable[[torch.Tensor], Tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_eps: Optional[float],
    layout: str,
    data: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    impl: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run ``attn(q_roped_standard) -> (out bf16 [T, H, 512], lse)`` between the fused
    contract's prologue and epilogue; return ``(data, scale, lse)``."""
    T, H = check_fused_common(q, positions, cos_sin_cache, layout, q_norm_eps)
    if data is not None or scale is not None:  # the missing half is allocated
        from ..attention.fused import check_fused_output

        data, scale = check_fused_output(data, scale, T, H // WV_GROUP_SIZE, q.device)
    qs = q_to_standard(q, layout)
    if q_norm_eps is not None:
        qs = q_head_rmsnorm(qs, q_norm_eps)
    if impl == "triton":
        from ..ops.mxfp8 import rope_mxfp8_epilogue
        from ..ops.rope import apply_rope

        q_roped = apply_rope(qs, positions, cos_sin_cache)
        out, lse = attn(q_roped)
        data, scale = rope_mxfp8_epilogue(out, positions, cos_sin_cache, layout=layout,
                                          data=data, scale=scale)
    else:
        from ..ops.mxfp8_ref import rope_mxfp8_epilogue_ref
        from ..ops.rope_ref import apply_rope_ref

        q_roped = apply_rope_ref(qs, positions, cos_sin_cache)
        out, lse = attn(q_roped)
        d, s = rope_mxfp8_epilogue_ref(out, positions, cos_sin_cache, layout=layout)
        if data is None:
            from ..ops.mxfp8 import alloc_mxfp8_output

            data, scale = alloc_mxfp8_output(T, H // WV_GROUP_SIZE, q.device)
        data.copy_(d)
        scale.copy_(s)
    return data, scale, lse


class ComposedFusedMixin:
    """The fused entry points of a backend that has only bf16 attention: its own
    ``sparse_mla_decode`` / ``sparse_mla_prefill`` between the prologue and the epilogue of
    :func:`fused_via_steps`, implemented by ``fused_steps_impl`` ("triton" or "torch")."""

    fused_steps_impl = "triton"

    def sparse_mla_decode_fused(self, q, positions, cos_sin_cache, swa_cache, swa_indices,
                                swa_lens, extra_cache=None, extra_indices=None, extra_lens=None,
                                attn_sink=None, softmax_scale=None, q_norm_eps=None,
                                layout="standard", data=None, scale=None):
        def attn(qr):
            return self.sparse_mla_decode(qr, swa_cache, swa_indices, swa_lens, extra_cache,
                                          extra_indices, extra_lens, attn_sink, softmax_scale)

        return fused_via_steps(attn, q, positions, cos_sin_cache, q_norm_eps, layout, data,
                               scale, impl=self.fused_steps_impl)

    def sparse_mla_prefill_fused(self, q, positions, cos_sin_cache, kv, indices, lens=None,
                                 attn_sink=None, softmax_scale=None, q_norm_eps=None,
                                 layout="standard", data=None, scale=None):
        def attn(qr):
            return self.sparse_mla_prefill(qr, kv, indices, lens, attn_sink, softmax_scale)

        return fused_via_steps(attn, q, positions, cos_sin_cache, q_norm_eps, layout, data,
                               scale, impl=self.fused_steps_impl)
