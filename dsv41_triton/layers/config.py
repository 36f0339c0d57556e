"""The attention layer's configuration and its RoPE tables.

``DeepseekV41AttentionConfig`` holds what one attention layer needs from a checkpoint's
``config.json`` (names as there); presets: :meth:`v41_flash`, :meth:`v4_flash`, :meth:`v4_pro`.

RoPE per layer type (SPEC §2, vLLM's ``build_deepseek_v4_rope``): window-only layers
(``compress_ratio == 0``) use plain RoPE with ``rope_theta``; compressed layers use
``compress_rope_theta`` with YaRN (``rope_factor``, ``original_max_position_embeddings``,
``beta_fast``/``beta_slow``; magnitude scaling off, i.e. ``mscale = 1``). The table is the fp32
``cos_sin_cache [max_pos, 64]`` of SPEC §2 (cos in columns 0..31, sin in 32..63).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional, Tuple

import torch

from .._utils import HEAD_DIM, ROPE_DIM


def _pattern(n_layers: int, head: Tuple[int, ...], body: Tuple[int, ...]) -> Tuple[int, ...]:
    out = list(head)
    while len(out) < n_layers:
        out.extend(body)
    return tuple(out[:n_layers])


@dataclass(frozen=True)
class DeepseekV41AttentionConfig:
    """Shapes and RoPE parameters of a DeepSeek V4 / V4.1 sparse MLA attention layer.

    ``compress_ratios[layer_id]`` is the layer's ratio (0 = window only); layers past the list
    (e.g. MTP) are window only. ``q_head_norm``: V4 re-normalizes each head of Q (RMSNorm
    without weight) after ``wq_b``; V4.1 does not (it norms ``qr`` before ``wq_b`` only).
    ``index_n_heads`` / ``index_head_dim`` / ``index_topk`` describe the indexer that feeds the
    layer its top-k rows; ``kv_source_layer_ids`` / ``index_source_layer_ids`` (V4.1) name the
    layers that compute compressed KV / indexer keys for the others (recorded as given; the
    caller shares the caches). Layers whose ratio is in ``hca_ratios`` (heavily compressed
    attention) have no indexer: they attend to every completed compressed entry.
    """

    name: str = "custom"
    hidden_size: int = 4096
    num_attention_heads: int = 64
    head_dim: int = HEAD_DIM
    qk_rope_head_dim: int = ROPE_DIM
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    sliding_window: int = 128
    index_topk: int = 512
    compress_ratios: Tuple[int, ...] = field(default_factory=tuple)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    q_head_norm: bool = False
    index_n_heads: int = 64
    index_head_dim: int = 128
    num_hidden_layers: Optional[int] = None
    kv_source_layer_ids: Tuple[int, ...] = field(default_factory=tuple)
    index_source_layer_ids: Tuple[int, ...] = field(default_factory=tuple)
    hca_ratios: Tuple[int, ...] = (128,)

    def __post_init__(self):
        if self.head_dim != HEAD_DIM or self.qk_rope_head_dim != ROPE_DIM:
            raise ValueError(f"head_dim/qk_rope_head_dim must be {HEAD_DIM}/{ROPE_DIM}, got "
                             f"{self.head_dim}/{self.qk_rope_head_dim}")
        for f in ("hidden_size", "num_attention_heads", "q_lora_rank", "o_lora_rank", "o_groups",
                  "sliding_window"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of o_groups ({self.o_groups})")
        if any((not isinstance(r, int)) or r < 0 for r in self.compress_ratios):
            raise ValueError(f"compress_ratios: expected ints >= 0, got {self.compress_ratios}")
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        for f in ("kv_source_layer_ids", "index_source_layer_ids", "hca_ratios"):
            object.__setattr__(self, f, tuple(int(i) for i in getattr(self, f)))
        for f in ("index_topk", "index_n_heads", "index_head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}: expected a positive int, got {v!r}")

    # ---------------------------------------------------------------------------------------
    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups

    def compress_ratio(self, layer_id: int) -> int:
        """The layer's ratio (0 past the list)."""
        return self.compress_ratios[layer_id] if 0 <= layer_id < len(self.compress_ratios) else 0

    def has_indexer(self, layer_id: int) -> bool:
        """Whether the layer's top-k rows come from an indexer (compressed, not HCA)."""
        r = self.compress_ratio(layer_id)
        return r > 0 and r not in self.hca_ratios

    def replace(self, **changes) -> "DeepseekV41AttentionConfig":
        return dataclasses.replace(self, **changes)

    # ---------------------------------------------------------------------------------------
    @classmethod
    def v41_flash(cls, **changes) -> "DeepseekV41AttentionConfig":
        """DeepSeek V4.1-Flash: 64 heads, q_lora 1280, 8 groups, top-k 512, ratios 0/1/2.
        (The exact per-layer ratio list comes from the checkpoint; the preset alternates.)"""
        base = cls(name="v4.1-flash", hidden_size=4096, num_attention_heads=64, q_lora_rank=1280,
                   o_lora_rank=1024, o_groups=8, sliding_window=128, index_topk=512,
                   compress_ratios=_pattern(43, (0, 0), (1, 2)), q_head_norm=False)
        return base.replace(**changes) if changes else base

    @classmethod
    def v4_flash(cls, **changes) -> "DeepseekV41AttentionConfig":
        """DeepSeek V4-Flash: 64 heads, q_lora 1024, 8 groups, top-k 512, ratios 4/128."""
        base = cls(name="v4-flash", hidden_size=4096, num_attention_heads=64, q_lora_rank=1024,
                   o_lora_rank=1024, o_groups=8, sliding_window=128, index_topk=512,
                   compress_ratios=_pattern(43, (0, 0), (4, 128)), q_head_norm=True)
        return base.replace(**changes) if changes else base

    @classmethod
    def v4_pro(cls, **changes) -> "DeepseekV41AttentionConfig":
        """DeepSeek V4-Pro: 128 heads, hidden 7168, q_lora 1536, 16 groups, top-k 1024,
        ratios 4/128."""
        base = cls(name="v4-pro", hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                   o_lora_rank=1024, o_groups=16, sliding_window=128, index_topk=1024,
                   compress_ratios=_pattern(61, (0, 0), (4, 128)), q_head_norm=True)
        return base.replace(**changes) if changes else base

    @classmethod
    def from_hf_config(cls, cfg: Any, **changes) -> "DeepseekV41AttentionConfig":
        """From a model config: transformers' ``DeepseekV4Config`` (object or ``to_dict()``),
        the checkpoint's ``config.json``, vLLM's ``hf_config`` or DeepSeek's
        ``inference/config.json`` (see :mod:`dsv41_triton.layers.hf_config`). Every layer's
        ratio, the RoPE of each layer type, window, groups and index settings are read; an
        unknown or contradictory field raises ``ValueError`` naming it. ``changes`` override
        fields afterwards."""
        from .hf_config import attention_config_kwargs

        kw = attention_config_kwargs(cfg)
        kw.update(changes)
        return cls(**kw)


