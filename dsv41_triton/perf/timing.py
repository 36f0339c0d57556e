"""Timing one call.

GPU: CUDA events around each call, the median of the warm repetitions. Before every
repetition the L2 cache is flushed (a 256 MiB buffer is zeroed: the H200's L2 is 50 MB) and
the GPU is kept busy for a moment (``torch.cuda._sleep``) so the event brackets the kernels and
not the Python launch cost. Small decode steps are captured in a CUDA graph and replayed (as a
serving engine does), since an eager call costs tens of microseconds of launch overhead.
The number of repetitions fills a time budget (clamped to ``[min_reps, max_reps]``).

CPU: wall clock of a couple of calls. These numbers time PyTorch on the CPU and Triton's
interpreter: they are NOT meaningful as kernel performance, and the report says so.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

FLUSH_BYTES = 256 << 20
#: spin cycles queued before each timed repetition (about 100 us / 20 us at ~2 GHz)
SLEEP_CYCLES_EAGER = 200_000
SLEEP_CYCLES_GRAPH = 40_000

_flush_buffers: Dict[str, torch.Tensor] = {}


@dataclass
class Timing:
    median_us: float
    min_us: float
    reps: int
    method: str  # "cuda-graph" | "cuda-events" | "cpu-wall"
    note: str = ""


def _flush_buffer(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _flush_buffers:
        _flush_buffers[key] = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    return _flush_buffers[key]


def _sleep(cycles: int) -> None:
    try:
        torch.cuda._sleep(cycles)
    except Exception:  # pragma: no cover - private API missing: timing just includes launch
        pass


def capture_graph(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """Capture ``fn`` (already warm) in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _host_sync_in(fn: Callable[[], object]) -> Optional[str]:
    """Run ``fn`` once with PyTorch's sync debug mode set to "error"; return why it synchronized
    with the host (None if it did not). A call that syncs cannot be captured in a CUDA graph,
    and a capture that fails half-way can leave the CUDA RNG thinking it is still capturing
    (later ``normal_()`` calls then raise), so such calls are never captured."""
    prev = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        fn()
        return None
    except RuntimeError as e:
        return (str(e).splitlines() or [type(e).__name__])[0][:80]
    finally:
        torch.cuda.set_sync_debug_mode(prev)
        torch.cuda.synchronize()


def time_cuda(
    fn: Callable[[], object],
    *,
    use_graph: bool = False,
    flush_l2: bool = True,
    budget_ms: float = 150.0,
    min_reps: int = 5,
    max_reps: int = 200,
) -> Timing:
    """Median CUDA-event time of ``fn`` (warm), L2 flushed before each repetition."""
    device = torch.device("cuda", torch.cuda.current_device())
    fn()
    torch.cuda.synchronize()
    run, method, note = fn, "cuda-events", ""
    graph = None
    sync = _host_sync_in(fn) if use_graph else None
    if sync is not None:
        note = f"host sync in the call ({sync}): not captured, timed eagerly"
    elif use_graph:
        try:
            graph = capture_graph(fn)
            run, method = graph.replay, "cuda-graph"
        except Exception as e:  # allocations or other work that cannot be captured
            torch.cuda.synchronize()
            note = f"graph capture failed ({type(e).__name__}), timed eagerly"
    buf = _flush_buffer(device) if flush_l2 else None
    # estimate
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(3):
        run()
    e.record()
    torch.cuda.synchronize()
    est_ms = max(s.elapsed_time(e) / 3, 1e-3)
    reps = int(min(max(budget_ms / est_ms, min_reps), max_reps))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    cycles = SLEEP_CYCLES_GRAPH if graph is not None else SLEEP_CYCLES_EAGER
    for i in range(reps):
        if buf is not None:
            buf.zero_()
        _sleep(cycles)
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) * 1e3 for a, b in zip(starts, ends)]
    del graph
    return Timing(statistics.median(times), min(times), reps, method, note)


def time_cpu(fn: Callable[[], object], *, reps: int = 2) -> Timing:
    """Wall-clock median of ``reps`` calls (after the check call that warmed it up)."""
    times: List[float] = []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return Timing(statistics.median(times), min(times), len(times), "cpu-wall",
                  "CPU wall clock: not meaningful")


def time_call(fn: Callable[[], object], device, *, use_graph: bool = False,
              budget_ms: float = 150.0, max_reps: int = 200, cpu_reps: int = 2) -> Timing:
    if torch.device(device).type == "cuda":
        return time_cuda(fn, use_graph=use_graph, budget_ms=budget_ms, max_reps=max_reps)
    return time_cpu(fn, reps=cpu_reps)
