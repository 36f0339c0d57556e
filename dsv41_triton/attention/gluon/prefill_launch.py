"""Host side of the Gluon prefill kernel: when it applies, the pick table, the launch.

``usable(q, kv, indices)`` says whether the kernel can run these arguments (sm_90, Gluon
present, 16-byte aligned q / workspace rows); ``pick(T, H, device)`` says whether the auto path
should take it (``PICK``, measured on an H200; ``DSV41_PREFILL_KERNEL`` overrides);
``launch`` runs it on arguments that ``prefill.py`` already validated. Importing this module
never fails: without a usable Gluon every query answers False.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..._utils import cdiv, is_interpreter
from . import AVAILABLE, REASON
from . import launch as _decode_launch
from .launch import _cap, _sms

#: the pick table: (major, minor) -> {heads bucket: variant}. Heads buckets: 8 (H <= 8), 16,
#: 32, 64 (33..64), 128 (65..128), 1 << 30 (more); variants: "eager" (the O rescale every
#: block) or "lazy" (only when a row's max grows by > 2**8). Only buckets where the Gluon kernel
#: measured faster than the tl kernel on the H200 are listed (perf/NOTES.md, "Gluon sm_90
#: prefill (many heads)"); a missing key means tl.
PICK = {
    # H200, triton 3.6, 2026-12-01, 4096 tokens x 640 keys of a 32768-row workspace, sink on,
    # CUDA graph, L2 flushed, one run (tl / gluon eager / FlashMLA): 64 heads 1466.5 / 1108.7 /
    # 654.1 us, 128 heads 2897.0 / 2166.1 / 1281.8 us; 8 heads 551.5 / 950.1 (gluon pads to 64
    # heads). tl tiles 33..64 heads as one 64-head tile and 65..128 as two, like this kernel.
    # Warp-specialized kernel (prefill_ws.py), same method, one run: tl / eager / ws / FlashMLA
    # 64 heads 1472.3 / 1113.7 / 930.0 / 653.7 us, 128 heads 2920.2 / 2175.8 / 1819.3 / 1290.0.
    # Persistent warp-specialized kernel (prefill_wsp.py), 2026-12-02, one run: wsp / ws /
    # FlashMLA 64 heads 666.1 / 740.0 / 655.5 us, 128 heads 1266.0 / 1436.3 / 1287.2.
    # Few-heads kernel (prefill_few.py: keys as the wgmma M), 2026-12-02, one run: 8 heads
    # tl / few 550.0 / 482.9 us (640 keys), 455.6 / 396.5 (the 512 top-k keys alone); 128
    # tokens x 640 keys 34.1 / 26.4, 512 x 4096 435.0 / 367.8; 1 token 11.5 / 19.4 (hence
    # FEW_MIN_TOKENS). H100, 2026-12-05 (session 28), 128-byte row copies, one run: 8 heads
    # 4096 x 640 tl / few at one / two CTAs per SM 571.2 / 453.2 / 428.4 us, 1024 x 640 157.0 /
    # 127.9 / 126.8, 264 x 640 50.2 / 44.6 / 44.9 (hence FEW_TWO_CTAS_TOKENS_PER_SM).
    (9, 0): {8: "few", 64: "wsp", 128: "wsp"},
}
#: fewer query tokens than this keep ``tl`` where the table says "few" (one token measured
#: 1.7x slower on it: one CTA walks all the blocks; 128 tokens faster)
FEW_MIN_TOKENS = 128
#: the few-heads kernel runs two CTAs per SM (one ring stage each) from this many tokens per SM
#: on, where its index slots leave room for two (``few_ctas_per_sm``)
FEW_TWO_CTAS_TOKENS_PER_SM = 2

#: variants the GPU tests run (tests/attention/test_prefill_gluon.py); PICK uses only these.
#: "ws": the warp-specialized kernel (``prefill_ws.py``: a producer warpgroup and two consumer
#: warpgroups ping-ponging on alternate key blocks, eager rescale); "wsp": its persistent form
#: (``prefill_wsp.py``: one CTA per SM looping over (token, head tile) items)
VARIANTS = ("eager", "lazy", "ws", "wsp", "few")
#: "few": the few-heads kernel (``prefill_few.py``: H <= 8, the keys as the wgmma M, int32
#: index rows of at most ``MAX_WIDTH`` columns); where it cannot run, "eager" runs instead
FEW = "few"

#: DSV41_PREFILL_KERNEL=tl|gluon|auto overrides the pick (benchmarks, tests)
ENV = "DSV41_PREFILL_KERNEL"
#: DSV41_PREFILL_GLUON_VARIANT=lazy|eager|ws|wsp pins the variant (benchmarks, tests)
VARIANT_ENV = "DSV41_PREFILL_GLUON_VARIANT"
#: heads per CTA (the kernel's wgmma M)
BLOCK_H = 64


def heads_bucket(H: int) -> int:
    """``launch.heads_bucket`` with a bucket of its own (``1 << 30``) past 128 heads."""
    return _decode_launch.heads_bucket(H, beyond=1 << 30)


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned base and rows (every stride but the last a multiple of 8 elements)."""
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])