# --------------------------------------------------------------------------------------------
# RoPE tables
# --------------------------------------------------------------------------------------------
def yarn_inv_freq(dim: int, base: float, factor: float, original_max_pos: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """float64 ``[dim // 2]`` inverse frequencies: plain ``base**(-2i/dim)`` when
    ``factor <= 1``, else YaRN's blend of interpolated (``/factor``) and original frequencies
    with a linear ramp between the correction dims of ``beta_fast`` and ``beta_slow``."""
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    extrapolated = base ** (-i / dim)
    if factor <= 1.0:
        return extrapolated

    def corr_dim(rotations: float) -> float:
        return dim * math.log(original_max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # weight of the original (extrapolated) frequency
    return extrapolated / factor * (1.0 - keep) + extrapolated * keep


def rope_params(config: DeepseekV41AttentionConfig, compress_ratio: int) -> Tuple[float, float]:
    """``(theta, yarn_factor)`` of a layer type: ratio 0 -> (rope_theta, 1); compressed ->
    (compress_rope_theta, rope_factor)."""
    if compress_ratio > 0:
        return config.compress_rope_theta, config.rope_factor
    return config.rope_theta, 1.0


@lru_cache(maxsize=16)
def _cos_sin_cpu(theta, factor, orig, beta_fast, beta_slow, max_pos) -> torch.Tensor:
    inv = yarn_inv_freq(ROPE_DIM, theta, factor, orig, beta_fast, beta_slow)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).to(torch.float32)


_DEVICE_TABLES: dict = {}


def build_cos_sin_cache(config: DeepseekV41AttentionConfig, compress_ratio: int, max_pos: int,
                        device="cpu") -> torch.Tensor:
    """The fp32 ``[max_pos, 64]`` table of a layer type. One tensor per (parameters, device) is
    shared by every layer of that type (treat it as read-only)."""
    if not isinstance(max_pos, int) or max_pos < 1:
        raise ValueError(f"max_pos: expected a positive int, got {max_pos!r}")
    theta, factor = rope_params(config, compress_ratio)
    key = (float(theta), float(factor), int(config.original_max_position_embeddings),
           float(config.beta_fast), float(config.beta_slow), max_pos)
    dev = torch.device(device)
    if (key, dev) not in _DEVICE_TABLES:
        _DEVICE_TABLES[(key, dev)] = _cos_sin_cpu(*key).to(dev)
    return _DEVICE_TABLES[(key, dev)]
