"""Every row of docs/semantics.md against every backend available on this machine (``torch``,
``triton`` — on CPU in Triton's interpreter —) and the float64 references."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41_triton import backends as B
from dsv41_triton.attention.ref import sparse_mla_decode_ref, sparse_mla_prefill_ref
from dsv41_triton.ops import allocate_k_cache, apply_rope
from dsv41_triton.ops.kv_cache import quantize_and_insert_k_cache
from dsv41_triton.ops.kv_cache_ref import quantize_and_insert_k_cache_ref
from dsv41_triton.ops.mxfp8 import mxfp8_quantize
from dsv41_triton.ops.mxfp8_ref import mxfp8_quantize_ref
from dsv41_triton.ops.rope_ref import apply_rope_ref, make_cos_sin_cache
from dsv41_triton.testing import random_k_cache

#: backends checked here (those that cannot run on this machine are skipped: FlashMLA needs
#: an SM90/SM100 GPU and its library) and "ref", the float64 references
IMPLS = ("torch", "triton", "flashmla", "ref")
PAGE = 4


def _backend(name, device):
    if name == "ref":
        return None
    a = B.probe(name, B.Problem(kind="decode", num_heads=8, device=torch.device(device)))
    if not a.available:
        pytest.skip(a.reason)
    return B.get_backend(name)


def decode(impl, device, *args, **kw):
    """``(out, lse)`` of one decode; references return float64."""
    be = _backend(impl, device)
    if be is None:
        return sparse_mla_decode_ref(*args, **kw)
    return be.sparse_mla_decode(*args, **kw)


def prefill(impl, device, *args, **kw):
    be = _backend(impl, device)
    if be is None:
        return sparse_mla_prefill_ref(*args, **kw)
    return be.sparse_mla_prefill(*args, **kw)


def _decode_case(device, T=3, H=3, g=None, extra_record=288):
    g = g or torch.Generator().manual_seed(7)
    q = torch.randn(T, H, 512, generator=g).bfloat16().to(device)
    # built on the CPU (the generator is a CPU one), then moved
    swa = random_k_cache(4, PAGE, 584, "cpu", generator=g).to(device)
    extra = random_k_cache(3, PAGE, extra_record, "cpu", generator=g).to(device)
    si = torch.randint(0, 4 * PAGE, (T, 6), generator=g, dtype=torch.int32).to(device)
    ei = torch.randint(0, 3 * PAGE, (T, 5), generator=g, dtype=torch.int32).to(device)
    sl = torch.full((T,), 6, dtype=torch.int32, device=device)
    el = torch.full((T,), 5, dtype=torch.int32, device=device)
    return q, swa, si, sl, extra, ei, el


def _extra(impl):
    """FlashMLA's sparse decode reads both caches in one record."""
    return 584 if impl == "flashmla" else 288


def _f(x):
    return x.double().cpu()


