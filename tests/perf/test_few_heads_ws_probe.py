"""``perf/few_heads_ws_probe.py`` compiles for sm_90a as designed: the 64 keys-as-M products per
block (m64n8k16: 8 dim groups x 4 k16 steps for S^T, 8 dim tiles x 4 for O^T), no local memory,
one CTA's shared memory at both ring depths, no products in the copies-alone mode, and with A in
registers one ``ldmatrix`` per product (CPU, in a subprocess without the interpreter; skipped
without Triton's Gluon API of 3.6)."""
from gluon_probe import probe_json


def test_few_heads_ws_probe_compiles_as_designed():
    rows = probe_json("few_heads_ws_probe.py")
    assert [(r["ns"], r["mode"], r["a_regs"]) for r in rows] == [
        (2, 0, False), (3, 0, False), (2, 1, False), (2, 0, True)], rows
    for r in rows:
        ops = r["ops"]
        assert r["stack"] == 0 and "LDL" not in ops and "STL" not in ops, r
        assert ops.get("LDGSTS", 0) >= 32, ops  # 8 tiles x 4 copies of a block's rows, at least
        assert 0 < r["smem"] <= 227 * 1024, r
    assert rows[0]["ops"].get("HGMMA64x8x16") == 64 and rows[1]["ops"].get("HGMMA64x8x16") == 64
    assert "HGMMA64x8x16" not in rows[2]["ops"], rows[2]["ops"]
    regs_a = rows[3]["ops"]
    assert regs_a.get("HGMMA64x8x16") == 64 and regs_a.get("LDSM") == 64, regs_a
    assert "LDSM" not in rows[0]["ops"], rows[0]["ops"]
    assert rows[1]["smem"] - rows[0]["smem"] >= 64 * 1024, rows  # one more 64-key stage
