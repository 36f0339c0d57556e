"""The comparison harness: which kernel is faster, and is it right?

One command, ``dsv41-bench`` (or ``python -m dsv41_triton.perf``), runs a case matrix on every
available backend, checks each result against the reference, times it and writes a CSV, a
Markdown report and plots (see ``cli.py``). The pieces are public for scripts and forks:

* :func:`build_cases` / :class:`Case` / ``PRESETS`` — the case matrix;
* :func:`default_impls` / :class:`Impl` / :func:`load_impl` — what is compared;
* :func:`run_benchmark` / :class:`RunConfig` — the loop (one row per case and backend);
* :func:`get_ceilings` — measured copy GB/s and bf16 matmul TFLOP/s (cached);
* :func:`write_report` / :func:`compare_runs` — the outputs.

Importing this package imports no kernel: Triton modules load lazily, after the CLI has chosen
between the GPU and the CPU interpreter.
"""
from .cases import FAMILIES, PRESET_NAMES, Case, Preset, build_cases, get_preset, presets
from .ceilings import Ceilings, get_ceilings, measure_ceilings
from .impls import Impl, backend_impl, default_impls, load_impl
from .report import add_speedups, compare_runs, markdown_report, write_report
from .runner import COLUMNS, RunConfig, run_benchmark
from .timing import Timing, time_call


def __getattr__(name):  # ``PRESETS`` is built lazily (see ``cases.presets``)
    if name == "PRESETS":
        return presets()
    raise AttributeError(name)


def main(argv=None) -> int:
    """The ``dsv41-bench`` entry point (see ``dsv41_triton.perf.cli``)."""
    from .cli import main as _main

    return _main(argv)


__all__ = [
    "FAMILIES", "PRESET_NAMES", "presets", "Case", "Preset", "build_cases", "get_preset", "Ceilings",
    "get_ceilings", "measure_ceilings", "Impl", "backend_impl", "default_impls", "load_impl",
    "add_speedups", "compare_runs", "markdown_report", "write_report", "COLUMNS", "RunConfig",
    "run_benchmark", "Timing", "time_call", "main",
]
