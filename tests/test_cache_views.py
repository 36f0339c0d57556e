"""Caches that are not in the block-split layout are rejected before any launch (cache
untouched) by every entry point that takes a cache; the accepted layouts work."""
from __future__ import annotations

import pytest
import torch

from dsv41_triton import backends as B
from dsv41_triton.attention import sparse_mla_decode, sparse_mla_decode_fused
from dsv41_triton.attention.ref import sparse_mla_decode_ref
from dsv41_triton.ops import allocate_k_cache, check_k_cache, dequantize_and_gather_k_cache
from dsv41_triton.ops import quantize_and_insert_k_cache
from dsv41_triton.ops.rope_ref import make_cos_sin_cache
from dsv41_triton.testing import random_k_cache

PAGE = 16


def _views(device):
    """(name, bad view, match) for every rejected layout; built from one real cache."""
    c = random_k_cache(4, PAGE, 584, device)
    flat = torch.randint(0, 256, (4 * c.stride(0) + 64,), dtype=torch.uint8, device=device)
    return [
        ("page slice", c[:, :8], "page-dim slice"),
        ("page slice 4-D", c.unsqueeze(2)[:, 8:], "page-dim slice"),
        ("transposed", c.transpose(0, 1), "back to back"),
        ("page-strided", c[:, ::2], "back to back"),
        ("misaligned base", flat[1:].as_strided((4, PAGE, 584), (c.stride(0), 584, 1)),
         "16-byte aligned"),
        ("overlapping blocks", flat.as_strided((4, PAGE, 584), (584 * PAGE - 16, 584, 1)),
         "overlap"),
        ("odd block stride", flat.as_strided((4, PAGE, 584), (584 * PAGE + 8, 584, 1)),
         "multiple of 16"),
        ("4-D dim 2 not 1", torch.zeros(2, PAGE, 2, 584, dtype=torch.uint8, device=device),
         "1, bytes"),
        ("record bytes strided",
         torch.zeros(4, PAGE, 1168, dtype=torch.uint8, device=device)[:, :, ::2],
         "contiguous"),
    ]


@pytest.mark.parametrize("which", range(9))
def test_bad_views_rejected_everywhere_cache_untouched(which, device):
    name, bad, match = _views(device)[which]
    before = bad.clone()
    with pytest.raises(ValueError, match=match):
        check_k_cache("k_cache", bad)
    T = 3
    k = torch.randn(T, 512).bfloat16().to(device)
    slots = torch.arange(T, device=device)
    with pytest.raises(ValueError, match=match):
        quantize_and_insert_k_cache(k, bad, slots)
    out = torch.zeros(1, 8, 512, dtype=torch.bfloat16, device=device)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=match):
        dequantize_and_gather_k_cache(out, bad, torch.tensor([4], dtype=torch.int32,
                                                             device=device), None, bt,
                                      bad.shape[1], 0)
    q = torch.randn(T, 8, 512).bfloat16().to(device)
    idx = torch.zeros(T, 4, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=match):
        sparse_mla_decode(q, bad, idx, None)
    cs = make_cos_sin_cache(8).to(device)
    pos = torch.zeros(T, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=match):
        sparse_mla_decode_fused(q, bad, idx, token_positions=pos, cos_sin_cache=cs)
    for backend in ("torch", "triton"):
        a = B.probe(backend, B.Problem(kind="decode", num_heads=8, device=torch.device(device)))
        if a.available:
            with pytest.raises(ValueError, match=match):
                B.get_backend(backend).sparse_mla_decode(q, bad, idx, None)
    assert torch.equal(bad, before) and torch.equal(out, torch.zeros_like(out))


def test_a_reshape_into_smaller_blocks_is_a_cache(device):
    base = torch.zeros(4, PAGE, 584, dtype=torch.uint8, device=device)
    fmt, c3 = check_k_cache("k_cache", base.view(8, PAGE // 2, 584))
    assert fmt.record_bytes == 584 and c3.shape == (8, PAGE // 2, 584)
    with pytest.raises(ValueError, match="page-dim slice"):
        check_k_cache("k_cache", base[:, : PAGE // 2])


@pytest.mark.parametrize("four_d", (False, True))
@pytest.mark.parametrize("record", (584, 528, 288))
def test_padded_block_stride_and_block_slices_are_accepted(record, four_d, device):
    from dsv41_triton.ops.records import get_record_format, quantize_dequantize_ref, read_slots_ref

    fmt = get_record_format(record)
    base = allocate_k_cache(6, PAGE, record, device, block_stride=fmt.block_bytes(PAGE) + 512,
                            fill=0xA5)
    for cache in (base, base[1:4], base[::2]):
        c = cache.unsqueeze(2) if four_d else cache
        assert check_k_cache("k_cache", c)[0] is fmt
        nb = cache.shape[0]
        T = nb * PAGE
        k = torch.randn(T, 512).bfloat16().to(device)
        raw = torch.empty(0, dtype=torch.uint8, device=device).set_(c.untyped_storage())
        before = raw.clone()
        quantize_and_insert_k_cache(k, c, torch.arange(T, device=device))
        out = torch.full((1, T, 512), float("nan"), dtype=torch.bfloat16, device=device)
        dequantize_and_gather_k_cache(out, c, torch.tensor([T], dtype=torch.int32, device=device),
                                      None, torch.arange(nb, dtype=torch.int32,
                                                         device=device)[None], PAGE, 0)
        want = quantize_dequantize_ref(k, record)
        assert torch.equal(read_slots_ref(c, torch.arange(T, device=device)), want)
        assert torch.equal(out[0], want)
        # only this view's record bytes changed: not the padding after each block's scale
        # rows, not the blocks outside the view
        owned = torch.zeros_like(before, dtype=torch.bool)
        for blk in range(nb):
            start = cache.storage_offset() + blk * cache.stride(0)
            owned[start:start + PAGE * record] = True
        assert torch.equal(raw[~owned], before[~owned])
        assert not torch.equal(raw[owned], before[owned])
        if record != 288:
            q = torch.randn(2, 3, 512).bfloat16().to(device)
            idx = torch.randint(0, T, (2, 5), dtype=torch.int32, device=device)
            o, lse = sparse_mla_decode(q, c, idx, None)
            ro, rl = sparse_mla_decode_ref(q, c, idx, None)
            assert (o.double() - ro).norm() <= 1e-2 * ro.norm()
