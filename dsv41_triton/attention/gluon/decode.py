"""Sparse MLA decode for Hopper in Gluon: ``sparse_mla_decode``'s contract (SPEC §3, §4, §6).

One CTA (one warpgroup, or two with ``NW = 8``) owns ``BH`` heads of one query token and one
key split; it
walks the window keys then the extra keys of its split in blocks of ``BN = 64`` keys through one
online softmax. Per block:

1. **gather** (issued ``NS - 1`` blocks ahead): the block's slot ids (loaded one more block
   ahead, into registers) become byte offsets of each key's data and scale rows; ``cp.async``
   copies the raw record bytes into stage ``k % NS`` of a shared ring: ``[64, 64]`` byte tiles,
   each its own allocation (one per 64 dims; 288 records use four), the scale row (8/16/32 bytes)
   and, for 584 records, the raw bf16 RoPE tail straight into a ``[64, 64]`` bf16 wgmma tile.
   Invalid keys (``< 0``, past ``rows``, past ``len``) copy nothing (zero fill) and are marked
   ``-1`` in the stage's index row.
2. **dequant**: each byte tile becomes exact bf16 in registers (e4m3: ``cvt`` to f16x2, to fp32,
   times the scale, one rounding pack; e2m1 through ``prmt`` byte tables and one multiply by the
   scale) and is stored to its bf16 key tile (NVMMA-swizzled).
3. **swap-AB wgmma**: keys are the MMA's M (64), heads its N (``BH`` = 8/16/32):
   ``S^T [64, BH] = K [64, 512] · Q^T`` (Q resident in shared memory), softmax along M,
   ``O^T_g [64, BH] += K_g^T · P^T`` for each 64-dim group ``g`` (K read transposed from the
   same tile), so few heads do not pay for 64 MMA rows.

Splits write normalized fp32 partials and their log2-sum-exp, combined (with the sink) by the
``tl`` merge kernel. No host sync, fixed launch shapes: CUDA-graph safe.

**One ring stage** (``NS = 1``, 8-head tiles, 4 warps): ~110 KB of shared memory, so two CTAs
share an SM (``launch.ctas_per_sm``) and cover each other's latencies; block ``j + 1``'s
gathers go into the stage as soon as block ``j``'s dequant has read it (584's RoPE tail is
first copied into a key tile of its own), under block ``j``'s products.

**fp16 operands** (``F16``): the key tiles are fp16 and hold ``value * 2**(127 - R)``, where
``R`` is a running maximum (like the softmax max) of the blocks' largest UE8M0 scale byte
(``R_MIN`` at least; e2m1 blocks count as 127): e4m3 bytes become fp16 with one ``cvt`` per two
(exact, NaN kept) and one multiply by ``2**(scale byte - R) <= 1``; e2m1 values times their
e4m3 scale are exact fp16 products. Each head's Q is scaled by a power of two that puts its
amax in ``[2**14, 2**15)`` (no fp16 overflow or underflow) and the logit scale undoes it and
``R``; when ``R`` grows the accumulators are rescaled with the softmax's ``alpha``. ``P`` is fp16
(``p <= 1``). The 584 records' bf16 RoPE tail stays a bf16 wgmma (bf16 Q tail, its own logit
accumulator; ``P * 2**(127 - R)`` in bf16 for the value side). Exact as the bf16 path except
where ``value * 2**(127 - R)`` is an fp16 subnormal: a key whose scale is ``2**14`` or more
below the largest scale seen so far in its split. Record pairs: 584 only or 528/288 only (584
mixed with 528/288 needs a per-block choice of the group-7 wgmma types; that version measured
wrong on the H200 and is refused at compile time; the launch uses bf16 operands there).
"""
from __future__ import annotations


from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .common import _finish_rows


#: keys per block (the wgmma M of the swap-AB products)
BN = 64
#: record width -> (data bytes, scale bytes)
SRC_BYTES = {584: (576, 8), 528: (512, 16), 288: (256, 32)}


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


# ------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _copy_layout(vec, nw):
    """[64, w] copy tiles: ``vec`` elements (16 or 8 bytes) per thread, 4 threads per row,
    ``nw`` warps along the keys."""
    return gl.BlockedLayout([1, vec], [8, 4], [nw, 1], [1, 0])


