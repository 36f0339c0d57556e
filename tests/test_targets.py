"""Every Triton (``tl``) kernel compiles for the GPUs the README names, and fits their shared
memory, at the launch shapes the host picks there: ``compile_targets.py`` compiles what the
public entry points launch (``target_cases.py``) for each target, in a subprocess without the
interpreter, on this machine's CPU. Nothing runs on those GPUs; their numerics are the ones the
interpreter and the H200 check (the same kernels; the e4m3 software path is what the
interpreter runs)."""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
import warnings

import pytest

HERE = os.path.dirname(__file__)
TARGETS = ("hip:gfx942", "cuda:80", "cuda:90", "cuda:100", "cuda:120")


def _tl_kernels() -> set:
    """Names of the package's ``@triton.jit`` kernels (``*_kernel``) outside ``gluon``."""
    import dsv41_triton
    names = set()
    for m in pkgutil.walk_packages(dsv41_triton.__path__, "dsv41_triton."):
        if ".gluon" in m.name or not m.name.startswith(("dsv41_triton.ops",
                                                         "dsv41_triton.attention")):
            continue
        with warnings.catch_warnings():  # the moved-path shims warn on import
            warnings.simplefilter("ignore", DeprecationWarning)
            mod = importlib.import_module(m.name)
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", None)
            if (name.endswith("_kernel") and callable(fn)
                    and getattr(fn, "__module__", "") == m.name):
                names.add(name)
    return names


@pytest.fixture(scope="module")
def kernels() -> set:
    return _tl_kernels()


@pytest.fixture(scope="module")
def compiled() -> dict:
    """target -> (return code, stdout, stderr) of ``compile_targets.py``, two targets at a
    time (each compiles on one core)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(HERE, "compile_targets.py")
    waiting, running, done = list(TARGETS), {}, {}
    while waiting or running:
        while waiting and len(running) < max(2, os.cpu_count() or 1):
            t = waiting.pop(0)
            running[t] = subprocess.Popen([sys.executable, script, t], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        t = next(iter(running))
        out, err = running.pop(t).communicate(timeout=2400)
        done[t] = (out, err)
    return done


@pytest.mark.parametrize("target", TARGETS)
def test_kernels_compile_and_fit_on(target, kernels, compiled):
    sys.path.insert(0, HERE)
    from compile_targets import SHARED_LIMIT
    out, err = compiled[target]
    assert out, err[-3000:]
    got = json.loads(out)
    assert not got["host_errors"], got["host_errors"]
    failed = [(e["case"], e["kernel"], e["error"][-400:]) for e in got["launches"] if not e["ok"]]
    assert not failed, failed
    limit = SHARED_LIMIT[target]
    over = sorted({(e["kernel"], e["shared"]) for e in got["launches"] if e["shared"] > limit})
    assert not over, f"shared memory over {limit} bytes on {target}: {over}"
    missing = kernels - {e["kernel"] for e in got["launches"]}
    assert not missing, f"target_cases.py launches none of {sorted(missing)}"
