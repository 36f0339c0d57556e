"""The device's measured ceilings: copy bandwidth and bf16 matmul rate.

Measured once per device and cached as JSON (``<outdir>/ceilings.json``, and
``~/.cache/dsv41_triton/ceilings.json`` when writable), keyed by device name. Each result row's
``pct_bw`` / ``pct_mm`` is its GB/s / TFLOP/s as a fraction of these.

* copy: a 1 GiB device-to-device ``copy_``; bytes = read + write.
* matmul: ``8192 x 8192 x 8192`` bf16 ``torch.mm``; FLOPs = ``2 * M * N * K``.

On a CPU both are measured tiny (64 MiB, 512^3) and labelled: they only keep the columns
filled and mean nothing.
"""
from __future__ import annotations

import json
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
    source: str  # "measured" | "cached (<path>)" | "cpu (not meaningful)"
    measured_at: str = ""
    copy_bytes: int = 0
    matmul_n: int = 0

    def to_dict(self):
        return asdict(self)


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


def measure_ceilings(device) -> Ceilings:
    """Measure copy GB/s and bf16 matmul TFLOP/s on ``device`` now."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    nbytes = (1 << 30) if gpu else (64 << 20)
    n = 8192 if gpu else 512
    med = _cuda_median_ms if gpu else _cpu_median_ms
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    t_copy = med(lambda: dst.copy_(src), 20 if gpu else 3)
    del src, dst
    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev).to(torch.bfloat16)
    t_mm = med(lambda: torch.mm(a, b), 20 if gpu else 3)
    del a, b
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
    and store them in both. CPU ceilings are always re-measured (they take a moment)."""
    key = device_key(device)
    gpu = torch.device(device).type == "cuda"
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
    for p in paths if gpu else paths[:1]:
        _write(p, c)
    return c
