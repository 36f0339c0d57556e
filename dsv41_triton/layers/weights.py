"""Weights of the V4.1 attention layer: checkpoint names, random init, TP sharding.

Canonical (vLLM) names are :data:`PARAM_NAMES`; :func:`canonicalize_attention_state_dict` maps a
checkpoint's names (DeepSeek's, vLLM's, transformers') onto them, and the compressor's / indexer's
onto :data:`EXTRA_PARAM_NAMES`; :func:`shard_attention_state_dict` cuts one tensor-parallel shard
(the compressor and indexer are replicated).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple, Union

import torch

from .._utils import check_int
from .config import DeepseekV41AttentionConfig

#: canonical (vLLM) parameter names of one layer
PARAM_NAMES = ("fused_wqa_wkv.weight", "q_norm.weight", "kv_norm.weight", "wq_b.weight",
               "wo_a.weight", "wo_b.weight", "attn_sink")


def full_param_shapes(config: DeepseekV41AttentionConfig) -> Dict[str, Tuple[int, ...]]:
    c = config
    H, D, G = c.num_attention_heads, c.head_dim, c.o_groups
    return {
        "fused_wqa_wkv.weight": (c.q_lora_rank + D, c.hidden_size),
        "q_norm.weight": (c.q_lora_rank,),
        "kv_norm.weight": (D,),
        "wq_b.weight": (H * D, c.q_lora_rank),
        "wo_a.weight": (G * c.o_lora_rank, H * D // G),
        "wo_b.weight": (c.hidden_size, G * c.o_lora_rank),
        "attn_sink": (H,),
    }


def random_attention_state_dict(
    config: DeepseekV41AttentionConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: Union[str, torch.device] = "cpu",
) -> Dict[str, torch.Tensor]:
    """A full (TP=1) random state dict with canonical names: linear weights
    ``N(0, 1/fan_in)``, norm weights ``1 + N(0, 0.1)``, sinks ``N(0, 1)`` fp32. Magnitudes keep
    activations O(1) through the layer."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in full_param_shapes(config).items():
        if name == "attn_sink":
            sd[name] = torch.randn(shape, generator=g).float().to(device)
        elif name.endswith("norm.weight"):
            sd[name] = (1 + 0.1 * torch.randn(shape, generator=g)).to(dtype).to(device)
        else:
            sd[name] = (torch.randn(shape, generator=g) * shape[1] ** -0.5).to(dtype).to(device)
    return sd


