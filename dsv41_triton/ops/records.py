"""The three KV-cache records of SPEC §4 and their plain PyTorch codecs (the reference).

A cache is a uint8 tensor ``[num_blocks, page, record_bytes]`` (or ``[num_blocks, page, 1,
record_bytes]``). Inside a block the bytes are *split*: ``page`` data rows first, then ``page``
scale rows, then padding up to the block stride (``cache.stride(0)``, which may exceed
``page * record_bytes``)::

    data(block, t)   = block * stride0 + t * data_bytes
    scales(block, t) = block * stride0 + page * data_bytes + t * scale_bytes

=============  =====  ==========  ===========  =========================================
record         bytes  data_bytes  scale_bytes  content
=============  =====  ==========  ===========  =========================================
fp8_ds_mla     584    576         8            448 e4m3 + 64 raw bf16; 7 UE8M0 (per 64) + 0
mxfp8          528    512         16           512 e4m3; 16 UE8M0 (per 32)
nvfp4          288    256         32           512 e2m1 (even element low nibble); 32 e4m3
=============  =====  ==========  ===========  =========================================

Everything here is the bit-exact rule the Triton kernels are tested against.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .._contract import (  # noqa: F401  (records and the cache check are part of the contract)
    FP8_DS_MLA,
    MXFP8,
    NVFP4,
    RECORD_FORMATS,
    UE8M0_AMAX_FLOOR,
    RecordFormat,
    check_device,
    check_k_cache,
    get_record_format,
)
from .._utils import HEAD_DIM, NOPE_DIM, check_int, check_tensor

E4M3_MAX = 448.0
E2M1_MAX = 6.0
UE8M0_BIAS = 127
E4M3_NAN = 0x7F  # the e4m3 byte every NaN input is encoded as
#: e2m1 magnitudes by code 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

RecordLike = Union[int, str, RecordFormat]


def allocate_k_cache(
    num_blocks: int,
    page_size: int,
    record: RecordLike,
    device: Union[str, torch.device] = "cpu",
    *,
    block_stride: Optional[int] = None,
    fill: Optional[int] = None,
) -> torch.Tensor:
    """A uint8 cache ``[num_blocks, page_size, record_bytes]`` whose ``stride(0)`` is the block
    stride (default ``fmt.block_bytes(page_size)``; pass a larger one to test padding).
    ``fill`` sets every byte (random bytes when None, so unwritten bytes are never zero)."""
    fmt = get_record_format(record)
    check_int("num_blocks", num_blocks, lo=1)
    check_int("page_size", page_size, lo=1)
    stride0 = fmt.block_bytes(page_size) if block_stride is None else block_stride
    check_int("block_stride", stride0, lo=page_size * fmt.record_bytes)
    if stride0 % 16:
        raise ValueError(f"block_stride: expected a multiple of 16 bytes (the ops' row loads), "
                         f"got {stride0}")
    if fill is not None:
        check_int("fill", fill, lo=0, hi=255)
    device = check_device(device)
    if fill is None:
        flat = torch.randint(0, 256, (num_blocks * stride0,), dtype=torch.uint8, device=device)
    else:
        flat = torch.full((num_blocks * stride0,), fill, dtype=torch.uint8, device=device)
    # a tensor of its own over the flat storage, not a view of it: then a slice of the cache
    # (``cache[:, :8]``) is a view whose base is the cache, which ``check_k_cache`` rejects
    cache = torch.empty(0, dtype=torch.uint8, device=flat.device)
    return cache.set_(flat.untyped_storage(), 0, (num_blocks, page_size, fmt.record_bytes),
                      (stride0, fmt.record_bytes, 1))


def record_views(cache: torch.Tensor, fmt: RecordFormat) -> Tuple[torch.Tensor, torch.Tensor]:
    """Strided uint8 views ``data [num_blocks, page, data_bytes]`` and
    ``scales [num_blocks, page, scale_bytes]`` of a 3-D cache (writes go through)."""
    nb, page = cache.shape[0], cache.shape[1]
    s0 = cache.stride(0)
    off = cache.storage_offset()
    data = cache.as_strided((nb, page, fmt.data_bytes), (s0, fmt.data_bytes, 1), off)
    scales = cache.as_strided(
        (nb, page, fmt.scale_bytes), (s0, fmt.scale_bytes, 1), off + page * fmt.data_bytes
    )
    return data, scales


# --------------------------------------------------------------------------------------------
# scalar rules (exact)
# --------------------------------------------------------------------------------------------
def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """``e = ceil(log2(amax / 448))`` computed exactly (int32), for fp32 ``amax > 0``.

    With ``amax = m * 2**E``, ``m`` in [1, 2): ``amax/448 = (m/1.75) * 2**(E-8)``, so
    ``e = E - 8 + (m > 1.75)``. (A float ``log2`` gets this wrong near powers of two.)
    """
    mant, exp = torch.frexp(amax.float())  # amax = mant * 2**exp, mant in [0.5, 1)
    return (exp - 9 + (mant > 0.875).to(exp.dtype)).to(torch.int32)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**e`` for int tensors ``e`` in the normal range."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32))


def quantize_ue8m0_groups(
    x: torch.Tensor, group: int, amax_floor: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., n]`` (n % group == 0) per ``group`` elements with UE8M0 scales.

    Returns ``(e4m3 [..., n] float8_e4m3fn, scale_bytes [..., n // group] uint8)`` with
    ``amax = max(max|x|, floor)``, ``e = ceil(log2(amax/448))``, byte ``e + 127``, stored
    ``clamp(x * 2**-e, -448, 448)`` rounded to nearest even.

    Non-finite inputs (the kernels encode them the same way): NaN and +-inf do not count in
    ``amax`` (the group's scale comes from its finite elements), +-inf is stored as +-448
    (saturated, 0x7E / 0xFE) and NaN as the positive e4m3 NaN 0x7F, whatever its sign.
    """
    xf = x.float().unflatten(-1, (-1, group))
    return _quantize_ue8m0_split(xf, amax_floor)


