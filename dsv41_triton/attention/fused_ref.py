"""Float64 PyTorch reference of the fused ("mega") contract (SPEC §2, §3, §6), built on the
other references:

    q (layout) -> standard -> RoPE of dims 448..511 at token_positions -> bf16
               -> attention with sink, logits sm_scale * r * <q_rot, k>         (ref.py)
                  (r = rsqrt(sum(q**2) / 512 + eps) per (token, head) of the un-rotated q
                  with enable_q_norm, else 1)
               -> inverse RoPE of the output's dims 448..511
               -> output groups [T, H/8, 4096] in layout -> MXFP8 (data, scale)

Everything is float64 except two roundings: the rotated q is rounded to bf16 (the attention's
input precision; FlashMLA's own oracle does the same), and the MXFP8 cast (the exact rule of
:mod:`dsv41_triton.ops.mxfp8_ref`, applied to the fp32 value of the float64 output).

``bf16_steps=True`` models the Triton path instead, whose attention takes and returns bf16:
the norm factor is folded into q before its one bf16 rounding (``bf16(rope(q) * r)``, so with
the norm on all 512 dims are rounded, which moves ``lse`` by up to a few 1e-3 on unit-scale
data), and the attention output is rounded to bf16 before the epilogue (rms ~2e-3 relative,
which flips ~2% of the e4m3 codes by one step: ~1.5% relative between dequantized pairs).

Arguments mirror :mod:`dsv41_triton.attention.fused` (same names and order; the fixed
FlashMLA flags and the output buffers are left out). The references also return the float64
output after the inverse RoPE (standard ``[T, H, 512]``), so tests can look at the
unquantized values.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._utils import HEAD_DIM
from ..ops.layouts import output_to_groups, q_from_interleaved
from ..ops.mxfp8_ref import mxfp8_quantize_ref
from ..ops.rope_ref import apply_rope_ref
from .ref import sparse_mla_decode_ref, sparse_mla_prefill_ref

DEFAULT_LAYOUT = "interleaved"
DEFAULT_RMS_NORM_EPS = 1e-6


def q_rms_factor_ref(q_std: torch.Tensor, rms_norm_eps: float,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[T, H]``: ``rsqrt(sum(q**2) / 512 + eps)`` of every (token, head) row of a standard
    q (over all 512 dims, before RoPE)."""
    x = q_std.to(dtype)
    return torch.rsqrt((x * x).sum(-1) / HEAD_DIM + rms_norm_eps)


