"""The harness's pieces: cases, checks, runner bookkeeping, timing, ceilings, report, plots."""
import math

import pandas as pd
import pytest
import torch

from dsv41_triton.perf import (PRESETS, Case, Impl, RunConfig, build_cases, get_ceilings,
                               run_benchmark, time_call, write_report)
from dsv41_triton.perf import ceilings as ceil_mod
from dsv41_triton.perf import report as report_mod
from dsv41_triton.perf.families import get_family
from dsv41_triton.perf.impls import load_impl
from dsv41_triton.perf.report import add_speedups, choose_baselines, read_csv
from dsv41_triton.perf.runner import COLUMNS

GPU = torch.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("gpu,quick", [(True, False), (True, True), (False, False), (False, True)])
def test_presets_build_unique_cases(preset, gpu, quick):
    cases = build_cases(preset, gpu=gpu, quick=quick)
    ids = [c.case_id for c in cases]
    assert len(ids) == len(set(ids)) and len(ids) > 0
    p = PRESETS[preset]
    for c in cases:
        assert c.preset == preset
        if c.family in ("decode", "prefill"):
            assert c.heads in p.heads or (not gpu and c.heads == 3)
            assert c.keys == c.window + (c.topk if c.ratio else 0)
        if c.family == "decode":
            assert (c.extra_record is None) == (c.ratio == 0)
    fams = {c.family for c in cases}
    assert fams >= {"decode", "prefill", "decode_fused", "insert", "gather", "combine_indices",
                    "global_topk"}
    assert "prefill_fused" in fams or quick
    for c in cases:
        if c.family.endswith("_fused"):
            assert c.heads % 8 == 0 and c.q_norm == p.q_norm
    if gpu and not quick:
        dec = [c for c in cases if c.family == "decode"]
        assert {c.tokens for c in dec} == {1, 32, 128, 512}
        assert {c.heads for c in dec} == set(p.heads)
        assert any(c.ratio == 0 for c in dec) and any(c.ratio > 0 for c in dec)


def test_preset_numbers():
    assert {c.heads for c in build_cases("tp8") if c.heads} == {8}
    pro = [c for c in build_cases("v4-pro") if c.family == "decode"]
    assert max(c.heads for c in pro) == 128 and {c.topk for c in pro} == {1024}
    v41 = build_cases("v41-flash")
    assert {c.swa_record for c in v41 if c.family == "insert"} == {584, 528, 288}
    cpu = build_cases("v41-flash", gpu=False)
    assert any(c.extra_record == 288 for c in cpu if c.family == "decode")
    assert any(c.heads == 3 for c in cpu)  # odd head count
    assert [c.family for c in build_cases(families=["gather"])] == ["gather"] * 2 * 3


