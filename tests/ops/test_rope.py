"""apply_rope (Triton) vs apply_rope_ref (PyTorch), SPEC §2."""
import pytest
import torch

from dsv41_triton._utils import is_interpreter
from dsv41_triton.ops.rope import apply_rope
from dsv41_triton.ops.rope_ref import apply_rope_ref, make_cos_sin_cache, rope_rotate_ref
from dsv41_triton.testing import poison_


def _ordinal(t: torch.Tensor) -> torch.Tensor:
    """Monotone integer ordinal of bf16/fp32 bit patterns (+0 and -0 both 0)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        b = t.view(torch.int16).to(torch.int64)
        mag = b & 0x7FFF
        return torch.where(b < 0, -mag, mag)
    b = t.view(torch.int32).to(torch.int64)
    mag = b & 0x7FFFFFFF
    return torch.where(b < 0, -mag, mag)


def assert_close_ulp(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, max_ulp: int = 1):
    """Bit-equal under the interpreter (no FMA contraction there). On a GPU, fused multiply-adds
    round ``a*cos - b*sin`` once instead of twice: within ``max_ulp`` units in the last place,
    plus fp32 rounding (2**-23) of the terms, whose size is bounded by the row's max |x| —
    when the two terms cancel, the result is small and its ulp far below the terms' rounding."""
    assert not torch.isnan(out.float()).any(), "unwritten (NaN) elements"
    d = (_ordinal(out.cpu()) - _ordinal(ref.cpu())).abs()
    if is_interpreter():
        assert d.max().item() == 0, f"not bit-equal: {int((d > 0).sum())} elements differ"
        return
    bad = d > max_ulp
    if bad.any():
        err = (out.double() - ref.double()).abs()
        terms = x.double().abs().amax(-1, keepdim=True) * 2.0**-23
        ulp_ref = ref.double().abs() * torch.finfo(ref.dtype).eps  # eps = 2**-mantissa bits
        ok = err <= max_ulp * ulp_ref + 2 * terms
        assert ok.all(), f"max ulp diff {d.max().item()}, {int((~ok).sum())} elements beyond the FMA bound"


def _positions(T, max_pos, device, dtype=torch.int64, edge=True):
    pos = torch.randint(0, max_pos, (T,), dtype=dtype)
    if edge:
        extra = torch.tensor([0, max_pos - 1, -1, max_pos, 3], dtype=dtype)
        pos[: min(T, 5)] = extra[: min(T, 5)]
    return pos.to(device)


@pytest.mark.parametrize("T,H", [(1, 1), (7, 3), (5, 17)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_matches_ref(device, T, H, inverse):
    cs = make_cos_sin_cache(257, device=device)
    x = (torch.randn(T, H, 512) * 3).to(torch.bfloat16).to(device)
    pos = _positions(T, 257, device)
    out = poison_(torch.empty_like(x))
    res = apply_rope(x, pos, cs, inverse=inverse, out=out)
    assert res is out
    ref = apply_rope_ref(x, pos, cs, inverse=inverse)
    # NoPE dims are a plain copy: always bit-equal
    assert torch.equal(out[..., :448].view(torch.int16), x[..., :448].view(torch.int16))
    assert_close_ulp(out, ref, x)
    # a rotation really happened on the in-range tokens (a test that cannot fail is a defect)
    if T >= 2:
        assert not torch.equal(out[1, :, 448:], x[1, :, 448:])


def test_apply_rope_fp64_oracle(device):
    """The fp32 kernel is within bf16 rounding of a float64 oracle."""
    T, H = 6, 4
    cs = make_cos_sin_cache(64, device=device)
    x = torch.randn(T, H, 512, device=device).to(torch.bfloat16)
    pos = torch.arange(T, device=device) * 9
    out = apply_rope(x, pos, cs)
    ref = apply_rope_ref(x, pos, cs, compute_dtype=torch.float64, out_dtype=torch.float64)
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2.0**-8 + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_rope_int32_positions_other_dtypes(device, dtype):
    T, H = 3, 2
    cs = make_cos_sin_cache(50, device=device)
    x = torch.randn(T, H, 512, device=device).to(dtype)
    pos = torch.tensor([7, 0, 49], dtype=torch.int32, device=device)
    out = apply_rope(x, pos, cs, inverse=True)
    ref = apply_rope_ref(x, pos, cs, inverse=True)
    assert_close_ulp(out, ref, x)


def test_apply_rope_roundtrip(device):
    T, H = 4, 3
    cs = make_cos_sin_cache(100, device=device)
    x = torch.randn(T, H, 512, device=device)
    pos = torch.tensor([1, 17, 99, 50], device=device)
    y = apply_rope(apply_rope(x, pos, cs), pos, cs, inverse=True)
    assert (y - x).abs().max().item() < 1e-5
    assert (apply_rope(x, pos, cs) - x)[..., 448:].abs().max().item() > 1e-2


def test_apply_rope_in_place_and_strided(device):
    T, H = 5, 3
    cs = make_cos_sin_cache(40, device=device)
    big = torch.randn(T, 2 * H, 512, device=device).to(torch.bfloat16)
    x = big[:, ::2]  # strided over heads
    assert not x.is_contiguous()
    pos = _positions(T, 40, device)
    ref = apply_rope_ref(x, pos, cs)
    untouched = big[:, 1::2].clone()
    x_in = x.clone()
    apply_rope(x, pos, cs, out=x)
    assert_close_ulp(x, ref, x_in)
    assert torch.equal(big[:, 1::2], untouched)


def test_apply_rope_out_of_range_positions_identity(device):
    cs = make_cos_sin_cache(10, device=device)
    x = torch.randn(3, 2, 512, device=device).to(torch.bfloat16)
    pos = torch.tensor([-5, 10, 1000], device=device)
    out = apply_rope(x, pos, cs)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))


