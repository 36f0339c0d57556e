"""Paged record gathers shared by the Gluon decode kernels (``decode.py``, ``decode_heads.py``,
their warp-specialized forms): the raw-record ring in shared memory, a CTA's key ranges and
slot ids (checked against the cache), and the ``cp.async`` copies of a 64-key block's record
bytes, scales and RoPE tail.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from ._api import async_load


#: keys per block (the wgmma M of the swap-AB products)
BN = 64

#: record width -> (data bytes, scale bytes)
SRC_BYTES = {584: (576, 8), 528: (512, 16), 288: (256, 32)}


@gluon.constexpr_function
def _copy_layout(vec, nw):
    """[64, w] copy tiles: ``vec`` elements (16 or 8 bytes) per thread, 4 threads per row,
    ``nw`` warps along the keys."""
    return gl.BlockedLayout([1, vec], [8, 4], [nw, 1], [1, 0])


@gluon.jit
def _program_ids(num_ht, num_splits):
    """This CTA's (head tile, key split, token) of a grid ``T * num_splits * num_ht`` (head
    tile fastest, then split, then token; the token as int64)."""
    return _item_ids(gl.program_id(0), num_ht, num_splits)


@gluon.jit
def _item_ids(item, num_ht, num_splits):
    """(head tile, key split, token as int64) of work item ``item`` of ``T * num_splits *
    num_ht`` (head tile fastest, then split, then token)."""
    rest = item // num_ht
    return item % num_ht, rest % num_splits, (rest // num_splits).to(gl.int64)


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
            async_load(dst, p, mask=vm)
    else:
        NG: gl.constexpr = 7 if SRC == 584 else 8
        for g in gl.static_range(NG):
            p = base + (data_off + g * 64)[:, None] + c16[None, :]
            dst = _pick(g, r0, r1, r2, r3, r4, r5, r6, r7).index(s)
            async_load(dst, p, mask=vm)
        if SRC == 584:
            # the raw bf16 RoPE tail (bytes 448..575) goes straight into its wgmma tile
            rp = (base + (data_off + 448)).to(gl.pointer_type(gl.bfloat16))
            async_load(rope_s, rp[:, None] + c16[None, :], mask=vm)
    cs = gl.arange(0, SW, layout=gl.SliceLayout(0, LS))
    so = gl.convert_layout(scale_off, gl.SliceLayout(1, LS))
    sp = base + so[:, None] + cs[None, :]
    svm = gl.convert_layout(valid, gl.SliceLayout(1, LS))[:, None]
    async_load(scale_s, sp, mask=svm & (cs < SB)[None, :])


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
def _key_ranges(t, split, num_splits, a_len_ptr, a_len_st, a_width, b_len_ptr, b_len_st,
                b_width, HAS_B: gl.constexpr, HAS_LEN_A: gl.constexpr,
                HAS_LEN_B: gl.constexpr, SPLIT: gl.constexpr):
    """Token ``t``'s columns read by key split ``split``: window ``[lo_a, hi_a)`` and extra
    ``[lo_b, hi_b)`` (lens clamped to ``[0, width]``; splits of whole 64-key blocks), and the
    block counts ``nblk_a`` (window) and ``nblk`` (all)."""
    la, lb = _load_lens(t, a_len_ptr, a_len_st, b_len_ptr, b_len_st, HAS_B, HAS_LEN_A,
                        HAS_LEN_B)
    return _lens_ranges(la, lb, split, num_splits, a_width, b_width, HAS_B, HAS_LEN_A,
                        HAS_LEN_B, SPLIT)


@gluon.jit
def _load_lens(t, a_len_ptr, a_len_st, b_len_ptr, b_len_st, HAS_B: gl.constexpr,
               HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr):
    """Token ``t``'s lens as stored (int32 0 where a part has none): no arithmetic on the
    loaded values, so a caller can carry them an item ahead and pay their latency only at
    ``_lens_ranges``."""
    la = (t * 0).to(gl.int32)
    lb = la
    if HAS_LEN_A:
        la = gl.load(a_len_ptr + t * a_len_st)
    if HAS_B:
        if HAS_LEN_B:
            lb = gl.load(b_len_ptr + t * b_len_st)
    return la, lb


@gluon.jit
def _lens_ranges(la, lb, split, num_splits, a_width, b_width, HAS_B: gl.constexpr,
                 HAS_LEN_A: gl.constexpr, HAS_LEN_B: gl.constexpr, SPLIT: gl.constexpr):
    """``_key_ranges`` of the lens ``_load_lens`` loaded."""
    if HAS_LEN_A:
        len_a = gl.minimum(gl.maximum(la.to(gl.int32), 0), a_width)
    else:
        len_a = a_width + 0
    len_b = len_a * 0
    if HAS_B:
        if HAS_LEN_B:
            len_b = gl.minimum(gl.maximum(lb.to(gl.int32), 0), b_width)
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
    _pick(g, k0, k1, k2, k3, k4, k5, k6, k7).store(x)

