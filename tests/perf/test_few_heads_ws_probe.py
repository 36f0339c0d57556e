"""``perf/few_heads_ws_probe.py`` compiles for sm_90a as designed: the 64 keys-as-M products per
block (m64n8k16: 8 dim groups x 4 k16 steps for S^T, 8 dim tiles x 4 for O^T), the producer's 32
cp.async copies per block, no local memory, one CTA's shared memory at both ring depths (CPU, in
a subprocess without the interpreter; skipped without Triton's Gluon API of 3.6)."""
from gluon_probe import probe_json


def test_few_heads_ws_probe_compiles_as_designed():
    rows = probe_json("few_heads_ws_probe.py")
    assert [(r["ns"], r["s_split"]) for r in rows] == [(2, False), (3, False), (2, True)], rows
    for r in rows:
        ops = r["ops"]
        assert r["stack"] == 0 and "LDL" not in ops and "STL" not in ops, r
        assert ops.get("HGMMA64x8x16") == 64 and ops.get("LDGSTS") == 32, ops
        assert 0 < r["smem"] <= 227 * 1024, r
    assert rows[1]["smem"] - rows[0]["smem"] >= 64 * 1024, rows  # one more 64-key stage
