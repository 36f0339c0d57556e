"""The contract of SPEC.md as plain Python: its constants and every argument check.

Kernel-free (imports only torch): the Triton wrappers, the PyTorch references, the backends,
the layer and the benchmarks all validate through these functions, so one bad argument raises
the same ``TypeError`` (wrong type / dtype) or ``ValueError`` (wrong shape, size, layout)
everywhere, naming the argument, before anything is launched or written.

The checks read only shapes, dtypes and strides (never tensor values: that would need a
device-to-host sync), so they also run under ``torch.compile`` on fake tensors without
specializing on the token count. The edge-case semantics they encode are listed in
``docs/semantics.md``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence, Tuple, Union

import torch

# ---- SPEC §1 ---------------------------------------------------------------------------------
HEAD_DIM = 512  # D: the one KV head's width; dims 0..447 NoPE, 448..511 RoPE
ROPE_DIM = 64  # R: the RoPE'd tail
NOPE_DIM = HEAD_DIM - ROPE_DIM  # 448
WV_GROUP_SIZE = 8  # heads per wo_a output group (n_wv_group = H / 8)
GROUP_WIDTH = WV_GROUP_SIZE * HEAD_DIM  # 4096: one output group's width
MXFP8_CHUNK = 32  # elements per UE8M0 scale of the fused output (num_per_channels)
UE8M0_AMAX_FLOOR = 1e-4  # record scales (SPEC §4)
#: the kinds of work a backend can be probed for, and the fused contract's layouts
KINDS = ("decode", "prefill", "decode_fused", "prefill_fused")
LAYOUTS = ("standard", "interleaved")

INDEX_DTYPES = (torch.int32,)
INT_DTYPES = (torch.int32, torch.int64)


# ---- SPEC §4: records --------------------------------------------------------------------------
@dataclass(frozen=True)
class RecordFormat:
    """One KV record layout. ``group`` is the number of dims sharing one scale."""

    name: str
    record_bytes: int
    data_bytes: int
    scale_bytes: int
    block_align: int
    group: int

    def block_bytes(self, page_size: int) -> int:
        """Default block stride in bytes: ``page * record_bytes`` rounded up to ``block_align``."""
        return -(-page_size * self.record_bytes // self.block_align) * self.block_align


FP8_DS_MLA = RecordFormat("fp8_ds_mla", 584, 576, 8, 576, 64)
MXFP8 = RecordFormat("mxfp8", 528, 512, 16, 512, 32)
NVFP4 = RecordFormat("nvfp4", 288, 256, 32, 512, 16)
RECORD_FORMATS = {f.record_bytes: f for f in (FP8_DS_MLA, MXFP8, NVFP4)}
_BY_NAME = {f.name: f for f in RECORD_FORMATS.values()}
#: record widths each decode cache accepts (nvfp4 is for the compressed cache only)
SWA_RECORDS = (584, 528)
EXTRA_RECORDS = (584, 528, 288)
#: block stride and base alignment of a cache, bytes
CACHE_ALIGN = 16

RecordLike = Union[int, str, RecordFormat]


# ---- generic checks ------------------------------------------------------------------------
def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndims: Optional[Union[int, Sequence[int]]] = None,
    last_dim: Optional[int] = None,
    contiguous_last: bool = True,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Validate one tensor argument; raise TypeError/ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {t.dtype}")
    if ndims is not None:
        allowed = (ndims,) if isinstance(ndims, int) else tuple(ndims)
        if t.dim() not in allowed:
            want = " or ".join(f"{n}-D" for n in allowed)
            raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}")
    if last_dim is not None and (t.dim() == 0 or t.shape[-1] != last_dim):
        raise ValueError(f"{name}: expected last dim {last_dim}, got shape {tuple(t.shape)}")
    if contiguous_last and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: Sequence[Optional[int]]) -> None:
    """Check ``t.shape`` against ``shape`` (``None`` = any size)."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")


def check_int(name: str, v: object, *, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """Validate a Python integer argument within [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{name}: expected >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name}: expected <= {hi}, got {v}")
    return v


def check_bool(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
    return v


def check_same_device(**tensors: Optional[torch.Tensor]) -> torch.device:
    """All given tensors (None skipped) must share one device; return it."""
    devs = {n: t.device for n, t in tensors.items() if t is not None}
    first = next(iter(devs.values()))
    for n, d in devs.items():
        if d != first:
            names = ", ".join(f"{k} on {v}" for k, v in devs.items())
            raise ValueError(f"{n}: all tensors must be on one device ({names})")
    return first


def check_device(device: object, name: str = "device") -> torch.device:
    """A ``torch.device`` or a device string (``'cpu'``, ``'cuda:1'``) -> ``torch.device``;
    ``ValueError`` naming ``name`` for one torch cannot parse."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected a torch.device or a device string such as 'cpu' or "
                         f"'cuda:1', got {device!r}") from e


