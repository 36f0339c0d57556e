"""Can one warp feed both few-heads products from one register copy of its keys?
A compile probe for sm_90 (Gluon, Triton 3.6; no GPU needed), and a check on a GPU.

    python perf/movmatrix_probe.py            # SASS op counts (CPU)
    python perf/movmatrix_probe.py --check    # also runs it on a GPU against torch
    python perf/movmatrix_probe.py --rate     # GPU: MOVM warp instructions per clock per SM

With the keys as the MMA's M, ``S^T = K Q^T`` takes a key tile as the A operand ``[keys,
dims]`` and ``O^T = V^T P^T`` takes it transposed, ``[dims, keys]`` (V = K). A kernel that
reads the tile from shared memory twice (``ldmatrix`` and ``ldmatrix.trans``) moves 128 KB per
64-key block; this probe reads it once. The ``mma.sync`` A fragment of a ``[16, 64]`` tile is
16 registers per thread, each the thread's pair of one 8 x 8 block; ``movmatrix.trans``
transposes such a block across the warp, so the 16 transposed registers hold the warp's keys
as ``[64 dims, 16 keys]``: the tile ``t`` after it is ``t[8a + i, 8b + j] = K[8a + j, 8b + i]``,
which a reshape / permute / reshape names ``V^T`` without moving data, and which is already
the A fragment of ``O^T`` (checked in the PTX: the four transposed registers of one S k-step
are the four A registers of one O m-tile, in the order a0 a2 a1 a3).

One warp, one ``[16 keys, 64 dims]`` bf16 tile from global memory, ``Q^T [64, 8]`` and ``P^T
[16, 8]``: S^T (4 ``HMMA.16816``), 16 ``MOVM``, O^T (4 ``HMMA``), both stored in fp32.
Results: perf/NOTES.md, session 26.
"""
from __future__ import annotations

import os
import re
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dsv41_triton.attention.gluon import compile_check as cc  # noqa: E402
from dsv41_triton.attention.gluon.prefill_few_movm import _transpose_blocks  # noqa: E402

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1],
                                              instr_shape=[16, 8]))
A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))
KEYS, DIMS, HEADS = 16, 64, 8


@gluon.jit
def movmatrix_probe_kernel(k_ptr, qt_ptr, pt_ptr, s_ptr, o_ptr):
    """``s = K @ Q^T`` ``[16, 8]`` and ``o = K^T @ P^T`` ``[64, 8]`` (fp32), K ``[16, 64]``
    bf16 read once."""
    kr = gl.arange(0, 16, layout=gl.SliceLayout(1, A))
    kc = gl.arange(0, 64, layout=gl.SliceLayout(0, A))
    k = gl.load(k_ptr + kr[:, None] * 64 + kc[None, :])
    dr = gl.arange(0, 64, layout=gl.SliceLayout(1, B))
    hc = gl.arange(0, 8, layout=gl.SliceLayout(0, B))
    qt = gl.load(qt_ptr + dr[:, None] * 8 + hc[None, :])
    s = mma_v2(k, qt, gl.zeros([16, 8], gl.float32, layout=MMA))
    mr = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    mc = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    gl.store(s_ptr + mr[:, None] * 8 + mc[None, :], s)
    t = _transpose_blocks(k)
    vt = gl.reshape(gl.permute(gl.reshape(t, [2, 8, 8, 8]), (2, 1, 0, 3)), [64, 16])
    pr = gl.arange(0, 16, layout=gl.SliceLayout(1, B))
    pt = gl.load(pt_ptr + pr[:, None] * 8 + hc[None, :])
    o = mma_v2(gl.convert_layout(vt, A), pt, gl.zeros([64, 8], gl.float32, layout=MMA))
    orow = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    gl.store(o_ptr + orow[:, None] * 8 + mc[None, :], o)


@gluon.jit
def _swap_halves(x):
    """The control for ``_transpose_blocks``: a register-only op per register (``prmt``)."""
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x1032;", "=r,r", [x],
                                     dtype=gl.bfloat16, is_pure=True, pack=2)


@gluon.jit
def movmatrix_rate_kernel(x_ptr, out_ptr, rounds, MOVM: gl.constexpr):
    """One warp per CTA: ``rounds`` x 16 ``movmatrix`` (``MOVM``) or 16 ``prmt`` on one
    ``[16, 64]`` A-fragment tile, a dependent chain per register, then one store."""
    kr = gl.arange(0, 16, layout=gl.SliceLayout(1, A))
    kc = gl.arange(0, 64, layout=gl.SliceLayout(0, A))
    off = kr[:, None] * 64 + kc[None, :]
    x = gl.load(x_ptr + off)
    for _ in range(rounds):
        if MOVM:
            x = _transpose_blocks(x)
        else:
            x = _swap_halves(x)
    gl.store(out_ptr + gl.program_id(0) * 1024 + off, x)


