"""Reading a DeepSeek V4 / V4.1 model config into :class:`DeepseekV41AttentionConfig` fields.

Four spellings of the same facts are accepted (:func:`attention_config_kwargs`):

* transformers' ``DeepseekV4Config`` object, or its ``to_dict()`` / ``save_pretrained`` JSON:
  ``layer_types`` (``sliding_attention`` / ``compressed_sparse_attention`` /
  ``heavily_compressed_attention``) with ``compress_rates`` (type -> ratio), and
  ``rope_parameters`` nested as ``{"main": {...}, "compress": {...}}``;
* the checkpoint's ``config.json`` (DeepSeek's Hugging Face release): per-layer
  ``compress_ratios`` (layers past ``num_hidden_layers`` are MTP) and ``rope_scaling``
  (``{"type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}``);
* vLLM's ``hf_config``: ``compress_ratios`` with ``rope_parameters`` flat (``rope_type``
  ``yarn`` / ``deepseek_yarn``, ``mscale = mscale_all_dim``) or nested as transformers';
* DeepSeek's ``inference/config.json`` (``ModelArgs`` names): ``dim``, ``n_heads``,
  ``window_size``, ``rope_head_dim``, ``norm_eps``, ``rope_factor``, ``original_seq_len``, ...

RoPE facts (DeepSeek's reference, transformers and vLLM agree): window-only layers use plain
RoPE at ``rope_theta``; compressed layers use ``compress_rope_theta`` with the checkpoint's YaRN
(no magnitude scaling). A field this reader does not understand that could change what a layer
computes (an unknown layer type, RoPE type or key; a head/window/ratio field it does not know)
raises ``ValueError`` naming it, as do two spellings of one fact that disagree. Fields of the
rest of the model (MoE, hyper-connections, vocabulary, vision, ...) are ignored.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .._utils import HEAD_DIM, ROPE_DIM

#: transformers' layer types and the ratio each has unless ``compress_rates`` says otherwise
LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

#: DeepSeek ``inference/config.json`` name -> Hugging Face name
_DEEPSEEK_NAMES = {
    "dim": "hidden_size",
    "n_heads": "num_attention_heads",
    "n_layers": "num_hidden_layers",
    "norm_eps": "rms_norm_eps",
    "rope_head_dim": "qk_rope_head_dim",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
}
#: DeepSeek ``inference/config.json`` YaRN fields -> rope dict keys
_DEEPSEEK_YARN = {"rope_factor": "factor", "original_seq_len": "original_max_position_embeddings",
                  "beta_fast": "beta_fast", "beta_slow": "beta_slow"}

#: keys read here (after renaming)
_READ = {
    "model_type", "hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim",
    "partial_rotary_factor", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window",
    "index_topk", "index_n_heads", "index_head_dim", "compress_ratios", "layer_types",
    "compress_rates", "compress_rate_csa", "compress_rate_hca", "rms_norm_eps", "rope_theta",
    "compress_rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "num_hidden_layers", "num_key_value_heads", "attention_bias", "kv_source_layer_ids",
    "index_source_layer_ids", "beta_fast", "beta_slow", "rope_factor", "original_seq_len",
}
#: attention-adjacent keys known to leave the layer's computation unchanged
_KNOWN_UNUSED = {
    "attention_dropout", "output_attentions", "num_nextn_predict_layers", "n_mtp_layers",
    "topk_method", "norm_topk_prob", "num_experts_per_tok", "n_activated_experts", "use_cache", "max_seq_len",
    "max_batch_size", "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size",
    "_attn_implementation", "attn_implementation", "_attn_implementation_autoset",
}
_IGNORED_PREFIXES = ("vision_", "engram_", "dspark_", "hc_", "moe_", "mlp_", "router_", "n_routed",
                     "n_shared", "n_hash", "num_hash", "quantization", "expert", "_")
#: an unknown key matching this could change attention: refuse it
_ATTENTION_LIKE = re.compile(r"attn|attention|rope|rotary|yarn|window|swa|compress|index|lora|"
                             r"o_group|head|kv|sink|topk|ratio|mscale")

_ROPE_KEYS = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "rope_theta",
              "partial_rotary_factor", "apply_yarn_scaling", "is_deepseek_v4", "rope_dim",
              "truncate"}
_YARN_TYPES = ("yarn", "deepseek_yarn")

V4_MODEL_TYPES = ("deepseek_v4",)
V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v4_1", "deepseek_v4.1")


def _as_dict(cfg: Any) -> Dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    to_dict = getattr(cfg, "to_dict", None)
    if callable(to_dict):
        d = dict(to_dict())
        # runtime attributes transformers sets outside its dataclass fields
        for k in ("qk_rope_head_dim", "layer_types", "compress_rates", "rope_parameters"):
            if k not in d and getattr(cfg, k, None) is not None:
                d[k] = getattr(cfg, k)
        return d
    if hasattr(cfg, "__dict__"):
        return {k: v for k, v in vars(cfg).items()}
    raise TypeError(f"config: expected a dict or a transformers config, got {type(cfg).__name__}")


def _same(name: str, a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def _merge(d: Dict[str, Any], key: str, value: Any, source: str) -> None:
    """Set ``d[key]`` from ``source``; two spellings that disagree are an error."""
    if key in d and d[key] is not None and value is not None and not _same(key, d[key], value):
        raise ValueError(f"config: {source}={value!r} contradicts {key}={d[key]!r}")
    if value is not None:
        d[key] = value


def _normalize_names(raw: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """DeepSeek ``ModelArgs`` names -> Hugging Face names; returns (config, deepseek yarn)."""
    d: Dict[str, Any] = {}
    for k, v in raw.items():
        if k in _DEEPSEEK_NAMES or k in _DEEPSEEK_YARN:
            continue
        d[k] = v
    for k, hf in _DEEPSEEK_NAMES.items():
        if k in raw:
            _merge(d, hf, raw[k], k)
    yarn = {_DEEPSEEK_YARN[k]: raw[k] for k in _DEEPSEEK_YARN if k in raw}
    return d, yarn


def _check_unknown(d: Mapping[str, Any]) -> None:
    for k in d:
        if k in _READ or k in _KNOWN_UNUSED or k.startswith(_IGNORED_PREFIXES):
            continue
        if _ATTENTION_LIKE.search(k):
            raise ValueError(f"config: unknown attention field {k!r} (not understood by "
                             "DeepseekV41AttentionConfig.from_hf_config; refusing to guess)")


def _int(d: Mapping[str, Any], key: str, default: Any = None, required: bool = False) -> Optional[int]:
    v = d.get(key, default)
    if v is None:
        if required:
            raise ValueError(f"config: missing {key!r}")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"config: {key} must be an int, got {v!r}")
    return int(v)


def _ratios(d: Mapping[str, Any]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Per-layer ratios from ``compress_ratios`` and/or ``layer_types`` + ``compress_rates``,
    and the ratios of the layers without an indexer (HCA)."""
    hca = (DEFAULT_COMPRESS_RATES["heavily_compressed_attention"],)
    n_layers = _int(d, "num_hidden_layers")
    from_list: Optional[List[int]] = None
    if d.get("compress_ratios") is not None:
        cr = d["compress_ratios"]
        if isinstance(cr, (str, bytes)) or not hasattr(cr, "__iter__"):
            raise ValueError(f"config: compress_ratios must be a list of ints, got {cr!r}")
        from_list = []
        for i, r in enumerate(cr):
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ValueError(f"config: compress_ratios[{i}] must be an int >= 0, got {r!r}")
            from_list.append(int(r))
    from_types: Optional[List[int]] = None
    if d.get("layer_types") is not None:
        rates = dict(DEFAULT_COMPRESS_RATES)
        given = d.get("compress_rates")
        if given is not None:
            if not isinstance(given, Mapping):
                raise ValueError(f"config: compress_rates must be a dict, got {given!r}")
            for k, v in given.items():
                if k not in DEFAULT_COMPRESS_RATES:
                    raise ValueError(f"config: compress_rates has an unknown layer type {k!r} "
                                     f"(expected {tuple(DEFAULT_COMPRESS_RATES)})")
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"config: compress_rates[{k!r}] must be an int >= 1, got {v!r}")
                rates[k] = int(v)
        for key, t in (("compress_rate_csa", "compressed_sparse_attention"),
                       ("compress_rate_hca", "heavily_compressed_attention")):
            if d.get(key) is not None:
                if given is not None and t in given and given[t] != d[key]:
                    raise ValueError(f"config: {key}={d[key]!r} contradicts compress_rates[{t!r}]="
                                     f"{given[t]!r}")
                rates[t] = _int(d, key)
        csa_r, hca_r = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
        if csa_r == hca_r:
            raise ValueError(f"config: compress_rates gives CSA and HCA the same ratio {csa_r}; "
                             "the layers could not be told apart")
        hca = (hca_r,)
        from_types = []
        for i, t in enumerate(d["layer_types"]):
            if t == "sliding_attention":
                from_types.append(0)
            elif t in rates:
                from_types.append(rates[t])
            else:
                raise ValueError(f"config: layer_types[{i}] is {t!r}; expected one of {LAYER_TYPES}")
        if n_layers is not None and len(from_types) != n_layers:
            raise ValueError(f"config: layer_types has {len(from_types)} entries, "
                             f"num_hidden_layers is {n_layers}")
    elif d.get("compress_rates") is not None:
        raise ValueError("config: compress_rates without layer_types (which layer has which type?)")
    if from_list is not None and from_types is not None:
        n = len(from_types)
        if from_list[:n] != from_types:
            raise ValueError(f"config: compress_ratios {from_list[:n]} contradicts layer_types + "
                             f"compress_rates {from_types}")
        return (tuple(from_list) if len(from_list) > n else tuple(from_types)), hca
    if from_list is not None:
        if n_layers is not None and len(from_list) < n_layers:
            raise ValueError(f"config: compress_ratios has {len(from_list)} entries for "
                             f"{n_layers} layers")
        return tuple(from_list), hca
    if from_types is not None:
        return tuple(from_types), hca
    raise ValueError("config: no per-layer compress ratios (expected compress_ratios, or "
                     "layer_types with compress_rates); refusing to build window-only layers")


