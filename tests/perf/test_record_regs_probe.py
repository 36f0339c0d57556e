"""``perf/record_regs_probe.py`` compiles for sm_90a without spills and with shared memory for
two CTAs per SM (CPU; skipped without Triton's Gluon API of 3.6)."""
import sys
from pathlib import Path

import pytest

from dsv41_triton.attention import gluon as gluon_pkg


@pytest.mark.parametrize("has_b", [False, True])
def test_record_regs_probe_compiles_without_spills(has_b):
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the probe uses: {gluon_pkg.REASON}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    import record_regs_probe as probe

    st = probe.compile_stats(has_b)
    assert st["stack"] == 0 and st["loop"]["spill_ld_st"] == 0, st
    assert 0 < st["smem"] <= 113 * 1024, st  # two CTAs per SM
    assert st["loop"]["ops"].get("HGMMA") == 68, st["loop"]["ops"]  # 32 + 36 per 64-key block
