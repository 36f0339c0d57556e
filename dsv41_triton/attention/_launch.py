"""Host side of the sparse MLA kernel: ``KeySet`` (one key source) and ``launch`` (the fwd
kernel of ``_sparse_kernel.py``, then the split merge of ``_merge_kernel.py`` when splitting).
Launch shapes come from ``_configs.py``."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .._utils import HEAD_DIM, cdiv, is_interpreter, next_power_of_2
from ._configs import MIN_BLOCK_N_GPU, KernelConfig, default_config
from ._merge_kernel import HAS_GDC, _merge_kernel
from ._sparse_kernel import SRC_BF16, SRC_BYTES, _sparse_mla_fwd_grouped_kernel

LOG2E = 1.4426950408889634
#: DSV41_PDL=0 turns the programmatic dependent launch of the split merge off (benchmarks)
PDL_ENV = "DSV41_PDL"
#: a split merge of at most this many (token, head tile) programs is latency-bound: it loads
#: every split's partial at once over value-dim chunks, and follows the tl split kernel as a
#: programmatic dependent launch. H200 (one run, us): 64 h T=1 auto 16.8 -> 14.1, tl 18.7 ->
#: 15.3; 8 h T=1 13.9 -> 12.8. With 128 programs (8 h T=128) both lost (Gluon 39.2 -> 41.4,
#: tl 41.6 -> 48.0), so larger merges keep the loop over splits and the plain launch.
SMALL_MERGE = 16

#: the last attention launch's compiled kernel and config (for benchmarks: registers, spills)
LAST_LAUNCH = {}


@dataclass(frozen=True)
class KeySet:
    """One key source for the kernel. ``src``: 0 (bf16 rows), 584, 528 or 288.
    ``k``: the cache ``[nb, page, bytes]`` uint8 or the workspace ``[S, 512]`` bf16;
    ``indices [T, width]``; ``lens [T]`` or None; ``bstride``: block stride in bytes (rows:
    row stride in elements); ``rows``: number of valid slots / rows."""

    src: int
    k: torch.Tensor
    indices: torch.Tensor
    lens: Optional[torch.Tensor]
    bstride: int
    page: int
    rows: int


def _page_log2(page: int) -> int:
    """log2(page) for a power of two (the kernel shifts instead of dividing), else -1."""
    return page.bit_length() - 1 if page > 0 and page & (page - 1) == 0 else -1


def launch(q: torch.Tensor, a: KeySet, b: Optional[KeySet], sink: Optional[torch.Tensor],
           softmax_scale: float, out: torch.Tensor, lse: torch.Tensor,
           config: Optional[KernelConfig] = None, prior: bool = False) -> None:
    """Run the kernel on validated arguments (no checks here; see decode.py/prefill.py).

    ``prior``: ``out``/``lse`` hold a normalized partial of other keys to merge with (the
    kernel's ``PRIOR``; one split)."""
    T, H, _ = q.shape
    if T == 0 or H == 0:
        return
    cfg = config or default_config(T, H, a.indices.shape[1] + (b.indices.shape[1] if b else 0),
                                   q.device, paged=a.src != SRC_BF16)
    if q.device.type == "cuda" and not is_interpreter() and cfg.block_n < MIN_BLOCK_N_GPU:
        raise ValueError(f"config: block_n must be >= {MIN_BLOCK_N_GPU} on a GPU, got "
                         f"{cfg.block_n} (16-key blocks gave wrong results on an H200 with "
                         f"triton 3.6)")
    bh, ns = cfg.block_h, (1 if prior else cfg.num_splits)
    n_ht = cdiv(H, bh)
    interp = is_interpreter()
    bb = b if b is not None else a
    args, po, pl, sink_arg, sink_st = kernel_args(q, a, b, sink, out, lse, ns)
    da, sa = SRC_BYTES[a.src]
    db, sbb = SRC_BYTES[bb.src]
    grid = (T * ns * n_ht,)
    args = args + (H, float(softmax_scale) * LOG2E, ns, n_ht)
    kw = dict(SRC_A=a.src, DATA_A=da, SCALE_A=sa, SRC_B=bb.src, DATA_B=db, SCALE_B=sbb,
              HAS_B=b is not None, HAS_LEN_A=a.lens is not None,
              HAS_LEN_B=bb.lens is not None, HAS_SINK=sink is not None,
              SPLIT=ns > 1, BH=bh, BN=cfg.block_n, DOT_F32=interp, SW=interp,
              num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    pdl = ns > 1 and small_merge(T, H) and pdl_enabled(q.device)
    k = _sparse_mla_fwd_grouped_kernel[grid](*args, PAGE_LOG2_A=_page_log2(a.page),
                                             PAGE_LOG2_B=_page_log2(bb.page),
                                             LAZY=cfg.lazy_rescale, PDL=pdl, PRIOR=prior,
                                             **kw)
    LAST_LAUNCH["fwd"] = (k, cfg)
    if ns > 1:
        merge_splits(po, pl, sink, sink_arg, sink_st, out, lse, ns, sw=interp, pdl=pdl)


def kernel_args(q: torch.Tensor, a: KeySet, b: Optional[KeySet], sink: Optional[torch.Tensor],
                out: torch.Tensor, lse: torch.Tensor, ns: int):
    """The positional arguments the decode kernels share (q, both key sets, the sink, out/lse
    and the split partials), the split buffers ``po [T, ns, H, 512]`` / ``pl [T, ns, H]`` fp32
    (``lse`` stands in when ``ns == 1``) and the sink pointer/stride the merge takes too."""
    T, H, _ = q.shape
    bb = b if b is not None else a
    if ns > 1:
        po = torch.empty((T, ns, H, HEAD_DIM), dtype=torch.float32, device=q.device)
        pl = torch.empty((T, ns, H), dtype=torch.float32, device=q.device)
    else:
        po = pl = lse  # unused
    sink_arg = sink if sink is not None else lse
    sink_st = sink.stride(0) if sink is not None else 0

    def _lens(ks):
        return (ks.lens if ks.lens is not None else ks.indices,
                ks.lens.stride(0) if ks.lens is not None else 0)

    a_len, a_len_st = _lens(a)
    b_len, b_len_st = _lens(bb)
    args = (
        q, q.stride(0), q.stride(1),
        a.k, a.indices, a.indices.stride(0), a_len, a_len_st, a.indices.shape[1], a.bstride,
        a.page, a.rows,
        bb.k, bb.indices, bb.indices.stride(0), b_len, b_len_st, bb.indices.shape[1],
        bb.bstride, bb.page, bb.rows,
        sink_arg, sink_st,
        out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1),
        po, pl,
    )
    return args, po, pl, sink_arg, sink_st


@functools.lru_cache(maxsize=16)
def _pdl_capable(device: torch.device) -> bool:
    return (HAS_GDC and device.type == "cuda" and not torch.version.hip
            and torch.cuda.get_device_capability(device) >= (9, 0))


def pdl_enabled(device: torch.device) -> bool:
    """Whether the ``tl`` split kernel's merge is a programmatic dependent launch (sm_90+,
    CUDA, a Triton with ``gdc_wait``; not in the interpreter; ``DSV41_PDL=0`` turns it off):
    the split kernel triggers it at its start, so the merge's launch overlaps the split
    kernel (used for ``small_merge`` launches: H200 0.5-0.8 us less at T = 1, 0.7 us more at 8
    heads T = 128; the Gluon split kernels measured 0.3-1.0 us slower with it, so they launch
    the merge plainly)."""
    return (not is_interpreter() and os.environ.get(PDL_ENV, "1") != "0"
            and _pdl_capable(device))


def _merge_head_tile(H: int) -> int:
    return min(16, next_power_of_2(H))


def small_merge(T: int, H: int) -> bool:
    """Whether the split merge of ``T`` tokens x ``H`` heads has at most ``SMALL_MERGE``
    (token, head tile) programs."""
    return T * cdiv(H, _merge_head_tile(H)) <= SMALL_MERGE


def merge_splits(po, pl, sink, sink_arg, sink_st, out, lse, ns: int, sw: bool,
                 pdl: bool = False) -> None:
    """Merge ``ns`` split partials into ``out``/``lse`` and apply the sink (one launch;
    ``pdl``: a programmatic dependent launch of the split kernel just launched, which triggers
    it)."""
    T, H = out.shape[0], out.shape[1]
    mbh = _merge_head_tile(H)
    m_ht = cdiv(H, mbh)
    nsp = max(2, next_power_of_2(ns))
    # a small merge: value-dim chunks with all splits' [nsp, mbh, dc] partials in <= 8192
    # fp32 registers; else one program per (token, head tile) looping over the splits
    dc = max(16, min(128, 8192 // (nsp * mbh))) if small_merge(T, H) else HEAD_DIM
    extra = dict(launch_pdl=True) if pdl else {}
    _merge_kernel[(T * m_ht * (HEAD_DIM // dc),)](
        po, pl, sink_arg, sink_st, out, out.stride(0), out.stride(1),
        lse, lse.stride(0), lse.stride(1), H, ns, m_ht,
        NSP=nsp, BH=mbh, HAS_SINK=sink is not None, SW=sw, DC=dc, PDL=pdl, num_warps=4,
        **extra,
    )


__all__ = ["KeySet", "KernelConfig", "launch", "LAST_LAUNCH", "SRC_BF16"]
