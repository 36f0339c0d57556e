"""The comparison loop: every case on every implementation, one result row each.

A failing implementation (wrong numbers, an exception, a missing module) is recorded in its
row — ``status`` and ``note`` — and the run goes on.

Row ``status``:

=============  ===================================================================
``ok``         checked against the reference and within SPEC §7 tolerances
``FAIL``       checked and wrong (see the error columns and ``note``)
``error``      raised an exception (``note`` has it); no timing
``unchecked``  ran, but no reference was available to check it
``unavailable`` its probe said it cannot serve this case (``note`` says why)
``skipped``    deliberately not run (e.g. the slow reference on a huge case)
=============  ===================================================================
"""
from __future__ import annotations

import gc
import math
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import pandas as pd
import torch

from .cases import ATTENTION_FAMILIES, Case
from .ceilings import Ceilings
from .families import Check, get_family
from .impls import Impl
from .timing import time_call

#: column order of the results table
COLUMNS = [
    "case_id", "family", "preset", "heads", "tokens", "requests", "layer", "ratio", "window",
    "topk", "keys", "page", "records", "swa_record", "extra_record", "layout", "q_norm",
    "backend", "status",
    "passed", "out_rel_err", "lse_max_err", "bit_exact", "ref_tokens", "time_us", "time_min_us",
    "reps", "timing", "flops", "bytes", "tflops", "gbps", "pct_bw", "pct_mm", "pct_roof",
    "note", "device",
]


@dataclass
class RunConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: the reference is computed on at most this many tokens of a case (None = all)
    max_ref_tokens: Optional[int] = None
    #: capture decode cases with at most this many tokens in a CUDA graph (0 = never)
    graph_max_tokens: int = 128
    budget_ms: float = 150.0
    max_reps: int = 200
    cpu_reps: int = 2
    seed: int = 0
    #: per backend name: skip attention cases with more than this many ``tokens * keys * heads``
    max_work: Dict[str, int] = field(default_factory=dict)
    #: called with one line per event (None = quiet)
    progress: Optional[Callable[[str], None]] = None
    #: stop starting new cases after this many seconds; the rest get ``skipped`` rows
    time_limit_s: Optional[float] = None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def case_seed(case: Case, seed: int) -> int:
    return (zlib.crc32(case.case_id.encode()) + 7919 * seed) % (2**31)


