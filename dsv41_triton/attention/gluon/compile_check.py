"""Compile the Gluon decode kernels for an sm_90 target without a GPU (``triton.compile``).

``compile_decode(SRC_A, SRC_B, BH, ...)`` (``BH = 64``: the many-heads kernel of
``decode_heads.py``, 8 warps) returns the compiled kernel (``.asm['sass'|'ptx']``,
``.n_regs`` is unset without a driver: read registers with ``cuobjdump`` from ``.asm['cubin']``).
Used by the CPU compile-only test and by ``python -m dsv41_triton.attention.gluon.compile_check``.
"""
from __future__ import annotations

import sys


def _signature(idx_dtype: str = "i32"):
    sig = {}
    ptr16 = []
    names = [
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
    for i, (n, ty) in enumerate(names):
        sig[n] = ty
        if ty.startswith("*") or n in ("a_bstride", "b_bstride", "stride_qt", "stride_qh"):
            ptr16.append(i)
    return sig, ptr16


def compile_decode(src_a: int = 584, src_b: int = 584, bh: int = 8, split: bool = False,
                   has_b: bool = True, ns: int = 3, arch: int = 90, nw: int = 4,
                   overlap: bool = True):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, ptr16 = _signature()
    consts = dict(SRC_A=src_a, SRC_B=src_b, HAS_B=has_b, HAS_LEN_A=True, HAS_LEN_B=True,
                  HAS_SINK=True, SPLIT=split)
    if bh == 64:
        from .decode_heads import NW
        nw = NW.value
        from .decode_heads import _sparse_mla_decode_heads_kernel as kern
        consts.update(NS=ns, OVERLAP=overlap)
    else:
        from .decode import _sparse_mla_decode_gluon_kernel as kern
        consts.update(BH=bh, NS=ns, NW=nw)
    for k, v in consts.items():
        sig[k] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i in ptr16}
    src = GluonASTSource(kern, sig, constexprs={(list(sig).index(k),): v
                                                for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=nw))


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


def summary(src_a: int, src_b: int, bh: int, split: bool, nw: int = 4, ns: int = 3,
            overlap: bool = True) -> dict:
    """Facts of one compile: wgmma / cp.async present in the PTX, shared memory, registers,
    stack bytes (spills) and CTA barriers in the SASS (``overlap``: the many-heads kernel's
    variant)."""
    k = compile_decode(src_a, src_b, bh, split, nw=nw, ns=ns, overlap=overlap)
    ptx = k.asm["ptx"]
    use = resource_usage(k)
    regs = [ln.split("REG:")[1].split()[0] for ln in use.splitlines() if "REG:" in ln]
    stack = [ln.split("STACK:")[1].split()[0] for ln in use.splitlines() if "STACK:" in ln]
    sass = resource_usage(k, "-sass")
    return {"wgmma": "wgmma.mma_async" in ptx, "cp_async": "cp.async" in ptx,
            "shared": int(k.metadata.shared), "regs": int(regs[0]) if regs else -1,
            "stack": int(stack[0]) if stack else -1, "bar_sync": sass.count("BAR.SYNC"),
            "wgmma_ptx": ptx.count("wgmma.mma_async")}


_PREFILL_ARGS = (
    ("q_ptr", "*bf16"), ("stride_qt", "i64"), ("stride_qh", "i64"),
    ("kv_ptr", "*bf16"), ("kv_stride", "i64"), ("rows", "i64"),
    ("idx_ptr", "*i32"), ("idx_st", "i64"), ("width", "i32"), ("len_ptr", "*i32"),
    ("len_st", "i64"), ("sink_ptr", "*fp32"), ("sink_st", "i64"),
    ("out_ptr", "*bf16"), ("stride_ot", "i64"), ("stride_oh", "i64"),
    ("lse_ptr", "*fp32"), ("stride_lt", "i64"), ("stride_lh", "i64"),
    ("H", "i32"), ("qk_scale", "fp32"), ("num_ht", "i32"),
)


def compile_prefill(lazy: bool = True, has_len: bool = True, has_sink: bool = True,
                    arch: int = 90, ws: bool = False):
    """The Gluon prefill kernel (``ws``: the warp-specialized one) compiled for ``sm_<arch>``
    (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    if ws:
        from .prefill_ws import NUM_WARPS, _sparse_mla_prefill_gluon_ws_kernel as kern
    else:
        from .prefill import NUM_WARPS, _sparse_mla_prefill_gluon_kernel as kern

    sig = dict(_PREFILL_ARGS)
    aligned = [i for i, (n, ty) in enumerate(_PREFILL_ARGS)
               if ty.startswith("*") or n in ("stride_qt", "stride_qh", "kv_stride")]
    consts = dict(HAS_LEN=has_len, HAS_SINK=has_sink, LAZY=lazy)
    for k in consts:
        sig[k] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = GluonASTSource(kern, sig, constexprs={(list(sig).index(k),): v
                                                for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=NUM_WARPS))


def summary_prefill(lazy: bool = True, ws: bool = False) -> dict:
    """Facts of one prefill compile: wgmma / cp.async in the PTX, shared memory, registers,
    spill stores, CTA barriers in the SASS (``setmaxnreg``: the partitions' register budgets
    of the warp-specialized kernel)."""
    k = compile_prefill(lazy, ws=ws)
    ptx = k.asm["ptx"]
    usage = resource_usage(k)
    regs = [ln.split("REG:")[1].split()[0] for ln in usage.splitlines() if "REG:" in ln]
    stack = [ln.split("STACK:")[1].split()[0] for ln in usage.splitlines() if "STACK:" in ln]
    sass = k.asm.get("sass", "") or ""
    return {"wgmma": "wgmma.mma_async" in ptx, "cp_async": "cp.async" in ptx,
            "shared": int(k.metadata.shared), "regs": int(regs[0]) if regs else -1,
            "stack": int(stack[0]) if stack else -1,
            "bar_sync": sass.count("BAR.SYNC"), "local_st": sass.count("STL"),
            "setmaxnreg": sorted(set(ln.split("setmaxnreg")[1].strip().rstrip(";")
                                     for ln in ptx.splitlines() if "setmaxnreg" in ln))}


if __name__ == "__main__":
    # python -m dsv41_triton.attention.gluon.compile_check SRC_A SRC_B BH SPLIT NW [NS [OVERLAP]]
    # -> JSON line (BH 64: the many-heads kernel, OVERLAP 0/1 its variant; run with
    # TRITON_INTERPRET unset: the interpreter replaces the functions Gluon calls)
    import json
    if len(sys.argv) in (3, 4) and sys.argv[1] == "prefill":
        # python -m ...compile_check prefill LAZY [WS] -> JSON line
        ws = len(sys.argv) == 4 and bool(int(sys.argv[3]))
        print(json.dumps(summary_prefill(bool(int(sys.argv[2])), ws=ws)))
        sys.exit(0)
    if len(sys.argv) in (6, 7, 8):
        a, b, bh, sp, nw = (int(x) for x in sys.argv[1:6])
        ns = int(sys.argv[6]) if len(sys.argv) >= 7 else (2 if bh == 64 else 3)
        ov = bool(int(sys.argv[7])) if len(sys.argv) == 8 else True
        print(json.dumps(summary(a, b, bh, bool(sp), nw, ns, ov)))
        sys.exit(0)
    combos = [(584, 584), (528, 288), (584, 288), (528, 528), (584, 528), (528, 584)]
    for a, b in combos:
        for bh in (8, 16, 32):
            for split in (False, True):
                print(a, b, bh, split, summary(a, b, bh, split), flush=True)
