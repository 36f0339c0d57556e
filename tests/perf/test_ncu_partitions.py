"""``perf/ncu_partitions.py``: ncu's source page split into a warp-specialized kernel's
partitions, with the mbarrier waits named (a synthetic page; no GPU, no ncu)."""
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "perf"))
import ncu_partitions as npart  # noqa: E402

HEADER = ["Address", "Source", npart.SAMPLES, "# Samples", "stall_long_sb", "stall_short_sb",
          "stall_long_sb (Not Issued)"]
# (SASS, samples, long scoreboard, short scoreboard)
SASS = [
    # the default partition (mma.sync): a wait on tready at 0x100 spun on right after it
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P4, [R17+URZ+0x100], R2", 2, 0, 2),
    ("@!P4  BRA 0x7f0000000500", 30, 30, 0),
    ("HMMA.16816.F32 R4, R8, R12, R4", 18, 0, 18),
    # the producer: its wait on free at 0x110, the branch three instructions on
    ("USETMAXREG.DEALLOC.CTAPOOL 0x50", 0, 0, 0),
    ("SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR22+0x110], R4", 1, 0, 1),
    ("SEL R5, R2, 0xffffffff, !P3", 0, 0, 0),
    ("@!P3  BRA 0x7f0000000600", 5, 5, 0),  # another predicate: not the spin
    ("@!P2  BRA 0x7f0000000700", 40, 40, 0),
    ("LDGSTS.E.BYPASS.128 [R41+0x30800], desc[UR8][R6.64]", 4, 0, 0),
    # a partition without samples, then the dequant one (wgmma)
    ("USETMAXREG.DEALLOC.CTAPOOL 0x50", 0, 0, 0),
    ("NOP", 0, 0, 0),
    ("USETMAXREG.DEALLOC.CTAPOOL 0x50", 0, 0, 0),
    ("HGMMA.64x8x16.F32 R24, R44, gdesc[UR48], R24", 100, 0, 60),
]


def _page():
    out = io.StringIO()
    out.write('"Kernel Name","_k",\n')
    out.write(",".join(f'"{h}"' for h in HEADER) + "\n")
    for i, (s, n, lsb, ssb) in enumerate(SASS):
        row = [hex(0x7f0000000000 + 16 * i), "      " + s, n, n, lsb, ssb, 0]
        out.write(",".join(f'"{v}"' for v in row) + "\n")
    out.seek(0)
    return out


def test_partitions_labels_shares_and_named_waits():
    hdr, ins = npart.read_source(_page())
    assert len(ins) == len(SASS) and ins[0][1].startswith("SYNCS")
    parts = npart.summarize(hdr, ins, top=2, barriers={0x100: "tready"})
    assert [p["label"] for p in parts] == ["mma.sync", "copies", "wgmma"]  # the empty one left out
    total = sum(n for _, n, _, _ in SASS)
    mma, prod, ds = parts
    assert mma["samples"] == 50 and mma["share"] == pytest.approx(50 / total)
    assert mma["waits"] == {"tready": pytest.approx(30 / 50)}
    # the spin on the wait's own predicate (P2), not the nearer branch on P3
    assert prod["waits"] == {"0x110": pytest.approx(40 / 50)}
    assert prod["stalls"]["long_sb"] == pytest.approx(45 / 50)
    assert ds["waits"] == {} and ds["stalls"] == {"short_sb": pytest.approx(0.6)}
    assert [t[0] for t in prod["top"]] == [0x70, 0x60]  # most sampled first
    assert prod["start"] == 0x30 and prod["end"] == 0x80


def test_main_prints_each_partition(tmp_path, capsys):
    f = tmp_path / "source.csv"
    f.write_text(_page().read())
    assert npart.main([str(f), "--top", "1", "--barriers", "0x110=free"]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 3 and "mbarrier waits: free 80.0 %" in out
