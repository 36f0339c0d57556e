"""The reference record codecs of ``dsv41_triton.ops.records`` (SPEC §4): known values, UE8M0
exponent edge cases, e2m1 ties, layouts, and round-trip error bounds per record."""
import math

import pytest
import torch

from dsv41_triton.testing import rel_err
from dsv41_triton.ops.records import (
    E2M1_VALUES,
    FP8_DS_MLA,
    MXFP8,
    NVFP4,
    allocate_k_cache,
    check_k_cache,
    decode_records_ref,
    dequantize_ue8m0_groups,
    e2m1_codes_to_float,
    encode_records_ref,
    get_record_format,
    quantize_dequantize_ref,
    quantize_ue8m0_groups,
    read_slots_ref,
    record_views,
    round_to_e2m1_codes,
    ue8m0_exponent,
)

RECORDS = [584, 528, 288]


def _random_k(T, scale_spread=10):
    """Random bf16 [T, 512]: per-token and per-16-dim magnitudes spread over 2**±spread."""
    x = torch.randn(T, 512)
    x = x * torch.exp2(torch.randint(-scale_spread, scale_spread + 1, (T, 1)).float())
    x = x * torch.exp2(torch.randint(-3, 4, (T, 32, 1)).float()).repeat_interleave(16, 1).view(T, 512)
    return x.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# formats
# ---------------------------------------------------------------------------------------------
def test_record_formats():
    for fmt, (rb, db, sb, group) in [
        (FP8_DS_MLA, (584, 576, 8, 64)),
        (MXFP8, (528, 512, 16, 32)),
        (NVFP4, (288, 256, 32, 16)),
    ]:
        assert (fmt.record_bytes, fmt.data_bytes, fmt.scale_bytes, fmt.group) == (rb, db, sb, group)
        assert fmt.data_bytes + fmt.scale_bytes == fmt.record_bytes
        assert get_record_format(rb) is fmt and get_record_format(fmt.name) is fmt
        assert get_record_format(fmt) is fmt
        assert fmt.block_bytes(64) % fmt.block_align == 0
        assert fmt.block_bytes(64) >= 64 * rb
    for bad in (576, 0, "fp8", True, 584.0):
        with pytest.raises(ValueError, match="record"):
            get_record_format(bad)


