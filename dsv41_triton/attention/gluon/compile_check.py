"""Compile the Gluon decode kernels for an sm_90 target without a GPU (``triton.compile``).

``compile_decode(SRC_A, SRC_B, BH, ...)`` (``BH = 64``: the many-heads kernel of
``decode_heads.py``, 8 warps) returns the compiled kernel (``.asm['sass'|'ptx']``,
``.n_regs`` is unset without a driver: read registers with ``cuobjdump`` from ``.asm['cubin']``).
Used by the CPU compile-only test and by ``python -m dsv41_triton.attention.gluon.compile_check``.
"""
from __future__ import annotations

import sys


def _decode_args(idx_dtype: str = "i32"):
    """(name, type) of the decode kernels' shared arguments (``_launch.kernel_args`` + H,
    scale, splits, head tiles)."""
    return [
        ("q_ptr", "*bf16"), ("stride_qt", "i64"), ("stride_qh", "i64"),
        ("a_ptr", "*u8"), ("a_idx_ptr", f"*{idx_dtype}"), ("a_idx_st", "i64"),
        ("a_len_ptr", "*i32"), ("a_len_st", "i64"), ("a_width", "i32"), ("a_bstride", "i64"),
        ("a_page", "i32"), ("a_rows", "i32"),
        ("b_ptr", "*u8"), ("b_idx_ptr", f"*{idx_dtype}"), ("b_idx_st", "i64"),
        ("b_len_ptr", "*i32"), ("b_len_st", "i64"), ("b_width", "i32"), ("b_bstride", "i64"),
        ("b_page", "i32"), ("b_rows", "i32"),
        ("sink_ptr", "*fp32"), ("sink_st", "i64"),
        ("out_ptr", "*bf16"), ("stride_ot", "i64"), ("stride_oh", "i64"),
        ("lse_ptr", "*fp32"), ("stride_lt", "i64"), ("stride_lh", "i64"),
        ("po_ptr", "*fp32"), ("pl_ptr", "*fp32"),
        ("H", "i32"), ("qk_scale", "fp32"), ("num_splits", "i32"), ("num_ht", "i32"),
    ]


#: integer arguments assumed 16-divisible when no launch values are given
_DECODE_ALIGNED = ("a_bstride", "b_bstride", "stride_qt", "stride_qh")


def compile_decode(src_a: int = 584, src_b: int = 584, bh: int = 8, split: bool = False,
                   has_b: bool = True, ns: int = 3, arch: int = 90, nw: int = 4,
                   overlap: bool = True, f16: bool = False, ws: bool = False, nt: int = 0,
                   ahead: int = 1, deq_prefetch: bool = False, values: dict | None = None,
                   prior: bool = False, persist: bool = False, mode: int = 0,
                   ds: bool = False, ds_f16: bool = False, ds_split: int = 0):
    """``nt > 0`` with ``bh < 64``: the warp-specialized few-heads kernel (decode_few_ws.py)
    with ``nt`` key tiles and ``ns`` ring stages; ``ahead``: the warp-specialized kernels'
    ``IDX_AHEAD`` (their producer's slot-id lead in blocks); ``deq_prefetch`` / ``prior`` /
    ``persist`` / ``mode``: the few-heads ws kernel's ``DEQ_PREFETCH`` / ``PRIOR`` /
    ``PERSIST`` / ``MODE``; ``ds``: its dequant + S form (decode_few_ds.py, persistent, 8-head
    tiles, two stages and tiles; ``mode`` its ``MODE``, ``ds_f16`` its ``F16``);
    ``values`` (argument name -> int): specialized on a launch's integer arguments, as on the
    GPU (``_specialize``; ``compile_launch`` compiles what ``launch.launch`` actually
    passes)."""
    consts = dict(SRC_A=src_a, SRC_B=src_b, HAS_B=has_b, HAS_LEN_A=True, HAS_LEN_B=True,
                  HAS_SINK=True, SPLIT=split)
    if bh == 64 and ws:
        from .decode_heads import NW
        from .decode_heads_ws import _sparse_mla_decode_heads_ws_kernel as kern
        nw = NW.value
        consts.update(NS=ns, IDX_AHEAD=ahead)
    elif bh == 64:
        from .decode_heads import NW
        nw = NW.value
        from .decode_heads import _sparse_mla_decode_heads_kernel as kern
        consts.update(NS=ns, OVERLAP=overlap)
    elif nt or ds:
        from .decode_few_ws import MMA_WARPS, _sparse_mla_decode_few_ws_kernel as kern
        consts.update(BH=bh, IDX_AHEAD=ahead, DEQ_PREFETCH=deq_prefetch, PRIOR=prior)
        if ds:
            from .decode_few_ds import _sparse_mla_decode_few_ds_kernel as kern
            consts.update(MODE=mode, F16=ds_f16, FREE_SPLIT=ds_split)
        else:
            consts.update(NS=ns, NT=nt, PERSIST=persist, MODE=mode)
        return _compile(kern, _decode_args() + [("num_items", "i32")], _DECODE_ALIGNED, values,
                        consts, MMA_WARPS.value, arch)
    else:
        from .decode import _sparse_mla_decode_gluon_kernel as kern
        consts.update(BH=bh, NS=ns, NW=nw, F16=f16)
    return _compile(kern, _decode_args(), _DECODE_ALIGNED, values, consts, nw, arch)


