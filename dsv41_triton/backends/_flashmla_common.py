"""Shared plumbing of the two FlashMLA backends: lazy loading of the package, capability
checks, head padding to 64/128 and index padding. Nothing here imports FlashMLA at import time.

Facts this relies on (FlashMLA's Python API and its C++ support checks):

* sparse decode ``flash_mla_with_kvcache(q [b, s_q, h_q, d], k_cache [blocks, page, 1, bytes],
  block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata, num_splits=None,
  softmax_scale, causal=False, is_fp8_kvcache=True, indices [b, s_q, topk], attn_sink [h_q],
  extra_k_cache, extra_indices_in_kvcache, topk_length [b], extra_topk_length [b]) -> (out, lse)``;
  ``h_q`` must be 64 or 128; the 584-byte record (d_qk = 512) on SM90a and SM100; the extra
  cache must use the same record; ``kv.stride(1) == bytes``; topk a multiple of 64 (SM90);
* sparse prefill ``flash_mla_sparse_fwd(q [s_q, h_q, 512], kv [s_kv, 1, 512], indices
  [s_q, 1, topk], sm_scale, d_v=512, attn_sink, topk_length) -> (out, max_logits, lse)``;
  ``h_q`` 64 or 128; topk a multiple of 128 (SM90); indices < 0 or >= s_kv are skipped;
* both: natural-log ``lse`` without the sink, ``+inf`` for a query with no key;
* the fused mega kernels exist only for SM100 (``flash_mla.fused_norm_rope_attn_rope_cast`` or
  vLLM's ``torch.ops._flashmla_C``) and read 528 (window) / 528 or 288 (extra) records.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

from ..ops.index_mask import mask_index_rows
from ..ops.index_mask_ref import INT32_MAX
from .base import Problem, device_capability, is_rocm, module_available

PADDED_HEADS = (64, 128)


def padded_heads(h: int) -> int:
    """FlashMLA's head count for ``h`` local heads (64 or 128); ValueError above 128."""
    if h > 128:
        raise ValueError(f"FlashMLA supports at most 128 heads (h_q in {{64, 128}}), got {h}")
    return 64 if h <= 64 else 128


def arch_reason(problem: Problem, allowed_majors: Tuple[int, ...], what: str) -> Optional[str]:
    """None when the problem's device is a CUDA GPU of an allowed major capability."""
    dev = torch.device(problem.device)
    if dev.type != "cuda":
        return f"{what}: needs a CUDA GPU (device is {dev.type})"
    if is_rocm() and problem.capability is None:
        return f"{what}: CUDA only (this is ROCm)"
    cap = device_capability(problem)
    if cap is None:
        return "CUDA is not available"
    if cap[0] not in allowed_majors:
        archs = "/".join(f"SM{m}x" if m != 9 else "SM90a" for m in allowed_majors)
        return f"{what}: run on {archs} only; this GPU is sm_{cap[0]}{cap[1]}"
    return None


@dataclass
class FlashMLAOps:
    """The loaded entry points and where they came from."""

    source: str
    with_kvcache: Optional[Callable] = None
    sparse_fwd: Optional[Callable] = None
    get_metadata: Optional[Callable] = None
    mega_decode: Optional[Callable] = None
    mega_prefill: Optional[Callable] = None
    #: vLLM's mega ops take the output buffers as their last two arguments
    mega_out_args: bool = False


_CACHE: dict = {}


def load_flashmla() -> Tuple[Optional[FlashMLAOps], str]:
    """Import FlashMLA lazily (``flash_mla``, else vLLM's copy). Returns ``(ops, why_not)``."""
    if "ops" in _CACHE:
        return _CACHE["ops"], _CACHE["why"]
    reasons = []
    ops: Optional[FlashMLAOps] = None
    if module_available("flash_mla"):
        try:
            import flash_mla  # type: ignore

            ops = FlashMLAOps(
                "flash_mla",
                with_kvcache=getattr(flash_mla, "flash_mla_with_kvcache", None),
                sparse_fwd=getattr(flash_mla, "flash_mla_sparse_fwd", None),
                get_metadata=getattr(flash_mla, "get_mla_metadata", None),
            )
            mega = getattr(flash_mla, "fused_norm_rope_attn_rope_cast", None)
            if mega is not None:
                ops.mega_decode = getattr(mega, "decode", None)
                ops.mega_prefill = getattr(mega, "prefill", None)
        except Exception as e:  # a broken build must not crash probing
            reasons.append(f"import flash_mla failed ({type(e).__name__}: {e})")
            ops = None
    else:
        reasons.append("package flash_mla is not installed")
    if ops is None and module_available("vllm"):
        try:
            from vllm.v1.attention.ops import flashmla as vf  # type: ignore

            ok, why = vf.is_flashmla_sparse_supported()
            if not ok:
                reasons.append(f"vLLM's FlashMLA: {why}")
            else:
                ops = FlashMLAOps(
                    "vllm._flashmla_C",
                    with_kvcache=vf.flash_mla_with_kvcache,
                    sparse_fwd=vf.flash_mla_sparse_fwd,
                    get_metadata=vf.get_mla_metadata,
                )
                ns = getattr(torch.ops, "_flashmla_C", None)
                if ns is not None and hasattr(ns, "fused_norm_rope_attn_rope_cast_decode"):
                    ops.mega_decode = ns.fused_norm_rope_attn_rope_cast_decode
                    ops.mega_prefill = ns.fused_norm_rope_attn_rope_cast_fwd
                    ops.mega_out_args = True
        except Exception as e:
            reasons.append(f"vLLM's FlashMLA could not be loaded ({type(e).__name__}: {e})")
    elif ops is None:
        reasons.append("vLLM is not installed")
    why = "; ".join(reasons)
    _CACHE["ops"], _CACHE["why"] = ops, why
    return ops, why


