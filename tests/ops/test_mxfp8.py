"""MXFP8 packing (SPEC §6): alloc/check, mxfp8_quantize and rope_mxfp8_epilogue vs references."""
import math

import pytest
import torch

from dsv41_triton._utils import is_interpreter, round_up
from dsv41_triton.ops.layouts import o_interleave_index, output_from_groups
from dsv41_triton.ops.mxfp8 import (
    alloc_mxfp8_output,
    check_mxfp8_output,
    mxfp8_dequantize,
    mxfp8_quantize,
    rope_mxfp8_epilogue,
)
from dsv41_triton.ops.mxfp8_ref import (
    mxfp8_quantize_ref,
    pack_ue8m0_words,
    rope_mxfp8_epilogue_ref,
    unpack_ue8m0_words,
)
from dsv41_triton.ops.rope_ref import apply_rope_ref, make_cos_sin_cache
from dsv41_triton.testing import poison_

SENTINEL = -123456789


def _e4m3_ordinal(d: torch.Tensor) -> torch.Tensor:
    b = d.view(torch.uint8).to(torch.int64)
    mag = b & 0x7F
    return torch.where(b >= 128, -mag, mag)


def assert_mxfp8_equal(data, scale, ref_data, ref_scale):
    """Scales bit-equal; data bit-equal in the interpreter, within one e4m3 ulp on a GPU."""
    assert torch.equal(scale.cpu().contiguous(), ref_scale.cpu()), "scales differ"
    raw = data.view(torch.uint8).cpu()
    assert not ((raw & 0x7F) == 0x7F).any(), "NaN (unwritten) data bytes"
    diff = (_e4m3_ordinal(data.cpu()) - _e4m3_ordinal(ref_data.cpu())).abs()
    limit = 0 if is_interpreter() else 1
    assert diff.max().item() <= limit, f"{int((diff > limit).sum())} data bytes off by > {limit} ulp"


