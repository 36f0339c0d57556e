"""What the prefill's schedule would give decode: the persistent warp-specialized prefill (``wsp``)
run on decode-sized batches, beside the many-heads decode and FlashMLA in one run.

    python perf/decode_schedule_probe.py [--tokens 128,512] [--heads 64,128] [--variants wsp]

The decode's many-heads kernels run one serial chain per 64-key block (dequant, S, softmax,
PV); the prefill's ``wsp`` ping-pongs two consumer warpgroups over block pairs. This times
``wsp`` on ``T`` tokens x 640 keys (128 consecutive window rows + 512 random rows) of a bf16
workspace too large for L2 (131072 rows, 128 MiB; 1 KiB per key, 1.75x a 584-byte record),
so it is the decode's access pattern without the dequant. Rows: ``wsp`` on that workspace,
FlashMLA's ``flash_mla_sparse_fwd`` on the same, our decode (``auto``) and FlashMLA's decode
kernel on 584-byte records (``perf/bench_decode_hopper.py``'s case). Method as there: CUDA
graph of one call, 512 MB L2 flush before each replay, median.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode_hopper import build_case, flashmla_fn, time_graph  # noqa: E402
from bench_prefill import _flashmla_fn, _gluon_fn  # noqa: E402

from dsv41_triton.attention.decode import sparse_mla_decode  # noqa: E402
from dsv41_triton.testing import rel_err  # noqa: E402

ROWS = 131072
W, K = 128, 512


def workspace_case(T: int, H: int, device="cuda"):
    """``bench_prefill``-style inputs: q, a ``ROWS``-row bf16 workspace, 640 ids per token."""
    g = torch.Generator(device=device).manual_seed(T * 1000 + H)
    kv = torch.randn(ROWS, 512, device=device, generator=g).to(torch.bfloat16)
    start = torch.randint(0, ROWS - W, (T,), device=device, generator=g)
    win = start[:, None] + torch.arange(W, device=device)[None, :]
    top = torch.randint(0, ROWS, (T, K), device=device, generator=g)
    idx = torch.cat([top, win], 1).to(torch.int32).contiguous()
    q = torch.randn(T, H, 512, device=device, generator=g).to(torch.bfloat16)
    return dict(H=H, q=q, kv=kv, idx=idx, sink=torch.randn(H, device=device, generator=g),
                out=torch.empty(T, H, 512, dtype=torch.bfloat16, device=device))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="wsp",
                    help="comma-separated prefill Gluon variants to time (prefill_launch.VARIANTS)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_schedule_probe: no CUDA device; nothing to time")
        return 0
    variants = args.variants.split(",")
    print("| heads | T | " + " | ".join(f"{v} bf16 ws" for v in variants)
          + " | FlashMLA sparse_fwd bf16 ws | ours decode 584 (auto) | FlashMLA decode 584 | "
          + " | ".join(f"{v} vs FlashMLA fwd" for v in variants) + " |")
    print("|---|---|" + "---|" * (2 * len(variants) + 3))
    for H in (int(x) for x in args.heads.split(",")):
        for T in (int(x) for x in args.tokens.split(",")):
            inp = workspace_case(T, H)
            cells = []
            outs = []
            for fn in [_gluon_fn(inp, v) for v in variants] + [_flashmla_fn(inp)]:
                if fn is None:
                    cells.append(float("nan"))
                    outs.append(None)
                    continue
                cells.append(time_graph(fn, args.reps))
                outs.append(fn()[0].float().clone())
            ref = outs[-1]
            agree = [rel_err(o, ref) if o is not None and ref is not None else float("nan")
                     for o in outs[:-1]]
            del inp
            case = build_case(T, H, 584, 584)
            cells.append(time_graph(lambda c=case: sparse_mla_decode(**c), args.reps))
            fm = flashmla_fn(case)
            cells.append(time_graph(fm, args.reps) if fm is not None else float("nan"))
            del case
            torch.cuda.empty_cache()
            print(f"| {H} | {T} | " + " | ".join(f"{c:.1f}" for c in cells)
                  + " | " + " | ".join(f"{a:.1e}" for a in agree) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