def _err_text(e: BaseException, limit: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ").strip()
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _work_of(case: Case) -> int:
    """Size measure for ``RunConfig.max_work``: ``tokens * keys * heads`` of attention cases
    (0 for the ops, which are never skipped)."""
    if case.family not in ATTENTION_FAMILIES:
        return 0
    return case.tokens * case.keys * case.heads


def run_benchmark(
    cases: Sequence[Case],
    impls: Sequence[Impl],
    config: Optional[RunConfig] = None,
    ceilings: Optional[Ceilings] = None,
) -> pd.DataFrame:
    """Run every case on every implementation that has its family; one row per pair."""
    cfg = config or RunConfig()
    dev = torch.device(cfg.device)
    say = cfg.progress or (lambda s: None)
    pairs = [(c, i) for c in cases for i in impls if i.supports(c.family)]
    total, done = len(pairs), 0
    rows: List[Dict[str, object]] = []
    t_start = time.perf_counter()
    dev_name = ceilings.device if ceilings is not None else str(dev)
    said_unavailable: set = set()
    hidden_unavailable = 0
    for case in cases:
        fam = get_family(case.family)
        its = [i for i in impls if i.supports(case.family)]
        if not its:
            continue
        base = {k: v for k, v in case.params().items() if k in COLUMNS}
        if cfg.time_limit_s is not None and time.perf_counter() - t_start > cfg.time_limit_s:
            for impl in its:
                done += 1
                rows.append(dict(base, backend=impl.name, device=dev_name, status="skipped",
                                 note=f"not run: the run's time limit ({cfg.time_limit_s:g} s) "
                                      f"was reached"))
            continue
        state, ref, ref_note, flops, nbytes = None, None, "", math.nan, math.nan
        try:
            state = fam.build(case, dev, case_seed(case, cfg.seed))
            flops, nbytes = fam.work(case, state)
        except Exception as e:
            build_err = _err_text(e)
        else:
            build_err = ""
            try:
                ref = fam.reference(state, cfg.max_ref_tokens)
                if ref is None:
                    ref_note = "no reference available"
            except Exception as e:
                ref_note = "reference failed: " + _err_text(e)
                ref = None
        for impl in its:
            done += 1
            row = dict(base, backend=impl.name, device=dev_name, flops=flops, bytes=nbytes)
            if build_err:
                row.update(status="error", note="building inputs failed: " + build_err)
            else:
                row.update(_run_one(case, fam, impl, state, ref, ref_note, cfg, dev))
            _derive(row, ceilings)
            rows.append(row)
            if row.get("status") == "unavailable":
                key = (impl.name, unavailable_reason(impl.name, row.get("note")))
                if key in said_unavailable:
                    hidden_unavailable += 1
                    continue
                said_unavailable.add(key)
            say(_progress_line(done, total, case, row))
        del state, ref
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    df = pd.DataFrame(rows, columns=COLUMNS)
    if hidden_unavailable:
        say(f"({hidden_unavailable} more unavailable rows, each for a reason printed above)")
    say(f"done: {len(df)} rows in {time.perf_counter() - t_start:.1f} s")
    return df


def _run_one(case, fam, impl: Impl, state, ref, ref_note, cfg: RunConfig, dev) -> Dict:
    ok, reason = impl.availability(case, dev)
    if not ok:
        return dict(status="unavailable", note=reason)
    limit = cfg.max_work.get(impl.name)
    if limit is not None and _work_of(case) > limit:
        return dict(status="skipped", note=f"{impl.name} skipped: case larger than its limit "
                                           f"({_work_of(case)} > {limit} tokens*keys*heads)")
    fn = impl.fns[case.family]
    out: Dict[str, object] = {}
    try:
        call = fam.fresh(state)
        outputs = fam.invoke(fn, call)
        _sync(dev)
    except Exception as e:
        _sync_quiet(dev)
        return dict(status="error", note=_err_text(e))
    try:
        chk: Check = fam.check(state, call, outputs, ref)
    except Exception as e:
        chk = Check(False, note="check raised " + _err_text(e))
    out.update(passed=chk.passed, out_rel_err=chk.out_rel_err, lse_max_err=chk.lse_max_err,
               bit_exact=chk.bit_exact, ref_tokens=chk.ref_tokens)
    notes = [n for n in (chk.note if chk.passed is not None else (ref_note or chk.note),) if n]
    out["status"] = {True: "ok", False: "FAIL", None: "unchecked"}[chk.passed]
    del outputs
    use_graph = (case.family in ("decode", "decode_fused") and case.tokens <= cfg.graph_max_tokens
                 and impl.graph_safe)
    try:
        t = time_call(lambda: fam.invoke(fn, call), dev, use_graph=use_graph,
                      budget_ms=cfg.budget_ms, max_reps=cfg.max_reps, cpu_reps=cfg.cpu_reps)
        out.update(time_us=t.median_us, time_min_us=t.min_us, reps=t.reps, timing=t.method)
        if t.note and t.method != "cpu-wall":
            notes.append(t.note)
    except Exception as e:
        _sync_quiet(dev)
        out["status"] = "error"
        notes.append("timing failed: " + _err_text(e))
    out["note"] = "; ".join(notes)
    return out


def _sync_quiet(dev) -> None:
    try:
        _sync(dev)
    except Exception:
        pass


#: ``pct_roof`` is capped here; see :func:`_derive`
ROOF_CAP = 100.0
ROOF_CAP_NOTE = ("above the measured ceiling, shown as 100%: the ceiling measurement is below "
                 "what the device sustains (re-measure: --remeasure-ceilings)")


def _derive(row: Dict[str, object], c: Optional[Ceilings]) -> None:
    """GB/s, TFLOP/s and the fractions of the ceilings. ``bytes`` counts each unique byte a
    call must move once and timings flush L2 first, so a fraction above 100% can only come
    from a ceiling measured low: ``pct_roof`` is then capped at 100 and the note says so
    (``pct_bw`` / ``pct_mm`` keep the raw fractions)."""
    t = row.get("time_us")
    if t is None or not isinstance(t, (int, float)) or not t > 0:
        return
    flops, nbytes = row.get("flops") or 0.0, row.get("bytes") or 0.0
    row["tflops"] = flops / (t * 1e-6) / 1e12 if flops else math.nan
    row["gbps"] = nbytes / (t * 1e-6) / 1e9 if nbytes else math.nan
    if c is not None:
        pb = row["gbps"] / c.copy_gbps if c.copy_gbps > 0 else math.nan
        pm = row["tflops"] / c.matmul_tflops if c.matmul_tflops > 0 else math.nan
        row["pct_bw"] = 100 * pb
        row["pct_mm"] = 100 * pm
        vals = [v for v in (pb, pm) if isinstance(v, float) and not math.isnan(v)]
        roof = 100 * max(vals) if vals else math.nan
        if roof > ROOF_CAP:
            roof = ROOF_CAP
            row["note"] = "; ".join(n for n in (row.get("note") or "", ROOF_CAP_NOTE) if n)
        row["pct_roof"] = roof


def unavailable_reason(backend: str, note: object) -> str:
    """``note`` of an ``unavailable`` row without the ``"<backend> (<family>): "`` prefix the
    probes put in front, so that one reason reads the same in every family."""
    text = str(note or "").strip()
    return re.sub(r"^" + re.escape(backend) + r" \([^)]*\):\s*", "", text) or "no reason given"


def _fmt_us(t) -> str:
    if t is None or (isinstance(t, float) and math.isnan(t)):
        return "-"
    return f"{t:,.1f} us" if t < 1e5 else f"{t / 1e3:,.1f} ms"


def _progress_line(done: int, total: int, case: Case, row: Dict[str, object]) -> str:
    w = len(str(total))
    st = row.get("status")
    extra = ""
    if st in ("ok", "FAIL", "unchecked"):
        e = row.get("out_rel_err")
        extra = f"  {_fmt_us(row.get('time_us'))}"
        if isinstance(e, float) and not math.isnan(e):
            extra += f"  err {e:.1e}"
    if row.get("note") and st != "ok":
        extra += f"  ({str(row['note'])[:120]})"
    return f"[{done:>{w}}/{total}] {case.case_id:<44} {row['backend']:<14} {st}{extra}"