def check_distinct_elements(name: str, t: torch.Tensor) -> None:
    """An output must not map two of its elements to one address (a dim of size > 1 with
    stride 0, as ``expand`` makes): the kernels would race on it."""
    if t.numel() > 1 and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise ValueError(f"{name}: expected distinct elements, got strides {tuple(t.stride())} "
                         f"for shape {tuple(t.shape)} (a dim of size > 1 with stride 0)")


def _byte_span(t: torch.Tensor) -> Tuple[int, int]:
    lo = t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return lo, lo + (last + 1) * t.element_size()


def check_no_overlap(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """``t`` (written) and ``other`` (read) must not share memory: their byte spans in one
    storage must not intersect. Skipped while tracing (fake tensors have no addresses)."""
    if _compiling() or t.numel() == 0 or other.numel() == 0 or t.device != other.device:
        return
    if t.untyped_storage().data_ptr() != other.untyped_storage().data_ptr():
        return
    (a0, a1), (b0, b1) = _byte_span(t), _byte_span(other)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{name}: must not overlap {other_name} in memory")


def check_layout(layout: object, name: str = "layout") -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: expected 'standard' or 'interleaved', got {layout!r}")
    return layout  # type: ignore[return-value]


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover - torch < 2.3
        return False


# ---- caches --------------------------------------------------------------------------------
def get_record_format(record: RecordLike, name: str = "record") -> RecordFormat:
    """Look a record up by width (584/528/288), name, or pass a RecordFormat through."""
    if isinstance(record, RecordFormat):
        return record
    if isinstance(record, str) and record in _BY_NAME:
        return _BY_NAME[record]
    if isinstance(record, int) and not isinstance(record, bool) and record in RECORD_FORMATS:
        return RECORD_FORMATS[record]
    raise ValueError(
        f"{name}: expected a record width of 584, 528 or 288 bytes "
        f"(or one of {sorted(_BY_NAME)}), got {record!r}"
    )


def check_k_cache(
    name: str, cache: object, allowed: Optional[Sequence[int]] = None
) -> Tuple[RecordFormat, torch.Tensor]:
    """Validate a paged cache and return ``(format, cache as [num_blocks, page, bytes])``.

    The block-split layout of SPEC §4 is the only one accepted: uint8
    ``[num_blocks, page, bytes]`` (or ``[num_blocks, page, 1, bytes]``), ``bytes`` in
    {584, 528, 288} (``allowed`` narrows it), ``page >= 1``, ``stride(-1) == 1``,
    ``stride(1) == bytes`` (a page's records back to back), ``stride(0) >= page * bytes`` and
    a multiple of 16 (padding after the scale rows is fine), and a base 16-byte aligned
    (``storage_offset() % 16 == 0``). A view that cuts the page dim of a larger cache
    (``cache[:, :8]``) is rejected too: its scale rows are not where its page size puts them
    (detected through the view's base: a cache from ``allocate_k_cache`` or ``torch.empty``
    is its slices' base; strides alone cannot tell such a slice from a padded block stride).
    """
    check_tensor(name, cache, dtypes=(torch.uint8,), ndims=(3, 4))
    arg = cache
    if cache.dim() == 4:
        if cache.shape[2] != 1:
            raise ValueError(
                f"{name}: a 4-D cache must be [num_blocks, page, 1, bytes], got {tuple(cache.shape)}"
            )
        cache = cache.squeeze(2)
    fmt = get_record_format(int(cache.shape[-1]), name=f"{name} record width (last dim)")
    if allowed is not None and fmt.record_bytes not in tuple(allowed):
        raise ValueError(f"{name}: expected a record width in {tuple(allowed)}, got "
                         f"{fmt.record_bytes} ({fmt.name})")
    nb, page, rb = cache.shape[0], cache.shape[1], fmt.record_bytes
    if page < 1:
        raise ValueError(f"{name}: expected a page size >= 1, got shape {tuple(arg.shape)}")
    if cache.stride(2) != 1:
        raise ValueError(f"{name}: a record's bytes must be contiguous (stride 1), got strides "
                         f"{tuple(arg.stride())}")
    if page > 1 and cache.stride(1) != rb:
        raise ValueError(
            f"{name}: the records of a page must be back to back (page-dim stride {rb}), got "
            f"strides {tuple(arg.stride())}; pass the cache itself, not a transposed or "
            f"strided view (block-split layout, SPEC §4)")
    if nb > 1 and cache.stride(0) < page * rb:
        raise ValueError(
            f"{name}: block stride {cache.stride(0)} is smaller than page*bytes = "
            f"{page * rb}; blocks would overlap"
        )
    if nb > 1 and cache.stride(0) % CACHE_ALIGN != 0:
        raise ValueError(f"{name}: block stride {cache.stride(0)} must be a multiple of "
                         f"{CACHE_ALIGN} bytes")
    if not _compiling():  # (Dynamo traces neither storage offsets nor view bases)
        if cache.storage_offset() % CACHE_ALIGN != 0:
            raise ValueError(f"{name}: the cache must start {CACHE_ALIGN}-byte aligned "
                             f"(storage offset {cache.storage_offset()} bytes)")
        base = arg._base
        # a page-dim slice keeps its base's block stride and cuts its page count (a reshape
        # into smaller blocks, e.g. .view(2 * nb, page // 2, bytes), changes the stride: fine)
        if (base is not None and base.dtype == torch.uint8 and base.dim() in (3, 4)
                and base.shape[-1] == rb and base.shape[1] > page and base.stride(1) == rb
                and (nb <= 1 or cache.stride(0) == base.stride(0))):
            raise ValueError(
                f"{name}: a view of {page} tokens per page cut from a cache of {base.shape[1]} "
                f"tokens per page; inside a block the data rows of all its tokens come first, "
                f"then their scale rows (SPEC §4), so a page-dim slice is not a cache. Pass the "
                f"whole cache and select tokens through the slot ids")
    return fmt, cache


# ---- attention ------------------------------------------------------------------------------
def check_q(q: object, *, fused: bool = False, layout: Optional[str] = None,
            name: str = "q") -> Tuple[int, int]:
    """``q [T, H, 512]`` bf16, last dim contiguous, ``H >= 1`` (a positive multiple of 8 for the
    fused contract; ``layout="interleaved"`` needs each token's ``H*512`` values contiguous).
    Returns ``(T, H)`` (possibly symbolic under ``torch.compile``)."""
    check_tensor(name, q, dtypes=(torch.bfloat16,), ndims=3)
    if q.shape[-1] != HEAD_DIM:
        raise ValueError(f"{name}: expected head_dim {HEAD_DIM} (last dim), got shape "
                         f"{tuple(q.shape)}")
    check_tensor(name, q, last_dim=HEAD_DIM, contiguous_last=layout != "interleaved")
    T, H = q.shape[0], q.shape[1]
    if H == 0:
        raise ValueError(f"{name}: expected at least one head, got shape {tuple(q.shape)}")
    if fused and H % WV_GROUP_SIZE != 0:
        raise ValueError(
            f"{name}: the fused contract needs the number of heads to be a positive multiple "
            f"of {WV_GROUP_SIZE} (n_wv_group = H / {WV_GROUP_SIZE}), got H = {H}")
    if layout == "interleaved" and H > 1 and (q.stride(1) != HEAD_DIM or q.stride(2) != 1):
        raise ValueError(
            f"{name}: the interleaved layout needs each token's H*512 values contiguous "
            f"(stride(1) == 512, stride(2) == 1), got strides {tuple(q.stride())}")
    return T, H


def check_sink(attn_sink: object, H, name: str = "attn_sink") -> None:
    """``attn_sink`` None or ``[H]`` fp32 (any stride). Values are not read: ``-inf`` means no
    sink, ``+inf`` gives zero outputs, NaN gives NaN outputs (docs/semantics.md)."""
    if attn_sink is None:
        return
    check_tensor(name, attn_sink, dtypes=(torch.float32,), ndims=1, contiguous_last=False)
    if attn_sink.shape[0] != H:
        raise ValueError(f"{name}: expected shape [{H}] (one per head of q), got "
                         f"{tuple(attn_sink.shape)}")


def check_scale(v: object, name: str = "softmax_scale") -> float:
    """A finite float or None (``512 ** -0.5``); returns the scale."""
    if v is None:
        return HEAD_DIM ** -0.5
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a float or None, got {type(v).__name__}")
    scale = float(v)
    if not math.isfinite(scale):
        raise ValueError(f"{name}: expected a finite number, got {scale}")
    return scale


def check_out(out: object, T, H, name: str = "out") -> None:
    """``out`` None or ``[T, H, 512]`` bf16, last dim contiguous (any other strides)."""
    if out is None:
        return
    check_tensor(name, out, dtypes=(torch.bfloat16,), ndims=3, last_dim=HEAD_DIM)
    check_shape(name, out, (T, H, HEAD_DIM))
    check_distinct_elements(name, out)


def check_lens(name: str, lens: object, T, dtypes: Sequence[torch.dtype] = INT_DTYPES) -> None:
    """``lens`` None or ``[T]`` int (any stride). Values are clamped to ``[0, width]`` by every
    backend (a negative length reads no column)."""
    if lens is None:
        return
    check_tensor(name, lens, dtypes=dtypes, ndims=1, contiguous_last=False)
    if lens.shape[0] != T:
        raise ValueError(f"{name}: expected shape [{T}] (one per query token), got "
                         f"{tuple(lens.shape)}")


def check_indices(name: str, idx: object, T, dtypes: Sequence[torch.dtype] = INT_DTYPES,
                  allow_3d: bool = False) -> torch.Tensor:
    """``idx [T, K]`` int (``[T, 1, K]`` too with ``allow_3d``), last dim contiguous; returns
    the 2-D view. ``K = 0`` is allowed (no keys)."""
    check_tensor(name, idx, dtypes=dtypes, ndims=(2, 3) if allow_3d else 2)
    if idx.dim() == 3:
        if idx.shape[1] != 1:
            raise ValueError(f"{name}: 3-D indices must be [T, 1, K], got {tuple(idx.shape)}")
        idx = idx[:, 0, :]
    if idx.shape[0] != T:
        raise ValueError(f"{name}: expected {T} rows (one per query token), got "
                         f"{tuple(idx.shape)}")
    return idx


def check_workspace(kv: object, name: str = "kv") -> torch.Tensor:
    """``kv [S, 512]`` or ``[S, 1, 512]`` bf16 (rows may be strided, last dim contiguous);
    returns the 2-D view."""
    check_tensor(name, kv, dtypes=(torch.bfloat16,), ndims=(2, 3), last_dim=HEAD_DIM)
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"{name}: a 3-D workspace must be [S, 1, 512], got {tuple(kv.shape)}")
        kv = kv[:, 0, :]
    return kv