@gluon.constexpr_function
def _acc_layout(bh, nw):
    """wgmma accumulator ``[64, bh]``: one warpgroup per ``bh * 4 / nw`` heads."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, nw // 4],
                                     instr_shape=[16, bh * 4 // nw, 16])


@gluon.constexpr_function
def _rows_per_lane_layout(w, nw):
    """[64, w] tiles (w = 8 or 16 scale bytes per key) read whole by every warp: lane ``l``
    holds rows ``l`` and ``l + 32``, all ``w`` columns; warps replicate (a max over the tile
    needs no cross-warp step)."""
    reg = [[0, 1 << i] for i in range(w.bit_length() - 1)] + [[32, 0]]
    lane = [[1 << i, 0] for i in range(5)]
    warp = [[0, 0] for _ in range(nw.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [64, w])


# ------------------------------------------------------------------------------------------
# device helpers
# ------------------------------------------------------------------------------------------
@gluon.jit
def _program_ids(num_ht, num_splits):
    """This CTA's (head tile, key split, token) of a grid ``T * num_splits * num_ht`` (head
    tile fastest, then split, then token; the token as int64)."""
    pid = gl.program_id(0)
    rest = pid // num_ht
    return pid % num_ht, rest % num_splits, (rest // num_splits).to(gl.int64)


@gluon.jit
def _alloc_rings(SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
                 NS: gl.constexpr, SCALE_W: gl.constexpr, GROUP7_TILE: gl.constexpr):
    """The raw-record ring of ``NS`` stages: ``[NS, 64 keys, 64]`` byte tiles ``r0..r7`` (as many
    as the record pair needs: 584 7, 528 8, 288 4; the others alias ``r0``), the scale rows
    ``[NS, 64, SCALE_W]``, the bf16 RoPE tiles ``[NS, 64, 64]`` where 584 records are read (else,
    with ``GROUP7_TILE``, one ``[1, 64, 64]`` tile for a dequantized group 7, or an alias of the
    scales) and the slot ids ``[NS, 64]``."""
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    USE_584: gl.constexpr = SRC_A == 584 or (HAS_B and SRC_B == 584)
    USE_528: gl.constexpr = SRC_A == 528 or (HAS_B and SRC_B == 528)
    NRAW: gl.constexpr = 8 if USE_528 else (7 if USE_584 else 4)
    r0 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    r1 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    r2 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    r3 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    if NRAW > 4:
        r4 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
        r5 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
        r6 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    else:
        r4 = r0
        r5 = r0
        r6 = r0
    if NRAW > 7:
        r7 = gl.allocate_shared_memory(gl.uint8, [NS, 64, 64], PLAIN2)
    else:
        r7 = r0
    scale_ring = gl.allocate_shared_memory(gl.uint8, [NS, 64, SCALE_W], PLAIN2)
    if USE_584:
        rope_ring = gl.allocate_shared_memory(gl.bfloat16, [NS, 64, 64], KL)
    elif GROUP7_TILE:
        # one stage suffices: group 7 is rewritten only after the block's products are done
        rope_ring = gl.allocate_shared_memory(gl.bfloat16, [1, 64, 64], KL)
    else:
        rope_ring = scale_ring  # never written: only 584 records copy a RoPE tail
    idx_ring = gl.allocate_shared_memory(gl.int32, [NS, 64], PLAIN1)
    return r0, r1, r2, r3, r4, r5, r6, r7, scale_ring, rope_ring, idx_ring


@gluon.jit
def _load_idx_raw(k, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b,
                  HAS_B: gl.constexpr, L: gl.constexpr):
    """Slot ids of block ``k`` as stored (``[BN]`` of the window's and of the extra keys' index
    dtype, ``-1`` outside the block's part): no arithmetic on the loaded values, so a caller
    can carry them blocks ahead and pay their latency only at ``_check_idx``."""
    return _idx_at(k, gl.arange(0, 64, layout=L), nblk_a, nblk, a_idx_row, lo_a, hi_a,
                   b_idx_row, lo_b, hi_b, HAS_B)


@gluon.jit
def _idx_at(k, r, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b,
            HAS_B: gl.constexpr):
    """``_load_idx_raw`` at blocks ``k`` and key offsets ``r`` (broadcast against each other:
    a scalar block and ``[BN]`` offsets, or ``[P, 1]`` blocks and ``[1, BN]``)."""
    ca = lo_a + k * 64 + r
    ia = gl.load(a_idx_row + ca, mask=(ca < hi_a) & (k < nblk_a), other=-1)
    ib = ia
    if HAS_B:
        cb = lo_b + (k - nblk_a) * 64 + r
        ib = gl.load(b_idx_row + cb, mask=(cb < hi_b) & (k >= nblk_a) & (k < nblk), other=-1)
    return ia, ib


@gluon.jit
def _check_idx(ia, ib, a_rows, b_rows, HAS_B: gl.constexpr):
    """``_load_idx_raw``'s ids as ``[BN]`` int32, ``-1`` where outside ``[0, rows)`` (compared
    at the stored width: an int64 id of 2**32 + 5 is out of range, not row 5)."""
    idx = gl.where((ia >= 0) & (ia < a_rows), ia, -1).to(gl.int32)
    if HAS_B:
        idx = gl.where((ib >= 0) & (ib < b_rows), ib.to(gl.int32), idx)
    return idx


@gluon.jit
def _load_idx(k, nblk_a, nblk, a_idx_row, lo_a, hi_a, a_rows, b_idx_row, lo_b, hi_b, b_rows,
              HAS_B: gl.constexpr, L: gl.constexpr):
    """Slot ids of block ``k`` ([BN] int32 in ``L``), ``-1`` where a key is not read."""
    ia, ib = _load_idx_raw(k, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b, HAS_B,
                           L)
    return _check_idx(ia, ib, a_rows, b_rows, HAS_B)


@gluon.jit
def _copy_keys(base, idx, bstride, page, s, r0, r1, r2, r3, r4, r5, r6, r7, rope_s, scale_s,
               SRC: gl.constexpr, NW: gl.constexpr):
    """cp.async the records of one block (slot ids ``idx``, -1 = none) into one ring stage."""
    DATA: gl.constexpr = 576 if SRC == 584 else (512 if SRC == 528 else 256)
    SB: gl.constexpr = 8 if SRC == 584 else (16 if SRC == 528 else 32)
    L16: gl.constexpr = _copy_layout(16, NW)
    # the scale tile is [64, 16 | 32 | 64] bytes wide (4 threads per row)
    SW: gl.constexpr = scale_s.shape[1]
    LS: gl.constexpr = _copy_layout(SW // 4, NW)
    valid = idx >= 0
    slot = gl.where(valid, idx, 0)
    blk = slot // page
    off = slot - blk * page
    bbase = blk.to(gl.int64) * bstride
    data_off = gl.multiple_of(bbase + off.to(gl.int64) * DATA, 16)
    scale_off = gl.multiple_of(bbase + page.to(gl.int64) * DATA + off.to(gl.int64) * SB, 8)

    c16 = gl.arange(0, 64, layout=gl.SliceLayout(0, L16))
    vm = valid[:, None]
    if SRC == 288:
        # 256 data bytes = four [64, 64] byte tiles (two 64-dim groups each)
        for g in gl.static_range(4):
            p = base + (data_off + g * 64)[:, None] + c16[None, :]
            dst = _pick(g, r0, r1, r2, r3, r4, r5, r6, r7).index(s)
            cp.async_copy_global_to_shared(dst, p, mask=vm)
    else:
        NG: gl.constexpr = 7 if SRC == 584 else 8
        for g in gl.static_range(NG):
            p = base + (data_off + g * 64)[:, None] + c16[None, :]
            dst = _pick(g, r0, r1, r2, r3, r4, r5, r6, r7).index(s)
            cp.async_copy_global_to_shared(dst, p, mask=vm)
        if SRC == 584:
            # the raw bf16 RoPE tail (bytes 448..575) goes straight into its wgmma tile
            rp = (base + (data_off + 448)).to(gl.pointer_type(gl.bfloat16))
            cp.async_copy_global_to_shared(rope_s, rp[:, None] + c16[None, :], mask=vm)
    cs = gl.arange(0, SW, layout=gl.SliceLayout(0, LS))
    so = gl.convert_layout(scale_off, gl.SliceLayout(1, LS))
    sp = base + so[:, None] + cs[None, :]
    svm = gl.convert_layout(valid, gl.SliceLayout(1, LS))[:, None]
    cp.async_copy_global_to_shared(scale_s, sp, mask=svm & (cs < SB)[None, :])


@gluon.jit
def _copy_block(k, s, idx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride, b_page,
                r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring,
                SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
                NW: gl.constexpr, PAST_END: gl.constexpr):
    """Block ``k``'s checked slot ids ``idx`` into ring stage ``s`` and the ``cp.async`` of its
    records: window keys below ``nblk_a``, else the extra keys (``PAST_END``: ``k`` may be
    ``nblk`` or more, and then nothing is copied). The caller commits or arrives."""
    idx_ring.index(s).store(idx)
    if k < nblk_a:
        _copy_keys(a_ptr, idx, a_bstride, a_page, s, r0, r1, r2, r3, r4, r5, r6, r7,
                   rope_ring.index(s), scale_ring.index(s), SRC_A, NW)
    else:
        if HAS_B:
            if (not PAST_END) or k < nblk:
                _copy_keys(b_ptr, idx, b_bstride, b_page, s, r0, r1, r2, r3, r4, r5, r6, r7,
                           rope_ring.index(s), scale_ring.index(s), SRC_B, NW)


@gluon.jit
def _issue(k, idx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride, b_page,
           r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring,
           SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr, NS: gl.constexpr,
           NW: gl.constexpr):
    """Start the gathers of block ``k`` into stage ``k % NS`` (one cp.async group, maybe empty)."""
    _copy_block(k, k % NS, idx, nblk_a, nblk, a_ptr, a_bstride, a_page, b_ptr, b_bstride,
                b_page, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring, scale_ring, idx_ring, SRC_A,
                SRC_B, HAS_B, NW, True)
    cp.commit_group()


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


@gluon.jit
def _qk_f16(k0, k1, k2, k3, k4, k5, k6, k7, rope_s, q16, q_r, zero, cq, qk_scale,
            ROPE: gl.constexpr):
    """Logits ``S^T [64 keys, BH]`` (log2 units) of one block from the fp16 tiles: ``cq[h]``
    undoes the head's fp16 shift and the tiles' ``2**(127 - R)``; with ``ROPE`` (584 records)
    group 7 is the raw bf16 RoPE tile against the bf16 Q tail (its own accumulator)."""
    if not ROPE:
        return _qk(k0, k1, k2, k3, k4, k5, k6, k7, q16, zero) * cq[None, :]
    acc = _qk_groups7(k0, k1, k2, k3, k4, k5, k6, q16, zero)
    acr = warpgroup_mma(rope_s, q_r.permute((1, 0)), zero, use_acc=False, is_async=True)
    acc, acr = warpgroup_mma_wait(0, deps=[acc, acr])
    return acc * cq[None, :] + acr * qk_scale


@gluon.jit
def _q_rows(q_ptr, t, stride_qt, stride_qh, ht, BH: gl.constexpr, LQ: gl.constexpr):
    """Row pointers ``[BH, 1]`` of token ``t``'s heads in head tile ``ht``, the heads ``[BH]`` and
    the dims ``[64]`` of one 64-dim group, in the Q load layout ``LQ``."""
    hq = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, LQ))
    dq = gl.arange(0, 64, layout=gl.SliceLayout(0, LQ))
    return q_ptr + t * stride_qt + hq.to(gl.int64)[:, None] * stride_qh, hq, dq


@gluon.jit
def _store_q(qrow, hq, dq, H, q_smem):
    """The bf16 Q rows (``_q_rows``; heads ``>= H`` as 0) into ``q_smem [8, BH, 64]``."""
    for g in gl.static_range(8):
        qg = gl.load(qrow + (g * 64 + dq)[None, :], mask=(hq < H)[:, None], other=0.0)
        q_smem.index(g).store(qg)


@gluon.jit
def _qk_groups7(k0, k1, k2, k3, k4, k5, k6, q_smem, zero):
    """The wgmmas of 64-dim groups 0..6 of ``S^T = K Q^T`` (``_qk``), issued, not waited."""
    acc = warpgroup_mma(k0, q_smem.index(0).permute((1, 0)), zero, use_acc=False,
                        is_async=True)
    acc = warpgroup_mma(k1, q_smem.index(1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(k2, q_smem.index(2).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(k3, q_smem.index(3).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(k4, q_smem.index(4).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma(k5, q_smem.index(5).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(k6, q_smem.index(6).permute((1, 0)), acc, is_async=True)


@gluon.jit
def _qk(k0, k1, k2, k3, k4, k5, k6, k7, q_smem, zero):
    """Logits ``S^T [64 keys, BH] = K Q^T`` of one block from the bf16 key tiles ``k0..k7``
    (raw dot products; Q ``[8, BH, 64]`` in shared memory), waited."""
    acc = _qk_groups7(k0, k1, k2, k3, k4, k5, k6, q_smem, zero)
    acc = warpgroup_mma(k7, q_smem.index(7).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma_wait(0, deps=[acc])


@gluon.jit
def _online_softmax(sT, ok, m_i, l_part):
    """One key block's online-softmax step on the swap-AB logits ``sT [64 keys, BH]`` (scaled,
    log2 domain; ``ok [64]``: the keys that count): ``(p, alpha, m_new, l_part)`` with the
    running max ``m_i [BH]`` and the per-key partial sums ``l_part [64, BH]`` rescaled."""
    sT = gl.where(ok[:, None], sT, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sT, axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(sT - m_safe[None, :])
    return p, alpha, m_new, l_part * alpha[None, :] + p


@gluon.jit
def _pv(k0, k1, k2, k3, k4, k5, k6, k7, rope_s, p16, p_r, o0, o1, o2, o3, o4, o5, o6, o7,
        alpha, ROPE: gl.constexpr):
    """``O^T_g = O^T_g * alpha + K_g^T P^T`` for the 8 groups, waited (``P`` in ``p16``, bf16 or
    fp16 as the key tiles; with ``ROPE`` group 7 is the bf16 RoPE tile ``rope_s`` against the
    bf16 ``P * 2**(127 - R)`` in ``p_r``, else ``k7`` against ``p16``)."""
    pT = p16.permute((1, 0))
    o0 = warpgroup_mma(k0.permute((1, 0)), pT, o0 * alpha[None, :], is_async=True)
    o1 = warpgroup_mma(k1.permute((1, 0)), pT, o1 * alpha[None, :], is_async=True)
    o2 = warpgroup_mma(k2.permute((1, 0)), pT, o2 * alpha[None, :], is_async=True)
    o3 = warpgroup_mma(k3.permute((1, 0)), pT, o3 * alpha[None, :], is_async=True)
    o4 = warpgroup_mma(k4.permute((1, 0)), pT, o4 * alpha[None, :], is_async=True)
    o5 = warpgroup_mma(k5.permute((1, 0)), pT, o5 * alpha[None, :], is_async=True)
    o6 = warpgroup_mma(k6.permute((1, 0)), pT, o6 * alpha[None, :], is_async=True)
    if ROPE:
        o7 = warpgroup_mma(rope_s.permute((1, 0)), p_r.permute((1, 0)), o7 * alpha[None, :],
                           is_async=True)
    else:
        o7 = warpgroup_mma(k7.permute((1, 0)), pT, o7 * alpha[None, :], is_async=True)
    return warpgroup_mma_wait(0, deps=[o0, o1, o2, o3, o4, o5, o6, o7])


@gluon.jit
def _pick(g: gl.constexpr, t0, t1, t2, t3, t4, t5, t6, t7):
    """Tile ``g`` of eight separate allocations (a compile-time choice)."""
    if g == 0:
        return t0
    elif g == 1:
        return t1
    elif g == 2:
        return t2
    elif g == 3:
        return t3
    elif g == 4:
        return t4
    elif g == 5:
        return t5
    elif g == 6:
        return t6
    else:
        return t7


@gluon.jit
def _put(x, g: gl.constexpr, k0, k1, k2, k3, k4, k5, k6, k7):
    """Store ``x`` into tile ``g`` (separate allocations: no false write-after-write barriers)."""
    if g == 0:
        k0.store(x)
    elif g == 1:
        k1.store(x)
    elif g == 2:
        k2.store(x)
    elif g == 3:
        k3.store(x)
    elif g == 4:
        k4.store(x)
    elif g == 5:
        k5.store(x)
    elif g == 6:
        k6.store(x)
    else:
        k7.store(x)


@gluon.jit
def _store_out(orow_ptr, d0, acc, inv, hmask, ACC: gl.constexpr, TO_BF16: gl.constexpr):
    """``acc [64 dims, BH] * inv[BH]`` -> rows ``orow_ptr[h] + d0 + d``."""
    d = d0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    v = acc * inv[None, :]
    if TO_BF16:
        v = v.to(gl.bfloat16)
    gl.store(orow_ptr[None, :] + d[:, None], v, mask=hmask[None, :])


@gluon.jit
def _key_ranges(t, split, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st,
                b_width, HAS_B: gl.constexpr, HAS_LEN_A: gl.constexpr,
                HAS_LEN_B: gl.constexpr, SPLIT: gl.constexpr):
    """Token ``t``'s columns read by key split ``split``: window ``[lo_a, hi_a)`` and extra
    ``[lo_b, hi_b)`` (lens clamped to ``[0, width]``; splits of whole 64-key blocks), and the
    block counts ``nblk_a`` (window) and ``nblk`` (all)."""
    if HAS_LEN_A:
        len_a = gl.load(a_len_ptr + t * a_len_st).to(gl.int32)
        len_a = gl.minimum(gl.maximum(len_a, 0), a_width)
    else:
        len_a = a_width + 0
    len_b = len_a * 0
    if HAS_B:
        if HAS_LEN_B:
            len_b = gl.load(b_len_ptr + t * b_len_st).to(gl.int32)
            len_b = gl.minimum(gl.maximum(len_b, 0), b_width)
        else:
            len_b = len_b + b_width
    total = len_a + len_b
    if SPLIT:
        chunk = gl.cdiv(gl.cdiv(total, num_splits), 64) * 64
        lo = split * chunk
        hi = gl.minimum(lo + chunk, total)
    else:
        lo = total * 0
        hi = total
    lo_a = gl.minimum(lo, len_a)
    hi_a = gl.maximum(gl.minimum(hi, len_a), lo_a)
    lo_b = gl.maximum(lo, len_a) - len_a
    hi_b = gl.maximum(hi - len_a, lo_b)
    nblk_a = gl.cdiv(hi_a - lo_a, 64)
    nblk = nblk_a + gl.cdiv(hi_b - lo_b, 64)
    return lo_a, hi_a, lo_b, hi_b, nblk_a, nblk


@gluon.jit
def _few_heads_epilogue(o0, o1, o2, o3, o4, o5, o6, o7, l_i, m_i, o_unit, t, split, ht, H,
                        num_splits, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr,
                        stride_lt, stride_lh, po_ptr, pl_ptr, ACC: gl.constexpr,
                        HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, BH: gl.constexpr):
    """Swap-AB accumulators ``o0..o7 [64 dims, BH]`` (group ``g`` = dims ``64 g ..``), the
    softmax sums ``l_i`` and maxima ``m_i [BH]`` of head tile ``ht`` -> the token's bf16 rows and
    lse (with the sink), or with ``SPLIT`` the normalized fp32 partial and its log2-sum-exp;
    ``o_unit`` multiplies the outputs (the key tiles' units)."""
    h = ht * BH + gl.arange(0, BH, layout=gl.SliceLayout(0, ACC))
    hmask = h < H
    h64 = h.to(gl.int64)
    has = l_i != 0.0  # no key <=> l == 0 exactly; a NaN l propagates (docs/semantics.md)
    l_safe = gl.where(has, l_i, 1.0)
    if SPLIT:
        inv = gl.where(has, 1.0 / l_safe, 0.0)
        prow = (t * num_splits + split) * H + h64
        orow = po_ptr + prow * 512
        lse2 = gl.where(has, m_i + gl.log2(l_safe), float("-inf"))
        gl.store(pl_ptr + prow, lse2, mask=hmask)
        TO_BF16: gl.constexpr = False
    else:
        inv, lse = _finish_rows(l_i, m_i, h64, hmask, sink_ptr, sink_st, HAS_SINK)
        orow = out_ptr + t * stride_ot + h64 * stride_oh
        gl.store(lse_ptr + t * stride_lt + h64 * stride_lh, lse, mask=hmask)
        TO_BF16: gl.constexpr = True
    inv = inv * o_unit
    _store_out(orow, 0, o0, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 64, o1, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 128, o2, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 192, o3, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 256, o4, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 320, o5, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 384, o6, inv, hmask, ACC, TO_BF16)
    _store_out(orow, 448, o7, inv, hmask, ACC, TO_BF16)


@gluon.jit
def _sparse_mla_decode_gluon_kernel(
    q_ptr, stride_qt, stride_qh,
    a_ptr, a_idx_ptr, a_idx_st, a_len_ptr, a_len_st, a_width, a_bstride, a_page, a_rows,
    b_ptr, b_idx_ptr, b_idx_st, b_len_ptr, b_len_st, b_width, b_bstride, b_page, b_rows,
    sink_ptr, sink_st,
    out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh,
    po_ptr, pl_ptr,
    H, qk_scale, num_splits, num_ht,
    SRC_A: gl.constexpr, SRC_B: gl.constexpr, HAS_B: gl.constexpr,
    HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, HAS_SINK: gl.constexpr,
    SPLIT: gl.constexpr, BH: gl.constexpr, NS: gl.constexpr, NW: gl.constexpr,
    F16: gl.constexpr = False,
):
    """Grid ``T * num_splits * num_ht`` (head tile fastest, then split, then token); ``NW``
    warps (4 or 8: with 8, two warpgroups split the copies and the dequant by keys and the
    heads of the tile in the products; ``BH >= 16``).
    ``F16``: fp16 wgmma operands (module docstring, "fp16 operands").
    Arguments as the ``tl`` decode kernel's (``_sparse_mla_fwd_grouped_kernel``)."""
    ACC: gl.constexpr = _acc_layout(BH, NW)
    L16: gl.constexpr = _copy_layout(16, NW)
    LI: gl.constexpr = gl.SliceLayout(1, L16)
    LQ: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
    KL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    QL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, 64], gl.bfloat16)
    KDT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
    # F16: every block of 584 records (group 7 = the bf16 RoPE tail) or none
    ALL584: gl.constexpr = SRC_A == 584 and ((not HAS_B) or SRC_B == 584)
    if F16:
        gl.static_assert(ALL584 or (SRC_A != 584 and ((not HAS_B) or SRC_B != 584)),
                         "F16: 584 records mixed with 528/288 records are not supported")

    ht, split, t = _program_ids(num_ht, num_splits)

    # ---- shared memory ----------------------------------------------------------------
    USE_584: gl.constexpr = SRC_A == 584 or (HAS_B and SRC_B == 584)
    USE_288: gl.constexpr = SRC_A == 288 or (HAS_B and SRC_B == 288)
    r0, r1, r2, r3, r4, r5, r6, r7, scale_ring, rope_ring, idx_ring = _alloc_rings(
        SRC_A, SRC_B, HAS_B, NS, 32 if USE_288 else 16, True)
    k0 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k1 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k2 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k3 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k4 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k5 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    k6 = gl.allocate_shared_memory(KDT, [64, 64], KL)
    q_smem = gl.allocate_shared_memory(KDT, [8, BH, 64], QL)
    p_smem = gl.allocate_shared_memory(KDT, [BH, 64], QL)
    if F16:
        # the bf16 RoPE operands (584 records); 528/288 records put group 7 as fp16 into the
        # RoPE ring stage (reinterpreted: same bytes, same swizzle)
        q_r = gl.allocate_shared_memory(gl.bfloat16, [BH, 64], QL)
        p_r = gl.allocate_shared_memory(gl.bfloat16, [BH, 64], QL)
    # one ring stage (``NS == 1``): the next block's gathers are issued right after this
    # block's dequant, so the RoPE tail the products read is first copied out of the ring
    ONE: gl.constexpr = NS == 1
    if ONE and USE_584:
        k7t = gl.allocate_shared_memory(gl.bfloat16, [64, 64], KL)

    # ---- this program's column ranges ---------------------------------------------------
    lo_a, hi_a, lo_b, hi_b, nblk_a, nblk = _key_ranges(
        t, split, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st, b_width,
        HAS_B, HAS_LEN_A, HAS_LEN_B, SPLIT)
    a_idx_row = a_idx_ptr + t * a_idx_st
    b_idx_row = b_idx_ptr + t * b_idx_st

    # ---- Q (resident) -------------------------------------------------------------------
    qrow, hq, dq = _q_rows(q_ptr, t, stride_qt, stride_qh, ht, BH, LQ)
    if F16:
        # fp16 Q: each head times 2**(141 - e) (e: the biased exponent of its amax, clamped to
        # [15, 255]) puts its amax in [2**14, 2**15); qk_h = qk_scale * 2**(e - 141) undoes it.
        # 584-only kernels leave the bf16 RoPE tail out of the amax.
        NQ: gl.constexpr = 7 if ALL584 else 8
        amax = gl.full([BH], 0.0, gl.float32, layout=gl.SliceLayout(1, LQ))
        for g in gl.static_range(NQ):
            qg = gl.load(qrow + (g * 64 + dq)[None, :], mask=(hq < H)[:, None], other=0.0)
            amax = gl.maximum(amax, gl.max(gl.abs(qg.to(gl.float32)), axis=1))
        ea = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
        ea = gl.minimum(gl.maximum(ea, 15), 255)
        qmul = ((268 - ea) << 23).to(gl.float32, bitcast=True)
        for g in gl.static_range(8):
            qg = gl.load(qrow + (g * 64 + dq)[None, :], mask=(hq < H)[:, None], other=0.0)
            q_smem.index(g).store((qg.to(gl.float32) * qmul[:, None]).to(gl.float16))
            if g == 7:
                if ALL584:
                    q_r.store(qg)
        qk_h = gl.convert_layout(((ea - 14) << 23).to(gl.float32, bitcast=True),
                                 gl.SliceLayout(0, ACC)) * qk_scale
    else:
        _store_q(qrow, hq, dq, H, q_smem)

    # ---- prologue: NS - 1 blocks in flight (one with a single stage) ---------------------
    # the next block's raw ids (checked when issued, so their load's latency is not waited
    # for where they are loaded)
    na, nb = _load_idx_raw(0, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b, hi_b, HAS_B,
                           LI)
    for i in gl.static_range(1 if ONE else NS - 1):
        _issue(i, _check_idx(na, nb, a_rows, b_rows, HAS_B), nblk_a, nblk, a_ptr, a_bstride,
               a_page, b_ptr, b_bstride, b_page, r0, r1, r2, r3, r4, r5, r6, r7, rope_ring,
               scale_ring, idx_ring, SRC_A, SRC_B, HAS_B, NS, NW)
        na, nb = _load_idx_raw(i + 1, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row, lo_b,
                               hi_b, HAS_B, LI)
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, ACC))
    zero = gl.full([64, BH], 0.0, gl.float32, layout=ACC)
    l_part = zero  # per-thread partial sums of p, reduced once after the loop
    o0 = zero
    o1 = zero
    o2 = zero
    o3 = zero
    o4 = zero
    o5 = zero
    o6 = zero
    o7 = zero
    R = nblk * 0 + R_MIN  # F16: the running scale exponent of the key tiles

    for j in range(nblk):
        s = j % NS
        if not ONE:
            kn = j + NS - 1
            _issue(kn, _check_idx(na, nb, a_rows, b_rows, HAS_B), nblk_a, nblk, a_ptr,
                   a_bstride, a_page, b_ptr, b_bstride, b_page, r0, r1, r2, r3, r4, r5, r6, r7,
                   rope_ring, scale_ring, idx_ring, SRC_A, SRC_B, HAS_B, NS, NW)
            na, nb = _load_idx_raw(kn + 1, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row,
                                   lo_b, hi_b, HAS_B, LI)
        cp.wait_group(0 if ONE else NS - 1)
        gl.thread_barrier()
        scale_s = scale_ring.index(s)
        if USE_584:
            rope_s = rope_ring.index(s)
        else:
            rope_s = rope_ring.index(0)
        # the group-7 wgmma operand: the ring's RoPE tile, or (one stage) its copy
        if ONE and USE_584:
            g7 = k7t
        else:
            g7 = rope_s
        if F16:
            k7 = rope_s._reinterpret(gl.float16, [64, 64], KL)
            r_old = R
            if HAS_B and SRC_A != SRC_B:
                if j < nblk_a:
                    R = _prep_f16(s, r0, r1, r2, r3, r4, r5, r6, r7, scale_s, k0, k1, k2, k3, k4,
                                  k5, k6, k7, R, SRC_A, NW)
                else:
                    R = _prep_f16(s, r0, r1, r2, r3, r4, r5, r6, r7, scale_s, k0, k1, k2, k3, k4,
                                  k5, k6, k7, R, SRC_B, NW)
            else:
                R = _prep_f16(s, r0, r1, r2, r3, r4, r5, r6, r7, scale_s, k0, k1, k2, k3, k4, k5,
                              k6, k7, R, SRC_A, NW)
        else:
            if HAS_B and SRC_A != SRC_B:
                if j < nblk_a:
                    _dequant(s, r0, r1, r2, r3, r4, r5, r6, r7, g7, scale_s, k0, k1, k2, k3, k4,
                             k5, k6, SRC_A, NW)
                else:
                    _dequant(s, r0, r1, r2, r3, r4, r5, r6, r7, g7, scale_s, k0, k1, k2, k3, k4,
                             k5, k6, SRC_B, NW)
            else:
                _dequant(s, r0, r1, r2, r3, r4, r5, r6, r7, g7, scale_s, k0, k1, k2, k3, k4,
                         k5, k6, SRC_A, NW)
        if ONE:
            # the stage is read out (RoPE tail copied, ids in registers): the next block's
            # gathers go into it now, under this block's products
            if USE_584:
                if HAS_B and SRC_A != SRC_B:
                    if SRC_A == 584:
                        if j < nblk_a:
                            k7t.store(rope_s.load(L16))
                    else:
                        if j >= nblk_a:
                            k7t.store(rope_s.load(L16))
                else:
                    k7t.store(rope_s.load(L16))
            kidx = idx_ring.index(s).load(gl.SliceLayout(1, ACC))
        fence_async_shared()
        gl.thread_barrier()
        if ONE:
            _issue(j + 1, _check_idx(na, nb, a_rows, b_rows, HAS_B), nblk_a, nblk, a_ptr,
                   a_bstride, a_page, b_ptr, b_bstride, b_page, r0, r1, r2, r3, r4, r5, r6, r7,
                   rope_ring, scale_ring, idx_ring, SRC_A, SRC_B, HAS_B, NS, NW)
            na, nb = _load_idx_raw(j + 2, nblk_a, nblk, a_idx_row, lo_a, hi_a, b_idx_row,
                                   lo_b, hi_b, HAS_B, LI)
        if F16:
            cq = qk_h * _exp2i(R - 127)
            sT = _qk_f16(k0, k1, k2, k3, k4, k5, k6, k7, g7, q_smem, q_r, zero, cq, qk_scale,
                         ALL584)
            if not ONE:
                kidx = idx_ring.index(s).load(gl.SliceLayout(1, ACC))
            p, alpha, m_i, l_part = _online_softmax(sT, kidx >= 0, m_i, l_part)
            p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
            if ALL584:
                p_r.store(gl.permute((p * _exp2i(127 - R)).to(gl.bfloat16), (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            alpha = alpha * _exp2i(r_old - R)
            o0, o1, o2, o3, o4, o5, o6, o7 = _pv(k0, k1, k2, k3, k4, k5, k6, k7, g7, p_smem,
                                                 p_r, o0, o1, o2, o3, o4, o5, o6, o7, alpha,
                                                 ALL584)
            gl.thread_barrier()
        else:
            sT = _qk(k0, k1, k2, k3, k4, k5, k6, g7, q_smem, zero)

            if not ONE:
                kidx = idx_ring.index(s).load(gl.SliceLayout(1, ACC))
            p, alpha, m_i, l_part = _online_softmax(sT * qk_scale, kidx >= 0, m_i, l_part)
            p_smem.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
            fence_async_shared()
            gl.thread_barrier()

            # O^T_g = O^T_g * alpha + K_g^T P^T
            o0, o1, o2, o3, o4, o5, o6, o7 = _pv(k0, k1, k2, k3, k4, k5, k6, g7, g7, p_smem,
                                                 p_smem, o0, o1, o2, o3, o4, o5, o6, o7, alpha,
                                                 False)
            gl.thread_barrier()
    cp.wait_group(0)
    l_i = gl.sum(l_part, axis=0)
    if F16:
        o_unit = _exp2i(R - 127)  # the key tiles' units
    else:
        o_unit = 1.0

    # ---- epilogue -----------------------------------------------------------------------
    _few_heads_epilogue(o0, o1, o2, o3, o4, o5, o6, o7, l_i, m_i, o_unit, t, split, ht, H,
                        num_splits, sink_ptr, sink_st, out_ptr, stride_ot, stride_oh, lse_ptr,
                        stride_lt, stride_lh, po_ptr, pl_ptr, ACC, HAS_SINK, SPLIT, BH)
