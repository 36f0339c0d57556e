"""The paged prefill's record kernel compiles for sm_90a with the parts ``perf/paged_topk_probe.py``
times apart (``decode_few_ws.py``'s ``MODE``): the 64 m64n8k16 products per 64-key block only
where products run (modes 0 and 3), the e4m3 conversions only where the dequant runs (0 and 2),
the same record copies in every mode, and no local memory (CPU, in a subprocess without the
interpreter; skipped without Triton's Gluon API of 3.6)."""
from gluon_probe import probe_json


def test_paged_topk_probe_modes_compile_as_designed():
    rows = {r["mode"]: r for r in probe_json("paged_topk_probe.py")}
    assert sorted(rows) == [0, 1, 2, 3], rows
    for mode, r in rows.items():
        ops = r["ops"]
        assert r["stack"] == 0 and "STL" not in ops and "LDL" not in ops, r
        assert ops.get("LDGSTS") == rows[0]["ops"]["LDGSTS"] > 0, (mode, ops)
        assert ops.get("HGMMA", 0) == (64 if mode in (0, 3) else 0), (mode, ops)
    # the dequant: e4m3 pairs unpacked and bf16 pairs packed (112 F2FP a thread and block)
    convert = rows[0]["ops"]["F2FP"] - rows[3]["ops"]["F2FP"]
    assert convert >= 100, rows
    assert rows[2]["ops"]["F2FP"] - rows[1]["ops"]["F2FP"] == convert, rows
    # the copies-alone build keeps no bf16 key tiles (64 KB each)
    assert rows[0]["smem"] - rows[1]["smem"] >= 2 * 64 * 1024, rows
