"""``DeepseekV41AttentionConfig.from_hf_config`` on every spelling of a DeepSeek V4 / V4.1 config
(transformers' object and ``to_dict()``, the checkpoint's ``config.json``, vLLM's, DeepSeek's
``inference/config.json``), RoPE tables against transformers' own, and the refusals."""
import json

import pytest
import torch

from dsv41_triton.layers.config import DeepseekV41AttentionConfig, build_cos_sin_cache

Cfg = DeepseekV41AttentionConfig
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
        "type": "yarn"}

#: the attention fields of DeepSeek-V4-Flash's Hugging Face config.json (43 layers + MTP)
V4_FLASH_JSON = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "head_dim": 512,
    "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "max_position_embeddings": 1048576, "num_attention_heads": 64, "num_hidden_layers": 43,
    "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8,
    "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": dict(YARN), "rope_theta": 10000, "sliding_window": 128, "use_cache": True,
    "n_routed_experts": 256, "topk_method": "noaux_tc", "norm_topk_prob": True,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "hc_mult": 4, "swiglu_limit": 10.0, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}
V4_RATIOS = tuple([0, 0] + [4, 128] * 20 + [4, 0])

#: DeepSeek's inference/config.json spelling (ModelArgs names) of a V4.1-style model
V41_INFERENCE = {
    "vocab_size": 129280, "dim": 5120, "n_layers": 4, "n_mtp_layers": 1, "n_heads": 64,
    "n_routed_experts": 384, "score_func": "sqrtsoftplus", "q_lora_rank": 1280, "head_dim": 512,
    "rope_head_dim": 64, "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
    "kv_source_layers": [2], "index_source_layers": [2, 3], "original_seq_len": 65536,
    "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 32,
    "index_head_dim": 128, "index_topk": 512, "candidate_topk_blocks": 2048, "hc_mult": 4,
    "engram_layer_ids": [1], "dspark_block_size": 5, "dtype": "fp8", "compress_rope_theta": 160000,
    "compress_ratios": [0, 0, 2, 1, 0],
}


def _yarn_fields(c):
    return (c.rope_theta, c.compress_rope_theta, c.rope_factor,
            c.original_max_position_embeddings, c.beta_fast, c.beta_slow)


def test_checkpoint_config_json():
    c = Cfg.from_hf_config(V4_FLASH_JSON)
    assert c.compress_ratios == V4_RATIOS and c.num_hidden_layers == 43
    assert [c.compress_ratio(i) for i in (0, 1, 2, 3, 42, 43, 44)] == [0, 0, 4, 128, 4, 0, 0]
    assert _yarn_fields(c) == (10000.0, 160000.0, 16.0, 65536, 32.0, 1.0)
    assert (c.sliding_window, c.o_groups, c.index_topk, c.index_n_heads, c.index_head_dim) == \
        (128, 8, 512, 64, 128)
    assert (c.q_lora_rank, c.o_lora_rank, c.q_head_norm) == (1024, 1024, True)
    assert (c.has_indexer(2), c.has_indexer(3), c.has_indexer(0)) == (True, False, False)
    assert c == Cfg.v4_flash().replace(name=c.name, num_hidden_layers=43,
                                       compress_ratios=V4_RATIOS)


