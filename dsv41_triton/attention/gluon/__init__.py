"""Gluon (``triton.experimental.gluon``) kernels for Hopper (sm_90).

Gluon's API changes with every Triton release, so everything here is behind a feature gate:
``AVAILABLE`` is True only when the installed Triton offers every Gluon name the kernels use
(checked at import, never raising); otherwise ``REASON`` says what is missing and callers keep
the portable ``tl`` kernels. Gluon does not run in the CPU interpreter. Kernels: ``decode*.py`` (sparse MLA decode over the
paged caches), ``prefill.py`` / ``prefill_ws.py`` / ``prefill_wsp.py`` (sparse MLA prefill over
the bf16 workspace, many heads), ``prefill_few.py`` (at most 8 heads) and ``prefill_window.py``
(the shared-window entry's window partial).
"""
from __future__ import annotations

AVAILABLE = False
REASON = ""

#: names the kernels use, per module (checked by attribute, so a rename fails the gate)
_NEEDED = {
    "triton.experimental.gluon": ("jit",),
    "triton.experimental.gluon.language": (
        "BlockedLayout", "SliceLayout", "NVMMADistributedLayout", "NVMMASharedLayout",
        "SwizzledSharedLayout", "allocate_shared_memory", "inline_asm_elementwise",
        "thread_barrier", "static_range", "convert_layout", "join", "reshape", "permute",
        "arange", "full", "load", "store", "where", "maximum", "max", "sum", "exp2", "log2",
        "multiple_of", "cdiv", "minimum", "program_id", "NVMMADistributedLayout"),
    "triton.experimental.gluon.language.nvidia.hopper": (
        "warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared"),
    "triton.experimental.gluon.language.nvidia.ampere.async_copy": (
        "async_copy_global_to_shared", "commit_group", "wait_group"),
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


try:
    REASON = _check()
    if not REASON:
        from . import decode as _decode  # noqa: F401  (defines the kernels)
        from . import prefill as _prefill  # noqa: F401
        from . import decode_heads as _decode_heads  # noqa: F401
        AVAILABLE = True
except Exception as e:  # noqa: BLE001 - a kernel that fails to define closes the gate
    REASON = f"gluon kernels failed to load: {type(e).__name__}: {e}"
    AVAILABLE = False

__all__ = ["AVAILABLE", "REASON"]
