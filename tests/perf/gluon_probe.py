"""Shared by the probe tests: run a ``perf/`` Gluon probe's ``--json`` mode (sm_90 compiles on
the CPU) in a subprocess without Triton's interpreter, which the test session enables and which
would turn the kernels' helper functions into interpreted ones (a test module name: the test
directory is on ``sys.path``; its test modules are not a package)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41_triton.attention import gluon as gluon_pkg

PERF = Path(__file__).resolve().parents[2] / "perf"


def probe_json(script: str) -> list:
    """The JSON lines ``perf/<script> --json`` prints (skips without the Gluon API)."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the probe uses: {gluon_pkg.REASON}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(PERF / script), "--json"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.strip().splitlines() if line.startswith("{")]
