"""Benchmark of the Triton sparse MLA kernels on V4.1 shapes (H200 numbers in PERF-NOTES.md).

    python perf/bench_attention.py            # check, then the decode and prefill tables
    python perf/bench_attention.py --sweep    # also try launch configs on the key shapes
    python perf/bench_attention.py --quick    # fewer shapes

Decode: ``T`` query tokens, each its own request: a window of 128 consecutive positions in
its own random pages plus 512 random compressed slots, 584-byte records (``fp8_ds_mla``),
pages of 64, sink on, real encoded records (``records.encode_records_ref``). Timed as a CUDA
graph that replays the step over ``SETS`` different index sets in turn (so the working set is
several times the 50 MB L2), and eagerly with ``triton.testing.do_bench`` (median, L2 flushed
by do_bench; an eager call also pays the Python launch). Prefill: 4096 tokens x 640 random rows
of an 8192-row bf16 workspace. Reported: us, TFLOP/s (``4 * H * keys * 512`` per query token)
and GB/s of unique bytes (distinct key records + q + out).

Importable: ``build_decode_case`` / ``build_prefill_case`` return cases, ``decode_fn`` /
``prefill_fn`` return zero-argument callables, ``time_graph`` / ``time_eager`` time them.

Measured on the lent H200 (triton 3.6, CUDA graph, us; perf/NOTES.md has the full table):
decode 8 heads, 1/32/128/512 tokens: 13.7 / 22.6 / 39.2 / 117.8 (with the former one-tile
kernel 16.6 / 32.3 / 82.8 / 264.5); 64 heads, 128 / 512 tokens: 89.4 / 332.0 (FlashMLA 48.5 /
173.6); prefill 4096 x 640, 8 / 64 / 128 heads: 528 / 1472 / 2931 (FlashMLA 64 / 128 heads:
659.5 / 1274).

``--sweep-only`` times every launch shape of ``GPU_CANDIDATES`` against the defaults on
the key shapes (``--warm N`` compiles them in N processes first, ``--skip-failed LOG`` drops
candidates whose GPU tests failed in a pytest log, ``--csv`` keeps every timing).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

try:
    import dsv41_triton  # noqa: F401
except ImportError:  # run from a checkout: python perf/bench_attention.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

from dsv41_triton.attention._configs import (GPU_CANDIDATES, LAUNCH_TABLE,  # noqa: E402
                                             ArchLaunch, KernelConfig, config_from_template,
                                             config_shape, default_config)
from dsv41_triton.attention._launch import LAST_LAUNCH  # noqa: E402
from dsv41_triton.attention.decode import sparse_mla_decode  # noqa: E402
from dsv41_triton.attention.prefill import sparse_mla_prefill  # noqa: E402
from dsv41_triton.attention.ref import sparse_mla_decode_ref, sparse_mla_prefill_ref  # noqa: E402
from dsv41_triton.ops.records import (allocate_k_cache, encode_records_ref,  # noqa: E402
                                      get_record_format, record_views)
from dsv41_triton.testing import max_abs_err, rel_err  # noqa: E402

D = 512
SETS = 4  # index sets rotated through in graph timing


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------
def fill_cache_(cache: torch.Tensor, record, gen: torch.Generator, chunk: int = 1 << 16):
    """Write a real record (random bf16 row, encoded) into every slot of ``cache``."""
    fmt = get_record_format(record)
    nb, page = cache.shape[0], cache.shape[1]
    dv, sv = record_views(cache, fmt)
    n = nb * page
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        k = torch.randn(e - s, D, device=cache.device, generator=gen).to(torch.bfloat16)
        data, scales = encode_records_ref(k, fmt)
        slots = torch.arange(s, e, device=cache.device)
        dv[slots // page, slots % page] = data
        sv[slots // page, slots % page] = scales
    return cache


@dataclass
class DecodeCase:
    T: int
    H: int
    keys: int
    q: torch.Tensor
    swa_cache: torch.Tensor
    extra_cache: torch.Tensor
    sink: torch.Tensor
    sets: List[Dict[str, torch.Tensor]]  # swa_indices, swa_lens, extra_indices, extra_lens
    out: torch.Tensor
    unique_bytes: List[int] = field(default_factory=list)

    @property
    def flops(self) -> float:
        return 4.0 * self.H * self.keys * D * self.T


def build_decode_case(T: int, H: int, *, window: int = 128, topk: int = 512, page: int = 64,
                      record: int = 584, extra_record: int = 584, num_sets: int = SETS,
                      device="cuda", seed: int = 0, caches=None) -> DecodeCase:
    """V4.1 decode step inputs (see module doc). ``caches`` = (swa, extra) to reuse big caches."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    if caches is None:
        caches = make_decode_caches(record, extra_record, page, device, seed)
    swa, extra = caches
    nb_s, nb_e = swa.shape[0], extra.shape[0]
    fs, fe = get_record_format(record), get_record_format(extra_record)
    sets, ub = [], []
    for _ in range(num_sets):
        # window: positions [L - window, L) of a request with random distinct pages
        L = torch.randint(window, window + 4 * page, (T,), device=device, generator=gen)
        blocks = torch.randint(0, nb_s, (T, (window + 4 * page) // page + 2), device=device,
                               generator=gen)
        pos = (L[:, None] - window + torch.arange(window, device=device)[None, :])
        si = (blocks.gather(1, pos // page) * page + pos % page).to(torch.int32)
        ei = torch.randint(0, nb_e * page, (T, topk), device=device, generator=gen,
                           dtype=torch.int32)
        sets.append(dict(swa_indices=si.contiguous(),
                         swa_lens=torch.full((T,), window, dtype=torch.int32, device=device),
                         extra_indices=ei,
                         extra_lens=torch.full((T,), topk, dtype=torch.int32, device=device)))
        ub.append(torch.unique(si).numel() * fs.record_bytes
                  + torch.unique(ei).numel() * fe.record_bytes + 2 * T * H * D * 2)
    q = torch.randn(T, H, D, device=device, generator=gen).to(torch.bfloat16)
    sink = torch.randn(H, device=device, generator=gen)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=device)
    return DecodeCase(T, H, window + topk, q, swa, extra, sink, sets, out, ub)


_CACHES: Dict[tuple, tuple] = {}


def make_decode_caches(record=584, extra_record=584, page=64, device="cuda", seed=0,
                       slots: int = 1 << 19):
    """Two big paged caches (``slots`` each, e.g. 2**19 x 584 B = 306 MB), every slot a real
    record; memoized."""
    key = (record, extra_record, page, str(device), slots)
    if key not in _CACHES:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 17)
        nb = slots // page
        swa = fill_cache_(allocate_k_cache(nb, page, record, device), record, gen)
        extra = fill_cache_(allocate_k_cache(nb, page, extra_record, device), extra_record, gen)
        _CACHES[key] = (swa, extra)
    return _CACHES[key]


def decode_fn(case: DecodeCase, set_idx: int = 0,
              config: Optional[KernelConfig] = None) -> Callable[[], object]:
    s = case.sets[set_idx]

    def fn():
        return sparse_mla_decode(case.q, case.swa_cache, s["swa_indices"], s["swa_lens"],
                                 case.extra_cache, s["extra_indices"], s["extra_lens"],
                                 case.sink, None, case.out, _config=config)
    return fn


@dataclass
class PrefillCase:
    T: int
    H: int
    keys: int
    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    lens: torch.Tensor
    sink: torch.Tensor
    out: torch.Tensor
    unique_bytes: int = 0

    @property
    def flops(self) -> float:
        return 4.0 * self.H * self.keys * D * self.T


def build_prefill_case(T: int = 4096, H: int = 64, *, keys: int = 640, rows: int = 8192,
                       device="cuda", seed: int = 0) -> PrefillCase:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = torch.randn(T, H, D, device=device, generator=gen).to(torch.bfloat16)
    kv = torch.randn(rows, D, device=device, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, rows, (T, keys), device=device, generator=gen, dtype=torch.int32)
    lens = torch.full((T,), keys, dtype=torch.int32, device=device)
    sink = torch.randn(H, device=device, generator=gen)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=device)
    ub = torch.unique(idx).numel() * D * 2 + 2 * T * H * D * 2
    return PrefillCase(T, H, keys, q, kv, idx, lens, sink, out, ub)


