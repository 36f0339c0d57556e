"""The fused ("mega") contract of SPEC §6 in Triton: Q norm + Q RoPE + sparse attention +
inverse RoPE of the output + MXFP8 cast, for any GPU Triton runs on (and the CPU interpreter).

Entry points (argument order of FlashMLA's torch ops, see below):

* :func:`sparse_mla_decode_fused` -> ``(data, scale, lse)``
* :func:`sparse_mla_prefill_fused` -> ``(data, scale, max_logits, lse)`` (``max_logits`` is
  always ``None`` here: not computed)
* :func:`q_norm_rope`: the prologue alone (one Triton kernel), also used by the tests.

Pipeline (three launches, four when the attention splits its keys): one small kernel reads
``q`` in its layout, applies the optional per-head RMS factor and the RoPE at
``token_positions`` and writes a standard ``[T, H, 512]`` bf16 q; then
:func:`~dsv41_triton.attention.decode.sparse_mla_decode` /
:func:`~dsv41_triton.attention.prefill.sparse_mla_prefill` (bf16 output + lse); then the
inverse-RoPE + MXFP8 epilogue of :mod:`dsv41_triton.ops.mxfp8` writes ``(data, scale)``.
Every argument is checked before the first launch; nothing depends on tensor values on the
host, so the calls can be captured in a CUDA graph.

Facts about FlashMLA's fused kernels this mirrors (from its Python wrappers, the op schemas,
its test oracle and vLLM's ``deepseek_v41`` call sites; restated here in our words):

* There are two torch ops, ``_flashmla_C.fused_norm_rope_attn_rope_cast_decode`` (paged
  caches) and ``..._fwd`` (prefill over a bf16 ``kv``). Their positional order is: ``q, kv,
  indices, sm_scale, d_v, attn_sink, topk_length``, then for decode only ``extra_kv,
  extra_indices, extra_topk_length``, then ``enable_q_norm, rms_norm_eps, token_positions,
  is_rope_neox_style, rope_dim, cos_sin_cache, n_wv_group, num_per_channels,
  use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0``. vLLM's build takes the output
  pair as two more trailing arguments (``data``, ``scale``, written in place; vLLM passes
  token-range slices of one per-step pair); FlashMLA's own build allocates it. The Python
  wrappers ``flash_mla.fused_norm_rope_attn_rope_cast.decode/prefill`` take the same
  arguments with the norm/RoPE/cast group first. The functions here follow the op order
  (and the vLLM output pair), so a call site written for the op drives them unchanged.
* Returns: decode ``(out_fp8, out_sf, lse)``; prefill ``(out_fp8, out_sf, max_logits,
  lse)``. ``lse`` is natural-log, over the scaled logits, without the sink; ``+inf`` (and a
  zero output) for a query without keys.
* ``enable_q_norm``: a weightless RMS norm of every (token, head) row of the *un-rotated*
  ``q`` over all 512 dims, in fp32: ``r = rsqrt(sum(q**2) / 512 + rms_norm_eps)``. The kernel
  does not rescale ``q``: it multiplies that head's logits by ``r`` (``sm_scale * r *
  <rope(q), k>``), so ``lse`` includes it. vLLM passes ``False, 0.0`` (V4.1 normalizes the
  q latent before ``wq_b``); V4's per-head q norm is what the flag is for.
* Fixed conventions, only these values are accepted: ``is_rope_neox_style=False`` (GPT-J
  pairs), ``rope_dim=64``, ``num_per_channels=32``, ``use_tma_aligned_col_major_sf``,
  ``round_sf`` and ``use_packed_ue8m0`` all ``True``, ``d_v=512``. ``n_wv_group`` is
  ``h_q / 8`` (8 heads per ``wo_a`` group).
* ``q`` arrives in the chunk-interleaved layout (``wq_b`` rows permuted) and the output
  leaves in the chunk-interleaved group layout (``wo_a`` columns permuted); FlashMLA pads
  ``h_q`` to 64 or 128. ``token_positions`` is ``[s_q]`` int32, ``cos_sin_cache``
  ``[max_pos, 64]`` fp32 (cos | sin). Decode caches are ``[blocks, page, 1, bytes]``
  (584/528/288 records) with ``[s_q, topk]`` slot ids and ``[s_q]`` lengths; prefill takes
  ``kv [s_kv, 1, 512]`` bf16 and ``indices [s_q, 1, topk]`` (entries outside ``[0, s_kv)``
  skipped). The fused ops take no scheduler metadata.

Where this implementation differs (on purpose):

* ``layout`` (keyword, default ``"interleaved"`` = FlashMLA's) also accepts ``"standard"``
  (head-major q and output groups); any ``H`` that is a multiple of 8 works, no padding.
* The q norm is folded into q: the prologue multiplies the fp32 q row by ``r`` before the
  one bf16 rounding, which gives the same logits (they are linear in q) up to that rounding.
* ``sm_scale=None`` means ``512 ** -0.5``; ``token_positions`` may be int64; a position
  outside ``[0, max_pos)`` is not rotated (as everywhere in this package).
* ``scale`` may be any MN-major TMA-aligned buffer: ``stride(0) == 1``, ``stride(2)`` a
  multiple of 4 and ``>= T``, ``stride(1) == 32 * stride(2)`` (so a token-range slice of
  :func:`~dsv41_triton.ops.mxfp8.alloc_mxfp8_output` works, as in vLLM).
* ``max_logits`` is not computed (``None``); ``tile_scheduler_metadata`` / ``num_splits``
  keywords (for call sites written against ``flash_mla_with_kvcache``) are accepted and
  ignored.

Reference: :mod:`dsv41_triton.attention.fused_ref` (float64).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import triton
import triton.language as tl

from .._contract import (
    EXTRA_RECORDS,
    HEAD_DIM,
    MXFP8_CHUNK,
    ROPE_DIM,
    SWA_RECORDS,
    WV_GROUP_SIZE,
    check_bool,
    check_distinct_elements,
    check_indices,
    check_int,
    check_k_cache,
    check_layout,
    check_lens,
    check_no_overlap,
    check_q,
    check_same_device,
    check_scale,
    check_shape,
    check_sink,
    check_tensor,
    check_workspace,
)
from .._utils import call_op, is_interpreter, next_power_of_2, use_reference
from ..ops._codecs import f32_to_bf16
from ..ops.mxfp8 import alloc_mxfp8_output, check_mxfp8_output, rope_mxfp8_epilogue
from ..ops.rope import check_rope_args, rope_cos_sin, rope_interleaved
from .decode import sparse_mla_decode
from .prefill import sparse_mla_prefill

#: FlashMLA's kernel conventions (the only values accepted)
FLASHMLA_FIXED_ARGS = {
    "d_v": HEAD_DIM,
    "is_rope_neox_style": False,
    "rope_dim": ROPE_DIM,
    "num_per_channels": MXFP8_CHUNK,
    "use_tma_aligned_col_major_sf": True,
    "round_sf": True,
    "use_packed_ue8m0": True,
}
DEFAULT_LAYOUT = "interleaved"
DEFAULT_RMS_NORM_EPS = 1e-6


# --------------------------------------------------------------------------------------------
# prologue kernel: (optional) per-head RMS factor + RoPE, any q layout -> standard bf16 q
# --------------------------------------------------------------------------------------------
@triton.jit
def _q_norm_rope_kernel(
    q_ptr, out_ptr, pos_ptr, cs_ptr,
    H, max_pos, eps,
    sq_t, sq_h, so_t, so_h, s_cs, slice_stride,
    INTERLEAVED: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SW: tl.constexpr,
):
    """One program per (token, BLOCK_H heads): a [BLOCK_H, 512] row tile in fp32."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = (h < H)[:, None]
    h64 = h.to(tl.int64)[:, None]
    d = tl.arange(0, 512)[None, :]
    r = tl.arange(0, 64)[None, :]
    q_tok = q_ptr + t * sq_t
    if INTERLEAVED:
        # (h, d) at (d // 16) * (H * 16) + h * 16 + d % 16 of the token's H*512 values;
        # slice_stride = H * 16
        x_off = (d // 16) * slice_stride + h64 * 16 + d % 16
        r_off = ((448 + r) // 16) * slice_stride + h64 * 16 + r % 16
    else:
        x_off = h64 * sq_h + d
        r_off = h64 * sq_h + 448 + r
    x = tl.load(q_tok + x_off, mask=hm, other=0.0).to(tl.float32)  # [BH, 512]
    xr = tl.load(q_tok + r_off, mask=hm, other=0.0).to(tl.float32)  # [BH, 64] dims 448..511

    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos, sin = rope_cos_sin(cs_ptr + pos * s_cs, tl.arange(0, 32), (pos >= 0) & (pos < max_pos))
    y = rope_interleaved(xr, cos[None, :], sin[None, :], False)
    if NORM:
        # weightless RMS over the un-rotated row (all 512 dims), fp32
        rs = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / 512.0 + eps)
        x = x * rs[:, None]
        y = y * rs[:, None]

    o_row = out_ptr + t * so_t + h64 * so_h
    tl.store(o_row + d, f32_to_bf16(x, SW), mask=hm & (d < 448))
    tl.store(o_row + 448 + r, f32_to_bf16(y, SW), mask=hm)


def _launch_q_prologue(q, positions, cos_sin_cache, out, interleaved: bool, norm: bool,
                       eps: float) -> None:
    T, H, _ = q.shape
    if T == 0:
        return
    block_h = min(8, next_power_of_2(H))
    grid = (T, triton.cdiv(H, block_h))
    _q_norm_rope_kernel[grid](
        q, out, positions, cos_sin_cache,
        H, cos_sin_cache.shape[0], float(eps),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cos_sin_cache.stride(0), H * 16,
        INTERLEAVED=interleaved,
        NORM=norm,
        BLOCK_H=block_h,
        SW=is_interpreter(),
        num_warps=4,
    )


# --------------------------------------------------------------------------------------------
# argument checks (all before any launch)
# --------------------------------------------------------------------------------------------
_check_bool = check_bool


def _check_eps(enable_q_norm: object, rms_norm_eps: object) -> float:
    _check_bool("enable_q_norm", enable_q_norm)
    if isinstance(rms_norm_eps, bool) or not isinstance(rms_norm_eps, (int, float)):
        raise TypeError(f"rms_norm_eps: expected a float, got {type(rms_norm_eps).__name__}")
    eps = float(rms_norm_eps)
    if enable_q_norm and not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"rms_norm_eps: expected a finite float >= 0, got {rms_norm_eps!r}")
    return eps


