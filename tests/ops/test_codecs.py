"""The e4m3 codecs of ``ops/_codecs.py`` against torch's ``float8_e4m3fn``: every byte decoded,
and fp32 values encoded (subnormals, rounding ties, saturation). Without a GPU the software
path runs (the one compiled for GPUs without e4m3 conversions, e.g. A100); on a GPU of sm_89+
the hardware conversions."""
import pytest
import torch
import triton
import triton.language as tl

from dsv41_triton.ops import _codecs as C


@triton.jit
def _decode_kernel(b_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, C.e4m3_bits_to_f32(tl.load(b_ptr + i)))


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, SW: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, C.f32_to_e4m3_bits(tl.load(x_ptr + i, mask=m), SW), mask=m)


def test_every_e4m3_byte_decodes_exactly(device):
    b = torch.arange(256, dtype=torch.uint8, device=device)
    out = torch.full((256,), 12345.0, device=device)
    _decode_kernel[(1,)](b, out, N=256)
    ref = b.view(torch.float8_e4m3fn).float()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan)  # 0x7F and 0xFF
    assert torch.equal(out[~nan], ref[~nan])
    assert torch.equal(torch.signbit(out[~nan]), torch.signbit(ref[~nan]))  # -0.0 is 0x80


@pytest.mark.parametrize("sw", [True, False])
def test_e4m3_encoding_rounds_to_nearest_even_and_saturates(device, sw):
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    every = every[torch.isfinite(every)]
    mids = (every.sort().values[1:] + every.sort().values[:-1]) / 2  # ties between codes
    g = torch.Generator().manual_seed(7)
    rand = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-12, 9, (4096,),
                                                                      generator=g).float())
    x = torch.cat([every, mids, rand, torch.tensor([1e-9, -1e-9, 2.0 ** -10, 2.0 ** -9 * 1.5])])
    x = x[x.abs() <= 448].contiguous()
    out = torch.full(x.shape, 0xA5, dtype=torch.uint8, device=device)
    n = x.numel()
    _encode_kernel[(triton.cdiv(n, 1024),)](x.to(device), out, n, BLOCK=1024, SW=sw)
    ref = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(out.cpu(), ref)
    big = torch.tensor([449.0, 1e6, float("inf"), -464.0, float("-inf")])
    out = torch.zeros(5, dtype=torch.uint8, device=device)
    _encode_kernel[(1,)](big.to(device), out, 5, BLOCK=8, SW=sw)
    assert out.cpu().tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