def _check_rope_dict(name: str, rp: Mapping[str, Any]) -> None:
    for k in rp:
        if k not in _ROPE_KEYS:
            raise ValueError(f"config: unknown key {k!r} in {name}")


def _rope_type(name: str, rp: Mapping[str, Any]) -> str:
    types = {rp[k] for k in ("rope_type", "type") if rp.get(k) is not None}
    if len(types) > 1:
        raise ValueError(f"config: {name} has rope_type and type {sorted(types)} that disagree")
    t = types.pop() if types else ("yarn" if "factor" in rp else "default")
    if t not in ("default",) + _YARN_TYPES:
        raise ValueError(f"config: {name}: rope type {t!r} is not supported (expected 'default' "
                         "or YaRN)")
    return "default" if t == "default" else "yarn"


def _yarn(name: str, rp: Mapping[str, Any], defaults: Mapping[str, Any]) -> Dict[str, Any]:
    """The YaRN fields of a compressed layers' rope dict (``factor = 1``: plain RoPE)."""
    _check_rope_dict(name, rp)
    if _rope_type(name, rp) == "default":
        return {"rope_factor": 1.0}
    if rp.get("apply_yarn_scaling", True) is not True:
        raise ValueError(f"config: {name}.apply_yarn_scaling=False (llama-style scaling) is not "
                         "supported")
    if rp.get("truncate", True) is not True:
        raise ValueError(f"config: {name}.truncate=False is not supported (YaRN's correction "
                         "range is floored/ceiled)")
    af = rp.get("attention_factor")
    if af is not None and float(af) != 1.0:
        raise ValueError(f"config: {name}.attention_factor={af!r}: DeepSeek V4 uses no YaRN "
                         "magnitude scaling (expected 1.0)")
    ms, msa = rp.get("mscale"), rp.get("mscale_all_dim")
    if (ms is not None or msa is not None) and float(ms or 0) != float(msa or 0):
        raise ValueError(f"config: {name}: mscale={ms!r} != mscale_all_dim={msa!r} would scale "
                         "cos/sin; DeepSeek V4 uses none")
    if rp.get("rope_dim") is not None and int(rp["rope_dim"]) != ROPE_DIM:
        raise ValueError(f"config: {name}.rope_dim={rp['rope_dim']!r}, expected {ROPE_DIM}")
    out = {}
    for k, field, cast in (("factor", "rope_factor", float),
                           ("original_max_position_embeddings", "original_max_position_embeddings", int),
                           ("beta_fast", "beta_fast", float), ("beta_slow", "beta_slow", float)):
        v = rp.get(k, defaults.get(k))
        if v is None:
            raise ValueError(f"config: {name} is YaRN but has no {k!r}")
        out[field] = cast(v)
    return out


