"""Test doubles for the harness: backends whose errors are known in advance.

Importable by ``--extra-backend perf_doubles:NAME`` because pytest puts ``tests/perf`` on
``sys.path`` (its test modules are not in a package).
"""
from __future__ import annotations

import torch

from dsv41_triton.backends.base import Availability, AttentionBackend
from dsv41_triton.perf.impls import Impl

OUT_SCALE = 1.05  # out * 1.05 -> relative Frobenius error 0.05 (+ bf16 rounding)
LSE_SHIFT = 0.5  # lse + 0.5 -> max abs lse error 0.5


def _emit(res: torch.Tensor, out):
    res = res.to(torch.bfloat16)
    if out is None:
        return res
    out.copy_(res)
    return out


class ScaledBackend(AttentionBackend):
    """The float64 oracle with its output scaled by ``OUT_SCALE`` and lse shifted by
    ``LSE_SHIFT``: wrong numbers with known error figures."""

    name = "double_scaled"
    description = "test double: oracle * 1.05, lse + 0.5"
    out_scale, lse_shift = OUT_SCALE, LSE_SHIFT

    def probe(self, problem):
        return Availability(True, "test double")

    def sparse_mla_decode(self, q, swa_cache, swa_indices, swa_lens, extra_cache=None,
                          extra_indices=None, extra_lens=None, attn_sink=None,
                          softmax_scale=None, out=None):
        from dsv41_triton.attention.ref import sparse_mla_decode_ref

        o, lse = sparse_mla_decode_ref(q, swa_cache, swa_indices, swa_lens, extra_cache,
                                       extra_indices, extra_lens, attn_sink=attn_sink,
                                       softmax_scale=softmax_scale)
        return _emit(o * self.out_scale, out), (lse + self.lse_shift).float()

    def sparse_mla_prefill(self, q, kv, indices, lens=None, attn_sink=None, softmax_scale=None,
                           out=None):
        from dsv41_triton.attention.ref import sparse_mla_prefill_ref

        o, lse = sparse_mla_prefill_ref(q, kv, indices, lens, attn_sink=attn_sink,
                                        softmax_scale=softmax_scale)
        return _emit(o * self.out_scale, out), (lse + self.lse_shift).float()


    def sparse_mla_decode_fused(self, q, positions, cos_sin_cache, swa_cache, swa_indices,
                                swa_lens, extra_cache=None, extra_indices=None, extra_lens=None,
                                attn_sink=None, softmax_scale=None, q_norm_eps=None,
                                layout="standard", data=None, scale=None):
        from dsv41_triton.backends._compose import fused_via_steps

        def attn(qr):
            return self.sparse_mla_decode(qr, swa_cache, swa_indices, swa_lens, extra_cache,
                                          extra_indices, extra_lens, attn_sink, softmax_scale)

        return fused_via_steps(attn, q, positions, cos_sin_cache, q_norm_eps, layout, data,
                               scale, impl="torch")


class ExactBackend(ScaledBackend):
    """The oracle rounded to bf16: must pass."""

    name = "double_exact"
    description = "test double: the oracle"
    out_scale, lse_shift = 1.0, 0.0


class RaisingBackend(ScaledBackend):
    """Raises on decode, unavailable for prefill."""

    name = "double_raising"

    def probe(self, problem):
        if problem.kind == "prefill":
            return Availability(False, "double_raising does no prefill")
        return Availability(True, "test double")

    def sparse_mla_decode(self, *a, **k):
        raise RuntimeError("boom: this double always raises")


def _corrupt_insert(k, k_cache, slot_mapping):
    from dsv41_triton.ops.kv_cache_ref import quantize_and_insert_k_cache_ref

    quantize_and_insert_k_cache_ref(k, k_cache, slot_mapping)
    c = k_cache.squeeze(2) if k_cache.dim() == 4 else k_cache
    s = int(slot_mapping[0])
    page = c.shape[1]
    c[s // page, s % page, 3] ^= 0x10  # one flipped bit in the first token's record


def _corrupt_global_topk(*a):
    from dsv41_triton.ops.indices_ref import compute_global_topk_indices_and_lens_ref

    idx, lens = compute_global_topk_indices_and_lens_ref(*a)
    return idx, lens + 1


#: an op implementation with a flipped bit (insert) and off-by-one lens (global_topk)
corrupt_ops = Impl("corrupt_ops", {"insert": _corrupt_insert, "global_topk": _corrupt_global_topk},
                   "test double: corrupted ops")
