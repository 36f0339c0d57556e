"""Lightning-indexer ops in Triton: the index-key store, the index logits and the top-k.

Rules and the cache layout: :mod:`dsv41_triton.ops.indexer_ref` (the reference beside these
kernels) and docs/compressor_indexer.md §3-§4.

* :func:`quantize_and_insert_index_k` -- ``k [T, dim]`` rows (RoPE'd, Hadamard'd for V4) ->
  FP4 simulation (optional) -> an e4m3 row + fp32 row scale at ``slot_mapping[t]``. Bit-equal
  to the reference.
* :func:`index_logits` -- ``out[t, j] = sum_h relu(q[t,h] . k_j) * w[t,h]`` over the cached
  keys of the token's request, ``-inf`` for entries not visible. One program per (token,
  ``LOGITS_BLOCKS_PER_PROGRAM`` tiles of ``BLOCK_N`` entries): the query heads are loaded once,
  the keys are decoded e4m3 -> bf16 (exact) and multiplied with them by ``tl.dot``. fp32 accumulation; equal to the float64 oracle within fp32
  rounding (sums in another order).
* :func:`index_topk` -- radix select: one program per row, one pass to histogram the top 8
  bits of an order-preserving uint32 key of every valid logit, three more for the next bytes
  (only elements matching the prefix so far), then one pass that writes the selected entry ids
  in ascending order (ties at the threshold go to the lower entries). Bit-equal to the
  reference. :func:`index_topk_torch` does the same with ``torch.topk`` (ties: any).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import cdiv, is_interpreter, next_power_of_2, use_reference
from . import _codecs as C
from .indexer_ref import (
    INDEX_ROW_SHIFT,
    ROW_AMAX_FLOOR,
    check_index_insert_args,
    check_logits_args,
    check_topk_args,
    index_logits_ref,
    index_topk_ref,
    quantize_and_insert_index_k_ref,
)

__all__ = ["index_logits", "index_topk", "index_topk_torch", "quantize_and_insert_index_k",
           "select_topk"]

INSERT_BLOCK_T = 8
LOGITS_BLOCK_N = 64
LOGITS_NUM_WARPS = 8
#: entry tiles per logits program: the token's query tile (H x 128 bf16, 16 KB at 64 heads) is
#: loaded once per program instead of once per 64 keys
LOGITS_BLOCKS_PER_PROGRAM = 8
TOPK_BLOCK = 1024
TOPK_NUM_WARPS = 8
#: :func:`select_topk` uses ``torch.topk`` for rows at least this wide when there are fewer
#: rows than this (the radix kernel runs one program per row: few long rows leave most SMs
#: idle). Width from the H200 crossover (perf/NOTES.md, "Indexer on the H200"); the row
#: bound is not measured yet.
TORCH_TOPK_MIN_WIDTH = 1 << 15
TORCH_TOPK_MAX_ROWS = 264

# globals read inside @triton.jit code must be constexprs
_ROW_SHIFT = tl.constexpr(INDEX_ROW_SHIFT)
_ROW_AMAX_FLOOR = tl.constexpr(ROW_AMAX_FLOOR)
_FP4_AMAX_FLOOR = tl.constexpr(6.0 * 2.0 ** -126)


# ============================================================================================
# index-key store
# ============================================================================================
@triton.jit
def _fp4_exponent(amax):
    """Exact ``ceil(log2(amax / 6))`` (int32) for positive normal fp32 ``amax``:
    ``amax = 1.m * 2**E`` -> ``E - 2`` when ``1.m <= 1.5``, else ``E - 1``."""
    b = amax.to(tl.int32, bitcast=True)
    return ((b >> 23) & 0xFF) - 129 + ((b & 0x7FFFFF) > 0x400000).to(tl.int32)


@triton.jit
def _index_insert_kernel(k_ptr, stride_kt, cache_ptr, stride_blk, slot_ptr, stride_slot,
                         T, num_slots,
                         DIM: tl.constexpr, PAGE: tl.constexpr, FP4: tl.constexpr,
                         K_BF16: tl.constexpr, BLOCK_T: tl.constexpr, SW: tl.constexpr):
    G: tl.constexpr = DIM // 32
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    slot = tl.load(slot_ptr + t.to(tl.int64) * stride_slot, mask=tm, other=-1).to(tl.int64)
    valid = tm & (slot >= 0) & (slot < num_slots)
    d = tl.arange(0, DIM)
    x = tl.load(k_ptr + t.to(tl.int64)[:, None] * stride_kt + d[None, :], mask=valid[:, None], other=0.0)
    if K_BF16:
        x = C.bf16_to_f32(x, SW)
    else:
        x = x.to(tl.float32)
    if FP4:
        xg = tl.reshape(x, [BLOCK_T, G, 32])
        amax = tl.maximum(tl.max(tl.abs(xg), axis=2), _FP4_AMAX_FLOOR)
        e = _fp4_exponent(amax)  # [BLOCK_T, G]
        y = xg * C.exp2_int(-e)[:, :, None]
        y = tl.minimum(tl.maximum(y, -6.0), 6.0)
        v = C.e2m1_code_to_f32(C.f32_to_e2m1_code(y))  # in units of the group scale
        emax = tl.max(e, axis=1)  # [BLOCK_T]
        shift = tl.maximum(e - emax[:, None] + _ROW_SHIFT, -126)
        val = tl.reshape(v * C.exp2_int(shift)[:, :, None], [BLOCK_T, DIM])
        scale = C.exp2_int(emax) * 0.015625  # 2**(emax - 6), subnormal-safe
    else:
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), _ROW_AMAX_FLOOR)
        e = C.ue8m0_exponent(amax)
        val = x * C.exp2_int(-e)[:, None]
        val = tl.minimum(tl.maximum(val, -448.0), 448.0)
        scale = C.exp2_int(e)
    bits = C.f32_to_e4m3_bits(val, SW)
    blk = slot // PAGE
    off = slot % PAGE
    base = cache_ptr + blk * stride_blk
    tl.store(base[:, None] + off[:, None] * DIM + d[None, :], bits, mask=valid[:, None])
    sp = (base + PAGE * DIM + off * 4).to(tl.pointer_type(tl.float32))
    tl.store(sp, scale, mask=valid)


def quantize_and_insert_index_k(k: torch.Tensor, index_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, fp4: bool = True) -> None:
    """Write ``k [T, dim]`` (bf16/fp16/fp32, last dim contiguous) into the index-key cache
    ``uint8 [num_blocks, page, dim + 4]`` at ``slot_mapping [T]`` (int32/int64; ``< 0`` and
    past-the-cache slots skipped). ``fp4``: FP4-simulate the row first (the V4/V4.1 rule);
    else a plain FP8 row with a power-of-two scale."""
    cache, dim = check_index_insert_args(k, index_cache, slot_mapping, fp4)
    if use_reference(k.device, _index_insert_kernel):
        quantize_and_insert_index_k_ref(k, index_cache, slot_mapping, fp4)
        return
    T = k.shape[0]
    if T == 0:
        return
    nb, page = cache.shape[0], cache.shape[1]
    _index_insert_kernel[(cdiv(T, INSERT_BLOCK_T),)](
        k, k.stride(0), cache, cache.stride(0), slot_mapping, slot_mapping.stride(0), T, nb * page,
        DIM=dim, PAGE=page, FP4=bool(fp4), K_BF16=k.dtype == torch.bfloat16,
        BLOCK_T=INSERT_BLOCK_T, SW=is_interpreter(), num_warps=4,
    )


# ============================================================================================
# logits
# ============================================================================================
@triton.jit
def _index_logits_kernel(q_ptr, sq_t, sq_h, w_ptr, sw_t, cache_ptr, stride_blk, num_blocks,
                         bt_ptr, sbt_b, sbt_c, n_req, max_cols, req_ptr, s_req, vis_ptr, s_vis,
                         out_ptr, so_t, N, H,
                         DIM: tl.constexpr, PAGE: tl.constexpr, HP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, SW: tl.constexpr):
    """One token, ``BLOCKS`` consecutive tiles of ``BLOCK_N`` entries: the query heads and
    weights are loaded once and the key tiles streamed past them."""
    t = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + t * s_req).to(tl.int64)
    vis = tl.load(vis_ptr + t * s_vis)
    vis = tl.where((req >= 0) & (req < n_req), vis, 0)
    o_row = out_ptr + t * so_t
    neg = tl.full([BLOCK_N], float("-inf"), tl.float32)
    d = tl.arange(0, DIM)
    h = tl.arange(0, HP)
    hm = h < H
    q = tl.load(q_ptr + t * sq_t + h.to(tl.int64)[:, None] * sq_h + d[None, :], mask=hm[:, None], other=0.0)
    if SW:  # the interpreter's bf16 dot is not usable: fp32 operands (same values)
        q = C.bf16_to_f32(q, SW)
    w = tl.load(w_ptr + t * sw_t + h, mask=hm, other=0.0)
    for it in range(BLOCKS):
        j0 = (tl.program_id(1) * BLOCKS + it) * BLOCK_N
        j = j0 + tl.arange(0, BLOCK_N)
        jm = j < N
        if j0 >= vis:
            tl.store(o_row + j, neg, mask=jm)
        else:
            col = j // PAGE
            live = jm & (j < vis) & (col < max_cols)
            blk = tl.load(bt_ptr + req * sbt_b + col.to(tl.int64) * sbt_c, mask=live, other=-1).to(tl.int64)
            live = live & (blk >= 0) & (blk < num_blocks)
            base = cache_ptr + blk * stride_blk
            off = (j % PAGE).to(tl.int64)
            kb = tl.load(base[:, None] + off[:, None] * DIM + d[None, :], mask=live[:, None], other=0)
            k = C.e4m3_bits_to_f32(kb)
            ks = tl.load((base + PAGE * DIM + off * 4).to(tl.pointer_type(tl.float32)), mask=live, other=0.0)
            if SW:
                s = tl.dot(q, tl.trans(k))
            else:  # e4m3 values are exact in bf16
                s = tl.dot(q, tl.trans(k.to(tl.bfloat16)))  # [HP, BLOCK_N] fp32
            s = tl.maximum(s, 0.0) * w[:, None]
            logit = tl.sum(s, axis=0) * ks
            tl.store(o_row + j, tl.where(live, logit, neg), mask=jm)


def index_logits(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                 block_table: torch.Tensor, token_to_req: torch.Tensor, visible_lens: torch.Tensor,
                 out: torch.Tensor | None = None, max_len: int | None = None) -> torch.Tensor:
    """Index logits over the paged index-key cache.

    Args:
        q: ``[T, H, dim]`` bf16 index queries (RoPE'd, FP4-simulated; any H >= 1).
        weights: ``[T, H]`` fp32 head weights (``weights_proj x * dim**-0.5 * H**-0.5``).
        index_cache: ``uint8 [num_blocks, page, dim + 4]``.
        block_table: ``[B, max_blocks]`` int32 (entry ``j`` of request ``b`` is slot
            ``block_table[b, j // page] * page + j % page``).
        token_to_req: ``[T]`` int32/int64 request of each token (out of range -> no entry).
        visible_lens: ``[T]`` int32/int64 entries visible to the token
            (``min((pos + 1) // ratio, entries)``).
        out: optional ``[T, N]`` fp32 (any row stride); else ``max_len`` gives ``N``.
    Returns:
        ``out``: logits for ``j < visible_lens[t]`` with a block, ``-inf`` for every other ``j < N``.
    """
    cache, dim = check_logits_args(q, weights, index_cache, block_table, token_to_req,
                                   visible_lens, out, max_len)
    if use_reference(q.device, _index_logits_kernel):
        return index_logits_ref(q, weights, index_cache, block_table, token_to_req, visible_lens,
                                out, max_len)
    T, H, _ = q.shape
    if out is None:
        out = torch.empty(T, max_len, dtype=torch.float32, device=q.device)
    N = out.shape[1]
    if T == 0 or N == 0:
        return out
    hp = max(16, next_power_of_2(H))
    blocks = max(1, min(LOGITS_BLOCKS_PER_PROGRAM, cdiv(N, LOGITS_BLOCK_N)))
    _index_logits_kernel[(T, cdiv(N, LOGITS_BLOCK_N * blocks))](
        q, q.stride(0), q.stride(1), weights, weights.stride(0), cache, cache.stride(0), cache.shape[0],
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[0],
        block_table.shape[1], token_to_req, token_to_req.stride(0), visible_lens,
        visible_lens.stride(0), out, out.stride(0), N, H,
        DIM=dim, PAGE=cache.shape[1], HP=hp, BLOCK_N=LOGITS_BLOCK_N, BLOCKS=blocks,
        SW=is_interpreter(),
        num_warps=LOGITS_NUM_WARPS,
    )
    return out


# ============================================================================================
# top-k
# ============================================================================================
@triton.jit
def _sort_key(x, valid):
    """Order-preserving uint32 key of fp32 ``x``; 0 for invalid lanes (below every valid one)."""
    u = x.to(tl.uint32, bitcast=True)
    key = tl.where((u >> 31) == 1, ~u, u | 0x80000000)
    return tl.where(valid, key, 0)


@triton.jit
def _hist_pass(row, n, prefix, SHIFT: tl.constexpr, MATCH_PREFIX: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram ``[256]`` of byte ``SHIFT`` of the keys of the valid logits of ``row[:n]``
    (only keys whose bytes above ``SHIFT`` equal ``prefix``'s when ``MATCH_PREFIX``)."""
    ar = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], tl.int32)
    for start in range(0, n, BLOCK):
        j = start + ar
        m = j < n
        x = tl.load(row + j, mask=m, other=float("-inf"))
        key = _sort_key(x, m & (x > float("-inf")))  # NaN fails the compare too
        match = key > 0
        if MATCH_PREFIX:
            match = match & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        digit = tl.where(match, ((key >> SHIFT) & 0xFF).to(tl.int32), 0)
        misses = BLOCK - tl.sum(match.to(tl.int32))
        hist += tl.histogram(digit, 256) - tl.where(bins == 0, misses, 0)
    return hist


@triton.jit
def _radix_step(hist, remaining, prefix, SHIFT: tl.constexpr):
    """Pick the byte holding the ``remaining``-th largest key; return the new prefix and the
    rank still needed inside that byte."""
    bins = tl.arange(0, 256)
    above = tl.sum(hist) - tl.cumsum(hist, 0)  # keys with a larger byte
    b = tl.max(tl.where(above + hist >= remaining, bins, 0))
    remaining = remaining - tl.sum(tl.where(bins == b, above, 0))
    return prefix | (b.to(tl.uint32) << SHIFT), remaining


@triton.jit
def _index_topk_kernel(x_ptr, sx_t, len_ptr, s_len, out_ptr, so_t, N, K,
                       BLOCK: tl.constexpr, KBLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + t * sx_t
    n = tl.minimum(tl.maximum(tl.load(len_ptr + t * s_len), 0), N)
    # radix select of the K-th largest key, 8 bits per pass, highest byte first
    prefix = tl.zeros([], tl.uint32)
    hist = _hist_pass(row, n, prefix, 24, False, BLOCK)
    n_valid = tl.sum(hist)
    prefix, remaining = _radix_step(hist, K, prefix, 24)
    if n_valid > K:
        for p in tl.static_range(1, 4):
            hist = _hist_pass(row, n, prefix, 24 - 8 * p, True, BLOCK)
            prefix, remaining = _radix_step(hist, remaining, prefix, 24 - 8 * p)
    # every valid key is >= 1: threshold 0 takes them all
    thr = tl.where(n_valid > K, prefix, tl.zeros([], tl.uint32))
    need_ties = tl.where(n_valid > K, remaining, 0)
    # write the selected ids in ascending order
    ar = tl.arange(0, BLOCK)
    taken = 0
    ties = 0
    o_row = out_ptr + t * so_t
    for start in range(0, n, BLOCK):
        j = start + ar
        m = j < n
        x = tl.load(row + j, mask=m, other=float("-inf"))
        key = _sort_key(x, m & (x > float("-inf")))  # NaN fails the compare too
        gt = (key > thr) & (key > 0)
        eq = (key == thr) & (key > 0)
        eqi = eq.to(tl.int32)
        eq_rank = ties + tl.cumsum(eqi, 0) - eqi
        take = gt | (eq & (eq_rank < need_ties))
        ti = take.to(tl.int32)
        pos = taken + tl.cumsum(ti, 0) - ti
        tl.store(o_row + pos, j, mask=take)
        taken += tl.sum(ti)
        ties += tl.sum(eqi)
    for start in range(0, K, KBLOCK):
        c = start + tl.arange(0, KBLOCK)
        tl.store(o_row + c, tl.full([KBLOCK], -1, tl.int32), mask=(c < K) & (c >= taken))


def index_topk(logits: torch.Tensor, lens: torch.Tensor, k: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Top-``k`` entry ids per row of ``logits [T, N]`` fp32 (any row stride) among the finite
    values of ``logits[t, :lens[t]]``, ties to the lower entry, ascending, ``-1`` padded ->
    ``out [T, k]`` int32 (contiguous rows)."""
    check_topk_args(logits, lens, k, out)
    if use_reference(logits.device, _index_topk_kernel):
        return index_topk_ref(logits, lens, k, out)
    T, N = logits.shape
    if out is None:
        out = torch.empty(T, k, dtype=torch.int32, device=logits.device)
    elif out.stride(1) != 1:
        raise ValueError("out: the last dim must be contiguous")
    if T == 0:
        return out
    if logits.stride(1) != 1 and N > 1:
        raise ValueError("logits: the last dim must be contiguous")
    _index_topk_kernel[(T,)](
        logits, logits.stride(0), lens, lens.stride(0), out, out.stride(0), N, k,
        BLOCK=TOPK_BLOCK, KBLOCK=min(1024, next_power_of_2(k)), num_warps=TOPK_NUM_WARPS,
    )
    return out


def index_topk_torch(logits: torch.Tensor, lens: torch.Tensor, k: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`index_topk` through ``torch.topk`` (the same set where values are not tied at the
    threshold; the order among tied values is torch's)."""
    check_topk_args(logits, lens, k, out)
    T, N = logits.shape
    j = torch.arange(N, device=logits.device)
    valid = (j[None, :] < lens.long()[:, None]) & (logits > float("-inf")) & ~logits.isnan()
    kk = min(k, N)
    masked = torch.where(valid, logits, torch.full_like(logits, float("-inf")))
    val, idx = torch.topk(masked, kk, dim=1)
    idx = torch.where(val > float("-inf"), idx, torch.full_like(idx, N)).sort(1).values
    idx = torch.where(idx >= N, torch.full_like(idx, -1), idx).to(torch.int32)
    if kk < k:
        idx = torch.cat([idx, idx.new_full((T, k - kk), -1)], 1)
    if out is None:
        return idx
    out.copy_(idx)
    return out


def select_topk(logits: torch.Tensor, lens: torch.Tensor, k: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`index_topk` or, for few wide rows on a GPU, :func:`index_topk_torch`
    (``TORCH_TOPK_MIN_WIDTH`` / ``TORCH_TOPK_MAX_ROWS``): the same set unless values tie at the
    threshold."""
    check_topk_args(logits, lens, k, out)
    T, N = logits.shape
    if logits.is_cuda and N >= TORCH_TOPK_MIN_WIDTH and T < TORCH_TOPK_MAX_ROWS:
        return index_topk_torch(logits, lens, k, out)
    return index_topk(logits, lens, k, out)