def _rope(d: Dict[str, Any], deepseek_yarn: Mapping[str, Any]) -> Dict[str, Any]:
    """rope_theta, compress_rope_theta and the compressed layers' YaRN fields."""
    out: Dict[str, Any] = {}
    rope_theta = d.get("rope_theta")
    compress_theta = d.get("compress_rope_theta")
    rs, rp = d.get("rope_scaling"), d.get("rope_parameters")
    main = compress = None
    flat: List[Tuple[str, Mapping[str, Any]]] = []
    for name, v in (("rope_scaling", rs), ("rope_parameters", rp)):
        if v is None:
            continue
        if not isinstance(v, Mapping):
            raise ValueError(f"config: {name} must be a dict, got {v!r}")
        nested = {k: x for k, x in v.items() if isinstance(x, Mapping)}
        if nested:
            extra = set(nested) - {"main", "compress"}
            if extra:
                raise ValueError(f"config: {name} has unknown rope groups {sorted(extra)} "
                                 "(expected 'main' and 'compress')")
            leftover = {k: x for k, x in v.items() if k not in nested}
            _check_rope_dict(name, leftover)
            main, compress = nested.get("main", main), nested.get("compress", compress)
        else:
            flat.append((name, v))
    if main is not None:
        _check_rope_dict("rope_parameters.main", main)
        if _rope_type("rope_parameters.main", main) != "default":
            raise ValueError("config: rope_parameters.main is YaRN; window-only layers of DeepSeek "
                             "V4 use plain RoPE (DeepSeek's reference, transformers)")
        if main.get("rope_theta") is not None:
            _merge(d, "rope_theta", main["rope_theta"], "rope_parameters.main.rope_theta")
            rope_theta = d["rope_theta"]
    yarn: Optional[Dict[str, Any]] = None
    if compress is not None:
        if compress.get("rope_theta") is not None:
            _merge(d, "compress_rope_theta", compress["rope_theta"],
                   "rope_parameters.compress.rope_theta")
            compress_theta = d["compress_rope_theta"]
        yarn = _yarn("rope_parameters.compress", compress, deepseek_yarn)
    for name, v in flat:
        y = _yarn(name, {k: x for k, x in v.items() if k != "rope_theta"}, deepseek_yarn)
        t = v.get("rope_theta")
        # a flat dict's theta is the window layers' (transformers' conversion); vLLM overwrites
        # it in place with the compressed layers' while it builds them: both are consistent
        if t is not None and not (compress_theta is not None and rope_theta is not None
                                  and _same("", t, compress_theta)):
            _merge(d, "rope_theta", t, f"{name}.rope_theta")
            rope_theta = d["rope_theta"]
        if yarn is not None and y != yarn:
            raise ValueError(f"config: {name} {y} contradicts the other RoPE fields {yarn}")
        yarn = y
    if deepseek_yarn:
        y = {"rope_factor": float(deepseek_yarn.get("factor", 1.0))}
        if y["rope_factor"] > 1.0:
            y = _yarn("config", {"type": "yarn", **deepseek_yarn}, {})
        if yarn is not None:
            for k, v in y.items():
                if k in yarn and not _same(k, yarn[k], v):
                    raise ValueError(f"config: {k}={v!r} contradicts the rope dict's {yarn[k]!r}")
        else:
            yarn = y
    out["rope_theta"] = float(rope_theta if rope_theta is not None else 10000.0)
    out["compress_rope_theta"] = float(compress_theta if compress_theta is not None else 160000.0)
    out.update(yarn or {"rope_factor": 1.0})
    return out


