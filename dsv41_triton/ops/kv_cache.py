"""The two KV-cache ops of SPEC §5 in Triton: quantize-insert and dequant-gather.

Both handle the three records of SPEC §4 (584 ``fp8_ds_mla``, 528 ``mxfp8``, 288 ``nvfp4``) in
the block-split layout (``page`` data rows, then ``page`` scale rows, block stride
``cache.stride(0)``). ``kv_cache_ref.py`` holds the PyTorch reference of each op; both share the
argument checks, so bad input raises before anything is launched. All cache and workspace
addresses are computed in int64.

Shapes of the kernel tiles, per token (insert) or per position (gather):

=============  ===================  ====================================================
record         data tile            scales
=============  ===================  ====================================================
fp8_ds_mla     [8, 64] (group 7 =   8 bytes: 7 UE8M0 + a zero byte; the RoPE dims are
               the 64 RoPE dims)    copied as raw bf16
mxfp8          [16, 32]             16 UE8M0
nvfp4          [32, 16] -> [32, 8]  32 e4m3
               (gather: [2, 32]
               halves x 4 bytes)
=============  ===================  ====================================================

Exactness: the insert writes the same bytes as ``quantize_and_insert_k_cache_ref`` for every
bf16 input, NaN and +-inf included (the rule is in ``_codecs.py``) (interpreter: through the software codecs of ``_codecs.py``; GPU: hardware
conversions). The NVFP4 encode needs no per-element division (see ``_nvfp4_quantize_groups``),
so subnormal inputs keep their sign on the GPU too.
The gather is bit-exact for every record byte pattern (UE8M0 bytes 0 and 255 included) wherever
the reference is not NaN. Where it is NaN (e4m3 NaN bytes 0x7F/0xFF, or a UE8M0 byte 255 times
zero) the kernels give a NaN too, possibly of another payload.

Tuning knobs (constants below) are the tokens per insert program, the positions per gather
program and the warps of each; the reasoning behind them (from the sm_90 code Triton 3.6
generates) is in ``perf/NOTES.md`` ("ops kernels"). The page size is a constexpr of every
kernel: slot and position splits are shifts, not integer divisions.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._utils import call_op, cdiv, is_interpreter, use_reference
from . import _codecs as C
from .kv_cache_ref import (check_gather_args, check_insert_args,
                           dequantize_and_gather_k_cache_ref, quantize_and_insert_k_cache_ref)
from .records import FP8_DS_MLA, MXFP8, NVFP4, RECORD_FORMATS

__all__ = ["quantize_and_insert_k_cache", "dequantize_and_gather_k_cache"]

# ---- tuning knobs --------------------------------------------------------------------------
#: tokens per program and warps of the insert kernels, by record width. 584/528: one 16-element
#: (32-byte) slice of k per thread (BLOCK_T * 512 / 16 threads), so all of a thread's loads
#: are issued before their first use. 288: the encode is instruction-bound, so 32 elements per
#: thread. Why, as measured: perf/NOTES.md, "What was changed, why, and the prediction".
INSERT_BLOCK_T = {584: 8, 528: 8, 288: 8}
INSERT_NUM_WARPS = {584: 8, 528: 8, 288: 4}
#: positions (out rows) per program of the gather kernels, by record width
GATHER_BLOCK_P = {584: 16, 528: 16, 288: 16}
GATHER_NUM_WARPS = 4

_AMAX_FLOOR = tl.constexpr(1e-4)  # SPEC §4 record scales (records.UE8M0_AMAX_FLOOR)


# ============================================================================================
# insert
# ============================================================================================
@triton.jit
def _insert_rows(slot_ptr, stride_slot, T, num_slots, stride_blk, scale_base,
                 PAGE: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """Tokens of this program -> (token ids int64, in-range mask, valid mask, data row offset,
    scale row offset), offsets in bytes from the cache base, int64. ``PAGE`` is a constexpr:
    the slot split is a shift for power-of-two pages, not a 64-bit division."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < T
    slot = tl.load(slot_ptr + tok * stride_slot, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    blk = slot // PAGE
    off = slot - blk * PAGE
    base = blk * stride_blk
    return tok, in_range, valid, base + off * DATA_BYTES, base + scale_base + off * SCALE_BYTES


@triton.jit
def _ue8m0_quantize_groups(x, SW: tl.constexpr):
    """``C.ue8m0_quantize_groups`` without its clamp: with ``e = ceil(log2(amax / 448))``,
    ``|x| * 2**-e <= 448`` holds exactly (power-of-two scaling of finite values), so the clamp
    to +-448 never changes a finite value (it cost two min/max per element); +-inf saturates in
    the conversion itself."""
    amax = tl.maximum(tl.max(C.finite_abs(x), axis=2), _AMAX_FLOOR)
    e = C.ue8m0_exponent(amax)
    return C.e4m3_nan_fixup(C.f32_to_e4m3_bits(x * C.exp2_int(-e)[:, :, None], SW), x), e


@triton.jit
def _nvfp4_quantize_groups(x, SW: tl.constexpr):
    """``C.nvfp4_quantize_groups`` for bf16-valued ``x [A, G, S]`` fp32 without the per-element
    division: same ``(packed, s_bits)``, bit for bit.

    The reference rounds ``y = RN(x / s)`` to e2m1 by comparing ``|y|`` with the thresholds
    ``t`` in {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5}. Here ``|x|`` is compared with ``t * s``
    instead, which is exact (``s`` has <= 4 significant bits, ``t`` <= 3). The comparisons
    agree: ``|x|`` (bf16, 8 bits) and ``t * s`` (<= 7 bits) are equal or differ by at least
    ~2**-9 relative, far more than the half-ulp by which RN(x / s) could move ``|x| / s``
    across ``t``. The sign is ``x < 0`` (= ``y < 0``: ``|x| / s`` never underflows to 0).
    The code is found with a 3-level comparison tree (3 compares instead of a division and 7
    compares) kept in floats: the bits are 0.0 / 1.0 and the next threshold is an exact FMA
    of them (every sum of these thresholds has <= 8 significant bits), so no predicate has to
    stay live (selects instead cost registers and instructions: perf/NOTES.md, "Insert 288").
    The scale needs no division either (see below).
    """
    a = tl.abs(x)
    amax = tl.max(C.finite_abs(x), axis=2)  # NaN / inf do not set the scale
    # amax * fp32(1/6) can differ from amax / 6 in the last bit, but for every finite bf16
    # amax (all 32640 were checked) the clamped e4m3 scale is the same byte: no IEEE division
    s = amax * 0.16666666666666666
    s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)  # 2**-9 .. 448
    s_bits = C.f32_to_e4m3_bits(s, SW)
    sf = C.e4m3_bits_to_f32(s_bits)
    # per-group thresholds (exact products), broadcast over the group
    t025 = (sf * 0.25)[:, :, None]
    t075 = (sf * 0.75)[:, :, None]
    t125 = (sf * 1.25)[:, :, None]
    t175 = (sf * 1.75)[:, :, None]
    t250 = (sf * 2.5)[:, :, None]
    t350 = (sf * 3.5)[:, :, None]
    t500 = (sf * 5.0)[:, :, None]
    # code bits b2 b1 b0 of the magnitude as 0.0 / 1.0; '>' at a tie keeps the even code,
    # '>=' moves to it. The next threshold is picked with exact FMAs, not selects
    b2 = (a >= t175).to(tl.float32)
    b1 = (a >= t075 + b2 * (t350 - t075)).to(tl.float32)
    tlo = t025 + b1 * (t125 - t025)
    thi = t250 + b1 * (t500 - t250)
    b0 = (a > tlo + b2 * (thi - tlo)).to(tl.float32)
    # the code 0..15 as a float, turned into an int by the 2**23 trick (an exact add, then
    # the low mantissa bits) instead of a float-to-int conversion (a quarter-rate unit)
    cf = b2 * 4.0 + (b1 * 2.0 + (b0 + (x < 0).to(tl.float32) * 8.0))
    c = (cf + 8388608.0).to(tl.int32, bitcast=True) & 15
    lo, hi = tl.split(tl.reshape(c, [x.shape[0], x.shape[1], x.shape[2] // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8), s_bits


@triton.jit
def _insert_fp8_ds_mla_kernel(k_ptr, stride_kt, cache_ptr, stride_blk, scale_base,
                              slot_ptr, stride_slot, T, num_slots,
                              PAGE: tl.constexpr, BLOCK_T: tl.constexpr, SW: tl.constexpr):
    tok, in_range, valid, d_off, s_off = _insert_rows(
        slot_ptr, stride_slot, T, num_slots, stride_blk, scale_base, PAGE, 576, 8, BLOCK_T)
    g = tl.arange(0, 8)
    j = tl.arange(0, 64)
    col = g[:, None] * 64 + j[None, :]  # [8, 64]; group 7 = dims 448..511 (RoPE)
    m3 = valid[:, None, None]
    # k rows are read whatever the slot (masked by range only): the load does not wait for the
    # slot load, so the two DRAM round trips overlap
    x = tl.load(k_ptr + tok[:, None, None] * stride_kt + col[None, :, :],
                mask=in_range[:, None, None], other=0.0)
    bits, e = _ue8m0_quantize_groups(C.bf16_to_f32(x, SW), SW)
    tl.store(cache_ptr + d_off[:, None, None] + col[None, :, :], bits,
             mask=m3 & (g < 7)[None, :, None])
    # RoPE dims: raw bf16 bytes at data + 448 (a [BLOCK_T, 64] tile of its own: storing them
    # from the tile above would need a layout conversion, its 16-element rows being too wide
    # for one 16-byte bf16 store)
    rope = tl.load(k_ptr + tok[:, None] * stride_kt + 448 + j[None, :], mask=in_range[:, None])
    rope_ptr = (cache_ptr + d_off + 448).to(tl.pointer_type(tl.bfloat16))
    tl.store(rope_ptr[:, None] + j[None, :], rope, mask=valid[:, None])
    sb = tl.where(g[None, :] < 7, e + 127, 0).to(tl.uint8)
    tl.store(cache_ptr + s_off[:, None] + g[None, :], sb, mask=valid[:, None])


@triton.jit
def _insert_mxfp8_kernel(k_ptr, stride_kt, cache_ptr, stride_blk, scale_base,
                         slot_ptr, stride_slot, T, num_slots,
                         PAGE: tl.constexpr, BLOCK_T: tl.constexpr, SW: tl.constexpr):
    tok, in_range, valid, d_off, s_off = _insert_rows(
        slot_ptr, stride_slot, T, num_slots, stride_blk, scale_base, PAGE, 512, 16, BLOCK_T)
    g = tl.arange(0, 16)
    col = g[:, None] * 32 + tl.arange(0, 32)[None, :]  # [16, 32]
    x = tl.load(k_ptr + tok[:, None, None] * stride_kt + col[None, :, :],
                mask=in_range[:, None, None], other=0.0)
    bits, e = _ue8m0_quantize_groups(C.bf16_to_f32(x, SW), SW)
    tl.store(cache_ptr + d_off[:, None, None] + col[None, :, :], bits, mask=valid[:, None, None])
    tl.store(cache_ptr + s_off[:, None] + g[None, :], (e + 127).to(tl.uint8), mask=valid[:, None])


@triton.jit
def _insert_nvfp4_kernel(k_ptr, stride_kt, cache_ptr, stride_blk, scale_base,
                         slot_ptr, stride_slot, T, num_slots,
                         PAGE: tl.constexpr, BLOCK_T: tl.constexpr, SW: tl.constexpr):
    tok, in_range, valid, d_off, s_off = _insert_rows(
        slot_ptr, stride_slot, T, num_slots, stride_blk, scale_base, PAGE, 256, 32, BLOCK_T)
    g = tl.arange(0, 32)
    col = g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [32, 16] dims
    x = tl.load(k_ptr + tok[:, None, None] * stride_kt + col[None, :, :],
                mask=in_range[:, None, None], other=0.0)
    packed, s_bits = _nvfp4_quantize_groups(C.bf16_to_f32(x, SW), SW)  # [BLOCK_T, 32, 8]
    # store the 256 data bytes as one flat row (wider vector stores than [32, 8])
    packed = tl.reshape(packed, [BLOCK_T, 256])
    tl.store(cache_ptr + d_off[:, None] + tl.arange(0, 256)[None, :], packed, mask=valid[:, None])
    tl.store(cache_ptr + s_off[:, None] + g[None, :], s_bits, mask=valid[:, None])


_INSERT_KERNELS = {
    FP8_DS_MLA.record_bytes: _insert_fp8_ds_mla_kernel,
    MXFP8.record_bytes: _insert_mxfp8_kernel,
    NVFP4.record_bytes: _insert_nvfp4_kernel,
}


def quantize_and_insert_k_cache(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Quantize ``k [T, 512]`` bf16 (already RoPE'd; any row stride, contiguous last dim) into
    the record format of ``k_cache`` (uint8 ``[num_blocks, page, bytes]`` or
    ``[num_blocks, page, 1, bytes]``, bytes = 584 / 528 / 288) and write the data row and scale
    row of token ``t`` at ``slot_mapping[t]`` (int32 or int64 ``[T]``). Slots ``< 0`` (and past
    the cache) are skipped; no other byte of the cache is written. ``T = 0`` is a no-op.
    NaN / +-inf in ``k`` are encoded by the rule of ``records.quantize_ue8m0_groups``.

    The ``torch.library`` op ``dsv41::quantize_and_insert_k_cache`` (mutates ``k_cache``);
    CPU tensors run the reference when the kernels are not in the Triton interpreter."""
    check_insert_args(k, k_cache, slot_mapping)
    call_op(_insert_op, k, k_cache, slot_mapping)


@torch.library.custom_op("dsv41::quantize_and_insert_k_cache", mutates_args=("k_cache",))
def _insert_op(k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    cache = k_cache.squeeze(2) if k_cache.dim() == 4 else k_cache
    rb = cache.shape[-1]
    kernel = _INSERT_KERNELS[rb]
    if use_reference(k.device, kernel):
        quantize_and_insert_k_cache_ref(k, k_cache, slot_mapping)
        return
    T = k.shape[0]
    if T == 0:
        return
    fmt = RECORD_FORMATS[rb]
    nb, page = cache.shape[0], cache.shape[1]
    block_t = INSERT_BLOCK_T[rb]
    kernel[(cdiv(T, block_t),)](
        k, k.stride(0), cache, cache.stride(0), page * fmt.data_bytes,
        slot_mapping, slot_mapping.stride(0), T, nb * page,
        PAGE=page, BLOCK_T=block_t, SW=is_interpreter(), num_warps=INSERT_NUM_WARPS[rb],
    )


@_insert_op.register_fake
def _insert_fake(k, k_cache, slot_mapping) -> None:
    return None


# ============================================================================================
# gather
# ============================================================================================
@triton.jit
def _gather_rows(b, seq, g, i, bt_ptr, stride_bt0, stride_bt1, max_blocks, num_blocks,
                 n_rows, stride_blk, scale_base,
                 PAGE: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr):
    """Positions ``i`` (int32, rows relative to ``offset``) of request ``b`` -> (valid mask,
    data row offset, scale row offset), offsets int64 bytes from the cache base."""
    pos = seq - g + i
    ok = (i < g) & (i < n_rows) & (pos >= 0)
    pos = tl.where(ok, pos, 0)
    col = pos // PAGE  # constexpr page: a shift, not a division
    ok = ok & (col < max_blocks)
    col = tl.where(ok, col, 0)
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt0 + col.to(tl.int64) * stride_bt1,
                  mask=ok, other=-1)
    ok = ok & (blk >= 0) & (blk < num_blocks)
    blk = tl.where(ok, blk, 0).to(tl.int64)
    off = (pos - col * PAGE).to(tl.int64)
    base = blk * stride_blk
    return ok, base + off * DATA_BYTES, base + scale_base + off * SCALE_BYTES


@triton.jit
def _gather_fp8_ds_mla_kernel(out_ptr, stride_ob, stride_om, cache_ptr, stride_blk, scale_base,
                              seq_ptr, stride_seq, gl_ptr, stride_gl,
                              bt_ptr, stride_bt0, stride_bt1, max_blocks, num_blocks,
                              offset, n_rows,
                              PAGE: tl.constexpr, HAS_GL: tl.constexpr, BLOCK_P: tl.constexpr,
                              SW: tl.constexpr):
    b = tl.program_id(1)
    seq = tl.load(seq_ptr + b.to(tl.int64) * stride_seq)
    if HAS_GL:
        g = tl.load(gl_ptr + b.to(tl.int64) * stride_gl)
    else:
        g = seq
    start = tl.program_id(0) * BLOCK_P
    if start >= g:
        return
    i = start + tl.arange(0, BLOCK_P)
    ok, d_off, s_off = _gather_rows(b, seq, g, i, bt_ptr, stride_bt0, stride_bt1, max_blocks,
                                    num_blocks, n_rows, stride_blk, scale_base, PAGE, 576, 8)
    gr = tl.arange(0, 8)
    j = tl.arange(0, 64)
    col = gr[:, None] * 64 + j[None, :]  # [8, 64]; group 7 = dims 448..511 (RoPE, bf16)
    m3 = ok[:, None, None]
    # the whole 512-byte head of the data row: bytes 448..511 are part of the bf16 tail and
    # are replaced below; one wide load is cheaper than a masked one. All three loads come
    # before any use: the data tile is converted to the store layout through shared memory,
    # and a load placed after that barrier would wait for it.
    q = tl.load(cache_ptr + d_off[:, None, None] + col[None, :, :], mask=m3, other=0)
    rope_ptr = (cache_ptr + d_off + 448).to(tl.pointer_type(tl.bfloat16))
    rope = tl.load(rope_ptr[:, None] + j[None, :], mask=ok[:, None])
    sc = tl.load(cache_ptr + s_off[:, None] + gr[None, :], mask=ok[:, None], other=127)
    v = C.f32_to_bf16(C.e4m3_bits_to_f32(q) * C.ue8m0_to_f32(sc)[:, :, None], SW)
    v = tl.where((gr == 7)[None, :, None], rope[:, None, :], v)
    o_off = b.to(tl.int64) * stride_ob + (offset + i).to(tl.int64) * stride_om
    tl.store(out_ptr + o_off[:, None, None] + col[None, :, :], v, mask=m3)


@triton.jit
def _gather_mxfp8_kernel(out_ptr, stride_ob, stride_om, cache_ptr, stride_blk, scale_base,
                         seq_ptr, stride_seq, gl_ptr, stride_gl,
                         bt_ptr, stride_bt0, stride_bt1, max_blocks, num_blocks,
                         offset, n_rows,
                         PAGE: tl.constexpr, HAS_GL: tl.constexpr, BLOCK_P: tl.constexpr,
                         SW: tl.constexpr):
    b = tl.program_id(1)
    seq = tl.load(seq_ptr + b.to(tl.int64) * stride_seq)
    if HAS_GL:
        g = tl.load(gl_ptr + b.to(tl.int64) * stride_gl)
    else:
        g = seq
    start = tl.program_id(0) * BLOCK_P
    if start >= g:
        return
    i = start + tl.arange(0, BLOCK_P)
    ok, d_off, s_off = _gather_rows(b, seq, g, i, bt_ptr, stride_bt0, stride_bt1, max_blocks,
                                    num_blocks, n_rows, stride_blk, scale_base, PAGE, 512, 16)
    gr = tl.arange(0, 16)
    col = gr[:, None] * 32 + tl.arange(0, 32)[None, :]  # [16, 32]
    m3 = ok[:, None, None]
    q = tl.load(cache_ptr + d_off[:, None, None] + col[None, :, :], mask=m3, other=0)
    sc = tl.load(cache_ptr + s_off[:, None] + gr[None, :], mask=ok[:, None], other=127)
    v = C.f32_to_bf16(C.e4m3_bits_to_f32(q) * C.ue8m0_to_f32(sc)[:, :, None], SW)
    o_off = b.to(tl.int64) * stride_ob + (offset + i).to(tl.int64) * stride_om
    tl.store(out_ptr + o_off[:, None, None] + col[None, :, :], v, mask=m3)


@triton.jit
def _gather_nvfp4_kernel(out_ptr, stride_ob, stride_om, cache_ptr, stride_blk, scale_base,
                         seq_ptr, stride_seq, gl_ptr, stride_gl,
                         bt_ptr, stride_bt0, stride_bt1, max_blocks, num_blocks,
                         offset, n_rows,
                         PAGE: tl.constexpr, HAS_GL: tl.constexpr, BLOCK_P: tl.constexpr,
                         SW: tl.constexpr):
    """Tiles ``[2, 32, BLOCK_P, 4]`` bytes in / ``[2, 32, BLOCK_P, 8]`` bf16 out: half c of
    group g of position p, 4 data bytes -> 8 elements per thread. The decoded bytes are joined
    in registers, so the data, its stores and the lanes (halves, then groups: 128 contiguous
    cache bytes per warp load, 512 output bytes per warp store) share one layout and nothing
    but the small scale tile goes through shared memory. (Dim order: Triton orders equally
    non-contiguous dims by index, so the half dim comes first.)"""
    b = tl.program_id(1)
    seq = tl.load(seq_ptr + b.to(tl.int64) * stride_seq)
    if HAS_GL:
        g = tl.load(gl_ptr + b.to(tl.int64) * stride_gl)
    else:
        g = seq
    start = tl.program_id(0) * BLOCK_P
    if start >= g:
        return
    i = start + tl.arange(0, BLOCK_P)
    ok, d_off, s_off = _gather_rows(b, seq, g, i, bt_ptr, stride_bt0, stride_bt1, max_blocks,
                                    num_blocks, n_rows, stride_blk, scale_base, PAGE, 256, 32)
    gr = tl.arange(0, 32)[None, :, None, None]  # group of 16 elements (8 bytes)
    half = tl.arange(0, 2)[:, None, None, None]
    ok4 = ok[None, None, :, None]
    q = tl.load(cache_ptr + d_off[None, None, :, None] + (gr * 8 + half * 4)
                + tl.arange(0, 4)[None, None, None, :], mask=ok4, other=0).to(tl.int32)
    sc = tl.load(cache_ptr + s_off[None, None, :, None] + gr, mask=ok4, other=0)
    s = C.e4m3_bits_to_f32(sc)
    # e2m1 code m (bit 3 = sign) as fp32: the bits (sign << 31) | (m & 7) << 22 are exactly
    # e2m1(m) * 2**-126 (a subnormal for m < 2, the binade 2**-126 for m >= 2), so one exact
    # multiply by 2**126 gives the value; times the e4m3 scale it is exact too (<= 6
    # significant bits), and so is its bf16 rounding. Even element = low nibble.
    lo = ((q << 22) & 0x01C00000) | ((q << 28) & -2147483648)
    hi = ((q << 18) & 0x01C00000) | ((q << 24) & -2147483648)
    lo = lo.to(tl.float32, bitcast=True) * 8.507059173023462e37 * s  # 2**126
    hi = hi.to(tl.float32, bitcast=True) * 8.507059173023462e37 * s
    v = tl.reshape(tl.join(lo, hi), [2, 32, BLOCK_P, 8])
    v = C.f32_to_bf16(v, SW)
    o_off = b.to(tl.int64) * stride_ob + (offset + i).to(tl.int64) * stride_om
    tl.store(out_ptr + o_off[None, None, :, None] + (gr * 16 + half * 8)
             + tl.arange(0, 8)[None, None, None, :], v, mask=ok4)


_GATHER_KERNELS = {
    FP8_DS_MLA.record_bytes: _gather_fp8_ds_mla_kernel,
    MXFP8.record_bytes: _gather_mxfp8_kernel,
    NVFP4.record_bytes: _gather_nvfp4_kernel,
}


def dequantize_and_gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: Optional[torch.Tensor],
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
) -> None:
    """Dequantize the last ``g`` positions of each request into a bf16 workspace.

    ``out [B, M, 512]`` bf16 (any strides on dims 0-1, contiguous last dim); ``k_cache`` as in
    :func:`quantize_and_insert_k_cache`; ``seq_lens [B]``, ``gather_lens [B]`` (or None:
    ``g = seq_lens[b]``) and ``block_table [B, max_blocks]`` int32; ``block_size`` must equal
    the cache page. Positions ``seq_lens[b] - g .. seq_lens[b] - 1`` are read at
    ``block_table[b, pos // block_size] * block_size + pos % block_size`` and written to
    ``out[b, offset : offset + g]``. Rows ``>= M`` are never written (masked in the kernel,
    no host sync); a negative block id, a block-table column past its end, or a negative
    position leave the row untouched; every other row of ``out`` is untouched.

    The ``torch.library`` op ``dsv41::dequantize_and_gather_k_cache`` (mutates ``out``).
    """
    check_gather_args(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset)
    call_op(_gather_op, out, k_cache, seq_lens, gather_lens,
                                                  block_table, block_size, offset)


@torch.library.custom_op("dsv41::dequantize_and_gather_k_cache", mutates_args=("out",))
def _gather_op(out: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor,
               gather_lens: Optional[torch.Tensor], block_table: torch.Tensor, block_size: int,
               offset: int) -> None:
    cache = k_cache.squeeze(2) if k_cache.dim() == 4 else k_cache
    rb = cache.shape[-1]
    kernel = _GATHER_KERNELS[rb]
    if use_reference(out.device, kernel):
        dequantize_and_gather_k_cache_ref(out, k_cache, seq_lens, gather_lens, block_table,
                                          block_size, offset)
        return
    fmt = RECORD_FORMATS[rb]
    num_reqs, rows = out.shape[0], out.shape[1]
    n_rows = rows - offset
    if num_reqs == 0 or n_rows == 0:
        return
    block_p = GATHER_BLOCK_P[rb]
    has_gl = gather_lens is not None
    gl = gather_lens if has_gl else seq_lens
    page = cache.shape[1]
    kernel[(cdiv(n_rows, block_p), num_reqs)](
        out, out.stride(0), out.stride(1), cache, cache.stride(0), page * fmt.data_bytes,
        seq_lens, seq_lens.stride(0), gl, gl.stride(0),
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
        cache.shape[0], offset, n_rows,
        PAGE=page, HAS_GL=has_gl, BLOCK_P=block_p, SW=is_interpreter(),
        num_warps=GATHER_NUM_WARPS,
    )


@_gather_op.register_fake
def _gather_fake(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset) -> None:
    return None
