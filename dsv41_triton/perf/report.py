"""Reports: ``results.csv``, ``meta.json``, ``report.md``, PNG plots, and the two-run comparison.

The Markdown has a summary (failing rows first), what to do next, the backends that cannot
run here (one line per backend and reason), and per case family a summary table (time of every
backend and its speedup over the baseline backend) and a detail table (status, error figures,
TFLOP/s, GB/s, fraction of the measured ceilings). Plots use matplotlib (a dependency of the
package); where it cannot be imported they are skipped and the report says so.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

from .cases import ATTENTION_FAMILIES, FAMILIES
from .families import LSE_ABS_TOL, OUT_REL_TOL
from .runner import ROOF_CAP, unavailable_reason

#: baseline preference when ``baseline="auto"`` (first one with timings in a family)
AUTO_BASELINE = ("flashmla", "vllm", "torch", "triton")
TIMED = ("ok", "FAIL", "unchecked")
#: statuses that make ``dsv41-bench`` exit with status 1 (unless ``--no-fail``)
FAILED = ("FAIL", "error")
#: the repository's committed reports (present in a source checkout, not in a wheel)
REPORTS_DIR = Path(__file__).resolve().parents[2] / "perf" / "reports"

FAMILY_TITLES = {
    "decode": "Decode attention (`sparse_mla_decode`, paged caches)",
    "prefill": "Prefill attention (`sparse_mla_prefill`, bf16 workspace)",
    "decode_fused": "Fused decode (`sparse_mla_decode_fused`: RoPE in, inverse RoPE + MXFP8 out)",
    "prefill_fused": "Fused prefill (`sparse_mla_prefill_fused`: RoPE in, inverse RoPE + MXFP8 out)",
    "insert": "Cache insert (`quantize_and_insert_k_cache`)",
    "gather": "Cache gather (`dequantize_and_gather_k_cache`)",
    "combine_indices": "Prefill index rows (`combine_topk_swa_indices`)",
    "global_topk": "Decode slot translation (`compute_global_topk_indices_and_lens`)",
}


# ---------------------------------------------------------------------------------------------
# small formatting helpers
# ---------------------------------------------------------------------------------------------
def _isnum(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def fmt_time(us) -> str:
    """Microseconds, about 3-4 significant digits."""
    if not _isnum(us):
        return "-"
    if us >= 1000:
        return f"{us:,.0f}"
    return f"{us:.1f}" if us >= 10 else f"{us:.2f}"


def fmt_sig(v, digits: int = 3) -> str:
    if not _isnum(v):
        return "-"
    return f"{v:,.0f}" if abs(v) >= 10 ** digits else f"{v:.{digits}g}"


def fmt_num(v, digits: int = 1) -> str:
    return f"{v:,.{digits}f}" if _isnum(v) else "-"


def fmt_err(v) -> str:
    if not _isnum(v):
        return "inf" if isinstance(v, float) and math.isinf(v) else "-"
    return "0" if v == 0 else f"{v:.1e}"


def md_escape(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def md_table(headers: Sequence[str], rows: Iterable[Sequence[object]],
             align: Optional[Sequence[str]] = None) -> str:
    """A GitHub Markdown table (``align``: "l"/"r" per column)."""
    align = align or ["l"] * len(headers)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(md_escape(h) for h in headers) + " |", "| " + " | ".join(sep) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(md_escape(c) for c in r) + " |")
    return "\n".join(lines)


def _bool(v) -> Optional[bool]:
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, str):
        return {"true": True, "false": False}.get(v.lower())
    if _isnum(v):
        return bool(v)
    return None


# ---------------------------------------------------------------------------------------------
# speedups
# ---------------------------------------------------------------------------------------------
def choose_baselines(df: pd.DataFrame, baseline: str = "auto") -> Dict[str, Optional[str]]:
    """Per family, the backend that speedups are relative to: ``baseline`` where it has
    timings in that family, else the first of ``AUTO_BASELINE`` that has."""
    out: Dict[str, Optional[str]] = {}
    for fam, g in df.groupby("family", sort=False):
        timed = set(g.loc[g["status"].isin(TIMED) & g["time_us"].notna(), "backend"])
        prefs = ([baseline] if baseline != "auto" else []) + list(AUTO_BASELINE)
        out[fam] = next((b for b in prefs if b in timed), None)
    return out


def add_speedups(df: pd.DataFrame, baseline: str = "auto") -> pd.DataFrame:
    """Add ``baseline`` and ``speedup`` (= baseline time / this time; > 1 is faster)."""
    df = df.copy()
    bases = choose_baselines(df, baseline)
    df["baseline"] = df["family"].map(bases)
    base_t = {}
    for _, r in df.iterrows():
        if r["backend"] == r["baseline"] and r["status"] in TIMED:
            base_t[r["case_id"]] = r["time_us"]
    sp = []
    for _, r in df.iterrows():
        bt, t = base_t.get(r["case_id"]), r["time_us"]
        sp.append(bt / t if _isnum(bt) and _isnum(t) and t > 0 and r["status"] in TIMED
                  else math.nan)
    df["speedup"] = sp
    return df


# ---------------------------------------------------------------------------------------------
# what next, and what cannot run here
# ---------------------------------------------------------------------------------------------
def committed_reports(reports_dir: Optional[Path] = None) -> List[str]:
    """Paths (relative to the repository root) of the committed GPU reports, newest first:
    each ``*-summary.md`` and each run folder's ``report.md``. Empty outside a checkout."""
    d = Path(reports_dir) if reports_dir is not None else REPORTS_DIR
    if not d.is_dir():
        return []
    found = [p for p in d.glob("*-summary.md")] + [p for p in d.glob("*/report.md")]
    root = d.parent.parent
    return [str(p.relative_to(root)) for p in sorted(found, key=lambda p: str(p), reverse=True)]


