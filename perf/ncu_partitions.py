"""Where a warp-specialized kernel's warps wait, partition by partition, from ncu's source page.

    ncu --set full --import-source no -k regex:few_ds -c 1 -o rep python perf/paged_topk_probe.py \
        --tokens 2048 --ncu --ncu-rows "decode ds f16 split4 ahead2 pvsync smask"
    ncu -i rep.ncu-rep --page source --csv --print-source sass > source.csv
    python perf/ncu_partitions.py source.csv [--top 6] [--barriers 0x37c90=ready,...]

The SASS of a ``gl.warp_specialize`` kernel holds each partition's code after a
``USETMAXREG`` (the default partition first). For each stretch that has warp-state samples this
prints its share of the kernel's samples, its top stall reasons, the mbarrier waits (the
``BRA`` on each ``SYNCS.PHASECHK.*TRYWAIT``'s predicate, named by the barrier's shared-memory
offset, or by ``--barriers``; a barrier indexed at run time is named by its array's offset) and its most sampled instructions. A stretch is labelled by what
it issues: ``mma.sync`` (``HMMA``), ``wgmma`` (``HGMMA``), ``copies`` (``LDGSTS``), else
``other``.
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from typing import Dict, Iterable, List, Tuple

SAMPLES = "Warp Stall Sampling (All Samples)"
_WAIT = re.compile(r"SYNCS\.PHASECHK\S*TRYWAIT\s+(P\d),\s*\[[^\]]*?(0x[0-9a-f]+)\]")


def read_source(lines: Iterable[str]) -> Tuple[List[str], List[Tuple[int, str, List[str]]]]:
    """ncu's ``--page source --csv`` rows -> (header, [(address, SASS, row)]); the lines before
    the header (the kernel's name) are skipped."""
    rows = list(csv.reader(lines))
    start = next(i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"])
    hdr = rows[start]
    ins = [(int(r[0], 16), r[1].strip(), r) for r in rows[start + 1:]
           if r and r[0].startswith("0x")]
    return hdr, ins


def partitions(ins):
    """Split at each ``USETMAXREG``: [(label, [(address, SASS, row)])]."""
    cuts = [i for i, (_, s, _) in enumerate(ins) if "USETMAXREG" in s]
    bounds = [0] + cuts + [len(ins)]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        seg = ins[a:b]
        ops = " ".join(s for _, s, _ in seg)
        label = ("mma.sync" if "HMMA" in ops else "wgmma" if "HGMMA" in ops
                 else "copies" if "LDGSTS" in ops else "other")
        out.append((label, seg))
    return out


def _n(row, ix, col) -> int:
    v = row[ix[col]]
    return int(v) if v not in ("", "-") else 0


def summarize(hdr, ins, top: int = 6, barriers: Dict[int, str] = None) -> List[dict]:
    """Per stretch with samples: ``{label, start, end, samples, share, stalls, waits, top}``
    (``stalls``: reason -> share of the stretch's samples; ``waits``: barrier -> share;
    ``top``: [(address, share, SASS)]); addresses relative to the kernel's first."""
    barriers = barriers or {}
    ix = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    base = ins[0][0] if ins else 0
    total = sum(_n(r, ix, SAMPLES) for _, _, r in ins) or 1
    out = []
    for label, seg in partitions(ins):
        n = sum(_n(r, ix, SAMPLES) for _, _, r in seg)
        if n == 0:
            continue
        st = collections.Counter()
        for _, _, r in seg:
            for h in reasons:
                st[h[len("stall_"):]] += _n(r, ix, h)
        waits = collections.Counter()
        for i, (_, s, _) in enumerate(seg):
            m = _WAIT.search(s)
            if not m:
                continue
            # the spin's branch on the wait's predicate, a few instructions on
            spin = next((r2 for _, s2, r2 in seg[i + 1:i + 8]
                         if "BRA" in s2 and f"@!{m.group(1)} " in s2), None)
            if spin is not None:
                off = int(m.group(2), 16)
                waits[barriers.get(off, hex(off))] += _n(spin, ix, SAMPLES)
        hot = sorted(seg, key=lambda x: -_n(x[2], ix, SAMPLES))[:top]
        out.append(dict(label=label, start=seg[0][0] - base, end=seg[-1][0] - base, samples=n,
                        share=n / total,
                        stalls={k: v / n for k, v in st.most_common(6) if v},
                        waits={k: v / n for k, v in waits.most_common() if v},
                        top=[(a - base, _n(r, ix, SAMPLES) / n, s) for a, s, r in hot]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass")
    ap.add_argument("--top", type=int, default=6, help="most sampled instructions per stretch")
    ap.add_argument("--barriers", default="",
                    help="names for barrier offsets: 0x37c90=ready,0x37ca0=free,...")
    a = ap.parse_args(argv)
    names = {int(k, 16): v for k, v in (p.split("=") for p in a.barriers.split(",") if p)}
    with open(a.csv, newline="") as f:
        hdr, ins = read_source(f)
    for p in summarize(hdr, ins, a.top, names):
        print(f"== {p['label']} {p['start']:#x}..{p['end']:#x}: {p['samples']} samples "
              f"({100 * p['share']:.1f} % of the kernel's)")
        print("   stalls: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in p["stalls"].items()))
        if p["waits"]:
            print("   mbarrier waits: " + ", ".join(f"{k} {100 * v:.1f} %"
                                                   for k, v in p["waits"].items()))
        for addr, share, sass in p["top"]:
            print(f"   {addr:#8x} {100 * share:5.1f} %  {sass[:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