def usable(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> bool:
    """True when the Gluon kernel can run these (validated) arguments on this machine
    (``kv [S, 512]`` and ``indices [T, K]`` already 2-D)."""
    if not AVAILABLE or q.device.type != "cuda" or is_interpreter():
        return False
    if _cap(q.device) != (9, 0):
        return False
    if kv.shape[0] > 1 and not _aligned(kv):
        return False
    if kv.shape[0] <= 1 and kv.data_ptr() % 16:
        return False
    return _aligned(q)


def few_usable(H: int, indices: torch.Tensor) -> bool:
    """True when the few-heads kernel takes these (validated) arguments: ``H <= 8``, int32
    ``indices [T, K]`` with ``K <= MAX_WIDTH`` and unit column stride."""
    try:
        from .prefill_few import MAX_HEADS, MAX_WIDTH
    except Exception:  # noqa: BLE001 - a Triton without this Gluon API: never usable
        return False
    return (H <= MAX_HEADS and indices.dtype == torch.int32 and indices.shape[1] <= MAX_WIDTH
            and (indices.shape[1] <= 1 or indices.stride(1) == 1))


def few_ctas_per_sm(T: int, width: int, device: torch.device) -> int:
    """CTAs per SM for the few-heads kernel on ``T`` tokens of ``width`` index columns: 2 (two
    independent product chains per SM, one ring stage each) from ``FEW_TWO_CTAS_TOKENS_PER_SM``
    tokens per SM on where two CTAs' shared memory fits, else 1 (perf/NOTES.md, "Session 28")."""
    from .prefill_few import TWO_CTAS_MAX_WIDTH
    two = width <= TWO_CTAS_MAX_WIDTH and T >= FEW_TWO_CTAS_TOKENS_PER_SM * _sms(device)
    return 2 if two else 1


def table_variant(H: int, device: torch.device,
                  indices: Optional[torch.Tensor] = None) -> Optional[str]:
    """The ``PICK`` entry for this head count (a variant name) or None; a "few" entry only for
    ``indices`` the few-heads kernel takes (None without ``indices``)."""
    v = PICK.get(_cap(device), {}).get(heads_bucket(H))
    if v == FEW and (indices is None or not few_usable(H, indices)):
        return None
    return v


def pick(T: int, H: int, device: torch.device, indices: Optional[torch.Tensor] = None) -> bool:
    """Whether the auto path should take the Gluon kernel."""
    mode = os.environ.get(ENV, "auto")
    if mode == "tl":
        return False
    if mode == "gluon":
        return True
    v = table_variant(H, device, indices)
    return v is not None and (v != FEW or T >= FEW_MIN_TOKENS)


#: the last launch's compiled kernel and variant (benchmarks read registers)
LAST_LAUNCH = {}


def launch(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
           lens: Optional[torch.Tensor], sink: Optional[torch.Tensor], softmax_scale: float,
           out: torch.Tensor, lse: torch.Tensor, variant: Optional[str] = None,
           prior: bool = False) -> None:
    """Run the Gluon prefill on validated arguments (``kv [S, 512]``, ``indices [T, K]``).
    ``prior`` (the few-heads kernel only): out / lse hold a normalized partial of other keys
    (bf16, natural lse, +inf = none) that is merged in (the sink applied once)."""
    if not AVAILABLE:
        raise RuntimeError(f"gluon prefill unavailable: {REASON}")

    T, H, _ = q.shape
    if T == 0:
        return
    variant = (variant or os.environ.get(VARIANT_ENV) or table_variant(H, q.device, indices)
               or "eager")
    if variant not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}: expected one of {VARIANTS}, got {variant!r}")
    if variant == FEW and not few_usable(H, indices):
        variant = "eager"
    if prior and variant != FEW:
        raise ValueError("prior: only the few-heads kernel merges a prior partial")
    if variant == FEW:
        _launch_few(q, kv, indices, lens, sink, softmax_scale, out, lse, prior,
                    ctas_per_sm=few_ctas_per_sm(T, indices.shape[1], q.device))
        return
    if variant == "wsp":
        from .prefill_wsp import NUM_WARPS, _sparse_mla_prefill_gluon_wsp_kernel as kernel
    elif variant == "ws":
        from .prefill_ws import NUM_WARPS, _sparse_mla_prefill_gluon_ws_kernel as kernel
    else:
        from .prefill import NUM_WARPS, _sparse_mla_prefill_gluon_kernel as kernel
    S = kv.shape[0]
    kv_stride = kv.stride(0) if S > 1 else 512
    n_ht = cdiv(H, BLOCK_H)
    lens_arg = lens if lens is not None else indices
    sink_arg = sink if sink is not None else lse
    items = T * n_ht
    # the persistent kernel: one CTA per SM (fewer for fewer items), each looping over items
    grid = min(_sms(q.device), items) if variant == "wsp" else items
    extra = (items,) if variant == "wsp" else ()
    k = kernel[(grid,)](
        q, q.stride(0), q.stride(1),
        kv, kv_stride, S,
        indices, indices.stride(0), indices.shape[1],
        lens_arg, lens.stride(0) if lens is not None else 0,
        sink_arg, sink.stride(0) if sink is not None else 0,
        out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1),
        H, float(softmax_scale) * 1.4426950408889634, n_ht, *extra,
        HAS_LEN=lens is not None, HAS_SINK=sink is not None, LAZY=variant == "lazy",
        num_warps=NUM_WARPS,
    )
    LAST_LAUNCH["fwd"] = (k, variant)


