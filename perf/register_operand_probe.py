"""Can a few-heads kernel feed both wgmma products from record bytes held in registers?
A compile-only probe for sm_90 (Gluon, Triton 3.6; no GPU needed).

    python perf/register_operand_probe.py

With heads as the wgmma N (swap-AB), both products take the key block as the A operand:
``S^T = K Q^T`` (keys as M, dims as K) and ``O^T = V^T P^T`` (dims as M, keys as K). If a
thread can load its A elements straight from a record row and reach the A register layout
(fp16, ``k_width`` 2) without shared memory, a kernel needs no dequantized key tile: the
record is written to shared memory once and read once per product. Both probes permute what
the products contract over (dims for S, keys for O) and, for O, the output dims, so that a
thread's elements are whole runs of one key's bytes:

* ``qk``: a thread reads 16 consecutive bytes of its key per 64-dim chunk (logical dim
  ``16 b + 8 u + 2 c + v`` is byte ``16 c + 4 b + 2 u + v``);
* ``pv``: a thread reads 2 consecutive bytes (dims) of each of its 16 keys.

Each probe loads one 64-key x 64-dim e4m3 chunk (rows ``stride`` bytes apart), converts it to
fp16 and issues the wgmma. ``compile_check.sass_op_counts`` gives the SASS opcode counts: with
no ``LDS``, ``STS`` (beyond the B tile's one) or ``SHFL``, the operand never touched shared
memory.

``ring_probe_kernel`` checks, at compile time (``gl.bank_conflicts``), that one ring layout
serves both products' 16-byte reads without bank conflicts: a 64-key block as ``[8 groups, 64
keys, 64 bytes]``, 16-byte chunks swizzled by ``(key // 2) % 4``; S reads 16 bytes of one key
per group, O reads a thread's 16 bytes of each of its keys, with the keys of a warp's lanes
``k, k + 1, k + 4, k + 5`` (the order P^T is then laid out in). Its compile fails otherwise.
Results: perf/NOTES.md, session 14.
"""
from __future__ import annotations

import os
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                              warpgroup_mma_wait)

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv41_triton.attention.gluon import compile_check as cc  # noqa: E402
from dsv41_triton.attention.gluon._api import barrier  # noqa: E402

ROW_BYTES = 584


