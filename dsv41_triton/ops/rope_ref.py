"""Plain PyTorch reference for the GPT-J (interleaved) RoPE of SPEC §2.

Pair ``i < 32`` is ``(x[448 + 2i], x[448 + 2i + 1])``; ``cos_sin_cache`` is fp32
``[max_pos, 64]`` with ``cos`` in columns 0..31 and ``sin`` in 32..63, row = position.
Forward ``(a, b) -> (a*cos - b*sin, b*cos + a*sin)``; inverse uses ``-sin``.

A position outside ``[0, max_pos)`` is not rotated (identity), which is what the Triton
kernels do rather than read outside the cache.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._utils import HEAD_DIM, NOPE_DIM, ROPE_DIM

HALF = ROPE_DIM // 2  # 32 pairs


def rope_cos_sin_ref(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype = torch.float32
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[*positions.shape, 32]`` in ``dtype``; out-of-range positions
    give ``cos = 1, sin = 0``."""
    max_pos = cos_sin_cache.shape[0]
    pos = positions.long()
    ok = (pos >= 0) & (pos < max_pos)
    rows = cos_sin_cache[pos.clamp(0, max(max_pos - 1, 0))].to(dtype)
    cos = torch.where(ok.unsqueeze(-1), rows[..., :HALF], torch.ones_like(rows[..., :HALF]))
    sin = torch.where(ok.unsqueeze(-1), rows[..., HALF:], torch.zeros_like(rows[..., HALF:]))
    return cos, sin


def rope_rotate_ref(
    x_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate interleaved pairs of ``x_rope [..., 64]`` (float) with ``cos``/``sin``
    broadcastable to ``[..., 32]``; computed in ``x_rope.dtype`` as ``a*cos - b*sin`` and
    ``b*cos + a*sin`` (separately rounded products, like the kernels in the interpreter)."""
    a, b = x_rope[..., 0::2], x_rope[..., 1::2]
    if inverse:
        a2, b2 = a * cos + b * sin, b * cos - a * sin
    else:
        a2, b2 = a * cos - b * sin, b * cos + a * sin
    return torch.stack([a2, b2], -1).flatten(-2)


def apply_rope_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    inverse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Reference of :func:`dsv41_triton.ops.rope.apply_rope`.

    ``x [T, H, 512]``, ``positions [T]`` -> ``[T, H, 512]`` in ``out_dtype`` (default
    ``x.dtype``): dims 0..447 copied, dims 448..511 rotated at each token's position in
    ``compute_dtype`` (fp32 or fp64), then rounded once to the output dtype.
    """
    assert x.shape[-1] == HEAD_DIM
    out_dtype = x.dtype if out_dtype is None else out_dtype
    cos, sin = rope_cos_sin_ref(positions, cos_sin_cache, compute_dtype)
    rot = rope_rotate_ref(
        x[..., NOPE_DIM:].to(compute_dtype), cos.unsqueeze(-2), sin.unsqueeze(-2), inverse
    )
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out[..., :NOPE_DIM] = x[..., :NOPE_DIM].to(out_dtype)
    out[..., NOPE_DIM:] = rot.to(out_dtype)
    return out


def make_cos_sin_cache(
    max_pos: int, base: float = 10000.0, device="cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A standard ``[max_pos, 64]`` cache (``cos | sin`` of ``pos * base**(-2i/64)``), for
    tests and benchmarks."""
    inv_freq = base ** (-torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).to(dtype).to(device)
