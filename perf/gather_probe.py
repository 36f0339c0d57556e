"""How fast CTAs can gather random paged records into shared memory on Hopper (sm_90, Gluon).

    python perf/gather_probe.py [--tokens 128,1024] [--stages 2,3,4] [--modes ...]
                                [--split 1,2] [--ctas-per-sm 1] [--pages 16384]
                                [--keys 640] [--workspace]

The warp-specialized few-heads decode kernel runs one CTA per SM and gathers 64-key blocks of
584-byte records (576 data bytes per key in its page, the scales after the page's data). This
probe times that gather alone, with no dequant and no products, on a paged cache of 584-byte
records and random slot ids (640 keys per token = 10 blocks; every 97th id is -1): the first
512 data bytes of every key, into an ``NS``-stage ring. Modes:

* ``tile64``: the kernels' copy shape: eight ``cp.async`` copies per block, each a
  ``[64 keys, 64 bytes]`` tile (4 threads per key: a warp instruction covers 8 keys x 64 B);
* ``row``: one ``cp.async`` copy of ``[64, 512]`` bytes (a warp instruction covers one key's
  512 contiguous bytes);
* ``tile128``: ``[64 keys, 128 bytes]`` tiles (8 threads per key: a warp instruction covers
  4 keys x 128 B);
* ``tile64_pre`` / ``row_pre``: the same, with a token's 640 ids loaded at once into shared
  memory at its first block (else each block's ids are loaded when the block is issued);
* ``tma``: one TMA box per key (a 4-d descriptor over ``[pages, 64, 2, 256]`` bytes, box
  ``[1, 1, 2, 256]``; invalid ids go to page -1, which TMA fills with zeros), completion
  counted in bytes on the stage's mbarrier, issued by the CTA's 4 warps;
* ``tma_ws4`` / ``tma_ws1``: the TMA boxes issued by 4 (16 keys each) or 1 one-warp producer
  partitions (``gl.warp_specialize``), the default partition consuming.

``--split S`` gives each token's keys to S CTAs (10 / S blocks each); the grid is persistent,
at most ``--ctas-per-sm`` CTAs per SM. ``--keys`` sets the keys per token (a multiple of 64).
``--workspace`` gathers the prefill workspace's pattern instead (cp.async modes only): whole
1024-byte bf16 rows of a flat ``[pages * 64, 512]`` workspace (``--pages 512``: 32768 rows,
32 MB). Each block's first 16 bytes per key go into a checksum,
which must agree across the modes. Median of ``triton.testing.do_bench`` (L2 cleared between
runs); GB/s of the bytes gathered. Results and what they mean: perf/NOTES.md, session 8.
"""
from __future__ import annotations

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dsv41_triton.attention.gluon._api import async_load, barrier, reinterpret

PAGE = 64
DATA = 576
SCALES = 8
BSTRIDE = PAGE * (DATA + SCALES)
KEYS = 640
NB = KEYS // 64
ROW = 512
NW = 4


@gluon.jit
def _block_off(k, pid, G, NB: gl.constexpr):
    """Offset of the ids of this CTA's block ``k`` (tokens ``pid, pid + G, ...``, NB blocks
    each)."""
    tok = pid + (k // NB) * G
    return tok.to(gl.int64) * (NB * 64) + (k % NB) * 64


@gluon.jit
def _blocks_of(n_tok, pid, G, NB: gl.constexpr):
    """How many blocks this CTA gathers (tokens ``pid, pid + G, ...``, NB blocks each)."""
    return ((n_tok - pid + G - 1) // G) * NB


#: the checksum's layout: a block's first 16 bytes per key, one key row per thread
_LR = gl.constexpr(gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0]))


@gluon.jit
def _touch(acc, stage):
    """``acc`` plus the first 16 bytes of every key of a landed ``[64, 512]`` byte stage."""
    return acc + stage.slice(0, 16, dim=1).load(_LR).to(gl.int32)