def prefill_fn(case: PrefillCase, config: Optional[KernelConfig] = None):
    def fn():
        return sparse_mla_prefill(case.q, case.kv, case.indices, case.lens, case.sink, None,
                                  case.out, _config=config)
    return fn


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------
def time_graph(fns: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Capture ``fns`` (called in turn) in one CUDA graph, replay it; us per call (median of
    ``replays`` replays)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    times.sort()
    return times[len(times) // 2]


def time_eager(fn: Callable[[], object]) -> float:
    """``triton.testing.do_bench`` median (L2 flushed before each call), us."""
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def time_decode(case: DecodeCase, config=None) -> float:
    return time_graph([decode_fn(case, i, config) for i in range(len(case.sets))])


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------
def check(device="cuda") -> List[str]:
    """Kernel vs float64 reference on small V4.1-like cases; returns failure lines."""
    bad = []
    caches = make_decode_caches(device=device, slots=1 << 14)
    for T, H in ((5, 8), (3, 64), (2, 128)):
        c = build_decode_case(T, H, num_sets=1, device=device, seed=T + H, caches=caches)
        c.sets[0]["extra_lens"][0] = 100
        c.sets[0]["extra_indices"][-1, ::7] = -1
        for cfg in (None, KernelConfig(16 if H <= 16 else 64, 32, 3, 4 if H <= 16 else 8, 2)):
            o, l = decode_fn(c, 0, cfg)()
            s = c.sets[0]
            ro, rl = sparse_mla_decode_ref(c.q, c.swa_cache, s["swa_indices"], s["swa_lens"],
                                           c.extra_cache, s["extra_indices"], s["extra_lens"],
                                           c.sink)
            e1, e2 = rel_err(o, ro), max_abs_err(l, rl)
            line = f"check decode T={T} H={H} cfg={cfg}: out rel {e1:.2e} lse abs {e2:.2e}"
            print(line)
            if not (e1 <= 1e-2 and e2 <= 1e-3):
                bad.append(line)
    for H in (8, 64):
        p = build_prefill_case(64, H, device=device, seed=H)
        o, l = prefill_fn(p)()
        ro, rl = sparse_mla_prefill_ref(p.q, p.kv, p.indices, p.lens, p.sink)
        e1, e2 = rel_err(o, ro), max_abs_err(l, rl)
        line = f"check prefill T=64 H={H}: out rel {e1:.2e} lse abs {e2:.2e}"
        print(line)
        if not (e1 <= 1e-2 and e2 <= 1e-3):
            bad.append(line)
    return bad


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------
def kernel_info() -> str:
    """Registers / spills / shared memory of the last attention kernel launched."""
    k = LAST_LAUNCH.get("fwd", (None, None))[0]
    if k is None:
        return ""
    try:
        return (f"regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}")
    except Exception:  # pragma: no cover - older/newer triton metadata
        return ""


def _fmt(name, T, H, us, case_flops, ub, extra=""):
    tf = case_flops / (us * 1e-6) / 1e12
    gbs = ub / (us * 1e-6) / 1e9
    return f"{name:8s} H={H:<4d} T={T:<5d} {us:9.1f} us {tf:7.1f} TFLOP/s {gbs:8.0f} GB/s {extra}"


# --------------------------------------------------------------------------------------------
# candidate sweep: every launch shape in GPU_CANDIDATES against the current defaults
# --------------------------------------------------------------------------------------------
#: sweep shapes, most important first: (family, H, T)
SWEEP_SHAPES = [
    ("decode", 8, 128), ("decode", 64, 128), ("prefill", 8, 4096), ("prefill", 64, 4096),
    ("decode", 8, 512), ("decode", 16, 128), ("decode", 64, 512), ("decode", 128, 128),
    ("decode", 16, 512), ("decode", 128, 512), ("prefill", 128, 4096), ("prefill", 16, 4096),
    ("decode", 8, 1), ("decode", 64, 1), ("decode", 8, 32), ("decode", 64, 32),
]


def _resident(shape) -> int:
    """Programs per SM of a launch shape (sm_90 compile, perf/NOTES.md): the 4-warp kernels
    fit two (<= 255 registers, <= 113 KB shared), the 8-warp ones one."""
    return 2 if shape[3] <= 4 else 1


def current_default(fam, T, H, keys, sms, rules: Optional[ArchLaunch] = None) -> KernelConfig:
    """``default_config`` of the sm_90 launch-table entry (or ``rules``) for ``sms`` SMs."""
    paged = fam == "decode"
    rules = rules or LAUNCH_TABLE[("cuda", (9, 0))]
    bh = rules.head_tile(T, H, paged)
    shape, resident = rules.templates[(paged, bh)]
    return config_from_template(T, H, keys, sms, shape, resident)


def sweep_plan(fam, H, T, keys, sms) -> List[tuple]:
    """[(label, KernelConfig)] for one shape: the current default first, then the candidates
    that make sense there (head tiles <= max(16, H); split counts from the default rule; for
    T=128 few-head decode also explicit split counts)."""
    plan = [("default", current_default(fam, T, H, keys, sms))]
    seen = {plan[0][1]}
    for shape in GPU_CANDIDATES[fam]:
        bh, lazy = shape[1], shape[5]
        if bh > max(16, H):
            continue  # head tile wider than the heads
        if not lazy and (T <= 32 or (H >= 64 and bh == 16)):
            continue  # few tokens / 16-head tiles for many heads: the lazy form only
        cfg = config_from_template(T, H, keys, sms, shape, _resident(shape))
        if cfg not in seen:
            plan.append(("-".join(map(str, shape)), cfg))
            seen.add(cfg)
    if fam == "decode" and H <= 16 and T == 128:
        for shape in (("group", 16, 32, 4, 3, True), ("group", 16, 64, 4, 2, True)):
            for ns in (1, 3):
                c = config_from_template(T, H, keys, sms, shape, _resident(shape))
                c = KernelConfig(c.block_h, c.block_n, ns, c.num_warps, c.num_stages,
                                 variant=c.variant, lazy_rescale=c.lazy_rescale)
                if c not in seen:
                    plan.append(("-".join(map(str, shape)) + f"-s{ns}", c))
                    seen.add(c)
    return plan


def failed_candidates(log_path: Optional[str]) -> set:
    """Candidate ids ("group-16-32-4-3-True") named in FAILED/ERROR lines of a pytest log
    (the summary lines, or the per-test lines of ``-v`` / xdist)."""
    bad = set()
    if not log_path or not os.path.exists(log_path):
        return bad
    ids = {"-".join(map(str, c)) for f in GPU_CANDIDATES.values() for c in f}
    for line in open(log_path, errors="replace"):
        if " FAILED " in f" {line}" or " ERROR " in f" {line}":
            bad |= {i for i in ids if i in line}
    return bad


def _shape_id(cfg: KernelConfig) -> str:
    return "-".join(map(str, config_shape(cfg)))


def _warm_one(task):
    """Compile (and run once) one launch on a small case with the same specialization as the
    sweep's (same H, widths, strides, split count): fills the on-disk Triton cache."""
    fam, H, cfg = task
    try:
        if fam == "decode":
            caches = make_decode_caches(device="cuda", slots=1 << 14)
            c = build_decode_case(2, H, num_sets=1, device="cuda", caches=caches)
            decode_fn(c, 0, cfg)()
        else:
            c = build_prefill_case(8, H, device="cuda")
            prefill_fn(c, cfg)()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported, the timing loop skips nothing because of it
        return f"warm {fam} H={H} {cfg}: {type(e).__name__}: {str(e)[:160]}"


def warm(tasks, procs: int):
    import concurrent.futures as cf
    import multiprocessing as mp
    if procs <= 1:
        return [r for r in map(_warm_one, tasks) if r]
    with cf.ProcessPoolExecutor(max_workers=procs, mp_context=mp.get_context("spawn")) as ex:
        return [r for r in ex.map(_warm_one, tasks) if r]


def sweep(device="cuda", deadline=None, skip=(), warm_procs=0, csv_path=None):
    """Time the current default and every sensible candidate on SWEEP_SHAPES. Returns the
    compact summary lines (one per shape: default, best, speedup)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plans = []
    for fam, H, T in SWEEP_SHAPES:
        keys = 640
        plan = [(lab, cfg) for lab, cfg in sweep_plan(fam, H, T, keys, sms)
                if _shape_id(cfg) not in skip]
        plans.append((fam, H, T, plan))
    if warm_procs:
        t0 = time.time()
        tasks, keyset = [], set()
        for fam, H, T, plan in plans:
            for _, cfg in plan:
                k = (fam, H, cfg.num_splits > 1, cfg.num_splits if cfg.num_splits % 16 == 0
                     else 0, -(-H // cfg.block_h) == 1, config_shape(cfg))
                if k not in keyset:
                    keyset.add(k)
                    tasks.append((fam, H, cfg))
        for line in warm(tasks, warm_procs):
            print(line, flush=True)
        print(f"warm: {len(tasks)} launches compiled in {time.time() - t0:.0f} s", flush=True)
    rows, summary = [], []
    for fam, H, T, plan in plans:
        if deadline and time.time() > deadline:
            summary.append(f"{fam:7s} H={H:<3d} T={T:<4d}: skipped (budget)")
            continue
        case = build_decode_case(T, H, device=device) if fam == "decode" else \
            build_prefill_case(T, H, device=device)
        ref_out, res = None, []
        for lab, cfg in plan:
            if deadline and time.time() > deadline:
                break
            try:
                if fam == "decode":
                    us = time_decode(case, cfg)
                    out = decode_fn(case, 0, cfg)()[0].clone()
                else:
                    us = time_graph([prefill_fn(case, cfg)], replays=10)
                    out = prefill_fn(case, cfg)()[0].clone()
                torch.cuda.synchronize()
            except Exception as e:
                print(f"sweep {fam} H={H} T={T} {lab}: FAILED {type(e).__name__}: "
                      f"{str(e)[:200]}", flush=True)
                continue
            info = kernel_info()
            if ref_out is None:
                ref_out = out
            agree = rel_err(out, ref_out)
            ok = agree < 1e-2
            res.append((us, lab, cfg, ok))
            ub = case.unique_bytes[0] if fam == "decode" else case.unique_bytes
            line = _fmt(f"sw-{fam[0]}", T, H, us, case.flops, ub,
                        f"{lab} s{cfg.num_splits} | {info} | vs-first {agree:.1e}"
                        f"{'' if ok else ' DISAGREES'}")
            rows.append((fam, H, T, lab, cfg.num_splits, us, info, agree))
            print(line, flush=True)
        del case
        torch.cuda.empty_cache()
        good = [r for r in res if r[3]]
        if not res:
            summary.append(f"{fam:7s} H={H:<3d} T={T:<4d}: no result")
            continue
        base = [r for r in res if r[1] == "default"]
        best = min(good or res, key=lambda r: r[0])
        o = f"{base[0][0]:8.1f}" if base else "     n/a"
        sp = f"{base[0][0] / best[0]:5.2f}x" if base else "   -"
        summary.append(f"{fam:7s} H={H:<3d} T={T:<4d} default {o} us  best {best[0]:8.1f} us "
                       f"{sp}  {best[1]} s{best[2].num_splits}")
    if csv_path:
        with open(csv_path, "w") as f:
            f.write("family,heads,tokens,label,splits,us,kernel,agree\n")
            for r in rows:
                f.write(",".join(str(x).replace(",", ";") for x in r) + "\n")
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="try launch configs on key shapes")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-eager", action="store_true", help="skip do_bench eager timings")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds before skipping work")
    ap.add_argument("--sweep-only", action="store_true", help="only the candidate sweep")
    ap.add_argument("--skip-failed", default=None,
                    help="pytest log: candidates named in its FAILED/ERROR lines are skipped")
    ap.add_argument("--warm", type=int, default=0,
                    help="processes that compile the sweep's kernels before timing")
    ap.add_argument("--csv", default=None, help="write every sweep timing here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; nothing to time")
        return 0
    t0 = time.time()
    deadline = t0 + args.budget
    dev = "cuda"
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}", flush=True)
    skip = failed_candidates(args.skip_failed)
    if skip:
        print("skipping candidates that failed their GPU tests:", sorted(skip), flush=True)
    if args.sweep_only:
        lines = sweep(dev, deadline, skip, args.warm, args.csv)
        print(f"\n==== sweep summary ({time.time() - t0:.0f} s; us, CUDA graph) ====")
        for line in lines:
            print(line)
        return 0
    bad = [] if args.no_check else check(dev)
    sweep_lines = sweep(dev, deadline, skip, args.warm, args.csv) if args.sweep else []
    table = []
    heads = (8, 16, 64, 128)
    tokens = (1, 32, 128) if args.quick else (1, 8, 32, 128, 512)
    for H in heads:
        for T in tokens:
            if time.time() > deadline:
                table.append(f"decode   H={H} T={T}: skipped (budget)")
                continue
            case = build_decode_case(T, H, device=dev)
            cfg = default_config(T, H, case.keys, torch.device(dev), paged=True)
            us = time_decode(case)
            extra = (f"graph; {cfg.block_h}x{cfg.block_n} s{cfg.num_splits} w{cfg.num_warps} "
                     f"st{cfg.num_stages} {kernel_info()}")
            if not args.no_eager:
                extra += f"; eager {time_eager(decode_fn(case)):.1f} us"
            table.append(_fmt("decode", T, H, us, case.flops, case.unique_bytes[0], extra))
            print(table[-1], flush=True)
            del case
    for H in heads:
        if time.time() > deadline:
            table.append(f"prefill  H={H}: skipped (budget)")
            continue
        case = build_prefill_case(4096, H, device=dev)
        us = time_graph([prefill_fn(case)], replays=10)
        cfg = default_config(4096, H, case.keys, torch.device(dev), paged=False)
        extra = (f"graph; {cfg.block_h}x{cfg.block_n} s{cfg.num_splits} w{cfg.num_warps} "
                 f"st{cfg.num_stages} {kernel_info()}")
        if not args.no_eager:
            extra += f"; eager {time_eager(prefill_fn(case)):.1f} us"
        table.append(_fmt("prefill", 4096, H, us, case.flops, case.unique_bytes, extra))
        print(table[-1], flush=True)
        del case
    print("\n==== summary (" + f"{time.time() - t0:.0f} s) ====")
    for line in sweep_lines:
        print(line)
    for line in table:
        print(line)
    if bad:
        print("CHECK FAILURES:")
        for line in bad:
            print("  " + line)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
