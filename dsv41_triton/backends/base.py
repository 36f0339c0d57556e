"""The one interface every attention backend implements.

A backend is one file plus one registry line (``backends/registry.py``). It answers
``probe(problem) -> Availability`` without ever raising, and implements the entry points of
SPEC §6 with the same signatures as ``dsv41_triton.attention``:

* ``sparse_mla_decode(q, swa_cache, swa_indices, swa_lens, extra_cache=None, extra_indices=None,
  extra_lens=None, attn_sink=None, softmax_scale=None, out=None) -> (out, lse)``
* ``sparse_mla_prefill(q, kv, indices, lens=None, attn_sink=None, softmax_scale=None, out=None)
  -> (out, lse)``
* the fused ("mega") contract, ``sparse_mla_decode_fused`` / ``sparse_mla_prefill_fused``:
  the same arguments plus ``positions`` and ``cos_sin_cache`` (``q`` NOT RoPE'd), an optional
  per-head Q RMSNorm (``q_norm_eps``), a ``layout`` ("standard" or "interleaved", for Q and the
  output together) and the output MXFP8 pair ``(data, scale)`` instead of ``out``; they return
  ``(data, scale, lse)``.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from .._contract import (KINDS, LAYOUTS, SWA_RECORDS, WV_GROUP_SIZE,  # noqa: F401
                         check_device, problem_error)
from ._checks import check_shared_window_hint


@dataclass(frozen=True)
class Availability:
    """Whether a backend can serve a problem, and why (or why not).

    ``auto``: whether ``select_backend("auto")`` may pick it (False for backends that work but
    should only run when asked for, e.g. Triton in the CPU interpreter).
    """

    available: bool
    reason: str
    auto: bool = True

    def __bool__(self) -> bool:
        return self.available


@dataclass(frozen=True)
class Problem:
    """What a caller wants to run, for probing.

    kind: "decode" | "prefill" | "decode_fused" | "prefill_fused".
    swa_record / extra_record: record widths of the window and compressed caches (decode);
    extra_record None = no compressed cache.
    capability: override of the device's compute capability ``(major, minor)`` (probe a
    hypothetical device; None = ask the device).
    layout: the fused contract's Q/output layout ("standard" or "interleaved").
    """

    kind: str
    num_heads: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    swa_record: int = 584
    extra_record: Optional[int] = None
    head_dim: int = 512
    capability: Optional[Tuple[int, int]] = None
    layout: str = "standard"


class AttentionBackend:
    """Base class. Subclasses set ``name`` and override ``probe`` and the entry points."""

    name: str = "base"
    #: a short human description for reports
    description: str = ""

    def probe(self, problem: Problem) -> Availability:  # pragma: no cover - overridden
        return Availability(False, "not implemented")

    def sparse_mla_decode(self, q, swa_cache, swa_indices, swa_lens, extra_cache=None,
                          extra_indices=None, extra_lens=None, attn_sink=None,
                          softmax_scale=None, out=None) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{self.name}: decode")

    def sparse_mla_prefill(self, q, kv, indices, lens=None, attn_sink=None, softmax_scale=None,
                           out=None) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(f"{self.name}: prefill")

    def sparse_mla_prefill_shared_window(self, q, kv, indices, lens, window_rows,
                                         query_start_loc, attn_sink=None, softmax_scale=None,
                                         out=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``sparse_mla_prefill(q, kv, indices, lens, ...)`` with a key-sharing hint.

        ``window_rows [3, T]`` int32 (``combine_topk_swa_indices(..., window_rows=)``) says
        that columns ``window_rows[2] .. lens - 1`` of row ``t`` of ``indices`` are the
        consecutive rows ``window_rows[0, t] ..`` of ``kv`` (``window_rows[1, t]`` of them), and
        ``query_start_loc [B + 1]`` which tokens form one request. A backend may load such keys
        once for several queries; the result is ``sparse_mla_prefill``'s either way. This
        default checks the hint and ignores it."""
        check_shared_window_hint(q, window_rows, query_start_loc)
        return self.sparse_mla_prefill(q, kv, indices, lens, attn_sink=attn_sink,
                                       softmax_scale=softmax_scale, out=out)

    def supports_paged_window(self, heads: int) -> bool:
        """Whether ``sparse_mla_prefill_paged_window`` runs ``heads`` query heads (the layer's
        paged prefill uses it then, else slot ids for the window keys too)."""
        return False

    def sparse_mla_prefill_paged_window(self, q, kv, window_rows, query_start_loc, topk_cache,
                                        topk_slots, topk_lens, attn_sink=None,
                                        softmax_scale=None, out=None
                                        ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Prefill whose window keys are rows of a bf16 window workspace and whose top-k keys
        are records of a paged cache.

        ``kv [S, 512]`` bf16: the window rows; ``window_rows [3, T]`` int32: token ``t`` reads
        rows ``window_rows[0, t] ..`` (``window_rows[1, t]`` of them; row 2 unused);
        ``query_start_loc [B + 1]``: which tokens form one request; ``topk_cache`` uint8
        ``[blocks, page, 584 | 528 | 288]``, ``topk_slots [T, K]`` int32 slot ids into it
        (``< 0`` skipped), ``topk_lens [T]`` columns read. One softmax over both key sets (a
        key in both counts twice). Returns ``(out [T, H, 512] bf16, lse [T, H] fp32)``."""
        raise NotImplementedError(f"{self.name}: paged-window prefill")

    def sparse_mla_decode_fused(self, q, positions, cos_sin_cache, swa_cache, swa_indices,
                                swa_lens, extra_cache=None, extra_indices=None, extra_lens=None,
                                attn_sink=None, softmax_scale=None, q_norm_eps=None,
                                layout="standard", data=None, scale=None):
        raise NotImplementedError(f"{self.name}: fused decode")

    def sparse_mla_prefill_fused(self, q, positions, cos_sin_cache, kv, indices, lens=None,
                                 attn_sink=None, softmax_scale=None, q_norm_eps=None,
                                 layout="standard", data=None, scale=None):
        raise NotImplementedError(f"{self.name}: fused prefill")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


# --------------------------------------------------------------------------------------------
# helpers for probes (never raise)
# --------------------------------------------------------------------------------------------
def module_available(name: str) -> bool:
    """Whether ``import name`` would find the module (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def device_capability(problem: Problem) -> Optional[Tuple[int, int]]:
    """``problem.capability`` or the CUDA device's ``(major, minor)``; None off CUDA."""
    if problem.capability is not None:
        return tuple(problem.capability)  # type: ignore[return-value]
    dev = torch.device(problem.device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    return tuple(torch.cuda.get_device_capability(idx))  # type: ignore[return-value]


def is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_problem(problem: Problem) -> Optional[str]:
    """A reason string when the problem itself is malformed, else None."""
    bad = problem_error(problem.kind, problem.num_heads, problem.head_dim, problem.swa_record,
                        problem.extra_record, problem.layout)
    if bad is not None:
        return bad
    if problem.swa_record not in SWA_RECORDS:
        return (f"swa_record: expected a window cache record width in {SWA_RECORDS}, got "
                f"{problem.swa_record}")
    try:
        check_device(problem.device)
    except ValueError as e:
        return str(e)
    return None