def next_steps(cpu_run: bool, failed: bool, results_csv: Optional[str] = None,
               reports_dir: Optional[Path] = None) -> List[str]:
    """What to do after this run, one line each (Markdown inline code for commands)."""
    lines = []
    if failed:
        lines.append("fix or report the failing rows first: rerun one of them with "
                     "`dsv41-bench --families <family> --backends <backend>`; the `note` "
                     "column says what differed")
    reports = committed_reports(reports_dir)
    runs = [r for r in reports if r.endswith("/report.md")]
    if cpu_run:
        lines.append("measure on a GPU: `bash perf/run_gpu.sh` from a checkout (the tests on "
                     "the GPU, GPU-only ones included, then this harness, then a summary "
                     "table; `--quick` for a few cases), or `dsv41-bench` there")
        if reports:
            lines.append("measured numbers already committed: "
                         + ", ".join(f"`{r}`" for r in reports))
        else:
            lines.append("measured H200 reports are committed under `perf/reports/` in the "
                         "source repository")
    else:
        if runs:
            csv = runs[0][: -len("report.md")] + "results.csv"
            lines.append(f"compare with the committed run: `dsv41-bench --compare {csv} "
                         f"{results_csv or '<this run>/results.csv'} --labels committed this`")
        lines.append("kernel tuning: `python perf/bench_attention.py`; what was tried and "
                     "measured: `perf/NOTES.md`")
    return lines