def q_norm_rope_ref(
    q: torch.Tensor,
    token_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str,
    enable_q_norm: bool = False,
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference of :func:`dsv41_triton.attention.fused.q_norm_rope`, unrounded: standard
    ``[T, H, 512]`` in ``dtype`` = ``rope(q_std) * r`` (``r = 1`` without the norm)."""
    qs = q_from_interleaved(q) if layout == "interleaved" else q
    x = apply_rope_ref(qs, token_positions, cos_sin_cache, compute_dtype=dtype, out_dtype=dtype)
    if enable_q_norm:
        x = x * q_rms_factor_ref(qs, rms_norm_eps, dtype)[..., None]
    return x


def fused_epilogue_ref(
    o: torch.Tensor, token_positions: torch.Tensor, cos_sin_cache: torch.Tensor, layout: str
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``o [T, H, 512]`` -> inverse RoPE in float64 -> ``(data, scale, o_rot)``: the MXFP8
    pair of the output groups in ``layout`` (contiguous ``scale``) and the float64 rotated
    output (standard layout)."""
    o_rot = apply_rope_ref(o.double(), token_positions, cos_sin_cache, inverse=True,
                           compute_dtype=torch.float64, out_dtype=torch.float64)
    data, scale = mxfp8_quantize_ref(output_to_groups(o_rot, layout))
    return data, scale, o_rot


def _q(q, token_positions, cos_sin_cache, layout, enable_q_norm, rms_norm_eps, bf16_steps):
    """The q the attention sees, float64 ``[T, H, 512]`` (see the module doc)."""
    if bf16_steps:
        return _bf16(q_norm_rope_ref(q, token_positions, cos_sin_cache, layout, enable_q_norm,
                                     rms_norm_eps))
    qs = q_from_interleaved(q) if layout == "interleaved" else q
    x = _bf16(q_norm_rope_ref(qs, token_positions, cos_sin_cache, "standard"))
    if enable_q_norm:  # scaling q by r in float64 == scaling the logits by r
        x = x * q_rms_factor_ref(qs, rms_norm_eps)[..., None]
    return x


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16 (through fp32, as the kernels round fp32 values) -> float64."""
    return x.float().to(torch.bfloat16).double()


def _sm(sm_scale: Optional[float]) -> float:
    return HEAD_DIM ** -0.5 if sm_scale is None else float(sm_scale)


def sparse_mla_decode_fused_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: Optional[float] = None,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_kv: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    enable_q_norm: bool = False,
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS,
    token_positions: Optional[torch.Tensor] = None,
    cos_sin_cache: Optional[torch.Tensor] = None,
    *,
    layout: str = DEFAULT_LAYOUT,
    bf16_steps: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of :func:`~dsv41_triton.attention.fused.sparse_mla_decode_fused`
    (``bf16_steps``: model the Triton path's roundings, see the module doc).

    Returns ``(data, scale, lse, out)``: the MXFP8 pair (contiguous ``scale``), ``lse [T, H]``
    float64 and the float64 output after the inverse RoPE, standard ``[T, H, 512]``.
    """
    qr = _q(q, token_positions, cos_sin_cache, layout, enable_q_norm, rms_norm_eps, bf16_steps)
    o, lse = sparse_mla_decode_ref(qr, kv, indices, topk_length, extra_kv, extra_indices,
                                   extra_topk_length, attn_sink=attn_sink,
                                   softmax_scale=_sm(sm_scale))
    if bf16_steps:
        o = _bf16(o)
    data, scale, o_rot = fused_epilogue_ref(o, token_positions, cos_sin_cache, layout)
    return data, scale, lse, o_rot


def sparse_mla_prefill_fused_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: Optional[float] = None,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    enable_q_norm: bool = False,
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS,
    token_positions: Optional[torch.Tensor] = None,
    cos_sin_cache: Optional[torch.Tensor] = None,
    *,
    layout: str = DEFAULT_LAYOUT,
    bf16_steps: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of :func:`~dsv41_triton.attention.fused.sparse_mla_prefill_fused`
    (``bf16_steps`` as for decode).

    Returns ``(data, scale, max_logits, lse, out)``; ``max_logits [T, H]`` float64 is the
    largest scaled logit ``sm_scale * r * <q_rot, k>`` over the valid keys (``-inf`` for a
    token without keys), which FlashMLA's prefill returns (the Triton path does not).
    """
    qr = _q(q, token_positions, cos_sin_cache, layout, enable_q_norm, rms_norm_eps, bf16_steps)
    sm = _sm(sm_scale)
    o, lse = sparse_mla_prefill_ref(qr, kv, indices, topk_length, attn_sink=attn_sink,
                                    softmax_scale=sm)
    max_logits = _max_logits_ref(qr, kv, indices, topk_length, sm)
    if bf16_steps:
        o = _bf16(o)
    data, scale, o_rot = fused_epilogue_ref(o, token_positions, cos_sin_cache, layout)
    return data, scale, max_logits, lse, o_rot


def _max_logits_ref(qr, kv, indices, lens, sm: float) -> torch.Tensor:
    kv2 = kv.reshape(kv.shape[0], HEAD_DIM)
    idx = indices.reshape(indices.shape[0], indices.shape[-1]).long()
    T, K = idx.shape
    S = kv2.shape[0]
    valid = (idx >= 0) & (idx < S)
    if lens is not None:
        valid &= torch.arange(K, device=idx.device)[None, :] < lens.long()[:, None]
    out = torch.full(qr.shape[:2], float("-inf"), dtype=torch.float64, device=qr.device)
    if S == 0 or K == 0:
        return out
    for t in range(T):
        cols = idx[t][valid[t]]
        if cols.numel():
            z = qr[t] @ kv2[cols].double().T * sm  # [H, n]
            out[t] = z.amax(-1)
    return out


__all__ = [
    "fused_epilogue_ref",
    "q_norm_rope_ref",
    "q_rms_factor_ref",
    "sparse_mla_decode_fused_ref",
    "sparse_mla_prefill_fused_ref",
]