#: the modules and names of the kernels ``launch.launch`` (decode) and
#: ``prefill_launch.launch`` start
_DECODE_KERNELS = (("decode", "_sparse_mla_decode_gluon_kernel"),
                   ("decode_few_ws", "_sparse_mla_decode_few_ws_kernel"),
                   ("decode_few_ds", "_sparse_mla_decode_few_ds_kernel"),
                   ("decode_heads", "_sparse_mla_decode_heads_kernel"),
                   ("decode_heads_ws", "_sparse_mla_decode_heads_ws_kernel"))
_PREFILL_KERNELS = (("prefill", "_sparse_mla_prefill_gluon_kernel"),
                    ("prefill_ws", "_sparse_mla_prefill_gluon_ws_kernel"),
                    ("prefill_wsp", "_sparse_mla_prefill_gluon_wsp_kernel"),
                    ("prefill_few", "_sparse_mla_prefill_gluon_few_kernel"),
                    ("prefill_few", "_sparse_mla_prefill_gluon_few_sync_kernel"),
                    ("prefill_few_movm", "_sparse_mla_prefill_gluon_few_movm_kernel"))


class _Recorder:
    """Stands in for a Gluon kernel: ``kernel[grid](*args, **kwargs)`` appends the launch to
    ``log`` instead of running it."""

    def __init__(self, name: str, real, log: list):
        self.name, self.real, self.log = name, real, log

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(dict(kernel=self.name, real=self.real, grid=tuple(grid), args=args,
                                 kwargs=kwargs))
            return None
        return run


def _recording(kernels, sms: int, run) -> list:
    """``run()`` with ``kernels`` (module, name) replaced by recorders, the launch modules' SM
    count and capability queries answering ``sms`` and sm_90, their gate open wherever the
    kernels compile (``COMPILABLE``), and the split merge a no-op; everything restored after.
    Returns the recorded launches."""
    import importlib

    from .. import _launch
    from . import COMPILABLE
    from . import launch as gl_launch
    from . import prefill_launch as pf_launch

    log, saved = [], []
    for m, name in kernels:
        mod = importlib.import_module(f"{__package__}.{m}")
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, _Recorder(f"{m}.{name}", getattr(mod, name), log))
    fakes = {"_sms": lambda device: sms, "_cap": lambda device: (9, 0), "AVAILABLE": COMPILABLE}
    for mod in (gl_launch, pf_launch):
        for name, fake in fakes.items():
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, fake)
    saved.append((_launch, "merge_splits", _launch.merge_splits))
    _launch.merge_splits = lambda *a, **k: None
    try:
        run()
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)
    return log


def capture_decode(T: int, H: int, src_a: int, src_b: int, shape: str = "", W: int = 128,
                   K: int = 512, page: int = 64, sms: int = 132, prior: bool = False,
                   persist: bool | None = None, ds: bool | None = None,
                   form: dict | None = None) -> list:
    """The kernel launches ``launch.launch`` makes for a decode of ``T`` tokens x ``H`` heads
    (``W`` window slot ids of ``src_a`` records, ``K`` extra ones of ``src_b`` (0: none), lens
    and a sink; caches of ``perf/bench_decode_hopper.py``'s sizes) on an sm_90 GPU of ``sms``
    SMs, at launch shape ``shape`` (empty: the pick table's), merging a prior partial with
    ``prior``, on the few-heads ws kernel's persistent grid with ``persist`` True, on its
    per-item grid with False (at the pick table's shape when ``shape`` is empty), on the
    launch's default grid with None; ``ds``: its dequant + S form forced on / off
    (``launch.FEW_DS``; None: the default); ``form``: more override keys of that form
    (``ds_f16``, ``ds_split``, ``ds_ahead``; absent: the defaults). Runs on the CPU
    (``_recording``). Each launch: ``{kernel, real, grid, args, kwargs}``."""
    import torch

    from ...ops.records import allocate_k_cache
    from ..decode import _keyset
    from . import launch as gl_launch

    def keys(nb, src, n):
        ids = torch.zeros(T, n, dtype=torch.int32)
        return _keyset(allocate_k_cache(nb, page, src), ids,
                       torch.full((T,), n, dtype=torch.int32))

    def run():
        over = dict(gl_launch.OVERRIDE)
        try:
            a = keys(3 * T + 8, src_a, W)
            b = keys(max(2048, 8 * T), src_b, K) if src_b else None
            pick = shape
            if not pick and persist is not None:  # forcing persist keeps the pick's shape
                pick = gl_launch.table_shape(T, H, a, b, torch.device("cuda")) or ""
            gl_launch.OVERRIDE.clear()
            gl_launch.OVERRIDE.update(gl_launch.parse_shape(pick))
            if persist is not None:
                gl_launch.OVERRIDE["persist"] = bool(persist)
            if ds is not None:
                gl_launch.OVERRIDE["ds"] = bool(ds)
            gl_launch.OVERRIDE.update(form or {})
            q = torch.empty(T, H, 512, dtype=torch.bfloat16)
            lse = torch.empty(T, H, dtype=torch.float32)
            gl_launch.launch(q, a, b, torch.zeros(H), 512 ** -0.5, torch.empty_like(q), lse,
                             prior=prior)
        finally:
            gl_launch.OVERRIDE.clear()
            gl_launch.OVERRIDE.update(over)
    return _recording(_DECODE_KERNELS, sms, run)


