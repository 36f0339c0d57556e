"""GPT-J (interleaved) RoPE on dims 448..511 (SPEC §2): Triton jit helpers for use inside
other kernels, and the standalone :func:`apply_rope`.

Reference: :mod:`dsv41_triton.ops.rope_ref`.

Jit helpers (import them into a kernel module and call them from ``@triton.jit`` code):

* ``rope_cos_sin(row_ptr, i, mask)`` -> ``(cos, sin)`` fp32 tiles: ``row_ptr`` points at the
  cache row of the position (``cos_sin_cache + pos * stride``, scalar or a tile broadcastable
  against ``i``), ``i`` is a tile of pair indices in ``[0, 32)``; masked-off lanes give
  ``cos = 1, sin = 0`` (no rotation).
* ``rope_pair(a, b, cos, sin, INVERSE)`` -> ``(a', b')``: rotate the (even, odd) pair tiles.
* ``rope_interleaved(x, cos, sin, INVERSE)`` -> ``x'``: rotate a ``[BM, 64]`` fp32 tile that
  holds dims 448..511 in their natural (interleaved) order; ``cos``/``sin`` broadcast to
  ``[BM, 32]``.
* ``rope_elementwise(x, partner, cos, sin, is_odd, INVERSE)``: the same rotation written per
  element, for tiles where element ``d``'s partner ``d ^ 1`` was loaded separately.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._utils import (
    call_op,
    HEAD_DIM,
    INT_DTYPES,
    ROPE_DIM,
    check_same_device,
    check_shape,
    check_tensor,
    is_interpreter,
    next_power_of_2,
    use_reference,
)
from ._codecs import f32_to_bf16
from .rope_ref import apply_rope_ref

ROPE_HALF = ROPE_DIM // 2  # 32 pairs
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# jit helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def rope_cos_sin(row_ptr, i, mask):
    """Load ``cos = row[i]``, ``sin = row[32 + i]`` (fp32); masked lanes: ``cos 1, sin 0``."""
    # a comparison (not `mask & tile`) so a scalar mask broadcasts to a bool tile: the
    # interpreter turns `scalar_bool & bool_tile` into an int tile that tl.load rejects
    m = tl.where(mask, i, 32) < 32
    cos = tl.load(row_ptr + i, mask=m, other=1.0).to(tl.float32)
    sin = tl.load(row_ptr + 32 + i, mask=m, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rope_pair(a, b, cos, sin, INVERSE: tl.constexpr):
    """Forward ``(a*cos - b*sin, b*cos + a*sin)``; inverse ``(a*cos + b*sin, b*cos - a*sin)``."""
    if INVERSE:
        return a * cos + b * sin, b * cos - a * sin
    else:
        return a * cos - b * sin, b * cos + a * sin


@triton.jit
def rope_interleaved(x, cos, sin, INVERSE: tl.constexpr):
    """Rotate ``x [BM, 64]`` (fp32, dims 448..511 in order) with ``cos``/``sin`` -> ``[BM, 32]``."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], 32, 2)))
    a2, b2 = rope_pair(a, b, cos, sin, INVERSE)
    return tl.reshape(tl.join(a2, b2), (x.shape[0], 64))


@triton.jit
def rope_elementwise(x, partner, cos, sin, is_odd, INVERSE: tl.constexpr):
    """Per-element rotation: ``x`` is element ``d``, ``partner`` element ``d ^ 1``, ``cos``/``sin``
    those of pair ``d // 2``; the same products and sums as :func:`rope_pair`."""
    if INVERSE:
        return tl.where(is_odd, x * cos - partner * sin, x * cos + partner * sin)
    else:
        return tl.where(is_odd, x * cos + partner * sin, x * cos - partner * sin)


