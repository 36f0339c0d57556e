"""The index ops of SPEC §5 in Triton (signatures follow vLLM's ``deepseek_v41`` ops).

* :func:`combine_topk_swa_indices` (prefill): per query token, the top-k compressed entries
  then the sliding window, as rows of the flat gathered workspace ``kv.view(-1, 512)``.
* :func:`compute_global_topk_indices_and_lens` (decode): local compressed indices -> paged slot
  ids; survivors packed to the left.

References: :mod:`dsv41_triton.ops.indices_ref`. Outputs are int32; every program writes only
the rows of its own tokens.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._utils import (
    INT_DTYPES,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
    is_interpreter,
    next_power_of_2,
)
from .indices_ref import COMBINED_ALIGN, combined_width

INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------------
# combine_topk_swa_indices
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T", "B", "n_search", "width", "topk", "window", "ratio", "M", "N"])
def _combine_topk_swa_kernel(
    topk_ptr, qsl_ptr, seq_ptr, gather_ptr, out_ptr, lens_ptr,
    T, B, n_search, width, topk, window, ratio, M, N,
    st_t, st_k, so_t, s_lens,
    HAS_GATHER: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tvalid = tok < T
    base = tl.load(qsl_ptr).to(tl.int64)
    total = tl.load(qsl_ptr + B).to(tl.int64) - base
    owned = tvalid & (tok < total)

    # request = the last b in [0, B) with qsl[b] - base <= tok (skips empty requests)
    lo = tl.zeros((BLOCK_T,), dtype=tl.int32)
    hi = lo + (B - 1)
    for _ in range(n_search):
        act = lo < hi
        mid = (lo + hi + 1) // 2
        start = tl.load(qsl_ptr + mid, mask=act, other=0).to(tl.int64) - base
        go = act & (start <= tok)
        lo = tl.where(go, mid, lo)
        hi = tl.where(act & (start > tok), mid - 1, hi)
    req = lo

    qs = tl.load(qsl_ptr + req, mask=owned, other=0).to(tl.int64) - base
    qe = tl.load(qsl_ptr + req + 1, mask=owned, other=0).to(tl.int64) - base
    sl = tl.load(seq_ptr + req, mask=owned, other=0).to(tl.int64)
    if HAS_GATHER:
        gl = tl.load(gather_ptr + req, mask=owned, other=0).to(tl.int64)
    else:
        gl = sl
    pos = sl - (qe - qs) + tok - qs
    # clamp before dividing: integer division of negatives differs between backends.
    # (ratio >= 1 here; the host passes topk = 0 for ratio 0)
    topk_len = tl.minimum(tl.maximum(pos + 1, 0) // ratio, topk)
    topk_len = tl.where(owned, topk_len, 0)
    gs = sl - gl
    swa_start = tl.maximum(tl.maximum(pos - window + 1, 0), gs)
    swa_len = tl.where(owned, tl.maximum(pos - swa_start + 1, 0), 0)
    n_used = topk_len + swa_len
    rbase = req.to(tl.int64) * M

    t64 = tok.to(tl.int64)[:, None]
    tl_2 = topk_len[:, None]
    for c0 in range(0, width, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)[None, :]
        in_topk = cols < tl_2
        e = tl.load(topk_ptr + t64 * st_t + cols.to(tl.int64) * st_k,
                    mask=in_topk & tvalid[:, None], other=-1).to(tl.int64)
        topk_val = tl.where((e >= 0) & (e < N), rbase[:, None] + e, -1)
        swa_val = rbase[:, None] + N + swa_start[:, None] + (cols - tl_2) - gs[:, None]
        val = tl.where(in_topk, topk_val, tl.where(cols < n_used[:, None], swa_val, -1))
        tl.store(out_ptr + t64 * so_t + cols, val.to(tl.int32), mask=tvalid[:, None])
    tl.store(lens_ptr + tok.to(tl.int64) * s_lens, n_used.to(tl.int32), mask=tvalid)


def _check_index_vector(name, t, length=None, min_length=None):
    check_tensor(name, t, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    if length is not None:
        check_shape(name, t, [length])
    if min_length is not None and t.shape[0] < min_length:
        raise ValueError(f"{name}: expected at least {min_length} entries, got {t.shape[0]}")
    return t


def combine_topk_swa_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: Optional[torch.Tensor],
    window_size: int,
    compress_ratio: int,
    topk: int,
    M: int,
    N: int,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill indices into the flat workspace (SPEC §5).

    Args:
        topk_indices: ``[T, K]`` int32 (int64 accepted), the indexer's local compressed indices
            per query token; ``K >= topk`` when ``compress_ratio > 0`` (unused otherwise).
        query_start_loc: ``[B+1]`` int, cumulative query starts (``[0]`` may be non-zero; the
            tokens are ``query_start_loc[b] - query_start_loc[0] ..``). Tokens ``t >=
            query_start_loc[B] - query_start_loc[0]`` get a ``-1`` row and length 0.
        seq_lens: ``[B]`` int, total length of each request (its queries are the last ones).
        gather_lens: ``[B]`` int or None (= ``seq_lens``): the gathered window rows of request
            ``b`` are positions ``seq_len - gather_len .. seq_len - 1`` at ``M*b + N + ..``.
        window_size: ``W`` (the query's own token included); ``compress_ratio``: 0, 1, 2, ...;
        topk: top-k entries per query; ``M``: workspace rows per request; ``N``: compressed
            rows per request (a top-k entry ``e`` is valid when ``0 <= e < N``).
        out: optional ``(indices [T, width] int32, lens [T] int32)`` to fill.

    Returns ``(indices [T, round_up(topk + W, 128)] int32, lens [T] int32)``; the whole row is
    written (``-1`` past ``lens``; invalid top-k entries are ``-1`` but counted).
    """
    check_tensor("topk_indices", topk_indices, dtypes=INT_DTYPES, ndims=2, contiguous_last=False)
    T, K = topk_indices.shape
    _check_index_vector("query_start_loc", query_start_loc, min_length=1)
    B = query_start_loc.shape[0] - 1
    _check_index_vector("seq_lens", seq_lens, length=B)
    if gather_lens is not None:
        _check_index_vector("gather_lens", gather_lens, length=B)
    check_int("window_size", window_size, lo=0)
    check_int("compress_ratio", compress_ratio, lo=0)
    check_int("topk", topk, lo=0)
    check_int("M", M, lo=0)
    check_int("N", N, lo=0)
    if compress_ratio > 0 and K < topk:
        raise ValueError(f"topk_indices: expected at least topk = {topk} columns, got shape {(T, K)}")
    if M * max(B, 1) + N > INT32_MAX:
        raise ValueError(f"M: workspace rows M*B + N = {M * B + N} do not fit int32 indices")
    width = combined_width(topk, window_size)
    dev = check_same_device(
        topk_indices=topk_indices, query_start_loc=query_start_loc, seq_lens=seq_lens,
        gather_lens=gather_lens,
    )
    if out is None:
        indices = torch.empty(T, width, dtype=torch.int32, device=dev)
        lens = torch.empty(T, dtype=torch.int32, device=dev)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out: expected a tuple (indices, lens)")
        indices, lens = out
        check_tensor("out[0] (indices)", indices, dtypes=(torch.int32,), ndims=2)
        check_shape("out[0] (indices)", indices, [T, width])
        check_tensor("out[1] (lens)", lens, dtypes=(torch.int32,), ndims=1, contiguous_last=False)
        check_shape("out[1] (lens)", lens, [T])
        check_same_device(topk_indices=topk_indices, out_indices=indices, out_lens=lens)
    if T == 0:
        return indices, lens
    block_t = 32 if is_interpreter() else 4
    grid = (triton.cdiv(T, block_t),)
    _combine_topk_swa_kernel[grid](
        topk_indices, query_start_loc, seq_lens,
        gather_lens if gather_lens is not None else seq_lens,
        indices, lens,
        T, B, max(B - 1, 0).bit_length(), width,
        topk if compress_ratio > 0 else 0, window_size, max(compress_ratio, 1), M, N,
        topk_indices.stride(0), topk_indices.stride(1), indices.stride(0), lens.stride(0),
        HAS_GATHER=gather_lens is not None,
        BLOCK_T=block_t,
        BLOCK_C=COMBINED_ALIGN,
        num_warps=4,
    )
    return indices, lens