def test_case_validation():
    with pytest.raises(ValueError, match="family"):
        Case("nope", 1)
    with pytest.raises(ValueError, match="tokens"):
        Case("insert", 0)
    with pytest.raises(ValueError, match="heads"):
        Case("decode", 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        Case("decode_fused", 1, 12)
    with pytest.raises(ValueError, match="layout"):
        Case("prefill_fused", 1, 8, layout="x")
    with pytest.raises(ValueError, match="preset"):
        build_cases("v9")
    with pytest.raises(ValueError, match="families"):
        build_cases(families=["decode", "x"])


# ---------------------------------------------------------------------------------------------
# checks: a wrong result is caught (and a right one is not)
# ---------------------------------------------------------------------------------------------
def _run(fam_name, case, fn, device="cpu"):
    fam = get_family(fam_name)
    st = fam.build(case, device, 1)
    ref = fam.reference(st)
    call = fam.fresh(st)
    return fam.check(st, call, fam.invoke(fn, call), ref), st


def test_gather_check_catches_one_unwritten_row():
    from dsv41_triton.ops.kv_cache_ref import dequantize_and_gather_k_cache_ref as ref

    case = Case("gather", 9, swa_record=528, page=4, requests=2)

    def lazy(out, *a):
        keep = out[1, 10].clone()
        ref(out, *a)
        out[1, 10] = keep  # leaves one row poisoned

    chk, _ = _run("gather", case, ref)
    assert chk.passed is True and chk.bit_exact is True
    chk, _ = _run("gather", case, lazy)
    assert chk.passed is False and "1 of" not in chk.note and "512 of" in chk.note


def test_decode_check_catches_unwritten_token():
    from dsv41_triton.attention.ref import sparse_mla_decode_ref

    def partial(q, *a, out=None, **k):
        o, lse = sparse_mla_decode_ref(q, *a, **k)
        out[1:].copy_(o[1:].to(out.dtype))  # token 0 left as poison
        return out, lse.float()

    case = Case("decode", 3, 2, 584, 528, window=8, topk=8, ratio=1, page=4, requests=3)
    chk, _ = _run("decode", case, partial)
    assert chk.passed is False and math.isinf(chk.out_rel_err) and "NaN" in chk.note


def test_nvfp4_insert_check_allows_ties_only():
    from dsv41_triton.ops.kv_cache_ref import quantize_and_insert_k_cache_ref as ref
    from dsv41_triton.ops.records import NVFP4, record_views

    case = Case("insert", 3, swa_record=288, page=4)
    fam = get_family("insert")
    st = fam.build(case, "cpu", 3)
    # token 0, group 0: amax 6 -> scale 1; element 1 = 0.25 is a tie between codes 0 and 1
    k = st["k"]
    k[0, :16] = 0.0
    k[0, 0], k[0, 1], k[0, 2] = 6.0, 0.25, 0.3
    ref_cache = fam.reference(st)

    def flip(code_index, new_code):
        def insert(kk, cache, slots):
            ref(kk, cache, slots)
            data, _ = record_views(cache, NVFP4)  # records are split: data rows first
            page = cache.shape[1]
            s = int(slots[0])
            b = data[s // page, s % page, code_index // 2]
            if code_index % 2:
                b = (b & 0x0F) | (new_code << 4)
            else:
                b = (b & 0xF0) | new_code
            data[s // page, s % page, code_index // 2] = b
        return insert

    for idx, code, ok in ((1, 1, True), (2, 0, False)):
        call = fam.fresh(st)
        chk = fam.check(st, call, fam.invoke(flip(idx, code), call), ref_cache)
        assert chk.passed is ok and chk.bit_exact is False, chk.note
    call = fam.fresh(st)
    assert fam.check(st, call, fam.invoke(ref, call), ref_cache).bit_exact is True


def test_insert_check_catches_a_write_outside_the_records():
    from dsv41_triton.ops.kv_cache_ref import quantize_and_insert_k_cache_ref as ref

    def stray(k, cache, slots):
        ref(k, cache, slots)
        free = [s for s in range(cache.shape[0] * cache.shape[1]) if s not in set(slots.tolist())]
        s = free[0]
        cache[s // cache.shape[1], s % cache.shape[1], 0] ^= 1

    chk, _ = _run("insert", Case("insert", 5, swa_record=584, page=4), stray)
    assert chk.passed is False and "1 bytes differ" in chk.note


# ---------------------------------------------------------------------------------------------
# runner bookkeeping
# ---------------------------------------------------------------------------------------------
def _impl(name, **fns):
    return Impl(name, fns, f"{name} double")


def test_runner_rows_errors_skips_and_progress():
    from dsv41_triton.attention.ref import sparse_mla_prefill_ref
    from dsv41_triton.ops.indices_ref import compute_global_topk_indices_and_lens_ref as gt

    def boom(*a):
        raise ValueError("bad input")

    def prefill(q, kv, indices, lens=None, attn_sink=None, softmax_scale=None, out=None):
        return sparse_mla_prefill_ref(q, kv, indices, lens, attn_sink, softmax_scale)

    cases = [Case("prefill", 2, 1, window=4, topk=4, page=4),
             Case("prefill", 40, 1, window=4, topk=4, page=4),
             Case("global_topk", 5, topk=8, page=4), Case("global_topk", 40, topk=8, page=4),
             Case("insert", 3, swa_record=584, page=4)]
    impls = [_impl("good", global_topk=gt, prefill=prefill), _impl("bad", global_topk=boom),
             Impl("never", {"global_topk": gt}, probe=lambda c, d: (False, "no device")),
             Impl("probe_raises", {"global_topk": gt}, probe=lambda c, d: 1 / 0)]
    lines = []
    from dsv41_triton.perf.runner import _work_of

    cfg = RunConfig(progress=lines.append, max_work={"good": _work_of(cases[0])})
    assert _work_of(cases[2]) == 0
    df = run_benchmark(cases, impls, cfg)
    assert list(df.columns) == COLUMNS
    assert len(df) == 10  # insert has no implementation here: no rows
    st = {(r.case_id.split("/")[1], r.backend): r for r in df.itertuples()}
    assert st[("T5", "good")].status == "ok" and st[("T5", "good")].bit_exact is True
    assert st[("T40", "good")].status == "ok"  # ops are never skipped for size
    pre = {r.tokens: r for r in df[df["family"] == "prefill"].itertuples()}
    assert pre[2].status == "ok" and pre[40].status == "skipped"
    assert st[("T5", "bad")].status == "error" and "ValueError: bad input" in st[("T5", "bad")].note
    assert st[("T5", "never")].status == "unavailable" and st[("T5", "never")].note == "no device"
    assert st[("T5", "probe_raises")].status == "unavailable"
    assert "ZeroDivisionError" in st[("T5", "probe_raises")].note
    # an unavailable backend is said once per reason: "never" and "probe_raises" print their
    # first case only
    assert len([ln for ln in lines if ln.startswith("[")]) == 8 and lines[-1].startswith("done")
    assert lines[-2] == "(2 more unavailable rows, each for a reason printed above)"

    # a time limit already reached: every case is reported, none is run
    df2 = run_benchmark(cases, impls, RunConfig(time_limit_s=0.0))
    assert len(df2) == 10 and (df2["status"] == "skipped").all()
    assert df2["note"].str.contains("time limit").all() and df2["time_us"].isna().all()


def test_runner_without_reference_marks_unchecked(monkeypatch):
    from dsv41_triton.ops.indices_ref import compute_global_topk_indices_and_lens_ref as gt
    from dsv41_triton.perf import families

    monkeypatch.setitem(families.REFERENCES, "global_topk", ("no.such.module", "x"))
    df = run_benchmark([Case("global_topk", 3, topk=8, page=4)], [_impl("good", global_topk=gt)])
    r = df.iloc[0]
    assert r["status"] == "unchecked" and r["passed"] is None
    assert "no reference" in r["note"] and r["time_us"] > 0


def test_derived_columns_from_ceilings():
    from dsv41_triton.ops.indices_ref import compute_global_topk_indices_and_lens_ref as gt

    c = ceil_mod.Ceilings(copy_gbps=1e3, matmul_tflops=1.0, device="x", source="test")
    df = run_benchmark([Case("global_topk", 4, topk=8, page=4)], [_impl("g", global_topk=gt)],
                       ceilings=c)
    r = df.iloc[0]
    assert r["gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
    assert r["pct_bw"] == pytest.approx(100 * r["gbps"] / 1e3) and 0 < r["pct_bw"] < 100
    assert r["pct_roof"] == pytest.approx(r["pct_bw"]) and math.isnan(r["tflops"])


def test_roof_above_the_ceiling_is_capped_with_a_note():
    """A ceiling measured below what a call achieves: pct_roof shows 100 and says why; the raw
    fractions stay in pct_bw / pct_mm."""
    from dsv41_triton.perf.runner import ROOF_CAP_NOTE, _derive

    c = ceil_mod.Ceilings(copy_gbps=1.0, matmul_tflops=1.0, device="x", source="test")
    row = dict(time_us=1.0, flops=0.0, bytes=5e3, note="")  # 5 GB/s against a 1 GB/s ceiling
    _derive(row, c)
    assert row["pct_bw"] == pytest.approx(500.0) and row["pct_roof"] == 100.0
    assert row["note"] == ROOF_CAP_NOTE
    row = dict(time_us=1.0, flops=0.0, bytes=5e2, note="checked 3 tokens")
    _derive(row, c)
    assert row["pct_roof"] == pytest.approx(50.0) and row["note"] == "checked 3 tokens"
    # ceilings not measured (a CPU run): no fraction at all
    row = dict(time_us=1.0, flops=1e6, bytes=5e2, note="")
    _derive(row, ceil_mod.Ceilings.not_measured("cpu", "CPU run"))
    assert math.isnan(row["pct_roof"]) and math.isnan(row["pct_bw"]) and row["gbps"] > 0


def test_decode_bytes_count_shared_window_keys_once():
    """Decode tokens of one request share window keys: bytes count each record once."""
    fam = get_family("decode")
    one = Case("decode", 4, 1, 584, None, 8, 8, 0, 4, requests=4)
    shared = Case("decode", 4, 1, 584, None, 8, 8, 0, 4, requests=1)
    qol = 4 * 1 * (2 * 512 * 2 + 4)  # q, out, lse
    for case, keys in ((one, 4 * 8), (shared, 8 + 3)):  # one request: W + 3 distinct positions
        st = fam.build(case, torch.device("cpu"), 0)
        flops, nbytes = fam.work(case, st)
        assert flops == 4.0 * 1 * 4 * 8 * 512
        assert nbytes == keys * 584 + qol, case.case_id


def test_load_impl_forms():
    assert load_impl("perf_doubles:corrupt_ops").name == "corrupt_ops"
    assert load_impl("perf_doubles:ScaledBackend").name == "double_scaled"
    with pytest.raises(TypeError):
        load_impl("perf_doubles:OUT_SCALE")
    with pytest.raises(ValueError):
        load_impl("perf_doubles")


# ---------------------------------------------------------------------------------------------
# timing and ceilings
# ---------------------------------------------------------------------------------------------
def test_time_call_cpu():
    calls = []
    t = time_call(lambda: calls.append(1), "cpu", cpu_reps=3)
    assert t.method == "cpu-wall" and t.reps == 3 and len(calls) == 3
    assert 0 <= t.min_us <= t.median_us and "not meaningful" in t.note


def test_ceilings_not_measured_on_cpu_and_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    c = get_ceilings("cpu", tmp_path)
    assert not c.measured and math.isnan(c.copy_gbps) and math.isnan(c.matmul_tflops)
    assert c.source.startswith("not measured (CPU run")
    assert not (tmp_path / "ceilings.json").exists() and not (tmp_path / "xdg").exists()
    # measuring a CPU on purpose still works
    m = ceil_mod.measure_ceilings("cpu")
    assert m.measured and "not meaningful" in m.source
    # the cache format round-trips
    c2 = ceil_mod.Ceilings(1.5, 2.5, "fake gpu", "measured")
    ceil_mod._write(tmp_path / "c.json", c2)
    back = ceil_mod._read(tmp_path / "c.json", "fake gpu")
    assert (back.copy_gbps, back.matmul_tflops) == (1.5, 2.5) and back.source.startswith("cached")
    assert ceil_mod._read(tmp_path / "c.json", "other gpu") is None


@pytest.mark.gpu
def test_cuda_timing_graph_and_ceiling_cache(tmp_path, monkeypatch):
    from dsv41_triton.perf.timing import time_cuda

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty_like(x)
    t_eager = time_cuda(lambda: y.copy_(x), budget_ms=5)
    t_graph = time_cuda(lambda: y.copy_(x), use_graph=True, budget_ms=5)
    assert t_eager.method == "cuda-events" and t_graph.method == "cuda-graph"
    assert 0 < t_graph.median_us < 1e4 and t_eager.reps >= 5

    def syncs():
        y.copy_(x)
        return float(y[0])  # a host sync: cannot be captured

    t_bad = time_cuda(syncs, use_graph=True, budget_ms=5)
    assert t_bad.method == "cuda-events" and "timed eagerly" in t_bad.note
    c1 = get_ceilings("cuda", tmp_path / "a")
    assert c1.source == "measured" and c1.copy_gbps > 100 and c1.matmul_tflops > 10
    c2 = get_ceilings("cuda", tmp_path / "b")  # from the user cache now
    assert c2.source.startswith("cached") and c2.copy_gbps == c1.copy_gbps


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _df():
    rows = []
    for cid, fam, b, st, t in [
        ("decode/a", "decode", "flashmla", "ok", 10.0), ("decode/a", "decode", "triton", "ok", 20.0),
        ("decode/a", "decode", "torch", "ok", 400.0), ("decode/b", "decode", "flashmla", "unavailable", None),
        ("decode/b", "decode", "triton", "FAIL", 5.0), ("decode/b", "decode", "torch", "ok", 50.0),
        ("insert/a", "insert", "triton", "ok", 2.0), ("insert/a", "insert", "torch", "ok", 8.0),
        ("insert/a", "insert", "flashmla", "unavailable", None),
    ]:
        rows.append({c: None for c in COLUMNS} | dict(
            case_id=cid, family=fam, backend=b, status=st, time_us=t, heads=8, tokens=1,
            layer="c1", records="584", keys=640, swa_record=584, topk=512, requests=1,
            flops=1e9 if fam == "decode" else 0.0, bytes=1e6, out_rel_err=1e-3, lse_max_err=1e-6,
            tflops=1e9 / (t * 1e-6) / 1e12 if t else math.nan, gbps=1e6 / (t * 1e-6) / 1e9 if t else math.nan,
            pct_roof=1.0, note="why not" if st == "unavailable" else ""))
    return pd.DataFrame(rows, columns=COLUMNS)


def test_speedups_and_baselines():
    df = _df()
    assert choose_baselines(df) == {"decode": "flashmla", "insert": "torch"}
    assert choose_baselines(df, "triton") == {"decode": "triton", "insert": "triton"}
    s = add_speedups(df)
    sp = {(r.case_id, r.backend): r.speedup for r in s.itertuples()}
    assert sp[("decode/a", "triton")] == pytest.approx(0.5)
    assert sp[("decode/a", "torch")] == pytest.approx(10 / 400)
    assert math.isnan(sp[("decode/b", "triton")])  # no baseline timing for this case
    assert sp[("insert/a", "triton")] == pytest.approx(4.0)


def test_markdown_report_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(report_mod, "_plt", lambda: None)
    meta = dict(preset="v41-flash", environment={"device": "Fake GPU"}, cpu_run=False,
                ceilings=dict(copy_gbps=4000.0, matmul_tflops=700.0, source="measured",
                              copy_bytes=1 << 30, matmul_n=8192),
                command="dsv41-bench", max_ref_tokens=128)
    paths = write_report(_df(), tmp_path, meta)
    md = paths["md"].read_text()
    assert "flashmla vs ... " not in md
    assert "| case | flashmla (us) | triton (us) | torch (us) | triton vs flashmla | torch vs flashmla |" in md
    assert "0.50x" in md and "4.00x" in md and "FAIL" in md
    assert "Plots skipped: matplotlib cannot be imported" in md
    assert "4,000 GB/s" in md and "700 TFLOP/s" in md and "CPU run" not in md
    assert "Not available here: `flashmla`" in md  # insert: flashmla never ran
    # one line for flashmla's one reason, whatever the number of rows and families
    gone = md.split("## Not available on this machine")[1].split("##")[0]
    assert gone.count("`flashmla`") == 1 and "why not (decode, insert: 2 rows)" in gone
    assert md.count("why not") == 1
    nxt = md.split("## What next")[1].split("##")[0]
    assert "dsv41-bench --families <family> --backends <backend>" in nxt  # a row failed
    assert "--compare" in nxt and "perf/bench_attention.py" in nxt  # a GPU run
    assert "1 failing rows" in md
    back = read_csv(paths["csv"])
    assert len(back) == 9 and "speedup" in back.columns and "baseline" in back.columns


def test_next_steps_name_the_gpu_command_and_the_committed_reports(tmp_path):
    from dsv41_triton.perf.report import committed_reports, next_steps

    reports = tmp_path / "perf" / "reports"
    (reports / "2026-11-29-h200-x").mkdir(parents=True)
    (reports / "2026-11-29-h200-x" / "report.md").write_text("x")
    (reports / "2026-11-29-h200-summary.md").write_text("x")
    assert committed_reports(reports) == ["perf/reports/2026-11-29-h200-x/report.md",
                                          "perf/reports/2026-11-29-h200-summary.md"]
    cpu = next_steps(cpu_run=True, failed=False, reports_dir=reports)
    assert len(cpu) == 2 and "bash perf/run_gpu.sh" in cpu[0]
    assert "`perf/reports/2026-11-29-h200-summary.md`" in cpu[1]
    assert "perf/reports/" in next_steps(True, False, reports_dir=tmp_path / "none")[1]
    gpu = next_steps(cpu_run=False, failed=True, results_csv="o/results.csv", reports_dir=reports)
    assert "--backends <backend>" in gpu[0]
    assert ("dsv41-bench --compare perf/reports/2026-11-29-h200-x/results.csv o/results.csv"
            in gpu[1])
    # the repository's own reports are found from an editable install or a checkout
    assert any(r.endswith("-summary.md") for r in committed_reports())


def test_cpu_report_says_ceilings_are_not_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(report_mod, "_plt", lambda: None)
    df = _df()
    df["pct_roof"] = math.nan
    meta = dict(preset="v41-flash", environment={"device": "cpu"}, cpu_run=True,
                ceilings=ceil_mod.Ceilings.not_measured("cpu", "CPU run: x").to_dict())
    md = write_report(df, tmp_path, meta)["md"].read_text()
    assert "Ceilings not measured (CPU run: x). The `% roof` columns stay empty" in md
    assert "bf16 matmul" not in md
    assert "bash perf/run_gpu.sh" in md.split("## What next")[1].split("##")[0]


def test_plots_written_with_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    from dsv41_triton.perf.report import make_plots

    df = _df()
    df.loc[df["case_id"] == "decode/b", "tokens"] = 32
    df["pct_bw"] = 1.0
    meta = dict(ceilings=dict(copy_gbps=4000.0, matmul_tflops=700.0))
    paths, note = make_plots(df, tmp_path, meta)
    names = sorted(p.split("/")[-1] for p in paths)
    assert names == ["ops_bandwidth.png", "roofline.png", "time_vs_tokens_decode.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
