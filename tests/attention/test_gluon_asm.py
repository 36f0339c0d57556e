"""The Gluon decode kernels' inline-asm dequantizers (``gluon/dequant.py``) against plain decodes,
bit for bit, on the CPU: their PTX runs in a small emulator (``ptx_emu.py``), every byte value
and every scale byte included."""
import numpy as np
import pytest
import torch

from dsv41_triton.attention.gluon import dequant as gd
from dsv41_triton.ops.records import E2M1_VALUES

from ptx_emu import run

RNG = np.random.default_rng(0)


def _bits(x: torch.Tensor, dtype=torch.bfloat16) -> np.ndarray:
    """``x`` rounded to ``dtype`` (a 16-bit float), its bit patterns as uint32."""
    return x.to(dtype).view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return _bits(x, torch.bfloat16)


def _f16_bits(x: torch.Tensor) -> np.ndarray:
    return _bits(x, torch.float16)


def _same(got: np.ndarray, want: np.ndarray, dtype=torch.bfloat16) -> bool:
    """Equal pairs of ``dtype`` values (bit for bit), any NaN matching any NaN."""
    for sh in (0, 16):
        g = torch.from_numpy(((got >> sh) & 0xFFFF).astype(np.int16)).view(dtype)
        w = torch.from_numpy(((want >> sh) & 0xFFFF).astype(np.int16)).view(dtype)
        nan = torch.isnan(g) & torch.isnan(w)
        if not bool(((g.view(torch.int16) == w.view(torch.int16)) | nan).all()):
            return False
    return True


def _same_f16(got: np.ndarray, want: np.ndarray) -> bool:
    return _same(got, want, torch.float16)


def _e4m3_scales():
    """Every e4m3 scale byte as bf16 bits (0x7F / 0xFF: NaN)."""
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    return _bf16_bits(b.to(torch.float32))


#: code (bit 3 = sign) -> value
E2M1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def _e2m1_inputs(n):
    """Words whose first two bytes run over every pair (the rest random), random scales."""
    pairs = np.arange(1 << 16, dtype=np.uint32)
    w = np.concatenate([pairs | (RNG.integers(0, 1 << 16, pairs.size, dtype=np.uint32) << 16),
                        RNG.integers(0, 1 << 32, n, dtype=np.uint32)])
    sc = _e4m3_scales()
    s = sc[RNG.integers(0, 256, (4, w.size))]
    return w, s


def _e2m1_want(w, s):
    """bf16 bits of (low nibbles of bytes 0..3) * s and (high nibbles) * s, as bf16x2 pairs."""
    b = [(w >> (8 * k)) & 0xFF for k in range(4)]
    sf = [torch.from_numpy((x << 16).astype(np.uint32).view(np.float32).copy()) for x in s]

    def val(code, k):
        return _bf16_bits(E2M1[torch.from_numpy(code.astype(np.int64))] * sf[k])

    lo = [val(b[k] & 0xF, k) for k in range(4)]
    hi = [val(b[k] >> 4, k) for k in range(4)]
    return [lo[0] | lo[1] << 16, lo[2] | lo[3] << 16, hi[0] | hi[1] << 16, hi[2] | hi[3] << 16]


@pytest.mark.parametrize("asm_name", ["_E2M1_ASM"])
def test_e2m1_asm_matches_decode(asm_name):
    """Every e2m1 code pair (and random words) times every e4m3 scale: exact bf16."""
    w, s = _e2m1_inputs(1 << 16)
    got = run(getattr(gd, asm_name).value, [w, s[0] | (s[1] << 16), s[2] | (s[3] << 16)], 4)
    want = _e2m1_want(w, s)
    for k in range(4):
        assert _same(got[k], want[k]), (asm_name, k)


def test_e4m3_asm_matches_decode():
    """Every e4m3 byte in every position times UE8M0 scales 2**-127 .. 2**127 (and +inf):
    exact bf16, NaN kept."""
    n = 1 << 16
    w = np.concatenate([np.arange(256, dtype=np.uint32) * 0x01010101,
                        RNG.integers(0, 1 << 32, n, dtype=np.uint32)])
    e = RNG.integers(0, 256, (4, w.size)).astype(np.uint32)
    e[:, :256] = np.arange(256)
    scale = np.where(e == 0, 0, np.where(e == 255, 0x7F800000, e << 23)).astype(np.uint32)
    got = run(gd._E4M3_ASM.value, [w] + [scale[k] for k in range(4)], 2)
    b = [torch.from_numpy(((w >> (8 * k)) & 0xFF).astype(np.uint8)).view(torch.float8_e4m3fn)
         for k in range(4)]
    v = [_bf16_bits(b[k].to(torch.float32) * torch.from_numpy(scale[k].view(np.float32).copy()))
         for k in range(4)]
    assert _same(got[0], v[0] | v[1] << 16) and _same(got[1], v[2] | v[3] << 16)


def test_emulator_refuses_unmodelled_instructions():
    with pytest.raises(NotImplementedError):
        run("{ add.u32 $0, $1, $1; }", [np.zeros(4, dtype=np.uint32)], 1)


def _f16_scales(n):
    """fp16 scales as the F16 kernels form them: e4m3 values (every byte, NaN included) or
    powers of two, times 2**-k (k = 0..12: subnormal and zero products included)."""
    b = torch.from_numpy(RNG.integers(0, 256, n).astype(np.uint8)).view(torch.float8_e4m3fn)
    v = torch.where(torch.from_numpy(RNG.random(n) < 0.5), b.to(torch.float32),
                    torch.exp2(torch.from_numpy(RNG.integers(-20, 1, n)).float()))
    v = v * torch.exp2(-torch.from_numpy(RNG.integers(0, 13, n)).float())
    return _f16_bits(v), v.to(torch.float16).to(torch.float64)


def test_e4m3_f16_asm_matches_decode():
    """fp16 operands: every e4m3 byte in every position times fp16 scales, one rounding."""
    n = 1 << 16
    w = np.concatenate([np.arange(256, dtype=np.uint32) * 0x01010101,
                        RNG.integers(0, 1 << 32, n, dtype=np.uint32)])
    sb, sv = zip(*(_f16_scales(w.size) for _ in range(4)))
    got = run(gd._E4M3_F16_ASM.value, [w, sb[0] | sb[1] << 16, sb[2] | sb[3] << 16], 2)
    b = [torch.from_numpy(((w >> (8 * k)) & 0xFF).astype(np.uint8)).view(torch.float8_e4m3fn)
         for k in range(4)]
    v = [_f16_bits(b[k].to(torch.float64) * sv[k]) for k in range(4)]
    assert _same_f16(got[0], v[0] | v[1] << 16) and _same_f16(got[1], v[2] | v[3] << 16)


def test_e2m1_f16_asm_matches_decode():
    """fp16 operands: byte k's (low, high) nibble as ``value * 2**-14`` times the word's fp16
    scale (the kernels give a thread's bytes one scale), every code pair, one rounding."""
    w, _ = _e2m1_inputs(1 << 16)
    sb, sv = _f16_scales(w.size)
    got = run(gd._E2M1_F16_ASM.value, [w, sb | sb << 16, sb | sb << 16], 4)
    e2m1 = E2M1.to(torch.float64) * 2.0 ** -14
    for k in range(4):
        byte = torch.from_numpy(((w >> (8 * k)) & 0xFF).astype(np.int64))
        lo = _f16_bits(e2m1[byte & 0xF] * sv)
        hi = _f16_bits(e2m1[byte >> 4] * sv)
        assert _same_f16(got[k], lo | hi << 16), k
