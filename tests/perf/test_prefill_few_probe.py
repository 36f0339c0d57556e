"""The few-heads Gluon prefill (``attention/gluon/prefill_few.py``) compiles for sm_90a as
designed (``perf/prefill_few_probe.py --json``): the 64 keys-as-M products per 64-key block
(m64n8k16: 8 dim groups x 4 k16 steps for S^T, 8 dim tiles x 4 for O^T), no local memory with
or without the prior, one CTA's shared memory at both ring depths, no products in the
copies-alone mode, the mma.sync form's 128 ``HMMA`` per block (two consumers) and the movm
form's 64 ``HMMA`` and 128 ``MOVM`` (per consumer, one block); the
shared-window kernel (``prefill_window.py``) at 8 and 1 heads a token without local memory (CPU, in a subprocess without the interpreter; skipped without Triton's
Gluon API of 3.6)."""
from gluon_probe import probe_json


def test_prefill_few_compiles_as_designed():
    rows = probe_json("prefill_few_probe.py")
    window = [r for r in rows if r["kind"] == "window"]
    rows = [r for r in rows if r["kind"] == "few"]
    # the shared-window kernel: QK^T and PV on 64-row wgmma tiles, no local memory
    assert [r["hp"] for r in window] == [8, 1], window
    for r in window:
        assert r["stack"] == 0 and "LDL" not in r["ops"] and 0 < r["smem"] <= 227 * 1024, r
        assert r["ops"].get("HGMMA64x64x16", 0) > 0 and r["ops"].get("HGMMA64x256x16", 0) > 0, r
    assert [(r["ns"], r["mode"], r["prior"], r["form"]) for r in rows] == [
        (2, 0, False, "wgmma"), (2, 0, True, "wgmma"), (3, 0, False, "wgmma"),
        (2, 1, False, "wgmma"), (2, 0, False, "sync"), (2, 0, True, "sync"),
        (2, 0, False, "movm"), (2, 1, False, "movm"), (1, 0, True, "wgmma2")], rows
    two = rows[8]
    movm = rows[6:8]
    rows = rows[:6]
    # two CTAs per SM: 128 registers a thread at launch (setmaxnreg moves them between the
    # partitions), the shared memory of two CTAs within the SM's 228 KB (1 KB reserved each),
    # the same 64 m64n8k16 per block, nothing spilled
    assert two["regs"] <= 128 and two["stack"] == 0 and "LDL" not in two["ops"], two
    assert 2 * (two["smem"] + 1024) <= 228 * 1024, two
    assert two["ops"].get("HGMMA64x8x16") == 64, two["ops"]
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
    for r in rows[4:]:  # two mma.sync consumers: 8 x 4 m16n8k16 for S and for O per warp each
        assert r["ops"].get("HMMA") == 128 and "HGMMA64x8x16" not in r["ops"], r["ops"]
    # the movm form: per consumer and block 4 x 4 m16n8k16 for S^T, 16 for O^T; each key tile
    # read from shared memory once (16 ldmatrix of K, 8 of Q) and transposed by 64 movmatrix
    assert movm[0]["ops"].get("HMMA") == 64 and movm[0]["ops"].get("MOVM") == 128, movm[0]
    assert "HMMA" not in movm[1]["ops"] and "MOVM" not in movm[1]["ops"], movm[1]
    for r in movm:
        assert 0 < r["smem"] <= 227 * 1024 and r["ops"].get("LDGSTS", 0) >= 32, r
