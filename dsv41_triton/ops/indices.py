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
    call_op,
    INT_DTYPES,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
    is_interpreter,
    next_power_of_2,
    use_reference,
)
from .indices_ref import (COMBINED_ALIGN, combine_topk_swa_indices_ref, combined_width,
                          compute_global_topk_indices_and_lens_ref)

COMBINE_ALIGN_C = COMBINED_ALIGN  # columns per step of the combine kernel

INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------------
# combine_topk_swa_indices
# --------------------------------------------------------------------------------------------
#: tokens per program of the combine kernel (one warp per token row)
COMBINE_BLOCK_T = 4
COMBINE_NUM_WARPS = 4
#: most top-k columns loaded up front (before any store); wider top-k rows load the rest in
#: the column loop
COMBINE_MAX_TOPK_COLS = 1024


# `width` (a multiple of 128) and `topk` stay specialized: their divisibility by 16 is what lets
# the masks `cols < width` / `cols < topk` keep 16-byte vector stores and loads
@triton.jit(do_not_specialize=["T", "B", "n_search", "window", "ratio", "M", "N"])
def _combine_topk_swa_kernel(
    topk_ptr, qsl_ptr, seq_ptr, gather_ptr, out_ptr, lens_ptr, win_ptr,
    T, B, n_search, width, topk, window, ratio, M, N,
    st_t, st_k, so_t, s_lens, s_win,
    HAS_GATHER: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NCK: tl.constexpr,
):
    """BLOCK_T token rows per program. The first ``NCK * BLOCK_C`` columns (the top-k part,
    NCK = 0 when there is none) come from one ``[BLOCK_T, NCK, BLOCK_C]`` tile whose top-k
    entries are loaded first, before the request lookup and before any store, so no load waits
    behind another; the rest of the row goes in ``BLOCK_C``-column steps. Values are formed in
    int32 (wrapping, so bit-equal to int64 then truncated; the host checks workspace rows fit).
    ``HAS_WINDOW``: also rows 0 / 1 / 2 of ``win_ptr`` (stride ``s_win``): the window's first
    workspace row, its length and the top-k length."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tvalid = tok < T
    t64 = tok.to(tl.int64)
    if NCK > 0:
        ca = tl.arange(0, NCK)[None, :, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, None, :]
        # only `cols < topk` bounds the load: it must not wait for topk_len (the request chain)
        ea = tl.load(topk_ptr + t64[:, None, None] * st_t + ca.to(tl.int64) * st_k,
                     mask=(ca < topk) & (tok < T)[:, None, None], other=-1)
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
    n_used = topk_len + swa_len  # <= topk + window
    rbase = req * M  # int32: M * B + N fits (host check)
    # window entry in column c: rbase + N + swa_start + (c - topk_len) - gs (int32 wraps)
    swa_base = (rbase + N + swa_start - topk_len - gs).to(tl.int32)
    tlen = topk_len.to(tl.int32)
    nused = n_used.to(tl.int32)

    # per-token values as [BLOCK_T, 1, 1]: both column parts share one layout (4 small
    # layout conversions in all)
    row_out = (out_ptr + t64 * so_t)[:, None, None]
    rb3 = rbase[:, None, None]
    tlen3 = tlen[:, None, None]
    nused3 = nused[:, None, None]
    swa3 = swa_base[:, None, None]
    tv3 = tvalid[:, None, None]
    if NCK > 0:
        va = tl.where((ea >= 0) & (ea < N), rb3 + ea, -1).to(tl.int32)
        va = tl.where(ca < tlen3, va, tl.where(ca < nused3, swa3 + ca, -1))
        tl.store(row_out + ca, va, mask=(ca < width) & tv3)
    for c0 in range(NCK * BLOCK_C, width, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)[None, None, :]
        in_topk = cols < tlen3
        e = tl.load(topk_ptr + t64[:, None, None] * st_t + cols.to(tl.int64) * st_k,
                    mask=in_topk & tv3, other=-1)
        val = tl.where((e >= 0) & (e < N), rb3 + e, -1).to(tl.int32)
        val = tl.where(in_topk, val, tl.where(cols < nused3, swa3 + cols, -1))
        tl.store(row_out + cols, val, mask=tv3)
    tl.store(lens_ptr + t64 * s_lens, nused, mask=tvalid)
    if HAS_WINDOW:
        tl.store(win_ptr + t64, tl.where(owned, swa_base + tlen, 0), mask=tvalid)
        tl.store(win_ptr + s_win + t64, swa_len.to(tl.int32), mask=tvalid)
        tl.store(win_ptr + 2 * s_win + t64, tlen, mask=tvalid)


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
    window_rows: Optional[torch.Tensor] = None,
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
        window_rows: optional ``[3, T]`` int32 to fill with each token's window as a row range
            of the workspace and its top-k length: ``window_rows[0] .. [0] + [1] - 1`` are the
            rows of columns ``[2] .. lens - 1`` (0 / 0 / 0 for tokens past the last request).
            This is the hint :func:`~dsv41_triton.attention.prefill_shared.
            sparse_mla_prefill_shared_window` takes.

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
    if N > M:
        raise ValueError(f"N: expected <= M = {M} (a request's compressed rows are the first N of "
                         f"its M workspace rows), got {N}")
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
    if window_rows is not None:
        check_tensor("window_rows", window_rows, dtypes=(torch.int32,), ndims=2)
        check_shape("window_rows", window_rows, [3, T])
        check_same_device(topk_indices=topk_indices, window_rows=window_rows)
    call_op(_combine_op, topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
            compress_ratio, topk, M, N, indices, lens, window_rows)
    return indices, lens


@torch.library.custom_op("dsv41::combine_topk_swa_indices",
                         mutates_args=("indices", "lens", "window_rows"))
def _combine_op(topk_indices: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, gather_lens: Optional[torch.Tensor], window_size: int,
                compress_ratio: int, topk: int, M: int, N: int, indices: torch.Tensor,
                lens: torch.Tensor, window_rows: Optional[torch.Tensor]) -> None:
    if use_reference(topk_indices.device, _combine_topk_swa_kernel):
        combine_topk_swa_indices_ref(topk_indices, query_start_loc, seq_lens, gather_lens,
                                     window_size, compress_ratio, topk, M, N,
                                     out=(indices, lens), window_rows=window_rows)
        return
    T = topk_indices.shape[0]
    B = query_start_loc.shape[0] - 1
    width = indices.shape[1]
    if T == 0:
        return
    block_t = 32 if is_interpreter() else COMBINE_BLOCK_T
    tk = topk if compress_ratio > 0 else 0
    nck = 0
    if tk:
        nck = min(next_power_of_2(triton.cdiv(tk, COMBINE_ALIGN_C)),
                  COMBINE_MAX_TOPK_COLS // COMBINE_ALIGN_C)
    grid = (triton.cdiv(T, block_t),)
    _combine_topk_swa_kernel[grid](
        topk_indices, query_start_loc, seq_lens,
        gather_lens if gather_lens is not None else seq_lens,
        indices, lens, window_rows if window_rows is not None else lens,
        T, B, max(B - 1, 0).bit_length(), width,
        tk, window_size, max(compress_ratio, 1), M, N,
        topk_indices.stride(0), topk_indices.stride(1), indices.stride(0), lens.stride(0),
        window_rows.stride(0) if window_rows is not None else 0,
        HAS_GATHER=gather_lens is not None,
        HAS_WINDOW=window_rows is not None,
        BLOCK_T=block_t,
        BLOCK_C=COMBINE_ALIGN_C,
        NCK=nck,
        num_warps=COMBINE_NUM_WARPS,
    )


@_combine_op.register_fake
def _combine_fake(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                  compress_ratio, topk, M, N, indices, lens, window_rows) -> None:
    return None


# --------------------------------------------------------------------------------------------
# compute_global_topk_indices_and_lens
# --------------------------------------------------------------------------------------------
#: warps per program of the global top-k kernel; each warp owns one token row, so a program
#: handles GLOBAL_TOPK_NUM_WARPS tokens and the left-packing scan never leaves its warp
GLOBAL_TOPK_NUM_WARPS = 4
#: most columns of a row held in registers at once (32 lanes x GLOBAL_TOPK_MAX_COLS/32 per
#: lane); longer rows loop, carrying the survivor count
GLOBAL_TOPK_MAX_COLS = 512


@triton.jit
def _global_topk_step(k, km, row_in, bt_row, row_out, count, lim, bt_m, col_max, sl_k, sb_c,
                      shifts, BLOCK_SIZE: tl.constexpr, IN_I64: tl.constexpr):
    """One step of :func:`_global_topk_kernel` over columns ``k [32, 1, NGROUP, PACK]`` (mask
    ``km``): translate, left-pack, store the survivors; returns the new survivor count."""
    # int32 math where the input is int32 (the common case); int64 inputs stay int64.
    # IN_I64: a strided input or block table whose in-row offsets may pass 2**31
    if IN_I64:
        i = tl.load(row_in + k.to(tl.int64) * sl_k, mask=km, other=-1)
    else:
        i = tl.load(row_in + k * sl_k, mask=km, other=-1)
    ip = tl.maximum(i, 0)
    col = ip // BLOCK_SIZE  # constexpr divisor: a shift for power-of-two pages
    ok = km & (i >= 0) & (col < lim)
    # the block-table load is masked per token only (an in-table column is read for dropped
    # entries too): per-element masks would use up the predicate registers
    colc = tl.minimum(col, col_max)
    if IN_I64:
        blk = tl.load(bt_row + colc.to(tl.int64) * sb_c, mask=bt_m, other=-1)
    else:
        blk = tl.load(bt_row + colc * sb_c, mask=bt_m, other=-1)
    # blk * bs + off is in [0, 2**31) exactly when blk >= 0 and blk < LIM or blk == LIM with
    # off <= REM: a slot past the int32 output is dropped, never wrapped
    off = ip - col * BLOCK_SIZE
    LIM: tl.constexpr = 2147483647 // BLOCK_SIZE
    REM: tl.constexpr = 2147483647 % BLOCK_SIZE
    ok = ok & (blk >= 0) & ((blk < LIM) | ((blk == LIM) & (off <= REM)))
    slot = blk.to(tl.int32) * BLOCK_SIZE + off.to(tl.int32)
    # left-packed position = survivors in earlier steps + in earlier chunks (of 32 columns)
    # of this step + in earlier columns of this chunk (= higher lanes). The lane scan and
    # the chunk sums run on PACK chunks at once: 0/1 flags summed over <= 32 lanes fit
    # 8-bit fields of an int32.
    packed = tl.sum(ok.to(tl.int32) << shifts, axis=3, keep_dims=True)
    scan = (tl.cumsum(packed, axis=0, reverse=True) >> shifts) & 255  # inclusive
    csum = (tl.sum(packed, axis=0, keep_dims=True) >> shifts) & 255  # [1, BT, NGROUP, PACK]
    gsum = tl.sum(csum, axis=3, keep_dims=True)  # [1, BT, NGROUP, 1]
    before = (tl.cumsum(csum, axis=3) - csum) + (tl.cumsum(gsum, axis=2) - gsum)
    tl.store(row_out + (count + before + scan - 1), slot, mask=ok)
    return count + tl.sum(gsum, axis=2, keep_dims=True)


@triton.jit
def _global_topk_kernel(
    local_ptr, req_ptr, bt_ptr, valid_ptr, out_ptr, lens_ptr,
    T, K, R, MB,
    sl_t, sl_k, s_req, sb_r, sb_c, s_valid, so_t,
    BLOCK_SIZE: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NGROUP: tl.constexpr,
    PACK: tl.constexpr,
    IN_I64: tl.constexpr,
):
    """BLOCK_T token rows per program. A step covers ``STEP = 32 * NGROUP * PACK`` columns of
    each row as a ``[32, BLOCK_T, NGROUP, PACK]`` tile: lane ``l`` holds column
    ``k0 + 32 * (PACK * g + p) + 31 - l``.

    Layout: the left-packing store has data-dependent addresses, so Triton gives it one element
    per thread with the dims in index order (lanes on dim 0, warps on dim 1). The lanes are
    numbered backwards so that Triton's analysis sees no contiguity in the other accesses
    either (it does not treat decreasing runs as contiguous): every access of the tile gets that
    same layout, so nothing goes through shared memory, each warp owns one token row, and a
    warp access still touches 32 consecutive int32 (coalesced). With unit column strides a
    thread's addresses are one base plus immediate offsets, and whole steps (``k0 + STEP <=
    K``) need no column mask, so the loads of a step share one predicate (few registers and
    predicates: the loads are issued together). The in-row scan runs backwards to match.
    """
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    # every per-token load is issued before any store (a load after a store cannot be hoisted)
    req = tl.load(req_ptr + t64 * s_req, mask=tm, other=-1).to(tl.int64)
    if HAS_VALID:
        v = tl.load(valid_ptr + t64 * s_valid, mask=tm, other=0)
    req_ok = (req >= 0) & (req < R)
    req_c = tl.where(req_ok, req, 0)
    lim = tl.where(req_ok, MB, 0)[None, :, None, None]
    bt_row = (bt_ptr + req_c * sb_r)[None, :, None, None]
    row_in = (local_ptr + t64 * sl_t)[None, :, None, None]
    row_out = (out_ptr + t64 * so_t)[None, :, None, None]
    tm4 = tm[None, :, None, None]
    # (a select, not `tm4 & scalar`: the interpreter turns scalar-bool & bool-tile into ints)
    bt_m = tl.where((R > 0) & (MB > 0), tm4, tl.zeros_like(tm4))
    col_max = tl.maximum(MB - 1, 0)
    shifts = tl.arange(0, PACK)[None, None, None, :]
    kk = ((31 - tl.arange(0, 32))[:, None, None, None]
          + (tl.arange(0, NGROUP)[None, None, :, None] * PACK + shifts) * 32)
    shifts = shifts * 8
    STEP: tl.constexpr = NGROUP * PACK * 32
    k_full = (K // STEP) * STEP
    count = tl.zeros((1, BLOCK_T, 1, 1), dtype=tl.int32)  # kept 4-D: no layout conversions
    for k0 in range(0, k_full, STEP):
        count = _global_topk_step(k0 + kk, tm4, row_in, bt_row, row_out, count, lim, bt_m,
                                  col_max, sl_k, sb_c, shifts, BLOCK_SIZE, IN_I64)
    if k_full < K:
        k = k_full + kk
        count = _global_topk_step(k, (k < K) & tm4, row_in, bt_row, row_out, count, lim, bt_m,
                                  col_max, sl_k, sb_c, shifts, BLOCK_SIZE, IN_I64)
    # the tail after the survivors (disjoint from the addresses written above)
    minus1 = tl.full((32, BLOCK_T, NGROUP, PACK), -1, tl.int32)
    for k0 in range(0, K, STEP):
        k = k0 + kk
        tl.store(row_out + k, minus1, mask=(k < K) & (k >= count) & tm4)
    count = tl.sum(tl.sum(tl.sum(count, axis=3), axis=2), axis=0)  # [BLOCK_T]
    if HAS_VALID:
        count = tl.where(v != 0, count, 0)
    tl.store(lens_ptr + t64, count, mask=tm)


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
    is negative (a negative block id) or past int32 (computed at 64 bits, never wrapped). Survivors are packed to the LEFT in their original
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
    call_op(_global_topk_op,
        topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, indices,
        lens)
    return indices, lens


@torch.library.custom_op("dsv41::compute_global_topk_indices_and_lens",
                         mutates_args=("indices", "lens"))
def _global_topk_op(topk_indices: torch.Tensor, token_to_req_indices: torch.Tensor,
                    block_table: torch.Tensor, block_size: int,
                    is_valid_token: Optional[torch.Tensor], indices: torch.Tensor,
                    lens: torch.Tensor) -> None:
    if use_reference(topk_indices.device, _global_topk_kernel):
        i, n = compute_global_topk_indices_and_lens_ref(
            topk_indices, token_to_req_indices, block_table, block_size, is_valid_token)
        indices.copy_(i)
        lens.copy_(n)
        return
    T, K = topk_indices.shape
    if T == 0:
        return
    R, MB = block_table.shape
    nchunk = min(next_power_of_2(triton.cdiv(max(K, 1), 32)), GLOBAL_TOPK_MAX_COLS // 32)
    pack = min(nchunk, 4)
    block_t = GLOBAL_TOPK_NUM_WARPS
    _global_topk_kernel[(triton.cdiv(T, block_t),)](
        topk_indices, token_to_req_indices, block_table,
        is_valid_token if is_valid_token is not None else token_to_req_indices,
        indices, lens,
        T, K, R, MB,
        topk_indices.stride(0), topk_indices.stride(1), token_to_req_indices.stride(0),
        block_table.stride(0), block_table.stride(1),
        is_valid_token.stride(0) if is_valid_token is not None else 0,
        indices.stride(0),
        BLOCK_SIZE=block_size,
        HAS_VALID=is_valid_token is not None,
        BLOCK_T=block_t,
        NGROUP=nchunk // pack,
        PACK=pack,
        # in-row offsets in int32 unless a strided input may reach past 2**31 elements
        IN_I64=max(max(K - 1, 0) * abs(topk_indices.stride(1)),
                   max(MB - 1, 0) * abs(block_table.stride(1))) >= 2**31,
        num_warps=GLOBAL_TOPK_NUM_WARPS,
    )


@_global_topk_op.register_fake
def _global_topk_fake(topk_indices, token_to_req_indices, block_table, block_size,
                      is_valid_token, indices, lens) -> None:
    return None
