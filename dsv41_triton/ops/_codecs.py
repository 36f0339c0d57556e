"""Element-wise Triton codecs shared by every kernel that reads or writes records.

All helpers work on tiles of any shape. ``SW`` (constexpr) selects a software path that is
bit-exact in Triton's CPU interpreter: there (triton 3.9, numpy 2) fp32->e4m3 casts mis-round
(subnormals, mantissa carries) and fp32->bf16 casts truncate instead of rounding to nearest
even. Hosts pass ``SW=is_interpreter()``; on a GPU the hardware conversions are used, and the
GPU tests check they are bit-equal to the same reference.
"""
import triton
import triton.language as tl


@triton.jit
def e4m3_bits_to_f32(b):
    """uint8 e4m3 bits -> fp32 (exact)."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _rne_small_int(y):
    """Round fp32 ``0 <= y < 2**22`` to the nearest integer, ties to even (int32)."""
    f = y + 8388608.0  # 2**23: the fp32 add rounds to nearest even
    return f.to(tl.int32, bitcast=True) - 0x4B000000


@triton.jit
def f32_to_e4m3_bits(x, SW: tl.constexpr):
    """fp32 (|x| <= 448, finite) -> uint8 e4m3 bits, round to nearest even."""
    if SW:
        a = tl.abs(x)
        ab = a.to(tl.int32, bitcast=True)
        E = tl.maximum((ab >> 23) - 127, -6)
        scale = ((130 - E) << 23).to(tl.float32, bitcast=True)  # 2**(3 - E), exact
        n = _rne_small_int(a * scale)
        code = (E + 6) * 8 + n
        sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
        return (code | (sign << 7)).to(tl.uint8)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def f32_to_bf16(x, SW: tl.constexpr):
    """fp32 -> bf16, round to nearest even (finite inputs)."""
    if SW:
        b = x.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return r.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def ue8m0_exponent(amax):
    """Exact ``ceil(log2(amax / 448))`` (int32) for positive normal fp32 ``amax``."""
    b = amax.to(tl.int32, bitcast=True)
    return ((b >> 23) & 0xFF) - 135 + ((b & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def exp2_int(e):
    """Exact fp32 ``2**e`` for int32 ``e`` in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_code_to_f32(c):
    """4-bit e2m1 code (int, bit 3 = sign) -> fp32 in {0, ±0.5, ..., ±6}."""
    m = c & 7
    ex = m >> 1
    mag = tl.where(ex == 0, (m & 1).to(tl.float32) * 0.5,
                   exp2_int(ex - 1) * (1.0 + (m & 1).to(tl.float32) * 0.5))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def f32_to_e2m1_code(y):
    """fp32 -> e2m1 code (int32): nearest, ties to even code, saturating; sign for y < 0."""
    a = tl.abs(y)
    m = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
         + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
         + (a > 5.0).to(tl.int32))
    return m | ((y < 0).to(tl.int32) << 3)
