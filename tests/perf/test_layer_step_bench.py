"""The layer-step benchmark runs end to end on a tiny config (CPU: the torch backend)."""
from dsv41_triton.layers import DeepseekV41AttentionConfig
from dsv41_triton.perf.layer_step_bench import run

TINY = DeepseekV41AttentionConfig(name="tiny", hidden_size=64, num_attention_heads=8, q_lora_rank=32,
                                  o_lora_rank=16, o_groups=4, sliding_window=8, index_topk=4,
                                  compress_ratios=(0, 1, 2), index_n_heads=2, index_head_dim=64)


def test_layer_step_bench_tiny(device):
    for ratio in (1, 2):
        res = run(tp=2, ratio=ratio, prefill=9, decode=3, context=10, device=device,
                  backend="torch" if device == "cpu" else "auto", cfg=TINY, page=4)
        steps = [k for k in res if k.startswith(("prefill", "decode"))]
        assert len(steps) == 2
        for k in steps:
            parts = {n: v for n, v in res[k].items() if n != "step"}
            assert set(parts) == {"projections", "compressor", "indexer", "attention", "output projections"}
            assert abs(sum(v["share"] for v in parts.values()) - 1) < 1e-2
            assert res[k]["step"]["us"] > 0
