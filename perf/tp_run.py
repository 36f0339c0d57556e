"""Tensor-parallel V4.1 attention step under torchrun: check TP=N against TP=1 and time it.

    torchrun --standalone --nproc-per-node N perf/tp_run.py --tp N [--backend triton]
        [--preset v41-flash] [--prefill 2048x2,1000x4,256x9,1] [--steps 4] [--layer-ids 0,2,3]
    python perf/tp_run.py --tp 1 ...          # TP=1 needs no torchrun
    bash perf/run_tp.sh                       # TP=1/2/4 for the GPUs present, table last

Every rank builds the same random full weights and the same steps (seeded): one prefill step of
all requests (prompt lengths from ``--prefill``: ``LEN`` or ``LENxCOUNT``, comma-separated),
then ``--steps`` decode steps (every request one token). Each rank runs its shard (heads and
``wo_a`` groups split, ``wo_b`` all-reduced: NCCL on GPUs, gloo on the CPU) with its own
caches; rank 0 also runs the steps through a TP=1 layer on its device and compares the layer
outputs of every step (relative Frobenius error <= 1e-2, SPEC §7 for bf16 outputs).

Timing replays the prefill step and the last decode step (a replay rewrites the same records to
the same slots, so it is idempotent): a barrier, then the step between CUDA events (GPU; eager,
Python launch overhead included) or the wall clock (CPU); the median per rank, the slowest
rank's median reported (the all-reduce included). Rank 0 times its TP=1 layer the same way.
One JSON line per (TP size, layer, phase) on stdout (and appended to ``--jsonl``), a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout: torchrun ... perf/tp_run.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_argv = " ".join(sys.argv[1:]).replace("=", " ")
if not torch.cuda.is_available() or "--device cpu" in _argv:
    # Triton decides interpreter vs GPU when a kernel is defined: before importing any kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv41_triton.layers.distributed import (  # noqa: E402
    NCCL_ENV_DEFAULTS,
    ScenarioSetup,
    TPContext,
    check_tp_against_tp1,
    init_tp_from_env,
    run_step,
    set_nccl_env_defaults,
    shutdown_tp,
)

set_nccl_env_defaults()  # before anything can initialise NCCL

import torch.distributed as dist  # noqa: E402

from dsv41_triton.layers.config import DeepseekV41AttentionConfig  # noqa: E402

#: the CPU test's tiny layer (8 heads, 4 groups of 2): TP up to 4 on the torch backend
TINY = DeepseekV41AttentionConfig(
    name="tiny", hidden_size=64, num_attention_heads=8, q_lora_rank=32, o_lora_rank=16,
    o_groups=4, sliding_window=8, index_topk=4, compress_ratios=(0, 1, 2),
)
PRESETS = {
    "tiny": lambda: TINY,
    "v41-flash": DeepseekV41AttentionConfig.v41_flash,
    "v4-flash": DeepseekV41AttentionConfig.v4_flash,
    "v4-pro": DeepseekV41AttentionConfig.v4_pro,
}
DEFAULT_PREFILL = {"tiny": "11,6,7,1"}
GPU_PREFILL = "2048x2,1000x4,256x9,1"  # 16 requests, 10401 prompt tokens


def parse_lens(spec: str) -> List[int]:
    """``"2048x2,300,1"`` -> ``[2048, 2048, 300, 1]``."""
    out: List[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        n, _, c = part.partition("x")
        try:
            ln, cnt = int(n), int(c or 1)
        except ValueError:
            raise SystemExit(f"--prefill: bad entry {part!r} (expected LEN or LENxCOUNT)")
        if ln < 1 or cnt < 1:
            raise SystemExit(f"--prefill: bad entry {part!r} (lengths and counts >= 1)")
        out += [ln] * cnt
    if not out:
        raise SystemExit("--prefill: no requests")
    return out


def build_steps(lens: Sequence[int], decode_steps: int):
    """Prefill of every request (1-token prompts count as decodes and come first), then
    ``decode_steps`` steps of one token per request."""
    names = [f"r{i}" for i in range(len(lens))]
    plan = sorted(zip(names, lens), key=lambda x: x[1] > 1)  # vLLM order: decodes first
    steps = [(tuple(plan), 0)]
    steps += [(tuple((n, 1) for n in names), 0)] * decode_steps
    return steps


def time_step(layer, step, ctx: TPContext, iters: int, warmup: int, group) -> List[float]:
    """Per-iteration milliseconds of ``run_step`` (barrier first when ``group``)."""
    cuda = ctx.device.type == "cuda"
    for _ in range(warmup):
        run_step(layer, step)
    times = []
    for _ in range(iters):
        if group is not None:
            dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run_step(layer, step)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            run_step(layer, step)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _slowest(x: float, ctx: TPContext) -> float:
    if ctx.world_size == 1 or not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return float(t.item())


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, required=True, help="TP size (= torchrun's nproc)")
    ap.add_argument("--backend", default="auto", help="auto, triton, torch, flashmla, ...")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS),
                    help="layer shapes (default: v41-flash on a GPU, tiny on the CPU)")
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"))
    ap.add_argument("--layer-ids", default=None,
                    help="comma-separated layers (default: the first layer of each ratio)")
    ap.add_argument("--prefill", default=None, help=f"prompt lengths (GPU default {GPU_PREFILL})")
    ap.add_argument("--steps", "--decode-steps", dest="steps", type=int, default=4,
                    help="decode steps after the prefill")
    ap.add_argument("--page-size", type=int, default=None, help="cache page (64 GPU, 4 CPU)")
    ap.add_argument("--fused", action="store_true", help="the fused (MXFP8-output) contract")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-check", action="store_true", help="skip the TP=1 comparison")
    ap.add_argument("--jsonl", default=None, help="append the JSON rows to this file")
    a = ap.parse_args(argv)

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if "RANK" in os.environ:
        ctx = init_tp_from_env(device)
    elif a.tp == 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else \
            torch.device("cpu")
        ctx = TPContext(0, 1, 0, dev, "none", None)
    else:
        raise SystemExit(f"--tp {a.tp}: run under torchrun --nproc-per-node {a.tp}")
    if ctx.world_size != a.tp:
        raise SystemExit(f"--tp {a.tp} but WORLD_SIZE={ctx.world_size}")

    preset = a.preset or ("v41-flash" if device == "cuda" else "tiny")
    cfg = PRESETS[preset]()
    lens = parse_lens(a.prefill or DEFAULT_PREFILL.get(preset, GPU_PREFILL))
    steps = build_steps(lens, a.steps)
    page = a.page_size or (64 if device == "cuda" else 4)
    max_len = max(lens) + a.steps + 1
    bpr = -(-max_len // page)
    setup = ScenarioSetup(seed=a.seed + 1, num_blocks=bpr * len(lens), page_size=page,
                          compressed_page_size=page, blocks_per_req=bpr,
                          max_model_len=max_len)
    if a.layer_ids:
        layer_ids = [int(x) for x in a.layer_ids.split(",")]
    else:
        first: Dict[int, int] = {}
        for i in range(len(cfg.compress_ratios) or 1):
            first.setdefault(cfg.compress_ratio(i), i)
        layer_ids = sorted(first.values())

    dev_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    rows = []
    ok_all = True
    for lid in layer_ids:
        chk = check_tp_against_tp1(ctx, cfg, lid, backend=a.backend, steps=steps, setup=setup,
                                   weights_seed=a.seed, reference=not a.no_check and a.tp > 1,
                                   fused=a.fused)
        ok_all &= chk.ok
        layer = chk.layer
        timed = [("prefill", chk.steps[0])] + ([("decode", chk.steps[-1])] if a.steps else [])
        for phase, st in timed:
            group = ctx.group if ctx.world_size > 1 else None
            t = time_step(layer, st, ctx, a.iters, a.warmup, group)
            med = _slowest(statistics.median(t), ctx)
            base = dict(preset=preset, layer_id=lid, ratio=layer.compress_ratio, phase=phase,
                        tokens=st.metadata.num_tokens, requests=st.metadata.num_reqs,
                        backend=layer.selection.name, fused=layer.fused, device=dev_name,
                        dist=ctx.backend, world=ctx.world_size,
                        timer="cuda-events (eager)" if ctx.device.type == "cuda" else "wall")
            rows.append(dict(base, tp=a.tp, role="tp", heads=layer.n_local_heads, median_ms=med,
                             min_ms=min(t), max_rel_err=chk.max_rel_err if chk.rel_errs else None,
                             ranks_agree=chk.ranks_agree, ok=chk.ok))
            if chk.reference is not None:  # rank 0 only: the TP=1 layer, timed alone
                t1 = time_step(chk.reference, st, ctx, a.iters, a.warmup, None)
                rows.append(dict(base, tp=1, role="tp1-reference", heads=chk.reference.n_local_heads,
                                 median_ms=statistics.median(t1), min_ms=min(t1),
                                 max_rel_err=0.0, ranks_agree=True, ok=True))
        if ctx.world_size > 1:
            dist.barrier(group=ctx.group)
        del chk, layer
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()

    if ctx.is_main:
        for r in rows:
            print(json.dumps(r), flush=True)
        if a.jsonl:
            with open(a.jsonl, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
        print_table(rows)
        env = {k: os.environ.get(k) for k in NCCL_ENV_DEFAULTS}
        print(f"tp={a.tp} preset={preset} device={dev_name} dist={ctx.backend} env={env} "
              f"check={'skipped' if a.no_check or a.tp == 1 else ('PASS' if ok_all else 'FAIL')}")
    return 0 if ok_all else 1


def print_table(rows: List[dict]) -> None:
    cols = ("tp", "world", "layer_id", "ratio", "phase", "tokens", "heads", "backend", "median_ms",
            "min_ms", "max_rel_err", "ok")
    cells = [[("-" if r[c] is None else f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]))
              for c in cols] for r in rows]
    w = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w[i]) for i, c in enumerate(cols)))
    for x in cells:
        print("  ".join(v.rjust(w[i]) for i, v in enumerate(x)))


def _run_and_exit() -> None:
    """``main``, then every rank tears its group down together and leaves without the
    interpreter's teardown: gloo's threads still alive there abort the process."""
    try:
        code = main()
    except BaseException:
        shutdown_tp(barrier=False)
        raise
    shutdown_tp()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _run_and_exit()