class DecodeArgs(NamedTuple):
    T: object
    H: object
    scale: float
    swa_fmt: RecordFormat
    swa_cache: torch.Tensor  # 3-D view
    extra_fmt: Optional[RecordFormat]
    extra_cache: Optional[torch.Tensor]  # 3-D view or None


def check_decode_args(q, swa_cache, swa_indices, swa_lens, extra_cache=None, extra_indices=None,
                      extra_lens=None, attn_sink=None, softmax_scale=None, out=None, *,
                      index_dtypes: Sequence[torch.dtype] = INT_DTYPES,
                      names: Tuple[str, ...] = ("swa_cache", "swa_indices", "swa_lens",
                                                "extra_cache", "extra_indices", "extra_lens",
                                                "attn_sink", "softmax_scale")) -> DecodeArgs:
    """All checks of ``sparse_mla_decode`` (SPEC §6), in one place for every backend."""
    n_sc, n_si, n_sl, n_ec, n_ei, n_el, n_sink, n_scale = names
    T, H = check_q(q)
    scale = check_scale(softmax_scale, n_scale)
    sfmt, s3 = check_k_cache(n_sc, swa_cache, SWA_RECORDS)
    check_indices(n_si, swa_indices, T, index_dtypes)
    check_lens(n_sl, swa_lens, T, index_dtypes)
    efmt = e3 = None
    if extra_cache is not None:
        efmt, e3 = check_k_cache(n_ec, extra_cache, EXTRA_RECORDS)
        if extra_indices is None:
            raise ValueError(f"{n_ei}: required when {n_ec} is given")
        check_indices(n_ei, extra_indices, T, index_dtypes)
        check_lens(n_el, extra_lens, T, index_dtypes)
    elif extra_indices is not None or extra_lens is not None:
        raise ValueError(f"{n_ec}: required when {n_ei}/{n_el} are given")
    check_sink(attn_sink, H, n_sink)
    check_out(out, T, H)
    check_same_device(q=q, swa_cache=swa_cache, swa_indices=swa_indices, swa_lens=swa_lens,
                      extra_cache=extra_cache, extra_indices=extra_indices,
                      extra_lens=extra_lens, attn_sink=attn_sink, out=out)
    return DecodeArgs(T, H, scale, sfmt, s3, efmt, e3)


