"""Prefill straight from the paged caches: slot-id rows for ``sparse_mla_decode`` (Triton).

:func:`prefill_slot_indices` turns a prefill chunk's positions, requests and top-k entries
into per-token slot ids of the window cache and of the compressed cache, so that prefill
tokens attend like decode tokens (records dequantized in the attention kernel) and no
whole-sequence bf16 workspace is needed: memory ``T * (W + K) * 4`` bytes of indices.
Reference: :mod:`dsv41_triton.ops.prefill_indices_ref`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .._utils import (INT_DTYPES, call_op, check_int, check_same_device, check_tensor,
                      next_power_of_2, use_reference)

#: tokens per program (one warp each) and compressed columns per step (512-column steps
#: measured slower: 8.7 against 7.8 us for 2048 x 512 ids on the H100, perf/NOTES.md
#: "Session 33")
SLOT_BLOCK_T = 4
SLOT_BLOCK_K = 128


@triton.jit
def _map_slots(local, ok, bt_row_ptr, bt_st_c, MB, PAGE: tl.constexpr):
    """Local positions / entries (int64) -> slot ids (int64), -1 where not ``ok``, past the
    table's ``MB`` columns or a negative block id."""
    col = tl.where(local >= 0, local, 0) // PAGE
    good = ok & (local >= 0) & (col < MB)
    blk = tl.load(bt_row_ptr + col * bt_st_c, mask=good, other=-1).to(tl.int64)
    good = good & (blk >= 0)
    return tl.where(good, blk * PAGE + (local - col * PAGE), -1)


@triton.jit(do_not_specialize=["T", "B", "R_s", "MB_s", "R_c", "MB_c", "K", "NG", "req0",
                               "G"])