def test_transformers_object_dict_and_json_agree():
    tf = pytest.importorskip("transformers")
    types = [S, S, C, H, C]
    hf = tf.DeepseekV4Config(num_hidden_layers=5, layer_types=types, rope_scaling=dict(YARN),
                             hidden_size=256, num_attention_heads=16, q_lora_rank=64,
                             o_lora_rank=32, o_groups=2, sliding_window=16, index_topk=8)
    from_obj = Cfg.from_hf_config(hf)
    assert from_obj.compress_ratios == (0, 0, 4, 128, 4)
    assert _yarn_fields(from_obj) == (10000.0, 160000.0, 16.0, 65536, 32.0, 1.0)
    assert (from_obj.sliding_window, from_obj.index_topk, from_obj.o_groups) == (16, 8, 2)
    assert Cfg.from_hf_config(hf.to_dict()) == from_obj
    assert Cfg.from_hf_config(json.loads(hf.to_json_string())) == from_obj
    # transformers reading the checkpoint's config.json gives what we read from it directly
    assert Cfg.from_hf_config(tf.DeepseekV4Config(**V4_FLASH_JSON)).compress_ratios == \
        V4_RATIOS[:43]
    # other rates per type
    hf2 = tf.DeepseekV4Config(num_hidden_layers=3, layer_types=[S, C, H],
                              compress_rates={C: 8, H: 64})
    c2 = Cfg.from_hf_config(hf2.to_dict())
    assert c2.compress_ratios == (0, 8, 64)
    assert c2.rope_factor == 1.0  # no rope_scaling: transformers' compressed RoPE is plain
    assert c2.hca_ratios == (64,) and [c2.has_indexer(i) for i in range(3)] == [False, True, False]
    with pytest.raises(ValueError, match="same ratio"):
        Cfg.from_hf_config(dict(hf2.to_dict(), compress_rates={C: 8, H: 8}))


@pytest.mark.parametrize("with_yarn", [True, False])
def test_rope_tables_match_transformers(with_yarn):
    tf = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    kw = dict(rope_scaling=dict(YARN)) if with_yarn else {}
    hf = tf.DeepseekV4Config(num_hidden_layers=2, layer_types=[S, H], **kw)
    c = Cfg.from_hf_config(hf)
    rot = DeepseekV4RotaryEmbedding(hf)
    pos = torch.tensor([[0, 1, 7, 127, 128, 1000, 4095, 65535, 200_000]])
    x = torch.zeros(1, dtype=torch.float32)
    # transformers' fp32 angles drift by ~ulp(angle) from our float64 ones
    tol = (1e-5 + 2.5e-7 * pos[0].double())[:, None]
    for ratio, label in ((0, "main"), (128, "compress")):
        cos, sin = rot(x, pos, layer_type=label)
        ours = build_cos_sin_cache(c, ratio, 200_001)[pos[0]].double()
        assert ((ours[:, :32] - cos[0].double()).abs() <= tol).all(), label
        assert ((ours[:, 32:] - sin[0].double()).abs() <= tol).all(), label
    # the two layer types' tables differ (theta, and YaRN when configured)
    assert not torch.allclose(build_cos_sin_cache(c, 0, 4096), build_cos_sin_cache(c, 128, 4096))


def test_vllm_flat_and_nested_rope_parameters():
    flat = dict(V4_FLASH_JSON)
    del flat["rope_scaling"]
    flat["rope_parameters"] = {"rope_type": "deepseek_yarn", "factor": 16, "beta_fast": 32,
                               "beta_slow": 1, "original_max_position_embeddings": 65536,
                               "mscale": 0, "mscale_all_dim": 0, "rope_theta": 10000,
                               "is_deepseek_v4": True, "rope_dim": 64}
    ref = Cfg.from_hf_config(V4_FLASH_JSON)
    assert Cfg.from_hf_config(flat) == ref
    # vLLM writes the compressed layers' theta into the shared dict while building them
    assert Cfg.from_hf_config(dict(flat, rope_parameters=dict(flat["rope_parameters"],
                                                              rope_theta=160000))) == ref
    with pytest.raises(ValueError, match="rope_parameters.rope_theta"):
        Cfg.from_hf_config(dict(flat, rope_parameters=dict(flat["rope_parameters"],
                                                           rope_theta=50000)))
    nested = dict(flat, rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.125},
        "compress": {"rope_type": "yarn", "rope_theta": 160000, "factor": 16, "beta_fast": 32,
                     "beta_slow": 1, "original_max_position_embeddings": 65536,
                     "attention_factor": 1.0}})
    assert Cfg.from_hf_config(nested) == ref


