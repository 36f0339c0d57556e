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

Measured on the lent H200 (triton 3.6, CUDA graph, us; FlashMLA from PERF-NOTES.md):
decode 8 heads, 1/8/32/128/512 tokens: 16.7 / 19.9 / 31.6 / 83.0 / 267.2 (vLLM Triton 13.3 /
- / 35.0 / 111.5 / 422.3); 64 heads with 64x64 tiles, 128 / 512 tokens: 126 / 477 (FlashMLA
48.5 / 173.6); prefill 4096 x 640, 8 / 64 / 128 heads: 739 / 1556 / 3089 (FlashMLA 64 / 128
heads: 659.5 / 1274).
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

from dsv41_triton.attention._kernels import LAST_LAUNCH, KernelConfig, default_config  # noqa: E402
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


DECODE_SWEEP = {
    # (H, T): configs to try (block_h, block_n, num_splits, warps, stages);
    # num_splits 0 = the default heuristic's count for that block shape
    (8, 128): [(16, 32, 2, 4, 3), (16, 32, 3, 4, 3), (16, 64, 2, 4, 3), (16, 32, 2, 8, 3)],
    (8, 1): [(16, 32, 10, 4, 3), (16, 32, 20, 4, 3)],
    (64, 1): [(64, 32, 20, 8, 2), (16, 32, 20, 4, 3), (32, 32, 20, 4, 2)],
    (64, 32): [(64, 64, 4, 8, 2), (64, 32, 4, 8, 2), (16, 32, 2, 4, 3), (32, 32, 2, 4, 2)],
    (64, 128): [(64, 64, 1, 8, 2), (64, 32, 1, 8, 2), (64, 64, 1, 8, 3), (32, 32, 1, 4, 2)],
    (128, 128): [(64, 64, 1, 8, 2), (64, 32, 1, 8, 2)],
}
PREFILL_SWEEP = {
    8: [(16, 32, 1, 4, 3), (16, 64, 1, 4, 3), (16, 128, 1, 4, 2)],
    64: [(64, 64, 1, 8, 2), (64, 32, 1, 8, 3)],
}


def _cfg(t, T, H, keys, device):
    bh, bn, ns, w, st = t
    if ns == 0:  # the default heuristic's split count for this block shape
        ns = default_config(T, H, keys, torch.device(device), paged=True, block_h=bh,
                            block_n=bn).num_splits
    return KernelConfig(bh, bn, ns, w, st)


def sweep(device="cuda", deadline=None):
    lines = []
    for (H, T), cfgs in DECODE_SWEEP.items():
        case = build_decode_case(T, H, device=device)
        for t in cfgs:
            if deadline and time.time() > deadline:
                break
            cfg = _cfg(t, T, H, case.keys, device)
            try:
                us = time_decode(case, cfg)
            except Exception as e:  # a config that does not compile / fit: report, go on
                lines.append(f"sweep decode H={H} T={T} {cfg}: FAILED {type(e).__name__}: "
                             f"{str(e)[:200]}")
                print(lines[-1], flush=True)
                continue
            lines.append(_fmt("sweep-d", T, H, us, case.flops, case.unique_bytes[0],
                              f"{cfg} {kernel_info()}"))
            print(lines[-1], flush=True)
    for H, cfgs in PREFILL_SWEEP.items():
        case = build_prefill_case(4096, H, device=device)
        for t in cfgs:
            if deadline and time.time() > deadline:
                break
            cfg = _cfg(t, 4096, H, case.keys, device)
            try:
                us = time_graph([prefill_fn(case, cfg)], replays=10)
            except Exception as e:
                lines.append(f"sweep prefill H={H} {cfg}: FAILED {type(e).__name__}: "
                             f"{str(e)[:200]}")
                print(lines[-1], flush=True)
                continue
            lines.append(_fmt("sweep-p", 4096, H, us, case.flops, case.unique_bytes,
                              f"{cfg} {kernel_info()}"))
            print(lines[-1], flush=True)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="try launch configs on key shapes")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-eager", action="store_true", help="skip do_bench eager timings")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds before skipping work")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device; nothing to time")
        return 0
    t0 = time.time()
    deadline = t0 + args.budget
    dev = "cuda"
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}", flush=True)
    bad = [] if args.no_check else check(dev)
    sweep_lines = sweep(dev, deadline) if args.sweep else []
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
