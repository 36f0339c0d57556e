"""``perf/movmatrix_probe.py``: one register copy of a warp's key tile feeds both few-heads
products, ``S^T = K Q^T`` and (after ``movmatrix.trans``) ``O^T = V^T P^T``, with no shared
memory in between (sm_90 compile on the CPU; the products against torch on a GPU)."""
import json
import os
import subprocess
import sys

import pytest
from gluon_probe import PERF, probe_json

from dsv41_triton.attention import gluon as gluon_pkg


@pytest.fixture(scope="module")
def facts():
    return probe_json("movmatrix_probe.py")[-1]


def test_key_tile_transposed_in_registers(facts):
    assert facts["HMMA"] == 8, facts  # 4 k-steps of S^T, 4 m-tiles of O^T
    assert facts["MOVM"] == 16, facts  # the [16, 64] tile's 16 8 x 8 blocks
    for op in ("LDS", "STS", "LDSM", "SHFL"):
        assert facts.get(op, 0) == 0, (op, facts)  # no conversion through shared memory


def test_o_products_take_the_transposed_s_operands(facts):
    # O m-tile i's four A registers are movmatrix of S k-step i's a0, a2, a1, a3 (a wrong
    # permute of the transposed tile routes it through shared memory and breaks this)
    assert facts["movmatrix"] == 16 and facts["o_from_s"] is True, facts


@pytest.mark.gpu
def test_movmatrix_products_match_torch_gpu():
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the probe uses: {gluon_pkg.REASON}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(PERF / "movmatrix_probe.py"), "--json", "--check"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["s_rel"] <= 1e-5 and rec["o_rel"] <= 1e-5, rec
