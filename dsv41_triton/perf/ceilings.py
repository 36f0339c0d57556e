"""The device's measured ceilings: copy bandwidth and bf16 matmul rate.

Measured once per device and cached as JSON (``<outdir>/ceilings.json``, and
``~/.cache/dsv41_triton/ceilings.json`` when writable), keyed by device name. Each result row's
``pct_bw`` / ``pct_mm`` is its GB/s / TFLOP/s as a fraction of these.

* copy: a 1 GiB device-to-device ``copy_``; bytes = read + write.
* matmul: ``8192 x 8192 x 8192`` bf16 ``torch.mm``; FLOPs = ``2 * M * N * K``.

The harness does not use ceilings on a CPU (:func:`get_ceilings` returns them as *not
measured*): a CPU's memcpy rate and bf16 ``torch.mm`` rate do not bound what the Triton
interpreter or the float64 references do (cache-resident tiny cases beat the DRAM copy, fp32 and
fp64 work beats an emulated bf16 matmul), so a "% of ceiling" there could read above 100% and
would mean nothing. :func:`measure_ceilings` still measures a CPU when called directly.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

CACHE_NAME = "ceilings.json"


@dataclass
class Ceilings:
    copy_gbps: float
    matmul_tflops: float
    device: str
    source: str  # "measured" | "cached (<path>)" | "cpu (not meaningful)" | "not measured (...)"
    measured_at: str = ""
    copy_bytes: int = 0
    matmul_n: int = 0

    def to_dict(self):
        return asdict(self)

    @property
    def measured(self) -> bool:
        """True when both rates are real measurements (finite and positive)."""
        return all(math.isfinite(v) and v > 0 for v in (self.copy_gbps, self.matmul_tflops))

    @classmethod
    def not_measured(cls, device: str, why: str) -> "Ceilings":
        """Placeholder with NaN rates: every ``pct_*`` column derived from it is NaN."""
        return cls(math.nan, math.nan, device, f"not measured ({why})")


#: ``Ceilings.source`` of a CPU run
CPU_NOT_MEASURED = "CPU run: a CPU's copy and matmul rates do not bound this work"


def device_key(device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(idx)
        return f"{torch.cuda.get_device_name(idx)} (sm_{cap[0]}{cap[1]})"
    import platform

    return f"cpu {platform.machine()} ({os.cpu_count()} cores)"


def _cuda_median_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def _cpu_median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _copy_fn(nbytes: int, dev: torch.device):
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _mm_fn(n: int, dev: torch.device):
    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev).to(torch.bfloat16)
    return lambda: torch.mm(a, b)


def measure_ceilings(device) -> Ceilings:
    """Measure copy GB/s and bf16 matmul TFLOP/s on ``device`` now."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    nbytes = (1 << 30) if gpu else (64 << 20)
    n = 8192 if gpu else 512
    med = _cuda_median_ms if gpu else _cpu_median_ms
    reps = 20 if gpu else 3
    t_copy = med(_copy_fn(nbytes, dev), reps)  # the buffers are freed when the call returns
    t_mm = med(_mm_fn(n, dev), reps)
    if gpu:
        torch.cuda.empty_cache()
    return Ceilings(
        copy_gbps=2 * nbytes / (t_copy * 1e-3) / 1e9,
        matmul_tflops=2 * n**3 / (t_mm * 1e-3) / 1e12,
        device=device_key(dev),
        source="measured" if gpu else "cpu (not meaningful)",
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
        copy_bytes=nbytes,
        matmul_n=n,
    )


def _user_cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv41_triton" / CACHE_NAME


def _read(path: Path, key: str) -> Optional[Ceilings]:
    try:
        d = json.loads(path.read_text())[key]
        c = Ceilings(**d)
        c.source = f"cached ({path})"
        return c
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: Path, c: Ceilings) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                data = {}
        except (OSError, ValueError):
            data = {}
        data[c.device] = c.to_dict()
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    except OSError:
        pass  # a read-only home directory is fine: the output dir keeps a copy


def get_ceilings(device, outdir=None, *, remeasure: bool = False,
                 use_user_cache: bool = True) -> Ceilings:
    """Cached ceilings for ``device`` (output dir first, then the user cache), else measure
    and store them in both. On a CPU: :meth:`Ceilings.not_measured` (see the module doc)."""
    key = device_key(device)
    gpu = torch.device(device).type == "cuda"
    if not gpu:
        return Ceilings.not_measured(key, CPU_NOT_MEASURED)
    paths = []
    if outdir is not None:
        paths.append(Path(outdir) / CACHE_NAME)
    if use_user_cache:
        paths.append(_user_cache_file())
    if gpu and not remeasure:
        for p in paths:
            c = _read(p, key)
            if c is not None:
                if outdir is not None and p != paths[0]:
                    _write(paths[0], c)
                return c
    c = measure_ceilings(device)
    for p in paths:
        _write(p, c)
    return c