def capture_prefill(T: int, H: int, S: int, K: int, variant: str = "",
                    has_len: bool = False, sms: int = 132) -> list:
    """The kernel launches ``prefill_launch.launch`` makes for ``T`` tokens x ``H`` heads x
    ``K`` ids into an ``S``-row bf16 workspace (a sink; lens with ``has_len``; variant
    ``variant``, empty: the pick table's) on an sm_90 GPU of ``sms`` SMs, on the CPU."""
    import torch

    from . import prefill_launch as pf_launch

    def run():
        q = torch.empty(T, H, 512, dtype=torch.bfloat16)
        lens = torch.full((T,), K, dtype=torch.int32) if has_len else None
        pf_launch.launch(q, torch.empty(S, 512, dtype=torch.bfloat16),
                         torch.zeros(T, K, dtype=torch.int32), lens, torch.zeros(H),
                         512 ** -0.5, torch.empty_like(q), torch.empty(T, H), variant or None)
    return _recording(_PREFILL_KERNELS, sms, run)


_PTR = {"torch.bfloat16": "*bf16", "torch.uint8": "*u8", "torch.int32": "*i32",
        "torch.int64": "*i64", "torch.float32": "*fp32"}


#: launch options a recorded launch may pass besides ``num_warps`` (not kernel parameters)
LAUNCH_OPTIONS = ("maxnreg",)


def launch_signature(rec: dict):
    """``(args, values, constexprs, num_warps)`` of one recorded launch for ``_compile``:
    every positional argument typed from what the launch passes (tensors as pointers of their
    dtype, integers to be specialized on their values, floats fp32), the keyword constexprs as
    given (``LAUNCH_OPTIONS`` left out). Raises ``ValueError`` when the launch's arguments do
    not match the kernel's parameters (a wiring fault the CPU otherwise never sees)."""
    import torch
    kern = rec["real"]
    kw = {k: v for k, v in rec["kwargs"].items() if k not in LAUNCH_OPTIONS}
    num_warps = kw.pop("num_warps")
    const = {p.name for p in kern.params if p.is_constexpr}
    free = [p.name for p in kern.params if not p.is_constexpr]
    if len(rec["args"]) != len(free):
        raise ValueError(f"{rec['kernel']}: {len(rec['args'])} positional arguments for "
                         f"{len(free)} parameters ({free})")
    unknown = set(kw) - const
    missing = {p.name for p in kern.params
               if p.is_constexpr and not p.has_default and p.name not in kw}
    if unknown or missing:
        raise ValueError(f"{rec['kernel']}: constexprs {sorted(unknown)} unknown, "
                         f"{sorted(missing)} missing")
    args, values = [], {}
    for name, v in zip(free, rec["args"]):
        if isinstance(v, torch.Tensor):
            args.append((name, _PTR[str(v.dtype)]))
        elif isinstance(v, float):
            args.append((name, "fp32"))
        else:
            args.append((name, "i64"))
            values[name] = int(v)
    return args, values, kw, num_warps


def compile_launch(rec: dict, arch: int = 90):
    """One recorded launch compiled as the GPU builds it (``launch_signature``; the
    integers specialized by ``_specialize``)."""
    args, values, consts, num_warps = launch_signature(rec)
    return _compile(rec["real"], args, (), values, consts, num_warps, arch,
                    maxnreg=rec["kwargs"].get("maxnreg"))


def resource_usage(k, flag: str = "--dump-resource-usage") -> str:
    """``cuobjdump --dump-resource-usage`` (or ``flag``, e.g. ``-sass``) of a compiled
    kernel's cubin (registers, smem)."""
    import os
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
        path = f.name
    try:
        return subprocess.run([tool, flag, path], capture_output=True,
                              text=True).stdout
    finally:
        os.unlink(path)


