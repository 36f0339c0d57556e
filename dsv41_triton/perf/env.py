"""What ran the benchmark: device and software versions, for the report header."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import torch

from .ceilings import device_key


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> Optional[str]:
    """The checkout's commit (``+dirty`` with local changes), when run from a git tree."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) or None


def environment(device) -> Dict[str, str]:
    """A flat ``{name: value}`` description of the machine and the software."""
    from .. import __version__

    dev = torch.device(device)
    info: Dict[str, str] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device_key(dev),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "dsv41_triton": __version__,
    }
    commit = git_commit()
    if commit:
        info["git_commit"] = commit
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "not installed"
    for dist in ("numpy", "pandas", "matplotlib", "flash_mla", "flash-mla", "vllm", "deep_gemm"):
        v = _version(dist)
        if v:
            info[dist.replace("-", "_")] = v
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        info["cuda"] = str(torch.version.cuda or torch.version.hip)
        info["sm_count"] = str(p.multi_processor_count)
        info["gpu_memory_gib"] = f"{p.total_memory / 2**30:.0f}"
        clock = getattr(p, "clock_rate", None)
        if clock:
            info["sm_clock_mhz"] = str(int(clock) // 1000)
    else:
        info["cpu_cores"] = str(os.cpu_count())
        info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0")
    return info