def _alloc_poisoned(T, G, device):
    """Poisoned output pair; the whole scale storage (padding rows included) holds SENTINEL."""
    data, scale = alloc_mxfp8_output(T, G, device)
    poison_(data)
    storage = torch.as_strided(scale, (scale.untyped_storage().nbytes() // 4,), (1,), 0)
    storage.fill_(SENTINEL)
    return data, scale, storage


def _padding_untouched(scale, storage, T):
    """Every storage word outside the T real rows still holds SENTINEL."""
    tp = round_up(T, 4)
    rows = torch.arange(storage.numel(), device=storage.device) % tp
    return bool((storage[rows >= T] == SENTINEL).all())


def _random_groups(T, G, device, dtype=torch.float32):
    """Random chunks with per-chunk magnitudes spread over 2**-20 .. 2**20."""
    scale = torch.exp2(torch.randint(-20, 20, (T, G, 128, 1)).float())
    x = (torch.randn(T, G, 128, 32) * scale).view(T, G, 4096)
    return x.to(dtype).to(device)


# --------------------------------------------------------------------------------------------
# buffers
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [0, 1, 3, 4, 5, 7])
def test_alloc_strides(T):
    data, scale = alloc_mxfp8_output(T, 3)
    tp = round_up(T, 4)
    assert data.shape == (T, 3, 4096) and data.dtype == torch.float8_e4m3fn and data.is_contiguous()
    assert scale.shape == (T, 3, 32) and scale.dtype == torch.int32
    assert scale.stride() == (1, 32 * tp, tp)
    assert scale.untyped_storage().nbytes() == 3 * 32 * tp * 4
    check_mxfp8_output(data, scale, T, 3)


def test_pack_unpack_words():
    b = torch.randint(0, 256, (5, 128), dtype=torch.uint8)
    w = pack_ue8m0_words(b)
    assert w.dtype == torch.int32 and w.shape == (5, 32)
    assert int(w[0, 0]) & 0xFF == int(b[0, 0]) and (int(w[0, 0]) >> 24) & 0xFF == int(b[0, 3])
    assert torch.equal(unpack_ue8m0_words(w), b)


def test_reference_follows_the_rule():
    """The reference against the SPEC rule written out with float64 math (chunks that are
    not at a power-of-two boundary, so float log2 is safe)."""
    x = torch.randn(2, 1, 4096, dtype=torch.float64) * 37.0
    x[0, 0, :32] = 0.0  # amax floor 1e-10
    x[0, 0, 32:64] = torch.linspace(-3.0, 5.0, 32, dtype=torch.float64) * 448 * 2.0**3  # amax = 448*40 (not a power-of-2 multiple)
    x = x.float()
    data, scale = mxfp8_quantize_ref(x)
    sb = unpack_ue8m0_words(scale).view(2, 1, 128).long()
    chunks = x.double().view(2, 1, 128, 32)
    amax = chunks.abs().amax(-1).clamp_min(1e-10)
    e = torch.ceil(torch.log2(amax / 448.0)).long()
    assert torch.equal(sb, e + 127)
    assert int(sb[0, 0, 0]) == math.ceil(math.log2(1e-10 / 448)) + 127
    vals = (chunks * torch.exp2(-e.double()).unsqueeze(-1)).clamp(-448, 448)
    assert torch.equal(data.view(2, 1, 128, 32).view(torch.uint8), vals.float().to(torch.float8_e4m3fn).view(torch.uint8))
    # the power-of-two boundary: amax = 448 * 2**k gives e = k exactly (rounded UP only above)
    y = torch.full((1, 1, 4096), 448.0 * 8)
    y[..., 32:64] = 448.0 * 8 * 1.0000001
    _, s = mxfp8_quantize_ref(y)
    sb = unpack_ue8m0_words(s)[0, 0]
    assert int(sb[0]) == 127 + 3 and int(sb[1]) == 127 + 4


# --------------------------------------------------------------------------------------------
# mxfp8_quantize
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,G", [(1, 1), (3, 2), (5, 1), (7, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp8_quantize_matches_ref(device, T, G, dtype):
    x = _random_groups(T, G, device, dtype)
    x.view(T, G, 128, 32)[0, 0, 0] = 0  # an all-zero chunk: amax floor
    x.view(T, G, 128, 32)[-1, -1, 1] = 448.0 * 2.0**-5  # exactly on a power-of-two boundary
    x.view(T, G, 128, 32)[-1, -1, 2, 0] = 1e30  # huge
    data, scale, storage = _alloc_poisoned(T, G, device)
    d, s = mxfp8_quantize(x, data, scale)
    assert d is data and s is scale
    ref_d, ref_s = mxfp8_quantize_ref(x.cpu())
    assert_mxfp8_equal(d, s, ref_d, ref_s)
    assert _padding_untouched(scale, storage, T)
    # dequantized values are within e4m3 precision of x (relative to each chunk's scale)
    deq = mxfp8_dequantize(d, s).cpu().view(T, G, 128, 32)
    xc = x.float().cpu().view(T, G, 128, 32)
    tol = xc.abs().amax(-1, keepdim=True) * 2.0**-3 + 1e-30
    assert ((deq - xc).abs() <= tol).all()


def test_mxfp8_quantize_allocates_and_strided_input(device):
    T, G = 3, 2
    big = _random_groups(T, G + 1, device)
    x = big[:, 1:]  # strided over groups
    d, s = mxfp8_quantize(x)
    assert s.stride() == (1, 32 * 4, 4)
    assert_mxfp8_equal(d, s, *mxfp8_quantize_ref(x.cpu()))


def test_mxfp8_quantize_writes_only_its_rows(device):
    """A data buffer that is a slice of a larger one: the rest stays poisoned."""
    T, G = 5, 2
    x = _random_groups(T, G, device)
    big = poison_(torch.empty(T + 2, G + 1, 4096, dtype=torch.float8_e4m3fn, device=device))
    data = big[1 : T + 1, :G]
    _, scale = alloc_mxfp8_output(T, G, device)
    mxfp8_quantize(x, data, scale)
    raw = big.view(torch.uint8)
    assert (raw[0] == 0x7F).all() and (raw[T + 1] == 0x7F).all() and (raw[:, G] == 0x7F).all()
    assert_mxfp8_equal(data, scale, *mxfp8_quantize_ref(x.cpu()))


def test_mxfp8_quantize_empty(device):
    d, s = mxfp8_quantize(torch.empty(0, 2, 4096, device=device))
    assert d.shape == (0, 2, 4096) and s.shape == (0, 2, 32)


# --------------------------------------------------------------------------------------------
# rope_mxfp8_epilogue
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,H", [(1, 8), (3, 16), (5, 8), (7, 24)])
@pytest.mark.parametrize("layout", ["standard", "interleaved"])
def test_epilogue_matches_ref(device, T, H, layout):
    cs = make_cos_sin_cache(300, device=device)
    o = (torch.randn(T, H, 512) * torch.exp2(torch.randint(-6, 6, (T, H, 1)).float())).to(torch.bfloat16).to(device)
    pos = torch.randint(0, 300, (T,))
    pos[: min(T, 3)] = torch.tensor([299, -1, 300])[: min(T, 3)]
    pos = pos.to(device)
    data, scale, storage = _alloc_poisoned(T, H // 8, device)
    d, s = rope_mxfp8_epilogue(o, pos, cs, layout, data, scale)
    assert d is data and s is scale
    ref_d, ref_s = rope_mxfp8_epilogue_ref(o.cpu(), pos.cpu(), cs.cpu(), layout)
    assert_mxfp8_equal(d, s, ref_d, ref_s)
    assert _padding_untouched(scale, storage, T)
    # the result decodes to the inverse-RoPE'd output in the requested layout
    deq = output_from_groups(mxfp8_dequantize(d, s).cpu(), layout)
    want = apply_rope_ref(o.cpu(), pos.cpu(), cs.cpu(), inverse=True, out_dtype=torch.float32)
    assert (deq - want).abs().max().item() <= want.abs().max().item() * 2.0**-3


def test_epilogue_layouts_are_permutations_of_each_other(device):
    """Same 32-element chunks in both layouts: data and scale bytes are exact permutations."""
    T, H = 3, 16
    cs = make_cos_sin_cache(50, device=device)
    o = torch.randn(T, H, 512, device=device)  # fp32 input
    pos = torch.tensor([4, 49, 0], device=device, dtype=torch.int32)
    ds, ss = rope_mxfp8_epilogue(o, pos, cs, "standard")
    di, si = rope_mxfp8_epilogue(o, pos, cs, "interleaved")
    idx = o_interleave_index(device)
    assert torch.equal(di.view(torch.uint8), ds.view(torch.uint8)[..., idx])
    chunk_idx = idx.view(128, 32)[:, 0] // 32  # interleaved chunk k holds standard chunk
    assert torch.equal(unpack_ue8m0_words(si), unpack_ue8m0_words(ss)[..., chunk_idx])
    assert not torch.equal(di.view(torch.uint8), ds.view(torch.uint8))


def test_epilogue_rotation_happens(device):
    """The inverse rotation is applied (a no-RoPE quantization differs on dims 448..511)."""
    T, H = 2, 8
    cs = make_cos_sin_cache(50, device=device)
    o = torch.randn(T, H, 512, device=device).to(torch.bfloat16)
    pos = torch.tensor([7, 31], device=device)
    d, s = rope_mxfp8_epilogue(o, pos, cs)
    plain_d, _ = mxfp8_quantize(o.view(T, 1, 4096))
    dd = d.view(torch.uint8).view(T, 8, 512)
    pp = plain_d.view(torch.uint8).view(T, 8, 512)
    assert torch.equal(dd[..., :448], pp[..., :448])
    assert not torch.equal(dd[..., 448:], pp[..., 448:])


def test_epilogue_bad_inputs():
    cs = make_cos_sin_cache(10)
    o = torch.randn(3, 16, 512).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="o: .*multiple of 8"):
        rope_mxfp8_epilogue(torch.randn(3, 12, 512).to(torch.bfloat16), pos, cs)
    with pytest.raises(TypeError, match="o"):
        rope_mxfp8_epilogue(o.to(torch.int16), pos, cs)
    with pytest.raises(ValueError, match="layout"):
        rope_mxfp8_epilogue(o, pos, cs, layout="mixed")
    with pytest.raises(ValueError, match="positions"):
        rope_mxfp8_epilogue(o, pos[:2], cs)
    data, scale = alloc_mxfp8_output(3, 2)
    with pytest.raises(ValueError, match="scale: expected MN-major TMA-aligned strides"):
        rope_mxfp8_epilogue(o, pos, cs, data=data, scale=torch.empty(3, 2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale: expected MN-major TMA-aligned strides"):
        # MN-major but the dim-2 stride (3) is not TMA-aligned (a multiple of 4)
        s3 = torch.empty(2 * 32 * 3, dtype=torch.int32).as_strided((3, 2, 32), (1, 96, 3))
        rope_mxfp8_epilogue(o, pos, cs, data=data, scale=s3)
    with pytest.raises(TypeError, match="scale"):
        rope_mxfp8_epilogue(o, pos, cs, data=data, scale=scale.to(torch.int64))
    with pytest.raises(TypeError, match="data"):
        rope_mxfp8_epilogue(o, pos, cs, data=torch.empty(3, 2, 4096, dtype=torch.bfloat16), scale=scale)
    with pytest.raises(ValueError, match="data"):
        rope_mxfp8_epilogue(o, pos, cs, data=torch.empty(3, 1, 4096, dtype=torch.float8_e4m3fn), scale=scale)
    with pytest.raises(ValueError, match="scale"):
        rope_mxfp8_epilogue(o, pos, cs, data=data, scale=alloc_mxfp8_output(3, 1)[1])
    with pytest.raises(TypeError, match="x"):
        mxfp8_quantize(torch.zeros(3, 2, 4096, dtype=torch.int32))
    with pytest.raises(ValueError, match="x"):
        mxfp8_quantize(torch.zeros(3, 2, 512))


def test_bad_input_leaves_buffers_untouched():
    cs = make_cos_sin_cache(10)
    o = torch.randn(3, 16, 512).to(torch.bfloat16)
    data, scale = alloc_mxfp8_output(3, 2)
    poison_(data)
    with pytest.raises(ValueError):
        rope_mxfp8_epilogue(o, torch.tensor([0, 1]), cs, data=data, scale=scale)
    assert (data.view(torch.uint8) == 0x7F).all()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["standard", "interleaved"])
def test_epilogue_large_gpu(layout):
    T, H = 8191, 64
    cs = make_cos_sin_cache(65536, device="cuda")
    o = torch.randn(T, H, 512, device="cuda").to(torch.bfloat16)
    pos = torch.randint(0, 65536, (T,), device="cuda")
    data, scale, storage = _alloc_poisoned(T, H // 8, "cuda")
    rope_mxfp8_epilogue(o, pos, cs, layout, data, scale)
    assert_mxfp8_equal(data, scale, *rope_mxfp8_epilogue_ref(o.cpu(), pos.cpu(), cs.cpu(), layout))
    assert _padding_untouched(scale, storage, T)


@pytest.mark.gpu
def test_mxfp8_quantize_large_gpu():
    T, G = 4097, 8
    x = _random_groups(T, G, "cuda", torch.bfloat16)
    data, scale, storage = _alloc_poisoned(T, G, "cuda")
    mxfp8_quantize(x, data, scale)
    assert_mxfp8_equal(data, scale, *mxfp8_quantize_ref(x.cpu()))
    assert _padding_untouched(scale, storage, T)


def test_epilogue_writes_a_token_slice_of_a_step_buffer(device):
    """A token-range slice of a bigger step buffer is accepted and written in place; the rows
    around it stay untouched."""
    cs = make_cos_sin_cache(10, device=device)
    o = torch.randn(3, 16, 512).to(torch.bfloat16).to(device)
    pos = torch.tensor([0, 1, 9], device=device)
    d5, s5 = alloc_mxfp8_output(5, 2, device)
    poison_(d5), poison_(s5)
    rope_mxfp8_epilogue(o, pos, cs, data=d5[1:4], scale=s5[1:4])
    ref_d, ref_s = rope_mxfp8_epilogue(o, pos, cs)
    assert torch.equal(s5[1:4], ref_s)
    assert torch.equal(d5[1:4].view(torch.uint8), ref_d.view(torch.uint8))
    for t in (0, 4):
        assert (d5[t].view(torch.uint8) == 0x7F).all() and (s5[t] == -123456789).all()
