"""The layouts of the fused ("mega") contract, SPEC §6, in plain PyTorch index math.

Two layouts per tensor:

* **Q** ``[T, H, 512]``. Standard: head-major, element ``(h, d)`` at ``h*512 + d`` of a
  token's ``H*512`` values. Interleaved (FlashMLA): at ``(d // 16) * (H*16) + h*16 + d % 16``,
  i.e. 16-dim slices of all heads side by side. An interleaved Q keeps the tensor shape
  ``[T, H, 512]``; only the order of a token's ``H*512`` values changes.
* **Output groups** ``[T, G, 4096]``, ``G = H / 8`` (``WV_GROUP_SIZE = 8`` heads per ``wo_a``
  group). Standard: ``(h, d)`` of the group at ``h*512 + d``. Interleaved: ``(h, d = 32c + j)``
  at ``(c*8 + h)*32 + j``, i.e. each 32-dim chunk of the 8 heads side by side (so the MXFP8
  scale chunks are the same 32-element pieces in both layouts, only their order differs).

The weight permutations let the GEMMs around attention speak the interleaved layout:

* ``wq_b`` (``q_lora_rank -> H*512``, weight ``[H*512, q_lora_rank]``): permuting its rows
  with :func:`permute_wq_b` makes ``x @ w.T`` produce the interleaved Q directly.
* ``wo_a`` (per group, input width ``8*512``, weight ``[..., 4096]``): permuting its input
  columns with :func:`permute_wo_a` makes it consume the interleaved output group.

The permutations move whole rows/columns, so they are exact on any dtype. They do not carry
block-quantization scales (a 128-row block of the permuted ``wq_b`` mixes 8 heads): permute
the dequantized weight (or per-row/per-tensor quantized weights) and re-quantize.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from .._contract import GROUP_WIDTH, LAYOUTS, WV_GROUP_SIZE, check_layout  # noqa: F401
from .._utils import HEAD_DIM, check_int, check_tensor

Q_SLICE = 16  # dims per head slice in the interleaved Q
O_CHUNK = 32  # dims per head chunk in the interleaved output


# --------------------------------------------------------------------------------------------
# index maps
# --------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _q_index_cpu(num_heads: int) -> torch.Tensor:
    std = torch.arange(num_heads * HEAD_DIM).view(num_heads, HEAD_DIM // Q_SLICE, Q_SLICE)
    return std.permute(1, 0, 2).reshape(-1)


def q_interleave_index(num_heads: int, device="cpu") -> torch.Tensor:
    """``idx [H*512]`` int64: interleaved position ``p`` holds standard element ``idx[p]``
    (``= h*512 + d`` for ``p = (d // 16) * (H*16) + h*16 + d % 16``)."""
    check_int("num_heads", num_heads, lo=1)
    return _q_index_cpu(num_heads).to(device, copy=True)


@lru_cache(maxsize=None)
def _o_index_cpu() -> torch.Tensor:
    std = torch.arange(GROUP_WIDTH).view(WV_GROUP_SIZE, HEAD_DIM // O_CHUNK, O_CHUNK)
    return std.permute(1, 0, 2).reshape(-1)


def o_interleave_index(device="cpu") -> torch.Tensor:
    """``idx [4096]`` int64: interleaved position ``p`` of an output group holds standard
    element ``idx[p]`` (``= h*512 + 32c + j`` for ``p = (c*8 + h)*32 + j``)."""
    return _o_index_cpu().to(device, copy=True)


def inverse_permutation(idx: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[idx[p]] = p``."""
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(idx.numel(), device=idx.device)
    return inv


# --------------------------------------------------------------------------------------------
# activations
# --------------------------------------------------------------------------------------------
def _check_q(name: str, q: object) -> torch.Tensor:
    check_tensor(name, q, ndims=3, last_dim=HEAD_DIM, contiguous_last=False)
    return q


def q_to_interleaved(q: torch.Tensor) -> torch.Tensor:
    """Standard ``q [T, H, 512]`` -> interleaved, same shape, new contiguous tensor."""
    _check_q("q", q)
    T, H, _ = q.shape
    return q.reshape(T, H, HEAD_DIM // Q_SLICE, Q_SLICE).transpose(1, 2).reshape(T, H, HEAD_DIM)


def q_from_interleaved(q: torch.Tensor) -> torch.Tensor:
    """Interleaved ``q [T, H, 512]`` -> standard, same shape, new contiguous tensor."""
    _check_q("q", q)
    T, H, _ = q.shape
    return q.reshape(T, HEAD_DIM // Q_SLICE, H, Q_SLICE).transpose(1, 2).reshape(T, H, HEAD_DIM)


def _check_heads(name: str, H: int) -> int:
    if H % WV_GROUP_SIZE != 0 or H == 0:
        raise ValueError(f"{name}: the number of heads must be a positive multiple of 8, got {H}")
    return H // WV_GROUP_SIZE


def output_to_groups(o: torch.Tensor, layout: str = "standard") -> torch.Tensor:
    """``o [T, H, 512]`` (H a multiple of 8) -> ``[T, H/8, 4096]`` in ``layout``
    (standard is a reshape; interleaved puts ``(h, 32c + j)`` at ``(c*8 + h)*32 + j``)."""
    check_layout(layout)
    check_tensor("o", o, ndims=3, last_dim=HEAD_DIM, contiguous_last=False)
    T, H, _ = o.shape
    G = _check_heads("o", H)
    if layout == "standard":
        return o.reshape(T, G, GROUP_WIDTH)
    x = o.reshape(T, G, WV_GROUP_SIZE, HEAD_DIM // O_CHUNK, O_CHUNK).transpose(2, 3)
    return x.reshape(T, G, GROUP_WIDTH)


def output_from_groups(x: torch.Tensor, layout: str = "standard") -> torch.Tensor:
    """Inverse of :func:`output_to_groups`: ``[T, G, 4096]`` -> ``[T, 8*G, 512]``."""
    check_layout(layout)
    check_tensor("x", x, ndims=3, last_dim=GROUP_WIDTH, contiguous_last=False)
    T, G, _ = x.shape
    if layout == "standard":
        return x.reshape(T, G * WV_GROUP_SIZE, HEAD_DIM)
    y = x.reshape(T, G, HEAD_DIM // O_CHUNK, WV_GROUP_SIZE, O_CHUNK).transpose(2, 3)
    return y.reshape(T, G * WV_GROUP_SIZE, HEAD_DIM)


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------
def _dim(name: str, w: object, dim: int) -> int:
    check_tensor(name, w, contiguous_last=False)
    if w.dim() == 0:
        raise ValueError(f"{name}: expected at least a 1-D tensor")
    check_int("dim", dim, lo=-w.dim(), hi=w.dim() - 1)
    return dim % w.dim()


def _wq_b_index(w: torch.Tensor, dim: int, num_heads: Optional[int]) -> torch.Tensor:
    n = w.shape[dim]
    if num_heads is None:
        if n % HEAD_DIM != 0 or n == 0:
            raise ValueError(f"w: dim {dim} must be H*512, got {n}")
        num_heads = n // HEAD_DIM
    check_int("num_heads", num_heads, lo=1)
    if n != num_heads * HEAD_DIM:
        raise ValueError(f"w: dim {dim} must be num_heads*512 = {num_heads * HEAD_DIM}, got {n}")
    return q_interleave_index(num_heads, w.device)


def permute_wq_b(w: torch.Tensor, num_heads: Optional[int] = None, dim: int = 0) -> torch.Tensor:
    """``wq_b [H*512, q_lora_rank]`` -> the row-permuted weight whose GEMM output is the
    interleaved Q: ``q_to_interleaved((x @ w.T).view(T, H, 512)) == (x @ w'.T).view(T, H, 512)``.
    ``dim`` is the output-feature dim (0 for the ``nn.Linear`` ``[out, in]`` weight)."""
    d = _dim("w", w, dim)
    return w.index_select(d, _wq_b_index(w, d, num_heads))


def unpermute_wq_b(w: torch.Tensor, num_heads: Optional[int] = None, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`permute_wq_b`."""
    d = _dim("w", w, dim)
    return w.index_select(d, inverse_permutation(_wq_b_index(w, d, num_heads)))


def _wo_a_index(w: torch.Tensor, dim: int) -> torch.Tensor:
    if w.shape[dim] != GROUP_WIDTH:
        raise ValueError(
            f"w: dim {dim} must be the group's input width 8*512 = {GROUP_WIDTH}, got {w.shape[dim]}"
        )
    return o_interleave_index(w.device)


def permute_wo_a(w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``wo_a`` weight ``[..., 4096]`` (per group: ``[G, o_lora_rank, 4096]`` or
    ``[G*o_lora_rank, 4096]``) -> the column-permuted weight that consumes the interleaved
    output group: ``output_to_groups(o, "interleaved") @ w'.T == output_to_groups(o) @ w.T``
    per group. ``dim`` is the input-feature dim."""
    d = _dim("w", w, dim)
    return w.index_select(d, _wo_a_index(w, d))


def unpermute_wo_a(w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`permute_wo_a`."""
    d = _dim("w", w, dim)
    return w.index_select(d, inverse_permutation(_wo_a_index(w, d)))