def test_check_k_cache():
    c = allocate_k_cache(3, 16, 584)
    fmt, c3 = check_k_cache("k_cache", c.unsqueeze(2))
    assert fmt is FP8_DS_MLA and c3.shape == c.shape and c3.data_ptr() == c.data_ptr()
    with pytest.raises(TypeError, match="k_cache"):
        check_k_cache("k_cache", c.view(torch.int8))
    with pytest.raises(ValueError, match="k_cache"):
        check_k_cache("k_cache", torch.zeros(3, 16, 600, dtype=torch.uint8))
    with pytest.raises(ValueError, match="k_cache"):
        check_k_cache("k_cache", torch.zeros(3, 16, 2, 584, dtype=torch.uint8))
    flat = torch.zeros(4 * 16 * 584, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        check_k_cache("k_cache", flat.as_strided((3, 16, 584), (16 * 584 - 16, 584, 1)))


def test_record_views_follow_the_split_layout():
    page, s0 = 4, 4 * 528 + 512
    c = allocate_k_cache(3, page, 528, block_stride=s0, fill=0)
    data, scales = record_views(c, MXFP8)
    data[2, 1].fill_(7)
    scales[1, 3].fill_(9)
    flat = c.as_strided((3 * s0,), (1,))
    d0 = 2 * s0 + 1 * 512
    s_0 = 1 * s0 + page * 512 + 3 * 16
    assert torch.all(flat[d0 : d0 + 512] == 7) and torch.all(flat[s_0 : s_0 + 16] == 9)
    assert int((flat != 0).sum()) == 512 + 16


# ---------------------------------------------------------------------------------------------
# UE8M0
# ---------------------------------------------------------------------------------------------
def test_ue8m0_exponent_at_powers_of_two():
    n = torch.arange(-40, 120)
    p2 = torch.exp2(n.float())
    # 2**n / 448 = 2**(n-8) / 1.75 -> ceil(log2) = n - 8
    assert torch.equal(ue8m0_exponent(p2), (n - 8).int())
    # 448 * 2**k exactly -> k; one fp32 ulp above -> k + 1; one below -> k
    k = torch.arange(-30, 110)
    a = 448.0 * torch.exp2(k.float())
    assert torch.equal(ue8m0_exponent(a), k.int())
    assert torch.equal(ue8m0_exponent(torch.nextafter(a, a * 2)), (k + 1).int())
    assert torch.equal(ue8m0_exponent(torch.nextafter(a, a * 0)), k.int())


def test_ue8m0_exponent_matches_the_exact_rule():
    a = torch.exp2(torch.empty(20000).uniform_(-30, 120)) * (1 + torch.rand(20000))
    a = a.float()
    e = ue8m0_exponent(a)
    for av, ev in zip(a.double().tolist()[:2000], e.tolist()[:2000]):
        # smallest e with 448 * 2**e >= amax (exact in float64)
        assert 448.0 * 2.0**ev >= av > 448.0 * 2.0 ** (ev - 1)
    ad, ed = a.double(), e.double()
    assert torch.all(448.0 * torch.exp2(ed) >= ad) and torch.all(448.0 * torch.exp2(ed - 1) < ad)


def test_quantize_ue8m0_groups_known_values():
    # one group of 32 whose amax is exactly 448 * 2**3: byte 130, values divided by 8 exactly
    vals = torch.tensor([448.0, -448.0, 1.0, -2.5, 0.0625, 96.0] + [3.0] * 26) * 8
    q, sb = quantize_ue8m0_groups(vals.view(1, 32), 32, 1e-4)
    assert sb.tolist() == [[130]]
    assert torch.equal(q.float(), (vals / 8).view(1, 32))
    # rounding to nearest even inside e4m3 (amax 448 -> e = 0): 1.0625 -> 1.0, 1.1875 -> 1.25,
    # 1.3125 -> 1.25, 17 -> 16, 19 -> 20, 0.001953125 (2**-9, smallest subnormal) kept,
    # 0.0009765625 (half of it) -> 0 (tie to even)
    x = torch.tensor([[448.0, 1.0625, 1.1875, 1.3125, 17.0, 19.0, 2.0**-9, 2.0**-10]])
    q, sb = quantize_ue8m0_groups(x, 8, 1e-4)
    assert sb.tolist() == [[127]]
    assert q.float().tolist() == [[448.0, 1.0, 1.25, 1.25, 16.0, 20.0, 2.0**-9, 0.0]]
    # amax floor 1e-4: e = ceil(log2(1e-4 / 448)) = -22 -> byte 105
    tiny = torch.full((1, 64), 1e-7)
    q, sb = quantize_ue8m0_groups(tiny, 64, 1e-4)
    assert sb.tolist() == [[105]]
    assert torch.equal(q.float(), (tiny * 2.0**22).to(torch.float8_e4m3fn).float())
    assert math.ceil(math.log2(1e-4 / 448)) == -22


def test_ue8m0_round_trip_error_bound():
    x = _random_k(64).float()
    for group in (32, 64):
        q, sb = quantize_ue8m0_groups(x, group, 1e-4)
        y = dequantize_ue8m0_groups(q, sb, group)
        e = (sb.int() - 127).repeat_interleave(group, -1).double()
        # e4m3: half an ulp is 2**-4 relative (normal) or 2**-10 absolute (subnormal), times 2**e
        bound = torch.maximum(x.double().abs() * 2.0**-4, torch.exp2(e - 10))
        assert torch.all((y.double() - x.double()).abs() <= bound)
        assert torch.all(q.float().abs() <= 448)


# ---------------------------------------------------------------------------------------------
# e2m1
# ---------------------------------------------------------------------------------------------
def test_e2m1_code_table():
    codes = torch.arange(16, dtype=torch.uint8)
    v = e2m1_codes_to_float(codes)
    assert v[:8].tolist() == list(E2M1_VALUES)
    assert v[8:].tolist() == [-x for x in E2M1_VALUES]
    # every representable value maps to its own code (±0 both to code 0 / 8)
    assert torch.equal(round_to_e2m1_codes(v[1:8]), codes[1:8])
    assert torch.equal(round_to_e2m1_codes(v[9:]), codes[9:])


def test_e2m1_ties_go_to_the_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = [0, 2, 2, 4, 4, 6, 6]  # 0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0
    assert round_to_e2m1_codes(ties).tolist() == want
    assert round_to_e2m1_codes(-ties).tolist() == [c | 8 for c in want]
    up = torch.nextafter(ties, ties * 2)
    assert round_to_e2m1_codes(up).tolist() == [1, 2, 3, 4, 5, 6, 7]
    down = torch.nextafter(ties, ties * 0)
    assert round_to_e2m1_codes(down).tolist() == [0, 1, 2, 3, 4, 5, 6]
    # saturation
    assert round_to_e2m1_codes(torch.tensor([6.0, 7.0, 1e30, -1e30])).tolist() == [7, 7, 7, 15]


def test_e2m1_nearest_on_random_values():
    y = torch.empty(50000).uniform_(-7, 7)
    table = torch.tensor(E2M1_VALUES)
    d = (y.abs()[:, None] - table[None, :]).abs()
    nearest = table[d.argmin(1)]
    got = e2m1_codes_to_float(round_to_e2m1_codes(y))
    assert torch.equal(got.abs(), nearest)  # ties have probability ~0 here
    assert torch.all((got < 0) == ((y < 0) & (nearest > 0)))


# ---------------------------------------------------------------------------------------------
# record encode / decode
# ---------------------------------------------------------------------------------------------
def test_encode_fp8_ds_mla_layout():
    k = _random_k(5)
    data, scales = encode_records_ref(k, 584)
    assert data.shape == (5, 576) and scales.shape == (5, 8) and data.dtype == torch.uint8
    # RoPE dims stored raw as bf16 bytes at 448..575
    assert torch.equal(data[:, 448:].contiguous().view(torch.bfloat16), k[:, 448:])
    assert torch.all(scales[:, 7] == 0)
    q, sb = quantize_ue8m0_groups(k[:, :448], 64, 1e-4)
    assert torch.equal(scales[:, :7], sb)
    assert torch.equal(data[:, :448], q.view(torch.uint8))


def test_encode_mxfp8_layout():
    k = _random_k(5)
    data, scales = encode_records_ref(k, 528)
    assert data.shape == (5, 512) and scales.shape == (5, 16)
    q, sb = quantize_ue8m0_groups(k, 32, 1e-4)
    assert torch.equal(scales, sb) and torch.equal(data, q.view(torch.uint8))


def test_encode_nvfp4_known_values():
    k = torch.zeros(1, 512)
    # group 0: amax 6 -> s = e4m3(1.0) = 1.0
    k[0, :4] = torch.tensor([6.0, 0.5, -1.5, 3.0])
    # group 1: amax 12 -> s = 2; 2.5 / 2 = 1.25 is a tie -> 1.0 (code 2); -7 / 2 = -3.5 -> -4
    k[0, 16:19] = torch.tensor([12.0, 2.5, -7.0])
    # group 2: all zero -> s clamps to 2**-9
    # group 3: tiny amax 6e-4 / 6 = 1e-4 < 2**-9 -> s = 2**-9
    k[0, 48] = 6e-4
    k = k.to(torch.bfloat16)
    data, scales = encode_records_ref(k, 288)
    assert data.shape == (1, 256) and scales.shape == (1, 32)
    s = scales.view(torch.float8_e4m3fn).float()[0]
    assert s[:4].tolist() == [1.0, 2.0, 2.0**-9, 2.0**-9]
    # even element in the LOW nibble
    assert data[0, 0].item() == 0x17  # 6 -> code 7 (low), 0.5 -> code 1 (high)
    assert data[0, 1].item() == 0x5B  # -1.5 -> code 3|8 = 0xB (low), 3 -> code 5 (high)
    assert data[0, 8].item() == 0x27  # 6 (12/2) -> 7 (low), 1.25 tie -> 1.0, code 2 (high)
    assert data[0, 9].item() == 0x0E  # -3.5 tie -> -4, code 6|8 (low), 0 (high)
    assert data[0, 16:24].tolist() == [0] * 8  # group 2: all zero
    # 6e-4 / 2**-9 = 0.307 -> 0.5 (code 1)
    assert data[0, 24].item() == 0x01


@pytest.mark.parametrize("record", RECORDS)
def test_decode_of_representable_values_is_exact(record):
    fmt = get_record_format(record)
    T = 6
    if record == 288:
        # values e2m1 * s with amax exactly 6 * s per group of 16
        s = torch.tensor([1.0, 0.5, 2.0**-9, 448.0, 0.75, 3.0])[torch.randint(0, 6, (T, 32))]
        codes = torch.randint(0, 16, (T, 32, 16), dtype=torch.uint8)
        codes[:, :, 0] = 7
        x = e2m1_codes_to_float(codes) * s[..., None]
    else:
        group = fmt.group
        n = 448 if record == 584 else 512
        e = torch.randint(-20, 20, (T, n // group, 1)).float()
        q = (torch.randn(T, n // group, group) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        q[:, :, 0] = 448.0
        x = (q * torch.exp2(e)).view(T, n)
        if record == 584:
            x = torch.cat([x, torch.randn(T, 64).bfloat16().float()], 1)
    k = x.reshape(T, 512).to(torch.bfloat16)
    assert torch.equal(k.float(), x.reshape(T, 512))  # representable in bf16 too
    assert torch.equal(quantize_dequantize_ref(k, record), k)


@pytest.mark.parametrize("record", RECORDS)
def test_round_trip_error_bound(record):
    k = _random_k(48)
    x = k.double()
    y = quantize_dequantize_ref(k, record).double()
    assert y.dtype == torch.float64 and not torch.isnan(y).any()
    err = (y - x).abs()
    if record in (584, 528):
        group = 64 if record == 584 else 32
        n = 448 if record == 584 else 512
        _, sb = quantize_ue8m0_groups(k[:, :n], group, 1e-4)
        e = (sb.int() - 127).repeat_interleave(group, -1).double()
        bound = torch.maximum(x[:, :n].abs() * 2.0**-4, torch.exp2(e - 10))
        assert torch.all(err[:, :n] <= bound)
        assert torch.all(err[:, n:] == 0)  # 584: RoPE dims raw
    else:
        _, scales = encode_records_ref(k, 288)
        s = scales.view(torch.float8_e4m3fn).double().repeat_interleave(16, -1)
        # e2m1 rounding error <= max(0.25, |y|/4) in units of s while |x| <= 6s; beyond, the
        # code saturates at 6s (s = e4m3(amax / 6) can round down, by a lot when subnormal)
        bound = torch.where(x.abs() > 6 * s, x.abs() - 6 * s, torch.maximum(0.25 * s, x.abs() / 4))
        assert torch.all(err <= bound)
    # relative error on O(1) data (NVFP4 saturates for amax > 6 * 448 and loses scale precision
    # for amax < 6 * 2**-6, so the wide-range data above is not a fair figure)
    k1 = torch.randn(64, 512).to(torch.bfloat16)
    r = rel_err(quantize_dequantize_ref(k1, record), k1)
    assert 0 < r < {584: 0.04, 528: 0.04, 288: 0.11}[record]


@pytest.mark.parametrize("record", RECORDS)
def test_decode_shapes_and_read_slots(record):
    fmt = get_record_format(record)
    k = _random_k(7)
    data, scales = encode_records_ref(k, record)
    dec = decode_records_ref(data.view(7, 1, -1), scales.view(7, 1, -1), record)
    assert dec.shape == (7, 1, 512) and dec.dtype == torch.bfloat16
    cache = allocate_k_cache(2, 4, record)
    dv, sv = record_views(cache, fmt)
    blk, off = torch.arange(1, 8) // 4, torch.arange(1, 8) % 4
    dv[blk, off] = data
    sv[blk, off] = scales
    slots = torch.tensor([[3, -1], [7, 1]])
    r = read_slots_ref(cache, slots)
    assert torch.equal(r[0, 0], dec[2, 0]) and torch.equal(r[1, 0], dec[6, 0])
    assert torch.equal(r[1, 1], dec[0, 0]) and torch.all(r[0, 1] == 0)