def has_params(fn: Callable, *names: str) -> bool:
    """Whether ``fn`` accepts all ``names`` (True when its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return True
    return all(n in params for n in names)


# --------------------------------------------------------------------------------------------
# tensor plumbing
# --------------------------------------------------------------------------------------------
def pad_heads(q: torch.Tensor, hp: int) -> torch.Tensor:
    """Zero-pad ``q [T, H, D]`` to ``[T, hp, D]`` (no copy when already ``hp``)."""
    T, H, D = q.shape
    if H == hp:
        return q.contiguous() if q.stride(-1) != 1 else q
    qp = q.new_zeros((T, hp, D))
    qp[:, :H] = q
    return qp


def pad_sink(sink: Optional[torch.Tensor], h: int, hp: int) -> Optional[torch.Tensor]:
    """``sink [h]`` fp32 padded with ``-inf`` (no effect) to ``[hp]``; None stays None."""
    if sink is None:
        return None
    s = sink.float().reshape(-1)
    if h == hp:
        return s.contiguous()
    return torch.cat([s, s.new_full((hp - h,), float("-inf"))])


def pad_indices(idx: torch.Tensor, multiple: int) -> torch.Tensor:
    """``idx [T, K]`` int -> ``[T, Kp]`` int32 with every negative entry -1, padded with -1 to
    a multiple of ``multiple`` columns (at least one block); one Triton launch."""
    return mask_index_rows(idx, None, multiple)


def index_rows_i32(idx: torch.Tensor, lens: Optional[torch.Tensor], num_rows: int,
                   multiple: int) -> torch.Tensor:
    """The index rows FlashMLA reads: ``idx [T, K]`` int32 or int64 -> ``[T, Kp]`` int32, ``Kp``
    ``K`` rounded up to ``multiple`` (at least one ``multiple``).

    An entry ``< 0`` or ``>= num_rows`` (the cache's slots or the workspace's rows; int64
    compared at 64 bits, so ``2**32 + 5`` is skipped, never slot 5), a column past ``lens[t]``
    and the padding are ``-1``, the only id FlashMLA's kernels skip (any other id is read,
    unchecked). Device ops only: no host sync, CUDA-graph safe."""
    return mask_index_rows(idx, lens, multiple, num_rows=num_rows)


def as_cache4(cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, page, bytes]`` -> ``[blocks, page, 1, bytes]`` (a view; strides kept)."""
    return cache if cache.dim() == 4 else cache.unsqueeze(2)


def cache_slots(cache4: torch.Tensor) -> int:
    """The slot ids a ``[blocks, page, 1, bytes]`` cache holds (``blocks * page``): the bound of
    ``index_rows_i32`` for its index rows."""
    return cache4.shape[0] * cache4.shape[1]


def lens_i32(lens: Optional[torch.Tensor], width: Optional[int] = None
             ) -> Optional[torch.Tensor]:
    """``lens [T]`` int32 or int64 -> int32 clamped to ``[0, width]`` (``width`` None: to int32's
    range), FlashMLA's ``topk_length``: its kernels read that many columns unchecked. None stays
    None."""
    if lens is None:
        return None
    hi = INT32_MAX if width is None else min(width, INT32_MAX)
    return lens.clamp(0, hi).to(torch.int32).contiguous()


def new_sched_meta(get_metadata: Optional[Callable]) -> Any:
    """A fresh scheduler-metadata object of the new-style API (``get_mla_metadata()``)."""
    if get_metadata is None:
        raise RuntimeError("this FlashMLA has no get_mla_metadata")
    meta = get_metadata()
    return meta[0] if isinstance(meta, tuple) else meta