class PrefillArgs(NamedTuple):
    T: object
    H: object
    scale: float
    kv: torch.Tensor  # [S, 512]
    indices: torch.Tensor  # [T, K]


def check_prefill_args(q, kv, indices, lens=None, attn_sink=None, softmax_scale=None, out=None,
                       *, index_dtypes: Sequence[torch.dtype] = INT_DTYPES,
                       lens_name: str = "lens", scale_name: str = "softmax_scale") -> PrefillArgs:
    """All checks of ``sparse_mla_prefill`` (SPEC §6)."""
    T, H = check_q(q)
    scale = check_scale(softmax_scale, scale_name)
    kv2 = check_workspace(kv)
    idx2 = check_indices("indices", indices, T, index_dtypes, allow_3d=True)
    check_lens(lens_name, lens, T, index_dtypes)
    check_sink(attn_sink, H)
    check_out(out, T, H)
    check_same_device(q=q, kv=kv, indices=indices, lens=lens, attn_sink=attn_sink, out=out)
    return PrefillArgs(T, H, scale, kv2, idx2)


def new_outputs(q: torch.Tensor, out: Optional[torch.Tensor]
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out or a new [T, H, 512] bf16, a new lse [T, H] fp32)`` on ``q``'s device."""
    T, H = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    return out, lse


