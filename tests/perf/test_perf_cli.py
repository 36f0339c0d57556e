"""The ``dsv41-bench`` command end to end, on whatever device the tests run on (the CPU in CI:
PyTorch references + Triton interpreter at tiny shapes)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from dsv41_triton.perf import build_cases, default_impls
from dsv41_triton.perf.cli import main
from dsv41_triton.perf.families import LSE_ABS_TOL, OUT_REL_TOL
from dsv41_triton.perf.report import read_csv

import perf_doubles

GPU = torch.cuda.is_available()
ATTN = ("decode", "prefill", "decode_fused", "prefill_fused")
DOUBLES = ["--extra-backend", "perf_doubles:ScaledBackend",
           "--extra-backend", "perf_doubles:ExactBackend",
           "--extra-backend", "perf_doubles:RaisingBackend",
           "--extra-backend", "perf_doubles:corrupt_ops"]


def _finite(v) -> bool:
    return isinstance(v, float) and math.isfinite(v)


def test_default_command_writes_a_checked_report(tmp_path):
    out = tmp_path / "bench"
    rc = main(["-o", str(out), "-q"] + (["--quick"] if GPU else []))
    assert rc == 0  # every check passed (a failing row would make it 1)
    for name in ("results.csv", "report.md", "meta.json") + (("ceilings.json",) if GPU else ()):
        assert (out / name).is_file(), name
    # plots by default (matplotlib is a dependency)
    assert (out / "time_vs_tokens_decode.png").is_file()
    df = read_csv(out / "results.csv")

    # one row per (case, backend that has the case's family)
    cases = build_cases("v41-flash", gpu=GPU, quick=GPU)
    impls = default_impls()
    expected = {(c.case_id, i.name) for c in cases for i in impls if i.supports(c.family)}
    got = list(zip(df["case_id"], df["backend"]))
    assert len(got) == len(set(got)) == len(expected)
    assert set(got) == expected
    assert set(df["family"]) == {"decode", "prefill", "decode_fused", "prefill_fused", "insert",
                                 "gather", "combine_indices", "global_topk"}
    assert set(df["status"]) <= {"ok", "FAIL", "error", "unchecked", "unavailable", "skipped"}

    # error columns: present wherever a result was checked, consistent with the status
    checked = df[df["status"].isin(["ok", "FAIL"])]
    assert len(checked) > 0
    for _, r in checked.iterrows():
        if r["family"] in ATTN:
            assert _finite(r["out_rel_err"]) or math.isinf(r["out_rel_err"]), r["case_id"]
            tol = OUT_REL_TOL
            if r["family"].endswith("_fused"):  # on top of the oracle's own MXFP8 error
                tol += float(str(r["note"]).split("MXFP8 alone: ")[1].split(";")[0])
            ok = r["out_rel_err"] <= tol and r["lse_max_err"] <= LSE_ABS_TOL
        else:
            assert r["bit_exact"] in (True, False)
            ok = bool(r["bit_exact"]) or "ties" in str(r["note"])
        assert ok == (r["status"] == "ok") == (r["passed"] is True), (r["case_id"], r["backend"])
        assert r["time_us"] > 0 and r["reps"] >= 1
    # the torch rows are the references themselves: they must pass, with bf16-level error
    # (on a GPU the torch oracle skips cases above its size limit, by design)
    torch_rows = df[df["backend"] == "torch"]
    skipped = torch_rows["status"] == "skipped"
    assert not GPU or skipped.sum() < len(torch_rows)
    assert (torch_rows["status"] == "ok").all() if not GPU else \
        (torch_rows[~skipped]["status"] == "ok").all(), torch_rows[["case_id", "status", "note"]]
    assert torch_rows[skipped]["note"].str.contains("larger than its limit").all()
    torch_rows = torch_rows[~skipped]
    attn_torch = torch_rows[torch_rows["family"].isin(ATTN[:2])]
    assert (attn_torch["out_rel_err"] < 4e-3).all() and (attn_torch["out_rel_err"] > 0).all()
    assert (attn_torch["lse_max_err"] < 1e-5).all()
    fused_torch = torch_rows[torch_rows["family"].isin(ATTN[2:])]
    assert len(fused_torch) and (fused_torch["out_rel_err"] < 0.05).all()
    # derived columns
    timed = df[df["time_us"].notna()]
    assert (timed["gbps"] > 0).all()
    assert (timed[timed["family"].isin(ATTN)]["tflops"] > 0).all()
    if GPU:
        assert timed["pct_roof"].notna().all() and (timed["pct_roof"] <= 100).all()
    else:  # CPU ceilings are not measured: no fraction of them
        assert timed["pct_roof"].isna().all() and timed["pct_bw"].isna().all()

    md = (out / "report.md").read_text()
    for fam in ("Decode attention", "Prefill attention", "Fused decode", "Fused prefill",
                "Cache insert", "Cache gather",
                "combine_topk_swa_indices", "compute_global_topk_indices_and_lens"):
        assert fam in md
    assert "vs torch" in md or "vs flashmla" in md  # speedup columns
    meta = json.loads((out / "meta.json").read_text())
    assert meta["environment"]["torch"] == torch.__version__
    # what next, and each unavailable backend + reason said once
    nxt = md.split("## What next")[1].split("\n## ")[0]
    assert ("bash perf/run_gpu.sh" in nxt) == (not GPU)
    assert "perf/reports/" in nxt or "--compare" in nxt
    gone = df[df["status"] == "unavailable"]
    if len(gone):
        listed = md.split("## Not available on this machine")[1].split("\n## ")[0]
        lines = [ln for ln in listed.splitlines() if ln.startswith("- `")]
        keys = {(r["backend"], r["note"].split("): ", 1)[-1]) for _, r in gone.iterrows()}
        assert len(lines) == len(keys), lines
        assert sum(int(ln.rsplit(": ", 1)[1].split()[0]) for ln in lines) == len(gone)
        for b, why in keys:
            assert md.count(why) == 1, why  # not repeated in the family tables
    if GPU:
        assert "CPU run" not in md and meta["ceilings"]["source"] != "cpu (not meaningful)"
        small = df[(df["family"] == "decode") & (df["tokens"] <= 128) & (df["backend"] == "triton")
                   & df["time_us"].notna()]
        assert len(small) and (small["timing"] == "cuda-graph").all(), small[["case_id", "note"]]
        assert set(df.loc[df["time_us"].notna(), "timing"]) <= {"cuda-graph", "cuda-events"}
    else:
        assert "CPU run" in md and "mean nothing" in md
        assert meta["cpu_run"] is True
        assert "Ceilings not measured (CPU run" in md and "bf16 matmul" not in md
        assert set(df.loc[df["time_us"].notna(), "timing"]) == {"cpu-wall"}


def test_wrong_backends_are_flagged_and_the_run_goes_on(tmp_path):
    out = tmp_path / "bench"
    args = ["-o", str(out), "-q", "--quick", "--no-plots",
            "--families", "decode,prefill,decode_fused,insert,global_topk",
            "--backends", "torch,double_scaled,double_exact,double_raising,corrupt_ops"]
    # failing rows make the exit status 1; --no-fail makes it 0 with the same report
    assert main(args + DOUBLES) == 1
    assert main(args + DOUBLES + ["--no-fail", "-o", str(tmp_path / "b2")]) == 0
    md_no_fail = (tmp_path / "b2" / "report.md").read_text()
    assert "failing rows** (wrong numbers or an exception)" in md_no_fail
    df = read_csv(out / "results.csv")
    by = {b: g for b, g in df.groupby("backend")}
    assert set(by) == {"torch", "double_scaled", "double_exact", "double_raising", "corrupt_ops"}

    sc = by["double_scaled"]
    assert len(sc) == df[df["family"].isin(ATTN)]["case_id"].nunique()
    assert (sc["status"] == "FAIL").all() and (sc["passed"] == False).all()  # noqa: E712
    assert ((sc["lse_max_err"] - perf_doubles.LSE_SHIFT).abs() < 1e-4).all()
    assert sc["time_us"].notna().all()  # wrong but still timed
    scale_err = perf_doubles.OUT_SCALE - 1
    plain = sc[~sc["family"].str.endswith("_fused")]
    assert ((plain["out_rel_err"] - scale_err).abs() < 0.1 * scale_err).all(), plain["out_rel_err"]
    fused = sc[sc["family"] == "decode_fused"]
    assert len(fused) and (fused["out_rel_err"] > scale_err).all()  # plus MXFP8's own error

    ex = by["double_exact"]
    assert (ex["status"] == "ok").all(), ex[["case_id", "note"]]
    ex_plain = ex[~ex["family"].str.endswith("_fused")]
    assert (ex_plain["out_rel_err"] < 4e-3).all() and (ex["lse_max_err"] < 1e-5).all()

    ra = by["double_raising"]
    assert (ra[ra["family"] == "decode_fused"]["status"] == "error").all()  # no fused entry
    dec = ra[ra["family"] == "decode"]
    assert (dec["status"] == "error").all() and dec["note"].str.contains("boom").all()
    assert (ra[ra["family"] == "prefill"]["status"] == "unavailable").all()

    co = by["corrupt_ops"]
    assert set(co["family"]) == {"insert", "global_topk"}
    assert (co["status"] == "FAIL").all() and (co["bit_exact"] == False).all()  # noqa: E712
    assert co[co["family"] == "insert"]["note"].str.contains("1 bytes differ").all()
    assert co[co["family"] == "global_topk"]["note"].str.contains("lens differ").all()

    # the rows after the failures still ran
    # (on a GPU the float64 torch oracle skips cases above its size limit, by design)
    torch_rows = by["torch"]["status"]
    assert torch_rows.isin(["ok", "skipped"]).all() and (torch_rows == "ok").any()
    md = (out / "report.md").read_text()
    assert "failing rows" in md
    for name in ("double_scaled", "double_raising", "corrupt_ops"):
        assert name in md.split("failing rows")[1].split("##")[0]
    assert "double_exact" not in md.split("failing rows")[1].split("##")[0]


def _synthetic(times):
    rows = []
    for (cid, backend), t in times.items():
        fam = cid.split("/")[0]
        rows.append(dict(case_id=cid, family=fam, backend=backend, status="ok", time_us=t,
                         out_rel_err=1e-3, tflops=1.0, gbps=2.0, pct_roof=3.0))
    return pd.DataFrame(rows)


def test_compare_two_saved_runs(tmp_path, capsys):
    a = _synthetic({("decode/H8/T1", "triton"): 10.0, ("decode/H8/T1", "torch"): 100.0,
                    ("insert/T7", "triton"): 4.0})
    b = _synthetic({("decode/H8/T1", "triton"): 5.0, ("decode/H8/T1", "torch"): 100.0,
                    ("gather/B2", "triton"): 1.0})
    pa, pb = tmp_path / "a" / "results.csv", tmp_path / "b" / "results.csv"
    pa.parent.mkdir()
    pb.parent.mkdir()
    a.to_csv(pa, index=False)
    b.to_csv(pb, index=False)
    out = tmp_path / "cmp"
    assert main(["--compare", str(pa), str(pb), "--labels", "h200", "b200", "-o", str(out)]) == 0
    md = (out / "compare.md").read_text()
    assert "b200 vs h200" in capsys.readouterr().out  # also printed
    assert "b200 vs h200" in md and "2.00x" in md and "1.00x" in md
    assert "(absent)" in md  # insert only in A, gather only in B
    table = pd.read_csv(out / "compare.csv")
    assert len(table) == 4
    r = table[(table["case_id"] == "decode/H8/T1") & (table["backend"] == "triton")].iloc[0]
    assert r["b_vs_a"] == pytest.approx(2.0)
    # a missing file is a usage error
    assert main(["--compare", str(pa), str(tmp_path / "nope.csv"), "-o", str(out)]) == 2


def test_compare_a_real_run_with_itself(tmp_path):
    out = tmp_path / "run"
    assert main(["-o", str(out), "-q", "--quick", "--families", "global_topk", "--no-plots"]) == 0
    csv = str(out / "results.csv")
    assert main(["--compare", csv, csv, "-o", str(tmp_path / "cmp")]) == 0
    table = pd.read_csv(tmp_path / "cmp" / "compare.csv")
    assert len(table) == len(pd.read_csv(csv))
    assert (table["b_vs_a"].dropna() == 1.0).all() and table["b_vs_a"].notna().any()


def test_usage_errors(tmp_path, capsys):
    assert main(["--families", "nope", "-o", str(tmp_path)]) == 2
    assert main(["--backends", "nope", "-o", str(tmp_path)]) == 2
    assert main(["--extra-backend", "no_colon", "-o", str(tmp_path)]) == 2
    with pytest.raises(SystemExit):
        main(["--preset", "v9"])
    capsys.readouterr()


def test_list_and_module_entry_point(tmp_path):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the command sets it itself without a GPU
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + env.get("PYTHONPATH", "").split(os.pathsep))
    r = subprocess.run([sys.executable, "-m", "dsv41_triton.perf", "--list", "--preset", "tp8"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "decode/H8/" in r.stdout and "global_topk/" in r.stdout
    assert "triton" in r.stdout and "torch" in r.stdout
    assert list(tmp_path.iterdir()) == []  # --list runs and writes nothing


def test_module_run_sets_up_triton_itself(tmp_path):
    """``python -m dsv41_triton.perf`` in a fresh process, TRITON_INTERPRET unset: on a CPU it
    must switch Triton to the interpreter before any kernel is defined."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + env.get("PYTHONPATH", "").split(os.pathsep))
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "-m", "dsv41_triton.perf", "--quick", "--families",
                        "global_topk,combine_indices", "--no-plots", "-o", str(out)],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    df = read_csv(out / "results.csv")
    assert set(df["backend"]) >= {"triton", "torch"}
    assert (df[df["backend"].isin(["triton", "torch"])]["status"] == "ok").all(), df
