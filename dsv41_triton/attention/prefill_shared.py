"""Few-head sparse MLA prefill that shares window keys between consecutive queries.

In V4.1 a prefill token reads a window of ``W`` consecutive positions plus its own top-k
compressed entries; consecutive tokens of one request share ``W - 1`` of their window keys.
``sparse_mla_prefill_shared_window`` takes the window as a row range per token (rows of the
workspace, ``[win_start, win_start + win_len)``) and the top-k part as index rows, in two
launches: ``_shared_window_kernel.py`` (tiles of ``BT`` consecutive tokens of one request load
each window key once for the whole tile and leave a normalized partial in ``out``/``lse``),
then the general kernel over each token's top-k rows (on sm_90 with at most 8 heads the Gluon
few-heads kernel, ``gluon/prefill_few.py``), which merges that partial in (its ``PRIOR``) and
applies the sink. ``sparse_mla_prefill`` stays the general entry point (any
head count, any key rows). Reference: ``prefill_shared_ref.py``.

For the layer's gathered workspace, ``ops.indices.combine_topk_swa_indices(...,
window_rows=)`` writes the window ranges and top-k lengths beside the combined index rows, so
that those rows can be passed as the top-k rows with ``topk_lens``.

With ``topk_cache`` the top-k keys come from a paged record cache instead (slot ids, records
dequantized in the kernel, as in ``sparse_mla_decode``) while the window keys stay rows of a
small bf16 workspace: the layer's paged prefill gathers only the window rows of its query
tokens, so its memory does not grow with the context.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from .._utils import (
    call_op,
    HEAD_DIM,
    INT_DTYPES,
    check_int,
    check_same_device,
    check_tensor,
    is_interpreter,
    next_power_of_2,
    use_reference,
)
from ._configs import MIN_BLOCK_N_GPU, arch_launch
from .._contract import EXTRA_RECORDS
from ..ops.records import check_k_cache
from ._kernels import check_common, check_indices, check_lens, new_outputs
from ._launch import LAST_LAUNCH, KeySet, launch
from ._shared_window_kernel import _tiles_kernel, _window_partial_kernel
from ._sparse_kernel import SRC_BF16

LOG2E = 1.4426950408889634
#: most heads the shared-window kernel takes (more heads: ``sparse_mla_prefill``)
MAX_SHARED_HEADS = 16


#: most ``query_start_loc`` entries the one-launch tile builder takes (more: torch ops)
MAX_TILE_KERNEL_ENTRIES = 4096


def shared_window_tiles(query_start_loc: torch.Tensor, T: int, block_t: int) -> torch.Tensor:
    """``[cdiv(T, block_t) + B + 1, 2]`` int32 tiles (first token, count) of at most
    ``block_t`` consecutive tokens of one request (tokens ``query_start_loc[b] - [0] ..``);
    tokens past the last request form their own tiles; unused tiles have count 0. No host
    sync; ``query_start_loc`` must be non-decreasing. One Triton launch on a GPU (and in the
    interpreter), else :func:`shared_window_tiles_ref`."""
    nq = query_start_loc.shape[0]
    NT = -(-T // block_t) + nq
    dev = query_start_loc.device
    if use_reference(dev, _tiles_kernel) or nq > MAX_TILE_KERNEL_ENTRIES:
        return shared_window_tiles_ref(query_start_loc, T, block_t)
    tiles = torch.empty((NT, 2), dtype=torch.int32, device=dev)
    bi = 128
    _tiles_kernel[(-(-NT // bi),)](query_start_loc, nq, T, NT, tiles, BT=block_t,
                                   BB=max(16, next_power_of_2(nq)), BI=bi)
    return tiles


def shared_window_tiles_ref(query_start_loc: torch.Tensor, T: int, block_t: int
                            ) -> torch.Tensor:
    """:func:`shared_window_tiles` in torch ops (no host sync)."""
    dev = query_start_loc.device
    qsl = query_start_loc.long() - query_start_loc[0].long()
    B = qsl.numel() - 1
    bounds = torch.cat([qsl.clamp(0, T), torch.full((1,), T, dtype=torch.long, device=dev)])
    lens = (bounds[1:] - bounds[:-1]).clamp_min(0)  # [B + 1], the last: tokens past requests
    nt = torch.div(lens + block_t - 1, block_t, rounding_mode="floor")
    cum = torch.cumsum(nt, 0)
    NT = -(-T // block_t) + B + 1
    i = torch.arange(NT, device=dev)
    b = torch.searchsorted(cum, i, right=True).clamp(max=B)
    start = bounds[b] + (i - (cum[b] - nt[b])) * block_t
    cnt = torch.minimum(bounds[b + 1] - start, torch.full_like(start, block_t)).clamp_min(0)
    cnt = torch.where(i < cum[-1], cnt, 0)
    return torch.stack([torch.where(cnt > 0, start, 0), cnt], 1).to(torch.int32)


def check_shared_window_args(q, kv, win_start, win_len, topk_indices, topk_lens,
                             query_start_loc, attn_sink=None, softmax_scale=None, out=None,
                             topk_cache=None, max_heads: Optional[int] = MAX_SHARED_HEADS):
    """Every argument check of :func:`sparse_mla_prefill_shared_window` but its launch shape
    (``max_heads`` None: any head count); returns ``(T, H, scale)``."""
    T, H, scale = check_common(q, attn_sink, softmax_scale, out, "prefill")
    if max_heads is not None and H > max_heads:
        raise ValueError(f"q: the shared-window prefill takes at most {max_heads} heads, "
                         f"got {H} (use sparse_mla_prefill)")
    check_tensor("kv", kv, dtypes=(torch.bfloat16,), ndims=2, last_dim=HEAD_DIM)
    for name, v in (("win_start", win_start), ("win_len", win_len)):
        check_lens(name, v, T)
        if v is None:
            raise TypeError(f"{name}: expected a tensor, got None")
    check_indices("topk_indices", topk_indices, T)
    check_lens("topk_lens", topk_lens, T)
    if topk_cache is not None:
        check_k_cache("topk_cache", topk_cache, EXTRA_RECORDS)
        if topk_indices.dtype != torch.int32:
            raise TypeError(f"topk_indices: slot ids into topk_cache must be int32, got "
                            f"{topk_indices.dtype}")
    check_tensor("query_start_loc", query_start_loc, dtypes=INT_DTYPES, ndims=1,
                 contiguous_last=False)
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc: expected at least one entry")
    check_same_device(q=q, kv=kv, win_start=win_start, win_len=win_len,
                      topk_indices=topk_indices, topk_lens=topk_lens,
                      query_start_loc=query_start_loc, attn_sink=attn_sink, out=out,
                      topk_cache=topk_cache)
    return T, H, scale


def sparse_mla_prefill_shared_window(
    q: torch.Tensor,
    kv: torch.Tensor,
    win_start: torch.Tensor,
    win_len: torch.Tensor,
    topk_indices: torch.Tensor,
    topk_lens: Optional[torch.Tensor],
    query_start_loc: torch.Tensor,
    attn_sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    *,
    block_t: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: int = 2,
    topk_cache: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill (1..16 heads) whose window keys are shared by consecutive tokens.

    Args:
        q: ``[T, H, 512]`` bf16, RoPE'd, ``H <= 16``.
        kv: ``[S, 512]`` bf16 workspace (rows may be strided).
        win_start, win_len: ``[T]`` int32/int64: token ``t`` reads rows ``win_start[t] ..
            win_start[t] + win_len[t] - 1`` (rows outside ``[0, S)`` skipped; ``win_len <= 0``:
            none). Consecutive tokens of a request should have overlapping ranges (the tile
            walks the union of its tokens' ranges).
        topk_indices: ``[T, K]`` int rows of ``kv`` (``< 0`` or ``>= S`` skipped), or with
            ``topk_cache`` int32 slot ids into it (``< 0`` or past its slots skipped);
            ``topk_lens [T]`` columns read (None: all ``K``).
        query_start_loc: ``[B + 1]`` int, non-decreasing: tiles never span two requests.
        attn_sink: ``[H]`` fp32 or None; softmax_scale: default ``512 ** -0.5``;
        out: optional ``[T, H, 512]`` bf16.
        block_t: tokens per tile (default ``64 // next_power_of_2(H)``, at least 1);
        block_n, num_warps, num_stages: the ``tl`` window launch's shape (default
            ``block_n``: the device's ``window_block_n`` in ``_configs.LAUNCH_TABLE``; on
            sm_90 with at most 8 heads and ``block_t * next_power_of_2(H) == 64`` the Gluon
            window and few-heads kernels run instead and these do not apply).
        topk_cache: optional uint8 ``[blocks, page, 584 | 528 | 288]`` record cache the top-k
            slot ids point into (on sm_90 the Gluon decode kernel reads it, merging the window
            partial in; elsewhere the ``tl`` kernel).

    Each token attends over its window rows and its top-k rows in one softmax (a row in both
    counts twice). Returns ``(out [T, H, 512] bf16, lse [T, H] fp32)``; empty rows 0 / +inf.
    """
    T, H, scale = check_shared_window_args(q, kv, win_start, win_len, topk_indices, topk_lens,
                                           query_start_loc, attn_sink, softmax_scale, out,
                                           topk_cache)
    hp = next_power_of_2(H)
    bt = check_int("block_t", block_t if block_t is not None else max(1, 64 // hp), lo=1)
    if bt & (bt - 1):
        raise ValueError(f"block_t: expected a power of two, got {bt}")
    rows = bt * hp
    if not 16 <= rows <= 128:
        raise ValueError(f"block_t: block_t * next_power_of_2(H) must be in [16, 128], got "
                         f"{bt} * {hp}")
    if block_n is not None:
        check_int("block_n", block_n, lo=16)
        if block_n & (block_n - 1):
            raise ValueError(f"block_n: expected a power of two, got {block_n}")
        if q.device.type == "cuda" and not is_interpreter() and block_n < MIN_BLOCK_N_GPU:
            raise ValueError(f"block_n: must be >= {MIN_BLOCK_N_GPU} on a GPU, got {block_n}")
    out, lse = new_outputs(q, out)
    call_op(_shared_window_op,
        q, kv, win_start, win_len, topk_indices, topk_lens, query_start_loc, attn_sink, scale,
        out, lse, bt, -1 if block_n is None else block_n,
        -1 if num_warps is None else num_warps, num_stages, topk_cache)
    return out, lse


@torch.library.custom_op("dsv41::sparse_mla_prefill_shared_window", mutates_args=("out", "lse"))
def _shared_window_op(q: torch.Tensor, kv: torch.Tensor, win_start: torch.Tensor,
                      win_len: torch.Tensor, topk_indices: torch.Tensor,
                      topk_lens: Optional[torch.Tensor], query_start_loc: torch.Tensor,
                      attn_sink: Optional[torch.Tensor], scale: float, out: torch.Tensor,
                      lse: torch.Tensor, bt: int, block_n: int, num_warps: int,
                      num_stages: int, topk_cache: Optional[torch.Tensor] = None) -> None:
    """The op behind :func:`sparse_mla_prefill_shared_window` (checked arguments; the
    outputs allocated by the caller; ``block_n`` / ``num_warps`` = -1: the defaults)."""
    if use_reference(q.device, _window_partial_kernel):
        from .prefill_shared_ref import sparse_mla_prefill_shared_window_ref

        o, l = sparse_mla_prefill_shared_window_ref(q, kv, win_start, win_len, topk_indices,
                                                    topk_lens, query_start_loc, attn_sink,
                                                    scale, topk_cache)
        out.copy_(o)
        lse.copy_(l)
        return
    T, H = q.shape[0], q.shape[1]
    if T == 0:
        return
    hp = next_power_of_2(H)
    rows = bt * hp
    tiles = shared_window_tiles(query_start_loc, T, bt)
    win_start, win_len = win_start.contiguous(), win_len.contiguous()
    S = int(kv.shape[0])
    row_stride = kv.stride(0) if S > 1 else HEAD_DIM
    from .gluon import prefill_launch as gluon_launch
    # sm_90, <= 8 heads: the top-k rows on the Gluon few-heads kernel (and, with 64-row tiles,
    # the window partial on the Gluon window kernel)
    few = (gluon_launch.usable(q, kv, topk_indices)
           and gluon_launch.pick(T, H, q.device, topk_indices)
           and gluon_launch.table_variant(H, q.device, topk_indices) == gluon_launch.FEW)
    if few and rows == 64:
        gluon_launch.launch_window(q, kv, win_start, win_len, tiles, scale, out, lse)
    else:
        interp = is_interpreter()
        if block_n <= 0:
            block_n = arch_launch(q.device).window_block_n
        k = _window_partial_kernel[(tiles.shape[0],)](
            q, q.stride(0), q.stride(1),
            kv, row_stride, S,
            win_start, win_len, tiles,
            out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1),
            H, scale * LOG2E,
            HP=hp, BT=bt, BN=block_n, DOT_F32=interp, SW=interp,
            num_warps=num_warps if num_warps > 0 else (8 if rows >= 64 else 4),
            num_stages=1 if interp else num_stages,
        )
        LAST_LAUNCH["shared"] = (k, (bt, block_n))
    # the top-k keys, merging the window partial in (its PRIOR) and applying the sink
    if topk_cache is not None:
        from .decode import _keyset
        from .gluon import launch as decode_launch
        topk = _keyset(topk_cache, topk_indices, topk_lens)
        if (decode_launch.usable(q, topk, None)
                and os.environ.get(decode_launch.ENV, "auto") != "tl"):
            decode_launch.launch(q, topk, None, attn_sink, scale, out, lse, prior=True)
        else:
            launch(q, topk, None, attn_sink, scale, out, lse, prior=True)
        return
    if few:
        gluon_launch.launch(q, kv, topk_indices, topk_lens, attn_sink, scale, out, lse,
                            gluon_launch.FEW, prior=True)
        return
    topk = KeySet(src=SRC_BF16, k=kv, indices=topk_indices, lens=topk_lens, bstride=row_stride,
                  page=1, rows=S)
    launch(q, topk, None, attn_sink, scale, out, lse, prior=True)


@_shared_window_op.register_fake
def _shared_window_fake(q, kv, win_start, win_len, topk_indices, topk_lens, query_start_loc,
                        attn_sink, scale, out, lse, bt, block_n, num_warps, num_stages,
                        topk_cache=None) -> None:
    return None


__all__ = ["sparse_mla_prefill_shared_window", "check_shared_window_args", "shared_window_tiles",
           "shared_window_tiles_ref"]
