"""``perf/record_regs_probe.py`` compiles for sm_90a without spills and with shared memory for
two CTAs per SM (CPU, in a subprocess without the interpreter; skipped without Triton's Gluon
API of 3.6)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41_triton.attention import gluon as gluon_pkg

PROBE = Path(__file__).resolve().parents[2] / "perf" / "record_regs_probe.py"


def test_record_regs_probe_compiles_without_spills():
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the probe uses: {gluon_pkg.REASON}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(PROBE), "--json"], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.strip().splitlines() if line.startswith("{")]
    assert [row["has_b"] for row in rows] == [False, True], rows
    for st in rows:
        assert st["stack"] == 0 and st["spills"] == 0, st
        assert 0 < st["smem"] <= 113 * 1024, st  # two CTAs per SM
        assert st["hgmma"] == 68, st  # 32 + 36 products per 64-key block
