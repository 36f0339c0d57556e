"""The indexer benchmark runs end to end (tiny shapes on the CPU interpreter) and checks its
results against the references."""
from dsv41_triton.perf.indexer_bench import run


def test_indexer_bench_tiny(device):
    rows = run(heads=3, device=device, decode_shapes=[(200, 2)], prefill_shapes=[(96, 5)])
    assert [r["case"] for r in rows][:2] == ["logits decode", "topk triton k=512"]
    assert all(r["check"] is not False for r in rows)
    assert all(r["us"] > 0 for r in rows)