# ---- NaN ------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_q_propagates_and_nothing_else_changes(impl, device):
    q, swa, si, sl, extra, ei, el = _decode_case(device, extra_record=_extra(impl))
    clean_o, clean_l = decode(impl, device, q, swa, si, sl, extra, ei, el)
    qn = q.clone()
    qn[0, 1, 5] = float("nan")
    sl2, el2 = sl.clone(), el.clone()
    qn[2, 0, 7] = float("nan")  # token 2 has no key at all: still 0 / +inf
    sl2[2] = 0
    el2[2] = 0
    o, lse = decode(impl, device, qn, swa, si, sl2, extra, ei, el2)
    o, lse = _f(o), _f(lse)
    assert torch.isnan(o[0, 1]).all() and torch.isnan(lse[0, 1])
    assert torch.equal(o[2], torch.zeros_like(o[2])) and torch.isinf(lse[2]).all()
    keep = torch.ones(3, 3, dtype=torch.bool)
    keep[0, 1] = False
    keep[2] = False
    assert torch.isfinite(o[keep]).all()
    assert torch.equal(o[keep], _f(clean_o)[keep]) and torch.equal(lse[keep], _f(clean_l)[keep])


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_key_propagates_to_the_tokens_that_read_it(impl, device):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 512, generator=g).bfloat16().to(device)
    kv = torch.randn(6, 512, generator=g).bfloat16().to(device)
    kv[4, 100] = float("nan")
    idx = torch.tensor([[0, 1, 4], [0, 1, 2]], dtype=torch.int32, device=device)
    o, lse = map(_f, prefill(impl, device, q, kv, idx))
    assert torch.isnan(o[0]).all() and torch.isnan(lse[0]).all()
    assert torch.isfinite(o[1]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_stored_in_a_record_propagates(impl, device):
    q, swa, si, sl, extra, ei, el = _decode_case(device, extra_record=_extra(impl))
    k = torch.randn(2, 512).bfloat16().to(device)
    k[0, 9] = float("nan")  # e4m3 byte 0x7F in the record of slot 5
    quantize_and_insert_k_cache_ref(k, swa, torch.tensor([5, 6], device=device))
    si = si.clone()
    si[1, 2] = 5
    si[0] = torch.where(si[0] == 5, 6, si[0])
    si[2] = torch.where(si[2] == 5, 6, si[2])
    o, lse = map(_f, decode(impl, device, q, swa, si, sl, extra, ei, el))
    assert torch.isnan(o[1]).all() and torch.isnan(lse[1]).all()
    assert torch.isfinite(o[[0, 2]]).all() and torch.isfinite(lse[[0, 2]]).all()


@pytest.mark.parametrize("record", (584, 528, 288))
def test_nan_and_inf_keys_are_encoded_by_one_rule(record, device):
    g = torch.Generator().manual_seed(record)
    k = torch.randn(7, 512, generator=g).bfloat16()
    k[0, 3] = float("nan")
    k[1, 100] = float("inf")
    k[2, 500] = -float("inf")
    k[3, :64] = float("nan")  # a whole group
    k[4, 450] = float("nan")  # the 584 record's raw bf16 tail
    k[5, 7] = -float("nan")
    k[6, 32:64] = -float("inf")
    k = k.to(device)
    c1 = allocate_k_cache(2, PAGE, record, device, fill=0xA5)
    c2 = c1.clone()
    slots = torch.arange(7, device=device)
    quantize_and_insert_k_cache(k, c1, slots)
    quantize_and_insert_k_cache_ref(k, c2, slots)
    assert torch.equal(c1, c2)
    if record != 288:  # e4m3 bytes: NaN -> 0x7F, +-inf -> +-448
        data = c2.view(-1)[: 7 * (record - (8 if record == 584 else 16))]
        assert (data == 0x7F).sum() >= 2 + 64 and (data == 0xFE).any()


def test_nan_and_inf_in_the_mxfp8_cast(device):
    x = torch.randn(3, 2, 4096)
    x[0, 0, 5] = float("nan")
    x[1, 1, 40] = float("inf")
    x[2, 0, 100:132] = -float("nan")
    d, s = mxfp8_quantize(x.to(device))
    dr, sr = mxfp8_quantize_ref(x)
    assert torch.equal(d.view(torch.uint8).cpu(), dr.view(torch.uint8))
    assert torch.equal(s.cpu(), sr)
    assert d.view(torch.uint8)[0, 0, 5].item() == 0x7F


@pytest.mark.parametrize("impl", ("torch", "triton"))
def test_nan_in_q_fused(impl, device):
    be = _backend(impl, device)
    q, swa, si, sl, extra, ei, el = _decode_case(device, T=2, H=8)
    q[1, 3, 0] = float("nan")
    pos = torch.tensor([5, 9], dtype=torch.int32, device=device)
    cs = make_cos_sin_cache(16).to(device)
    data, scale, lse = be.sparse_mla_decode_fused(q, pos, cs, swa, si, sl, extra, ei, el)
    lse = lse.cpu()
    assert torch.isnan(lse[1, 3]) and torch.isfinite(lse[0]).all()
    nan_mask = torch.isnan(lse)
    assert nan_mask.sum() == 1
    bytes_ = data.view(torch.uint8).cpu()
    assert (bytes_[1, 0, 3 * 512:4 * 512] == 0x7F).all()
    assert (bytes_[0] != 0x7F).all()


# ---- empty ----------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens(impl, device):
    q, swa, si, sl, extra, ei, el = _decode_case(device, extra_record=_extra(impl))
    o, lse = decode(impl, device, q[:0], swa, si[:0], sl[:0], extra, ei[:0], el[:0])
    assert o.shape == (0, 3, 512) and lse.shape == (0, 3)
    kv = torch.randn(5, 512).bfloat16().to(device)
    o, lse = prefill(impl, device, q[:0], kv, si[:0], sl[:0])
    assert o.shape == (0, 3, 512) and lse.shape == (0, 3)


@pytest.mark.parametrize("impl", IMPLS)
def test_index_width_zero(impl, device):
    q, swa, si, sl, extra, ei, el = _decode_case(device, extra_record=_extra(impl))
    z = si[:, :0]
    o, lse = decode(impl, device, q, swa, z, None, extra, ei[:, :0], None)
    assert torch.equal(_f(o), torch.zeros(3, 3, 512, dtype=torch.float64))
    assert torch.isinf(_f(lse)).all() and (_f(lse) > 0).all()
    kv = torch.randn(5, 512).bfloat16().to(device)
    o, lse = prefill(impl, device, q, kv, z)
    assert torch.equal(_f(o), torch.zeros(3, 3, 512, dtype=torch.float64))
    assert (_f(lse) == math.inf).all()


@pytest.mark.parametrize("impl", ("torch", "triton"))
@pytest.mark.parametrize("kind", ("decode_fused", "prefill_fused"))
def test_no_tokens_fused(impl, kind, device):
    be = _backend(impl, device)
    q = torch.randn(0, 8, 512).bfloat16().to(device)
    pos = torch.zeros(0, dtype=torch.int32, device=device)
    cs = make_cos_sin_cache(16).to(device)
    idx = torch.zeros(0, 4, dtype=torch.int32, device=device)
    if kind == "decode_fused":
        data, scale, lse = be.sparse_mla_decode_fused(q, pos, cs, random_k_cache(2, PAGE, 584, device),
                                                      idx, None)
    elif kind == "prefill_fused":
        data, scale, lse = be.sparse_mla_prefill_fused(q, pos, cs, torch.randn(3, 512).bfloat16()
                                                       .to(device), idx)
    else:
        raise AssertionError(kind)
    assert data.shape == (0, 1, 4096) and scale.shape == (0, 1, 32) and lse.shape == (0, 8)


@pytest.mark.parametrize("impl", ("torch", "triton"))
@pytest.mark.parametrize("given", ("data", "scale"))
def test_fused_half_of_the_output_pair_given(impl, given, device):
    """The missing half of ``(data, scale)`` is allocated; the result is a call given neither."""
    from dsv41_triton.ops import alloc_mxfp8_output

    be = _backend(impl, device)
    T = 3
    q = torch.randn(T, 8, 512).bfloat16().to(device)
    pos = torch.arange(T, dtype=torch.int32, device=device)
    cs = make_cos_sin_cache(16).to(device)
    cache = random_k_cache(2, PAGE, 584, device)
    idx = torch.randint(0, 2 * PAGE, (T, 4), dtype=torch.int32, device=device)
    d0, s0, _ = be.sparse_mla_decode_fused(q, pos, cs, cache, idx, None)
    d, s = alloc_mxfp8_output(T, 1, device)
    kw = {given: d if given == "data" else s}
    d1, s1, _ = be.sparse_mla_decode_fused(q, pos, cs, cache, idx, None, **kw)
    assert (d1 is d) if given == "data" else (s1 is s)
    assert torch.equal(d1.view(torch.uint8), d0.view(torch.uint8)) and torch.equal(s1, s0)


# ---- rejected -------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ("torch", "triton", "flashmla"))
def test_zero_heads_rejected(impl, device):
    q, swa, si, sl, extra, ei, el = _decode_case(device, extra_record=_extra(impl))
    with pytest.raises(ValueError, match="q: expected at least one head"):
        decode(impl, device, q[:, :0], swa, si, sl)
    with pytest.raises(ValueError, match="q: expected at least one head"):
        prefill(impl, device, q[:, :0], torch.randn(5, 512).bfloat16().to(device), si)


def test_select_backend_bogus_kind_is_one_value_error():
    with pytest.raises(ValueError, match=r"^problem: unknown kind 'bogus'") as e:
        B.select_backend(kind="bogus", num_heads=8)
    assert str(e.value).count("bogus") == 1
    with pytest.raises(ValueError, match="num_heads"):
        B.select_backend("torch", kind="decode", num_heads=0)


# ---- lens -----------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_lens_are_clamped_to_the_width(impl, device):
    q, swa, si, sl, extra, ei, el = _decode_case(device, extra_record=_extra(impl))
    wild = torch.tensor([99, -5, 3], dtype=torch.int32, device=device)
    clamped = wild.clamp(0, si.shape[1])
    ewild = torch.tensor([-1, 50, 0], dtype=torch.int32, device=device)
    eclamped = ewild.clamp(0, ei.shape[1])
    o1, l1 = decode(impl, device, q, swa, si, wild, extra, ei, ewild)
    o2, l2 = decode(impl, device, q, swa, si, clamped, extra, ei, eclamped)
    assert torch.equal(_f(o1), _f(o2)) and torch.equal(_f(l1), _f(l2))
    # token 1 reads only its 50 -> 5 compressed columns; a row with no column at all: 0, +inf
    o3, l3 = decode(impl, device, q, swa, si, torch.tensor([-3, -3, -3], dtype=torch.int32,
                                                            device=device))
    assert torch.equal(_f(o3), torch.zeros(3, 3, 512, dtype=torch.float64))
    assert (_f(l3) == math.inf).all()


# ---- indices --------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_int64_ids_past_int32_are_skipped(impl, device):
    """An int64 id of 2**32 + s (s a valid slot) is out of range, not slot s: as -1."""
    q, swa, si, sl, extra, ei, el = _decode_case(device, extra_record=_extra(impl))
    si64, ei64 = si.to(torch.int64), ei.to(torch.int64)
    si64[:, ::2] += 2 ** 32
    ei64[:, 1::2] += 2 ** 33
    si_neg, ei_neg = si.clone(), ei.clone()
    si_neg[:, ::2] = -1
    ei_neg[:, 1::2] = -1
    o1, l1 = decode(impl, device, q, swa, si64, sl, extra, ei64, el)
    o2, l2 = decode(impl, device, q, swa, si_neg, sl, extra, ei_neg, el)
    assert torch.equal(_f(o1), _f(o2)) and torch.equal(_f(l1), _f(l2))


# ---- sink -----------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_sink_values(impl, device):
    q, swa, si, sl, extra, ei, el = _decode_case(device, extra_record=_extra(impl))
    sl = sl.clone()
    sl[2] = 0
    el = el.clone()
    el[2] = 0
    base_o, base_l = map(_f, decode(impl, device, q, swa, si, sl, extra, ei, el))
    sink = torch.tensor([float("-inf"), float("inf"), float("nan")], device=device)
    o, lse = map(_f, decode(impl, device, q, swa, si, sl, extra, ei, el, attn_sink=sink))
    assert torch.equal(lse, base_l)  # the sink never enters lse
    assert torch.equal(o[:, 0], base_o[:, 0])  # -inf: no sink
    assert torch.equal(o[:2, 1], torch.zeros(2, 512, dtype=torch.float64))  # +inf: zero output
    assert torch.isnan(o[:, 2]).all()  # NaN: NaN output, for the token without keys too
    assert torch.equal(o[2, :2], torch.zeros(2, 512, dtype=torch.float64))  # no keys: 0
    assert (lse[2] == math.inf).all()


@pytest.mark.parametrize("impl", ("torch", "triton"))
def test_nan_sink_fused(impl, device):
    """The fused contract: a NaN sink makes its head's MXFP8 data bytes 0x7F in every token,
    the token without keys included; lse unaffected."""
    be = _backend(impl, device)
    q, swa, si, sl, extra, ei, el = _decode_case(device, T=2, H=8)
    sl[1] = 0
    el[1] = 0
    sink = torch.full((8,), float("-inf"), device=device)
    sink[3] = float("nan")
    pos = torch.tensor([5, 9], dtype=torch.int32, device=device)
    cs = make_cos_sin_cache(16).to(device)
    _, _, base_l = be.sparse_mla_decode_fused(q, pos, cs, swa, si, sl, extra, ei, el)
    data, scale, lse = be.sparse_mla_decode_fused(q, pos, cs, swa, si, sl, extra, ei, el,
                                                  attn_sink=sink)
    assert torch.equal(lse.cpu(), base_l.cpu())
    assert (lse[1].cpu() == math.inf).all()
    bytes_ = data.view(torch.uint8).cpu()
    assert (bytes_[:, 0, 3 * 512:4 * 512] == 0x7F).all()
    rest = torch.cat([bytes_[:, 0, :3 * 512], bytes_[:, 0, 4 * 512:]], -1)
    assert (rest[0] != 0x7F).all() and ((rest[1] & 0x7F) == 0).all()  # no keys: +-0


# ---- positions past the cos/sin table -------------------------------------------------------
def test_positions_outside_the_table_are_not_rotated_by_the_ops(device):
    x = torch.randn(4, 2, 512).bfloat16().to(device)
    cs = make_cos_sin_cache(8).to(device)
    pos = torch.tensor([-1, 8, 100, 3], dtype=torch.int32, device=device)
    out = apply_rope(x, pos, cs)
    ref = apply_rope_ref(x, pos, cs)
    assert torch.equal(out, ref)
    assert torch.equal(out[:3], x[:3]) and not torch.equal(out[3], x[3])


@pytest.mark.parametrize("impl", ("torch", "triton"))
def test_outputs_carry_no_autograd_graph(impl, device):
    q, swa, si, sl, extra, ei, el = _decode_case(device, extra_record=288)
    q.requires_grad_(True)
    o, lse = decode(impl, device, q, swa, si, sl, extra, ei, el)
    assert not o.requires_grad and not lse.requires_grad
    o, lse = prefill(impl, device, q, torch.randn(9, 512).bfloat16().to(device), si % 9)
    assert not o.requires_grad and not lse.requires_grad