def _check_q(q: object, layout: str, *, fused: bool):
    return check_q(q, fused=fused, layout=layout)


def _check_fixed(**given: Any) -> None:
    for name, v in given.items():
        want = FLASHMLA_FIXED_ARGS[name]
        if isinstance(want, bool):
            _check_bool(name, v)
        elif isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
        if v != want:
            raise ValueError(f"{name}: only {want!r} is supported (FlashMLA's convention), "
                             f"got {v!r}")


def _check_rows(name: str, t: object, T, ndims: int) -> None:
    if ndims == 1:
        check_lens(name, t, T)
    else:
        check_indices(name, t, T, allow_3d=ndims == 3)


def _check_n_wv_group(n_wv_group: object, H: int) -> int:
    G = H // WV_GROUP_SIZE
    if n_wv_group is None:
        return G
    check_int("n_wv_group", n_wv_group, lo=1)
    if n_wv_group != G:
        raise ValueError(f"n_wv_group: expected H / {WV_GROUP_SIZE} = {G} for {H} heads, got "
                         f"{n_wv_group}")
    return G


def check_fused_output(data: object, scale: object, num_tokens: int, n_groups: int,
                       device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Allocate the missing half of the fused output pair (``None``), then validate both with
    :func:`~dsv41_triton.ops.mxfp8.check_mxfp8_output` (token-range slices of a step's
    buffer qualify). Raises TypeError/ValueError naming the argument."""
    if data is None or scale is None:
        d_new, s_new = alloc_mxfp8_output(num_tokens, n_groups, device)
        data = d_new if data is None else data
        scale = s_new if scale is None else scale
    return check_mxfp8_output(data, scale, num_tokens, n_groups)


def _check_common(q, sm_scale, d_v, attn_sink, topk_length, enable_q_norm, rms_norm_eps,
                  token_positions, is_rope_neox_style, rope_dim, cos_sin_cache, n_wv_group,
                  num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0,
                  layout):
    check_layout(layout)
    T, H = _check_q(q, layout, fused=True)
    scale_f = check_scale(sm_scale, "sm_scale")
    _check_fixed(d_v=d_v, is_rope_neox_style=is_rope_neox_style, rope_dim=rope_dim,
                 num_per_channels=num_per_channels,
                 use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf, round_sf=round_sf,
                 use_packed_ue8m0=use_packed_ue8m0)
    eps = _check_eps(enable_q_norm, rms_norm_eps)
    if token_positions is None:
        raise ValueError("token_positions: required ([T] int32 positions of the query tokens)")
    if cos_sin_cache is None:
        raise ValueError("cos_sin_cache: required ([max_pos, 64] fp32, cos | sin)")
    check_rope_args(q, token_positions, cos_sin_cache, x_name="q",
                    positions_name="token_positions")
    check_sink(attn_sink, H)
    if topk_length is not None:
        _check_rows("topk_length", topk_length, T, 1)
    G = _check_n_wv_group(n_wv_group, H)
    return T, H, G, scale_f, eps


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def q_norm_rope(
    q: torch.Tensor,
    token_positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layout: str,
    enable_q_norm: bool = False,
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The fused contract's Q prologue, one Triton kernel.

    Args:
        q: ``[T, H, 512]`` bf16 in ``layout`` (``"standard"``: last dim contiguous;
            ``"interleaved"``: each token's ``H*512`` values contiguous), any ``H >= 1``.
        token_positions: ``[T]`` int32/int64 (outside ``[0, max_pos)``: no rotation).
        cos_sin_cache: ``[max_pos, 64]`` fp32.
        layout: ``"standard"`` or ``"interleaved"`` (SPEC §6).
        enable_q_norm: multiply each (token, head) row by
            ``rsqrt(sum(q**2) / 512 + rms_norm_eps)`` (fp32, over the un-rotated row).
        out: optional ``[T, H, 512]`` bf16 (last dim contiguous; must not alias ``q``).

    Returns ``out``: standard-layout bf16 q, dims 448..511 rotated at the token's position,
    computed in fp32 and rounded once (RNE).
    """
    check_layout(layout)
    T, H = _check_q(q, layout, fused=False)
    eps = _check_eps(enable_q_norm, rms_norm_eps)
    check_rope_args(q, token_positions, cos_sin_cache, x_name="q",
                    positions_name="token_positions")
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    else:
        check_tensor("out", out, dtypes=(torch.bfloat16,), ndims=3, last_dim=HEAD_DIM)
        check_shape("out", out, [T, H, HEAD_DIM])
        check_same_device(q=q, out=out)
        check_distinct_elements("out", out)
        if out is q:
            raise ValueError("out: must not alias q (the prologue reads whole rows first)")
        check_no_overlap("out", out, "q", q)
    call_op(_q_norm_rope_op, q, token_positions, cos_sin_cache, layout, enable_q_norm, eps,
                                out)
    return out


def _q_norm_rope_impl(q, token_positions, cos_sin_cache, layout, enable_q_norm, eps, out):
    if use_reference(q.device, _q_norm_rope_kernel):
        from .fused_ref import q_norm_rope_ref

        out.copy_(q_norm_rope_ref(q, token_positions, cos_sin_cache, layout, enable_q_norm,
                                  eps, dtype=torch.float32))
        return
    if q.shape[0] > 0 and out.data_ptr() == q.data_ptr():
        raise ValueError("out: must not alias q (the prologue reads whole rows first)")
    _launch_q_prologue(q, token_positions, cos_sin_cache, out, layout == "interleaved",
                       enable_q_norm, eps)


@torch.library.custom_op("dsv41::q_norm_rope", mutates_args=("out",))
def _q_norm_rope_op(q: torch.Tensor, token_positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, layout: str, enable_q_norm: bool,
                    rms_norm_eps: float, out: torch.Tensor) -> None:
    _q_norm_rope_impl(q, token_positions, cos_sin_cache, layout, enable_q_norm, rms_norm_eps,
                      out)


@_q_norm_rope_op.register_fake
def _q_norm_rope_fake(q, token_positions, cos_sin_cache, layout, enable_q_norm, rms_norm_eps,
                      out) -> None:
    return None


def sparse_mla_decode_fused(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: Optional[float] = None,
    d_v: int = HEAD_DIM,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_kv: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    enable_q_norm: bool = False,
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS,
    token_positions: Optional[torch.Tensor] = None,
    is_rope_neox_style: bool = False,
    rope_dim: int = ROPE_DIM,
    cos_sin_cache: Optional[torch.Tensor] = None,
    n_wv_group: Optional[int] = None,
    num_per_channels: int = MXFP8_CHUNK,
    use_tma_aligned_col_major_sf: bool = True,
    round_sf: bool = True,
    use_packed_ue8m0: bool = True,
    data: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
    *,
    layout: str = DEFAULT_LAYOUT,
    tile_scheduler_metadata: Any = None,
    num_splits: Any = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused decode over paged caches (the order of ``fused_norm_rope_attn_rope_cast_decode``).

    Args:
        q: ``[T, H, 512]`` bf16, NOT RoPE'd, in ``layout``; ``H`` a positive multiple of 8.
        kv: the window cache, uint8 ``[num_blocks, page, 584|528]`` (or ``[nb, page, 1, b]``).
        indices: ``[T, topk]`` int32 slot ids into ``kv`` (``< 0`` or past the cache: skipped).
        sm_scale: logit scale (None: ``512 ** -0.5``).
        d_v: must be 512.
        attn_sink: ``[H]`` fp32 or None (``-inf``: no sink).
        topk_length: ``[T]`` int32, columns of ``indices`` read per token (None: all).
        extra_kv, extra_indices, extra_topk_length: the optional second (compressed) cache,
            ``584|528|288`` records, sharing one softmax with ``kv``.
        enable_q_norm, rms_norm_eps: the per-head weightless RMS norm of q (see module doc).
        token_positions: ``[T]`` int32/int64, required.
        is_rope_neox_style, rope_dim: must be False, 64.
        cos_sin_cache: ``[max_pos, 64]`` fp32, required.
        n_wv_group: None or ``H / 8``.
        num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0: must be
            32, True, True, True.
        data, scale: optional output pair (see :func:`check_fused_output`); missing ones are
            allocated.
        layout: ``"interleaved"`` (default, FlashMLA's) or ``"standard"``, for q and output.
        tile_scheduler_metadata, num_splits: accepted and ignored.

    Returns:
        ``(data [T, H/8, 4096] float8_e4m3fn, scale [T, H/8, 32] int32, lse [T, H] fp32)``.
    """
    del tile_scheduler_metadata, num_splits
    T, H, G, scale_f, eps = _check_common(
        q, sm_scale, d_v, attn_sink, topk_length, enable_q_norm, rms_norm_eps,
        token_positions, is_rope_neox_style, rope_dim, cos_sin_cache, n_wv_group,
        num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, layout)
    check_k_cache("kv", kv, SWA_RECORDS)
    _check_rows("indices", indices, T, 2)
    if extra_kv is not None:
        check_k_cache("extra_kv", extra_kv, EXTRA_RECORDS)
        if extra_indices is None:
            raise ValueError("extra_indices: required when extra_kv is given")
        _check_rows("extra_indices", extra_indices, T, 2)
        if extra_topk_length is not None:
            _check_rows("extra_topk_length", extra_topk_length, T, 1)
    elif extra_indices is not None or extra_topk_length is not None:
        raise ValueError("extra_kv: required when extra_indices/extra_topk_length are given")
    data, scale = check_fused_output(data, scale, T, G, q.device)
    check_same_device(q=q, kv=kv, indices=indices, topk_length=topk_length, extra_kv=extra_kv,
                      extra_indices=extra_indices, extra_topk_length=extra_topk_length,
                      attn_sink=attn_sink, token_positions=token_positions,
                      cos_sin_cache=cos_sin_cache, data=data, scale=scale)

    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    call_op(_decode_fused_op,
        q, kv, indices, scale_f, attn_sink, topk_length, extra_kv, extra_indices,
        extra_topk_length, enable_q_norm, eps, token_positions, cos_sin_cache, layout, data,
        scale, lse)
    return data, scale, lse


@torch.library.custom_op("dsv41::sparse_mla_decode_fused", mutates_args=("data", "scale", "lse"))
def _decode_fused_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                     attn_sink: Optional[torch.Tensor], topk_length: Optional[torch.Tensor],
                     extra_kv: Optional[torch.Tensor], extra_indices: Optional[torch.Tensor],
                     extra_topk_length: Optional[torch.Tensor], enable_q_norm: bool,
                     rms_norm_eps: float, token_positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, layout: str, data: torch.Tensor,
                     scale: torch.Tensor, lse: torch.Tensor) -> None:
    if use_reference(q.device, _q_norm_rope_kernel):
        from .fused_ref import sparse_mla_decode_fused_ref

        d, s, l, _ = sparse_mla_decode_fused_ref(
            q, kv, indices, sm_scale, attn_sink, topk_length, extra_kv, extra_indices,
            extra_topk_length, enable_q_norm, rms_norm_eps, token_positions, cos_sin_cache,
            layout=layout, bf16_steps=True)
        data.copy_(d)
        scale.copy_(s)
        lse.copy_(l)
        return
    T, H = q.shape[0], q.shape[1]
    q_rot = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    _launch_q_prologue(q, token_positions, cos_sin_cache, q_rot, layout == "interleaved",
                       enable_q_norm, rms_norm_eps)
    o, l = sparse_mla_decode(q_rot, kv, indices, topk_length, extra_kv, extra_indices,
                             extra_topk_length, attn_sink=attn_sink, softmax_scale=sm_scale)
    lse.copy_(l)
    rope_mxfp8_epilogue(o, token_positions, cos_sin_cache, layout, data, scale)


@_decode_fused_op.register_fake
def _decode_fused_fake(q, kv, indices, sm_scale, attn_sink, topk_length, extra_kv,
                       extra_indices, extra_topk_length, enable_q_norm, rms_norm_eps,
                       token_positions, cos_sin_cache, layout, data, scale, lse) -> None:
    return None


def sparse_mla_prefill_fused(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: Optional[float] = None,
    d_v: int = HEAD_DIM,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    enable_q_norm: bool = False,
    rms_norm_eps: float = DEFAULT_RMS_NORM_EPS,
    token_positions: Optional[torch.Tensor] = None,
    is_rope_neox_style: bool = False,
    rope_dim: int = ROPE_DIM,
    cos_sin_cache: Optional[torch.Tensor] = None,
    n_wv_group: Optional[int] = None,
    num_per_channels: int = MXFP8_CHUNK,
    use_tma_aligned_col_major_sf: bool = True,
    round_sf: bool = True,
    use_packed_ue8m0: bool = True,
    data: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
    *,
    layout: str = DEFAULT_LAYOUT,
) -> Tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
    """Fused prefill over a bf16 workspace (the order of ``fused_norm_rope_attn_rope_cast_fwd``).

    Args:
        q: ``[T, H, 512]`` bf16, NOT RoPE'd, in ``layout``; ``H`` a positive multiple of 8.
        kv: ``[S, 512]`` or ``[S, 1, 512]`` bf16 (RoPE'd keys; last dim contiguous).
        indices: ``[T, K]`` or ``[T, 1, K]`` int32 rows of ``kv`` (``< 0`` or ``>= S`` skipped).
        topk_length: ``[T]`` int32 or None.
        Other arguments as :func:`sparse_mla_decode_fused`.

    Returns:
        ``(data, scale, max_logits, lse)``: FlashMLA's tuple; ``max_logits`` is ``None`` (not
        computed by the Triton path), ``lse [T, H]`` fp32.
    """
    T, H, G, scale_f, eps = _check_common(
        q, sm_scale, d_v, attn_sink, topk_length, enable_q_norm, rms_norm_eps,
        token_positions, is_rope_neox_style, rope_dim, cos_sin_cache, n_wv_group,
        num_per_channels, use_tma_aligned_col_major_sf, round_sf, use_packed_ue8m0, layout)
    check_workspace(kv)
    check_indices("indices", indices, T, allow_3d=True)
    data, scale = check_fused_output(data, scale, T, G, q.device)
    check_same_device(q=q, kv=kv, indices=indices, topk_length=topk_length,
                      attn_sink=attn_sink, token_positions=token_positions,
                      cos_sin_cache=cos_sin_cache, data=data, scale=scale)

    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    call_op(_prefill_fused_op,
        q, kv, indices, scale_f, attn_sink, topk_length, enable_q_norm, eps, token_positions,
        cos_sin_cache, layout, data, scale, lse)
    return data, scale, None, lse


@torch.library.custom_op("dsv41::sparse_mla_prefill_fused",
                         mutates_args=("data", "scale", "lse"))
def _prefill_fused_op(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                      sm_scale: float, attn_sink: Optional[torch.Tensor],
                      topk_length: Optional[torch.Tensor], enable_q_norm: bool,
                      rms_norm_eps: float, token_positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, layout: str, data: torch.Tensor,
                      scale: torch.Tensor, lse: torch.Tensor) -> None:
    if use_reference(q.device, _q_norm_rope_kernel):
        from .fused_ref import sparse_mla_prefill_fused_ref

        d, s, _, l, _ = sparse_mla_prefill_fused_ref(
            q, kv, indices, sm_scale, attn_sink, topk_length, enable_q_norm, rms_norm_eps,
            token_positions, cos_sin_cache, layout=layout, bf16_steps=True)
        data.copy_(d)
        scale.copy_(s)
        lse.copy_(l)
        return
    T, H = q.shape[0], q.shape[1]
    q_rot = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    _launch_q_prologue(q, token_positions, cos_sin_cache, q_rot, layout == "interleaved",
                       enable_q_norm, rms_norm_eps)
    o, l = sparse_mla_prefill(q_rot, kv, indices, topk_length, attn_sink=attn_sink,
                              softmax_scale=sm_scale)
    lse.copy_(l)
    rope_mxfp8_epilogue(o, token_positions, cos_sin_cache, layout, data, scale)


@_prefill_fused_op.register_fake
def _prefill_fused_fake(q, kv, indices, sm_scale, attn_sink, topk_length, enable_q_norm,
                        rms_norm_eps, token_positions, cos_sin_cache, layout, data, scale,
                        lse) -> None:
    return None


__all__ = [
    "DEFAULT_LAYOUT",
    "FLASHMLA_FIXED_ARGS",
    "check_fused_output",
    "q_norm_rope",
    "sparse_mla_decode_fused",
    "sparse_mla_prefill_fused",
]
