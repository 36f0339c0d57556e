"""A vectorized emulator of the few PTX instructions the Gluon decode kernels' inline-asm
dequantizers use, so their bit tricks are checked on the CPU against plain decodes.

``run(asm, inputs, n_out)``: ``asm`` is an ``inline_asm_elementwise`` body (``$k`` operands,
outputs first), ``inputs`` one uint32 numpy array per input operand (all the same length);
returns the ``n_out`` output registers as uint32 arrays. Supported: ``.reg`` declarations,
``mov.b32`` (register, immediate, or ``{lo, hi}`` packing / unpacking of .b16 halves),
``and`` / ``or`` / ``xor`` / ``shl`` / ``shr`` ``.b32``, ``prmt.b32`` (default mode),
``mul.rn.bf16x2``, ``mul.rn.f16x2``, ``cvt.rn.f16x2.e4m3x2``, ``cvt.f32.f16``, ``mul.f32`` and
``cvt.rn.bf16x2.f32``. Anything else raises, so a test cannot pass on an instruction it did not
model. Products are formed in float64 and rounded (to fp32, then bf16 where the instruction
does): exact for the dequantizers' products, which need at most 8 significant bits.
"""
from __future__ import annotations

import re

import numpy as np
import torch

_M32 = np.uint64(0xFFFFFFFF)


def _u32(x):
    return np.asarray(x, dtype=np.uint64) & _M32


def _bf16_to_f32(h):
    return (_u32(h).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _f32_to_bf16_rn(f):
    t = torch.from_numpy(np.ascontiguousarray(f, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().astype(np.uint16).astype(np.uint64)


def _f16_to_f32(h):
    return _u32(h).astype(np.uint16).view(np.float16).astype(np.float32)


def _e4m3_to_f16(b):
    t = torch.from_numpy(_u32(b).astype(np.uint8)).view(torch.float8_e4m3fn).to(torch.float16)
    return t.view(torch.int16).numpy().astype(np.uint16).astype(np.uint64)


def _prmt(a, b, c):
    src = [(a >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    src += [(b >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)]
    stack = np.stack(src)
    out = np.zeros_like(a)
    for i in range(4):
        sel = (c >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = np.take_along_axis(stack, (sel & np.uint64(7)).astype(np.int64)[None], 0)[0]
        rep = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        byte = np.where(sel & np.uint64(8), rep, byte)
        out |= byte << np.uint64(8 * i)
    return out


def _split(v):
    return v & np.uint64(0xFFFF), (v >> np.uint64(16)) & np.uint64(0xFFFF)


def run(asm: str, inputs, n_out: int):
    n = len(inputs[0])
    regs = {}
    for k, v in enumerate(inputs):
        regs[f"${n_out + k}"] = _u32(v)

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return np.full(n, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint64)
        raise KeyError(f"unknown operand {tok!r}")

    body = asm.strip().strip("{}")
    for stmt in body.split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        args = [a.strip() for a in re.split(r",(?![^{]*})", rest)]
        if op == "mov.b32":
            dst, src = args
            if dst.startswith("{"):  # unpack a b32 into two b16 halves
                lo, hi = (x.strip() for x in dst.strip("{}").split(","))
                regs[lo], regs[hi] = _split(val(src))
            elif src.startswith("{"):  # pack two b16 halves
                lo, hi = (x.strip() for x in src.strip("{}").split(","))
                regs[dst] = (val(lo) & np.uint64(0xFFFF)) | (val(hi) << np.uint64(16))
            else:
                regs[dst] = val(src)
        elif op in ("and.b32", "or.b32", "xor.b32"):
            a, b = val(args[1]), val(args[2])
            regs[args[0]] = {"and.b32": a & b, "or.b32": a | b, "xor.b32": a ^ b}[op]
        elif op == "shl.b32":
            regs[args[0]] = _u32(val(args[1]) << (val(args[2]) & np.uint64(31)))
        elif op == "shr.b32":
            regs[args[0]] = val(args[1]) >> (val(args[2]) & np.uint64(31))
        elif op == "prmt.b32":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "mul.rn.bf16x2":
            (alo, ahi), (blo, bhi) = _split(val(args[1])), _split(val(args[2]))
            with np.errstate(invalid="ignore", over="ignore"):
                lo = _bf16_to_f32(alo).astype(np.float64) * _bf16_to_f32(blo)
                hi = _bf16_to_f32(ahi).astype(np.float64) * _bf16_to_f32(bhi)
                lo, hi = _f32_to_bf16_rn(lo), _f32_to_bf16_rn(hi)
            regs[args[0]] = lo | (hi << np.uint64(16))
        elif op == "mul.rn.f16x2":
            (alo, ahi), (blo, bhi) = _split(val(args[1])), _split(val(args[2]))
            with np.errstate(invalid="ignore", over="ignore"):
                lo = (_f16_to_f32(alo).astype(np.float64) * _f16_to_f32(blo)).astype(np.float16)
                hi = (_f16_to_f32(ahi).astype(np.float64) * _f16_to_f32(bhi)).astype(np.float16)
            regs[args[0]] = (lo.view(np.uint16).astype(np.uint64)
                             | (hi.view(np.uint16).astype(np.uint64) << np.uint64(16)))
        elif op == "cvt.rn.f16x2.e4m3x2":  # the low byte -> the low half
            v = val(args[1])
            lo = _e4m3_to_f16(v & np.uint64(0xFF))
            hi = _e4m3_to_f16((v >> np.uint64(8)) & np.uint64(0xFF))
            regs[args[0]] = lo | (hi << np.uint64(16))
        elif op == "cvt.f32.f16":
            regs[args[0]] = _f16_to_f32(val(args[1])).view(np.uint32).astype(np.uint64)
        elif op == "mul.f32":
            a = val(args[1]).astype(np.uint32).view(np.float32).astype(np.float64)
            b = val(args[2]).astype(np.uint32).view(np.float32).astype(np.float64)
            with np.errstate(invalid="ignore", over="ignore"):
                p = (a * b).astype(np.float32)
            regs[args[0]] = p.view(np.uint32).astype(np.uint64)
        elif op == "cvt.rn.bf16x2.f32":  # d = {a -> upper half, b -> lower half}
            a = val(args[1]).astype(np.uint32).view(np.float32)
            b = val(args[2]).astype(np.uint32).view(np.float32)
            regs[args[0]] = _f32_to_bf16_rn(b) | (_f32_to_bf16_rn(a) << np.uint64(16))
        else:
            raise NotImplementedError(f"ptx_emu: {op!r} is not modelled")
    return [regs[f"${k}"].astype(np.uint32) for k in range(n_out)]
