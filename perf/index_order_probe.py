r"""Whether the few-heads prefill's gather is bound by where its rows sit (GPU only).

At the issue's 8-head shape (4096 tokens x 512 random top-k rows of the 32768-row bf16
workspace) the few-heads kernel's copies run near ``gather_probe.py``'s floor. This probe asks
whether that floor is the L2's capacity (rows falling out to HBM) or its bandwidth, by timing
the same kernel on the same number of keys drawn in other ways:

* ``random``: the benchmark's ids;
* ``sorted``: each token's ids sorted, so that CTAs walking their tokens' blocks in step read
  nearby rows at the same time;
* ``random<16384`` / ``random<8192``: the ids folded into the first 16 / 8 MB of rows.

Each row gives the whole kernel, its copies alone (``MODE=1``) and its products alone
(``MODE=2``), for the one-CTA and two-CTA forms; then the shared-window entry with random and
sorted top-k ids, and ``torch.sort`` of the ids. CUDA graph, L2 flushed before each replay.

    python perf/index_order_probe.py
    ncu --clock-control none -k regex:few --section SpeedOfLight \
        --section MemoryWorkloadAnalysis_Tables python perf/index_order_probe.py --ncu
        # one launch each of the two-CTA form: whole and copies alone on random ids, copies
        # alone on ids folded into 8 MB
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _inputs():
    import torch

    import bench_prefill as bp
    inp = bp.build_kernel_inputs(8)
    ids = inp["local"]
    orders = {"random": ids, "sorted": torch.sort(ids, dim=1).values.contiguous(),
              "random<16384": (ids % 16384).contiguous(),
              "random<8192": (ids % 8192).contiguous()}
    out = torch.empty_like(inp["q"])
    lse = torch.empty(inp["q"].shape[:2], device=ids.device)
    return inp, orders, out, lse


def ncu_launches() -> None:
    import torch

    from dsv41_triton.attention.gluon import prefill_launch as pl
    inp, orders, out, lse = _inputs()
    for lab, mode in (("random", 0), ("random", 1), ("random<8192", 1)):
        pl._launch_few(inp["q"], inp["kv"], orders[lab], None, inp["sink"], 512 ** -0.5, out,
                       lse, False, mode, ctas_per_sm=2)
        torch.cuda.synchronize()
        print(f"launched: two CTAs per SM, {lab}, mode {mode}", flush=True)


def main() -> None:
    import torch

    import bench_prefill as bp
    from dsv41_triton.attention import sparse_mla_prefill
    from dsv41_triton.attention.gluon import prefill_launch as pl
    from dsv41_triton.attention.prefill_shared import sparse_mla_prefill_shared_window
    from dsv41_triton.testing import rel_err

    dev = "cuda"
    print(torch.cuda.get_device_name(), flush=True)
    inp, orders, out, lse = _inputs()
    q, kv, sink = inp["q"], inp["kv"], inp["sink"]
    T = q.shape[0]
    scale = 512 ** -0.5
    ids = orders["random"]
    t_sort = bp.time_graph_flushed(lambda: torch.sort(ids, dim=1))
    print(f"torch.sort {list(ids.shape)} int32: {t_sort:.1f} us", flush=True)
    refs = {lab: sparse_mla_prefill(q, kv, ix, None, sink, _kernel="tl")[0]
            for lab, ix in orders.items()}
    for form, kw in (("one CTA per SM", {}), ("two CTAs per SM", dict(ctas_per_sm=2))):
        for lab, ix in orders.items():
            pl._launch_few(q, kv, ix, None, sink, scale, out, lse, False, 0, **kw)
            err = rel_err(out, refs[lab])
            ts = [bp.time_graph_flushed(lambda: pl._launch_few(
                q, kv, ix, None, sink, scale, out, lse, False, m, **kw)) for m in (0, 1, 2)]
            print(f"few, {form}, {lab}: whole {ts[0]:.1f} copies {ts[1]:.1f} products "
                  f"{ts[2]:.1f} us (rel to tl {err:.1e})", flush=True)
    win_len = torch.full((T,), bp.W, dtype=torch.int32, device=dev)
    os.environ[pl.ENV] = "auto"
    for lab in ("random", "sorted"):
        args = (q, kv, inp["win_start"], win_len, orders[lab], None, inp["qsl"], sink)
        t = bp.time_graph_flushed(lambda: sparse_mla_prefill_shared_window(*args, out=out))
        print(f"shared-window entry, top-k {lab}: {t:.1f} us", flush=True)


if __name__ == "__main__":
    if "--ncu" in sys.argv:
        ncu_launches()
    else:
        main()
