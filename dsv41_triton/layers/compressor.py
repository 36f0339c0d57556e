"""DeepSeek V4 / V4.1 KV compressor (docs/compressor_indexer.md §1).

One compressed entry per ``r`` tokens: per channel, a softmax (over the entry's window of
tokens) of ``wgate x (+ ape)`` weights ``wkv x``; the pooled row is RMS-normed (with weight).
The layer then RoPEs it at the entry's first position ``e * r`` and writes it to the paged
compressed cache. Versions:

* V4 ratio 4: overlapping windows of 8 tokens (the previous group through channels ``0..D-1``
  of the ``2D``-wide projections, this group through ``D..2D-1``), ``ape [4, 2D]``.
* V4 ratio 128: the group's 128 tokens, ``ape [128, D]``.
* V4.1 ratio 2: the group's 2 tokens, no ``ape``. V4.1 ratio 1: ``RMSNorm(wkv x)`` per token.

Partial groups across steps: every token's projected row ``[kv | score]`` (fp32) is written to
a paged **state cache** ``float32 [num_blocks, page, 2 * C * D]`` at the token's window-cache
slot (the window cache's block table covers every position of a request), and a token that
completes an entry (``(pos + 1) % r == 0``) gathers its window's rows back from there. So
chunked prefill, decode steps and mixed batches need no per-request Python state; the state
lives in the same kind of paged cache as the KV, allocated beside it.

Arguments are checked (dtype, rank, shape, device, layout) before anything is computed or
written; a ``TypeError`` / ``ValueError`` names the argument. Values of device tensors are not
read (no host sync): a slot outside the state cache is skipped, a ``token_to_req`` without a
block-table row or a window position past the table reads no state row, and a position outside
``[0, max_pos)`` of the cos/sin table is left unrotated by :func:`rope_tail` (as the RoPE ops).

Weights are fp32 (as DeepSeek's reference keeps ``wkv``/``wgate``/``ape``/``norm``); the pooling
and the norm run in fp32. :func:`compress_sequence_ref` is the float64 oracle (a whole
request from position 0, no state).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .._contract import (
    INT_DTYPES,
    ROPE_DIM,
    check_bool,
    check_int,
    check_shape,
    check_tensor,
)
from ..ops.rope_ref import rope_cos_sin_ref

__all__ = ["CompressorSpec", "KVCompressor", "compress_sequence_ref", "rms_norm_f", "rope_tail"]


@dataclass(frozen=True)
class CompressorSpec:
    """Shape of one compressor: ``ratio``, output width ``dim``, ``overlap`` (V4 ratio 4),
    ``ape`` (V4: a learned position bias per offset in the group)."""

    ratio: int
    dim: int
    hidden_size: int
    overlap: bool = False
    ape: bool = False
    eps: float = 1e-6

    def __post_init__(self):
        for f in ("ratio", "dim", "hidden_size"):
            check_int(f, getattr(self, f), lo=1)

    @classmethod
    def for_version(cls, version: str, ratio: int, dim: int, hidden_size: int,
                    eps: float = 1e-6) -> CompressorSpec:
        """``version`` "v4" (ratios 4 / 128; overlap at 4, ``ape``) or "v4.1" (ratios 1 / 2)."""
        check_int("ratio", ratio, lo=1)
        if version == "v4":
            return cls(ratio, dim, hidden_size, overlap=ratio == 4, ape=True, eps=eps)
        if version == "v4.1":
            if ratio not in (1, 2):
                raise ValueError(f"ratio: V4.1 compresses at ratio 1 or 2, got {ratio}")
            return cls(ratio, dim, hidden_size, eps=eps)
        raise ValueError(f"version: expected 'v4' or 'v4.1', got {version!r}")

    @property
    def coff(self) -> int:
        """Projection width multiplier: 2 with overlap (two series), else 1."""
        return 2 if self.overlap else 1

    @property
    def window(self) -> int:
        """Tokens pooled into one entry."""
        return self.coff * self.ratio

    @property
    def state_width(self) -> int:
        """fp32 values per token in the state cache (0: ratio 1 keeps no state)."""
        return 0 if self.ratio == 1 else 2 * self.coff * self.dim


_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_rows(name: str, t: object, width: int | None, device: torch.device,
                T: int | None = None) -> torch.Tensor:
    """A float ``[T, width]`` activation on ``device`` (any strides)."""
    check_tensor(name, t, dtypes=_FLOAT_DTYPES, ndims=2, contiguous_last=False, device=device)
    check_shape(name, t, (T, width))
    return t


def _check_per_token(name: str, t: object, T: int, device: torch.device | None,
                     dtypes=INT_DTYPES) -> None:
    """A ``[T]`` int (or ``dtypes``) tensor on ``device`` (any stride)."""
    check_tensor(name, t, dtypes=dtypes, ndims=1, contiguous_last=False, device=device)
    check_shape(name, t, (T,))


def _check_positions(positions: object, device: torch.device) -> int:
    """``positions [T]`` int on ``device`` (any stride); returns ``T``."""
    check_tensor("positions", positions, dtypes=INT_DTYPES, ndims=1, contiguous_last=False,
                 device=device)
    return positions.shape[0]


def _check_valid(valid: object, T: int, device: torch.device) -> None:
    if valid is not None:
        _check_per_token("valid", valid, T, device, dtypes=(torch.bool,))


def _check_cos_sin_cache(cs: object, device: torch.device, name: str = "cos_sin_cache") -> None:
    """``[max_pos, 64]`` fp32 (fp64 for a float64 reference), cos | sin, on ``device``."""
    check_tensor(name, cs, dtypes=(torch.float32, torch.float64), ndims=2, last_dim=ROPE_DIM,
                 contiguous_last=False, device=device)


def _check_state_cache(cache: object, width: int, device: torch.device) -> torch.Tensor:
    """``float32 [num_blocks >= 1, page >= 1, width]`` whose rows can be addressed as one
    ``[num_blocks * page, width]`` view (blocks back to back, rows not overlapping); returns it."""
    check_tensor("state_cache", cache, dtypes=(torch.float32,), ndims=3, last_dim=width,
                 device=device)
    nb, page = cache.shape[0], cache.shape[1]
    if nb < 1 or page < 1:
        raise ValueError(f"state_cache: expected at least one block of at least one token, got "
                         f"shape {tuple(cache.shape)}")
    try:
        flat = cache.view(nb * page, width)
    except RuntimeError:
        flat = None
    if flat is None or (flat.shape[0] > 1 and flat.stride(0) < width):
        raise ValueError(
            f"state_cache: expected blocks of back-to-back rows (viewable as [num_blocks * page, "
            f"{width}], stride(0) == page * stride(1) >= page * {width}), got strides "
            f"{tuple(cache.stride())}")
    return flat


def rms_norm_f(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in ``x.dtype`` (use fp32 / fp64): ``x * rsqrt(mean(x**2) + eps) * weight``."""
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, contiguous_last=False)
    if x.dim() == 0:
        raise ValueError("x: expected at least one dim, got a 0-D tensor")
    check_tensor("weight", weight, dtypes=_FLOAT_DTYPES, ndims=1, contiguous_last=False,
                 device=x.device)
    check_shape("weight", weight, (x.shape[-1],))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)