def _prefill_slot_kernel(
    pos_ptr, req_ptr, seq_ptr, sbt_ptr, cbt_ptr, topk_ptr, glen_ptr,
    swa_ptr, swa_len_ptr, ext_ptr, ext_len_ptr,
    T, B, R_s, MB_s, R_c, MB_c, K, NG, req0, G,
    st_pos, st_req, st_seq, sbt_r, sbt_c, cbt_r, cbt_c, tk_t, tk_k, so_s, so_e, st_glen,
    W: tl.constexpr, WP: tl.constexpr, SPAGE: tl.constexpr, CPAGE: tl.constexpr,
    RATIO: tl.constexpr, WIN_ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_T tokens per program: the whole window row ``[BLOCK_T, WP]`` (``WIN_ROWS``: the
    window as a row range of the window workspace instead, rows 0 / 1 / 2 of ``swa_ptr``,
    stride ``so_s``), then the top-k row in ``BLOCK_K``-column steps. Writes only its tokens'
    rows (every column of them)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = tok < T
    t64 = tok.to(tl.int64)
    pos = tl.load(pos_ptr + t64 * st_pos, mask=tm, other=-1).to(tl.int64)
    req = tl.load(req_ptr + t64 * st_req, mask=tm, other=-1).to(tl.int64)
    ok = tm & (req >= 0) & (req < B) & (pos >= 0)
    rq = tl.where(ok, req, 0)
    start = tl.maximum(pos - (W - 1), 0)
    wlen = tl.where(ok, pos - start + 1, 0)
    if RATIO > 0 or WIN_ROWS:
        seq = tl.load(seq_ptr + rq * st_seq, mask=ok, other=0).to(tl.int64)
    if RATIO > 0:
        tlen = tl.where(ok, tl.minimum((pos + 1) // RATIO, K), 0)
    else:
        tlen = wlen * 0
    if WIN_ROWS:
        # request rq's gathered window rows: positions seq - glen .. seq - 1 at rows
        # (rq - req0) * G + 0 .. glen - 1 (glen clamped to G); the window clipped to them
        lr = rq - req0
        inw = ok & (lr >= 0) & (lr < NG)
        glen = tl.load(glen_ptr + lr * st_glen, mask=inw, other=0).to(tl.int64)
        glen = tl.minimum(tl.maximum(glen, 0), G)
        gs = seq - glen
        s0 = tl.maximum(start, gs)
        e0 = tl.minimum(pos, seq - 1)
        wl = tl.where(inw, tl.maximum(e0 - s0 + 1, 0), 0)
        row = tl.where(wl > 0, lr * G + s0 - gs, 0)
        tl.store(swa_ptr + t64, row.to(tl.int32), mask=tm)
        tl.store(swa_ptr + so_s + t64, wl.to(tl.int32), mask=tm)
        tl.store(swa_ptr + 2 * so_s + t64, tlen.to(tl.int32), mask=tm)
    else:
        cw = tl.arange(0, WP)
        in_w = cw[None, :] < wlen[:, None]
        srow = sbt_ptr + (rq * sbt_r)[:, None]
        slots = _map_slots(start[:, None] + cw[None, :], in_w & (rq < R_s)[:, None], srow,
                           sbt_c, MB_s, SPAGE)
        tl.store(swa_ptr + t64[:, None] * so_s + cw[None, :], slots.to(tl.int32),
                 mask=tm[:, None] & (cw[None, :] < W))
        tl.store(swa_len_ptr + t64, wlen.to(tl.int32), mask=tm)
    if RATIO > 0:
        nent = seq // RATIO
        crow = cbt_ptr + (rq * cbt_r)[:, None]
        for c0 in range(0, K, BLOCK_K):
            ck = c0 + tl.arange(0, BLOCK_K)
            cm = tm[:, None] & (ck[None, :] < K)
            e = tl.load(topk_ptr + t64[:, None] * tk_t + ck[None, :].to(tl.int64) * tk_k,
                        mask=cm & (ck[None, :] < tlen[:, None]), other=-1).to(tl.int64)
            good = (ck[None, :] < tlen[:, None]) & (e < nent[:, None]) & (rq < R_c)[:, None]
            s = _map_slots(e, good, crow, cbt_c, MB_c, CPAGE)
            tl.store(ext_ptr + t64[:, None] * so_e + ck[None, :], s.to(tl.int32), mask=cm)
        tl.store(ext_len_ptr + t64, tlen.to(tl.int32), mask=tm)


def _check_common(positions, token_to_req, seq_lens, window_size, topk_indices,
                  compressed_block_table, compressed_page_size, compress_ratio, **checked):
    """The checks both entries share (``checked``: the entry's own tensors, already checked,
    for the same-device check); returns ``(T, device)``."""
    check_tensor("positions", positions, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    T = positions.shape[0]
    check_tensor("token_to_req", token_to_req, dtypes=INT_DTYPES, ndims=1,
                 contiguous_last=False)
    if token_to_req.shape[0] < T:
        raise ValueError(f"token_to_req: expected at least {T} entries (one per token), got "
                         f"{token_to_req.shape[0]}")
    check_tensor("seq_lens", seq_lens, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    check_int("window_size", window_size, lo=1)
    check_int("compress_ratio", compress_ratio, lo=0)
    check_int("compressed_page_size", compressed_page_size, lo=1)
    if compress_ratio > 0:
        check_tensor("topk_indices", topk_indices, dtypes=INT_DTYPES, ndims=2,
                     contiguous_last=False)
        if topk_indices.shape[0] != T:
            raise ValueError(f"topk_indices: expected {T} rows (one per token), got "
                             f"{tuple(topk_indices.shape)}")
        check_tensor("compressed_block_table", compressed_block_table, dtypes=INT_DTYPES,
                     ndims=2, contiguous_last=False)
    dev = check_same_device(positions=positions, token_to_req=token_to_req, seq_lens=seq_lens,
                            topk_indices=topk_indices if compress_ratio > 0 else None,
                            compressed_block_table=(compressed_block_table
                                                    if compress_ratio > 0 else None),
                            **checked)
    return T, dev


def _extra_outputs(T, topk_indices, compress_ratio, dev):
    """``(extra_indices [T, K], extra_lens [T])`` int32, or ``(None, None)`` for ratio 0."""
    if compress_ratio <= 0:
        return None, None
    return (torch.empty(T, topk_indices.shape[1], dtype=torch.int32, device=dev),
            torch.empty(T, dtype=torch.int32, device=dev))


def prefill_slot_indices(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    swa_block_table: torch.Tensor,
    swa_page_size: int,
    window_size: int,
    topk_indices: Optional[torch.Tensor] = None,
    compressed_block_table: Optional[torch.Tensor] = None,
    compressed_page_size: int = 1,
    compress_ratio: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Slot-id rows of prefill tokens over the paged caches (no host sync, graph capturable).

    Args:
        positions: ``[T]`` int, each token's position in its request.
        token_to_req: ``[>= T]`` int, the request of each token (a row of ``seq_lens`` and of
            the block tables); tokens outside ``[0, len(seq_lens))`` get no keys.
        seq_lens: ``[B]`` int, each request's total length (bounds its compressed entries).
        swa_block_table: ``[R, max_blocks]`` int, window-cache blocks by position.
        swa_page_size, window_size: window-cache page and the window ``W`` (own token
            included).
        topk_indices: ``[T, K]`` int local compressed entries (``-1`` = none), for
            ``compress_ratio > 0``.
        compressed_block_table, compressed_page_size: the compressed cache's blocks by entry.
        compress_ratio: ``r`` (0: window only).

    Token ``t`` (request ``b``, position ``pos``): window positions ``max(pos - W + 1, 0) ..
    pos`` as slots (``-1`` for a block past the table or a negative block id, still counted;
    ``-1`` after them); top-k columns ``c < min((pos + 1) // r, K)`` as slots when ``0 <= e <
    seq_lens[b] // r``, else ``-1`` (still counted). Slot ids must fit int32 (as for decode).

    Returns ``(swa_indices [T, W] int32, swa_lens [T] int32, extra_indices [T, K] int32,
    extra_lens [T] int32)`` (the last two None when ``compress_ratio == 0``), the inputs of
    ``sparse_mla_decode``.
    """
    check_tensor("swa_block_table", swa_block_table, dtypes=INT_DTYPES, ndims=2,
                 contiguous_last=False)
    check_int("swa_page_size", swa_page_size, lo=1)
    T, dev = _check_common(positions, token_to_req, seq_lens, window_size, topk_indices,
                           compressed_block_table, compressed_page_size, compress_ratio,
                           swa_block_table=swa_block_table)
    swa = torch.empty(T, window_size, dtype=torch.int32, device=dev)
    swa_lens = torch.empty(T, dtype=torch.int32, device=dev)
    ext, ext_lens = _extra_outputs(T, topk_indices, compress_ratio, dev)
    call_op(_prefill_slot_op,
        positions, token_to_req, seq_lens, swa_block_table, swa_page_size, window_size,
        topk_indices if compress_ratio > 0 else None,
        compressed_block_table if compress_ratio > 0 else None, compressed_page_size,
        compress_ratio, swa, swa_lens, ext, ext_lens)
    return swa, swa_lens, ext, ext_lens


def prefill_window_slot_indices(
    positions: torch.Tensor,
    token_to_req: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    first_request: int,
    rows_per_request: int,
    window_size: int,
    topk_indices: Optional[torch.Tensor] = None,
    compressed_block_table: Optional[torch.Tensor] = None,
    compressed_page_size: int = 1,
    compress_ratio: int = 0,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A prefill chunk's window as row ranges of its window workspace and its top-k entries
    as slot ids of the compressed cache, in one launch (what
    ``sparse_mla_prefill_shared_window(..., topk_cache=)`` reads).

    Args:
        positions, token_to_req, seq_lens, window_size, topk_indices, compressed_block_table,
            compressed_page_size, compress_ratio: as :func:`prefill_slot_indices`.
        gather_lens: ``[NG]`` int: the window workspace holds request ``first_request + i``'s
            positions ``seq_len - gather_lens[i] .. seq_len - 1`` at rows ``rows_per_request *
            i + 0 ..`` (``gather_lens`` clamped to ``[0, rows_per_request]``), as
            ``dequantize_and_gather_k_cache`` writes them.
        first_request, rows_per_request: see ``gather_lens``.

    Token ``t`` (request ``b``, position ``pos``): its window ``max(pos - W + 1, 0) .. pos``
    clipped to the gathered positions of ``b`` (none when ``b`` is not one of the workspace's
    requests) as ``window_rows[0, t]`` (first row), ``window_rows[1, t]`` (count; 0 / 0 when
    empty) and ``window_rows[2, t]`` = the top-k length; the top-k columns exactly as
    :func:`prefill_slot_indices`'s.

    Returns ``(window_rows [3, T] int32, extra_indices [T, K] int32, extra_lens [T] int32)``
    (the last two None when ``compress_ratio == 0``).
    """
    check_tensor("gather_lens", gather_lens, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    T, dev = _check_common(positions, token_to_req, seq_lens, window_size, topk_indices,
                           compressed_block_table, compressed_page_size, compress_ratio,
                           gather_lens=gather_lens)
    check_int("first_request", first_request, lo=0)
    check_int("rows_per_request", rows_per_request, lo=0)
    if gather_lens.shape[0] * rows_per_request >= 2 ** 31:
        raise ValueError(f"rows_per_request: the window workspace's rows must fit int32, got "
                         f"{gather_lens.shape[0]} x {rows_per_request}")
    win = torch.empty(3, T, dtype=torch.int32, device=dev)
    ext, ext_lens = _extra_outputs(T, topk_indices, compress_ratio, dev)
    call_op(_prefill_window_slot_op,
        positions, token_to_req, seq_lens, gather_lens, first_request, rows_per_request,
        window_size, topk_indices if compress_ratio > 0 else None,
        compressed_block_table if compress_ratio > 0 else None, compressed_page_size,
        compress_ratio, win, ext, ext_lens)
    return win, ext, ext_lens


def _launch(positions, token_to_req, seq_lens, swa_block_table, swa_page_size, window_size,
            topk_indices, compressed_block_table, compressed_page_size, compress_ratio, swa,
            swa_lens, ext, ext_lens, gather_lens=None, req0=0, G=0):
    """``_prefill_slot_kernel`` (``gather_lens`` given: its ``WIN_ROWS`` form, ``swa`` the
    ``[3, T]`` window rows)."""
    T = positions.shape[0]
    if T == 0:
        return
    K = ext.shape[1] if ext is not None else 0
    win_rows = gather_lens is not None
    sbt = swa_block_table if not win_rows else seq_lens.view(-1, 1)
    cbt = compressed_block_table if compress_ratio > 0 else sbt
    tk = topk_indices if compress_ratio > 0 else positions.view(-1, 1)
    glen = gather_lens if win_rows else seq_lens
    _prefill_slot_kernel[(triton.cdiv(T, SLOT_BLOCK_T),)](
        positions, token_to_req, seq_lens, sbt, cbt, tk, glen,
        swa, swa_lens, ext if ext is not None else swa, ext_lens if ext is not None else swa_lens,
        T, seq_lens.shape[0], sbt.shape[0], sbt.shape[1], cbt.shape[0], cbt.shape[1], K,
        glen.shape[0], req0, G,
        positions.stride(0), token_to_req.stride(0), seq_lens.stride(0),
        sbt.stride(0), sbt.stride(1), cbt.stride(0), cbt.stride(1),
        tk.stride(0), tk.stride(1), swa.stride(0), ext.stride(0) if ext is not None else 0,
        glen.stride(0),
        W=window_size, WP=next_power_of_2(window_size), SPAGE=swa_page_size,
        CPAGE=compressed_page_size, RATIO=compress_ratio, WIN_ROWS=win_rows,
        BLOCK_T=SLOT_BLOCK_T, BLOCK_K=SLOT_BLOCK_K, num_warps=4,
    )


@torch.library.custom_op("dsv41::prefill_slot_indices",
                         mutates_args=("swa", "swa_lens", "ext", "ext_lens"))
def _prefill_slot_op(positions: torch.Tensor, token_to_req: torch.Tensor,
                     seq_lens: torch.Tensor, swa_block_table: torch.Tensor, swa_page_size: int,
                     window_size: int, topk_indices: Optional[torch.Tensor],
                     compressed_block_table: Optional[torch.Tensor], compressed_page_size: int,
                     compress_ratio: int, swa: torch.Tensor, swa_lens: torch.Tensor,
                     ext: Optional[torch.Tensor], ext_lens: Optional[torch.Tensor]) -> None:
    """The op behind :func:`prefill_slot_indices` (outputs allocated by the caller)."""
    if use_reference(positions.device, _prefill_slot_kernel):
        from .prefill_indices_ref import prefill_slot_indices_ref

        res = prefill_slot_indices_ref(positions, token_to_req, seq_lens, swa_block_table,
                                       swa_page_size, window_size, topk_indices,
                                       compressed_block_table, compressed_page_size,
                                       compress_ratio)
        _copy_into((swa, swa_lens, ext, ext_lens), res)
        return
    _launch(positions, token_to_req, seq_lens, swa_block_table, swa_page_size, window_size,
            topk_indices, compressed_block_table, compressed_page_size, compress_ratio, swa,
            swa_lens, ext, ext_lens)


@_prefill_slot_op.register_fake
def _prefill_slot_fake(positions, token_to_req, seq_lens, swa_block_table, swa_page_size,
                       window_size, topk_indices, compressed_block_table, compressed_page_size,
                       compress_ratio, swa, swa_lens, ext, ext_lens) -> None:
    return None


@torch.library.custom_op("dsv41::prefill_window_slot_indices",
                         mutates_args=("window_rows", "ext", "ext_lens"))
def _prefill_window_slot_op(positions: torch.Tensor, token_to_req: torch.Tensor,
                            seq_lens: torch.Tensor, gather_lens: torch.Tensor,
                            first_request: int, rows_per_request: int, window_size: int,
                            topk_indices: Optional[torch.Tensor],
                            compressed_block_table: Optional[torch.Tensor],
                            compressed_page_size: int, compress_ratio: int,
                            window_rows: torch.Tensor, ext: Optional[torch.Tensor],
                            ext_lens: Optional[torch.Tensor]) -> None:
    """The op behind :func:`prefill_window_slot_indices` (outputs allocated by the caller)."""
    if use_reference(positions.device, _prefill_slot_kernel):
        from .prefill_indices_ref import prefill_window_slot_indices_ref

        res = prefill_window_slot_indices_ref(positions, token_to_req, seq_lens, gather_lens,
                                              first_request, rows_per_request, window_size,
                                              topk_indices, compressed_block_table,
                                              compressed_page_size, compress_ratio)
        _copy_into((window_rows, ext, ext_lens), res)
        return
    _launch(positions, token_to_req, seq_lens, None, 1, window_size, topk_indices,
            compressed_block_table, compressed_page_size, compress_ratio, window_rows,
            window_rows, ext, ext_lens, gather_lens, first_request, rows_per_request)


@_prefill_window_slot_op.register_fake
def _prefill_window_slot_fake(positions, token_to_req, seq_lens, gather_lens, first_request,
                              rows_per_request, window_size, topk_indices,
                              compressed_block_table, compressed_page_size, compress_ratio,
                              window_rows, ext, ext_lens) -> None:
    return None


def _copy_into(dsts, srcs) -> None:
    for dst, src in zip(dsts, srcs):
        if dst is not None:
            dst.copy_(src)


__all__ = ["prefill_slot_indices", "prefill_window_slot_indices"]