@triton.jit
def _store_cast(ptr, v, mask, OUT_BF16: tl.constexpr, SW: tl.constexpr):
    if OUT_BF16:
        tl.store(ptr, f32_to_bf16(v, SW), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _apply_rope_kernel(
    x_ptr, out_ptr, pos_ptr, cs_ptr,
    H, max_pos,
    sx_t, sx_h, so_t, so_h, s_cs,
    INVERSE: tl.constexpr,
    COPY_NOPE: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SW: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = (h < H)[:, None]
    x_row = x_ptr + t * sx_t + h.to(tl.int64)[:, None] * sx_h
    o_row = out_ptr + t * so_t + h.to(tl.int64)[:, None] * so_h
    if COPY_NOPE:
        d = tl.arange(0, 512)[None, :]
        m = hm & (d < 448)
        tl.store(o_row + d, tl.load(x_row + d, mask=m), mask=m)
    r = tl.arange(0, 64)[None, :]
    x = tl.load(x_row + 448 + r, mask=hm).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, 32)
    cos, sin = rope_cos_sin(cs_ptr + pos * s_cs, i, (pos >= 0) & (pos < max_pos))
    y = rope_interleaved(x, cos[None, :], sin[None, :], INVERSE)
    _store_cast(o_row + 448 + r, y, hm, OUT_BF16, SW)


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------
def check_rope_args(x, positions, cos_sin_cache, *, x_name: str = "x", tokens: Optional[int] = None,
                    positions_name: str = "positions"):
    """Validate ``positions [T]`` int32/int64 and ``cos_sin_cache [max_pos, 64]`` fp32 for ``T``
    tokens (``x.shape[0]`` by default); raise TypeError/ValueError naming the argument."""
    T = x.shape[0] if tokens is None else tokens
    check_tensor(positions_name, positions, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    check_shape(positions_name, positions, [T])
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32,), ndims=2, last_dim=ROPE_DIM)
    check_same_device(**{x_name: x, positions_name: positions, "cos_sin_cache": cos_sin_cache})


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    inverse: bool = False,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Rotate dims 448..511 of every head of ``x`` at its token's position (SPEC §2).

    Args:
        x: ``[T, H, 512]`` bf16 (fp16/fp32 also accepted); the last dim contiguous.
        positions: ``[T]`` int32/int64. A position outside ``[0, max_pos)`` is not rotated.
        cos_sin_cache: ``[max_pos, 64]`` fp32, ``cos`` in columns 0..31, ``sin`` in 32..63.
        inverse: rotate by ``-angle`` (the attention output's inverse RoPE).
        out: optional ``[T, H, 512]`` of ``x.dtype``; ``out=x`` rotates in place (then
            dims 0..447 are not touched).

    Returns ``out``: dims 0..447 copied, 448..511 rotated in fp32 and rounded once (RNE).
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndims=3, last_dim=HEAD_DIM)
    check_rope_args(x, positions, cos_sin_cache)
    if not isinstance(inverse, bool):
        raise TypeError(f"inverse: expected a bool, got {type(inverse).__name__}")
    T, H, _ = x.shape
    if out is None:
        out = torch.empty_like(x)
    else:
        check_tensor("out", out, dtypes=(x.dtype,), ndims=3, last_dim=HEAD_DIM)
        check_shape("out", out, [T, H, HEAD_DIM])
        check_same_device(x=x, out=out)
    call_op(_apply_rope_op, x, positions, cos_sin_cache, inverse, out)
    return out


@torch.library.custom_op("dsv41::apply_rope", mutates_args=("out",))
def _apply_rope_op(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   inverse: bool, out: torch.Tensor) -> None:
    if use_reference(x.device, _apply_rope_kernel):
        out.copy_(apply_rope_ref(x, positions, cos_sin_cache, inverse))
        return
    T, H, _ = x.shape
    in_place = out.data_ptr() == x.data_ptr() and out.stride() == x.stride()
    if T == 0 or H == 0:
        return
    block_h = min(next_power_of_2(H), 16)
    grid = (T, triton.cdiv(H, block_h))
    _apply_rope_kernel[grid](
        x, out, positions, cos_sin_cache,
        H, cos_sin_cache.shape[0],
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos_sin_cache.stride(0),
        INVERSE=inverse,
        COPY_NOPE=not in_place,
        OUT_BF16=out.dtype == torch.bfloat16,
        BLOCK_H=block_h,
        SW=is_interpreter(),
        num_warps=4,
    )


@_apply_rope_op.register_fake
def _apply_rope_fake(x, positions, cos_sin_cache, inverse, out) -> None:
    return None
