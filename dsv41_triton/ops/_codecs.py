"""Element-wise Triton codecs shared by every kernel that reads or writes records.

All helpers work on tiles of any shape. ``SW`` (constexpr) selects a software path that is
bit-exact in Triton's CPU interpreter: there (triton 3.9, numpy 2) fp32->e4m3 casts mis-round
(subnormals, mantissa carries) and fp32->bf16 casts truncate instead of rounding to nearest
even. Hosts pass ``SW=is_interpreter()``; on a GPU the hardware conversions are used, and the
GPU tests check they are bit-equal to the same reference.

The e4m3 conversions need hardware that has them (CUDA sm_89 and later; Triton's ROCm backend
converts them itself). Compiling for an older CUDA GPU (A100, sm_80) they take a software path,
chosen at compile time from the target (``fp8_in_software``; the same path the interpreter
runs, so the CPU tests check it bit for bit).

Non-finite inputs follow one rule in every quantizer (and in ``records.py``): NaN and +-inf do
not count in a group's amax; +-inf saturates (e4m3 +-448, e2m1 +-6); NaN is the e4m3 byte 0x7F
(e2m1 code 0).
"""
import os

import triton
import triton.language as tl


#: the kernels of this process run in Triton's interpreter (fixed when they are defined)
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

try:
    from triton.language.target_info import cuda_capability_geq, is_hip
    from triton.runtime.jit import constexpr_function
except ImportError:  # a Triton without target queries: the hardware conversions everywhere
    constexpr_function = None

#: whether ``fp8_in_software`` exists (asked in a constexpr branch, so that the name is only
#: resolved where it does)
_TARGET_INFO = tl.constexpr(constexpr_function is not None)

if constexpr_function is not None:
    @constexpr_function
    def fp8_in_software():
        """True when the compile target has no e4m3 conversions: CUDA before sm_89, or no GPU
        target at all (Triton's interpreter without a GPU)."""
        return not (is_hip() or cuda_capability_geq(8, 9))

    @constexpr_function
    def rocm_target():
        """True when compiling for an AMD GPU (no PTX inline assembly there)."""
        return is_hip()
else:
    fp8_in_software = rocm_target = None


