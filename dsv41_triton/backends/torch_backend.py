"""The ``torch`` backend: the plain PyTorch float64 references, on any device (CPU included).

Slow and memory-hungry by design (it materializes every selected key row); it is the oracle
the other backends are checked against and the fallback where nothing else runs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _checks
from ._compose import ComposedFusedMixin
from .base import Availability, AttentionBackend, Problem, module_available


def _write_out(res: torch.Tensor, q: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """``res`` (float64, checked shapes) as bf16, into ``out`` when given."""
    if out is None:
        return res.to(torch.bfloat16)
    out.copy_(res.view(out.shape))
    return out


class TorchBackend(ComposedFusedMixin, AttentionBackend):
    name = "torch"
    fused_steps_impl = "torch"  # the fused contract from the references, step by step
    description = "plain PyTorch float64 reference (any device, slow)"

    def probe(self, problem: Problem) -> Availability:
        if not module_available("dsv41_triton.attention.ref"):
            return Availability(False, "dsv41_triton.attention.ref is missing")
        if problem.kind.endswith("_fused"):
            for mod in ("dsv41_triton.ops.rope_ref", "dsv41_triton.ops.mxfp8_ref"):
                if not module_available(mod):
                    return Availability(False, f"{mod} is missing (needed by the fused contract)")
            if problem.layout == "interleaved" and not module_available("dsv41_triton.ops.layouts"):
                return Availability(False, "dsv41_triton.ops.layouts is missing")
        dev = torch.device(problem.device)
        if dev.type == "cuda" and problem.capability is None and not torch.cuda.is_available():
            return Availability(False, "CUDA is not available")
        return Availability(True, f"PyTorch reference on {dev.type}")

    # ---------------------------------------------------------------------------------------
    # no autograd graph, as on every other backend (the entry points are inference-only)
    @torch.no_grad()
    def sparse_mla_decode(self, q, swa_cache, swa_indices, swa_lens, extra_cache=None,
                          extra_indices=None, extra_lens=None, attn_sink=None,
                          softmax_scale=None, out=None) -> Tuple[torch.Tensor, torch.Tensor]:
        from ..attention.ref import sparse_mla_decode_ref

        _checks.check_decode(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                             extra_lens, attn_sink, out, softmax_scale=softmax_scale)
        res, lse = sparse_mla_decode_ref(
            q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
            attn_sink=attn_sink, softmax_scale=softmax_scale,
        )
        return _write_out(res, q, out), lse.float()

    @torch.no_grad()
    def sparse_mla_prefill(self, q, kv, indices, lens=None, attn_sink=None, softmax_scale=None,
                           out=None) -> Tuple[torch.Tensor, torch.Tensor]:
        from ..attention.ref import sparse_mla_prefill_ref

        _checks.check_prefill(q, kv, indices, lens, attn_sink, out, softmax_scale=softmax_scale)
        res, lse = sparse_mla_prefill_ref(q, kv, indices, lens, attn_sink=attn_sink,
                                          softmax_scale=softmax_scale)
        return _write_out(res, q, out), lse.float()

    def supports_paged_window(self, heads: int) -> bool:
        return True

    @torch.no_grad()
    def sparse_mla_prefill_paged_window(self, q, kv, window_rows, query_start_loc, topk_cache,
                                        topk_slots, topk_lens, attn_sink=None,
                                        softmax_scale=None, out=None
                                        ) -> Tuple[torch.Tensor, torch.Tensor]:
        from ..attention.prefill_shared import check_shared_window_args
        from ..attention.prefill_shared_ref import sparse_mla_prefill_shared_window_ref

        _checks.check_shared_window_hint(q, window_rows, query_start_loc)
        check_shared_window_args(q, kv, window_rows[0], window_rows[1], topk_slots, topk_lens,
                                 query_start_loc, attn_sink, softmax_scale, out, topk_cache,
                                 max_heads=None)
        res, lse = sparse_mla_prefill_shared_window_ref(
            q, kv, window_rows[0], window_rows[1], topk_slots, topk_lens, query_start_loc,
            attn_sink, softmax_scale, topk_cache)
        return _write_out(res, q, out), lse.float()

