"""The ``flashmla`` backend: FlashMLA's sparse kernels (SM90a and SM100).

Decode is ``flash_mla_with_kvcache`` with ``indices`` (the window cache) plus the extra
(compressed) cache, its indices and both ``topk_length``s; prefill is ``flash_mla_sparse_fwd``
over the gathered bf16 workspace. FlashMLA takes 64 or 128 query heads only: fewer heads are
zero-padded (the sink with ``-inf``) and the padding is sliced off the output. FlashMLA reads
int32 ids and skips only ``-1``: index rows (int32 or int64) are converted on the device, every
id outside the cache / workspace and every column past its length set to ``-1``, and padded
with ``-1`` to the block multiple its kernels assume (``_flashmla_common.index_rows_i32``).
FlashMLA allocates its own output, so a given ``out`` costs one copy. The fused contract runs
FlashMLA's bf16 attention between the project's Triton RoPE and inverse-RoPE/MXFP8 epilogue
kernels.

Scheduler metadata: decode passes FlashMLA no ``topk_length`` (columns past a row's length are
set to ``-1`` instead, which its kernel skips), so the split-KV schedule depends on the shapes
alone. Given a ``step_cache`` dict (the layer passes its step's ``StepMetadata.backend_cache``),
one ``FlashMLASchedMeta`` per shape and the masked window index rows are built once and shared
by every layer of the step: the first call fills the schedule (inside a CUDA graph capture:
records its kernel), later calls reuse it; nothing synchronizes with the host. Without one, an
eager call reuses a schedule this backend keeps per shape (filled eagerly, so valid inside later
captures too); a call being captured without one gets a fresh schedule.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Tuple

import torch

from . import _checks
from ._flashmla_common import (
    arch_reason,
    as_cache4,
    cache_slots,
    has_params,
    index_rows_i32,
    lens_i32,
    load_flashmla,
    new_sched_meta,
    pad_heads,
    pad_sink,
    padded_heads,
)
from ._compose import ComposedFusedMixin
from .base import Availability, AttentionBackend, Problem, device_capability, module_available

_DECODE_TOPK_MULTIPLE = 64
_PREFILL_TOPK_MULTIPLE = 128


def _prepare(q, softmax_scale, out):
    """FlashMLA's ops (or RuntimeError), the logit scale, and the ``out [T, H, 512]`` /
    ``lse [T, H]`` buffers every entry point fills."""
    ops, why = load_flashmla()
    if ops is None:
        raise RuntimeError(f"FlashMLA is not available: {why}")
    T, H, D = q.shape
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.empty_like(q) if out is None else out
    return ops, scale, out, torch.empty((T, H), dtype=torch.float32, device=q.device)


class FlashMLABackend(ComposedFusedMixin, AttentionBackend):
    name = "flashmla"
    #: ``sparse_mla_decode`` takes ``step_cache`` (per-step scheduler metadata and index rows)
    accepts_step_cache = True
    fused_steps_impl = "triton"  # our RoPE prologue and MXFP8 epilogue around FlashMLA
    description = "FlashMLA sparse decode/prefill kernels (SM90a, SM100), heads padded to 64/128"

    def probe(self, problem: Problem) -> Availability:
        bad = arch_reason(problem, (9, 10), "FlashMLA's sparse kernels")
        if bad:
            return Availability(False, bad)
        if problem.num_heads > 128:
            return Availability(False, f"{problem.num_heads} heads: FlashMLA takes at most 128")
        major = device_capability(problem)[0]
        if problem.kind.startswith("decode"):
            ok = (584,) if major == 9 else (584, 528)
            if problem.swa_record not in ok:
                return Availability(False, f"window record {problem.swa_record} is not read by "
                                           f"FlashMLA's sparse decode on sm_{major}x (reads {ok})")
            if problem.extra_record is not None and problem.extra_record != problem.swa_record:
                return Availability(
                    False, f"FlashMLA's sparse decode needs both caches in one record "
                           f"({problem.swa_record} window, {problem.extra_record} compressed)")
        if problem.kind.endswith("_fused"):
            for mod in ("dsv41_triton.ops.rope", "dsv41_triton.ops.mxfp8"):
                if not module_available(mod):
                    return Availability(False, f"{mod} (the fused epilogue) is missing")
        ops, why = load_flashmla()
        if ops is None:
            return Availability(False, why)
        if problem.kind.startswith("decode"):
            if ops.with_kvcache is None:
                return Availability(False, f"{ops.source} has no flash_mla_with_kvcache")
            if not has_params(ops.with_kvcache, "indices", "attn_sink", "extra_k_cache",
                              "topk_length", "extra_topk_length"):
                return Availability(False, f"{ops.source}'s flash_mla_with_kvcache predates the "
                                           "V4 sparse decode (no attn_sink/extra cache/topk_length)")
        elif ops.sparse_fwd is None:
            return Availability(False, f"{ops.source} has no flash_mla_sparse_fwd")
        hp = padded_heads(problem.num_heads)
        pad = "" if hp == problem.num_heads else f", {problem.num_heads} heads padded to {hp}"
        return Availability(True, f"FlashMLA ({ops.source}) on sm_{major}x{pad}")

    # ---------------------------------------------------------------------------------------
    def sparse_mla_decode(self, q, swa_cache, swa_indices, swa_lens, extra_cache=None,
                          extra_indices=None, extra_lens=None, attn_sink=None,
                          softmax_scale=None, out=None, *, step_cache: Optional[dict] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
        """See the module docstring; ``step_cache``: a dict living for one step (shared by its
        layers) where the schedule and the window index rows are kept."""
        _checks.check_decode(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                             extra_lens, attn_sink, out, softmax_scale=softmax_scale)
        ops, why = load_flashmla()
        if ops is None:
            raise RuntimeError(f"FlashMLA is not available: {why}")
        T, H, D = q.shape
        scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
        if T == 0:
            out = torch.empty_like(q) if out is None else out
            return out, torch.empty((T, H), dtype=torch.float32, device=q.device)
        hp = padded_heads(H)
        qp = pad_heads(q, hp).unsqueeze(1)  # [T, 1, hp, 512]: each token its own "batch"
        cache4 = as_cache4(swa_cache)
        slots = cache_slots(cache4)
        # the same tensors, not modified in place since (version counters)
        key = ("swa_idx", swa_indices.data_ptr(), swa_indices._version, tuple(swa_indices.shape),
               slots,
               None if swa_lens is None else (swa_lens.data_ptr(), swa_lens._version))
        idx = None if step_cache is None else step_cache.get(key)
        if idx is None:
            idx = index_rows_i32(swa_indices, swa_lens, slots, _DECODE_TOPK_MULTIPLE).unsqueeze(1)
            if step_cache is not None:  # the step's window rows are the same for every layer
                step_cache[key] = idx
        extra = None if extra_cache is None else as_cache4(extra_cache)
        eidx = None
        if extra is not None:
            eidx = index_rows_i32(extra_indices, extra_lens, cache_slots(extra),
                                  _DECODE_TOPK_MULTIPLE).unsqueeze(1)
        o, l = ops.with_kvcache(
            qp, cache4, None, None, 512, self._sched_meta(ops, step_cache, qp, cache4, idx, extra,
                                                          eidx), None,
            softmax_scale=scale, causal=False, is_fp8_kvcache=True, indices=idx,
            attn_sink=pad_sink(attn_sink, H, hp), extra_k_cache=extra,
            extra_indices_in_kvcache=eidx, topk_length=None, extra_topk_length=None,
        )
        o = o.reshape(T, hp, D)[:, :H]
        l = l.reshape(T, hp)[:, :H]  # s_q == 1: [b, h, 1] and [b, 1, h] agree
        if out is None:  # FlashMLA's own buffer when no head was padded (no copy)
            return (o if hp == H else o.contiguous()), l.contiguous()
        out.copy_(o)
        return out, l.contiguous()

    #: schedules of eager calls without a step cache, by shape (most recent last)
    _EAGER_SCHEDULES = 64

    def _sched_meta(self, ops, step_cache, qp, cache4, idx, extra, eidx):
        """The schedule for this shape (FlashMLA's config fields): the step's; without a step
        cache, the one this backend keeps per shape (filled by an eager call), else a fresh one
        (kept only when this call is eager: one first filled inside a capture is written only
        when the graph replays)."""
        key = ("sched", qp.shape[0], qp.shape[2], cache4.shape[1], idx.shape[-1],
               None if extra is None else extra.shape[1],
               None if eidx is None else eidx.shape[-1], qp.device)
        if step_cache is None:
            kept = self.__dict__.setdefault("_eager", OrderedDict())
            meta = kept.get(key)
            if meta is not None:
                kept.move_to_end(key)
                return meta
            meta = new_sched_meta(ops.get_metadata)
            if not (qp.is_cuda and torch.cuda.is_current_stream_capturing()):
                if len(kept) >= self._EAGER_SCHEDULES:
                    kept.popitem(last=False)
                kept[key] = meta  # filled by this eager call
            return meta
        meta = step_cache.get(key)
        if meta is None:
            meta = step_cache[key] = new_sched_meta(ops.get_metadata)
        return meta

    def sparse_mla_prefill(self, q, kv, indices, lens=None, attn_sink=None, softmax_scale=None,
                           out=None) -> Tuple[torch.Tensor, torch.Tensor]:
        _checks.check_prefill(q, kv, indices, lens, attn_sink, out, softmax_scale=softmax_scale)
        ops, scale, out, lse = _prepare(q, softmax_scale, out)
        T, H, D = q.shape
        if T == 0:
            return out, lse
        hp = padded_heads(H)
        kv3 = kv.reshape(-1, 1, D)
        idx2 = indices.reshape(T, -1)
        idx = index_rows_i32(idx2, lens, kv3.shape[0], _PREFILL_TOPK_MULTIPLE).unsqueeze(1)
        res = ops.sparse_fwd(pad_heads(q, hp), kv3, idx, scale, 512,
                             pad_sink(attn_sink, H, hp), lens_i32(lens, idx2.shape[1]))
        o, l = res[0], res[2]
        out.copy_(o[:, :H])
        lse.copy_(l.reshape(T, hp)[:, :H])
        return out, lse

