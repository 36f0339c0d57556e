"""Compile the Triton (``tl``) kernels that the public entry points launch for another GPU
target, on a machine without that GPU: ``python tests/compile_targets.py cuda:80``.

Run without ``TRITON_INTERPRET``. Triton's own launcher does the work (binding, specializing,
``triton.compile``) with ``warmup=True``, so nothing runs; a stand-in driver answers the target.
The host code takes the target's launch rules (``_configs.arch_key``) and never the PyTorch
reference (``use_reference``); CPU tensors stand in for the device's. Prints one JSON object:
``{"target", "launches": [{"kernel", "case", "ok", "shared", "error"}]}``; ``shared`` is the
compiled kernel's shared memory in bytes, which must fit the target (``SHARED_LIMIT``).
"""
from __future__ import annotations

import json
import os
import sys
import traceback

#: bytes of shared memory (LDS) one CTA / workgroup may use, per target
SHARED_LIMIT = {
    "cuda:80": 166912,   # A100
    "cuda:89": 101376,   # L40S, RTX 4090
    "cuda:90": 232448,   # H100 / H200
    "cuda:100": 232448,  # B200
    "cuda:120": 101376,  # RTX Blackwell (RTX 5090, RTX PRO 6000)
    "hip:gfx942": 65536,  # MI300X
    "hip:gfx90a": 65536,  # MI250X
}
#: (major, minor) the host sees for each target
_CAPABILITY = {"cuda:80": (8, 0), "cuda:89": (8, 9), "cuda:90": (9, 0), "cuda:100": (10, 0),
               "cuda:120": (12, 0),
               "hip:gfx942": (9, 4), "hip:gfx90a": (9, 0)}


def _target(name: str):
    from triton.backends.compiler import GPUTarget
    backend, arch = name.split(":")
    if backend == "cuda":
        return GPUTarget("cuda", int(arch), 32)
    return GPUTarget("hip", arch, 64)


class _TargetDriver:
    """The part of Triton's driver that ``JITFunction.run(warmup=True)`` asks."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")


def _code_hash(asm: dict) -> str:
    """A hash of the compiled code without its debug lines (source line numbers)."""
    import hashlib
    text = asm.get("ptx") or asm.get("amdgcn") or ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    keep = [ln for ln in text.split(".section\t.debug")[0].splitlines()
            if not ln.lstrip().startswith((".loc", ".file", "$L__", ";"))]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def _patch_host(name: str, log: list, case: list) -> None:
    """Launches compile for ``name`` and are logged instead of run; the host takes the
    target's launch rules and the kernels, never the reference."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    import dsv41_triton._utils as U
    from dsv41_triton.attention import _configs

    driver.set_active(_TargetDriver(_target(name)))
    rocm = name.startswith("hip")
    key = ("rocm" if rocm else "cuda", _CAPABILITY[name])
    _configs.arch_key = lambda device: key
    _configs._sm_count = lambda device: 132 if not rocm else 304

    def no_reference(device, kernel):
        return False
    original = U.use_reference
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("dsv41_triton") and \
                getattr(mod, "use_reference", None) is original:
            mod.use_reference = no_reference

    def compile_only(self, grid):
        def run(*args, **kwargs):
            entry = dict(kernel=self.fn.__name__, case=case[0], ok=False, shared=None,
                         error="")
            try:
                k = self.run(*args, grid=grid, warmup=True, **kwargs)
                entry["shared"] = int(k.metadata.shared)
                entry["code"] = _code_hash(k.asm)
                entry["ok"] = True
            except Exception as e:  # noqa: BLE001 - every failure is reported
                entry["error"] = f"{type(e).__name__}: {e}"[-1500:]
            log.append(entry)
        return run
    JITFunction.__getitem__ = compile_only


def main(argv) -> int:
    name = argv[1]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET")
    sys.path.insert(0, os.path.dirname(__file__))
    import target_cases

    log, case = [], [""]
    _patch_host(name, log, case)
    errors = []
    for label, fn in target_cases.CASES:
        case[0] = label
        try:
            fn()
        except Exception:  # noqa: BLE001 - a host failure is reported with the case
            errors.append(dict(case=label, error=traceback.format_exc()[-1500:]))
    print(json.dumps(dict(target=name, launches=log, host_errors=errors)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
