"""Lightning-indexer ops in plain PyTorch: the reference of :mod:`dsv41_triton.ops.indexer`.

Rules (docs/compressor_indexer.md §2-§4):

* FP4 simulation of an activation row: groups of 32, power-of-two scale
  ``s = 2**ceil(log2(max(amax, 6 * 2**-126) / 6))``, values ``e2m1(clamp(x / s, -6, 6)) * s``.
* Index-key cache: uint8 ``[num_blocks, page, dim + 4]``, split per block: ``page`` rows of
  ``dim`` e4m3 bytes, then ``page`` fp32 row scales. Row value = ``e4m3 * scale``.
  With ``fp4=True`` the row is FP4-simulated first and ``scale = 2**(max_g e_g - 6)`` (every
  simulated value exact while the group exponents span <= 14); with ``fp4=False``
  ``scale = 2**ceil(log2(max(amax, 1e-4) / 448))`` (plain FP8 row).
* Logits ``out[t, j] = sum_h relu(q[t, h] . k_j) * w[t, h]`` for ``j < visible_lens[t]``, ``-inf``
  elsewhere (also where the block table has no block for ``j``).
* Top-k: the ``k`` largest finite logits of ``logits[t, :lens[t]]``, ties to the lower entry,
  returned in ascending entry order, ``-1`` padded.
"""
from __future__ import annotations

import torch

from .._contract import (
    INDEX_DTYPES,
    INT_DTYPES,
    check_bool,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
)
from .records import (
    E4M3_MAX,
    e2m1_codes_to_float,
    exp2_int,
    round_to_e2m1_codes,
    ue8m0_exponent,
)

FP4_GROUP = 32
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126
INDEX_SCALE_BYTES = 4
#: FP4-simulated rows: the largest group maps to <= 6 * 2**6 = 384 <= 448
INDEX_ROW_SHIFT = 6
ROW_AMAX_FLOOR = 1e-4
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

__all__ = [
    "FP4_GROUP",
    "INDEX_SCALE_BYTES",
    "allocate_index_k_cache",
    "apply_candidates_ref",
    "candidate_blocks_ref",
    "check_index_k_cache",
    "encode_index_rows_ref",
    "fp4_exponents",
    "fp4_simulate_ref",
    "hadamard_ref",
    "index_cache_views",
    "index_logits_ref",
    "index_topk_ref",
    "quantize_and_insert_index_k_ref",
    "read_index_k_ref",
]


# --------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------
def allocate_index_k_cache(num_blocks: int, page_size: int, dim: int = 128, device="cpu") -> torch.Tensor:
    """A zeroed index-key cache ``uint8 [num_blocks, page_size, dim + 4]``."""
    check_int("num_blocks", num_blocks, lo=1)
    check_int("page_size", page_size, lo=1)
    check_int("dim", dim, lo=FP4_GROUP)
    if dim & (dim - 1):
        raise ValueError(f"dim: expected a power of two >= {FP4_GROUP}, got {dim}")
    return torch.zeros(num_blocks, page_size, dim + INDEX_SCALE_BYTES, dtype=torch.uint8, device=device)


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover - torch < 2.3
        return False


