"""``perf/register_operand_probe.py``: both swap-AB wgmma A operands reach their registers from
record bytes without shared memory, and one swizzled ring serves both reads without bank
conflicts (sm_90 compiles on the CPU, in a subprocess without the interpreter; skipped without
Triton's Gluon API of 3.6)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41_triton.attention import gluon as gluon_pkg

PROBE = Path(__file__).resolve().parents[2] / "perf" / "register_operand_probe.py"


@pytest.fixture(scope="module")
def facts():
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the probe uses: {gluon_pkg.REASON}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(PROBE), "--json"], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["qk", "pv"])
def test_record_bytes_reach_the_wgmma_a_registers_without_shared_memory(facts, kind):
    ops = facts[kind]
    assert ops["HGMMA"] == 4, ops  # 64 keys (qk: 64 dims) of K in four k16 steps
    assert ops.get("LDS", 0) == 0 and ops.get("SHFL", 0) == 0, ops  # no conversion via memory
    assert ops["STS"] == 1, ops  # the B tile's one store
    assert ops["F2FP"] == 16, ops  # 32 e4m3 values per thread, two per convert


def test_one_swizzled_ring_serves_both_products_without_bank_conflicts(facts):
    # the ring probe's static_asserts: no bank conflict for either read on the swizzled rows;
    # on plain rows the O read conflicts and the compile fails
    assert facts["ring_swizzle_True"] == "compiled", facts["ring_swizzle_True"]
    assert "static_assert" in facts["ring_swizzle_False"], facts["ring_swizzle_False"]
