"""``perf/register_operand_probe.py``: both swap-AB wgmma A operands reach their registers from
record bytes without shared memory (sm_90 compile on the CPU; skipped without Triton's Gluon
API of 3.6)."""
import sys
from pathlib import Path

import pytest

from dsv41_triton.attention import gluon as gluon_pkg


@pytest.mark.parametrize("kind", ["qk", "pv"])
def test_record_bytes_reach_the_wgmma_a_registers_without_shared_memory(kind):
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the probe uses: {gluon_pkg.REASON}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    import register_operand_probe as probe

    ops = probe.count_ops(probe.compile_probe(kind))
    assert ops["HGMMA"] == 4, ops  # 64 keys (qk: 64 dims) of K in four k16 steps
    assert ops["LDS"] == 0 and ops["SHFL"] == 0, ops  # no layout conversion through memory
    assert ops["STS"] == 1, ops  # the B tile's one store
    assert ops["F2FP"] == 16, ops  # 32 e4m3 values per thread, two per convert


def test_one_swizzled_ring_serves_both_products_without_bank_conflicts():
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the probe uses: {gluon_pkg.REASON}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    import register_operand_probe as probe

    probe.compile_probe("ring")  # its static_asserts: no bank conflict for either read
    with pytest.raises(Exception, match="static_assert|[Aa]ssert"):
        probe.compile_probe("ring", swizzle=False)  # plain rows: the O read conflicts