class KVCompressor(nn.Module):
    """One layer's compressor (parameters under DeepSeek's names: ``wkv.weight``,
    ``wgate.weight``, ``ape``, ``norm.weight``)."""

    def __init__(self, spec: CompressorSpec, device=None):
        super().__init__()
        self.spec = spec
        C, D, Hd = spec.coff, spec.dim, spec.hidden_size
        kw = {"device": device, "dtype": torch.float32}
        self.wkv = nn.Linear(Hd, C * D, bias=False, **kw)
        self.wgate = nn.Linear(Hd, C * D, bias=False, **kw) if spec.ratio > 1 else None
        self.ape = nn.Parameter(torch.zeros(spec.ratio, C * D, **kw)) if spec.ape else None
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(D, **kw))
        for p in self.parameters():
            p.requires_grad_(False)

    # ---- pieces -----------------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return self.wkv.weight.device

    def _check_inputs(self, x: object, positions: object, valid: object = None) -> int:
        """``x [T, hidden]`` float, ``positions [T]`` int, ``valid`` None or ``[T]`` bool, all
        on the parameters' device; returns ``T``."""
        dev = self._device
        _check_rows("x", x, self.spec.hidden_size, dev)
        T = x.shape[0]
        _check_per_token("positions", positions, T, dev)
        _check_valid(valid, T, dev)
        return T

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> fp32 rows ``[T, 2 C D]`` = ``[wkv x | wgate x + ape[pos % r]]``."""
        if self.wgate is None:
            raise RuntimeError("project: a ratio-1 compressor keeps no state rows (no wgate)")
        self._check_inputs(x, positions)
        return self._project(x, positions)

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        kv = xf @ self.wkv.weight.t()
        sc = xf @ self.wgate.weight.t()
        if self.ape is not None:
            sc = sc + self.ape[positions.long() % self.spec.ratio]
        return torch.cat([kv, sc], -1)

    def pool(self, rows: torch.Tensor, first_entry: torch.Tensor) -> torch.Tensor:
        """Pool windows ``rows [n, window, 2 C D]`` (positions ascending; with overlap the first
        ``r`` rows belong to the previous group, ignored where ``first_entry``) -> ``[n, D]``
        normed fp32."""
        s = self.spec
        check_tensor("rows", rows, dtypes=(torch.float32,), ndims=3, contiguous_last=False,
                     device=self._device)
        check_shape("rows", rows, (None, s.window, 2 * s.coff * s.dim))
        _check_per_token("first_entry", first_entry, rows.shape[0], self._device,
                         dtypes=(torch.bool,))
        return self._pool(rows, first_entry)

    def _pool(self, rows: torch.Tensor, first_entry: torch.Tensor) -> torch.Tensor:
        s = self.spec
        D, r = s.dim, s.ratio
        kv, sc = rows[..., : s.coff * D], rows[..., s.coff * D:]
        if s.overlap:
            prev_sc = sc[:, :r, :D].masked_fill(first_entry[:, None, None], float("-inf"))
            kv = torch.cat([kv[:, :r, :D], kv[:, r:, D:]], 1)
            sc = torch.cat([prev_sc, sc[:, r:, D:]], 1)
        pooled = (kv * torch.softmax(sc, dim=1)).sum(1)
        return rms_norm_f(pooled, self.norm.weight, s.eps)

    # ---- one step ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: torch.Tensor, token_to_req: torch.Tensor | None = None,
                state_cache: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                slot_mapping: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Compress one step's tokens.

        Args:
            x: ``[T, hidden]`` float, the layer input; positions ``[T]`` int.
            token_to_req, block_table, slot_mapping: the window cache's (``[T]``, ``[B, blocks]``,
                ``[T]``, int); ``state_cache`` ``float32 [num_blocks, page, state_width]`` shares
                its geometry. Not needed at ratio 1 (checked when given, ``state_cache``
                ignored). All on the parameters' device.
            valid: ``[T]`` bool, False for padding tokens (never complete an entry).
        Returns:
            ``(latent [T, D] fp32, completes [T] bool)``: the normed, not yet RoPE'd entry
            ``pos // r`` on the rows of tokens completing it (``completes``), zeros elsewhere.
        """
        s = self.spec
        T = self._check_inputs(x, positions, valid)
        dev = x.device
        for name, t in (("token_to_req", token_to_req), ("slot_mapping", slot_mapping)):
            if t is not None:
                _check_per_token(name, t, T, dev)
        if block_table is not None:
            check_tensor("block_table", block_table, dtypes=INT_DTYPES, ndims=2,
                         contiguous_last=False, device=dev)
        flat = None
        if s.ratio > 1:
            missing = [n for n, t in (("state_cache", state_cache), ("block_table", block_table),
                                      ("slot_mapping", slot_mapping), ("token_to_req", token_to_req))
                       if t is None]
            if missing:
                raise ValueError(f"{', '.join(missing)}: required at ratio {s.ratio}")
            flat = _check_state_cache(state_cache, s.state_width, dev)
        pos = positions.long()
        completes = (pos + 1) % s.ratio == 0
        if valid is not None:
            completes &= valid
        if s.ratio == 1:
            lat = rms_norm_f(x.float() @ self.wkv.weight.t(), self.norm.weight, s.eps)
            return lat * completes[:, None], completes
        nb, page = state_cache.shape[0], state_cache.shape[1]
        out = torch.zeros(T, s.dim, dtype=torch.float32, device=dev)
        if T == 0:
            return out, completes
        rows = self._project(x, positions)
        slots = slot_mapping.long()
        ok = (slots >= 0) & (slots < nb * page)
        flat[slots[ok]] = rows[ok]
        idx = completes.nonzero().squeeze(1)
        if idx.numel() == 0:
            return out, completes
        L = s.window
        wpos = pos[idx, None] - L + 1 + torch.arange(L, device=dev)[None, :]  # [n, L]
        req = token_to_req.long()[idx]
        B, ncols = block_table.shape
        col = wpos.clamp_min(0) // page
        have = (wpos >= 0) & (col < ncols) & ((req >= 0) & (req < B))[:, None]
        if B == 0 or ncols == 0:
            blk = torch.full_like(wpos, -1)
        else:
            blk = block_table.long()[req.clamp(0, B - 1)[:, None], col.clamp_max(ncols - 1)]
        have &= (blk >= 0) & (blk < nb)
        wslot = blk * page + wpos.clamp_min(0) % page
        win = flat[wslot.clamp(0, nb * page - 1)]
        win = torch.where(have[..., None], win, torch.zeros_like(win))
        first = pos[idx] < s.ratio  # entry 0: no previous group
        out[idx] = self._pool(win, first)
        return out, completes

    # ---- weights ----------------------------------------------------------------------------
    def load(self, sd: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Load ``{prefix}wkv.weight``, ``wgate.weight``, ``ape``, ``norm.weight`` (DeepSeek),
        or the transformers names ``kv_proj.weight``, ``gate_proj.weight``, ``position_bias``,
        ``kv_norm.weight``."""
        alias = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight",
                 "ape": "position_bias", "norm.weight": "kv_norm.weight"}
        for name, p in self.named_parameters():
            t = sd.get(prefix + name, sd.get(prefix + alias[name]))
            if t is None:
                raise ValueError(f"state_dict: missing {prefix + name} (or {prefix + alias[name]})")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"state_dict[{prefix + name!r}]: expected {tuple(p.shape)}, got {tuple(t.shape)}")
            with torch.no_grad():
                p.copy_(t.float())


def compress_sequence_ref(x: torch.Tensor, comp: KVCompressor) -> torch.Tensor:
    """Float64 oracle: the normed (pre-RoPE) entries ``[S // r, D]`` of one request's tokens
    ``x [S, hidden]`` at positions ``0 .. S - 1``, written straight from the rules."""
    if not isinstance(comp, KVCompressor):
        raise TypeError(f"comp: expected a KVCompressor, got {type(comp).__name__}")
    _check_rows("x", x, comp.spec.hidden_size, comp._device)
    s = comp.spec
    xd = x.double()
    w = {n: p.detach().double() for n, p in comp.named_parameters()}
    kv = xd @ w["wkv.weight"].t()
    n = x.shape[0] // s.ratio
    D, r = s.dim, s.ratio
    out = torch.empty(n, D, dtype=torch.float64, device=x.device)
    if r == 1:
        return rms_norm_f(kv, w["norm.weight"], s.eps)
    sc = xd @ w["wgate.weight"].t()
    if s.ape:
        sc = sc + w["ape"][torch.arange(x.shape[0], device=x.device) % r]
    for e in range(n):
        cur = slice(e * r, (e + 1) * r)
        if s.overlap:
            ks, ss = [kv[cur, D:]], [sc[cur, D:]]
            if e > 0:
                prev = slice((e - 1) * r, e * r)
                ks.insert(0, kv[prev, :D])
                ss.insert(0, sc[prev, :D])
            k_, s_ = torch.cat(ks), torch.cat(ss)
        else:
            k_, s_ = kv[cur], sc[cur]
        wts = torch.exp(s_ - s_.max(0).values) / torch.exp(s_ - s_.max(0).values).sum(0)
        out[e] = rms_norm_f((wts * k_).sum(0), w["norm.weight"], s.eps)
    return out


def rope_tail(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
              inverse: bool = False) -> torch.Tensor:
    """GPT-J RoPE (SPEC §2) of the last 64 dims of ``x [T, ..., dim]`` at ``positions [T]``,
    in ``x.dtype`` (fp32 / fp64); the other dims are copied. A new tensor. A position outside
    ``[0, max_pos)`` of ``cos_sin_cache [max_pos, 64]`` is not rotated (as the RoPE ops)."""
    check_tensor("x", x, dtypes=_FLOAT_DTYPES, contiguous_last=False)
    if x.dim() < 2 or x.shape[-1] < ROPE_DIM:
        raise ValueError(f"x: expected [T, ..., dim >= {ROPE_DIM}], got shape {tuple(x.shape)}")
    _check_per_token("positions", positions, x.shape[0], x.device)
    _check_cos_sin_cache(cos_sin_cache, x.device)
    check_bool("inverse", inverse)
    if cos_sin_cache.shape[0] == 0:
        return x.clone()
    cos, sin = rope_cos_sin_ref(positions, cos_sin_cache, x.dtype)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (ROPE_DIM // 2,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    a, b = x[..., -64::2], x[..., -63::2]
    out = x.clone()
    out[..., -64::2] = a * cos - b * sin
    out[..., -63::2] = b * cos + a * sin
    return out
