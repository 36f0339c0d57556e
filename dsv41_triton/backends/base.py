"""The one interface every attention backend implements.

A backend is one file plus one registry line (``backends/registry.py``). It answers
``probe(problem) -> Availability`` without ever raising, and implements the entry points of
SPEC §6 with the same signatures as ``dsv41_triton.attention``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class Availability:
    """Whether a backend can serve a problem, and why (or why not)."""

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available


@dataclass(frozen=True)
class Problem:
    """What a caller wants to run, for probing.

    kind: "decode" | "prefill" | "decode_fused" | "prefill_fused".
    swa_record / extra_record: record widths of the window and compressed caches (decode);
    extra_record None = no compressed cache.
    """

    kind: str
    num_heads: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    swa_record: int = 584
    extra_record: Optional[int] = None
    head_dim: int = 512


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

    def sparse_mla_decode_fused(self, *args, **kwargs):
        raise NotImplementedError(f"{self.name}: fused decode")

    def sparse_mla_prefill_fused(self, *args, **kwargs):
        raise NotImplementedError(f"{self.name}: fused prefill")