def finite_amax(xf: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the last dim, NaN and +-inf counted as 0 (the rule for non-finite
    inputs, see :func:`quantize_ue8m0_groups`)."""
    a = xf.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(-1)


def _quantize_ue8m0_split(xf: torch.Tensor, amax_floor: float):
    amax = finite_amax(xf).clamp_min(amax_floor)
    e = ue8m0_exponent(amax)
    q = (xf * exp2_int(-e).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    bits = torch.where(torch.isnan(xf), torch.full_like(q.view(torch.uint8), E4M3_NAN),
                       q.view(torch.uint8))
    return bits.view(torch.float8_e4m3fn).flatten(-2), (e + UE8M0_BIAS).to(torch.uint8)


def dequantize_ue8m0_groups(q: torch.Tensor, scale_bytes: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 ``e4m3 * 2**(byte - 127)`` for ``q [..., n]`` and ``scale_bytes [..., n // group]``."""
    s = exp2_int(scale_bytes.to(torch.int32) - UE8M0_BIAS)
    return (q.float().unflatten(-1, (-1, group)) * s.unsqueeze(-1)).flatten(-2)


def round_to_e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 4-bit codes (uint8), nearest, ties to even code, saturating at 6;
    sign (bit 3) set for ``y < 0``."""
    a = y.abs()
    # thresholds between neighbouring magnitudes; '>' at a tie keeps the even (lower) code,
    # '>=' moves to the even (upper) code
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)
    return mag | ((y < 0).to(torch.uint8) << 3)


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


# --------------------------------------------------------------------------------------------
# record encode / decode (reference)
# --------------------------------------------------------------------------------------------
def _check_k(k: object, name: str = "k") -> torch.Tensor:
    check_tensor(name, k, dtypes=(torch.bfloat16,), ndims=2, last_dim=HEAD_DIM)
    return k


def encode_records_ref(k: torch.Tensor, record: RecordLike) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference encoder: ``k [T, 512]`` bf16 -> ``(data [T, data_bytes], scales [T, scale_bytes])``
    uint8, bit-exact to SPEC §4."""
    fmt = get_record_format(record)
    _check_k(k)
    T = k.shape[0]
    if fmt is FP8_DS_MLA:
        q, sb = quantize_ue8m0_groups(k[:, :NOPE_DIM], 64, UE8M0_AMAX_FLOOR)
        data = torch.cat([q.view(torch.uint8), k[:, NOPE_DIM:].contiguous().view(torch.uint8)], 1)
        scales = torch.cat([sb, torch.zeros(T, 1, dtype=torch.uint8, device=k.device)], 1)
    elif fmt is MXFP8:
        q, sb = quantize_ue8m0_groups(k, 32, UE8M0_AMAX_FLOOR)
        data, scales = q.view(torch.uint8), sb
    else:  # NVFP4
        xf = k.float().unflatten(-1, (32, 16))
        amax = finite_amax(xf)  # NaN -> code 0, +-inf -> +-6 (saturated), scale from the rest
        s = (amax / E2M1_MAX).clamp(2.0**-9, E4M3_MAX).to(torch.float8_e4m3fn)
        codes = round_to_e2m1_codes(xf / s.float().unsqueeze(-1)).flatten(1)
        data = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales = s.view(torch.uint8)
    return data.contiguous(), scales.contiguous()


def decode_records_ref(
    data: torch.Tensor, scales: torch.Tensor, record: RecordLike, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Reference decoder: ``data [..., data_bytes]``, ``scales [..., scale_bytes]`` uint8 ->
    ``[..., 512]`` in ``dtype`` (bf16 is exact for every record)."""
    fmt = get_record_format(record)
    if fmt is FP8_DS_MLA:
        nope = dequantize_ue8m0_groups(
            data[..., :NOPE_DIM].contiguous().view(torch.float8_e4m3fn), scales[..., :7], 64
        )
        rope = data[..., NOPE_DIM:].contiguous().view(torch.bfloat16).float()
        out = torch.cat([nope, rope], -1)
    elif fmt is MXFP8:
        out = dequantize_ue8m0_groups(data.contiguous().view(torch.float8_e4m3fn), scales, 32)
    else:
        lo, hi = data & 15, data >> 4
        codes = torch.stack([lo, hi], -1).flatten(-2)
        vals = e2m1_codes_to_float(codes).unflatten(-1, (32, 16))
        s = scales.contiguous().view(torch.float8_e4m3fn).float().unsqueeze(-1)
        out = (vals * s).flatten(-2)
    return out.to(dtype)


def quantize_dequantize_ref(k: torch.Tensor, record: RecordLike) -> torch.Tensor:
    """``decode(encode(k))`` as bf16: what attention over this record actually sees."""
    return decode_records_ref(*encode_records_ref(k, record), record)


def read_slots_ref(
    cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Decode the records at ``slots`` (any shape, int; ``-1`` gives zeros) ->
    ``[*slots.shape, 512]``."""
    fmt, cache = check_k_cache("cache", cache)
    data, scales = record_views(cache, fmt)
    page = cache.shape[1]
    s = slots.long().clamp_min(0)
    blk, off = s // page, s % page
    out = decode_records_ref(data[blk, off], scales[blk, off], fmt, torch.float32)
    out = torch.where((slots >= 0).unsqueeze(-1), out, torch.zeros_like(out))
    return out.to(dtype)
