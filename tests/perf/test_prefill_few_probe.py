"""The few-heads Gluon prefill (``attention/gluon/prefill_few.py``) compiles for sm_90a as
designed (``perf/prefill_few_probe.py --json``): the 64 keys-as-M products per 64-key block
(m64n8k16: 8 dim groups x 4 k16 steps for S^T, 8 dim tiles x 4 for O^T), no local memory with
or without the prior, one CTA's shared memory at both ring depths, no products in the
copies-alone mode (CPU, in a subprocess without the interpreter; skipped without Triton's
Gluon API of 3.6)."""
from gluon_probe import probe_json


def test_prefill_few_compiles_as_designed():
    rows = probe_json("prefill_few_probe.py")
    assert [(r["ns"], r["mode"], r["prior"]) for r in rows] == [
        (2, 0, False), (2, 0, True), (3, 0, False), (2, 1, False)], rows
    for r in rows:
        ops = r["ops"]
        assert r["stack"] == 0 and "LDL" not in ops and "STL" not in ops, r
        assert ops.get("LDGSTS", 0) >= 32, ops  # 8 tiles x 4 copies of a block's rows, at least
        assert 0 < r["smem"] <= 227 * 1024, r
    for r in rows[:3]:
        assert r["ops"].get("HGMMA64x8x16") == 64, r["ops"]
    assert "HGMMA64x8x16" not in rows[3]["ops"], rows[3]["ops"]
    assert rows[1]["ops"]["LDG"] > rows[0]["ops"]["LDG"], rows  # the prior's loads
    assert rows[2]["smem"] - rows[0]["smem"] >= 64 * 1024, rows  # one more 64-key stage
