"""Plain PyTorch references of the two KV-cache ops (SPEC §4-§5), and their argument checks.

``quantize_and_insert_k_cache_ref`` and ``dequantize_and_gather_k_cache_ref`` have the same
signatures and the same effects, byte for byte, as the Triton ops in ``kv_cache.py``; they are
built on the exact codecs of ``records.py``. The ``check_*_args`` functions are shared with the
Triton wrappers so both raise the same errors before touching anything.

Choices the SPEC leaves open (the kernels make the same ones):

- insert: a slot ``< 0`` or ``>= num_blocks * page`` writes nothing. With duplicate slots the
  winner is unspecified.
- gather: a position is skipped (its ``out`` row left untouched) when its output row would be
  ``>= M``, when it is negative (``gather_len > seq_len``), when its block-table column is past
  ``block_table.shape[1]``, or when the block id is ``< 0`` or ``>= num_blocks``. A negative
  ``gather_len`` gathers nothing.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._contract import check_distinct_elements
from .._utils import HEAD_DIM, INT_DTYPES, INDEX_DTYPES, check_int, check_same_device, check_tensor
from .records import (
    RecordFormat,
    check_k_cache,
    decode_records_ref,
    encode_records_ref,
    record_views,
)

__all__ = [
    "quantize_and_insert_k_cache_ref",
    "dequantize_and_gather_k_cache_ref",
    "check_insert_args",
    "check_gather_args",
]


class InsertArgs(NamedTuple):
    fmt: RecordFormat
    cache: torch.Tensor  # 3-D [num_blocks, page, bytes] view of k_cache


class GatherArgs(NamedTuple):
    fmt: RecordFormat
    cache: torch.Tensor  # 3-D view
    num_reqs: int
    rows: int  # M


def check_insert_args(k, k_cache, slot_mapping) -> InsertArgs:
    """Validate ``quantize_and_insert_k_cache`` arguments (raises TypeError/ValueError)."""
    check_tensor("k", k, dtypes=(torch.bfloat16,), ndims=2, last_dim=HEAD_DIM)
    fmt, cache = check_k_cache("k_cache", k_cache)
    check_tensor("slot_mapping", slot_mapping, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping: expected {k.shape[0]} entries (one per row of k), "
            f"got {slot_mapping.shape[0]}"
        )
    check_same_device(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
    return InsertArgs(fmt, cache)


def check_gather_args(
    out, k_cache, seq_lens, gather_lens, block_table, block_size, offset
) -> GatherArgs:
    """Validate ``dequantize_and_gather_k_cache`` arguments (raises TypeError/ValueError)."""
    check_tensor("out", out, dtypes=(torch.bfloat16,), ndims=3, last_dim=HEAD_DIM)
    check_distinct_elements("out", out)
    fmt, cache = check_k_cache("k_cache", k_cache)
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndims=1, contiguous_last=False)
    if gather_lens is not None:
        check_tensor("gather_lens", gather_lens, dtypes=INDEX_DTYPES, ndims=1, contiguous_last=False)
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndims=2, contiguous_last=False)
    num_reqs, rows = out.shape[0], out.shape[1]
    if seq_lens.shape[0] != num_reqs:
        raise ValueError(
            f"seq_lens: expected {num_reqs} entries (out.shape[0]), got {seq_lens.shape[0]}"
        )
    if gather_lens is not None and gather_lens.shape[0] != num_reqs:
        raise ValueError(
            f"gather_lens: expected {num_reqs} entries (out.shape[0]), got {gather_lens.shape[0]}"
        )
    if block_table.shape[0] != num_reqs:
        raise ValueError(
            f"block_table: expected {num_reqs} rows (out.shape[0]), got {block_table.shape[0]}"
        )
    check_int("block_size", block_size, lo=1)
    if block_size != cache.shape[1]:
        raise ValueError(
            f"block_size: expected the cache page size {cache.shape[1]} "
            f"(k_cache.shape[1]), got {block_size}"
        )
    check_int("offset", offset, lo=0, hi=rows)
    check_same_device(
        out=out, k_cache=k_cache, seq_lens=seq_lens, gather_lens=gather_lens, block_table=block_table
    )
    return GatherArgs(fmt, cache, num_reqs, rows)


def quantize_and_insert_k_cache_ref(
    k: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference insert: encode ``k [T, 512]`` bf16 into the cache's record format and write
    each token's data row and scale row at ``slot_mapping[t]`` (skipped when the slot is ``< 0``
    or past the cache). Every other byte of ``k_cache`` is left as it was."""
    fmt, cache = check_insert_args(k, k_cache, slot_mapping)
    if k.shape[0] == 0:
        return
    nb, page = cache.shape[0], cache.shape[1]
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < nb * page)
    data, scales = encode_records_ref(k, fmt)
    s = slots[valid]
    dv, sv = record_views(cache, fmt)
    dv[s // page, s % page] = data[valid]
    sv[s // page, s % page] = scales[valid]


def dequantize_and_gather_k_cache_ref(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: Optional[torch.Tensor],
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
) -> None:
    """Reference gather: for request ``b`` decode the last ``g = gather_lens[b]`` (or
    ``seq_lens[b]``) positions of its sequence, read through ``block_table``, into
    ``out[b, offset : offset + g]`` as bf16. Rows past ``M`` and skipped positions (see the
    module docstring) are not written."""
    fmt, cache, num_reqs, rows = check_gather_args(
        out, k_cache, seq_lens, gather_lens, block_table, block_size, offset
    )
    n = rows - offset
    max_blocks = block_table.shape[1]
    if num_reqs == 0 or n == 0 or max_blocks == 0:
        return
    dev = out.device
    seq = seq_lens.long()
    g = seq if gather_lens is None else gather_lens.long()
    i = torch.arange(n, device=dev)
    pos = (seq - g)[:, None] + i[None, :]  # [B, n]
    ok = (i[None, :] < g[:, None]) & (pos >= 0)
    pos = torch.where(ok, pos, torch.zeros_like(pos))
    col = pos // block_size
    ok &= col < max_blocks
    col = torch.where(ok, col, torch.zeros_like(col))
    blk = block_table.long().gather(1, col)
    ok &= (blk >= 0) & (blk < cache.shape[0])
    bsel, isel = ok.nonzero(as_tuple=True)
    blk, off = blk[bsel, isel], pos[bsel, isel] % block_size
    data, scales = record_views(cache, fmt)
    out[bsel, offset + isel] = decode_records_ref(data[blk, off], scales[blk, off], fmt, out.dtype)
