"""Plain PyTorch reference of the MXFP8 output of the fused contract (SPEC §6).

``data [T, G, 4096]`` float8_e4m3fn and ``scale [T, G, 32]`` int32: per 32-element chunk,
``amax = max(max|x|, 1e-10)``, ``e = ceil(log2(amax / 448))`` (UE8M0 byte ``e + 127``),
values ``clamp(x * 2**-e, -448, 448)`` rounded to nearest even e4m3; each int32 of ``scale``
packs the bytes of 4 consecutive chunks, the lowest chunk in the lowest byte. The references
return a contiguous ``scale``; the MN-major strides are the Triton side's business.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .._utils import HEAD_DIM, NOPE_DIM
from .layouts import GROUP_WIDTH, output_to_groups
from .records import UE8M0_BIAS, dequantize_ue8m0_groups, quantize_ue8m0_groups
from .rope_ref import rope_cos_sin_ref, rope_rotate_ref

MXFP8_CHUNK = 32
MXFP8_AMAX_FLOOR = 1e-10
SCALE_WORDS = GROUP_WIDTH // MXFP8_CHUNK // 4  # 32 int32 per group row


def pack_ue8m0_words(scale_bytes: torch.Tensor) -> torch.Tensor:
    """``[..., 4n]`` uint8 -> ``[..., n]`` int32, byte ``k`` of word ``w`` = ``scale_bytes[4w + k]``."""
    b = scale_bytes.to(torch.int64).unflatten(-1, (-1, 4))
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_ue8m0_words(words: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` int32 -> ``[..., 4n]`` uint8 (inverse of :func:`pack_ue8m0_words`)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    b = torch.stack([(w >> (8 * k)) & 0xFF for k in range(4)], -1)
    return b.flatten(-2).to(torch.uint8)


def mxfp8_quantize_ref(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [T, G, 4096]`` (any float dtype) -> ``(data [T, G, 4096] float8_e4m3fn,
    scale [T, G, 32] int32)``, both contiguous, bit-exact to the rule above."""
    assert x.shape[-1] == GROUP_WIDTH
    q, sb = quantize_ue8m0_groups(x.float(), MXFP8_CHUNK, MXFP8_AMAX_FLOOR)
    return q, pack_ue8m0_words(sb)


def mxfp8_dequantize_ref(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``e4m3 * 2**(byte - 127)`` for ``data [..., 4096]``, ``scale [..., 32]`` int32
    (any strides)."""
    sb = unpack_ue8m0_words(scale)
    return dequantize_ue8m0_groups(data.contiguous(), sb, MXFP8_CHUNK)


def rope_mxfp8_epilogue_ref(
    o: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str = "standard",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``o [T, H, 512]`` -> inverse RoPE on dims 448..511 at each token's position (fp32, as
    ``a*cos + b*sin``, ``b*cos - a*sin``) -> ``[T, H/8, 4096]`` in ``layout`` -> MXFP8
    ``(data, scale)`` (contiguous)."""
    assert o.shape[-1] == HEAD_DIM
    x = o.float().clone()
    cos, sin = rope_cos_sin_ref(positions, cos_sin_cache, torch.float32)
    x[..., NOPE_DIM:] = rope_rotate_ref(
        x[..., NOPE_DIM:], cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True
    )
    return mxfp8_quantize_ref(output_to_groups(x, layout))


__all__ = [
    "MXFP8_AMAX_FLOOR",
    "MXFP8_CHUNK",
    "SCALE_WORDS",
    "UE8M0_BIAS",
    "mxfp8_dequantize_ref",
    "mxfp8_quantize_ref",
    "pack_ue8m0_words",
    "rope_mxfp8_epilogue_ref",
    "unpack_ue8m0_words",
]