def _q_head_norm(d: Mapping[str, Any], ratios: Tuple[int, ...]) -> bool:
    """V4 norms each Q head after ``wq_b``; V4.1 does not. V4.1 is told by its model_type or,
    where there is none (DeepSeek's inference config) or it says ``deepseek_v4``, by what only
    V4.1 has: ratios 1 / 2 or cross-layer compressed-KV sources."""
    mt = d.get("model_type")
    if mt in V41_MODEL_TYPES:
        return False
    if mt is not None and mt not in V4_MODEL_TYPES:
        raise ValueError(f"config: model_type {mt!r} is not a DeepSeek V4 / V4.1 model "
                         f"(expected one of {V4_MODEL_TYPES + V41_MODEL_TYPES})")
    v41 = any(r in (1, 2) for r in ratios) or d.get("kv_source_layer_ids") is not None
    return not v41


def attention_config_kwargs(cfg: Any) -> Dict[str, Any]:
    """Constructor keywords of :class:`DeepseekV41AttentionConfig` from any of the accepted
    config spellings (see the module docstring). Raises ``ValueError`` naming an unknown or
    contradictory field."""
    d, deepseek_yarn = _normalize_names(_as_dict(cfg))
    _check_unknown(d)
    if d.get("num_key_value_heads") not in (None, 1):
        raise ValueError(f"config: num_key_value_heads={d['num_key_value_heads']!r}; DeepSeek V4 "
                         "attention has one shared KV head")
    if d.get("attention_bias"):
        raise ValueError("config: attention_bias=True; DeepSeek V4 projections have no bias")
    head_dim = _int(d, "head_dim", HEAD_DIM)
    rope_dim = _int(d, "qk_rope_head_dim")
    prf = d.get("partial_rotary_factor")
    if prf is not None:
        from_prf = float(prf) * head_dim
        if from_prf != int(from_prf):
            raise ValueError(f"config: partial_rotary_factor={prf!r} x head_dim={head_dim} is not "
                             "a whole number of dims")
        if rope_dim is not None and rope_dim != int(from_prf):
            raise ValueError(f"config: qk_rope_head_dim={rope_dim} contradicts "
                             f"partial_rotary_factor x head_dim = {int(from_prf)}")
        rope_dim = int(from_prf)
    ratios, hca_ratios = _ratios(d)
    kw: Dict[str, Any] = dict(
        name=str(d.get("model_type") or "deepseek"),
        hidden_size=_int(d, "hidden_size", required=True),
        num_attention_heads=_int(d, "num_attention_heads", required=True),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim if rope_dim is not None else ROPE_DIM,
        q_lora_rank=_int(d, "q_lora_rank", required=True),
        o_lora_rank=_int(d, "o_lora_rank", required=True),
        o_groups=_int(d, "o_groups", required=True),
        sliding_window=_int(d, "sliding_window", 128),
        index_topk=_int(d, "index_topk", 512),
        index_n_heads=_int(d, "index_n_heads", 64),
        index_head_dim=_int(d, "index_head_dim", 128),
        compress_ratios=ratios,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_int(d, "max_position_embeddings", 1048576),
        num_hidden_layers=_int(d, "num_hidden_layers"),
        q_head_norm=_q_head_norm(d, ratios),
        hca_ratios=hca_ratios,
    )
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        if d.get(key) is not None:
            kw[key] = tuple(int(i) for i in d[key])
    kw.update(_rope(d, deepseek_yarn))
    return kw


__all__ = ["LAYER_TYPES", "DEFAULT_COMPRESS_RATES", "attention_config_kwargs"]