def check_index_k_cache(name: str, cache: object, dim: int | None = None) -> tuple[torch.Tensor, int]:
    """Validate an index-key cache (``uint8 [num_blocks, page, dim + 4]`` or a 4-D
    ``[num_blocks, page, 1, dim + 4]`` view); return ``(cache as 3-D, dim)``. A block's rows
    must be back to back (``stride(1) == dim + 4``, bytes contiguous), blocks may be padded
    (``stride(0) >= page * (dim + 4)``, a multiple of 4, as the base offset); a page-dim slice
    of a larger cache is rejected (its scale rows are not after its own ``page`` data rows)."""
    check_tensor(name, cache, dtypes=(torch.uint8,), ndims=(3, 4))
    arg = cache
    if cache.dim() == 4:
        if cache.shape[2] != 1:
            raise ValueError(f"{name}: a 4-D cache must be [num_blocks, page, 1, bytes], got {tuple(cache.shape)}")
        cache = cache.squeeze(2)
    d = cache.shape[-1] - INDEX_SCALE_BYTES
    if d < FP4_GROUP or d & (d - 1):
        raise ValueError(f"{name}: last dim must be dim + 4 with dim a power of two >= {FP4_GROUP}, "
                         f"got {cache.shape[-1]}")
    if dim is not None and d != dim:
        raise ValueError(f"{name}: expected rows of {dim} keys (last dim {dim + 4}), got {cache.shape[-1]}")
    nb, page, rb = cache.shape[0], cache.shape[1], d + INDEX_SCALE_BYTES
    if page < 1:
        raise ValueError(f"{name}: expected a page size >= 1, got shape {tuple(arg.shape)}")
    if page > 1 and cache.stride(1) != rb:
        raise ValueError(f"{name}: the rows of a block must be back to back (page-dim stride "
                         f"{rb}), got strides {tuple(arg.stride())}; pass the cache itself, not "
                         f"a transposed or strided view")
    if nb > 1 and cache.stride(0) < page * rb:
        raise ValueError(f"{name}: block stride {cache.stride(0)} is smaller than page*bytes")
    if cache.stride(0) % 4 or cache.storage_offset() % 4:
        raise ValueError(f"{name}: block stride and offset must be multiples of 4 bytes (fp32 scales)")
    base = None if _compiling() else arg._base
    if (base is not None and base.dtype == torch.uint8 and base.dim() in (3, 4)
            and base.shape[-1] == rb and base.shape[1] > page and base.stride(1) == rb
            and (nb <= 1 or cache.stride(0) == base.stride(0))):
        raise ValueError(f"{name}: a view of {page} rows per block cut from a cache of "
                         f"{base.shape[1]}; a block holds all its data rows, then their scales, so "
                         f"a page-dim slice is not a cache. Pass the whole cache")
    return cache, d