@gluon.jit
def _store_sum(out_ptr, pid, acc):
    gl.store(out_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


@gluon.jit
def _tma_ring(NS: gl.constexpr, RING: gl.constexpr):
    """The TMA ring ``[NS, 64, 1, 2, 256]`` (one box per key) and its ``[NS, 64, 512]`` byte
    view."""
    ring = gl.allocate_shared_memory(gl.uint8, [NS, 64, 1, 2, 256], RING)
    flat = reinterpret(ring, gl.uint8, [NS, 64, 512], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    return ring, flat


@gluon.jit
def _ids_of(ids_ptr, k, pid, G, NB: gl.constexpr, LI: gl.constexpr):
    return gl.load(ids_ptr + _block_off(k, pid, G, NB) + gl.arange(0, 64, layout=LI))


@gluon.jit
def _tma_keys(desc, ids_ptr, off, dst, bar, R0: gl.constexpr, RP: gl.constexpr):
    """One TMA box per key ``R0 .. R0 + RP - 1`` of a block (ids at ``ids_ptr + off``) into
    those rows of stage ``dst``; -1 ids read page -1 (zero fill)."""
    o = off + R0
    for r in gl.static_range(RP):
        i = gl.load(ids_ptr + o + r)
        page = gl.where(i >= 0, i // 64, -1)
        tma.async_copy_global_to_shared(desc, [page, i % 64, 0, 0], bar,
                                        dst.slice(R0 + r, 1, dim=0))


@gluon.jit
def _issue_cp(cache_ptr, ids_ptr, ring, ids_smem, ids_rows, k, total, pid, G, bstride, kstride,
              MODE: gl.constexpr, NS: gl.constexpr, NB: gl.constexpr, RB: gl.constexpr):
    # MODE 0 / 2: [64, 64] tiles (4 threads per key); 1 / 3: [64, 512] (32 threads per key);
    # 2 / 3: a token's 640 ids loaded at once into shared memory at its first block; 4: [64,
    # 128] tiles (8 threads per key)
    if MODE == 4:
        L: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    elif MODE % 2 == 0:
        L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    else:
        L: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])
    if k < total:
        if MODE >= 2:
            if k % NB == 0:
                # the token's NB blocks of ids in one pass, then one store
                LT: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
                rr = gl.arange(0, 16, layout=gl.SliceLayout(1, LT))[:, None]
                cc = gl.arange(0, 64, layout=gl.SliceLayout(0, LT))[None, :]
                allids = gl.load(ids_ptr + _block_off(k, pid, G, NB) + rr * 64 + cc,
                                 mask=rr < NB, other=-1)
                barrier()
                ids_smem.store(allids)
                barrier()
            idx = ids_rows.index(k % NB).load(gl.SliceLayout(1, L))
        else:
            idx = _ids_of(ids_ptr, k, pid, G, NB, gl.SliceLayout(1, L))
        valid = idx >= 0
        slot = gl.where(valid, idx, 0)
        page = slot // 64
        base = page.to(gl.int64) * bstride + (slot - page * 64).to(gl.int64) * kstride
        base = gl.multiple_of(base, 16)
        st = ring.index(k % NS)
        if MODE == 4:
            c = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
            for g in gl.static_range(RB // 128):
                p = cache_ptr + (base + g * 128)[:, None] + c[None, :]
                async_load(st.slice(g * 128, 128, dim=1), p, mask=valid[:, None])
        elif MODE % 2 == 0:
            c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
            for g in gl.static_range(RB // 64):
                p = cache_ptr + (base + g * 64)[:, None] + c[None, :]
                async_load(st.slice(g * 64, 64, dim=1), p,
                           mask=valid[:, None])
        else:
            c = gl.arange(0, RB, layout=gl.SliceLayout(0, L))
            p = cache_ptr + base[:, None] + c[None, :]
            async_load(st, p, mask=valid[:, None])
    cp.commit_group()


@gluon.jit
def _probe_cp_kernel(cache_ptr, ids_ptr, out_ptr, n_tok, bstride, kstride,
                     MODE: gl.constexpr, NS: gl.constexpr, NB: gl.constexpr, RB: gl.constexpr):
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    total = _blocks_of(n_tok, pid, G, NB)
    ring = gl.allocate_shared_memory(gl.uint8, [NS, 64, RB],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ids_smem = gl.allocate_shared_memory(gl.int32, [16, 64],
                                         gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ids_rows = reinterpret(ids_smem, gl.int32, [16, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for k in gl.static_range(NS - 1):
        _issue_cp(cache_ptr, ids_ptr, ring, ids_smem, ids_rows, k, total, pid, G, bstride,
                  kstride, MODE, NS, NB, RB)
    acc = gl.zeros([64, 16], gl.int32, _LR)
    for j in range(total):
        _issue_cp(cache_ptr, ids_ptr, ring, ids_smem, ids_rows, j + NS - 1, total, pid, G,
                  bstride, kstride, MODE, NS, NB, RB)
        cp.wait_group(NS - 1)
        barrier()
        acc = _touch(acc, ring.index(j % NS))
        barrier()
    _store_sum(out_ptr, pid, acc)


@gluon.jit
def _issue_tma(desc, ids_ptr, ring, bars, k, total, pid, G, NS: gl.constexpr, NB: gl.constexpr):
    if k < total:
        off = _block_off(k, pid, G, NB)
        # the stage as a constant, so that each key's box has a constant shared-memory range
        for st in gl.static_range(NS):
            if k % NS == st:
                bar = bars.index(st)
                mbarrier.expect(bar, 64 * 512)
                _tma_keys(desc, ids_ptr, off, ring.index(st), bar, 0, 64)


@gluon.jit
def _probe_tma_kernel(desc, ids_ptr, out_ptr, n_tok, NS: gl.constexpr, NB: gl.constexpr,
                      RING: gl.constexpr):
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    total = _blocks_of(n_tok, pid, G, NB)
    ring, flat = _tma_ring(NS, RING)
    bars = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NS):
        mbarrier.init(bars.index(st), count=1)
    for k in gl.static_range(NS - 1):
        _issue_tma(desc, ids_ptr, ring, bars, k, total, pid, G, NS, NB)
    acc = gl.zeros([64, 16], gl.int32, _LR)
    for j in range(total):
        _issue_tma(desc, ids_ptr, ring, bars, j + NS - 1, total, pid, G, NS, NB)
        s = j % NS
        mbarrier.wait(bars.index(s), (j // NS) & 1)
        acc = _touch(acc, flat.index(s))
        barrier()
        fence_async_shared()  # the reads above precede the next TMA writes into the stage
    for st in gl.static_range(NS):
        mbarrier.invalidate(bars.index(st))
    _store_sum(out_ptr, pid, acc)


@gluon.jit
def _tma_producer(desc, ids_ptr, ring, ready, free, total, pid, G, PART: gl.constexpr,
                  NP: gl.constexpr, NS: gl.constexpr, NB: gl.constexpr):
    RP: gl.constexpr = 64 // NP
    for k in range(total):
        s = k % NS
        mbarrier.wait(free.index(s), ((k // NS) & 1) ^ 1)
        off = _block_off(k, pid, G, NB)
        for st in gl.static_range(NS):
            if s == st:
                bar = ready.index(st)
                mbarrier.expect(bar, RP * 512)
                _tma_keys(desc, ids_ptr, off, ring.index(st), bar, PART * RP, RP)


@gluon.jit
def _tma_consumer(flat, ready, free, total, out_ptr, pid, NS: gl.constexpr):
    acc = gl.zeros([64, 16], gl.int32, _LR)
    for j in range(total):
        s = j % NS
        mbarrier.wait(ready.index(s), (j // NS) & 1)
        acc = _touch(acc, flat.index(s))
        barrier()
        fence_async_shared()
        mbarrier.arrive(free.index(s))
    _store_sum(out_ptr, pid, acc)


@gluon.jit
def _probe_tma_ws_kernel(desc, ids_ptr, out_ptr, n_tok, NS: gl.constexpr, NB: gl.constexpr,
                         RING: gl.constexpr, NP: gl.constexpr):
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    total = _blocks_of(n_tok, pid, G, NB)
    ring, flat = _tma_ring(NS, RING)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(NS):
        mbarrier.init(ready.index(st), count=NP)
        mbarrier.init(free.index(st), count=1)
    if NP == 4:
        gl.warp_specialize([
            (_tma_consumer, (flat, ready, free, total, out_ptr, pid, NS)),
            (_tma_producer, (desc, ids_ptr, ring, ready, free, total, pid, G, 0, NP, NS, NB)),
            (_tma_producer, (desc, ids_ptr, ring, ready, free, total, pid, G, 1, NP, NS, NB)),
            (_tma_producer, (desc, ids_ptr, ring, ready, free, total, pid, G, 2, NP, NS, NB)),
            (_tma_producer, (desc, ids_ptr, ring, ready, free, total, pid, G, 3, NP, NS, NB)),
        ], [1, 1, 1, 1], [48, 48, 48, 48])
    else:
        gl.warp_specialize([
            (_tma_consumer, (flat, ready, free, total, out_ptr, pid, NS)),
            (_tma_producer, (desc, ids_ptr, ring, ready, free, total, pid, G, 0, NP, NS, NB)),
        ], [1], [48])


def _inputs(tokens, pages, keys=KEYS, bstride=BSTRIDE, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randint(0, 256, (pages, bstride), dtype=torch.uint8, device="cuda",
                          generator=g)
    ids = torch.randint(0, pages * PAGE, (tokens, keys), dtype=torch.int32, device="cuda",
                        generator=g)
    ids[:, ::97] = -1
    return cache, ids


def run(mode, cache, ids, ns, grid, nb=NB, workspace=False):
    out = torch.zeros(grid, dtype=torch.int32, device="cuda")
    if mode.startswith("tma"):
        view = torch.as_strided(cache, (cache.shape[0], PAGE, 2, 256), (BSTRIDE, DATA, 256, 1))
        lay = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=4)
        desc = TensorDescriptor.from_tensor(view, [1, 1, 2, 256], lay)

        ring = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=4)
        if mode == "tma":
            def fn():
                _probe_tma_kernel[(grid,)](desc, ids, out, ids.shape[0], NS=ns, NB=nb,
                                           RING=ring, num_warps=NW)
        else:
            np_ = int(mode[len("tma_ws"):] or 4)

            def fn():
                _probe_tma_ws_kernel[(grid,)](desc, ids, out, ids.shape[0], NS=ns, NB=nb,
                                              RING=ring, NP=np_, num_warps=NW)
    else:
        m = {"tile64": 0, "row": 1, "tile64_pre": 2, "row_pre": 3, "tile128": 4}[mode]

        def fn():
            if workspace:
                _probe_cp_kernel[(grid,)](cache, ids, out, ids.shape[0], PAGE * 1024, 1024,
                                          MODE=m, NS=ns, NB=nb, RB=1024, num_warps=NW)
            else:
                _probe_cp_kernel[(grid,)](cache, ids, out, ids.shape[0], BSTRIDE, DATA,
                                          MODE=m, NS=ns, NB=nb, RB=ROW, num_warps=NW)
    fn()
    torch.cuda.synchronize()
    return fn, out.sum().item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="128,1024")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--modes", default="tile64,row,tile64_pre,row_pre,tma_ws4")
    ap.add_argument("--pages", type=int, default=16384, help="cache pages (37376 bytes each)")
    ap.add_argument("--split", default="1",
                    help="CTAs per token (1, 2, 5: each gathers 10 / split blocks)")
    ap.add_argument("--ctas-per-sm", type=int, default=1,
                    help="persistent grid of at most this many CTAs per SM")
    ap.add_argument("--keys", type=int, default=KEYS, help="keys per token (multiple of 64)")
    ap.add_argument("--workspace", action="store_true",
                    help="1024-byte rows of a flat bf16 workspace (cp.async modes)")
    args = ap.parse_args(argv)
    keys = args.keys
    if keys % 64 or not 64 <= keys <= 1024:
        ap.error("--keys: a multiple of 64 in [64, 1024]")
    row = 1024 if args.workspace else ROW
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| tokens | split | grid | mode | stages | µs | GB/s | checksum |")
    print("|---|---|---|---|---|---|---|---|")
    for t in (int(x) for x in args.tokens.split(",")):
        cache, ids = _inputs(t, args.pages, keys, PAGE * 1024 if args.workspace else BSTRIDE)
        nbytes = t * keys * row
        for split in (int(x) for x in args.split.split(",")):
            # a token's keys over `split` CTAs: rows of 640 / split ids, 10 / split blocks
            sids = ids.reshape(t * split, keys // split)
            grid = min(t * split, sms * args.ctas_per_sm)
            for ns in (int(x) for x in args.stages.split(",")):
                for mode in args.modes.split(","):
                    try:
                        fn, chk = run(mode, cache, sids, ns, grid, keys // 64 // split,
                                      args.workspace)
                        ms = triton.testing.do_bench(fn, warmup=5, rep=40)
                        print(f"| {t} | {split} | {grid} | {mode} | {ns} | {ms * 1e3:.1f} | "
                              f"{nbytes / ms / 1e6:.0f} | {chk} |", flush=True)
                    except Exception as e:  # a mode this Triton cannot build: say so, go on
                        print(f"| {t} | {split} | {grid} | {mode} | {ns} | failed: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |",
                              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