# ---- fused contract -------------------------------------------------------------------------
def check_positions(positions: object, T, name: str = "positions") -> None:
    """``positions [T]`` int32/int64 (any stride). A position outside ``[0, max_pos)`` of the
    cos/sin table is not rotated by the ops; the layer rejects it (docs/semantics.md)."""
    check_tensor(name, positions, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    if positions.shape[0] != T:
        raise ValueError(f"{name}: expected {T} entries (one per token), got shape "
                         f"{tuple(positions.shape)}")


def check_cos_sin_cache(cos_sin_cache: object, name: str = "cos_sin_cache") -> None:
    """``cos_sin_cache [max_pos, 64]`` fp32, cos | sin (SPEC §2)."""
    check_tensor(name, cos_sin_cache, dtypes=(torch.float32,), ndims=2, last_dim=ROPE_DIM)


def check_q_norm_eps(q_norm_eps: object) -> Optional[float]:
    if q_norm_eps is None:
        return None
    if isinstance(q_norm_eps, bool) or not isinstance(q_norm_eps, (int, float)):
        raise TypeError(f"q_norm_eps: expected None or a float, got {type(q_norm_eps).__name__}")
    if not (math.isfinite(float(q_norm_eps)) and q_norm_eps >= 0):
        raise ValueError(f"q_norm_eps: expected None or a finite float >= 0, got {q_norm_eps!r}")
    return float(q_norm_eps)


def check_fused_common(q, positions, cos_sin_cache, layout, q_norm_eps):
    """The backend-level fused arguments (``positions``, ``cos_sin_cache``, ``layout``,
    ``q_norm_eps``) and ``q``; returns ``(T, H)``."""
    check_layout(layout)
    T, H = check_q(q, fused=True, layout=layout)
    check_positions(positions, T)
    check_cos_sin_cache(cos_sin_cache)
    check_q_norm_eps(q_norm_eps)
    check_same_device(q=q, positions=positions, cos_sin_cache=cos_sin_cache)
    return T, H


# ---- backends -------------------------------------------------------------------------------
def problem_error(kind, num_heads, head_dim, swa_record, extra_record, layout) -> Optional[str]:
    """Why a backend problem description is malformed, or None."""
    if kind not in KINDS:
        return f"unknown kind {kind!r} (expected one of {KINDS})"
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        return f"num_heads must be a positive int, got {num_heads!r}"
    if head_dim != HEAD_DIM:
        return f"head_dim must be {HEAD_DIM}, got {head_dim}"
    if swa_record not in RECORD_FORMATS:
        return f"unknown window record width {swa_record}"
    if extra_record is not None and extra_record not in RECORD_FORMATS:
        return f"unknown compressed record width {extra_record}"
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    if kind.endswith("_fused") and num_heads % WV_GROUP_SIZE:
        return (f"the fused contract needs the head count to be a multiple of {WV_GROUP_SIZE}, "
                f"got {num_heads}")
    return None
