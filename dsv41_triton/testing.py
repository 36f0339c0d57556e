"""Helpers for tests and benchmarks: poisoning outputs, error figures, random inputs.

Public so that forks can check their own kernels against ours the same way.
"""
from __future__ import annotations

from typing import Optional

import torch

#: value written into float outputs before a kernel runs: any unwritten element stays NaN
POISON_FLOAT = float("nan")
#: byte written into uint8 outputs/caches: unlikely to be produced by any encoder
POISON_BYTE = 0xA5
POISON_INT = -123456789


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no kernel produces (NaN, 0xA5, -123456789)."""
    if t.dtype.is_floating_point:
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        else:
            t.fill_(POISON_FLOAT)
    elif t.dtype == torch.uint8:
        t.fill_(POISON_BYTE)
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(POISON_INT)
    return t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``||out - ref|| / ||ref||`` in float64 (``inf`` on NaN)."""
    o, r = out.double(), ref.double()
    if torch.isnan(o).any():
        return float("inf")
    den = r.norm().item()
    num = (o - r).norm().item()
    return num / den if den > 0 else num


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |out - ref| treating equal infinities as equal; ``inf`` on NaN."""
    o, r = out.double(), ref.double()
    if torch.isnan(o).any() or torch.isnan(r).any():
        return float("inf")
    same = o == r  # covers +inf == +inf
    d = torch.where(same, torch.zeros_like(o), (o - r).abs())
    return d.max().item() if d.numel() else 0.0


def random_bf16(*shape: int, device="cpu", scale: float = 1.0, generator: Optional[torch.Generator] = None):
    """Random normal bf16 with a few outliers per row, never zeros; drawn where ``generator``
    lives (CPU by default), then moved to ``device``."""
    gdev = generator.device if generator is not None else device
    x = torch.randn(*shape, device=gdev, generator=generator) * scale
    return x.to(device=device, dtype=torch.bfloat16)


def random_block_table(
    num_reqs: int, max_blocks: int, num_blocks: int, device="cpu", generator=None
) -> torch.Tensor:
    """``[num_reqs, max_blocks]`` int32 of distinct random block ids in ``[0, num_blocks)``."""
    if num_reqs * max_blocks > num_blocks:
        raise ValueError("num_blocks too small for distinct blocks")
    perm = torch.randperm(num_blocks, generator=generator)[: num_reqs * max_blocks]
    return perm.view(num_reqs, max_blocks).to(torch.int32).to(device)


def random_k_cache(
    num_blocks: int,
    page_size: int,
    record,
    device="cpu",
    *,
    scale: float = 1.0,
    block_stride: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """A paged cache whose every slot holds a real record (``records.encode_records_ref`` of
    random bf16 rows times ``scale``), padding bytes random: no slot decodes to NaN/inf."""
    from .ops.records import allocate_k_cache, encode_records_ref, get_record_format, record_views

    fmt = get_record_format(record)
    cache = allocate_k_cache(num_blocks, page_size, fmt, device, block_stride=block_stride)
    k = random_bf16(num_blocks * page_size, 512, device=device, scale=scale, generator=generator)
    data, scales = encode_records_ref(k, fmt)
    dv, sv = record_views(cache, fmt)
    dv.copy_(data.view(num_blocks, page_size, fmt.data_bytes))
    sv.copy_(scales.view(num_blocks, page_size, fmt.scale_bytes))
    return cache


def large_offset_decode_case(device, T: int = 4, H: int = 16, W: int = 96) -> dict:
    """``sparse_mla_decode`` arguments over a 584-record cache of > 2 GiB whose slots all lie in
    its last 48 blocks (byte offsets past ``2**31``); only those slots hold records."""
    from .ops.records import allocate_k_cache, encode_records_ref, get_record_format, record_views

    page, fmt = 64, get_record_format(584)
    nb = (2 ** 31) // fmt.block_bytes(page) + 64
    cache = allocate_k_cache(nb, page, fmt, device)
    assert cache.shape[0] * cache.stride(0) > 2 ** 31
    lo = (nb - 48) * page
    slots = torch.randint(lo, nb * page, (T, W), dtype=torch.int32, device=device)
    uniq = torch.unique(slots)
    k = torch.randn(uniq.numel(), 512, device=device).to(torch.bfloat16)
    data, scales = encode_records_ref(k, fmt)
    dv, sv = record_views(cache, fmt)
    dv[uniq // page, uniq % page] = data
    sv[uniq // page, uniq % page] = scales
    q = torch.randn(T, H, 512, device=device).to(torch.bfloat16)
    lens = torch.full((T,), W, dtype=torch.int32, device=device)
    return dict(q=q, swa_cache=cache, swa_indices=slots, swa_lens=lens,
                attn_sink=torch.randn(H, device=device))


def assert_graph_replay(op, static: dict, fresh: dict, out: torch.Tensor, ref, *,
                        out_tol: float, lse_tol: float, **kwargs) -> None:
    """CUDA-graph safety of an attention op returning ``(out, lse)``: ``op(**static, out=out,
    **kwargs)`` runs once eagerly, is captured, then ``fresh``'s tensors are copied into
    ``static``'s of the same names, ``out`` is poisoned and the graph replayed. The replay's
    ``out`` / ``lse`` must equal an eager call's bit for bit and ``ref(**static)`` within
    ``out_tol`` (relative Frobenius) / ``lse_tol`` (max abs)."""
    op(**static, out=out, **kwargs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, lse_g = op(**static, out=out, **kwargs)
    for name, t in fresh.items():
        static[name].copy_(t)
    poison_(out)
    g.replay()
    torch.cuda.synchronize()
    o_e, l_e = op(**static, **kwargs)
    assert torch.equal(out, o_e) and torch.equal(lse_g, l_e)
    ro, rl = ref(**static)
    e_o, e_l = rel_err(out, ro), max_abs_err(lse_g, rl)
    assert e_o <= out_tol and e_l <= lse_tol, (e_o, e_l)
