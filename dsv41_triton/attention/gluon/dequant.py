"""Record dequantization shared by the Gluon decode kernels: a ring stage's raw bytes (e4m3 with
UE8M0 scales for 584 / 528 records, e2m1 with e4m3 scales for 288) -> exact bf16 key tiles, or
the fp16-operand form (``F16``) with the scales as powers of two; the inline PTX of each
conversion.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gather import _copy_layout, _pick, _put


# four e4m3 bytes -> four bf16 (two bf16x2), each * its fp32 scale: ``cvt`` to f16x2 (exact, NaN
# kept), each half to fp32, one multiply, one rounding pack (exact: an e4m3 value has at most 4
# significant bits, times a power of two)
_E4M3_ASM = gl.constexpr("""{
.reg .b16 lo, hi, a0, a1, a2, a3;
.reg .b32 h0, h1;
.reg .f32 f0, f1, f2, f3;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 h0, lo;
cvt.rn.f16x2.e4m3x2 h1, hi;
mov.b32 {a0, a1}, h0;
mov.b32 {a2, a3}, h1;
cvt.f32.f16 f0, a0;
cvt.f32.f16 f1, a1;
cvt.f32.f16 f2, a2;
cvt.f32.f16 f3, a3;
mul.f32 f0, f0, $3;
mul.f32 f1, f1, $4;
mul.f32 f2, f2, $5;
mul.f32 f3, f3, $6;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}""")

# four e2m1 bytes -> two results of four bf16 each: the low-nibble elements (even dims) and the
# high-nibble ones (odd dims) of bytes 0..3, each * its scale. The magnitude codes index byte
# tables of the bf16 values {0, .5, 1, 1.5, 2, 3, 4, 6} through prmt (high bytes t0/t1, low
# bytes t2/t3); a nibble's sign (bit 3) is already at bit 7 of its byte's slot in the
# high-byte results (low nibbles after one shift), so one masked or signs four values.
_E2M1_ASM = gl.constexpr("""{
.reg .b32 w, x, y, sl, sh, hl, ll, hh, lh, z, t0, t1, t2, t3;
mov.b32 w, $4;
mov.b32 z, 0;
mov.b32 t0, 0x3F3F3F00;
mov.b32 t1, 0x40404040;
mov.b32 t2, 0xC0800000;
mov.b32 t3, 0xC0804000;
and.b32 x, w, 0x07070707;
shr.b32 y, x, 4;
or.b32 x, x, y;
prmt.b32 sl, x, z, 0x0020;
shr.b32 x, w, 4;
and.b32 x, x, 0x07070707;
shr.b32 y, x, 4;
or.b32 x, x, y;
prmt.b32 sh, x, z, 0x0020;
prmt.b32 hl, t0, t1, sl;
prmt.b32 ll, t2, t3, sl;
prmt.b32 hh, t0, t1, sh;
prmt.b32 lh, t2, t3, sh;
shl.b32 x, w, 4;
and.b32 x, x, 0x80808080;
or.b32 hl, hl, x;
and.b32 x, w, 0x80808080;
or.b32 hh, hh, x;
prmt.b32 y, ll, hl, 0x5140;
mul.rn.bf16x2 $0, y, $5;
prmt.b32 y, ll, hl, 0x7362;
mul.rn.bf16x2 $1, y, $6;
prmt.b32 y, lh, hh, 0x5140;
mul.rn.bf16x2 $2, y, $5;
prmt.b32 y, lh, hh, 0x7362;
mul.rn.bf16x2 $3, y, $6;
}""")

# fp16 operands (``F16``): an e4m3 byte pair -> f16x2 in one ``cvt`` (every e4m3 value, NaN
# included, is exact in fp16), times a per-key power-of-two factor (exact unless the product is
# an fp16 subnormal).
_E4M3_F16_ASM = gl.constexpr("""{
.reg .b16 lo, hi;
.reg .b32 t0, t1;
mov.b32 {lo, hi}, $2;
cvt.rn.f16x2.e4m3x2 t0, lo;
cvt.rn.f16x2.e4m3x2 t1, hi;
mul.rn.f16x2 $0, t0, $3;
mul.rn.f16x2 $1, t1, $4;
}""")

# fp16 operands: four e2m1 bytes b0..b3 -> eight fp16 in dim order, two results of two f16x2:
# (lo(b0), hi(b0)), (lo(b1), hi(b1)) and the same for b2, b3, each * its fp16 scale. A nibble
# (sign, 3 magnitude bits) is an fp16 bit pattern once its magnitude bits sit at bits 9..11 and
# its sign at bit 15: the value * 2**-14 (code 1 is the subnormal 0.5 * 2**-14); the 2**14 is
# in the scale. prmt puts b and b >> 4 into the two halves, two shifts and two masks do the rest.
def _e2m1_f16_asm() -> str:
    """The PTX of ``_E2M1_F16_ASM``: per byte ``b0..b3``, its ``prmt`` selector (the byte and
    its high nibble into the two halves), its result and its scale operand."""
    lines = ["{", ".reg .b32 w4, t, m, s;", "shr.b32 w4, $4, 4;"]
    for sel, out, scale in (("0x0400", 0, 5), ("0x1511", 1, 5), ("0x2622", 2, 6),
                            ("0x3733", 3, 6)):
        lines += [f"prmt.b32 t, $4, w4, {sel};", "shl.b32 m, t, 9;", "shl.b32 s, t, 12;",
                  "and.b32 m, m, 0x0E000E00;", "and.b32 s, s, 0x80008000;", "or.b32 t, m, s;",
                  f"mul.rn.f16x2 ${out}, t, ${scale};"]
    return "\n".join(lines + ["}"])

_E2M1_F16_ASM = gl.constexpr(_e2m1_f16_asm())

#: F16: the exponent an e2m1 block counts as (its tiles hold ``value * 2**-14 * scale``)
E2M1_EXP = gl.constexpr(141)

#: F16: the smallest running scale exponent (a UE8M0 byte): key tiles hold ``value * 2**(127 -
#: R)`` with ``R = max(R_MIN, block maxima so far)``; the RoPE ``p`` is scaled by at most
#: ``2**(127 - R_MIN)``
R_MIN = gl.constexpr(96)


@gluon.constexpr_function
def _rows_per_lane_layout(w, nw):
    """[64, w] tiles (w = 8 or 16 scale bytes per key) read whole by every warp: lane ``l``
    holds rows ``l`` and ``l + 32``, all ``w`` columns; warps replicate (a max over the tile
    needs no cross-warp step)."""
    reg = [[0, 1 << i] for i in range(w.bit_length() - 1)] + [[32, 0]]
    lane = [[1 << i, 0] for i in range(5)]
    warp = [[0, 0] for _ in range(nw.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [64, w])


@gluon.jit
def _ue8m0_f32(b):
    """UE8M0 byte tensor -> fp32 ``2**(b - 127)`` (byte 0 -> 0, 255 -> inf)."""
    return (b.to(gl.int32) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _e4m3_bf16(b):
    """e4m3 byte tensor -> its bf16 value (exact; 0x7F / 0xFF -> NaN)."""
    bi = b.to(gl.int32)
    bits = ((bi & 0x7F) << 20) | ((bi & 0x80) << 24)
    v = bits.to(gl.float32, bitcast=True) * 1.329227995784916e36
    return gl.where((bi & 0x7F) == 0x7F, float("nan"), v).to(gl.bfloat16)


@gluon.jit
def _load_group(g: gl.constexpr, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s,
                SRC: gl.constexpr, NW: gl.constexpr):
    """Group ``g``'s raw bytes and scale bytes of stage ``s`` in registers (``_convert_group``'s
    input): separate from the conversion so that a caller can load group ``g + 1`` before it
    converts and stores group ``g`` (shared loads and stores are not reordered by ptxas)."""
    L16: gl.constexpr = _copy_layout(16, NW)
    if SRC == 288:
        L8: gl.constexpr = _copy_layout(8, NW)
        tile = _pick(g // 2, r0, r1, r2, r3, r4, r5, r6, r7).index(s)
        raw = gl.reshape(tile.slice((g % 2) * 32, 32, dim=1).load(L8), [64, 4, 8])
        sb = scale_s.slice(4 * g, 4, dim=1).load(gl.SliceLayout(2, raw.type.layout))
    elif SRC == 584 and g == 7:
        raw = rope_ring.index(s).load(L16)
        sb = raw
    else:
        raw = _pick(g, r0, r1, r2, r3, r4, r5, r6, r7).index(s).load(L16)
        if SRC == 584:
            sb = scale_s.slice(g, 1, dim=1).load(L16)
        else:
            raw = gl.reshape(raw, [64, 2, 32])
            sb = scale_s.slice(2 * g, 2, dim=1).load(gl.SliceLayout(2, raw.type.layout))
    return raw, sb


@gluon.jit
def _convert_group(g: gl.constexpr, raw, sb, SRC: gl.constexpr, NW: gl.constexpr):
    """``_load_group``'s registers -> exact bf16 ``[64 keys, 64]`` in ``_copy_layout(16, NW)``
    (584: group 7 is the raw RoPE tail already)."""
    L16: gl.constexpr = _copy_layout(16, NW)
    if SRC == 288:
        # a thread's 8 bytes are the 16 dims of one e4m3 scale: viewed as [64 keys, 4 scale
        # groups, 8 bytes] the scale broadcasts (no per-element selects)
        sc = gl.broadcast(gl.expand_dims(_e4m3_bf16(sb), 2), raw)[0]
        lo, hi = gl.inline_asm_elementwise(_E2M1_ASM, "=r,=r,=r,=r,r,r,r", [raw, sc],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True,
                                           pack=4)
        x = gl.convert_layout(gl.reshape(gl.join(lo, hi), [64, 64]), L16)
    elif SRC == 584 and g == 7:
        x = raw
    elif SRC == 584:
        sc = gl.broadcast(_ue8m0_f32(sb), raw)[0]
        x = gl.inline_asm_elementwise(_E4M3_ASM, "=r,=r,r,r,r,r,r", [raw, sc],
                                      dtype=gl.bfloat16, is_pure=True, pack=4)
    else:
        # 528: two scales per 64 dims; a thread's 16 bytes lie in one half
        sc = gl.broadcast(gl.expand_dims(_ue8m0_f32(sb), 2), raw)[0]
        x = gl.inline_asm_elementwise(_E4M3_ASM, "=r,=r,r,r,r,r,r", [raw, sc],
                                      dtype=gl.bfloat16, is_pure=True, pack=4)
        x = gl.convert_layout(gl.reshape(x, [64, 64]), L16)
    return x


@gluon.jit
def _dequant_group(g: gl.constexpr, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s,
                   SRC: gl.constexpr, NW: gl.constexpr):
    """Group ``g`` (64 dims) of stage ``s`` (records ``SRC``) as exact bf16 ``[64 keys, 64]``
    registers in ``_copy_layout(16, NW)`` (584: group 7 is the raw RoPE tail of the ring)."""
    raw, sb = _load_group(g, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_s, SRC, NW)
    return _convert_group(g, raw, sb, SRC, NW)


@gluon.jit
def _dequant(s, r0, r1, r2, r3, r4, r5, r6, r7, rope_s, scale_s, k0, k1, k2, k3, k4, k5, k6,
             SRC: gl.constexpr, NW: gl.constexpr):
    """Raw bytes of one stage -> bf16 key tiles: groups 0..6 into ``k0..k6``, group 7 into
    ``rope_s`` (for 584 records cp.async already put the raw bf16 tail there)."""
    NG: gl.constexpr = 7 if SRC == 584 else 8
    for g in gl.static_range(NG):
        x = _dequant_group(g, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_s, scale_s, SRC, NW)
        _put(x, g, k0, k1, k2, k3, k4, k5, k6, rope_s)


@gluon.jit
def _exp2i(d):
    """fp32 ``2**d`` for int32 ``d <= 127`` (0 below ``2**-126``)."""
    return (gl.maximum(d + 127, 0) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _block_exp(scale_s, SRC: gl.constexpr, NW: gl.constexpr):
    """The largest UE8M0 scale byte of one stage's 64 keys (584: the 7 real ones of 8; 528: all
    16; keys not read were zero-filled) as an int32 scalar; every warp reduces the whole tile."""
    W: gl.constexpr = 8 if SRC == 584 else 16
    LE: gl.constexpr = _rows_per_lane_layout(W, NW)
    e = scale_s.slice(0, W, dim=1).load(LE).to(gl.int32)
    if SRC == 584:
        c = gl.arange(0, W, layout=gl.SliceLayout(0, LE))
        e = gl.where((c < 7)[None, :], e, 0)
    return gl.max(gl.max(e, axis=1), axis=0)


@gluon.jit
def _dequant_f16(s, r0, r1, r2, r3, r4, r5, r6, r7, scale_s, k0, k1, k2, k3, k4, k5, k6, k7,
                 R, SRC: gl.constexpr, NW: gl.constexpr):
    """Raw bytes of one stage -> fp16 key tiles ``k0..k7`` holding ``value * 2**(127 - R)``
    (584: groups 0..6 only; the RoPE tail stays bf16). e4m3 data: ``cvt`` to fp16 and one
    multiply by ``2**(scale byte - R)`` (<= 1); e2m1 data: ``value * 2**-14`` from bit moves,
    times its e4m3 scale * ``2**(E2M1_EXP - R)`` (exact: every product is a multiple of
    ``2**-24``, the smallest fp16 subnormal, and below ``2688 * 2**-14``)."""
    L16: gl.constexpr = _copy_layout(16, NW)
    if SRC == 288:
        L8: gl.constexpr = _copy_layout(8, NW)
        f = _exp2i(E2M1_EXP - R)
        for g in gl.static_range(8):
            tile = _pick(g // 2, r0, r1, r2, r3, r4, r5, r6, r7).index(s)
            raw = gl.reshape(tile.slice((g % 2) * 32, 32, dim=1).load(L8), [64, 4, 8])
            sb = scale_s.slice(4 * g, 4, dim=1).load(gl.SliceLayout(2, raw.type.layout))
            sc = (sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * f).to(gl.float16)
            sc = gl.broadcast(gl.expand_dims(sc, 2), raw)[0]
            # a thread's 8 bytes (16 dims): ``a`` holds dims 0..3 and 8..11, ``b`` 4..7, 12..15
            a, b = gl.inline_asm_elementwise(_E2M1_F16_ASM, "=r,=r,=r,=r,r,r,r", [raw, sc],
                                             dtype=(gl.float16, gl.float16), is_pure=True,
                                             pack=4)
            x = gl.join(gl.reshape(a, [64, 4, 2, 4]), gl.reshape(b, [64, 4, 2, 4]))
            x = gl.reshape(gl.permute(x, (0, 1, 2, 4, 3)), [64, 64])
            _put(gl.convert_layout(x, L16), g, k0, k1, k2, k3, k4, k5, k6, k7)
    else:
        NG: gl.constexpr = 7 if SRC == 584 else 8
        for g in gl.static_range(NG):
            raw = _pick(g, r0, r1, r2, r3, r4, r5, r6, r7).index(s).load(L16)
            if SRC == 584:
                sb = scale_s.slice(g, 1, dim=1).load(L16)
                sc = gl.broadcast(_exp2i(sb.to(gl.int32) - R).to(gl.float16), raw)[0]
                x = gl.inline_asm_elementwise(_E4M3_F16_ASM, "=r,=r,r,r,r", [raw, sc],
                                              dtype=gl.float16, is_pure=True, pack=4)
            else:
                raw3 = gl.reshape(raw, [64, 2, 32])
                sb = scale_s.slice(2 * g, 2, dim=1).load(gl.SliceLayout(2, raw3.type.layout))
                sc = _exp2i(sb.to(gl.int32) - R).to(gl.float16)
                sc = gl.broadcast(gl.expand_dims(sc, 2), raw3)[0]
                x = gl.inline_asm_elementwise(_E4M3_F16_ASM, "=r,=r,r,r,r", [raw3, sc],
                                              dtype=gl.float16, is_pure=True, pack=4)
                x = gl.convert_layout(gl.reshape(x, [64, 64]), L16)
            _put(x, g, k0, k1, k2, k3, k4, k5, k6, k7)


@gluon.jit
def _prep_f16(s, r0, r1, r2, r3, r4, r5, r6, r7, scale_s, k0, k1, k2, k3, k4, k5, k6, k7, R,
              SRC: gl.constexpr, NW: gl.constexpr):
    """One stage of ``SRC`` records -> the new running exponent ``R`` (int32 scalar) and the
    fp16 key tiles in its units (e2m1 blocks count as ``E2M1_EXP``)."""
    if SRC == 288:
        R = gl.maximum(R, E2M1_EXP)
    else:
        R = gl.maximum(R, _block_exp(scale_s, SRC, NW))
    _dequant_f16(s, r0, r1, r2, r3, r4, r5, r6, r7, scale_s, k0, k1, k2, k3, k4, k5, k6, k7, R,
                 SRC, NW)
    return R
