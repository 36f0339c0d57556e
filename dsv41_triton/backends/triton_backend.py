"""The ``triton`` backend: the project's own kernels, on any CUDA or ROCm GPU.

Without a GPU the same kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``): that is
available (tests use it) but never picked by ``auto``. Any head count works (no padding), every
record width is read in-kernel. The fused contract is ``attention.fused`` (its Triton
prologue + the bf16 kernels + the inverse-RoPE/MXFP8 epilogue).
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._checks import check_shared_window_hint
from .base import (
    Availability,
    AttentionBackend,
    Problem,
    device_capability,
    interpreter_enabled,
    is_rocm,
    module_available,
)

_WINDOW_RECORDS = (584, 528)
#: most heads for which ``sparse_mla_prefill_shared_window`` takes the shared-window kernel.
#: H200, 4096 tokens x (128 + 512) keys (perf/NOTES.md "Session 16"): 1 / 3 / 8 heads 475 /
#: 488 / 534 us against the general kernel's 537 / 541 / 548; 16 heads 612 against 557
SHARED_WINDOW_MAX_HEADS = 8
_EXTRA_RECORDS = (584, 528, 288)
#: oldest CUDA GPU the kernels compile for (sm_75 fails on the bf16 conversions; what is
#: compile-checked: tests/test_targets.py)
MIN_CUDA_CAPABILITY = (8, 0)


class TritonBackend(AttentionBackend):
    name = "triton"
    description = "the project's Triton kernels (any CUDA/ROCm GPU; CPU interpreter for tests)"

    def probe(self, problem: Problem) -> Availability:
        if not module_available("triton"):
            return Availability(False, "the triton package is not installed")
        need = {
            "decode": ("dsv41_triton.attention.decode",),
            "prefill": ("dsv41_triton.attention.prefill",),
            "decode_fused": ("dsv41_triton.attention.fused",),
            "prefill_fused": ("dsv41_triton.attention.fused",),
        }[problem.kind]
        if problem.kind.endswith("_fused") and problem.layout == "interleaved":
            need = need + ("dsv41_triton.ops.layouts",)
        for mod in need:
            if not module_available(mod):
                return Availability(False, f"{mod} is missing")
        if problem.kind.startswith("decode"):
            if problem.swa_record not in _WINDOW_RECORDS:
                return Availability(False, f"window cache record {problem.swa_record} is not "
                                           f"supported (expected {_WINDOW_RECORDS})")
            if problem.extra_record is not None and problem.extra_record not in _EXTRA_RECORDS:
                return Availability(False, f"compressed record {problem.extra_record} unsupported")
        dev = torch.device(problem.device)
        if dev.type == "cuda":
            if not torch.cuda.is_available() and problem.capability is None:
                return Availability(False, "CUDA is not available")
            cap = None if is_rocm() else device_capability(problem)
            if cap is not None and tuple(cap) < MIN_CUDA_CAPABILITY:
                return Availability(False, f"the Triton kernels need sm_80 or newer (bf16 "
                                           f"conversions and tensor cores); this GPU is "
                                           f"sm_{cap[0]}{cap[1]}")
            return Availability(True, "Triton kernels on " + ("ROCm" if is_rocm() else "CUDA"))
        if dev.type == "cpu":
            if interpreter_enabled():
                return Availability(True, "Triton CPU interpreter (TRITON_INTERPRET=1; slow)",
                                    auto=False)
            return Availability(False, "CPU tensors need TRITON_INTERPRET=1 set before import "
                                       "(Triton's interpreter); without it the ops run the "
                                       "PyTorch reference on CPU (backend 'torch')")
        return Availability(False, f"device type {dev.type!r} is not supported by Triton here")

    # ---------------------------------------------------------------------------------------
    def sparse_mla_decode(self, q, swa_cache, swa_indices, swa_lens, extra_cache=None,
                          extra_indices=None, extra_lens=None, attn_sink=None,
                          softmax_scale=None, out=None) -> Tuple[torch.Tensor, torch.Tensor]:
        from ..attention.decode import sparse_mla_decode

        return sparse_mla_decode(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                                 extra_lens, attn_sink=attn_sink, softmax_scale=softmax_scale,
                                 out=out)

    def sparse_mla_prefill(self, q, kv, indices, lens=None, attn_sink=None, softmax_scale=None,
                           out=None) -> Tuple[torch.Tensor, torch.Tensor]:
        from ..attention.prefill import sparse_mla_prefill

        return sparse_mla_prefill(q, kv, indices, lens, attn_sink=attn_sink,
                                  softmax_scale=softmax_scale, out=out)

    def sparse_mla_prefill_shared_window(self, q, kv, indices, lens, window_rows,
                                         query_start_loc, attn_sink=None, softmax_scale=None,
                                         out=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Up to ``SHARED_WINDOW_MAX_HEADS`` heads: the window rows once per tile of
        consecutive tokens (``attention.prefill_shared``), the top-k columns per token; more
        heads: ``sparse_mla_prefill``."""
        check_shared_window_hint(q, window_rows, query_start_loc)
        if (q.shape[1] > SHARED_WINDOW_MAX_HEADS or not isinstance(kv, torch.Tensor)
                or kv.dim() != 2):
            return self.sparse_mla_prefill(q, kv, indices, lens, attn_sink=attn_sink,
                                           softmax_scale=softmax_scale, out=out)
        from ..attention.prefill_shared import sparse_mla_prefill_shared_window

        return sparse_mla_prefill_shared_window(
            q, kv, window_rows[0], window_rows[1], indices, window_rows[2], query_start_loc,
            attn_sink=attn_sink, softmax_scale=softmax_scale, out=out)

    def supports_paged_window(self, heads: int) -> bool:
        return heads <= SHARED_WINDOW_MAX_HEADS

    def sparse_mla_prefill_paged_window(self, q, kv, window_rows, query_start_loc, topk_cache,
                                        topk_slots, topk_lens, attn_sink=None,
                                        softmax_scale=None, out=None
                                        ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``attention.prefill_shared`` with ``topk_cache``: the window partial per tile of
        consecutive tokens, then the top-k records (on sm_90 the Gluon decode kernel) merged
        with it."""
        from ..attention.prefill_shared import sparse_mla_prefill_shared_window

        check_shared_window_hint(q, window_rows, query_start_loc)
        return sparse_mla_prefill_shared_window(
            q, kv, window_rows[0], window_rows[1], topk_slots, topk_lens, query_start_loc,
            attn_sink=attn_sink, softmax_scale=softmax_scale, out=out, topk_cache=topk_cache)

    # ---------------------------------------------------------------------------------------
    @staticmethod
    def _norm_kw(q_norm_eps):
        return {} if q_norm_eps is None else {"enable_q_norm": True, "rms_norm_eps": q_norm_eps}

    def sparse_mla_decode_fused(self, q, positions, cos_sin_cache, swa_cache, swa_indices,
                                swa_lens, extra_cache=None, extra_indices=None, extra_lens=None,
                                attn_sink=None, softmax_scale=None, q_norm_eps=None,
                                layout="standard", data=None, scale=None):
        from ..attention.fused import sparse_mla_decode_fused
        from ._compose import check_fused_common

        check_fused_common(q, positions, cos_sin_cache, layout, q_norm_eps)
        data, scale, lse = sparse_mla_decode_fused(
            q, swa_cache, swa_indices, softmax_scale, 512, attn_sink, swa_lens, extra_cache,
            extra_indices, extra_lens, token_positions=positions, cos_sin_cache=cos_sin_cache,
            data=data, scale=scale, layout=layout, **self._norm_kw(q_norm_eps))
        return data, scale, lse

    def sparse_mla_prefill_fused(self, q, positions, cos_sin_cache, kv, indices, lens=None,
                                 attn_sink=None, softmax_scale=None, q_norm_eps=None,
                                 layout="standard", data=None, scale=None):
        from ..attention.fused import sparse_mla_prefill_fused
        from ._compose import check_fused_common

        check_fused_common(q, positions, cos_sin_cache, layout, q_norm_eps)
        res = sparse_mla_prefill_fused(
            q, kv, indices, softmax_scale, 512, attn_sink, lens, token_positions=positions,
            cos_sin_cache=cos_sin_cache, data=data, scale=scale, layout=layout,
            **self._norm_kw(q_norm_eps))
        return res[0], res[1], res[-1]
