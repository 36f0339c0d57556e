"""transformers' parameter names (attention, compressor, indexer) load like DeepSeek's; HCA
layers (no indexer) build their own "every completed entry" top-k rows."""
import pytest
import torch

from dsv41_triton.layers import DeepseekV41Attention, DeepseekV41AttentionConfig
from dsv41_triton.layers.metadata import completed_entries_topk
from dsv41_triton.layers.weights import (
    EXTRA_PARAM_NAMES,
    HF_NAMES,
    canonicalize_attention_state_dict,
    random_attention_state_dict,
)
from dsv41_triton.testing import rel_err
from test_layer import CFG, MAX_LEN, STEPS, Scenario, _gather_oracle, make_layer, oracle_request

INV = {v: k for k, v in HF_NAMES.items()}


def _deepseek_sd(cfg, seed, ratio):
    """A layer's tensors under DeepSeek's names, with a compressor (and an indexer when the
    ratio is 4) of the right shapes."""
    g = torch.Generator().manual_seed(seed)
    sd = random_attention_state_dict(cfg, seed=seed)
    qa, wkv = sd.pop("fused_wqa_wkv.weight").split([cfg.q_lora_rank, 512], 0)
    out = {"wq_a.weight": qa, "wkv.weight": wkv}
    out.update(sd)
    if ratio:
        coff = 2 if ratio == 4 else 1
        hid = cfg.hidden_size
        out.update({"compressor.wkv.weight": torch.randn(coff * 512, hid, generator=g).bfloat16(),
                    "compressor.wgate.weight": torch.randn(coff * 512, hid, generator=g).bfloat16(),
                    "compressor.ape": torch.randn(ratio, coff * 512, generator=g),
                    "compressor.norm.weight": torch.rand(512, generator=g)})
        if ratio == 4:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            out.update({
                "indexer.wq_b.weight": torch.randn(ih * idim, cfg.q_lora_rank, generator=g).bfloat16(),
                "indexer.weights_proj.weight": torch.randn(ih, hid, generator=g).bfloat16(),
                "indexer.compressor.wkv.weight": torch.randn(2 * idim, hid, generator=g).bfloat16(),
                "indexer.compressor.wgate.weight": torch.randn(2 * idim, hid, generator=g).bfloat16(),
                "indexer.compressor.ape": torch.randn(4, 2 * idim, generator=g),
                "indexer.compressor.norm.weight": torch.rand(idim, generator=g)})
    return out


def _to_hf(sd):
    out = {}
    for k, v in sd.items():
        base = next((b for b in sorted(INV, key=len, reverse=True)
                     if k == b or k.startswith(b + ".")), None)
        out[(INV[base] + k[len(base):]) if base else k] = v
    return out


CFG4 = CFG.replace(compress_ratios=(0, 4, 128), index_n_heads=2, index_head_dim=16)


@pytest.mark.parametrize("layer_id", [0, 1, 2], ids=["window", "csa", "hca"])
def test_transformers_names_load_like_deepseek_names(layer_id):
    r = CFG4.compress_ratio(layer_id)
    ds = _deepseek_sd(CFG4, layer_id, r)
    hf = _to_hf(ds)
    assert "q_a_proj.weight" in hf and "sinks" in hf and "wq_a.weight" not in hf
    if r == 4:
        assert "compressor.indexer.scorer.weights_proj.weight" in hf
    pre = "model.layers.%d.self_attn." % layer_id
    a = DeepseekV41Attention(CFG4, layer_id, backend="torch", device="cpu", max_model_len=MAX_LEN)
    b = DeepseekV41Attention(CFG4, layer_id, backend="torch", device="cpu", max_model_len=MAX_LEN)
    a.load_weights(ds)
    b.load_weights({pre + k: v for k, v in hf.items()}, prefix=pre)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    want = {k for k in EXTRA_PARAM_NAMES if k in ds}
    assert set(b.extra_weights) == want == set(a.extra_weights)
    assert len(want) == {0: 0, 4: 10, 128: 4}[r]
    for k in want:
        assert torch.equal(a.extra_weights[k], b.extra_weights[k]), k
        assert torch.equal(b.extra_weights[k].float(), ds[k].float()), k