def test_apply_rope_empty(device):
    cs = make_cos_sin_cache(10, device=device)
    x = torch.empty(0, 4, 512, device=device, dtype=torch.bfloat16)
    assert apply_rope(x, torch.empty(0, dtype=torch.int64, device=device), cs).shape == (0, 4, 512)


def test_rope_rotate_ref_formula():
    """The reference itself against the written SPEC formula on one pair."""
    x = torch.zeros(64, dtype=torch.float64)
    x[0], x[1] = 2.0, 3.0
    c, s = torch.full((32,), 0.6, dtype=torch.float64), torch.full((32,), 0.8, dtype=torch.float64)
    y = rope_rotate_ref(x, c, s)
    assert y[0].item() == pytest.approx(2 * 0.6 - 3 * 0.8) and y[1].item() == pytest.approx(3 * 0.6 + 2 * 0.8)
    z = rope_rotate_ref(x, c, s, inverse=True)
    assert z[0].item() == pytest.approx(2 * 0.6 + 3 * 0.8) and z[1].item() == pytest.approx(3 * 0.6 - 2 * 0.8)


def test_apply_rope_bad_inputs():
    cs = make_cos_sin_cache(10)
    x = torch.randn(2, 2, 512).to(torch.bfloat16)
    pos = torch.tensor([0, 1])
    with pytest.raises(TypeError, match="x"):
        apply_rope(x.to(torch.int32), pos, cs)
    with pytest.raises(ValueError, match="x"):
        apply_rope(x[..., :256], pos, cs)
    with pytest.raises(TypeError, match="positions"):
        apply_rope(x, pos.float(), cs)
    with pytest.raises(ValueError, match="positions"):
        apply_rope(x, pos[:1], cs)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rope(x, pos, cs[:, :32])
    with pytest.raises(TypeError, match="cos_sin_cache"):
        apply_rope(x, pos, cs.double())
    with pytest.raises(TypeError, match="out"):
        apply_rope(x, pos, cs, out=torch.empty(2, 2, 512))
    with pytest.raises(ValueError, match="out"):
        apply_rope(x, pos, cs, out=torch.empty(2, 3, 512, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_apply_rope_large_gpu():
    cs = make_cos_sin_cache(65536, device="cuda")
    x = torch.randn(4096, 64, 512, device="cuda").to(torch.bfloat16)
    pos = torch.randint(0, 65536, (4096,), device="cuda")
    for inverse in (False, True):
        out = poison_(torch.empty_like(x))
        apply_rope(x, pos, cs, inverse=inverse, out=out)
        assert_close_ulp(out, apply_rope_ref(x, pos, cs, inverse=inverse), x)
