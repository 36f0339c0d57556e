"""Gluon (``triton.experimental.gluon``) kernels for Hopper (sm_90).

Gluon's API changes with every Triton release, so everything here is behind two gates, checked
at import, never raising. ``COMPILABLE``: the installed Triton offers every Gluon name the
kernels use (``_api`` bridges the names releases spell differently), so they compile.
``AVAILABLE``: also, the kernels have run on a GPU under this Triton release
(``GPU_CHECKED_RELEASES``), or ``DSV41_GLUON=1`` asks for them anyway; only then do the
launchers pick them. Otherwise ``REASON`` says why and callers keep the portable ``tl`` kernels. Gluon does not run in the CPU interpreter. Kernels: ``decode*.py`` (sparse MLA decode over the
paged caches), ``prefill.py`` / ``prefill_ws.py`` / ``prefill_wsp.py`` (sparse MLA prefill over
the bf16 workspace, many heads), ``prefill_few.py`` (at most 8 heads; ``prefill_few_movm.py`` an
unpicked form of it) and ``prefill_window.py`` (the shared-window entry's window partial).
"""
from __future__ import annotations

AVAILABLE = False
COMPILABLE = False
REASON = ""

#: Triton releases (major.minor) under which the kernels' GPU tests have passed
GPU_CHECKED_RELEASES = ("3.6",)

#: names the kernels use, per module (checked by attribute, so a rename fails the gate)
_NEEDED = {
    "triton.experimental.gluon": ("jit",),
    "triton.experimental.gluon.language": (
        "BlockedLayout", "SliceLayout", "NVMMADistributedLayout", "NVMMASharedLayout",
        "SwizzledSharedLayout", "allocate_shared_memory", "inline_asm_elementwise",
        "static_range", "convert_layout", "join", "reshape", "permute",
        "arange", "full", "load", "store", "where", "maximum", "max", "sum", "exp2", "log2",
        "multiple_of", "cdiv", "minimum", "program_id", "NVMMADistributedLayout"),
    "triton.experimental.gluon.language.nvidia.hopper": (
        "warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared"),
    "triton.experimental.gluon.language.nvidia.ampere.async_copy": (
        "commit_group", "wait_group"),
    # the names Triton releases spell differently (thread_barrier / barrier, ...)
    "dsv41_triton.attention.gluon._api": ("barrier", "async_load", "reinterpret"),
}


def _check() -> str:
    import importlib
    for mod, names in _NEEDED.items():
        try:
            m = importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - any import failure closes the gate
            return f"cannot import {mod}: {type(e).__name__}: {e}"
        missing = [n for n in names if not hasattr(m, n)]
        if missing:
            return f"{mod} lacks {', '.join(missing)}"
    return ""


def _release_reason() -> str:
    import os

    import triton
    release = ".".join(triton.__version__.split(".")[:2])
    if release in GPU_CHECKED_RELEASES or os.environ.get("DSV41_GLUON", "") == "1":
        return ""
    return (f"the Gluon kernels compile under Triton {triton.__version__} but have run on a GPU "
            f"only under Triton {', '.join(GPU_CHECKED_RELEASES)}; DSV41_GLUON=1 uses them")


try:
    REASON = _check()
    if not REASON:
        from . import decode as _decode  # noqa: F401  (defines the kernels)
        from . import prefill as _prefill  # noqa: F401
        from . import decode_heads as _decode_heads  # noqa: F401
        COMPILABLE = True
        REASON = _release_reason()
        AVAILABLE = not REASON
except Exception as e:  # noqa: BLE001 - a kernel that fails to define closes the gate
    REASON = f"gluon kernels failed to load: {type(e).__name__}: {e}"
    AVAILABLE = COMPILABLE = False

__all__ = ["AVAILABLE", "COMPILABLE", "REASON", "GPU_CHECKED_RELEASES"]
