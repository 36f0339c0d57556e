"""MXFP8 packing of the fused contract's output (SPEC §6) and the fused RoPE/MXFP8 epilogue.

Output pair for ``T`` tokens and ``G = H / 8`` groups:

* ``data [T, G, 4096]`` float8_e4m3fn (last dim contiguous);
* ``scale [T, G, 32]`` int32, **MN-major** (DeepGEMM's TMA-aligned layout): ``stride(0) == 1``,
  ``stride(2) == round_up(T, 4)``, ``stride(1) == 32 * round_up(T, 4)``. Each int32 packs the
  UE8M0 bytes of 4 consecutive 32-element chunks, the lowest chunk in the lowest byte.
  The padding rows ``T .. round_up(T, 4) - 1`` exist in the storage but are never written.

Per chunk: ``amax = max(max|x|, 1e-10)``, ``e = ceil(log2(amax/448))``, byte ``e + 127``,
values ``clamp(x * 2**-e, -448, 448)`` to e4m3, round to nearest even.

Reference: :mod:`dsv41_triton.ops.mxfp8_ref`.

Jit helpers for other kernels' epilogues:

* ``mxfp8_chunk_quant(x, SW)``: ``x [N, 32]`` fp32 -> ``(codes [N, 32] uint8, ebyte [N] int32)``.
* ``pack_ue8m0_x4(ebyte4)``: ``[N, 4]`` int32 bytes -> ``[N]`` int32 words.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from .._contract import check_distinct_elements
from .._utils import (
    call_op,
    HEAD_DIM,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
    is_interpreter,
    round_up,
    use_reference,
)
from ._codecs import e4m3_nan_fixup, exp2_int, f32_to_e4m3_bits, finite_abs, ue8m0_exponent
from .layouts import GROUP_WIDTH, WV_GROUP_SIZE, check_layout
from .mxfp8_ref import (SCALE_WORDS, mxfp8_dequantize_ref, mxfp8_quantize_ref,
                        rope_mxfp8_epilogue_ref)
from .rope import check_rope_args, rope_elementwise

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# jit helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def mxfp8_chunk_quant(x, SW: tl.constexpr):
    """``x [N, 32]`` fp32 -> ``(e4m3 codes [N, 32] uint8, UE8M0 bytes [N] int32)``."""
    amax = tl.maximum(tl.max(finite_abs(x), axis=1), 1e-10)
    e = ue8m0_exponent(amax)
    y = x * exp2_int(-e)[:, None]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return e4m3_nan_fixup(f32_to_e4m3_bits(y, SW), x), e + 127


@triton.jit
def pack_ue8m0_x4(b):
    """``[N, 4]`` int32 bytes -> ``[N]`` int32, ``b[:, k]`` in byte ``k`` (disjoint bits, so the
    sum is an OR; the top byte may set the sign bit)."""
    shift = (tl.arange(0, 4) * 8)[None, :]
    return tl.sum(b << shift, axis=1)


@triton.jit
def _mxfp8_quantize_kernel(
    x_ptr, data_ptr, scale_ptr,
    sx_t, sx_g, sd_t, sd_g, ss_t, ss_g, ss_w,
    SW: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    k = tl.arange(0, 128)[:, None]
    j = tl.arange(0, 32)[None, :]
    off = k * 32 + j
    x = tl.load(x_ptr + t * sx_t + g * sx_g + off).to(tl.float32)
    codes, eb = mxfp8_chunk_quant(x, SW)
    tl.store(data_ptr + t * sd_t + g * sd_g + off, codes)
    words = pack_ue8m0_x4(tl.reshape(eb, (32, 4)))
    w = tl.arange(0, 32).to(tl.int64)
    tl.store(scale_ptr + t * ss_t + g * ss_g + w * ss_w, words)


@triton.jit
def _rope_mxfp8_epilogue_kernel(
    o_ptr, pos_ptr, cs_ptr, data_ptr, scale_ptr,
    max_pos,
    so_t, so_h, s_cs, sd_t, sd_g, ss_t, ss_g, ss_w,
    INTERLEAVED: tl.constexpr,
    SW: tl.constexpr,
):
    """One program per (token, group of 8 heads): a [8 heads, 16 chunks, 32] tile."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, 8)[:, None, None]
    c = tl.arange(0, 16)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    d = c * 32 + j  # [1, 16, 32]
    row = o_ptr + t * so_t + (g * 8 + h) * so_h  # [8, 1, 1]
    x = tl.load(row + d).to(tl.float32)

    # inverse RoPE on dims 448..511 (chunks 14, 15); element d pairs with d ^ 1.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    ok = (pos >= 0) & (pos < max_pos)
    # out-of-range position: no rotation (a comparison, not `ok & tile`, see rope_cos_sin)
    rot = d >= tl.where(ok, 448, 512)  # [1, 16, 32]
    pair = tl.where(rot, (d - 448) // 2, 0)
    cos = tl.load(cs_ptr + pos * s_cs + pair, mask=rot, other=1.0)
    sin = tl.load(cs_ptr + pos * s_cs + 32 + pair, mask=rot, other=0.0)
    rot3 = rot & (h >= 0)  # [8, 16, 32]
    partner = tl.load(row + (d ^ 1), mask=rot3, other=0.0).to(tl.float32)
    y = rope_elementwise(x, partner, cos, sin, (j & 1) == 1, True)
    x = tl.where(rot3, y, x)

    codes, eb = mxfp8_chunk_quant(tl.reshape(x, (128, 32)), SW)
    codes = tl.reshape(codes, (8, 16, 32))
    eb = tl.reshape(eb, (8, 16))
    if INTERLEAVED:
        off = (c * 8 + h) * 32 + j  # (h, 32c + j) -> (c*8 + h)*32 + j
        # chunk k = c*8 + h: word c*2 + h // 4, byte h % 4
        words = pack_ue8m0_x4(tl.reshape(tl.trans(eb), (32, 4)))
    else:
        off = h * 512 + d
        # chunk k = h*16 + c: word h*4 + c // 4, byte c % 4
        words = pack_ue8m0_x4(tl.reshape(eb, (32, 4)))
    tl.store(data_ptr + t * sd_t + g * sd_g + off, codes)
    w = tl.arange(0, 32).to(tl.int64)
    tl.store(scale_ptr + t * ss_t + g * ss_g + w * ss_w, words)


# --------------------------------------------------------------------------------------------
# buffers
# --------------------------------------------------------------------------------------------
def mxfp8_scale_strides(num_tokens: int) -> Tuple[int, int, int]:
    """The MN-major strides of ``scale [T, G, 32]``: ``(1, 32 * round_up(T, 4), round_up(T, 4))``."""
    tp = round_up(num_tokens, 4)
    return (1, SCALE_WORDS * tp, tp)


def alloc_mxfp8_output(
    num_tokens: int, n_groups: int, device: Union[str, torch.device] = "cpu"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Allocate the fused output pair: ``data [T, G, 4096]`` float8_e4m3fn (contiguous) and
    ``scale [T, G, 32]`` int32 with the MN-major TMA-aligned strides, over a storage of
    ``G * 32 * round_up(T, 4)`` int32 (padding rows included, never written)."""
    check_int("num_tokens", num_tokens, lo=0)
    check_int("n_groups", n_groups, lo=1)
    data = torch.empty(num_tokens, n_groups, GROUP_WIDTH, dtype=torch.float8_e4m3fn, device=device)
    tp = round_up(num_tokens, 4)
    storage = torch.empty(n_groups * SCALE_WORDS * tp, dtype=torch.int32, device=device)
    scale = storage.as_strided((num_tokens, n_groups, SCALE_WORDS), mxfp8_scale_strides(num_tokens))
    return data, scale


def check_mxfp8_output(
    data: object,
    scale: object,
    num_tokens: int,
    n_groups: int,
    *,
    data_name: str = "data",
    scale_name: str = "scale",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validate a caller-provided output pair; raise TypeError/ValueError naming the argument.

    ``data [T, G, 4096]`` float8_e4m3fn with a contiguous last dim (other strides free);
    ``scale [T, G, 32]`` int32, MN-major and TMA-aligned: ``stride(0) == 1``, ``stride(2)`` a
    multiple of 4 and ``>= T``, ``stride(1) == 32 * stride(2)`` (strides of size-1 dims are
    free). :func:`alloc_mxfp8_output` and token-range slices of it (how a serving step hands
    one buffer's rows to its decode and prefill parts) qualify.
    """
    T, G = num_tokens, n_groups
    check_tensor(data_name, data, dtypes=(torch.float8_e4m3fn,), ndims=3)
    check_shape(data_name, data, [T, G, GROUP_WIDTH])
    check_tensor(scale_name, scale, dtypes=(torch.int32,), ndims=3, contiguous_last=False)
    check_shape(scale_name, scale, [T, G, SCALE_WORDS])
    check_distinct_elements(data_name, data)
    check_distinct_elements(scale_name, scale)
    s0, s1, s2 = scale.stride()
    ok = (T <= 1 or s0 == 1) and s2 % 4 == 0 and s2 >= T and (G <= 1 or s1 == SCALE_WORDS * s2)
    if not ok:
        raise ValueError(
            f"{scale_name}: expected MN-major TMA-aligned strides (stride(0) == 1, stride(2) a "
            f"multiple of 4 and >= T = {T}, stride(1) == 32 * stride(2); e.g. "
            f"alloc_mxfp8_output or a token slice of one), got {tuple(scale.stride())}"
        )
    check_same_device(**{data_name: data, scale_name: scale})
    return data, scale


def _outputs(data, scale, T, G, device):
    if data is None or scale is None:
        d_new, s_new = alloc_mxfp8_output(T, G, device)
        data = d_new if data is None else data
        scale = s_new if scale is None else scale
    return check_mxfp8_output(data, scale, T, G)


# --------------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------------
def mxfp8_quantize(
    x: torch.Tensor,
    data: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [T, G, 4096]`` (bf16/fp16/fp32, last dim contiguous) to the MXFP8 pair.

    ``data``/``scale`` may be given (see :func:`check_mxfp8_output`); missing ones are
    allocated with :func:`alloc_mxfp8_output`. Returns ``(data, scale)``.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndims=3, last_dim=GROUP_WIDTH)
    T, G, _ = x.shape
    data, scale = _outputs(data, scale, T, G, x.device)
    check_same_device(x=x, data=data, scale=scale)
    call_op(_mxfp8_quantize_op, x, data, scale)
    return data, scale


@torch.library.custom_op("dsv41::mxfp8_quantize", mutates_args=("data", "scale"))
def _mxfp8_quantize_op(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> None:
    if use_reference(x.device, _mxfp8_quantize_kernel):
        d, s = mxfp8_quantize_ref(x)
        data.copy_(d)
        scale.copy_(s)
        return
    T, G = x.shape[0], x.shape[1]
    if T == 0 or G == 0:
        return
    _mxfp8_quantize_kernel[(T, G)](
        x, data.view(torch.uint8), scale,
        x.stride(0), x.stride(1), data.stride(0), data.stride(1),
        scale.stride(0), scale.stride(1), scale.stride(2),
        SW=is_interpreter(),
        num_warps=4,
    )


@_mxfp8_quantize_op.register_fake
def _mxfp8_quantize_fake(x, data, scale) -> None:
    return None


def mxfp8_dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, G, 4096]``: ``e4m3 * 2**(byte - 127)`` per 32-element chunk (plain PyTorch;
    any ``scale`` strides)."""
    check_tensor("data", data, dtypes=(torch.float8_e4m3fn,), ndims=3, last_dim=GROUP_WIDTH)
    check_tensor("scale", scale, dtypes=(torch.int32,), ndims=3, contiguous_last=False)
    check_shape("scale", scale, [data.shape[0], data.shape[1], SCALE_WORDS])
    check_same_device(data=data, scale=scale)
    return mxfp8_dequantize_ref(data, scale)


def rope_mxfp8_epilogue(
    o: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str = "standard",
    data: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused contract's output epilogue: inverse RoPE of dims 448..511 at each token's
    position (fp32), then the MXFP8 cast into ``(data [T, H/8, 4096], scale [T, H/8, 32])``.

    Args:
        o: ``[T, H, 512]`` bf16 (fp16/fp32 accepted), H a positive multiple of 8, the last dim
            contiguous.
        positions: ``[T]`` int32/int64 (outside ``[0, max_pos)``: no rotation).
        cos_sin_cache: ``[max_pos, 64]`` fp32.
        layout: ``"standard"`` (head-major ``h*512 + d`` in a group of 8 heads) or
            ``"interleaved"`` (``(h, 32c + j)`` at ``(c*8 + h)*32 + j``).
        data, scale: optional output buffers (checked like :func:`check_mxfp8_output`).

    Returns ``(data, scale)``. One Triton program per (token, group).
    """
    check_tensor("o", o, dtypes=FLOAT_DTYPES, ndims=3, last_dim=HEAD_DIM)
    T, H, _ = o.shape
    if H == 0 or H % WV_GROUP_SIZE != 0:
        raise ValueError(f"o: the number of heads must be a positive multiple of 8, got H = {H}")
    check_layout(layout)
    check_rope_args(o, positions, cos_sin_cache, x_name="o")
    G = H // WV_GROUP_SIZE
    data, scale = _outputs(data, scale, T, G, o.device)
    check_same_device(o=o, data=data, scale=scale)
    call_op(_rope_mxfp8_epilogue_op, o, positions, cos_sin_cache, layout, data, scale)
    return data, scale


@torch.library.custom_op("dsv41::rope_mxfp8_epilogue", mutates_args=("data", "scale"))
def _rope_mxfp8_epilogue_op(o: torch.Tensor, positions: torch.Tensor,
                            cos_sin_cache: torch.Tensor, layout: str, data: torch.Tensor,
                            scale: torch.Tensor) -> None:
    if use_reference(o.device, _rope_mxfp8_epilogue_kernel):
        d, s = rope_mxfp8_epilogue_ref(o, positions, cos_sin_cache, layout)
        data.copy_(d)
        scale.copy_(s)
        return
    T, G = o.shape[0], o.shape[1] // WV_GROUP_SIZE
    if T == 0:
        return
    _rope_mxfp8_epilogue_kernel[(T, G)](
        o, positions, cos_sin_cache, data.view(torch.uint8), scale,
        cos_sin_cache.shape[0],
        o.stride(0), o.stride(1), cos_sin_cache.stride(0),
        data.stride(0), data.stride(1),
        scale.stride(0), scale.stride(1), scale.stride(2),
        INTERLEAVED=layout == "interleaved",
        SW=is_interpreter(),
        num_warps=4,
    )


@_rope_mxfp8_epilogue_op.register_fake
def _rope_mxfp8_epilogue_fake(o, positions, cos_sin_cache, layout, data, scale) -> None:
    return None
