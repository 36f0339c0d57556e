"""``perf/record_regs_probe.py`` compiles for sm_90a without spills and with shared memory for
two CTAs per SM (CPU, in a subprocess without the interpreter; skipped without Triton's Gluon
API of 3.6)."""
from gluon_probe import probe_json


def test_record_regs_probe_compiles_without_spills():
    rows = probe_json("record_regs_probe.py")
    assert [row["has_b"] for row in rows] == [False, True], rows
    for st in rows:
        assert st["stack"] == 0 and st["spills"] == 0, st
        assert 0 < st["smem"] <= 113 * 1024, st  # two CTAs per SM
        assert st["hgmma"] == 68, st  # 32 + 36 products per 64-key block