# --------------------------------------------------------------------------------------------
# compute_global_topk_indices_and_lens
# --------------------------------------------------------------------------------------------
@triton.jit
def _global_topk_kernel(
    local_ptr, req_ptr, bt_ptr, valid_ptr, out_ptr, lens_ptr,
    K, R, MB, block_size,
    sl_t, sl_k, s_req, sb_r, sb_c, s_valid, so_t,
    HAS_VALID: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + t * s_req).to(tl.int64)
    req_ok = (req >= 0) & (req < R)
    req_c = tl.where(req_ok, req, 0)
    # a comparison (not `req_ok & tile`): the interpreter turns scalar-bool & bool-tile into
    # an int tile
    lim = tl.where(req_ok, MB, 0)
    row_out = out_ptr + t * so_t
    count = tl.zeros((), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        i = tl.load(local_ptr + t * sl_t + k.to(tl.int64) * sl_k, mask=km, other=-1).to(tl.int64)
        col = tl.maximum(i, 0) // block_size
        ok = km & (i >= 0) & (col < lim)
        blk = tl.load(bt_ptr + req_c * sb_r + col * sb_c, mask=ok, other=-1).to(tl.int64)
        slot = blk * block_size + tl.maximum(i, 0) % block_size
        ok = ok & (slot >= 0)
        f = ok.to(tl.int32)
        dest = count + tl.cumsum(f, axis=0) - 1  # left-packed position of each survivor
        tl.store(row_out + dest, slot.to(tl.int32), mask=ok)
        count += tl.sum(f, axis=0)
    # the tail after the survivors (disjoint from the addresses written above)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        tl.store(row_out + k, tl.full((BLOCK_K,), -1, tl.int32), mask=(k < K) & (k >= count))
    if HAS_VALID:
        v = tl.load(valid_ptr + t * s_valid)
        count = tl.where(v != 0, count, 0)
    tl.store(lens_ptr + t, count)


def compute_global_topk_indices_and_lens(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    is_valid_token: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode: local compressed indices -> paged slot ids (SPEC §5, stricter than vLLM).

    Args:
        topk_indices: ``[T, K]`` int32 (int64 accepted), local indices, ``-1`` = none.
        token_to_req_indices: ``[>= T]`` int, the request (row of ``block_table``) of each
            token; only the first ``T`` entries are read.
        block_table: ``[R, max_blocks]`` int32/int64 block ids.
        block_size: tokens per block (>= 1).
        is_valid_token: ``[>= T]`` bool (or int, non-zero = valid), or None (all valid).

    Local index ``i >= 0`` becomes ``block_table[req, i // bs] * bs + i % bs``. It is dropped
    when the request is outside ``[0, R)``, the block column is ``>= max_blocks``, or the slot
    is negative (a negative block id). Survivors are packed to the LEFT in their original
    order, ``-1`` after them. ``lens`` counts them; 0 for invalid tokens (whose row is
    translated all the same).

    Returns ``(indices [T, K] int32, lens [T] int32)``.
    """
    check_tensor("topk_indices", topk_indices, dtypes=INT_DTYPES, ndims=2, contiguous_last=False)
    T, K = topk_indices.shape
    _check_index_vector("token_to_req_indices", token_to_req_indices, min_length=T)
    check_tensor("block_table", block_table, dtypes=INT_DTYPES, ndims=2, contiguous_last=False)
    check_int("block_size", block_size, lo=1)
    if is_valid_token is not None:
        check_tensor("is_valid_token", is_valid_token,
                     dtypes=(torch.bool, torch.uint8, torch.int32, torch.int64), ndims=1,
                     contiguous_last=False)
        if is_valid_token.shape[0] < T:
            raise ValueError(f"is_valid_token: expected at least {T} entries, got {is_valid_token.shape[0]}")
    dev = check_same_device(
        topk_indices=topk_indices, token_to_req_indices=token_to_req_indices,
        block_table=block_table, is_valid_token=is_valid_token,
    )
    indices = torch.empty(T, K, dtype=torch.int32, device=dev)
    lens = torch.empty(T, dtype=torch.int32, device=dev)
    if T == 0:
        return indices, lens
    R, MB = block_table.shape
    block_k = min(next_power_of_2(max(K, 1)), 1024)
    _global_topk_kernel[(T,)](
        topk_indices, token_to_req_indices, block_table,
        is_valid_token if is_valid_token is not None else token_to_req_indices,
        indices, lens,
        K, R, MB, block_size,
        topk_indices.stride(0), topk_indices.stride(1), token_to_req_indices.stride(0),
        block_table.stride(0), block_table.stride(1),
        is_valid_token.stride(0) if is_valid_token is not None else 0,
        indices.stride(0),
        HAS_VALID=is_valid_token is not None,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return indices, lens