def unavailable_summary(df: pd.DataFrame) -> List[Tuple[str, str, List[str], int]]:
    """One entry per (backend, reason) of the ``unavailable`` rows:
    ``(backend, reason, families, row count)``, in the order they first appear."""
    g = df[df["status"] == "unavailable"]
    seen: Dict[Tuple[str, str], List] = {}
    for _, r in g.iterrows():
        key = (r["backend"], unavailable_reason(r["backend"], r["note"]))
        fams, n = seen.get(key, ([], 0))
        if r["family"] not in fams:
            fams.append(r["family"])
        seen[key] = (fams, n + 1)
    return [(b, why, fams, n) for (b, why), (fams, n) in seen.items()]


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------
def write_csv(df: pd.DataFrame, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return path


def read_csv(path) -> pd.DataFrame:
    df = pd.read_csv(path)
    for col in ("passed", "bit_exact"):
        if col in df.columns:
            df[col] = df[col].map(_bool).astype(object)
    for col in ("note", "timing", "baseline", "records", "extra_record"):
        if col in df.columns:
            df[col] = df[col].astype(object).where(df[col].notna(), None)
    return df


def _case_label(r) -> str:
    f = r["family"]
    if f == "decode":
        return f"H{r['heads']} T{r['tokens']} {r['layer']} {r['records']}"
    if f == "prefill":
        return f"H{r['heads']} T{r['tokens']} {r['layer']} k{r['keys']}"
    if f in ("decode_fused", "prefill_fused"):
        rec = f" {r['records']}" if f == "decode_fused" else f" k{r['keys']}"
        qn = " qnorm" if _bool(r.get("q_norm")) else ""
        return f"H{r['heads']} T{r['tokens']} {r['layer']}{rec} {r.get('layout') or ''}{qn}"
    if f == "insert":
        return f"T{r['tokens']} r{r['swa_record']}"
    if f == "gather":
        return f"{r['requests']}x{r['tokens']} r{r['swa_record']}"
    if f == "combine_indices":
        return f"T{r['tokens']} {r['layer']} w{r['keys']}"
    return f"T{r['tokens']} k{r['topk']}"


def _cell(r) -> str:
    st = r["status"]
    if st in TIMED:
        mark = {"ok": "", "FAIL": " ✗FAIL", "unchecked": " (unchecked)"}[st]
        return fmt_time(r["time_us"]) + mark
    return {"unavailable": "n/a", "skipped": "skip"}.get(st, st)


def family_tables(df: pd.DataFrame, family: str, baseline: Optional[str]) -> str:
    g = df[df["family"] == family]
    # backends that could not run any case of the family get one line instead of columns
    absent = [b for b, bg in g.groupby("backend", sort=False)
              if (bg["status"] == "unavailable").all()]
    g = g[~g["backend"].isin(absent)]
    backends = list(dict.fromkeys(g["backend"]))
    # summary pivot
    heads = ["case"] + [f"{b} (us)" for b in backends]
    others = [b for b in backends if b != baseline] if baseline else []
    heads += [f"{b} vs {baseline}" for b in others]
    rows = []
    for cid, cg in g.groupby("case_id", sort=False):
        by = {r["backend"]: r for _, r in cg.iterrows()}
        first = cg.iloc[0]
        row = [_case_label(first)] + [_cell(by[b]) if b in by else "" for b in backends]
        for b in others:
            sp = by[b]["speedup"] if b in by else math.nan
            row.append(f"{sp:.2f}x" if _isnum(sp) else "-")
        rows.append(row)
    parts = [md_table(heads, rows, ["l"] + ["r"] * (len(heads) - 1))] if backends else []
    if absent:
        parts.append("Not available here: " + ", ".join(f"`{b}`" for b in absent)
                     + " (why: *Not available on this machine* above).")
    g = g[g["status"] != "unavailable"]  # their reasons are listed once, above
    # details
    attn = family in ATTENTION_FAMILIES
    dh = ["case", "backend", "status", "time (us)", "TFLOP/s" if attn else "GB/s",
          "% roof", "rel err" if attn else "exact", "lse err" if attn else "mismatch", "note"]
    drows = []
    for _, r in g.iterrows():
        if attn:
            perf, err1, err2 = (fmt_sig(r["tflops"]), fmt_err(r["out_rel_err"]),
                                 fmt_err(r["lse_max_err"]))
        else:
            be = _bool(r["bit_exact"])
            perf = fmt_sig(r["gbps"])
            err1 = {True: "yes", False: "no", None: "-"}[be]
            err2 = fmt_err(r["out_rel_err"])
        drows.append([_case_label(r), r["backend"], r["status"], fmt_time(r["time_us"]), perf,
                      fmt_sig(r["pct_roof"], 2), err1, err2, str(r["note"] or "")[:160]])
    parts.append("<details><summary>details</summary>\n\n"
                 + md_table(dh, drows, ["l", "l", "l", "r", "r", "r", "r", "r", "l"])
                 + "\n\n</details>")
    return "\n\n".join(parts)


def markdown_report(df: pd.DataFrame, meta: Dict[str, object],
                    plots: Sequence[str] = (), plot_note: str = "") -> str:
    """The whole Markdown report of one run (``df`` with speedups added)."""
    env = meta.get("environment", {}) or {}
    ceil = meta.get("ceilings") or {}
    cpu = bool(meta.get("cpu_run"))
    title = f"# dsv41-triton benchmark — preset `{meta.get('preset', '?')}`"
    if meta.get("quick"):
        title += " (quick)"
    out = [title, ""]
    if cpu:
        out += ["> **CPU run.** No GPU was found: the kernels ran in Triton's CPU interpreter and "
                "the references in PyTorch on the CPU, at tiny shapes. **The timings are CPU wall "
                "clock and mean nothing about kernel speed**; this run checks that every backend "
                "computes the right numbers and that the harness works.", ""]
    counts = df["status"].value_counts().to_dict()
    bad = df[df["status"].isin(["FAIL", "error"])]
    out += ["## Summary", "",
            f"- device: **{env.get('device', '?')}**; command: `{meta.get('command', '')}`",
            f"- {df['case_id'].nunique()} cases, {df['backend'].nunique()} backends, {len(df)} "
            "rows (one per case and backend that implements its family): "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
            ]
    bases = meta.get("baselines") or {}
    named = {f: b for f, b in bases.items() if b}
    if named:
        if len(set(named.values())) == 1:
            which = f"`{next(iter(named.values()))}` in every family"
        else:
            which = ", ".join(f"{f} → `{b}`" for f, b in named.items())
        out.append(f"- speedups are relative to {which} (baseline time / backend time; > 1 = "
                   "faster than the baseline)")
    if len(bad):
        out += ["", f"**{len(bad)} failing rows** (wrong numbers or an exception):", "",
                md_table(["case", "backend", "status", "rel err", "note"],
                         [[r["case_id"], r["backend"], r["status"], fmt_err(r["out_rel_err"]),
                           str(r["note"] or "")[:200]] for _, r in bad.iterrows()])]
    else:
        out += ["- no backend failed a check"]
    out += ["", "## What next", ""]
    out += [f"- {line}" for line in next_steps(cpu, len(bad) > 0, meta.get("results_csv"),
                                                 meta.get("reports_dir"))]
    gone = unavailable_summary(df)
    if gone:
        out += ["", "## Not available on this machine", "",
                f"{sum(n for *_, n in gone)} rows could not run; one line per backend and "
                "reason:", ""]
        out += [f"- `{b}`: {md_escape(why)} ({', '.join(fams)}: {n} rows)"
                for b, why, fams, n in gone]
    measured = _isnum(ceil.get("copy_gbps")) and _isnum(ceil.get("matmul_tflops"))
    if ceil and measured:
        out += ["", "## Ceilings", "",
                md_table(["what", "value", "how"], [
                    ["copy bandwidth", f"{fmt_sig(ceil.get('copy_gbps', math.nan))} GB/s",
                     f"{ceil.get('copy_bytes', 0) >> 20} MiB device copy, read + write"],
                    ["bf16 matmul", f"{fmt_sig(ceil.get('matmul_tflops', math.nan))} TFLOP/s",
                     f"torch.mm {ceil.get('matmul_n', 0)}^3"],
                ], ["l", "r", "l"]),
                "", f"source: {ceil.get('source', '?')}" + (" — **CPU numbers, not meaningful**"
                                                            if cpu else "")]
    elif ceil:
        out += ["", "## Ceilings", "",
                f"Ceilings {ceil.get('source', 'not measured')}. The `% roof` columns stay "
                "empty; a GPU run measures them."]
    out += ["", "## How to read this", ""]
    if cpu:
        out.append("- time: wall clock of a couple of calls on the CPU (not meaningful).")
    else:
        out.append("- time: median of the warm repetitions (CUDA events), L2 flushed before each "
                   "(256 MiB zeroed); decode steps of <= "
                   f"{meta.get('graph_max_tokens', 128)} tokens are replayed from a CUDA graph "
                   "(`timing` column says which).")
    out += [
        "- attention FLOPs = 4·H·keys·512 per query token (QKᵀ and PV; K = V). Decode bytes = "
        "unique records read × record bytes + q + out + lse; prefill bytes = unique workspace "
        "rows + q + out + indices; ops bytes = records/rows read + written and the indices.",
        "- `% roof`: the larger of GB/s ÷ copy ceiling and TFLOP/s ÷ matmul ceiling (bytes "
        f"count each unique byte once, so it cannot pass {ROOF_CAP:g}% unless the ceiling was "
        f"measured low; such a row shows {ROOF_CAP:g} and its note says so).",
        f"- attention is checked against the float64 PyTorch oracle (`attention.ref`): pass = "
        f"relative Frobenius error of `out` <= {OUT_REL_TOL:g} and max |lse error| <= "
        f"{LSE_ABS_TOL:g} (SPEC §7). Ops are checked against their exact references: pass = "
        "bit-equal (NVFP4 inserts may round exact ties either way). The `torch` attention "
        "backend is the oracle rounded to bf16: its error is the bf16 rounding floor (~2e-3).",
        "- fused cases: the MXFP8 output is dequantized and compared with the float64 oracle "
        "(RoPE, attention, inverse RoPE all in float64) before quantization; MXFP8 alone costs "
        "~3e-2, so pass = error <= (the oracle's own MXFP8 error) + 1e-2 and lse as above. The "
        "note gives both and the share of UE8M0 scale bytes that differ from the quantized oracle.",
    ]
    mrt = meta.get("max_ref_tokens")
    if mrt:
        out.append(f"- to stay fast, the reference of a case with more than {mrt} query tokens is "
                   f"computed on {mrt} evenly spaced tokens only (`ref_tokens` column in the CSV).")
    skipped = meta.get("max_work") or {}
    for b, lim in skipped.items():
        out.append(f"- `{b}` is skipped on cases above {lim:,} tokens·keys·heads (too slow).")
    for fam in FAMILIES:
        if (df["family"] == fam).any():
            out += ["", f"## {FAMILY_TITLES.get(fam, fam)}", "",
                    family_tables(df, fam, bases.get(fam))]
    if plots or plot_note:
        out += ["", "## Plots", ""]
        out += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
        if plot_note:
            out.append(plot_note)
    if env:
        out += ["", "## Machine and software", "",
                md_table(["", ""], [[k, v] for k, v in env.items()])]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------
def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt

        return plt
    except Exception:
        return None


def make_plots(df: pd.DataFrame, outdir, meta: Dict[str, object]) -> Tuple[List[str], str]:
    """Write the PNGs; returns (paths, note). Without matplotlib: ([], why)."""
    plt = _plt()
    if plt is None:
        return [], ("_Plots skipped: matplotlib cannot be imported "
                    "(`pip install matplotlib`)._")
    outdir = Path(outdir)
    cpu = " (CPU: not meaningful)" if meta.get("cpu_run") else ""
    paths: List[str] = []
    timed = df[df["status"].isin(TIMED) & df["time_us"].notna()]
    # one colour per backend across every panel
    color = {b: f"C{i}" for i, b in enumerate(dict.fromkeys(df["backend"]))}
    for fam in ATTENTION_FAMILIES:
        g = timed[timed["family"] == fam]
        if g.empty:
            continue
        keycols = ["heads", "layer", "keys", "records"] + (
            ["layout"] if fam.endswith("_fused") and "layout" in g.columns else [])
        # dropna=False: a key column can be empty for a family (e.g. after a CSV round trip)
        groups = list(g.groupby(keycols, sort=False, dropna=False))[:12]
        n = len(groups)
        if n == 0:
            continue
        cols = min(3, n)
        rows = math.ceil(n / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
        for ax, (key, sg) in zip(axes.flat, groups):
            for b, bg in sg.groupby("backend", sort=False):
                bg = bg.sort_values("tokens")
                ax.plot(bg["tokens"], bg["time_us"], marker="o", label=b, color=color[b])
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            rec = key[3] if pd.notna(key[3]) else "bf16 workspace"  # prefill reads no records
            ax.set_title(f"H{key[0]} {key[1]} keys {key[2]} rec {rec} "
                         + " ".join(str(k) for k in key[4:]), fontsize=9)
            ax.set_xlabel("query tokens")
            ax.set_ylabel("time (us)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.suptitle(f"{fam}: time vs tokens{cpu}")
        fig.tight_layout()
        p = outdir / f"time_vs_tokens_{fam}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(str(p))
    ceil = meta.get("ceilings") or {}
    att = timed[(timed["flops"] > 0) & timed["bytes"].notna()]
    if not att.empty and _isnum(ceil.get("copy_gbps")) and _isnum(ceil.get("matmul_tflops")):
        bw, mm = ceil["copy_gbps"], ceil["matmul_tflops"]
        ai = att["flops"] / att["bytes"]
        fig, ax = plt.subplots(figsize=(7, 5))
        lo, hi = max(ai.min() / 4, 1e-2), ai.max() * 4
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(mm, bw * x / 1e3) for x in xs], "k-", lw=1.5, label="measured roof")
        markers = {"decode": "o", "prefill": "s", "decode_fused": "D", "prefill_fused": "P"}
        for (fam, b), g in att.groupby(["family", "backend"], sort=False):
            ax.scatter(g["flops"] / g["bytes"], g["tflops"], marker=markers.get(fam, "^"),
                       label=f"{fam} / {b}", alpha=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"roofline: copy {fmt_sig(bw)} GB/s, bf16 mm {fmt_sig(mm)} TFLOP/s{cpu}",
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = outdir / "roofline.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(str(p))
    ops = timed[timed["family"].isin(["insert", "gather", "combine_indices", "global_topk"])]
    if not ops.empty and ops["pct_bw"].notna().any():
        labels = list(dict.fromkeys(ops["case_id"]))
        backends = list(dict.fromkeys(ops["backend"]))
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels) * len(backends)), 4.5))
        w = 0.8 / len(backends)
        for j, b in enumerate(backends):
            bg = ops[ops["backend"] == b].set_index("case_id")["pct_bw"]
            ax.bar([i + j * w for i in range(len(labels))], [bg.get(c, 0) for c in labels],
                   width=w, label=b, color=color[b])
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("% of copy ceiling")
        ax.set_title(f"ops: bandwidth vs the copy ceiling{cpu}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = outdir / "ops_bandwidth.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(str(p))
    return paths, ""


def write_report(df: pd.DataFrame, outdir, meta: Dict[str, object], *,
                 baseline: str = "auto", plots: bool = True) -> Dict[str, Path]:
    """Write ``results.csv``, ``meta.json``, ``report.md`` and the PNGs into ``outdir``."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    df = add_speedups(df, baseline)
    meta = dict(meta)
    meta["baselines"] = choose_baselines(df, baseline)
    paths = {"csv": write_csv(df, outdir / "results.csv")}
    pngs, note = make_plots(df, outdir, meta) if plots else ([], "_Plots disabled (--no-plots)._")
    md = markdown_report(df, meta, pngs, note)
    (outdir / "report.md").write_text(md)
    (outdir / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    paths.update(md=outdir / "report.md", meta=outdir / "meta.json")
    for p in pngs:
        paths[Path(p).stem] = Path(p)
    return paths


# ---------------------------------------------------------------------------------------------
# comparing two runs
# ---------------------------------------------------------------------------------------------
def _run_label(csv_path: Path, df: pd.DataFrame) -> str:
    meta_p = csv_path.parent / "meta.json"
    bits = []
    try:
        env = json.loads(meta_p.read_text()).get("environment", {})
        bits = [env.get("device", ""), env.get("git_commit", "")]
    except (OSError, ValueError, AttributeError):
        if "device" in df.columns and df["device"].notna().any():
            bits = [str(df["device"].dropna().iloc[0])]
    label = " ".join(b for b in bits if b)
    return f"{csv_path} ({label})" if label else str(csv_path)


def compare_runs(csv_a, csv_b, labels: Optional[Sequence[str]] = None
                 ) -> Tuple[pd.DataFrame, str]:
    """Join two ``results.csv`` on (case, backend). Returns the joined table and Markdown
    (``B vs A`` = A time / B time: > 1 means run B is faster)."""
    pa, pb = Path(csv_a), Path(csv_b)
    a, b = read_csv(pa), read_csv(pb)
    la, lb = (labels or ("A", "B"))[:2]
    key = ["case_id", "backend"]
    keep = ["family", "status", "time_us", "out_rel_err", "tflops", "gbps", "pct_roof"]
    m = pd.merge(a[key + keep], b[key + keep], on=key, how="outer", suffixes=("_a", "_b"),
                 sort=False)
    m["family"] = m["family_a"].where(m["family_a"].notna(), m["family_b"])
    m = m.drop(columns=["family_a", "family_b"])
    m["b_vs_a"] = [ta / tb if _isnum(ta) and _isnum(tb) and tb > 0 else math.nan
                   for ta, tb in zip(m["time_us_a"], m["time_us_b"])]
    order = {f: i for i, f in enumerate(FAMILIES)}
    m["_o"] = m["family"].map(lambda f: order.get(f, 99))
    m = m.sort_values(["_o"], kind="stable").drop(columns="_o").reset_index(drop=True)
    out = ["# dsv41-triton: two runs compared", "",
           f"- **{la}**: {_run_label(pa, a)}", f"- **{lb}**: {_run_label(pb, b)}",
           f"- `{lb} vs {la}` = {la} time / {lb} time (> 1: {lb} is faster)", ""]
    sp = m["b_vs_a"].dropna()
    if len(sp):
        geo = math.exp(sum(math.log(v) for v in sp) / len(sp))
        out.append(f"- {len(sp)} rows timed in both; geometric mean `{lb} vs {la}` = {geo:.2f}x")
    only_a = int((m["status_b"].isna()).sum())
    only_b = int((m["status_a"].isna()).sum())
    if only_a or only_b:
        out.append(f"- rows only in {la}: {only_a}; only in {lb}: {only_b}")
    for fam in list(dict.fromkeys(m["family"])):
        g = m[m["family"] == fam]
        out += ["", f"## {FAMILY_TITLES.get(fam, fam)}", "",
                md_table(["case", "backend", f"{la} (us)", f"{lb} (us)", f"{lb} vs {la}",
                          f"{la} status", f"{lb} status", f"{la} err", f"{lb} err"],
                         [[r["case_id"], r["backend"], fmt_time(r["time_us_a"]),
                           fmt_time(r["time_us_b"]),
                           f"{r['b_vs_a']:.2f}x" if _isnum(r["b_vs_a"]) else "-",
                           r["status_a"] if isinstance(r["status_a"], str) else "(absent)",
                           r["status_b"] if isinstance(r["status_b"], str) else "(absent)",
                           fmt_err(r["out_rel_err_a"]), fmt_err(r["out_rel_err_b"])]
                          for _, r in g.iterrows()],
                         ["l", "l", "r", "r", "r", "l", "l", "r", "r"])]
    return m, "\n".join(out) + "\n"
