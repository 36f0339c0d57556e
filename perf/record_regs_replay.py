"""The logical ops of ``record_regs_probe.py``'s kernel replayed in torch, on the CPU.

In Gluon a layout never changes a value (``reshape``, ``permute``, ``split`` and
``convert_layout`` are logical), so replaying the kernel's loads, permutations, matmuls and
output un-permutation in the same order checks its index algebra without a GPU:
:func:`replay` must agree with ``sparse_mla_decode_ref`` (``tests/perf/
test_record_regs_replay.py``). Each step names the kernel line it mirrors. fp16 rounding of
the operands is modelled (``_f16``); the accumulation is fp32.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

LOG2E = 1.4426950408889634
#: the output dim offset (2 t) of the kernel's accumulators o0 .. o7 (its splits' order)
TILE_OFFSETS = (0, 8, 4, 12, 2, 10, 6, 14)


def _e4m3(u8: torch.Tensor) -> torch.Tensor:
    return u8.view(torch.float8_e4m3fn).to(torch.float32)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _ue8m0(b: torch.Tensor) -> torch.Tensor:
    return _f16(torch.exp2(b.to(torch.float32) - 127))


def _scale_f32(b: torch.Tensor) -> torch.Tensor:
    """``(e8 << 23).to(float32, bitcast=True)``: ``2**(e - 127)`` exactly, 0 for ``e = 0``."""
    return torch.where(b == 0, 0.0, torch.exp2(b.to(torch.float32) - 127))


def _block(cache: torch.Tensor, ids: torch.Tensor, ok: torch.Tensor):
    """``_issue_ids``: the ring stage of 64 keys (zeros where ``ok`` is False)."""
    nb, page, _ = cache.shape
    flat = cache.reshape(nb, -1)
    nope = torch.zeros(8, 64, 64, dtype=torch.uint8)
    rope = torch.zeros(64, 64)
    scl = torch.zeros(64, 8, dtype=torch.uint8)
    for k in range(64):
        if ok[k]:
            pg, of = int(ids[k]) // page, int(ids[k]) % page
            rec = flat[pg, of * 576:of * 576 + 576]
            nope[:7, k] = rec[:448].reshape(7, 64)
            rope[k] = rec[448:].view(torch.bfloat16).float()
            scl[k] = flat[pg, page * 576 + of * 8:page * 576 + of * 8 + 8]
    return nope, rope, scl


def replay(q: torch.Tensor, sets: Sequence[Tuple[torch.Tensor, torch.Tensor,
                                                 Optional[torch.Tensor]]],
           sink: Optional[torch.Tensor], scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H <= 8, 512]``; ``sets``: one or two ``(cache [nb, page, 584] uint8, idx [T, K]
    slot ids, lens [T] or None)``; ``sink [H]`` or None. Returns ``(out [T, H, 512], lse [T,
    H])`` fp32 as the kernel computes them."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, 512)
    lse = torch.zeros(T, H)
    sink8 = torch.full((8,), float("-inf"))
    if sink is not None:
        sink8[:H] = sink.float()
    for t in range(T):
        qt = torch.zeros(8, 512)
        qt[:H] = q[t].float()
        qn = [_f16(qt[:, 64 * g:64 * g + 64]).reshape(8, 4, 4, 2, 2).permute(0, 2, 3, 1, 4)
              .reshape(8, 64).t() for g in range(7)]              # qn.index(g).store(...)
        qr = qt[:, 448:].to(torch.bfloat16).float().t()          # qr.store(...)
        m_i = torch.full((8,), float("-inf"))
        l_i = torch.zeros(8)
        o = [torch.zeros(64, 8) for _ in range(8)]
        orp = torch.zeros(64, 8)
        for cache, idx, lens in sets:
            K = idx.shape[1]
            n = K if lens is None else max(0, min(int(lens[t]), K))
            rows = cache.shape[0] * cache.shape[1]
            for j in range((n + 63) // 64):
                c = j * 64 + torch.arange(64)
                ids = torch.where(c < n, idx[t, c.clamp(max=K - 1)].long(), -1)
                ok = (c < n) & (ids >= 0) & (ids < rows)
                nope, rope, scl = _block(cache, ids, ok)
                acc = rope @ qr                                  # the RoPE S product
                for g in range(7):                               # the e4m3 S products
                    x = _f16(_e4m3(nope[g]))
                    x = x.reshape(64, 4, 4, 2, 2).permute(0, 2, 3, 1, 4).reshape(64, 64)
                    acc = acc + (x @ qn[g]) * _scale_f32(scl[:, g])[:, None]
                sco = torch.where(ok[:, None], acc * scale * LOG2E, float("-inf"))
                m_new = torch.maximum(m_i, sco.max(0).values)
                m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
                alpha = torch.exp2(m_i - m_safe)
                p = torch.exp2(sco - m_safe[None, :])
                l_i = l_i * alpha + p.sum(0)
                m_i = m_new
                o = [x * alpha[None, :] for x in o]
                orp = orp * alpha[None, :]
                pbf = p.to(torch.bfloat16).float()               # pbf.store
                p16 = _f16(p).reshape(16, 2, 2, 8).permute(0, 2, 1, 3).reshape(64, 8)
                orp = orp + rope.to(torch.bfloat16).float().t() @ pbf
                for b in range(4):                               # the O k16 steps
                    raw = nope[:, 16 * b:16 * b + 16, :]
                    e = scl[16 * b:16 * b + 16, :].t()
                    x = _f16(_e4m3(raw) * _ue8m0(e)[:, :, None])
                    x = x.reshape([2] * 13).permute(0, 1, 12, 2, 7, 8, 3, 4, 6, 5, 9, 10, 11)
                    x = x.reshape(64, 16, 2, 2, 2)
                    xa, xb = x.unbind(-1)
                    xaa, xab = xa.unbind(-1)
                    xba, xbb = xb.unbind(-1)
                    tiles = (*xaa.unbind(-1), *xab.unbind(-1), *xba.unbind(-1), *xbb.unbind(-1))
                    pb = p16[16 * b:16 * b + 16]
                    o = [o[i] + tiles[i] @ pb for i in range(8)]
        has = l_i != 0
        l_safe = torch.where(has, l_i, 1.0)
        den = l_safe + torch.exp2(sink8 * LOG2E - torch.where(has, m_i, 0.0))
        inv = torch.where(has, 1.0 / den, 0.0)
        lse[t] = torch.where(has, (m_i + torch.log2(l_safe)) * 0.6931471805599453,
                             float("inf"))[:H]
        m = torch.arange(64)
        dbase = 16 * (8 * (m // 16) + (m % 8)) + (m // 8) % 2   # the epilogue's dbase
        for i, off in enumerate(TILE_OFFSETS):
            d = dbase + off
            keep = d < 448
            out[t][:, d[keep]] = (o[i] * inv[None, :])[keep].t()[:H]
        out[t][:, 448:] = (orp * inv[None, :]).t()[:H]
    return out, lse
