"""The ``flashmla_mega`` backend: FlashMLA's fused kernels ``fused_norm_rope_attn_rope_cast_decode``
/ ``_fwd`` (Q norm + Q RoPE + sparse attention + inverse RoPE + MXFP8 cast in one kernel), SM100
only, from ``flash_mla.fused_norm_rope_attn_rope_cast`` or vLLM's ``torch.ops._flashmla_C``.

It serves only the fused contract (``decode_fused`` / ``prefill_fused``). The kernel reads Q in
its chunk-interleaved layout for 64 or 128 heads and writes the interleaved output layout:

* ``layout="interleaved"`` (the surrounding GEMMs permuted with ``ops.layouts``) is the fast
  path; with fewer than 64/128 heads Q is re-laid-out to add the padding heads (which sit at the
  tail of every 16-dim chunk) and the padding output groups are dropped;
* ``layout="standard"`` works too, at the cost of a Q re-layout and an output chunk permutation.

Kernel conventions (fixed by FlashMLA): GPT-J RoPE on the last 64 dims, per-32 UE8M0 scales
packed four to an int32, MN-major TMA-aligned scale layout, 8 heads per output group.
"""
from __future__ import annotations

import torch

from . import _checks
from ._compose import check_fused_common, q_to_standard
from ._flashmla_common import (
    arch_reason,
    as_cache4,
    cache_slots,
    index_rows_i32,
    lens_i32,
    load_flashmla,
    pad_heads,
    pad_sink,
    padded_heads,
)
from .base import WV_GROUP_SIZE, Availability, AttentionBackend, Problem, module_available

_TOPK_MULTIPLE = 128
_ROPE_ARGS = (False, 64)  # is_rope_neox_style, rope_dim
_SF_ARGS = (32, True, True, True)  # num_per_channels, tma-aligned col-major, round_sf, packed ue8m0
#: chunk permutation inside one 8-head output group: standard chunk 16*h + c <- interleaved 8*c + h
_STD_FROM_INTERLEAVED = torch.tensor(
    [8 * c + h for h in range(WV_GROUP_SIZE) for c in range(16)], dtype=torch.long
)


def _to_kernel_q(q: torch.Tensor, layout: str, hp: int) -> torch.Tensor:
    """``q [T, H, 512]`` in ``layout`` -> the kernel's interleaved layout for ``hp`` heads."""
    H = q.shape[1]
    if layout == "interleaved" and H == hp:
        return q
    from ..ops import layouts

    return layouts.q_to_interleaved(pad_heads(q_to_standard(q, layout), hp))


def _permute_chunks(data: torch.Tensor, scale: torch.Tensor, perm: torch.Tensor):
    """Apply a chunk permutation (per group of 128 chunks of 32 elements) to an MXFP8 pair:
    ``data [T, G, 4096]`` and its packed scales ``scale [T, G, 32]`` int32 (4 chunks each).
    Returns contiguous ``(data, scale_bytes [T, G, 128] uint8)``."""
    T, G = data.shape[:2]
    perm = perm.to(data.device)
    d = data.reshape(T, G, 128, 32).index_select(2, perm).reshape(T, G, 4096)
    sb = scale.contiguous().view(torch.uint8).reshape(T, G, 128).index_select(2, perm)
    return d, sb


def rope_rows_i32(positions: torch.Tensor, max_pos: int) -> torch.Tensor:
    """``positions [T]`` int32 or int64 -> the int32 table rows the mega kernels read
    (unchecked). A position outside ``[0, max_pos)`` (int64 compared at 64 bits) reads row 0,
    angle 0 (cos 1, sin 0) in every RoPE table: the token is not rotated, as on every backend.
    Device ops only."""
    p = positions.to(torch.int64)
    return torch.where((p >= 0) & (p < max_pos), p, 0).to(torch.int32).contiguous()


