"""Float64 PyTorch references for sparse MLA attention with a sink (SPEC §3).

For query head ``h`` over the key set ``S`` of its token (every key row is also its value)::

    z_j   = scale * <q_h, k_j>                       (all 512 dims)
    out_h = sum_j exp(z_j) k_j / (sum_j exp(z_j) + exp(sink_h))
    lse_h = log(sum_j exp(z_j))                      (natural log, sink NOT included)

A token with no valid key gets ``out = 0`` and ``lse = +inf``. Skipped key columns: index
``< 0`` anywhere, columns at or past the row's ``len`` (lens are clamped to ``[0, width]``),
and (so that nothing reads out of bounds) an index at or past the number of rows / slots.
Duplicated indices count twice. NaN propagates: a NaN in ``q[t, h]`` or in a selected key
gives NaN in ``out[t, h]`` and ``lse[t, h]``; a NaN sink makes every ``out`` row of its head NaN
(tokens with and without keys), ``lse`` unaffected;
``T = 0`` and index width 0 are fine (empty outputs; ``0`` / ``+inf``). The full table is
``docs/semantics.md``.

These are oracles, not fast paths: everything is float64, the keys are materialized per
token chunk (memory ``chunk * keys * 512 * 8`` bytes).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .._utils import HEAD_DIM
from ..ops.records import check_k_cache, read_slots_ref

#: tokens per reference chunk (bounds the float64 key tensor)
_REF_CHUNK_ELEMS = 1 << 26


def _column_mask(indices: torch.Tensor, lens: Optional[torch.Tensor], limit: int) -> torch.Tensor:
    """``[T, K]`` bool: column read and index in ``[0, limit)``."""
    T, K = indices.shape
    valid = (indices >= 0) & (indices < limit)
    if lens is not None:
        cols = torch.arange(K, device=indices.device)
        valid &= cols[None, :] < lens.to(indices.device).long()[:, None]
    return valid


def _attend(
    q: torch.Tensor, keys: List[torch.Tensor], masks: List[torch.Tensor],
    sink: Optional[torch.Tensor], scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [t, H, D] f64; keys[i] [t, K_i, D] f64; masks[i] [t, K_i] -> (out f64, lse f64)."""
    k = torch.cat(keys, 1) if len(keys) > 1 else keys[0]
    valid = torch.cat(masks, 1) if len(masks) > 1 else masks[0]
    t, H = q.shape[0], q.shape[1]
    # the output of a row without keys: 0, NaN in a head whose sink is NaN
    empty = torch.zeros(t, H, HEAD_DIM, dtype=q.dtype, device=q.device)
    if sink is not None:
        empty = empty.masked_fill(torch.isnan(sink)[None, :, None], float("nan"))
    if k.shape[1] == 0:  # index width 0: no keys at all
        return empty, torch.full((t, H), float("inf"), dtype=q.dtype, device=q.device)
    z = torch.einsum("thd,tkd->thk", q, k) * scale
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    # the max over the finite logits (a NaN logit must not hide the others; it reaches l
    # through exp below), -inf for a row without keys
    zf = torch.where(torch.isnan(z), torch.full_like(z, float("-inf")), z)
    m = zf.amax(-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(z - m_safe)  # exactly 0 where masked, NaN where the logit is NaN
    l = p.sum(-1)  # [t, H]
    den = l
    if sink is not None:
        den = l + torch.exp(sink.double()[None, :] - m_safe[..., 0])
    num = torch.einsum("thk,tkd->thd", p, k)
    # "no key" means l == 0 exactly; a NaN l (NaN in q or a key) or a NaN sink propagates
    has = l != 0
    out = torch.where(has[..., None], num / torch.where(has, den, torch.ones_like(den))[..., None],
                      empty)
    lse = torch.where(has, torch.log(torch.where(has, l, torch.ones_like(l))) + m_safe[..., 0],
                      torch.full_like(l, float("inf")))
    return out, lse


def _empty(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    H = q.shape[1]
    return (torch.zeros(0, H, HEAD_DIM, dtype=torch.float64, device=q.device),
            torch.zeros(0, H, dtype=torch.float64, device=q.device))


def _chunks(T: int, keys: int):
    step = max(1, _REF_CHUNK_ELEMS // max(1, keys * HEAD_DIM))
    for s in range(0, T, step):
        yield s, min(T, s + step)


def sparse_mla_decode_ref(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: Optional[torch.Tensor],
    extra_cache: Optional[torch.Tensor] = None,
    extra_indices: Optional[torch.Tensor] = None,
    extra_lens: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Decode over paged record caches, one softmax over both key sets.

    q ``[T, H, 512]``; caches uint8 ``[num_blocks, page, bytes]`` (records decoded with
    ``records.read_slots_ref``); indices ``[T, W]`` slot ids; lens ``[T]`` (None = all
    columns). Returns ``(out [T, H, 512] float64, lse [T, H] float64)``.
    """
    scale = HEAD_DIM ** -0.5 if softmax_scale is None else float(softmax_scale)
    sets = [(swa_cache, swa_indices, swa_lens)]
    if extra_cache is not None:
        sets.append((extra_cache, extra_indices, extra_lens))
    prepared = []
    for cache, idx, lens in sets:
        _, c3 = check_k_cache("cache", cache)
        nslots = c3.shape[0] * c3.shape[1]
        mask = _column_mask(idx.long(), lens, nslots)
        prepared.append((c3, idx.long(), mask))
    T = q.shape[0]
    total_keys = sum(p[1].shape[1] for p in prepared)
    if T == 0:
        return _empty(q)
    outs, lses = [], []
    for a, b in _chunks(T, total_keys):
        keys, masks = [], []
        for c3, idx, mask in prepared:
            slots = torch.where(mask[a:b], idx[a:b], torch.full_like(idx[a:b], -1))
            keys.append(read_slots_ref(c3, slots, torch.float32).double())
            masks.append(mask[a:b])
        o, l = _attend(q[a:b].double(), keys, masks, attn_sink, scale)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, 0), torch.cat(lses, 0)


def sparse_mla_prefill_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Prefill over a bf16 workspace: ``kv [S, 512]`` (or ``[S, 1, 512]``), ``indices [T, K]``
    (or ``[T, 1, K]``) rows of ``kv``; indices ``< 0`` or ``>= S`` skipped. Returns
    ``(out [T, H, 512] float64, lse [T, H] float64)``."""
    scale = HEAD_DIM ** -0.5 if softmax_scale is None else float(softmax_scale)
    kv2 = kv.reshape(kv.shape[0], HEAD_DIM)
    idx = indices.reshape(indices.shape[0], indices.shape[-1]).long()
    S = kv2.shape[0]
    mask = _column_mask(idx, lens, S)
    T = q.shape[0]
    if T == 0:
        return _empty(q)
    outs, lses = [], []
    for a, b in _chunks(T, idx.shape[1]):
        rows = torch.where(mask[a:b], idx[a:b], torch.zeros_like(idx[a:b]))
        keys = kv2[rows].double() if S > 0 else torch.zeros(
            b - a, idx.shape[1], HEAD_DIM, dtype=torch.float64, device=q.device)
        o, l = _attend(q[a:b].double(), [keys], [mask[a:b]], attn_sink, scale)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, 0), torch.cat(lses, 0)


__all__ = ["sparse_mla_decode_ref", "sparse_mla_prefill_ref"]