@gluon.jit
def _mma_and_store(a, b_ptr, o_ptr):
    """``a [64, 64]`` fp16 (A layout) times a ``[64, 8]`` fp16 tile from ``b_ptr``, stored."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8, 16])
    BL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 8], gl.float16)
    LB: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])
    kk = gl.arange(0, 64, layout=gl.SliceLayout(1, LB))
    nn = gl.arange(0, 8, layout=gl.SliceLayout(0, LB))
    b = gl.allocate_shared_memory(gl.float16, [64, 8], BL)
    b.store(gl.load(b_ptr + kk[:, None] * 8 + nn[None, :]))
    fence_async_shared()
    acc = gl.zeros([64, 8], gl.float32, layout=MMA)
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    mr = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    mn = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    gl.store(o_ptr + mr[:, None] * 8 + mn[None, :], acc)


@gluon.jit
def qk_probe_kernel(k_ptr, b_ptr, o_ptr, STRIDE: gl.constexpr):
    """K as the A operand of S^T: ``[key, c, 16 bytes]`` loaded, split into ``[key, c, b, u,
    v]``, permuted to ``[key, b, u, c, v]`` = ``[64 keys, 64 dims]``."""
    L3: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, 16])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    w = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    row = gl.multiple_of(r * STRIDE, 8)
    x = gl.load(k_ptr + row[:, None, None] + c[None, :, None] * 16 + w[None, None, :])
    x = x.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    a = gl.reshape(gl.permute(gl.reshape(x, [64, 4, 4, 2, 2]), (0, 2, 3, 1, 4)), [64, 64])
    _mma_and_store(gl.convert_layout(a, AL), b_ptr, o_ptr)


@gluon.jit
def pv_probe_kernel(k_ptr, b_ptr, o_ptr, STRIDE: gl.constexpr):
    """V^T as the A operand of O^T: ``[key, memory dim]`` loaded (key ``16 b + 8 u + 2 c + v``,
    byte ``16 w + 2 q + s``), permuted to ``[w, s, q | b, u, c, v]`` = ``[64 dims, 64 keys]``."""
    L2: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [1, 0], [8, 0], [16, 0], [32, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]],
        warp_bases=[[0, 16], [0, 32]], block_bases=[], shape=[64, 64])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 8, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    key = gl.arange(0, 64, layout=gl.SliceLayout(1, L2))
    md = gl.arange(0, 64, layout=gl.SliceLayout(0, L2))
    x = gl.load(k_ptr + gl.multiple_of(key * STRIDE, 8)[:, None] + md[None, :])
    x = x.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    x = gl.permute(gl.reshape(x, [4, 2, 4, 2, 4, 8, 2]), (4, 6, 5, 0, 1, 2, 3))
    _mma_and_store(gl.convert_layout(gl.reshape(x, [64, 64]), AL), b_ptr, o_ptr)


@gluon.jit
def ring_probe_kernel(k_ptr, o_ptr, SWIZZLE: gl.constexpr = True):
    """Both read layouts on the ring (``SWIZZLE``: the swizzled one, else plain rows);
    ``static_assert`` of no bank conflicts."""
    if SWIZZLE:
        RL: gl.constexpr = gl.SwizzledSharedLayout(16, 2, 4, [2, 1, 0])
    else:
        RL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
    # S: [group, key, byte]; a thread: 16 bytes of keys r and r + 8 in every group
    SL: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 8, 0], [1, 0, 0], [2, 0, 0],
                   [4, 0, 0]],
        lane_bases=[[0, 0, 16], [0, 0, 32], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[0, 16, 0], [0, 32, 0]], block_bases=[], shape=[8, 64, 64])
    # O: a thread (warp w, lane bits q): bytes 16 q .. 16 q + 15 of its 16 keys (lanes: keys
    # +1, +4; registers: +2, +8, +16, +32), i.e. 16 consecutive record dims
    OL: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 2, 0], [0, 8, 0], [0, 16, 0],
                   [0, 32, 0]],
        lane_bases=[[0, 1, 0], [0, 4, 0], [0, 0, 16], [0, 0, 32], [1, 0, 0]],
        warp_bases=[[2, 0, 0], [4, 0, 0]], block_bases=[], shape=[8, 64, 64])
    ring = gl.allocate_shared_memory(gl.uint8, [8, 64, 64], RL)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [8, 64, 64], SL),
                                       ring.type) == 0)
    gl.static_assert(gl.bank_conflicts(gl.distributed_type(gl.uint8, [8, 64, 64], OL),
                                       ring.type) == 0)
    BL: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, 4, 1], [2, 1, 0])
    g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, BL)))
    k = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, BL)))
    b = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, BL)))
    off = g[:, None, None] * 4096 + k[None, :, None] * 64 + b[None, None, :]
    ring.store(gl.load(k_ptr + off))
    barrier()
    x = gl.convert_layout(ring.load(SL), BL) + gl.convert_layout(ring.load(OL), BL)
    gl.store(o_ptr + off, x)


def compile_probe(kind: str, stride: int = ROW_BYTES, arch: int = 90, swizzle: bool = True):
    """``kind`` "qk", "pv" or "ring" (``swizzle``: its ring layout) compiled for ``sm_<arch>``
    (one warpgroup)."""
    if kind == "ring":
        return cc._compile(ring_probe_kernel, [("k_ptr", "*u8"), ("o_ptr", "*u8")], (), None,
                           dict(SWIZZLE=swizzle), 4, arch)
    kern = {"qk": qk_probe_kernel, "pv": pv_probe_kernel}[kind]
    args = [("k_ptr", "*u8"), ("b_ptr", "*fp16"), ("o_ptr", "*fp32")]
    return cc._compile(kern, args, (), None, dict(STRIDE=stride), 4, arch)


def main() -> None:
    keep = ("LDG", "LDS", "STS", "SHFL", "PRMT", "F2FP", "HGMMA")
    for kind in ("qk", "pv"):
        ops = cc.sass_op_counts(compile_probe(kind))
        print(f"{kind}: " + ", ".join(f"{o} {ops[o]}" for o in keep))
    compile_probe("ring")
    print("ring: both reads conflict-free on the swizzled layout (its static_asserts held)")


if __name__ == "__main__":
    if "--json" in sys.argv:  # for tests/perf: op counts, then whether each ring layout compiles
        import json
        rec = {kind: dict(cc.sass_op_counts(compile_probe(kind))) for kind in ("qk", "pv")}
        for swz in (True, False):
            try:
                compile_probe("ring", swizzle=swz)
                rec[f"ring_swizzle_{swz}"] = "compiled"
            except Exception as e:  # noqa: BLE001 - the static_assert's compile error
                rec[f"ring_swizzle_{swz}"] = f"failed: {type(e).__name__}: {str(e)[-300:]}"
        print(json.dumps(rec))
    else:
        main()