class FlashMLAMegaBackend(AttentionBackend):
    name = "flashmla_mega"
    description = "FlashMLA fused norm+RoPE+attention+RoPE+MXFP8 kernels (SM100 only)"

    def probe(self, problem: Problem) -> Availability:
        if not problem.kind.endswith("_fused"):
            return Availability(False, "mega attention only serves the fused contract "
                                       "(decode_fused / prefill_fused)")
        bad = arch_reason(problem, (10,), "FlashMLA's mega attention")
        if bad:
            return Availability(False, bad)
        if problem.num_heads > 128:
            return Availability(False, f"{problem.num_heads} heads: the kernel takes at most 128")
        if problem.kind == "decode_fused":
            if problem.swa_record != 528:
                return Availability(False, f"the mega decode reads the 528-byte V4.1 window record, "
                                           f"not {problem.swa_record}")
            if problem.extra_record not in (None, 528, 288):
                return Availability(False, f"compressed record {problem.extra_record} is not read "
                                           "by the mega decode (528 or 288)")
        if (problem.layout == "standard" or problem.num_heads not in (64, 128)) and \
                not module_available("dsv41_triton.ops.layouts"):
            return Availability(False, "dsv41_triton.ops.layouts (Q re-layout) is missing")
        ops, why = load_flashmla()
        if ops is None:
            return Availability(False, why)
        fn = ops.mega_decode if problem.kind == "decode_fused" else ops.mega_prefill
        if fn is None:
            return Availability(False, f"{ops.source} was built without the mega attention ops")
        hp = padded_heads(problem.num_heads)
        extra = "" if hp == problem.num_heads else f", {problem.num_heads} heads padded to {hp}"
        return Availability(True, f"FlashMLA mega attention ({ops.source}){extra}")

    # ---------------------------------------------------------------------------------------
    def _finish(self, o_data, o_scale, lse, T, H, layout, data, scale):
        """Copy the kernel's (padded-group, interleaved) output into the caller's pair."""
        from ..ops import mxfp8

        G = H // WV_GROUP_SIZE
        if data is None:
            data, scale = mxfp8.alloc_mxfp8_output(T, G, o_data.device)
        od, osc = o_data[:, :G], o_scale[:, :G]
        if layout == "standard":
            od, sb = _permute_chunks(od, osc, _STD_FROM_INTERLEAVED)
            osc = sb.view(torch.int32).reshape(T, G, 32)
        data.copy_(od)
        scale.copy_(osc)
        if lse is not None:
            lse = lse.reshape(T, -1)[:, :H].float()
        return data, scale, lse

    def _prep(self, q, positions, cos_sin_cache, layout, q_norm_eps, data, scale, attn_sink,
              softmax_scale):
        """What both fused calls pass FlashMLA besides their keys: ``(ops, T, H, hp, q in the
        kernel's layout, data, scale, softmax scale, (norm on, eps), rope rows)``."""
        T, H = check_fused_common(q, positions, cos_sin_cache, layout, q_norm_eps)
        _checks.check_sink(attn_sink, H)
        if data is not None or scale is not None:  # the missing half is allocated
            from ..attention.fused import check_fused_output

            data, scale = check_fused_output(data, scale, T, H // WV_GROUP_SIZE, q.device)
        ops, why = load_flashmla()
        if ops is None:
            raise RuntimeError(f"FlashMLA is not available: {why}")
        hp = padded_heads(H)
        sm = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        norm = (q_norm_eps is not None, 0.0 if q_norm_eps is None else float(q_norm_eps))
        pos = rope_rows_i32(positions, cos_sin_cache.shape[0])
        return ops, T, H, hp, _to_kernel_q(q, layout, hp), data, scale, sm, norm, pos

    def sparse_mla_decode_fused(self, q, positions, cos_sin_cache, swa_cache, swa_indices,
                                swa_lens, extra_cache=None, extra_indices=None, extra_lens=None,
                                attn_sink=None, softmax_scale=None, q_norm_eps=None,
                                layout="standard", data=None, scale=None):
        _checks.check_decode(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                             extra_lens, attn_sink, None, softmax_scale=softmax_scale)
        ops, T, H, hp, qk, data, scale, sm, norm, pos = self._prep(
            q, positions, cos_sin_cache, layout, q_norm_eps, data, scale, attn_sink,
            softmax_scale)
        cache4 = as_cache4(swa_cache)
        idx = index_rows_i32(swa_indices, swa_lens, cache_slots(cache4), _TOPK_MULTIPLE)
        extra = eidx = elen = None
        if extra_cache is not None:
            extra = as_cache4(extra_cache)
            eidx = index_rows_i32(extra_indices, extra_lens, cache_slots(extra), _TOPK_MULTIPLE)
            elen = lens_i32(extra_lens, extra_indices.shape[1])
        args = (qk, cache4, idx, sm, 512, pad_sink(attn_sink, H, hp),
                lens_i32(swa_lens, swa_indices.shape[1]), extra, eidx, elen)
        n_grp = hp // WV_GROUP_SIZE
        if ops.mega_out_args:  # vLLM: (..., out_data, out_scale) in place
            from ..ops import mxfp8

            od, osc = mxfp8.alloc_mxfp8_output(T, n_grp, q.device)
            res = ops.mega_decode(*args, *norm, pos, *_ROPE_ARGS, cos_sin_cache, n_grp,
                                  *_SF_ARGS, od, osc)
            lse = res[-1] if isinstance(res, (tuple, list)) and res else None
        else:
            od, osc, lse = ops.mega_decode(*norm, pos, *_ROPE_ARGS, cos_sin_cache, n_grp, *_SF_ARGS,
                                           *args)
        return self._finish(od, osc, lse, T, H, layout, data, scale)

    def sparse_mla_prefill_fused(self, q, positions, cos_sin_cache, kv, indices, lens=None,
                                 attn_sink=None, softmax_scale=None, q_norm_eps=None,
                                 layout="standard", data=None, scale=None):
        _checks.check_prefill(q, kv, indices, lens, attn_sink, None, softmax_scale=softmax_scale)
        ops, T, H, hp, qk, data, scale, sm, norm, pos = self._prep(
            q, positions, cos_sin_cache, layout, q_norm_eps, data, scale, attn_sink,
            softmax_scale)
        kv3 = kv.reshape(-1, 1, kv.shape[-1])
        idx2 = indices.reshape(T, -1)
        idx = index_rows_i32(idx2, lens, kv3.shape[0], _TOPK_MULTIPLE).unsqueeze(1)
        args = (qk, kv3, idx, sm, 512, pad_sink(attn_sink, H, hp), lens_i32(lens, idx2.shape[1]))
        n_grp = hp // WV_GROUP_SIZE
        if ops.mega_out_args:
            from ..ops import mxfp8

            od, osc = mxfp8.alloc_mxfp8_output(T, n_grp, q.device)
            res = ops.mega_prefill(*args, *norm, pos, *_ROPE_ARGS, cos_sin_cache, n_grp, *_SF_ARGS,
                                   od, osc)
            lse = res[-1] if isinstance(res, (tuple, list)) and res else None
        else:
            od, osc, _max_logits, lse = ops.mega_prefill(*norm, pos, *_ROPE_ARGS, cos_sin_cache,
                                                         n_grp, *_SF_ARGS, *args)
        return self._finish(od, osc, lse, T, H, layout, data, scale)
