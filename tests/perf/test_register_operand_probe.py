"""``perf/register_operand_probe.py``: both swap-AB wgmma A operands reach their registers from
record bytes without shared memory, and one swizzled ring serves both reads without bank
conflicts (sm_90 compiles on the CPU, in a subprocess without the interpreter; skipped without
Triton's Gluon API of 3.6)."""
import pytest
from gluon_probe import probe_json


@pytest.fixture(scope="module")
def facts():
    return probe_json("register_operand_probe.py")[-1]


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
