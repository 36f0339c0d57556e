"""``dsv41-bench`` / ``python -m dsv41_triton.perf``: which kernel is faster, and is it right?

Runs the case matrix of a preset on every available backend, checks every result against the
reference, times it, and writes ``results.csv``, ``report.md``, ``meta.json`` and PNG plots to
the output directory (default ``bench-out/``). Without a GPU it runs a tiny honest CPU run
(PyTorch references + Triton's interpreter) whose timings mean nothing but whose checks do.

Exit status: 0 when every checked row passed, 1 when any row is ``FAIL`` or ``error``
(``--no-fail``: 0 anyway), 2 on a usage error.

Examples::

    dsv41-bench                         # preset v41-flash, every family
    dsv41-bench --quick                 # a handful of cases (< 1 min on a GPU)
    dsv41-bench --preset tp8 --families decode,prefill --baseline flashmla
    dsv41-bench --compare runA/results.csv runB/results.csv --labels h200 b200
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Sequence

DEFAULT_OUT = "bench-out"
#: the torch reference backend is skipped above this many tokens*keys*heads on a GPU
GPU_TORCH_MAX_WORK = 1 << 28
GPU_MAX_REF_TOKENS = 128


def build_parser() -> argparse.ArgumentParser:
    from .cases import DEFAULT_PRESET, FAMILIES, PRESET_NAMES

    p = argparse.ArgumentParser(
        prog="dsv41-bench",
        description="Compare every dsv41_triton backend (and vLLM/FlashMLA when installed) on "
                    "the sparse MLA attention and cache/index ops: correctness vs the reference "
                    "and speed vs the device's measured ceilings.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets: " + ", ".join(PRESET_NAMES) + " (see --list for the cases)",
    )
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=PRESET_NAMES,
                   help=f"model numbers to run (default {DEFAULT_PRESET})")
    p.add_argument("--quick", action="store_true", help="a few representative cases only")
    p.add_argument("--families", default=None,
                   help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument("--backends", default=None,
                   help="comma-separated backend names to run (default: all that exist)")
    p.add_argument("--extra-backend", action="append", default=[], metavar="MODULE:ATTR",
                   help="add a backend: an AttentionBackend (instance/class) or a perf Impl")
    p.add_argument("--baseline", default="auto",
                   help="backend that speedups are relative to (default auto: flashmla, vllm, "
                        "torch, triton — the first present in each family)")
    p.add_argument("--out", "-o", default=DEFAULT_OUT, help=f"output dir (default {DEFAULT_OUT})")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-ms", type=float, default=None,
                   help="timed GPU milliseconds per row (default 150, quick 40)")
    p.add_argument("--max-reps", type=int, default=None, help="cap on timed repetitions")
    p.add_argument("--cpu-reps", type=int, default=2, help="timed calls per row on the CPU")
    p.add_argument("--max-ref-tokens", type=int, default=None,
                   help=f"check at most this many tokens per case (default {GPU_MAX_REF_TOKENS} "
                        "on a GPU, all on the CPU)")
    p.add_argument("--no-graphs", action="store_true", help="never use CUDA graphs")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="start no new case after S seconds (the rest are reported as skipped)")
    p.add_argument("--remeasure-ceilings", action="store_true",
                   help="measure copy/matmul ceilings even when cached")
    p.add_argument("--no-ceilings", action="store_true", help="do not measure ceilings")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--list", action="store_true", help="print the cases and backends, run nothing")
    p.add_argument("--no-fail", action="store_true",
                   help="exit with status 0 even when a row is FAIL or error (by default such "
                        "a row makes the exit status 1)")
    p.add_argument("--strict", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    p.add_argument("--compare", nargs=2, metavar=("A.csv", "B.csv"),
                   help="compare two saved results.csv side by side and exit")
    p.add_argument("--labels", nargs=2, metavar=("A", "B"), default=None,
                   help="names of the two runs in --compare (default A B)")
    return p


def _split(s: Optional[str]) -> Optional[List[str]]:
    if s is None:
        return None
    return [x.strip() for x in s.split(",") if x.strip()]


def _compare(args) -> int:
    from .report import compare_runs

    for f in args.compare:
        if not Path(f).is_file():
            print(f"dsv41-bench: --compare: no such file {f}", file=sys.stderr)
            return 2
    table, md = compare_runs(args.compare[0], args.compare[1], args.labels)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "compare.csv", index=False)
    (out / "compare.md").write_text(md)
    print(md)
    print(f"wrote {out / 'compare.md'} and {out / 'compare.csv'}", file=sys.stderr)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        return _compare(args)

    import torch

    if args.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("dsv41-bench: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
    gpu = device.type == "cuda"
    if not gpu:
        # Triton picks interpreter vs compiler when a kernel is defined: set it before any
        # kernel module is imported (they are imported lazily, from here on).
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from .cases import build_cases
    from .impls import default_impls, load_impl
    from .runner import RunConfig, _stderr, run_benchmark

    say = (lambda s: None) if args.quiet else _stderr
    try:
        cases = build_cases(args.preset, gpu=gpu, quick=args.quick, families=_split(args.families))
        extra = [load_impl(s) for s in args.extra_backend]
        impls = default_impls(extra)
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        print(f"dsv41-bench: {e}", file=sys.stderr)
        return 2
    wanted = _split(args.backends)
    if wanted is not None:
        unknown = sorted(set(wanted) - {i.name for i in impls})
        if unknown:
            print(f"dsv41-bench: --backends: unknown {unknown}; known: "
                  f"{[i.name for i in impls]}", file=sys.stderr)
            return 2
        impls = [i for i in impls if i.name in wanted]
    if args.list:
        print(f"{len(cases)} cases on {device} (preset {args.preset}"
              f"{', quick' if args.quick else ''}):")
        for c in cases:
            avail = []
            for i in impls:
                if i.supports(c.family):
                    ok, why = i.availability(c, device)
                    avail.append(i.name if ok else f"({i.name}: {why})")
            print(f"  {c.case_id:<46} " + ", ".join(avail))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not gpu:
        say("dsv41-bench: no GPU — tiny CPU run (PyTorch + Triton interpreter). Timings are CPU "
            "wall clock and NOT meaningful; the correctness checks are real.")
    ceilings = None
    if not args.no_ceilings:
        from .ceilings import get_ceilings

        if gpu:
            say("ceilings (copy, bf16 matmul)...")
        ceilings = get_ceilings(device, out, remeasure=args.remeasure_ceilings)
        if ceilings.measured:
            say(f"ceilings: copy {ceilings.copy_gbps:,.0f} GB/s, bf16 mm "
                f"{ceilings.matmul_tflops:,.1f} TFLOP/s ({ceilings.source})")
        else:
            say(f"ceilings: {ceilings.source}; the % roof columns stay empty")
    cfg = RunConfig(
        device=device,
        max_ref_tokens=args.max_ref_tokens if args.max_ref_tokens is not None
        else (GPU_MAX_REF_TOKENS if gpu else None),
        graph_max_tokens=0 if args.no_graphs else 128,
        budget_ms=args.budget_ms if args.budget_ms is not None else (40.0 if args.quick else 150.0),
        max_reps=args.max_reps if args.max_reps is not None else (50 if args.quick else 200),
        cpu_reps=args.cpu_reps,
        seed=args.seed,
        max_work=({"torch": GPU_TORCH_MAX_WORK >> (4 if args.quick else 0)} if gpu else {}),
        progress=say,
        time_limit_s=args.time_limit,
    )
    say(f"{len(cases)} cases x {len(impls)} backends ({', '.join(i.name for i in impls)}) "
        f"on {device}")
    df = run_benchmark(cases, impls, cfg, ceilings)

    from .env import environment
    from .report import FAILED, next_steps, write_report

    meta = dict(
        command="dsv41-bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                  else sys.argv[1:])),
        preset=args.preset, quick=args.quick, cpu_run=not gpu,
        environment=environment(device),
        ceilings=ceilings.to_dict() if ceilings is not None else None,
        max_ref_tokens=cfg.max_ref_tokens, graph_max_tokens=cfg.graph_max_tokens,
        max_work=cfg.max_work,
        backends={i.name: i.description for i in impls},
        results_csv=str(out / "results.csv"),
    )
    paths = write_report(df, out, meta, baseline=args.baseline, plots=not args.no_plots)
    bad = df[df["status"].isin(FAILED)]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(df["status"].value_counts().items()))
    print(f"dsv41-bench: {len(df)} rows ({counts}); report: {paths['md']}, data: {paths['csv']}")
    for line in next_steps(cpu_run=not gpu, failed=len(bad) > 0):
        print("dsv41-bench: next: " + line)
    if len(bad):
        print(f"dsv41-bench: {len(bad)} rows FAILED or raised"
              + (" (--no-fail: exit status 0 anyway):" if args.no_fail else ":"),
              file=sys.stderr)
        for _, r in bad.iterrows():
            print(f"  {r['case_id']} {r['backend']}: {r['status']} {r['note'] or ''}",
                  file=sys.stderr)
    return 1 if (len(bad) and not args.no_fail) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