def index_cache_views(cache: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``data uint8 [nb, page, dim]`` and ``scale float32 [nb, page]`` views of a 3-D cache."""
    nb, page = cache.shape[0], cache.shape[1]
    s0, off = cache.stride(0), cache.storage_offset()
    data = cache.as_strided((nb, page, dim), (s0, dim, 1), off)
    sc = cache.as_strided((nb, page, INDEX_SCALE_BYTES), (s0, INDEX_SCALE_BYTES, 1), off + page * dim)
    return data, sc.view(torch.float32).squeeze(-1)


# --------------------------------------------------------------------------------------------
# FP4 simulation and the Hadamard transform
# --------------------------------------------------------------------------------------------
def _check_groups(x: object, group: object) -> None:
    """``x [..., n]`` float with ``n`` a multiple of ``group``."""
    check_int("group", group, lo=1)
    check_tensor("x", x, dtypes=FLOAT_DTYPES, contiguous_last=False)
    if x.dim() == 0 or x.shape[-1] % group:
        raise ValueError(f"x: expected a last dim that is a multiple of {group}, got shape "
                         f"{tuple(x.shape)}")


def fp4_exponents(x: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """int32 ``e = ceil(log2(max(amax, 6 * 2**-126) / 6))`` per group of ``x [..., n]``."""
    _check_groups(x, group)
    amax = x.float().unflatten(-1, (-1, group)).abs().amax(-1).clamp_min(FP4_AMAX_FLOOR)
    mant, ex = torch.frexp(amax)  # amax = mant * 2**ex, mant in [0.5, 1); 6 * 2**e = 0.75 * 2**(e+3)
    return (ex - 3 + (mant > 0.75).to(ex.dtype)).to(torch.int32)


def fp4_simulate_ref(x: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """FP4 (e2m1, UE8M0 scale per ``group``) quantize-dequantize of ``x [..., n]``; fp32 out."""
    _check_groups(x, group)
    s = exp2_int(fp4_exponents(x, group)).unsqueeze(-1)
    y = (x.float().unflatten(-1, (-1, group)) / s).clamp(-6.0, 6.0)
    return (e2m1_codes_to_float(round_to_e2m1_codes(y)) * s).flatten(-2)


def hadamard_ref(x: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform (Sylvester order, ``H / sqrt(n)``) of the last dim
    (a power of two), computed in ``x.dtype`` (use float64 for a reference)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, contiguous_last=False)
    n = x.shape[-1] if x.dim() else 0
    if n < 1 or n & (n - 1):
        raise ValueError(f"x: last dim must be a power of two, got {n}")
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), 2)
        h *= 2
    return (y.reshape(x.shape) * n ** -0.5).to(x.dtype)


# --------------------------------------------------------------------------------------------
# index-key store
# --------------------------------------------------------------------------------------------
def encode_index_rows_ref(k: torch.Tensor, fp4: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [N, dim]`` -> ``(e4m3 bytes uint8 [N, dim], row scale float32 [N])`` (module doc)."""
    check_tensor("k", k, dtypes=FLOAT_DTYPES, ndims=2, contiguous_last=False)
    check_bool("fp4", fp4)
    if fp4:
        v = fp4_simulate_ref(k)
        e = fp4_exponents(k).amax(-1) - INDEX_ROW_SHIFT
    else:
        v = k.float()
        e = ue8m0_exponent(v.abs().amax(-1).clamp_min(ROW_AMAX_FLOOR))
    s = exp2_int(e)
    q = (v / s.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), s


def check_index_insert_args(k, index_cache, slot_mapping, fp4=True) -> tuple[torch.Tensor, int]:
    """Checks of :func:`quantize_and_insert_index_k`; returns ``(cache as 3-D, dim)``."""
    check_tensor("k", k, dtypes=FLOAT_DTYPES[:3], ndims=2)
    check_bool("fp4", fp4)
    cache, dim = check_index_k_cache("index_cache", index_cache)
    if k.shape[1] != dim:
        raise ValueError(f"k: expected [T, {dim}] (the cache's key width), got {tuple(k.shape)}")
    check_tensor("slot_mapping", slot_mapping, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    check_shape("slot_mapping", slot_mapping, [k.shape[0]])
    check_same_device(k=k, index_cache=index_cache, slot_mapping=slot_mapping)
    return cache, dim


def quantize_and_insert_index_k_ref(k: torch.Tensor, index_cache: torch.Tensor,
                                    slot_mapping: torch.Tensor, fp4: bool = True) -> None:
    """Write the FP8 row + scale of every ``k [T, dim]`` row at ``slot_mapping[t] >= 0``
    (slots past the cache are skipped too); nothing else of the cache changes."""
    cache, dim = check_index_insert_args(k, index_cache, slot_mapping, fp4)
    if k.shape[0] == 0:
        return
    q, s = encode_index_rows_ref(k, fp4)
    nb, page = cache.shape[0], cache.shape[1]
    slots = slot_mapping.long()
    ok = (slots >= 0) & (slots < nb * page)
    data, sc = index_cache_views(cache, dim)
    b, o = slots[ok] // page, slots[ok] % page
    data[b, o] = q[ok]
    sc[b, o] = s[ok]


def read_index_k_ref(index_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Dequantized fp32 rows ``[..., dim]`` at ``slots`` (``-1`` -> NaN rows)."""
    cache, dim = check_index_k_cache("index_cache", index_cache)
    check_tensor("slots", slots, dtypes=INT_DTYPES, contiguous_last=False)
    check_same_device(index_cache=index_cache, slots=slots)
    page = cache.shape[1]
    data, sc = index_cache_views(cache, dim)
    s = slots.long().clamp_min(0)
    rows = data[s // page, s % page].view(torch.float8_e4m3fn).float() * sc[s // page, s % page].unsqueeze(-1)
    return torch.where((slots >= 0).unsqueeze(-1), rows, torch.full_like(rows, float("nan")))


# --------------------------------------------------------------------------------------------
# logits
# --------------------------------------------------------------------------------------------
def check_logits_args(q, weights, index_cache, block_table, token_to_req, visible_lens, out, max_len):
    """Checks of :func:`index_logits`; returns ``(cache as 3-D, dim)``."""
    check_tensor("q", q, dtypes=(torch.bfloat16,), ndims=3)
    T, H, Dq = q.shape
    if H < 1:
        raise ValueError(f"q: expected at least one head, got shape {tuple(q.shape)}")
    cache, dim = check_index_k_cache("index_cache", index_cache)
    if Dq != dim:
        raise ValueError(f"q: expected [T, H, {dim}] (the cache's key width), got {tuple(q.shape)}")
    check_tensor("weights", weights, dtypes=(torch.float32,), ndims=2)
    check_shape("weights", weights, [T, H])
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndims=2)
    check_tensor("token_to_req", token_to_req, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    check_shape("token_to_req", token_to_req, [T])
    check_tensor("visible_lens", visible_lens, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    check_shape("visible_lens", visible_lens, [T])
    if out is not None:
        check_tensor("out", out, dtypes=(torch.float32,), ndims=2)
        if out.shape[0] != T:
            raise ValueError(f"out: expected [{T}, N], got {tuple(out.shape)}")
        if max_len is not None and check_int("max_len", max_len, lo=0) != out.shape[1]:
            raise ValueError(f"max_len: {max_len} differs from out's {out.shape[1]} columns")
    elif max_len is None:
        raise ValueError("max_len: give max_len or out")
    else:
        check_int("max_len", max_len, lo=0)
    check_same_device(q=q, weights=weights, index_cache=index_cache, block_table=block_table,
                      token_to_req=token_to_req, visible_lens=visible_lens,
                      **({} if out is None else {"out": out}))
    return cache, dim


def index_logits_ref(q, weights, index_cache, block_table, token_to_req, visible_lens,
                     out: torch.Tensor | None = None, max_len: int | None = None) -> torch.Tensor:
    """Float64 oracle of :func:`dsv41_triton.ops.indexer.index_logits` -> ``out [T, N]`` fp32."""
    cache, _ = check_logits_args(q, weights, index_cache, block_table, token_to_req,
                                 visible_lens, out, max_len)
    T = q.shape[0]
    N = out.shape[1] if out is not None else max_len
    if out is None:
        out = torch.empty(T, N, dtype=torch.float32, device=q.device)
    page = cache.shape[1]
    nb = cache.shape[0]
    j = torch.arange(N, device=q.device)
    req = token_to_req.long()
    col = j // page
    ok_req = (req >= 0) & (req < block_table.shape[0])
    colc = col.clamp_max(max(block_table.shape[1] - 1, 0))
    if block_table.shape[1] == 0 or block_table.shape[0] == 0:
        blk = torch.full((T, N), -1, dtype=torch.long, device=q.device)
    else:
        blk = block_table[req.clamp(0, block_table.shape[0] - 1)][:, colc].long()
    valid = (j[None, :] < visible_lens.long()[:, None]) & ok_req[:, None] & (col[None, :] < block_table.shape[1])
    valid &= (blk >= 0) & (blk < nb)
    slots = torch.where(valid, blk * page + j[None, :] % page, torch.full_like(blk, -1))
    step = max(1, (1 << 22) // (max(T, 1) * cache.shape[-1]))  # entries per chunk: <= 32 MB of f64 keys
    qd, wd = q.double(), weights.double().unsqueeze(-1)
    for a in range(0, N, step):
        b = min(N, a + step)
        k = torch.nan_to_num(read_index_k_ref(cache, slots[:, a:b]).double())  # [T, n, dim]
        lg = (torch.einsum("thd,tnd->thn", qd, k).relu() * wd).sum(1)
        out[:, a:b] = torch.where(valid[:, a:b], lg, torch.full_like(lg, float("-inf"))).float()
    return out


# --------------------------------------------------------------------------------------------
# top-k and the two-level selection
# --------------------------------------------------------------------------------------------
def check_topk_args(logits, lens, k, out, k_name: str = "k"):
    """Checks of :func:`index_topk`: ``logits [T, N]`` fp32, ``lens [T]`` int, ``k >= 1``,
    ``out`` None or ``[T, k]`` int32."""
    check_tensor("logits", logits, dtypes=(torch.float32,), ndims=2)
    T = logits.shape[0]
    check_tensor("lens", lens, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    check_shape("lens", lens, [T])
    check_int(k_name, k, lo=1)
    if out is not None:
        check_tensor("out", out, dtypes=(torch.int32,), ndims=2)
        check_shape("out", out, [T, k])
    check_same_device(logits=logits, lens=lens, **({} if out is None else {"out": out}))


def _ranked(values: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` largest valid values per row (ties: lower column), ascending,
    ``-1`` padded -> int64 ``[T, k]``."""
    T, N = values.shape
    key = torch.where(valid, values, torch.full_like(values, float("-inf")))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    n_sel = valid.sum(1).clamp_max(k)
    if order.shape[1] < k:
        order = torch.cat([order, order.new_zeros(T, k - order.shape[1])], 1)
    keep = torch.arange(k, device=values.device)[None, :] < n_sel[:, None]
    order = torch.where(keep, order, torch.full_like(order, N + 1))
    order = order.sort(1).values
    return torch.where(order > N, torch.full_like(order, -1), order)


def index_topk_ref(logits: torch.Tensor, lens: torch.Tensor, k: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``k`` largest finite logits of ``logits[t, :lens[t]]`` (ties: lower entry) as
    int32 entry ids in ascending order, ``-1`` padded -> ``out [T, k]``."""
    check_topk_args(logits, lens, k, out)
    N = logits.shape[1]
    j = torch.arange(N, device=logits.device)
    valid = (j[None, :] < lens.long()[:, None]) & (logits > float("-inf")) & ~logits.isnan()
    res = _ranked(logits, valid, k).to(torch.int32)
    if out is None:
        return res
    out.copy_(res)
    return out


def candidate_blocks_ref(logits: torch.Tensor, lens: torch.Tensor, num_blocks: int,
                         block_size: int) -> torch.Tensor:
    """V4.1 candidate blocks: block score = max finite logit of its visible entries, the
    block of entry ``lens[t] - 1`` forced to ``+inf``; the ``num_blocks`` best blocks with a
    visible finite entry (ties: lower block) as int32 ``[T, num_blocks]`` ascending, ``-1`` padded."""
    check_topk_args(logits, lens, num_blocks, None, k_name="num_blocks")
    check_int("block_size", block_size, lo=1)
    T, N = logits.shape
    nblk = -(-N // block_size)
    j = torch.arange(N, device=logits.device)
    lens_l = lens.long().clamp(0, N)
    valid = (j[None, :] < lens_l[:, None]) & (logits > float("-inf")) & ~logits.isnan()
    x = torch.where(valid, logits, torch.full_like(logits, float("-inf")))
    x = torch.nn.functional.pad(x, (0, nblk * block_size - N), value=float("-inf"))
    bscore = x.view(T, nblk, block_size).amax(-1)
    bvalid = bscore > float("-inf")
    last = (lens_l - 1) // block_size
    newest = (torch.arange(nblk, device=logits.device)[None, :] == last[:, None]) & (lens_l[:, None] > 0)
    bscore = torch.where(newest, torch.full_like(bscore, float("inf")), bscore)
    return _ranked(bscore, bvalid | newest, num_blocks).to(torch.int32)


def apply_candidates_ref(logits: torch.Tensor, candidates: torch.Tensor, block_size: int) -> torch.Tensor:
    """``logits [T, N]`` fp32 with every entry outside the candidate blocks (``candidates
    [T, n]`` int, block ids of ``block_size`` entries; out-of-range ids ignored) set to
    ``-inf`` (a new tensor)."""
    check_tensor("logits", logits, dtypes=(torch.float32,), ndims=2, contiguous_last=False)
    check_tensor("candidates", candidates, dtypes=INT_DTYPES, ndims=2, contiguous_last=False)
    if candidates.shape[0] != logits.shape[0]:
        raise ValueError(f"candidates: expected {logits.shape[0]} rows (one per logits row), got "
                         f"shape {tuple(candidates.shape)}")
    check_int("block_size", block_size, lo=1)
    check_same_device(logits=logits, candidates=candidates)
    T, N = logits.shape
    nblk = -(-N // block_size)
    keep = torch.zeros(T, nblk + 1, dtype=torch.bool, device=logits.device)
    c = candidates.long()
    c = torch.where((c >= 0) & (c < nblk), c, torch.full_like(c, nblk))
    keep.scatter_(1, c, True)
    keep = keep[:, :nblk].repeat_interleave(block_size, 1)[:, :N]
    return torch.where(keep, logits, torch.full_like(logits, float("-inf")))