@triton.jit
def _e4m3_bits_to_f32_sw(b):
    """uint8 e4m3 bits -> fp32 through fp16 bits: e4m3 is fp16 with 4 fewer exponent bits, so
    the sign and the 7 magnitude bits moved into fp16's places give the value times 2**-8
    (subnormals included); the NaN bytes 0x7F / 0xFF give NaN."""
    bi = b.to(tl.int32)
    h = ((bi & 0x80) << 8) | ((bi & 0x7F) << 7)
    v = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((bi & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _e4m3_bits_to_f32_hw(b):
    v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if _INTERPRETED:  # numpy's cast gives +-480 for the NaN bytes
        v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return v


@triton.jit
def e4m3_bits_to_f32(b):
    """uint8 e4m3 bits -> fp32, exact; the NaN bytes 0x7F / 0xFF give NaN."""
    if _TARGET_INFO:
        if fp8_in_software():
            return _e4m3_bits_to_f32_sw(b)
        else:
            return _e4m3_bits_to_f32_hw(b)
    else:
        return _e4m3_bits_to_f32_hw(b)


@triton.jit
def _rne_small_int(y):
    """Round fp32 ``0 <= y < 2**22`` to the nearest integer, ties to even (int32)."""
    f = y + 8388608.0  # 2**23: the fp32 add rounds to nearest even
    return f.to(tl.int32, bitcast=True) - 0x4B000000


@triton.jit
def f32_to_e4m3_bits(x, SW: tl.constexpr):
    """fp32 -> uint8 e4m3 bits, round to nearest even, saturating: ``|x| > 448`` (inf
    included) gives +-448 (0x7E / 0xFE). NaN gives 0x7F or 0xFF: callers that take NaN
    inputs fix the byte with :func:`e4m3_nan_fixup`."""
    if SW:
        return _f32_to_e4m3_bits_sw(x)
    elif _TARGET_INFO:
        if fp8_in_software():
            return _f32_to_e4m3_bits_sw(x)
        else:
            # the hardware conversion (cvt.rn.satfinite) saturates to +-448 itself
            return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _f32_to_e4m3_bits_sw(x):
    a = tl.minimum(tl.abs(x), 448.0)
    ab = a.to(tl.int32, bitcast=True)
    E = tl.maximum((ab >> 23) - 127, -6)
    scale = ((130 - E) << 23).to(tl.float32, bitcast=True)  # 2**(3 - E), exact
    n = _rne_small_int(a * scale)
    code = (E + 6) * 8 + n
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def e4m3_nan_fixup(bits, x):
    """The e4m3 byte of every NaN in ``x`` is the positive NaN 0x7F (the codec's rule for
    non-finite inputs, ``records.quantize_ue8m0_groups``)."""
    return tl.where(x != x, tl.full(bits.shape, 127, tl.uint8), bits)


@triton.jit
def finite_abs(x):
    """``|x|`` with NaN and +-inf as 0: what a group's scale is computed from."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)


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
    # the sign goes in by bits: `-mag` may compile to `0 - mag`, which loses the sign of zero
    # (code 8 is -0.0, and the gather must be bit-exact)
    sign = ((c & 8) != 0).to(tl.int32) << 31
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_e2m1_code(y):
    """fp32 -> e2m1 code (int32): nearest, ties to even code, saturating; sign for y < 0."""
    a = tl.abs(y)
    m = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
         + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
         + (a > 5.0).to(tl.int32))
    return m | ((y < 0).to(tl.int32) << 3)


@triton.jit
def bf16_to_f32(x, SW: tl.constexpr):
    """bf16 -> fp32, exact. The interpreter's cast flushes bf16 subnormals to zero; the SW path
    widens the bits instead."""
    if SW:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def ue8m0_to_f32(b):
    """UE8M0 scale byte (any int dtype, 0..255) -> fp32 ``2**(b - 127)``, exact for every byte:
    byte 0 gives the subnormal ``2**-127``, byte 255 gives ``inf`` (as ``torch.ldexp`` does)."""
    bi = b.to(tl.int32)
    return tl.where(bi == 0, 0x00400000, bi << 23).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_quantize_groups(x, AMAX_FLOOR: tl.constexpr, SW: tl.constexpr):
    """Per-group UE8M0 quantization of an fp32 tile ``x [A, G, S]`` (one group = the last axis).

    Returns ``(bits, e)``: e4m3 bits uint8 ``[A, G, S]`` of ``clamp(x * 2**-e, -448, 448)``
    (nearest even) and the int32 exponents ``e [A, G]`` with
    ``e = ceil(log2(max(max|x|, AMAX_FLOOR) / 448))``; the scale byte is ``e + 127``.
    """
    amax = tl.maximum(tl.max(finite_abs(x), axis=2), AMAX_FLOOR)
    e = ue8m0_exponent(amax)
    y = x * exp2_int(-e)[:, :, None]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return e4m3_nan_fixup(f32_to_e4m3_bits(y, SW), x), e


@triton.jit
def nvfp4_quantize_groups(x, SW: tl.constexpr):
    """NVFP4 quantization of an fp32 tile ``x [A, G, S]`` (S even; one group = the last axis).

    ``s = e4m3(clamp(max|x| / 6, 2**-9, 448))``, codes ``e2m1(x / s)`` (IEEE divisions).
    Returns ``(packed, s_bits)``: uint8 ``[A, G, S // 2]`` with the even element in the low
    nibble, and the e4m3 scale bits uint8 ``[A, G]``.
    """
    amax = tl.max(finite_abs(x), axis=2)
    s = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    s = tl.minimum(tl.maximum(s, 0.001953125), 448.0)  # 2**-9 .. 448
    s_bits = f32_to_e4m3_bits(s, SW)
    sf = e4m3_bits_to_f32(s_bits)
    y = tl.math.div_rn(x, tl.broadcast_to(sf[:, :, None], x.shape))
    c = f32_to_e2m1_code(y)
    lo, hi = tl.split(tl.reshape(c, [x.shape[0], x.shape[1], x.shape[2] // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8), s_bits