def _launch_few(q, kv, indices, lens, sink, softmax_scale, out, lse, prior, mode=0,
                form="wgmma", ctas_per_sm=1):
    """The few-heads kernel (``prefill_few.py``) on validated arguments; ``mode`` 1 / 2 time
    the copies / the products alone (benchmarks); ``form``: ``"wgmma"`` (picked), ``"sync"``
    (two mma.sync consumers on alternate blocks) or ``"movm"`` (``prefill_few_movm.py``, no
    prior); ``ctas_per_sm`` 2: the wgmma form with one ring stage, two CTAs per SM (at most
    ``TWO_CTAS_MAX_WIDTH`` index columns; ``few_ctas_per_sm`` picks it)."""
    from . import prefill_few as pf
    if form == "movm":
        if prior:
            raise ValueError("prior: the movm form has none")
        from .prefill_few_movm import _sparse_mla_prefill_gluon_few_movm_kernel as kernel
    elif form == "sync":
        kernel = pf._sparse_mla_prefill_gluon_few_sync_kernel
    elif form == "wgmma":
        kernel = pf._sparse_mla_prefill_gluon_few_kernel
    else:
        raise ValueError(f"form: expected 'wgmma', 'sync' or 'movm', got {form!r}")
    T, H, _ = q.shape
    S, K = kv.shape[0], indices.shape[1]
    ns, extra = pf.NS, {}
    two_fit = form == "wgmma" and K <= pf.TWO_CTAS_MAX_WIDTH
    if ctas_per_sm not in (1, 2) or (ctas_per_sm == 2 and not two_fit):
        raise ValueError(f"ctas_per_sm: 1, or 2 with the wgmma form and at most "
                         f"{pf.TWO_CTAS_MAX_WIDTH} index columns; got {ctas_per_sm!r} with "
                         f"{form!r} and {K} columns")
    if ctas_per_sm == 2:
        ns, extra = 1, dict(CREGS=200, maxnreg=128)
    k = kernel[(min(ctas_per_sm * _sms(q.device), T),)](
        q, q.stride(0), q.stride(1),
        kv, kv.stride(0) if S > 1 else 512, S,
        indices, indices.stride(0), K,
        lens if lens is not None else indices, lens.stride(0) if lens is not None else 0,
        sink if sink is not None else lse, sink.stride(0) if sink is not None else 0,
        out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1),
        T, H, float(softmax_scale) * 1.4426950408889634,
        HAS_LEN=lens is not None, HAS_SINK=sink is not None, PRIOR=prior, NS=ns,
        WB=pf.index_blocks(K), MODE=mode, num_warps=pf.NUM_WARPS, **extra,
    )
    LAST_LAUNCH["fwd"] = (k, FEW)
    return k


def launch_window(q: torch.Tensor, kv: torch.Tensor, win_start: torch.Tensor,
                  win_len: torch.Tensor, tiles: torch.Tensor, softmax_scale: float,
                  out: torch.Tensor, lse: torch.Tensor) -> None:
    """The shared-window partial (``prefill_window.py``) on validated arguments: ``tiles [NT,
    2]`` int32 of ``64 // next_power_of_2(H)`` tokens at most; writes each token's normalized
    window partial to out / lse (no sink)."""
    from ..._utils import next_power_of_2
    from .prefill_window import NUM_WARPS, _shared_window_gluon_kernel
    T, H, _ = q.shape
    S, NT = kv.shape[0], tiles.shape[0]
    if T == 0 or NT == 0:
        return
    k = _shared_window_gluon_kernel[(min(_sms(q.device), NT),)](
        q, q.stride(0), q.stride(1),
        kv, kv.stride(0) if S > 1 else 512, S,
        win_start, win_start.stride(0), win_len, win_len.stride(0), tiles, NT,
        out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1),
        H, float(softmax_scale) * 1.4426950408889634,
        HP=next_power_of_2(H), num_warps=NUM_WARPS,
    )
    LAST_LAUNCH["window"] = (k, "window")


__all__ = ["PICK", "ENV", "VARIANT_ENV", "VARIANTS", "FEW", "FEW_MIN_TOKENS",
           "FEW_TWO_CTAS_TOKENS_PER_SM", "usable", "few_usable", "few_ctas_per_sm", "pick",
           "launch", "launch_window", "heads_bucket", "table_variant"]