def movmatrix_rate(rounds: int = 2048, ctas_per_sm: int = 16) -> dict:
    """``MOVM`` issue rate on the GPU: warp instructions per cycle per SM for ``movmatrix`` and
    for the ``prmt`` control (same loop, same registers), one-warp CTAs, ``ctas_per_sm`` per
    SM, from ``do_bench`` times and the SM clock ``torch.cuda.clock_rate`` (MHz)."""
    import torch
    import triton

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * ctas_per_sm
    x = torch.randn(16, 64, device="cuda").to(torch.bfloat16)
    out = torch.empty(grid, 16, 64, device="cuda", dtype=torch.bfloat16)
    mhz = torch.cuda.clock_rate() if hasattr(torch.cuda, "clock_rate") else 1980
    rec = {"sms": sms, "ctas": grid, "mhz": mhz}
    for name, movm in (("movm", True), ("prmt", False)):
        def fn():
            movmatrix_rate_kernel[(grid,)](x, out, rounds, MOVM=movm, num_warps=1)
        ms = triton.testing.do_bench(fn, warmup=5, rep=50)
        instrs = grid * rounds * 16
        rec[f"{name}_us"] = ms * 1e3
        rec[f"{name}_per_clk_per_sm"] = instrs / sms / (ms * 1e-3 * mhz * 1e6)
    rec["identity"] = bool(torch.equal(out[0], x))  # an even number of transposes
    return rec


_ARGS = [("k_ptr", "*bf16"), ("qt_ptr", "*bf16"), ("pt_ptr", "*bf16"), ("s_ptr", "*fp32"),
         ("o_ptr", "*fp32")]


def compile_probe(arch: int = 90):
    """The probe compiled for ``sm_<arch>``, one warp, all pointers 16-byte aligned."""
    return cc._compile(movmatrix_probe_kernel, _ARGS, tuple(n for n, _ in _ARGS), None, {}, 1,
                       arch)


def ptx_wiring(k) -> dict:
    """How the PTX wires the products: ``s_a`` / ``o_a`` the four A registers of each S k-step /
    O m-tile ``mma.sync``, ``o_from_s`` whether O m-tile ``i``'s A is ``movmatrix`` of S
    k-step ``i``'s a0, a2, a1, a3: the fragment order of the transposed 16 x 16 tile (a0 rows
    0-7 x cols 0-7, a1 rows 8-15 x cols 0-7, a2 rows 0-7 x cols 8-15, a3 rows 8-15 x cols 8-15)."""
    ptx = k.asm["ptx"]
    mmas = re.findall(r"mma\.sync\.aligned\.m16n8k16\S*\s+\{[^}]*\},\s*\{([^}]*)\}", ptx)
    regs = [[r.strip() for r in m.split(",")] for m in mmas]
    trans = dict((d, s) for d, s in re.findall(
        r"movmatrix\.sync\.aligned\.m8n8\.trans\.b16\s+(%r\d+),\s*(%r\d+);", ptx))
    s_a, o_a = regs[:len(regs) // 2], regs[len(regs) // 2:]
    ok = len(s_a) == len(o_a) == 4 and all(
        [trans.get(r) for r in o] == [s[0], s[2], s[1], s[3]] for s, o in zip(s_a, o_a))
    return {"s_a": s_a, "o_a": o_a, "movmatrix": len(trans), "o_from_s": ok}


def check_on_gpu(seed: int = 0) -> dict:
    """The probe on random inputs on the GPU against torch: relative errors of S and O."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(KEYS, DIMS, device="cuda", generator=g).to(torch.bfloat16)
    qt = torch.randn(DIMS, HEADS, device="cuda", generator=g).to(torch.bfloat16)
    pt = torch.rand(KEYS, HEADS, device="cuda", generator=g).to(torch.bfloat16)
    s = torch.full((KEYS, HEADS), float("nan"), device="cuda")
    o = torch.full((DIMS, HEADS), float("nan"), device="cuda")
    movmatrix_probe_kernel[(1,)](k, qt, pt, s, o, num_warps=1)
    s_ref, o_ref = k.float() @ qt.float(), k.float().t() @ pt.float()

    def rel(x, y):
        return float((x - y).norm() / y.norm())
    return {"s_rel": rel(s, s_ref), "o_rel": rel(o, o_ref)}


def facts() -> dict:
    """Op counts of the sm_90 build and its PTX wiring (``ptx_wiring``)."""
    k = compile_probe()
    return {**cc.sass_op_counts(k), **ptx_wiring(k)}


if __name__ == "__main__":
    import json
    rec = facts()
    if "--check" in sys.argv:
        rec.update(check_on_gpu())
    if "--rate" in sys.argv:
        rate = movmatrix_rate()
        rec.update(rate)
        print(rate)
    if "--json" in sys.argv:
        print(json.dumps(rec))
    else:
        keep = ("LDG", "LDS", "STS", "LDSM", "SHFL", "MOVM", "HMMA", "PRMT")
        print(", ".join(f"{o} {rec.get(o, 0)}" for o in keep))
        print("O's A registers are movmatrix of S's (a0 a2 a1 a3):", rec["o_from_s"])
        if "--check" in sys.argv:
            print(f"S rel err {rec['s_rel']:.2e}, O rel err {rec['o_rel']:.2e}")