def test_real_transformers_module_names():
    tf = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention as HFAttn

    hf_cfg = tf.DeepseekV4Config(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=8, q_lora_rank=32,
        o_lora_rank=16, o_groups=4, sliding_window=8, index_topk=4, index_n_heads=2,
        index_head_dim=16, layer_types=["sliding_attention", "compressed_sparse_attention",
                                        "heavily_compressed_attention"])
    cfg = DeepseekV41AttentionConfig.from_hf_config(hf_cfg)
    for layer_id, n_extra in ((0, 0), (1, 10), (2, 4)):
        m = HFAttn(hf_cfg, layer_id)
        for p in m.parameters():
            torch.nn.init.normal_(p)
        sd = m.state_dict()
        ours = DeepseekV41Attention(cfg, layer_id, backend="torch", device="cpu",
                                    max_model_len=MAX_LEN)
        ours.load_weights(sd)
        assert len(ours.extra_weights) == n_extra
        assert torch.equal(ours.attn_sink, m.sinks.detach())
        assert torch.equal(ours.wo_a.weight.float(), m.o_a_proj.weight.detach().bfloat16().float())
        fused = torch.cat([m.q_a_proj.weight, m.kv_proj.weight]).detach().bfloat16()
        assert torch.equal(ours.fused_wqa_wkv.weight, fused)


def test_weight_name_conflicts_and_misplaced_tensors_raise():
    ds = _deepseek_sd(CFG4, 1, 4)
    both = dict(ds, **{"q_a_proj.weight": ds["wq_a.weight"]})
    with pytest.raises(ValueError, match="two names"):
        canonicalize_attention_state_dict(both)
    fused = dict(ds, **{"fused_wqa_wkv.weight": torch.cat([ds["wq_a.weight"], ds["wkv.weight"]])})
    with pytest.raises(ValueError, match="both"):
        canonicalize_attention_state_dict(fused)
    win = DeepseekV41Attention(CFG4, 0, backend="torch", device="cpu", max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match="window-only"):
        win.load_weights(ds)
    hca = DeepseekV41Attention(CFG4, 2, backend="torch", device="cpu", max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match="compress ratio is 128"):
        hca.load_weights(ds)  # a ratio-4 compressor (ape has 4 rows)


def test_completed_entries_rows():
    pos = torch.tensor([0, 1, 2, 3, 7, 8, 0])
    valid = torch.tensor([True] * 6 + [False])
    rows = completed_entries_topk(pos, 2, 5, valid)
    assert rows.dtype == torch.int32
    assert rows.tolist() == [[-1] * 5, [0, -1, -1, -1, -1], [0, -1, -1, -1, -1],
                             [0, 1, -1, -1, -1], [0, 1, 2, 3, -1], [0, 1, 2, 3, -1], [-1] * 5]
    assert completed_entries_topk(torch.tensor([127, 126]), 128, 1).tolist() == [[0], [-1]]
    with pytest.raises(ValueError, match="compress_ratio"):
        completed_entries_topk(pos, 0, 5)


# HCA at ratio 2 so that short sequences complete entries; ratio 1 keeps its indexer
HCA = CFG.replace(hca_ratios=(2,))


def test_hca_layer_builds_all_entry_rows_and_matches_oracle():
    sd = random_attention_state_dict(HCA, seed=4)
    layer = make_layer(HCA, 2, "torch", sd)
    assert not layer.has_indexer and make_layer(HCA, 1, "torch", sd).has_indexer
    explicit = make_layer(HCA, 2, "torch", sd)
    sc = Scenario(HCA, 2)
    outs = []
    for plan, padding in STEPS:
        md, hid, ckv, _, owners = sc.step(plan, padding)
        y = layer(None, hid, md, compressed_kv=ckv)  # no topk_indices
        rows = md.all_entries_topk(2)
        assert rows is md.all_entries_topk(2)  # one tensor per step and ratio
        assert rows.shape[1] % 64 == 0
        y2 = explicit(None, hid, md, compressed_kv=ckv,
                      topk_indices=completed_entries_topk(md.positions, 2, 40, md.is_valid_token))
        assert torch.equal(y, y2)
        outs.append((owners, y))
    orc = {}
    for name, st in sc.req.items():
        L = sum(h.shape[0] for h in st["hidden"])
        every = completed_entries_topk(torch.arange(L), 2, L)
        orc[name] = oracle_request(sd, HCA.replace(index_topk=L), 2, torch.cat(st["hidden"]),
                                   torch.cat(st["ckv"]), every)
    for owners, y in outs:
        _, y_ref = _gather_oracle(orc, owners)
        n = len(owners)
        assert rel_err(y[:n], y_ref) <= 1e-2, rel_err(y[:n], y_ref)


def test_indexed_layer_still_requires_rows():
    sd = random_attention_state_dict(HCA, seed=4)
    layer = make_layer(HCA, 1, "torch", sd)
    md, hid, ckv, _, _ = Scenario(HCA, 1).step([("A", 3)])
    with pytest.raises(ValueError, match="topk_indices: required"):
        layer(None, hid, md, compressed_kv=ckv)