def _dequant_block_fp8(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Block-quantized fp8 weight ``w [N, K]`` with per-block multipliers ``s [ceil(N/bn),
    ceil(K/bk)]`` -> fp32 (the block size inferred from the shapes)."""
    N, K = w.shape
    bn, bk = -(-N // s.shape[0]), -(-K // s.shape[1])
    sf = s.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return w.float() * sf


#: transformers' names (``DeepseekV4Attention`` and its compressor / indexer) -> DeepSeek's
HF_NAMES = {
    "q_a_proj": "wq_a",
    "q_a_norm": "q_norm",
    "q_b_proj": "wq_b",
    "kv_proj": "wkv",
    "kv_norm": "kv_norm",
    "o_a_proj": "wo_a",
    "o_b_proj": "wo_b",
    "sinks": "attn_sink",
    "compressor.kv_proj": "compressor.wkv",
    "compressor.gate_proj": "compressor.wgate",
    "compressor.position_bias": "compressor.ape",
    "compressor.kv_norm": "compressor.norm",
    "compressor.indexer.kv_proj": "indexer.compressor.wkv",
    "compressor.indexer.gate_proj": "indexer.compressor.wgate",
    "compressor.indexer.position_bias": "indexer.compressor.ape",
    "compressor.indexer.kv_norm": "indexer.compressor.norm",
    "compressor.indexer.q_b_proj": "indexer.wq_b",
    "compressor.indexer.scorer.weights_proj": "indexer.weights_proj",
}
#: the compressor's and indexer's tensors, kept by the layer (DeepSeek's names; the indexer
#: exists on layers with an indexer only, the compressor on compressed layers only)
EXTRA_PARAM_NAMES = ("compressor.wkv.weight", "compressor.wgate.weight", "compressor.ape",
                     "compressor.norm.weight", "indexer.wq_b.weight", "indexer.weights_proj.weight",
                     "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight",
                     "indexer.compressor.ape", "indexer.compressor.norm.weight")
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv", ".weight_scale")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _rename_hf(sd: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    """transformers' names -> DeepSeek's (longest module path first); a tensor given under
    both names is an error."""
    order = sorted(HF_NAMES, key=len, reverse=True)
    out: Dict[str, torch.Tensor] = {}
    origin: Dict[str, str] = {}
    for k, v in sd.items():
        new = k
        for hf in order:
            if k == hf or k.startswith(hf + "."):
                new = HF_NAMES[hf] + k[len(hf):]
                break
        if new in out:
            raise ValueError(f"state_dict: {prefix}{k} and {prefix}{origin[new]} are the same "
                             f"tensor ({new}) under two names")
        out[new], origin[new] = v, k
    return out


def canonicalize_attention_state_dict(
    state_dict: Mapping[str, torch.Tensor], prefix: str = "", dtype: torch.dtype = torch.bfloat16,
    *, extras: bool = False,
) -> Dict[str, torch.Tensor]:
    """Map a checkpoint's attention tensors (under ``prefix``, e.g. ``"layers.3.attn."`` or
    ``"model.layers.3.self_attn."``) to the canonical names of :data:`PARAM_NAMES`.

    Accepts DeepSeek's names (``wq_a`` + ``wkv`` are concatenated into ``fused_wqa_wkv``),
    vLLM's (``fused_wqa_wkv``) and transformers' (``q_a_proj``, ``q_a_norm``, ``q_b_proj``,
    ``kv_proj``, ``kv_norm``, ``o_a_proj``, ``o_b_proj``, ``sinks``; :data:`HF_NAMES`); fp8
    weights with a ``.scale`` / ``.weight_scale_inv`` block multiplier are dequantized to
    ``dtype``. ``extras=True`` also returns the compressor's and indexer's tensors under
    :data:`EXTRA_PARAM_NAMES` (projections in ``dtype``, ``ape`` and norms as stored); otherwise
    they are ignored, as are keys of neither.
    """
    sd = _rename_hf({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)},
                    prefix)

    def weight(base: str, cast: Optional[torch.dtype] = dtype) -> Optional[torch.Tensor]:
        w = sd.get(base + ".weight")
        if w is None:
            return None
        if w.dtype in _FP8:
            s = next((sd[base + x] for x in _SCALE_SUFFIXES if base + x in sd), None)
            if s is None:
                raise ValueError(f"{prefix}{base}.weight: fp8 weight without a .scale")
            return _dequant_block_fp8(w, s).to(dtype)
        return w.to(cast) if cast is not None else w

    out: Dict[str, torch.Tensor] = {}
    fused = weight("fused_wqa_wkv")
    wq_a, wkv = weight("wq_a"), weight("wkv")
    if fused is not None and (wq_a is not None or wkv is not None):
        raise ValueError(f"state_dict: {prefix}fused_wqa_wkv.weight and {prefix}wq_a / wkv both "
                         "given; pass one spelling")
    if fused is None and wq_a is not None and wkv is not None:
        fused = torch.cat([wq_a, wkv], 0)
    if fused is not None:
        out["fused_wqa_wkv.weight"] = fused
    for base in ("wq_b", "wo_a", "wo_b"):
        w = weight(base)
        if w is not None:
            out[base + ".weight"] = w
    for base in ("q_norm", "kv_norm"):
        if base + ".weight" in sd:
            out[base + ".weight"] = sd[base + ".weight"].to(dtype)
    if "attn_sink" in sd:
        out["attn_sink"] = sd["attn_sink"].float()
    if extras:
        for name in EXTRA_PARAM_NAMES:
            if name.endswith(".weight"):
                base = name[:-len(".weight")]
                w = weight(base, None if base.endswith("norm") else dtype)
            else:
                w = sd.get(name)
            if w is not None:
                out[name] = w
    return out


def check_tp(config: DeepseekV41AttentionConfig, tp_rank: int, tp_size: int) -> Tuple[int, int]:
    """Validate a TP topology; return ``(local heads, local groups)``."""
    check_int("tp_size", tp_size, lo=1)
    check_int("tp_rank", tp_rank, lo=0, hi=tp_size - 1)
    H, G = config.num_attention_heads, config.o_groups
    if H % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide num_attention_heads {H}")
    if G % tp_size:
        raise ValueError(f"tp_size {tp_size} does not divide o_groups {G} (wo_a groups are "
                         "sharded whole)")
    return H // tp_size, G // tp_size


def shard_attention_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    config: DeepseekV41AttentionConfig,
    tp_rank: int,
    tp_size: int,
) -> Dict[str, torch.Tensor]:
    """The ``tp_rank`` shard of a full canonical state dict: heads (``wq_b`` rows,
    ``attn_sink``), ``wo_a`` groups (rows) and ``wo_b`` columns split evenly; the rest
    replicated. Pure function (no process group needed)."""
    Hl, Gl = check_tp(config, tp_rank, tp_size)
    D, R = config.head_dim, config.o_lora_rank
    out = {}
    for name, t in state_dict.items():
        if name == "wq_b.weight":
            out[name] = t[tp_rank * Hl * D:(tp_rank + 1) * Hl * D]
        elif name == "attn_sink":
            out[name] = t[tp_rank * Hl:(tp_rank + 1) * Hl]
        elif name == "wo_a.weight":
            out[name] = t[tp_rank * Gl * R:(tp_rank + 1) * Gl * R]
        elif name == "wo_b.weight":
            out[name] = t[:, tp_rank * Gl * R:(tp_rank + 1) * Gl * R]
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


__all__ = [
    "EXTRA_PARAM_NAMES",
    "HF_NAMES",
    "PARAM_NAMES",
    "canonicalize_attention_state_dict",
    "check_tp",
    "full_param_shapes",
    "random_attention_state_dict",
    "shard_attention_state_dict",
]
