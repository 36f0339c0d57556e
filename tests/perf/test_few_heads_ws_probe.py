"""``perf/few_heads_ws_probe.py`` compiles for sm_90a as designed: the 64 keys-as-M products per
block (m64n8k16: 8 dim groups x 4 k16 steps for S^T, 8 dim tiles x 4 for O^T), no local memory,
one CTA's shared memory at both ring depths, and no products in the copies-alone mode (CPU, in a
subprocess without the interpreter; skipped without Triton's Gluon API of 3.6)."""
from gluon_probe import probe_json


def test_few_heads_ws_probe_compiles_as_designed():
    rows = probe_json("few_heads_ws_probe.py")
    assert [(r["ns"], r["mode"]) for r in rows] == [(2, 0), (3, 0), (2, 1)], rows
    for r in rows:
        ops = r["ops"]
        assert r["stack"] == 0 and "LDL" not in ops and "STL" not in ops, r
        assert ops.get("LDGSTS", 0) >= 32, ops  # 8 tiles x 4 copies of a block's rows, at least
        assert 0 < r["smem"] <= 227 * 1024, r
    assert rows[0]["ops"].get("HGMMA64x8x16") == 64 and rows[1]["ops"].get("HGMMA64x8x16") == 64
    assert "HGMMA64x8x16" not in rows[2]["ops"], rows[2]["ops"]
    assert rows[1]["smem"] - rows[0]["smem"] >= 64 * 1024, rows  # one more 64-key stage