def test_deepseek_inference_config():
    c = Cfg.from_hf_config(V41_INFERENCE)
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.sliding_window) == \
        (5120, 64, 1280, 128)
    assert c.compress_ratios == (0, 0, 2, 1, 0) and c.num_hidden_layers == 4
    assert (c.rms_norm_eps, c.index_n_heads, c.index_topk) == (1e-20, 32, 512)
    assert _yarn_fields(c) == (10000.0, 160000.0, 16.0, 65536, 32.0, 1.0)
    assert (c.kv_source_layer_ids, c.index_source_layer_ids) == ((2,), (2, 3))
    assert not c.q_head_norm  # V4.1: no per-head Q norm
    v4 = {k: v for k, v in V41_INFERENCE.items() if k not in ("kv_source_layers",
                                                              "index_source_layers")}
    v4["compress_ratios"] = [0, 0, 4, 128, 0]
    assert Cfg.from_hf_config(v4).q_head_norm


def test_changes_override():
    c = Cfg.from_hf_config(V4_FLASH_JSON, sliding_window=64, name="x")
    assert (c.sliding_window, c.name) == (64, "x")


def _with(base, **kw):
    d = json.loads(json.dumps(base))
    for k, v in kw.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("change, match", [
    (dict(compress_ratios=None), "no per-layer compress ratios"),
    (dict(compress_ratios=None, layer_types=[S] * 42 + ["full_attention"]), "layer_types\\[42\\]"),
    (dict(compress_ratios=None, layer_types=[S] * 43, compress_rates={"dense": 4}), "'dense'"),
    (dict(layer_types=[S] * 43), "contradicts layer_types"),
    (dict(compress_ratios=[0, 4]), "2 entries for 43 layers"),
    (dict(compress_ratios=[0, -4] + [0] * 41), "compress_ratios\\[1\\]"),
    (dict(compress_shared_layers=[1, 2]), "compress_shared_layers"),
    (dict(window_size=64), "window_size=64 contradicts sliding_window=128"),
    (dict(rope_scaling=dict(YARN, type="linear")), "'linear'"),
    (dict(rope_scaling=dict(YARN, low_freq_factor=1)), "low_freq_factor"),
    (dict(rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=0.0)), "mscale"),
    (dict(rope_scaling=dict(YARN, attention_factor=1.3)), "attention_factor"),
    (dict(rope_scaling={"type": "yarn", "factor": 16}), "no .original_max_position_embeddings"),
    (dict(rope_parameters={"main": dict(YARN), "compress": dict(YARN)}), "main is YaRN"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 8, "beta_fast": 32, "beta_slow": 1,
                           "original_max_position_embeddings": 65536}), "contradicts"),
    (dict(num_key_value_heads=8), "num_key_value_heads"),
    (dict(head_dim=256), "head_dim"),
    (dict(qk_rope_head_dim=32, partial_rotary_factor=0.125), "qk_rope_head_dim=32"),
    (dict(model_type="llama"), "model_type"),
    (dict(o_groups=None), "missing 'o_groups'"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_unknown_or_contradictory_fields_raise(change, match):
    with pytest.raises(ValueError, match=match):
        Cfg.from_hf_config(_with(V4_FLASH_JSON, **change))


def test_deepseek_spellings_that_disagree_raise():
    with pytest.raises(ValueError, match="rope_factor|contradicts"):
        Cfg.from_hf_config(dict(V41_INFERENCE, rope_scaling=dict(YARN, factor=4)))
    with pytest.raises(ValueError, match="dim=5120 contradicts|contradicts"):
        Cfg.from_hf_config(dict(V41_INFERENCE, hidden_size=4096))


def test_not_a_config():
    with pytest.raises(TypeError, match="config"):
        Cfg.from_hf_config(42)