def _regs_stack(k) -> tuple:
    """(registers, stack bytes) of a compiled kernel from ``cuobjdump``; -1 where absent."""
    use = resource_usage(k)
    regs = [ln.split("REG:")[1].split()[0] for ln in use.splitlines() if "REG:" in ln]
    stack = [ln.split("STACK:")[1].split()[0] for ln in use.splitlines() if "STACK:" in ln]
    return int(regs[0]) if regs else -1, int(stack[0]) if stack else -1


def loop_sass(k, contains: str = "") -> dict:
    """SASS of the kernel's main loop (``cuobjdump -sass``): ``loop`` = instructions from the
    target of the longest backward branch to that branch (``contains``: of the shortest one
    whose body holds that opcode, e.g. ``HGMMA`` / ``LDGSTS`` for the consumer / producer loop
    of a warp-specialized kernel), ``branches`` = (then, else) instruction counts of the if/else
    diamonds inside it, largest first (a block runs one side of each: per-block count = ``loop``
    minus the side not taken), ``bar_sync`` = CTA / named barriers in it, ``ops`` = opcode
    counts."""
    import collections
    import re

    text = resource_usage(k, "-sass")
    rows = [(int(m.group(1), 16), m.group(2))
            for m in re.finditer(r"/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;", text)]
    at = {a: i for i, (a, _) in enumerate(rows)}
    back = [(a - int(m.group(1), 16), int(m.group(1), 16), a) for a, ins in rows
            for m in [re.search(r"BRA (0x[0-9a-f]+)", ins)] if m and int(m.group(1), 16) < a]
    if contains:
        back = [(-n, lo, hi) for n, lo, hi in back
                if any(contains in ins for a, ins in rows if lo <= a <= hi)]
    if not back:
        return {"loop": 0, "branches": [], "spill_ld_st": 0, "bar_sync": 0, "ops": {}}
    _, lo, hi = max(back)
    body = [(a, ins) for a, ins in rows if lo <= a <= hi]
    branches = []
    for a, ins in body:
        m = re.match(r"@!?P\d BRA (0x[0-9a-f]+)", ins)
        x = int(m.group(1), 16) if m else None
        if x in at and at[x] > 0:
            m2 = re.match(r"BRA (0x[0-9a-f]+)", rows[at[x] - 1][1])
            if m2 and int(m2.group(1), 16) > x:
                branches.append(((x - a) // 16 - 1, (int(m2.group(1), 16) - x) // 16))
    ops = collections.Counter(re.sub(r"^@!?U?P\w+ ", "", ins).split()[0].split(".")[0]
                              for _, ins in body)
    return {"loop": len(body), "branches": sorted(branches, key=lambda b: -max(b)),
            "spill_ld_st": ops.get("LDL", 0) + ops.get("STL", 0),
            "bar_sync": sum("BAR.SYNC" in ins for _, ins in body),
            "ops": dict(ops.most_common(12))}


def _setmaxnreg(ptx: str) -> list:
    """The distinct ``setmaxnreg`` requests of a PTX text as ``"inc 224"`` / ``"dec 48"``."""
    import re
    return sorted(set(" ".join(m) for m in
                      re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)))


def summary(src_a: int, src_b: int, bh: int, split: bool, nw: int = 4, ns: int = 3,
            overlap: bool = True, f16: bool = False, ws: bool = False) -> dict:
    """Facts of one compile: wgmma / cp.async present in the PTX, shared memory, registers,
    stack bytes (spills) and CTA barriers in the SASS (``overlap``: the many-heads kernel's
    variant; ``ws``: its warp-specialized kernel, with the ``setmaxnreg`` requests and the
    consumer / producer loops' SASS, ``loop_sass``); ``f16_mma`` / ``e4m3_cvt``: fp16 wgmma and
    the e4m3 -> f16x2 ``cvt`` in the PTX."""
    k = compile_decode(src_a, src_b, bh, split, nw=nw, ns=ns, overlap=overlap, f16=f16, ws=ws)
    ptx = k.asm["ptx"]
    regs, stack = _regs_stack(k)
    sass = resource_usage(k, "-sass")
    out = {"wgmma": "wgmma.mma_async" in ptx, "cp_async": "cp.async" in ptx,
           "shared": int(k.metadata.shared), "regs": regs,
           "stack": stack, "bar_sync": sass.count("BAR.SYNC"),
           "wgmma_ptx": ptx.count("wgmma.mma_async"),
           "f16_mma": ".f32.f16.f16" in ptx, "e4m3_cvt": "cvt.rn.f16x2.e4m3x2" in ptx}
    if ws:
        out["setmaxnreg"] = _setmaxnreg(ptx)
        for name, op in (("consumer", "HGMMA"), ("producer", "LDGSTS")):
            lp = loop_sass(k, op)
            out[name] = {key: lp[key] for key in ("loop", "branches", "spill_ld_st", "bar_sync")}
    return out


_PREFILL_ARGS = (
    ("q_ptr", "*bf16"), ("stride_qt", "i64"), ("stride_qh", "i64"),
    ("kv_ptr", "*bf16"), ("kv_stride", "i64"), ("rows", "i64"),
    ("idx_ptr", "*i32"), ("idx_st", "i64"), ("width", "i32"), ("len_ptr", "*i32"),
    ("len_st", "i64"), ("sink_ptr", "*fp32"), ("sink_st", "i64"),
    ("out_ptr", "*bf16"), ("stride_ot", "i64"), ("stride_oh", "i64"),
    ("lse_ptr", "*fp32"), ("stride_lt", "i64"), ("stride_lh", "i64"),
    ("H", "i32"), ("qk_scale", "fp32"), ("num_ht", "i32"),
)


def kernel_constexprs(kern, consts: dict) -> dict:
    """``consts`` completed with ``kern``'s constexpr defaults (a compile from a bare
    signature would bind an omitted one to None, not to its default), in the order of the
    kernel's parameters."""
    given = {p.name: p.default for p in kern.params if p.is_constexpr and p.has_default}
    given.update(consts)
    unknown = set(given) - {p.name for p in kern.params if p.is_constexpr}
    if unknown:
        raise ValueError(f"constexprs {sorted(unknown)} are not parameters of the kernel")
    return {p.name: given[p.name] for p in kern.params if p.name in given}


def _compile(kern, args, aligned, values, consts: dict, num_warps: int, arch: int,
             maxnreg: int | None = None):
    """``kern`` compiled for ``sm_<arch>`` with the ``(name, type)`` arguments ``args``
    (specialized by ``_specialize``) followed by the constexprs ``consts`` and the kernel's
    defaults of those it omits (``kernel_constexprs``); ``maxnreg``: the launch's register
    cap, as the ``maxnreg=`` launch option sets it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, constexprs, attrs = _specialize(args, aligned, values)
    for k, v in kernel_constexprs(kern, consts).items():
        sig[k] = "constexpr"
        constexprs[(list(sig).index(k),)] = v
    src = GluonASTSource(kern, sig, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _specialize(args, aligned, values):
    """``(signature, constexprs, attrs)`` of ``args`` (name, type) pairs. Without ``values``:
    the given types, 16-byte divisibility for the ``aligned`` names. With ``values`` (name ->
    the int a launch passes): each such argument typed and specialized as Triton's launcher
    does for that value (1: a constant; an i32 or i64 by range; a multiple of 16: divisible),
    so the compile is the one a GPU launch of that shape makes."""
    values = values or {}
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        def spec(v):
            return native_specialize_impl(BaseBackend, v, False, True, True)
    except ImportError:  # another Triton: the same rules by hand
        def spec(v):
            if v == 1:
                return "constexpr", 1
            return ("i32" if -2**31 <= v < 2**31 else "i64"), ("D" if v % 16 == 0 else "")
    sig, consts, attrs = {}, {}, {}
    for i, (name, ty) in enumerate(args):
        sig[name] = ty
        if name in values:
            ty, key = spec(int(values[name]))
            sig[name] = ty
            if ty == "constexpr":
                consts[(i,)] = key
            elif key == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif ty.startswith("*") or name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def compile_prefill(lazy: bool = True, has_len: bool = True, has_sink: bool = True,
                    arch: int = 90, ws: bool = False, variant: str = "",
                    values: dict | None = None):
    """The Gluon prefill kernel compiled for ``sm_<arch>`` (no GPU needed): ``variant`` "ws"
    (or ``ws=True``: the warp-specialized one), "wsp" (the persistent warp-specialized one),
    else ``prefill.py``'s (``lazy`` picks its rescale); ``values`` (argument name -> int):
    specialized on a launch's integer arguments, as on the GPU (``_specialize``;
    ``compile_launch`` compiles what ``prefill_launch.launch`` actually passes)."""
    variant = variant or ("ws" if ws else "")
    args = _PREFILL_ARGS
    if variant == "wsp":
        from .prefill_wsp import NUM_WARPS, _sparse_mla_prefill_gluon_wsp_kernel as kern
        args = _PREFILL_ARGS + (("num_items", "i32"),)
    elif variant == "ws":
        from .prefill_ws import NUM_WARPS, _sparse_mla_prefill_gluon_ws_kernel as kern
    else:
        from .prefill import NUM_WARPS, _sparse_mla_prefill_gluon_kernel as kern

    consts = dict(HAS_LEN=has_len, HAS_SINK=has_sink, LAZY=lazy)
    return _compile(kern, args, ("stride_qt", "stride_qh", "kv_stride"), values, consts,
                    NUM_WARPS, arch)


def sass_instructions(k) -> list:
    """The kernel's SASS (``cuobjdump -sass``) as ``(address, instruction, write scoreboard,
    wait mask)`` rows: each 128-bit instruction's top 23 bits (the second printed word's top
    bits) hold its stall, yield, write / read scoreboard (7: none) and wait mask."""
    import re

    text = resource_usage(k, "-sass").splitlines()
    rows = []
    for i, line in enumerate(text[:-1]):
        m = re.match(r"\s*/\*([0-9a-f]{4,6})\*/\s+(.*?)\s*;\s*/\* (0x[0-9a-f]+) \*/", line)
        m2 = re.search(r"^\s*/\* (0x[0-9a-f]+) \*/\s*$", text[i + 1])
        if m and m2:
            ctrl = int(m2.group(1), 16) >> 41
            rows.append((int(m.group(1), 16), m.group(2), (ctrl >> 5) & 7, (ctrl >> 11) & 0x3F))
    return rows


def sass_op_counts(k) -> dict:
    """SASS opcode counts of a compiled kernel (the opcode up to its first dot; predicates
    skipped), e.g. ``{"HMMA": 8, "MOVM": 16, ...}`` (a ``collections.Counter``)."""
    import collections
    import re
    out = collections.Counter()
    for line in resource_usage(k, "-sass").splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m and ";" in line:
            out[m.group(1)] += 1
    return out


def loops_sass(k, rows: list | None = None) -> list:
    """Every loop of the kernel's SASS (``sass_instructions``, or its ``rows``; a
    warp-specialized kernel has one or two per partition), innermost first by address:
    ``(start, size, counts)`` with ``counts`` = instructions, ``BAR.SYNC`` (named barriers),
    ``HGMMA``, ``LDGSTS``, mbarrier waits (``SYNCS.PHASECHK``) and arrives (``SYNCS.ARRIVE`` +
    ``ARRIVES``), ``LDL``/``STL``."""
    import re

    rows = sass_instructions(k) if rows is None else rows
    op = [re.sub(r"^@!?U?P\w+ ", "", r[1]).split()[0] for r in rows]
    out = []
    for j, (a, ins, _, _) in enumerate(rows):
        # a loop's latch: a predicated backward branch (the mbarrier try-wait retry stubs
        # branch back to themselves, then jump back unpredicated)
        m = re.match(r"@!?P\d BRA (0x[0-9a-f]+)", ins)
        if not m or int(m.group(1), 16) >= a or "PHASECHK" in rows[j - 1][1]:
            continue
        lo = int(m.group(1), 16)
        body = [o for r, o in zip(rows, op) if lo <= r[0] <= a]
        out.append({"start": hex(lo), "end": hex(a), "instructions": len(body),
                    "bar_sync": sum(o.startswith("BAR.SYNC") for o in body),
                    "hgmma": sum(o.startswith("HGMMA") for o in body),
                    "ldgsts": sum(o.startswith("LDGSTS") for o in body),
                    "mbar_wait": sum(o.startswith("SYNCS.PHASECHK") for o in body),
                    "mbar_arrive": sum(o.startswith(("SYNCS.ARRIVE", "ARRIVES")) for o in body),
                    "local_ld_st": sum(o.startswith(("LDL", "STL")) for o in body)})
    return out


def loop_op_counts(k) -> list:
    """``loops_sass`` of the kernel with each loop's SASS opcode counts (the opcode up to its
    first dot) as ``ops``."""
    import collections
    import re

    rows = sass_instructions(k)
    out = []
    for lp in loops_sass(k, rows):
        lo, hi = int(lp["start"], 16), int(lp["end"], 16)
        ops = collections.Counter(re.sub(r"^@!?U?P\w+ ", "", ins).split()[0].split(".")[0]
                                  for a, ins, _, _ in rows if lo <= a <= hi)
        out.append({**lp, "ops": dict(ops)})
    return out


def early_load_waits(k, window: int = 40, rows: list | None = None) -> list:
    """Global loads (``LDG``) of the kernel's SASS (``sass_instructions``, or its ``rows``)
    that an instruction at most ``window`` instructions later waits on (the load's write
    scoreboard in that instruction's wait mask), i.e. loads whose latency is exposed where
    they are issued: ``{"addr", "op", "waited_by", "distance", "loops"}`` with ``loops`` the
    ``loops_sass`` entries (their ``start``) that contain the load."""
    import re

    rows = sass_instructions(k) if rows is None else rows
    loops = [(int(lp["start"], 16), int(lp["end"], 16), lp["start"])
             for lp in loops_sass(k, rows)]
    out = []
    for j, (addr, op, wbar, _) in enumerate(rows):
        if wbar == 7 or not re.match(r"(@!?P\w+ )?LDG\.", op):
            continue
        for d, (_, later, _, wait) in enumerate(rows[j + 1:j + 1 + window], 1):
            if wait >> wbar & 1:
                out.append({"addr": hex(addr), "op": op, "waited_by": later, "distance": d,
                            "loops": [st for lo, hi, st in loops if lo <= addr <= hi]})
                break
    return out


def summary_few_ws(src_a: int, src_b: int, split: bool, bh: int = 8, ahead: int = 1,
                   deq_prefetch: bool = False, has_b: bool = True, prior: bool = False) -> dict:
    """Facts of one compile of the warp-specialized few-heads kernel (``decode_few_ws.py``,
    ``bh``-head tiles, two ring stages, two key tiles, slot ids ``ahead`` blocks ahead): wgmma /
    cp.async / mbarrier in the PTX, shared memory, registers, stack bytes, ``setmaxnreg``
    requests and the loops (``loops_sass``); ``deq_prefetch`` / ``has_b`` / ``prior``:
    ``DEQ_PREFETCH`` / ``HAS_B`` / ``PRIOR``."""
    k = compile_decode(src_a, src_b, bh, split, has_b=has_b, ns=2, nt=2, ahead=ahead,
                       deq_prefetch=deq_prefetch, prior=prior)
    ptx = k.asm["ptx"]
    regs, stack = _regs_stack(k)
    return {"wgmma": "wgmma.mma_async" in ptx, "cp_async": "cp.async" in ptx,
            "mbarrier": "mbarrier" in ptx, "shared": int(k.metadata.shared), "regs": regs,
            "stack": stack, "setmaxnreg": _setmaxnreg(ptx), "loops": loops_sass(k)}


def summary_prefill(lazy: bool = True, ws: bool = False, variant: str = "") -> dict:
    """Facts of one prefill compile: wgmma / cp.async in the PTX, shared memory, registers,
    stack bytes, named barriers (``BAR.SYNC``), local stores (``STL``), ``HGMMA`` and wgmma
    waits (``WARPGROUP.DEPBAR``: one after every ``HGMMA`` when ptxas serialized them) in the
    SASS, the loops (``loops_sass``), and ``setmaxnreg`` (the partitions' register budgets of
    the warp-specialized kernels)."""
    k = compile_prefill(lazy, ws=ws, variant=variant)
    ptx = k.asm["ptx"]
    regs, stack = _regs_stack(k)
    sass = resource_usage(k, "-sass")
    return {"wgmma": "wgmma.mma_async" in ptx, "cp_async": "cp.async" in ptx,
            "shared": int(k.metadata.shared), "regs": regs, "stack": stack,
            "bar_sync": sass.count("BAR.SYNC"), "local_st": sass.count("STL"),
            "hgmma": sass.count("HGMMA"), "wgmma_waits": sass.count("WARPGROUP.DEPBAR"),
            "setmaxnreg": sorted(set(ln.split("setmaxnreg")[1].strip().rstrip(";")
                                     for ln in ptx.splitlines() if "setmaxnreg" in ln)),
            "loops": loops_sass(k)}


if __name__ == "__main__":
    # python -m dsv41_triton.attention.gluon.compile_check SRC_A SRC_B BH SPLIT NW [X [Y]] -> JSON
    # line. BH 64 (the many-heads kernel): X = NS, Y = OVERLAP 0/1 or ws; other BH (the
    # few-heads kernel): X = F16 0/1, then optionally NS and "sass" for the main loop's
    # instruction counts. Run with
    # TRITON_INTERPRET unset: the interpreter replaces the functions Gluon calls.
    import json
    if len(sys.argv) == 3 and sys.argv[1] == "launch":
        # python -m ...compile_check launch JSON -> JSON line: the launches of a decode
        # {"T", "H", "src_a", "src_b", "shape", "prior", "persist", "ds", "form"}
        # (``capture_decode``; with "load_waits": true also ``loops_sass`` and
        # ``early_load_waits``) or of a
        # prefill {"kind": "prefill", "T", "H", "S", "K", "variant", "has_len"}
        # (``capture_prefill``)
        # compiled as the GPU builds them: kernel, grid, registers and stack bytes of each
        c = json.loads(sys.argv[2])
        if c.get("kind") == "prefill":
            recs = capture_prefill(c["T"], c["H"], c["S"], c["K"], c.get("variant", ""),
                                   has_len=bool(c.get("has_len", False)))
        else:
            recs = capture_decode(c["T"], c["H"], c["src_a"], c["src_b"], c.get("shape", ""),
                                  prior=bool(c.get("prior", False)),
                                  persist=c.get("persist"), ds=c.get("ds"),
                                  form=c.get("form"))
        rows = []
        for rec in recs:
            k = compile_launch(rec)
            regs, stack = _regs_stack(k)
            row = {"kernel": rec["kernel"], "grid": list(rec["grid"]), "regs": regs,
                   "stack": stack, "prior": rec["kwargs"].get("PRIOR", False),
                   "persist": rec["kwargs"].get("PERSIST", False),
                   "split": rec["kwargs"].get("SPLIT"),
                   "form": {f: rec["kwargs"][f] for f in ("F16", "FREE_SPLIT", "IDX_AHEAD",
                                                          "PV_SYNC", "S_MASK")
                            if f in rec["kwargs"]}}
            if c.get("load_waits"):  # the loops and the loads waited where they are issued
                rows_k = sass_instructions(k)
                row["loops"] = loops_sass(k, rows_k)
                row["early_load_waits"] = early_load_waits(k, rows=rows_k)
            if c.get("loop_ops"):  # opcode counts of every loop
                row["loop_ops"] = loop_op_counts(k)
            row["shared"] = int(k.metadata.shared)
            rows.append(row)
        print(json.dumps(rows))
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == "ds_mode":
        # python -m ...compile_check ds_mode MODE -> JSON line: the SASS opcode counts of the
        # dequant + S form as the paged prefill's top-k launch compiles it, at ``MODE``
        k = compile_decode(584, 584, 8, False, has_b=False, ahead=0, deq_prefetch=True,
                           prior=True, ds=True, mode=int(sys.argv[2]))
        print(json.dumps(dict(sass_op_counts(k))))
        sys.exit(0)
    if len(sys.argv) in (4, 6) and sys.argv[1] == "ds_f16":
        # python -m ...compile_check ds_f16 SRC SPLIT [FREE_SPLIT AHEAD] -> JSON line: the
        # dequant + S form with fp16 operands (the paged prefill's top-k launch, ids one block
        # ahead by default): registers, stack, shared memory, SASS opcode counts, each loop's
        extra = sys.argv[4:] or ["0", "1"]
        k = compile_decode(int(sys.argv[2]), int(sys.argv[2]), 8, bool(int(sys.argv[3])),
                           has_b=False, ahead=int(extra[1]), deq_prefetch=True, prior=True,
                           ds=True, ds_f16=True, ds_split=int(extra[0]))
        regs, stack = _regs_stack(k)
        print(json.dumps(dict(regs=regs, stack=stack, shared=int(k.metadata.shared),
                              ops=dict(sass_op_counts(k)), loop_ops=loop_op_counts(k))))
        sys.exit(0)
    if len(sys.argv) in (3, 4) and sys.argv[1] == "prefill":
        # python -m ...compile_check prefill LAZY [WS] -> JSON line; WS: 0, 1 (= ws) or a
        # variant name (ws, wsp)
        v = sys.argv[3] if len(sys.argv) == 4 else "0"
        v = {"0": "", "1": "ws"}.get(v, v)
        print(json.dumps(summary_prefill(bool(int(sys.argv[2])), variant=v)))
        sys.exit(0)
    if len(sys.argv) in (5, 6, 7, 8) and sys.argv[1] == "few_ws":
        # python -m ...compile_check few_ws SRC_A SRC_B SPLIT [BH [AHEAD [p]]] -> JSON line
        # ("p": the dequant partition's group prefetch)
        print(json.dumps(summary_few_ws(int(sys.argv[2]), int(sys.argv[3]),
                                        bool(int(sys.argv[4])),
                                        int(sys.argv[5]) if len(sys.argv) >= 6 else 8,
                                        int(sys.argv[6]) if len(sys.argv) >= 7 else 1,
                                        len(sys.argv) == 8 and sys.argv[7] == "p")))
        sys.exit(0)
    if len(sys.argv) in (6, 7, 8, 9) and int(sys.argv[3]) == 64:
        # ... 64 SPLIT 8 NS Y [sass]: Y = OVERLAP 0/1 or "ws" (the warp-specialized kernel);
        # "sass": the main loop's instruction counts (``loop_sass``) instead of the summary
        a, b, bh, sp, nw = (int(x) for x in sys.argv[1:6])
        ns = int(sys.argv[6]) if len(sys.argv) >= 7 else 2
        y = sys.argv[7] if len(sys.argv) >= 8 else "1"
        ws = y == "ws"
        ov = (not ws) and bool(int(y))
        if len(sys.argv) == 9 and sys.argv[8] == "sass":
            k = compile_decode(a, b, bh, bool(sp), ns=ns, overlap=ov, ws=ws)
            print(json.dumps(loop_sass(k, "HGMMA" if ws else "")))
        else:
            print(json.dumps(summary(a, b, bh, bool(sp), nw, ns, ov, ws=ws)))
        sys.exit(0)
    if len(sys.argv) in (6, 7, 8, 9):
        # ... F16 [NS] [sass]: ring stages (default 3); "sass": the main loop's counts
        a, b, bh, sp, nw = (int(x) for x in sys.argv[1:6])
        f16 = len(sys.argv) >= 7 and bool(int(sys.argv[6]))
        rest = sys.argv[7:]
        ns = int(rest[0]) if rest and rest[0].isdigit() else 3
        if rest and rest[-1] == "sass":
            print(json.dumps(loop_sass(compile_decode(a, b, bh, bool(sp), nw=nw, ns=ns,
                                                      f16=f16))))
        else:
            print(json.dumps(summary(a, b, bh, bool(sp), nw, ns=ns, f16=f16)))
        sys.exit(0)
    combos = [(584, 584), (528, 288), (584, 288), (528, 528), (584, 528), (528, 584)]
    for a, b in combos:
        for bh in (8, 16, 32):
            for split in (False, True):
                print(a, b, bh, split, summary(a, b, bh, split), flush=True)
