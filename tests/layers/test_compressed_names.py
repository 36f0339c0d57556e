"""The compressor / indexer weights of a layer load the same under DeepSeek's names, vLLM's
(``compressor.fused_wkv_wgate`` = [wkv; wgate], ``fused_wqa_wkv``) and transformers'."""
import pytest
import torch

from dsv41_triton.layers import DeepseekV41Attention, DeepseekV41AttentionConfig
from dsv41_triton.layers.weights import random_attention_state_dict

V4 = DeepseekV41AttentionConfig(name="tiny-v4", hidden_size=64, num_attention_heads=8, q_lora_rank=32,
                                o_lora_rank=16, o_groups=4, sliding_window=8, index_topk=4,
                                compress_ratios=(4, 128), index_n_heads=2, index_head_dim=128,
                                q_head_norm=True)
V41 = V4.replace(name="tiny-v41", compress_ratios=(1, 2), q_head_norm=False)


def _extras(cfg, layer_id, g):
    r = cfg.compress_ratio(layer_id)
    v4 = cfg.q_head_norm
    coff = 2 if (v4 and r == 4) else 1
    H, Di, hid = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    sd = {"compressor.wkv.weight": torch.randn(coff * 512, hid, generator=g),
          "compressor.norm.weight": torch.rand(512, generator=g) + 0.5}
    if r > 1:
        sd["compressor.wgate.weight"] = torch.randn(coff * 512, hid, generator=g)
    if v4:
        sd["compressor.ape"] = torch.randn(r, coff * 512, generator=g)
    if cfg.has_indexer(layer_id):
        sd.update({"indexer.wq_b.weight": torch.randn(H * Di, cfg.q_lora_rank, generator=g),
                   "indexer.weights_proj.weight": torch.randn(H, hid, generator=g)})
        if v4:
            sd.update({"indexer.compressor.wkv.weight": torch.randn(2 * Di, hid, generator=g),
                       "indexer.compressor.wgate.weight": torch.randn(2 * Di, hid, generator=g),
                       "indexer.compressor.ape": torch.randn(4, 2 * Di, generator=g),
                       "indexer.compressor.norm.weight": torch.rand(Di, generator=g) + 0.5})
        else:
            sd.update({"indexer.wk.weight": torch.randn(Di, 512, generator=g),
                       "indexer.k_norm.weight": torch.rand(Di, generator=g) + 0.5})
    return {k: v.bfloat16() if k.endswith("weight") and "norm" not in k else v for k, v in sd.items()}


def _vllm(sd):
    out = dict(sd)
    for comp in ("compressor", "indexer.compressor"):
        if comp + ".wkv.weight" in out:
            parts = [out.pop(comp + ".wkv.weight")]
            if comp + ".wgate.weight" in out:
                parts.append(out.pop(comp + ".wgate.weight"))
            out[comp + ".fused_wkv_wgate.weight"] = torch.cat(parts)
    return out


@pytest.mark.parametrize("cfg,layer_id", [(V4, 0), (V4, 1), (V41, 0), (V41, 1)],
                         ids=["v4-ratio4", "v4-ratio128", "v41-ratio1", "v41-ratio2"])
def test_vllm_fused_compressor_names(cfg, layer_id):
    g = torch.Generator().manual_seed(layer_id)
    sd = dict(random_attention_state_dict(cfg, seed=3), **_extras(cfg, layer_id, g))
    a = DeepseekV41Attention(cfg, layer_id, backend="torch", device="cpu", max_model_len=64)
    b = DeepseekV41Attention(cfg, layer_id, backend="torch", device="cpu", max_model_len=64)
    a.load_weights(sd)
    pre = f"model.layers.{layer_id}.attn."
    b.load_weights({pre + k: v for k, v in _vllm(sd).items()}, prefix=pre)
    assert a.compressed_block.loaded and b.compressed_block.loaded
    pa = dict(a.compressed_block.named_parameters())
    pb = dict(b.compressed_block.named_parameters())
    assert set(pa) == set(pb) and len(pa) >= 2
    for n, p in pa.items():
        assert torch.equal(p, pb[n]), n
    assert torch.equal(pa["compressor.wkv.weight"], sd["compressor.wkv.weight"].float())


def test_fused_and_split_compressor_names_conflict():
    g = torch.Generator().manual_seed(0)
    sd = dict(random_attention_state_dict(V4, seed=3), **_extras(V4, 0, g))
    both = dict(sd, **{"compressor.fused_wkv_wgate.weight": _vllm(sd)["compressor.fused_wkv_wgate.weight"]})
    layer = DeepseekV41Attention(V4, 0, backend="torch", device="cpu", max_model_len=64)
    with pytest.raises(ValueError, match="fused_wkv_wgate"):
        layer.load_weights(both)
