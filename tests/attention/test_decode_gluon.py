"""The Gluon Hopper decode kernel (``attention/gluon``) against the float64 reference.

CPU: a compile-only check for an sm_90 target, run when the installed Triton has the Gluon API
the kernel needs (skipped otherwise, e.g. Triton 3.9). GPU-marked: every record pair, head
counts 1..128, tokens 1..512, ragged lens, ``-1`` and empty rows, sinks, layouts, a > 2 GiB
cache, CUDA graphs, hostile indices; skipped where the kernel cannot run (not sm_90).
"""
import pytest
import torch

from dsv41_triton.attention import gluon as gluon_pkg
from dsv41_triton.attention.decode import sparse_mla_decode
from dsv41_triton.attention.ref import sparse_mla_decode_ref
from dsv41_triton.ops.records import (get_record_format)
from dsv41_triton.testing import (assert_graph_replay, large_offset_decode_case, max_abs_err,
                                  poison_, random_k_cache, rel_err)

OUT_TOL = 1e-2
LSE_TOL = 1e-3
#: the decode inputs a CUDA-graph replay test refreshes (the caches stay)
GRAPH_INPUTS = ("q", "swa_indices", "swa_lens", "extra_indices", "extra_lens", "attn_sink")
PAIRS = [(584, 584), (584, 528), (584, 288), (528, 584), (528, 528), (528, 288), (584, None),
         (528, None)]


def _compile_check(*argv):
    """``python -m dsv41_triton.attention.gluon.compile_check ARGV`` in a subprocess without the
    interpreter (it would replace the functions Gluon calls): the completed process."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "dsv41_triton.attention.gluon.compile_check",
                           *map(str, argv)], env=env, capture_output=True, text=True,
                          timeout=900)


def _compile_facts(*argv):
    """``_compile_check``'s JSON line (the facts of one compile); the compile must succeed."""
    import json
    r = _compile_check(*argv)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _ds_block_loops(loop_ops, is_ds):
    """The dequant + S form's innermost block loops (over 150 instructions, with ``HGMMA`` or
    ``HMMA``): ``(ds, mma)``, the two dequant + S warpgroups' loops (``is_ds(ops)``) and the MMA
    warpgroup's; asserts there are two and one."""
    loops = [lp for lp in loop_ops
             if lp["instructions"] > 150 and (lp["hgmma"] or lp["ops"].get("HMMA", 0))]
    inner = [lp for lp in loops if not any(o is not lp and int(o["start"], 16) > int(
        lp["start"], 16) and int(o["end"], 16) < int(lp["end"], 16) for o in loops)]
    ds = [lp for lp in inner if is_ds(lp["ops"])]
    mma = [lp for lp in inner if lp not in ds]
    assert len(ds) == 2 and len(mma) == 1, [(lp["start"], lp["ops"]) for lp in inner]
    return ds, mma


def _f16_ds_block_loops(loop_ops, src):
    """``_ds_block_loops`` of the form with fp16 operands, checked: each dequant + S loop with
    its 32 ``HGMMA`` of ``S^T``, one ``HMUL2`` per two e4m3 bytes (7 or 8 groups x 16) and at
    most one stack access, the MMA warpgroup's with its ``O^T`` products (32 ``HGMMA``, or with
    ``launch.FEW_DS_PV_SYNC`` 32 ``HMMA`` and no ``HGMMA``) and none."""
    ds, mma = _ds_block_loops(loop_ops, lambda ops: ops.get("HMUL2", 0) > 0)
    for lp in ds:
        assert lp["hgmma"] == 32 and lp["ops"]["HMUL2"] == 16 * (7 if src == 584 else 8), lp
        assert lp["local_ld_st"] <= 1, lp
    products = (mma[0]["hgmma"], mma[0]["ops"].get("HMMA", 0))
    assert products in ((32, 0), (0, 32)) and mma[0]["local_ld_st"] == 0, mma[0]
    return ds, mma


def _need_gluon_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"gluon kernels unavailable: {gluon_pkg.REASON}")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels target sm_90")


# --------------------------------------------------------------------------------------------
# CPU: compile-only
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("src_a,src_b,bh,split,nw,f16,ns", [(584, 584, 8, False, 4, 0, 3),
                                                            (528, 288, 16, True, 8, 0, 3),
                                                            (584, 584, 8, False, 4, 1, 3),
                                                            (528, 288, 16, True, 4, 1, 3),
                                                            (528, 528, 8, True, 4, 1, 3),
                                                            (584, 584, 8, True, 4, 0, 1),
                                                            (584, 584, 8, True, 4, 1, 1),
                                                            (528, 288, 8, True, 4, 0, 1),
                                                            (528, 288, 8, False, 4, 1, 1)])
def test_gluon_decode_compiles_for_sm90(src_a, src_b, bh, split, nw, f16, ns):
    """The kernel compiles for sm_90 on this machine (in a subprocess without the interpreter,
    which would replace the functions Gluon calls); wgmma and cp.async are in the PTX; the
    fp16-operand variant (``F16``) has fp16 wgmma, the bf16 one not; both dequantize e4m3
    through the e4m3 -> f16x2 cvt (every pair here reads e4m3 records). One ring stage at 8 heads fits two CTAs per SM: 228 KB of shared memory per SM,
    1 KB of it reserved per CTA (``launch.ctas_per_sm``)."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    facts = _compile_facts(src_a, src_b, bh, int(split), nw, f16, ns)
    assert facts["wgmma"] and facts["cp_async"], facts
    assert facts["f16_mma"] == bool(f16) and facts["e4m3_cvt"], facts
    assert 0 < facts["shared"] <= 227 * 1024, facts
    if ns == 1:
        assert facts["shared"] <= 228 * 1024 // 2 - 1024 and facts["regs"] <= 256, facts


@pytest.mark.parametrize("src_a,src_b,split,bh,ahead", [(584, 584, 0, 8, 1), (528, 288, 1, 8, 1),
                                                        (584, 528, 1, 8, 1), (584, 288, 0, 16, 1),
                                                        (584, 584, 1, 16, 1), (528, 288, 1, 16, 1),
                                                        (584, 584, 0, 8, 0),
                                                        (584, 528, 1, 8, 0), (584, 584, 0, 8, "1p"),
                                                        (528, 288, 1, 16, "0p")])
def test_gluon_few_ws_compiles_for_sm90(src_a, src_b, split, bh, ahead):
    """The warp-specialized few-heads kernel compiles for sm_90 (subprocess, no interpreter):
    wgmma, cp.async and mbarriers in the PTX, one CTA's shared memory, per-partition register
    budgets (``setmaxnreg``), and its producer (slot ids one block ahead, 0: preloaded in
    chunks; ``p``: the dequant partition's group prefetch), dequant and MMA loops spill
    nothing."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    lead, prefetch = str(ahead)[0], str(ahead)[1:]  # "1p": lead 1 and the dequant prefetch
    facts = _compile_facts("few_ws", src_a, src_b, split, bh, lead,
                           *([prefetch] if prefetch else []))
    assert facts["wgmma"] and facts["cp_async"] and facts["mbarrier"], facts
    assert 0 < facts["shared"] <= 227 * 1024, facts
    assert facts["setmaxnreg"], facts
    big = [lp for lp in facts["loops"] if lp["instructions"] > 100]
    mma = [lp for lp in big if lp["hgmma"]]
    dequant = [lp for lp in big if not lp["hgmma"] and not lp["ldgsts"]]
    producer = [lp for lp in big if lp["ldgsts"]]
    assert len(mma) == 1 and len(dequant) == 1 and len(producer) == 1, facts["loops"]
    assert mma[0]["local_ld_st"] == 0 and dequant[0]["local_ld_st"] == 0, facts["loops"]
    # the producer's 48 registers: 584 records mixed with others (two address forms) spill a
    # few words per block (2 local loads/stores with ids one block ahead)
    mixed = src_a != src_b and 584 in (src_a, src_b)
    assert producer[0]["local_ld_st"] <= (16 if mixed else 0), facts["loops"]


def test_gluon_f16_mixed_584_refused():
    """fp16 operands with 584 records mixed with 528/288 ones: the compile refuses (a static
    assert) and the launch falls back to bf16 operands (``f16_supported``)."""
    from dsv41_triton.attention.gluon import launch as gl_launch

    class K:
        def __init__(self, src):
            self.src = src
    for a, b, ok in [(584, 584, True), (584, None, True), (528, 288, True), (528, 528, True),
                     (528, None, True), (584, 528, False), (528, 584, False),
                     (584, 288, False)]:
        assert gl_launch.f16_supported(K(a), K(b) if b else None) == ok, (a, b)
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    r = _compile_check(584, 528, 8, 0, 4, 1)
    assert r.returncode != 0 and "not supported" in r.stderr, r.stderr[-2000:]


def _pick_entries():
    from dsv41_triton.attention.gluon import launch as gl_launch
    return sorted(gl_launch.PICK[(9, 0)].items())


def _kernel_module(shape: str) -> str:
    """The module of the decode kernel a launch shape names."""
    from dsv41_triton.attention.gluon import launch as gl_launch
    o = gl_launch.parse_shape(shape)
    if o.get("few_ws"):
        return "decode_few_ws"
    if o.get("block_h") == 64:
        variant = gl_launch.HEADS_VARIANTS.get(o.get("variant"), gl_launch.HEADS_OVERLAP)
        return "decode_heads_ws" if variant == "ws" else "decode_heads"
    return "decode"


@pytest.mark.parametrize("entry,shape", _pick_entries(), ids=lambda x: str(x))
def test_gluon_picks_compile_at_launch_values(entry, shape):
    """Every pick-table entry: ``launch.launch`` run on the CPU at its buckets' heads and
    tokens (tokens 512 for the last) with recording kernels (``compile_check.capture_decode``)
    starts the kernel its shape names, and that launch compiled as the GPU builds it (integers
    specialized on the values passed: 1 -> constant, i32 by range, 16-divisible marked) has no
    stack, i.e. nothing spilled (on the H200 this specialization reproduced the spill sizes the
    GPU build reported; the unspecialized compile shows 8-byte stacks the GPU build does
    not)."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    import json
    hb, sa, sb, tb = entry
    case = dict(T=512 if tb == 1 << 30 else tb, H=hb, src_a=sa, src_b=sb)
    rows = _compile_facts("launch", json.dumps(case))
    assert [r["kernel"].split(".")[0] for r in rows] == [_kernel_module(shape)], (case, rows)
    for r in rows:
        assert 0 < r["regs"] <= 255 and r["stack"] == 0, (case, r)


def test_few_ds_dim_order_renames_the_a_fragment():
    """``decode_few_ds._ds_perm`` (the order Q is loaded in) is the column order ``_ds_a``'s
    reshape / permute gives a group, it is a permutation, every wgmma A-fragment column a
    thread holds (``2 (l % 4) + {0, 1, 8, 9}`` of each 16-wide step) is one of the 16 dims that
    thread loaded (``16 (l % 4) ..``), and the renamed product equals ``K Q^T``."""
    from dsv41_triton.attention.gluon import decode_few_ds as ds

    perm = ds._ds_perm.fn(torch.arange(64))
    cols = torch.arange(64).reshape(4, 4, 2, 2).permute(1, 2, 0, 3).reshape(64)
    assert torch.equal(perm, cols) and torch.equal(perm.sort().values, torch.arange(64))
    for L in range(64):
        lane_c = (L % 8) // 2  # the thread column (lane % 4) holding fragment column L % 16
        assert 16 * lane_c <= int(perm[L]) < 16 * lane_c + 16, (L, int(perm[L]))
    g = torch.Generator().manual_seed(3)
    k = torch.randn(64, 64, generator=g, dtype=torch.float64)
    q = torch.randn(8, 64, generator=g, dtype=torch.float64)
    a = k.reshape(64, 4, 4, 2, 2).permute(0, 2, 3, 1, 4).reshape(64, 64)
    assert torch.allclose(a @ q[:, perm].T, k @ q.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("H,src_a,src_b,shape,persist,ds", [
    (8, 584, 584, "4:8:2:W", True, True), (8, 528, None, "4:8:2:W:0:p", True, True),
    (8, 584, 528, "4:8:2:W", True, False), (8, 528, 288, "4:8:2:W", True, False),
    (16, 584, 584, "4:16:2:W", True, False), (8, 584, 584, "4:8:2:w", False, False)])
def test_few_ds_launch_conditions(monkeypatch, H, src_a, src_b, shape, persist, ds):
    """The override key ``ds`` takes the dequant + S form on the persistent grid with 8-head
    tiles and one e4m3 record width only (584 beside 528 needs both rings; 288 is e2m1; 16-head
    tiles and the per-item grid keep ``decode_few_ws``); ``launch.FEW_DS`` alone asks for it in
    prior launches only (the paged prefill's top-k records), not in decodes."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    from dsv41_triton.attention.gluon import compile_check as cc
    (r,) = cc.capture_decode(300, H, src_a, src_b or 0, shape, persist=persist, ds=True)
    assert r["kernel"].split(".")[0] == ("decode_few_ds" if ds else "decode_few_ws"), r["kernel"]
    (r,) = cc.capture_decode(300, H, src_a, src_b or 0, shape, persist=persist, ds=False)
    assert r["kernel"].split(".")[0] == "decode_few_ws", r["kernel"]
    if src_b is None and persist:
        from dsv41_triton.attention.gluon import launch as gl_launch
        monkeypatch.setattr(gl_launch, "FEW_DS", True)
        (r,) = cc.capture_decode(300, H, src_a, 0, shape, persist=persist)
        assert r["kernel"].split(".")[0] == "decode_few_ws", r["kernel"]  # a decode
        (r,) = cc.capture_decode(300, H, src_a, 0, shape, persist=persist, prior=True)
        assert r["kernel"].split(".")[0] == "decode_few_ds", r["kernel"]


def test_few_ds_split_decode_merges_its_splits(monkeypatch):
    """A split decode on the dequant + S form (one token: key splits fill the SMs) is followed
    by the split merge, as on the record kernel: the form's launch takes the common path
    after the kernel, not a return of its own."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    from dsv41_triton.attention import _launch
    from dsv41_triton.attention.gluon import compile_check as cc
    merges, recording = [], cc._recording

    def counting(kernels, sms, run):
        def run_counting():
            _launch.merge_splits = lambda *a, **k: merges.append(a[7])  # ns
            run()
        return recording(kernels, sms, run_counting)
    monkeypatch.setattr(cc, "_recording", counting)
    for ds in (False, True):
        merges.clear()
        (r,) = cc.capture_decode(1, 3, 528, 528, "4:8:2:W", persist=True, ds=ds)
        assert r["kernel"].split(".")[0] == ("decode_few_ds" if ds else "decode_few_ws")
        ns = r["args"][-3]  # (..., H, qk_scale, num_splits, num_ht, num_items)
        assert r["kwargs"]["SPLIT"] is True and ns > 1 and merges == [ns], (ds, ns, merges)


@pytest.mark.parametrize("T,H,src_a,src_b,prior,shape", [
    (2048, 8, 584, 0, True, "4:8:2:W:0:p"), (2048, 8, 528, 0, True, "4:8:2:W:0:p"),
    (300, 13, 584, 584, False, "4:8:2:W"), (1, 3, 528, 528, False, "4:8:2:W:0")])
def test_gluon_few_ds_launch_compiles(T, H, src_a, src_b, prior, shape):
    """The few-heads kernel's dequant + S form with bf16 operands (override keys ``ds``,
    ``ds_f16`` off, ``ds_split`` 0) as ``launch.launch`` starts it (the paged prefill's top-k
    launch with its prior, decodes of two head tiles and of split keys), compiled as the GPU
    builds it: one CTA's shared memory, no spill in the producer's block loop (at most one word
    on the stack outside it), and in each dequant + S warpgroup's block loop (the two loops with ``HGMMA`` and no ``LDGSTS`` beside
    the MMA warpgroup's) the 32 ``HGMMA`` of ``S^T`` with A from registers and no shuffles or
    extra shared-memory round trips: 7 or 8 groups of two 16-byte raw loads per thread (584:
    7 e4m3 groups, two 16-byte loads of the RoPE tile), four 16-byte key-tile stores per group;
    the MMA warpgroup's loop holds the 32 ``HGMMA`` of ``O^T`` only."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    import json
    rows = _compile_facts("launch", json.dumps(dict(T=T, H=H, src_a=src_a, src_b=src_b,
                                                    prior=prior, persist=True, ds=True,
                                                    form={"ds_f16": False, "ds_split": 0},
                                                    shape=shape, loop_ops=True)))
    (r,) = rows
    assert (r["form"]["F16"], r["form"]["FREE_SPLIT"]) == (False, 0), r["form"]
    # the form is persistent by construction: it has no PERSIST constexpr for the row to read
    assert r["kernel"].startswith("decode_few_ds") and r["persist"] is False, r["kernel"]
    # ptxas may keep one producer word on the stack across the partitions' register split
    # (reloaded once an item, outside the block loops checked below)
    assert r["stack"] <= 8 and 0 < r["shared"] <= 227 * 1024, r
    assert 0 < r["grid"][0] <= 132 and (T < 132 or r["grid"] == [132]), r["grid"]
    copies = [lp for lp in r["loop_ops"] if lp["ldgsts"] and lp["instructions"] > 100]
    assert copies and min(copies, key=lambda lp: lp["instructions"])["local_ld_st"] == 0, copies
    ds, mma = _ds_block_loops(r["loop_ops"], lambda ops: ops.get("F2FP", 0) >= 100)
    for lp in ds:
        ops = lp["ops"]
        assert lp["hgmma"] == 32 and lp["local_ld_st"] == 0, ops
        assert "SHFL" not in ops, ops
        assert ops.get("STS", 0) <= 2 * 16 + 4 and ops.get("LDS", 0) <= 2 * 8 + 16 + 8, ops
    products = (mma[0]["hgmma"], mma[0]["ops"].get("HMMA", 0))  # wgmma, or mma.sync (PV_SYNC)
    assert products in ((32, 0), (0, 32)) and mma[0]["local_ld_st"] == 0, mma[0]


@pytest.mark.parametrize("src", [584, 528])
def test_gluon_few_ds_default_launch_compiles(src):
    """The paged prefill's top-k launch at the package's defaults (``launch.FEW_DS``,
    ``FEW_DS_F16``, ``FEW_DS_FREE_SPLIT``, ``FEW_DS_F16_AHEAD`` for 584 records,
    ``FEW_DS_PV_SYNC``, ``FEW_DS_S_MASK``) starts the dequant + S form with fp16 operands on
    the persistent grid, and it compiles as the GPU builds it: one CTA's shared memory, each
    dequant + S warpgroup's block loop with its 32 ``HGMMA`` of ``S^T``, one ``HMUL2`` per two
    e4m3 bytes and at most one stack reload, the MMA warpgroup's with its 32 ``O^T`` products
    (``HMMA`` with ``FEW_DS_PV_SYNC``) and no spills."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    import json

    from dsv41_triton.attention.gluon import launch as gl_launch
    (r,) = _compile_facts("launch", json.dumps(dict(T=2048, H=8, src_a=src, src_b=0,
                                                    prior=True, loop_ops=True)))
    assert r["kernel"].startswith("decode_few_ds"), r["kernel"]
    assert r["form"] == {"F16": gl_launch.FEW_DS_F16, "FREE_SPLIT": gl_launch.FEW_DS_FREE_SPLIT,
                         "IDX_AHEAD": gl_launch.FEW_DS_F16_AHEAD if src == 584 else 1,
                         "PV_SYNC": gl_launch.FEW_DS_PV_SYNC,
                         "S_MASK": gl_launch.FEW_DS_S_MASK}, r["form"]
    assert 0 < r["shared"] <= 227 * 1024 and r["grid"] == [132], r
    _, mma = _f16_ds_block_loops(r["loop_ops"], src)
    # the MMA warpgroup's O^T products: mma.sync with FEW_DS_PV_SYNC
    assert (mma[0]["ops"].get("HMMA", 0) == 32) == gl_launch.FEW_DS_PV_SYNC, mma[0]


@pytest.mark.parametrize("mode", [1, 2, 3, 4])
def test_gluon_few_ds_benchmark_modes_compile(mode):
    """The dequant + S form's benchmark modes (``MODE`` 1: no conversion, 2: no ``S^T``
    products, 3: neither, 4: the fp16 operands' conversion) compile for sm_90a, each without
    what it leaves out: no e4m3 conversion (``F2FP``) in 1 and 3, half of it in 4 (no bf16
    packing), no register-A ``HGMMA`` beyond the MMA warpgroup's 32 of ``O^T`` in 2 and 3."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    ops = _compile_facts("ds_mode", mode)
    # the two warpgroups convert 7 e4m3 groups each with 16 F2FP a group (8 unpacking, 8
    # packing); what is left is the MMA warpgroup's packing of P and the epilogue's
    assert (ops.get("F2FP", 0) < 100) == (mode in (1, 3)), ops
    assert (ops.get("F2FP", 0) < 300) == (mode in (1, 3, 4)), ops
    assert (ops.get("HGMMA", 0) == 32) == (mode in (2, 3)) and ops.get("HGMMA", 0) >= 32, ops


@pytest.mark.parametrize("src,split,free_split,ahead", [
    (584, 0, 0, 1), (528, 0, 0, 1), (584, 1, 0, 1), (584, 0, 1, 1), (584, 0, 4, 2),
    (528, 0, 4, 1)])
def test_gluon_few_ds_f16_compiles(src, split, free_split, ahead):
    """The dequant + S form with fp16 operands as the paged prefill's top-k launch compiles it
    (the producer's ids ``ahead`` blocks ahead; ``free_split``: the tiles freed in two parts):
    one CTA's shared memory; in each dequant + S warpgroup's block loop the 32
    register-A ``HGMMA`` of ``S^T``, one ``HMUL2`` per two e4m3 bytes (power-of-two scales: 7
    or 8 groups x 16), no fp32 round trip, at most one stack reload, and a third mbarrier wait
    with ``free_split``; the MMA warpgroup's block loop with its 32 ``HGMMA`` of ``O^T``, no
    spills and a second arrive with ``free_split``."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    r = _compile_facts("ds_f16", src, split, free_split, ahead)
    assert 0 < r["shared"] <= 227 * 1024, r["shared"]
    assert r["ops"].get("HMUL2", 0) == 2 * 16 * (7 if src == 584 else 8), r["ops"]
    ds, mma = _f16_ds_block_loops(r["loop_ops"], src)
    for lp in ds:
        # no fp32 round trip: the e4m3 unpacking and the few packs of the loop's bookkeeping
        assert lp["ops"].get("F2FP", 0) <= 16 * 8 + 8, lp
        assert lp["mbar_wait"] == 2 + bool(free_split), lp
    assert mma[0]["mbar_arrive"] == 1 + bool(free_split), mma[0]


@pytest.mark.parametrize("T,H,src,persist", [(512, 8, 584, False), (512, 8, 528, False),
                                             (7, 16, 584, False), (1, 3, 528, False),
                                             (300, 40, 584, False), (512, 8, 584, True),
                                             (7, 16, 528, True), (300, 40, 584, True),
                                             (512, 8, 584, None), (7, 16, 528, None)])
def test_gluon_prior_launch_compiles(T, H, src, persist):
    """``launch.launch(..., prior=True)`` over one key set (the shared-window prefill's top-k
    records) starts the warp-specialized few-heads kernel once, unsplit (one CTA per token and
    head tile, or with ``persist`` at most one per SM: 132 here; ``None``: the launch's
    default, ``PRIOR_PERSIST``), with ``PRIOR``; persistent 8-head tiles take its dequant + S
    form (``launch.FEW_DS``; its block loops are checked by the ``few_ds`` compile tests);
    compiled as the GPU builds it, nothing spills."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    import json
    rows = _compile_facts("launch", json.dumps(dict(T=T, H=H, src_a=src, src_b=0, prior=True,
                                                    persist=persist)))
    from dsv41_triton.attention.gluon import launch as gl_launch
    if persist is None:
        persist = gl_launch.PRIOR_PERSIST
    bh = 8 if H <= 8 else 16
    items = T * -(-H // bh)
    ds = persist and bh == 8 and gl_launch.FEW_DS
    assert [r["kernel"].split(".")[0] for r in rows] == [
        "decode_few_ds" if ds else "decode_few_ws"], rows
    r = rows[0]
    # the dequant + S form is persistent by construction (no PERSIST for the row to read)
    assert r["prior"] is True and r["split"] is False and r["persist"] is (persist and not ds), r
    assert r["grid"] == [min(132, items) if persist else items], r
    # the dequant + S form: ptxas keeps a few producer words on the stack across the
    # partitions' register split (reloaded once an item, outside the block loops)
    assert 0 < r["regs"] <= 255 and r["stack"] <= (32 if ds else 0), r


@pytest.mark.parametrize("shape,H,src_a,src_b", [
    ("4:8:2:W:0:p", 8, 584, 584), ("4:8:2:W", 8, 528, 288), ("4:8:2:W:0:p", 16, 584, 0),
    ("4:16:2:W:0:p", 16, 584, 584), ("4:16:2:W", 40, 528, 288), ("4:16:2:W:0:p", 16, 528, 0)])
def test_gluon_persistent_launch_compiles(shape, H, src_a, src_b):
    """The few-heads ws kernel on its persistent grid (its producer carrying the next items'
    lens and first slot ids, its MMA partition the next 8-head Q), launched for a decode of
    one or two key sets and 8 / 16-head tiles, compiled as the GPU builds it: nothing spills
    (the producer's and MMA partition's register split is tight at 16-head tiles)."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    import json
    rows = _compile_facts("launch", json.dumps(dict(T=512, H=H, src_a=src_a, src_b=src_b,
                                                    shape=shape)))
    assert [r["kernel"].split(".")[0] for r in rows] == ["decode_few_ws"], rows
    for r in rows:
        assert r["persist"] is True and r["grid"] == [132], r
        assert 0 < r["regs"] <= 255 and r["stack"] == 0, r


@pytest.mark.parametrize("T,H,src_b,shape,persist", [
    (512, 8, 584, "", True), (2048, 8, 584, "", True), (133, 8, 584, "", True),
    (132, 8, 584, "", False), (128, 8, 584, "", False), (512, 16, 584, "", True),
    (512, 8, 288, "4:8:2:w", True), (512, 8, 584, "4:8:2:w:0:p", True)])
def test_gluon_decode_persists_past_one_item_per_sm(T, H, src_b, shape, persist):
    """A decode launch (no prior) of the few-heads ws kernel runs on the persistent grid
    (``DECODE_PERSIST``: at most one CTA per SM) exactly when it has more items than SMs;
    with the default off, or ``persist: False`` in the shape override, on one CTA per item."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    from dsv41_triton.attention.gluon import compile_check as cc
    from dsv41_triton.attention.gluon import launch as gl_launch
    src_a = 528 if src_b == 288 else 584
    (r,) = cc.capture_decode(T, H, src_a, src_b, shape)
    items = r["args"][-1]  # the kernel's num_items
    assert r["kernel"].startswith("decode_few_ws"), r["kernel"]
    assert r["kwargs"]["PERSIST"] is persist and r["kwargs"]["PRIOR"] is False
    assert r["grid"] == ((min(132, items),) if persist else (items,)), r["grid"]
    assert items == T * -(-H // r["kwargs"]["BH"]) * r["args"][-3]
    (r,) = cc.capture_decode(T, H, src_a, src_b, shape, persist=False)
    assert r["kwargs"]["PERSIST"] is False and r["grid"] == (items,)
    old = gl_launch.DECODE_PERSIST
    try:
        gl_launch.DECODE_PERSIST = False
        (r,) = cc.capture_decode(T, H, src_a, src_b, shape)
    finally:
        gl_launch.DECODE_PERSIST = old
    assert r["kwargs"]["PERSIST"] is False and r["grid"] == (items,)


@pytest.mark.parametrize("T,H,src,shape", [(2048, 8, 584, ""), (2048, 8, 528, ""),
                                           (512, 8, 584, "4:8:2:W")])
def test_gluon_persistent_items_start_without_load_waits(T, H, src, shape):
    """On the persistent grid (the shared-window prefill's top-k launch, ids in chunks or one
    block ahead) no partition waits on a global load it issued in the same item, read from
    the sm_90a SASS's scoreboards: every load waited within 40 instructions of its issue lies
    outside the item loops, or in the producer's block loop (a later id chunk of a long
    item). Lens, first slot ids, Q and the sink are loaded an item ahead."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    import json
    rows = _compile_facts("launch", json.dumps(dict(T=T, H=H, src_a=src, src_b=0, prior=True,
                                                    persist=True, shape=shape,
                                                    load_waits=True)))
    (r,) = rows
    assert r["persist"] is True and r["stack"] == 0, r
    loops = {lp["start"]: lp for lp in r["loops"]}
    # the three partitions' item loops each hold a block loop
    assert sum(lp["instructions"] > 100 for lp in r["loops"]) >= 6, r["loops"]
    for w in r["early_load_waits"]:
        if not w["loops"]:
            continue  # before the first item: once per CTA
        inner = min((loops[s] for s in w["loops"]), key=lambda lp: lp["instructions"])
        assert inner["ldgsts"] > 0, (w, inner)


#: launch shapes the wiring test forces beside the pick table's (every kernel family and its
#: variants)
WIRING_SHAPES = ("4:0:3", "4:0:3:h", "4:8:3:h", "4:0:1", "8:16:3", "8:32:3", "8:64:2",
                 "8:64:2:1", "8:64:2:2", "8:64:2:3", "8:64:2:3:0", "4:8:2:w", "4:16:2:w:0:p",
                 "4:8:2:w:1:p", "4:8:2:W:0:p", "4:16:2:W", "")


@pytest.mark.parametrize("shape", WIRING_SHAPES)
@pytest.mark.parametrize("T,H,src_a,src_b", [(1, 8, 584, 584), (128, 64, 528, 288),
                                             (7, 16, 584, 0), (512, 128, 584, 528)])
def test_gluon_launch_wiring(shape, T, H, src_a, src_b):
    """``launch.launch`` on the CPU with recording kernels: every launch it makes passes as many
    positional arguments as its kernel has non-constexpr parameters and only (and all required)
    constexprs of that kernel, with a grid of whole CTAs; a launch with one argument too few or
    an unknown constexpr is refused (so the check can fail)."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    from dsv41_triton.attention.gluon import compile_check as cc
    rows = cc.capture_decode(T, H, src_a, src_b, shape)
    assert rows
    for rec in rows:
        cc.launch_signature(rec)
        assert len(rec["grid"]) == 1 and rec["grid"][0] >= 1, rec["grid"]
    bad = dict(rows[0], args=rows[0]["args"][:-1])
    with pytest.raises(ValueError, match="positional arguments"):
        cc.launch_signature(bad)
    bad = dict(rows[0], kwargs=dict(rows[0]["kwargs"], NOT_A_PARAM=1))
    with pytest.raises(ValueError, match="unknown"):
        cc.launch_signature(bad)


def test_gluon_compile_constexpr_defaults():
    """The CPU compile binds a constexpr the caller omits to the kernel's default (a bare
    signature would bind it to None), keeps the kernel's parameter order, and refuses a name
    the kernel does not have."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    from dsv41_triton.attention.gluon import compile_check as cc
    from dsv41_triton.attention.gluon.decode_few_ws import _sparse_mla_decode_few_ws_kernel as k
    got = cc.kernel_constexprs(k, dict(NT=2, SRC_A=584, DEQ_PREFETCH=True))
    assert got["IDX_AHEAD"] == 1 and got["DEQ_PREFETCH"] is True and got["NT"] == 2, got
    order = [p.name for p in k.params if p.name in got]
    assert list(got) == order, (list(got), order)
    with pytest.raises(ValueError, match="NOT_A_PARAM"):
        cc.kernel_constexprs(k, dict(NOT_A_PARAM=1))


def test_gluon_pick_table():
    """Every pick-table entry names a launch shape the GPU tests run, on known buckets."""
    from dsv41_triton.attention.gluon import launch as gl_launch
    for cap, table in gl_launch.PICK.items():
        assert isinstance(cap, tuple) and len(cap) == 2
        for (hb, sa, sb, tb), shape in table.items():
            assert hb in (8, 16, 32, 64, 128) and tb in (1, 7, 32, 128, 1 << 30)
            assert sa in (584, 528) and sb in (584, 528, 288, 0)
            assert shape in gl_launch.TESTED_SHAPES, shape
            assert set(gl_launch.parse_shape(shape)) <= {"num_warps", "block_h", "stages",
                                                         "f16", "variant", "few_ws",
                                                         "idx_ahead", "deq_prefetch",
                                                         "persist"}
    assert gl_launch.heads_bucket(8) == 8 and gl_launch.heads_bucket(9) == 16
    assert gl_launch.tokens_bucket(1) == 1 and gl_launch.tokens_bucket(2) == 7
    assert gl_launch.tokens_bucket(7) == 7 and gl_launch.tokens_bucket(8) == 32
    assert gl_launch.tokens_bucket(32) == 32 and gl_launch.tokens_bucket(129) == 1 << 30
    assert gl_launch.parse_shape("8:16:3") == {"num_warps": 8, "block_h": 16, "stages": 3}
    assert gl_launch.parse_shape("4:0:3") == {"num_warps": 4, "stages": 3}
    assert gl_launch.parse_shape("4:8:3:h") == {"num_warps": 4, "block_h": 8, "stages": 3,
                                                "f16": True}
    assert gl_launch.parse_shape(gl_launch.FEW_WS_SHAPE) == {"num_warps": 4, "block_h": 8,
                                                             "stages": 2, "few_ws": True}
    assert gl_launch.parse_shape(gl_launch.FEW_WS16_SHAPE)["block_h"] == 16
    assert gl_launch.parse_shape("4:8:2:W:0:p") == {"num_warps": 4, "block_h": 8, "stages": 2,
                                                    "few_ws": True, "persist": True,
                                                    "idx_ahead": 0, "deq_prefetch": True}
    with pytest.raises(ValueError, match="launch shape"):
        gl_launch.parse_shape("4:8:2:h:0")
    assert gl_launch.parse_shape("4:8:2:w:0") == {"num_warps": 4, "block_h": 8, "stages": 2,
                                                  "few_ws": True, "idx_ahead": 0}
    assert gl_launch.parse_shape("8:64:2:3:0")["idx_ahead"] == 0
    assert gl_launch.parse_shape("4:8:2:w:1:p") == {"num_warps": 4, "block_h": 8, "stages": 2,
                                                    "few_ws": True, "idx_ahead": 1,
                                                    "deq_prefetch": True}
    assert gl_launch.IDX_AHEAD in (0, 1)
    for bad in ("4:8:3:x", "4:8:2:h:2", "4:8:2:w:2", "4:8:2:w:3", "8:64:2:3:2", "4:8:2:w:-1",
                "4:8:2:w:1:q", "8:64:2:3:1:p", "4:8:2:w::p", "4:8:2::2", "4:8:2:w:2:1"):
        with pytest.raises(ValueError, match="launch shape"):
            gl_launch.parse_shape(bad)


def test_gluon_ctas_per_sm_and_splits():
    """Two resident CTAs per SM only for one ring stage, 4 warps, 8-head tiles and no 584
    records mixed with 528/288; splits then fill twice the SMs."""
    from types import SimpleNamespace as K
    from dsv41_triton.attention.gluon import launch as gl_launch
    a584, a528, b288 = K(src=584), K(src=528), K(src=288)
    assert gl_launch.ctas_per_sm(1, 4, 8, a584, a584) == 2
    assert gl_launch.ctas_per_sm(1, 4, 8, a528, b288) == 2
    assert gl_launch.ctas_per_sm(1, 4, 8, a584, None) == 2
    assert gl_launch.ctas_per_sm(1, 4, 8, a584, b288) == 1
    assert gl_launch.ctas_per_sm(1, 4, 16, a584, a584) == 1
    assert gl_launch.ctas_per_sm(3, 4, 8, a584, a584) == 1
    assert gl_launch.ctas_per_sm(1, 8, 8, a584, a584) == 1
    assert gl_launch.default_shape(128, 8, 640, 132 * 2) == (8, 2)
    assert gl_launch.default_shape(128, 8, 640, 132) == (8, 1)
    assert gl_launch.default_shape(1, 8, 640, 264) == (8, 10)
    assert gl_launch.default_shape(512, 8, 640, 264) == (8, 1)


def test_gluon_not_picked_without_gpu():
    """On the CPU (or with the gate closed) the auto path never takes the Gluon kernel."""
    from dsv41_triton.attention.gluon import launch as gl_launch
    args = _case_cpu()
    o, lse = sparse_mla_decode(**args)  # the tl kernel (interpreter on the CPU)
    ro, rl = sparse_mla_decode_ref(**args)
    assert rel_err(o, ro) <= OUT_TOL and max_abs_err(lse, rl) <= LSE_TOL
    if not torch.cuda.is_available():
        assert not gl_launch.usable(args["q"], None, None)


def _case_cpu():
    return _case("cpu" if not torch.cuda.is_available() else "cuda", 2, 3, 584, 288, Ws=20,
                 K=30, page=16, nb_a=2, nb_b=3)


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------
def _slots(T, W, nslots, device, p_neg=0.1):
    idx = torch.randint(0, nslots, (T, W), dtype=torch.int32)
    idx[torch.rand(T, W) < p_neg] = -1
    return idx.to(device)


def _case(device, T, H, swa_rec, extra_rec, Ws=150, K=300, page=64, nb_a=8, nb_b=16,
          sink="rand", ragged=True):
    ca = random_k_cache(nb_a, page, swa_rec, device)
    ia = _slots(T, Ws, nb_a * page, device)
    la = (torch.randint(0, Ws + 1, (T,), dtype=torch.int32) if ragged
          else torch.full((T,), Ws, dtype=torch.int32)).to(device)
    cb = ib = lb = None
    if extra_rec:
        cb = random_k_cache(nb_b, page, extra_rec, device)
        ib = _slots(T, K, nb_b * page, device)
        lb = (torch.randint(0, K + 1, (T,), dtype=torch.int32) if ragged
              else torch.full((T,), K, dtype=torch.int32)).to(device)
    q = torch.randn(T, H, 512).to(torch.bfloat16).to(device)
    s = {"rand": torch.randn(H), "-inf": torch.full((H,), float("-inf")),
         "large": torch.full((H,), 80.0), "+inf": torch.full((H,), float("inf")),
         "none": None}[sink]
    return dict(q=q, swa_cache=ca, swa_indices=ia, swa_lens=la, extra_cache=cb,
                extra_indices=ib, extra_lens=lb,
                attn_sink=s.to(device) if s is not None else None)


def _v41(device, T, H, swa_rec=584, extra_rec=584, nb=512, page=64, W=128, K=512):
    ca = random_k_cache(nb, page, swa_rec, device)
    cb = random_k_cache(nb, page, extra_rec, device)
    return dict(q=torch.randn(T, H, 512, device=device).to(torch.bfloat16), swa_cache=ca,
                swa_indices=torch.randint(0, nb * page, (T, W), dtype=torch.int32, device=device),
                swa_lens=torch.randint(1, W + 1, (T,), dtype=torch.int32, device=device),
                extra_cache=cb,
                extra_indices=torch.randint(0, nb * page, (T, K), dtype=torch.int32,
                                            device=device),
                extra_lens=torch.randint(0, K + 1, (T,), dtype=torch.int32, device=device),
                attn_sink=torch.randn(H, device=device))


def _check_graph_replay(device, T, H, swa_rec, extra_rec):
    """A CUDA graph of ``sparse_mla_decode`` captured on one V4.1 case (``_v41``) and replayed on
    fresh inputs copied into its buffers matches the reference."""
    static = _v41(device, T, H, swa_rec, extra_rec)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device)
    fresh = _v41(device, T, H, swa_rec, extra_rec)
    assert_graph_replay(sparse_mla_decode, static, {n: fresh[n] for n in GRAPH_INPUTS}, out,
                        sparse_mla_decode_ref, out_tol=OUT_TOL, lse_tol=LSE_TOL, _kernel="gluon")


def _check(args, out=None, scale=None):
    T, H = args["q"].shape[:2]
    if out is None:
        out = poison_(torch.empty(T, H, 512, dtype=torch.bfloat16, device=args["q"].device))
    o, lse = sparse_mla_decode(**args, softmax_scale=scale, out=out, _kernel="gluon")
    assert o.data_ptr() == out.data_ptr()
    ro, rl = sparse_mla_decode_ref(**args, softmax_scale=scale)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    e_o, e_l = rel_err(o, ro), max_abs_err(lse, rl)
    assert e_o <= OUT_TOL, e_o
    assert e_l <= LSE_TOL, e_l
    return o, lse


def _hostile_case(device, H):
    """4 tokens of ``H`` heads (528 window, 288 extra keys, 2 blocks of 64 slots each) whose slot
    ids are INT32_MAX / INT32_MIN / one past the last slot / 10**9 in places, window lens past
    the width and negative."""
    args = _case(device, 4, H, 528, 288, Ws=70, K=90, page=64, nb_a=2, nb_b=2)
    ia, ib = args["swa_indices"], args["extra_indices"]
    ia[:, ::3] = 2 ** 31 - 1
    ia[:, 1::5] = -(2 ** 31)
    ib[:, ::4] = 2 * 64  # exactly one past the last slot
    ib[:, 2::7] = 10 ** 9
    args["swa_lens"][:] = torch.tensor([70, 10 ** 6, -5, 33], dtype=torch.int32)
    return args


def _wide_ids_case(device, H, swa_rec=528, extra_rec=288):
    """4 tokens of int64 slot ids, some of them 2**32 + (a valid slot), 2**33 + 3, -2**40 or
    INT64_MIN: out of range at 64 bits (skipped), valid if truncated to 32 (as a kernel that
    compared after narrowing would read them)."""
    args = _case(device, 4, H, swa_rec, extra_rec, Ws=70, K=90, page=64, nb_a=2, nb_b=2)
    ia = args["swa_indices"].to(torch.int64)
    ib = args["extra_indices"].to(torch.int64)
    ia[:, ::3] += 2 ** 32
    ia[:, 1::7] = -(2 ** 63)
    ib[:, ::4] += 2 ** 32
    ib[:, 1::5] = 2 ** 33 + 3
    ib[:, 2::9] = -(2 ** 40)
    args["swa_indices"], args["extra_indices"] = ia, ib
    return args


def _empty_rows_case(device, T, H, swa_rec, extra_rec, sink="rand"):
    """``_case`` with token 0 of len 0 and, for ``T > 1``, token 1 of only ``-1`` and token 2
    of only slots past the cache (``_check_empty_rows``)."""
    args = _case(device, T, H, swa_rec, extra_rec, sink=sink)
    extra = args["extra_lens"] is not None
    args["swa_lens"][0] = 0
    if extra:
        args["extra_lens"][0] = 0
    if T > 1:
        args["swa_indices"][1] = -1
        args["swa_indices"][2] = 10 ** 6
        if extra:
            args["extra_indices"][1] = -1
            args["extra_indices"][2] = 10 ** 7
    return args


def _check_empty_rows(args):
    """``_check`` of an ``_empty_rows_case``: its rows without keys are 0 with lse +inf."""
    T = args["q"].shape[0]
    o, lse = _check(args)
    assert (o[0] == 0).all() and torch.isinf(lse[0]).all() and (lse[0] > 0).all()
    if T > 1:
        assert (o[1:3] == 0).all() and torch.isinf(lse[1:3]).all()
    return o, lse


def _check_layouts(device, H, K, swa_rec, extra_rec):
    """Padded block stride, 4-D cache view, odd page size (5), strided q/out, int64 window
    ids, 3 tokens of ``H`` heads and ``K`` extra keys; nothing outside the owned rows of the
    poisoned output is written."""
    T, page = 3, 5
    fmt = get_record_format(swa_rec)
    ca = random_k_cache(7, page, swa_rec, device,
                        block_stride=fmt.block_bytes(page) + 576 * 2)
    cb = random_k_cache(11, page, extra_rec, device)
    ia = _slots(T, 19, 7 * page, device).long()
    ib = _slots(T, K, 11 * page, device)
    la = torch.tensor([19, 3, 11], dtype=torch.int32, device=device)
    qbig = torch.randn(T, 2 * H, 1024).to(torch.bfloat16).to(device)
    q = qbig[:, ::2, 256:768]
    obig = poison_(torch.empty(T, H + 2, 600, dtype=torch.bfloat16, device=device))
    out = obig[:, 1:H + 1, 50:562]
    args = dict(q=q, swa_cache=ca.unsqueeze(2), swa_indices=ia, swa_lens=la, extra_cache=cb,
                extra_indices=ib, extra_lens=None, attn_sink=torch.randn(H, device=device))
    _check(args, out=out)
    _check(args, out=out, scale=0.01)
    assert torch.isnan(obig[:, 0]).all() and torch.isnan(obig[:, H + 1]).all()
    assert torch.isnan(obig[:, :, :50]).all() and torch.isnan(obig[:, :, 562:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("H", [1, 3, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("swa_rec,extra_rec", PAIRS)
def test_gluon_records_heads_gpu(device, H, swa_rec, extra_rec):
    _need_gluon_gpu()
    _check(_case(device, 7, H, swa_rec, extra_rec))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 7, 128, 512])
@pytest.mark.parametrize("H", [8, 64])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288)])
def test_gluon_v41_shapes_gpu(device, T, H, swa_rec, extra_rec):
    _need_gluon_gpu()
    _check(_v41(device, T, H, swa_rec, extra_rec))


@pytest.mark.gpu
@pytest.mark.parametrize("sink", ["none", "-inf", "large", "rand"])
@pytest.mark.parametrize("T", [1, 7])
def test_gluon_sinks_gpu(device, sink, T):
    _need_gluon_gpu()
    _check(_case(device, T, 8, 584, 288, sink=sink))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5])
def test_gluon_empty_rows_gpu(device, T):
    """Rows with len 0, rows of only -1, rows whose every slot is past the cache."""
    _need_gluon_gpu()
    _check_empty_rows(_empty_rows_case(device, T, 8, 584, 528))


@pytest.mark.gpu
def test_gluon_layouts_gpu(device, swa_rec=584, extra_rec=288):
    """Padded block stride, 4-D cache view, odd page size, strided q/out, int64 indices;
    nothing outside the owned rows is written."""
    _need_gluon_gpu()
    _check_layouts(device, 3, 33, swa_rec, extra_rec)


@pytest.mark.gpu
def test_gluon_int64_offsets_gpu(device):
    """A cache of > 2 GiB: slots in its last blocks have byte offsets beyond 2**31."""
    _need_gluon_gpu()
    _check(large_offset_decode_case(device))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,swa_rec,extra_rec", [(1, 8, 584, 584), (128, 8, 528, 288),
                                                   (32, 64, 584, 584)])
def test_gluon_cuda_graph_gpu(device, T, H, swa_rec, extra_rec):
    _need_gluon_gpu()
    _check_graph_replay(device, T, H, swa_rec, extra_rec)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["", "4:0:1", "4:0:1:h", "4:8:2:w", "4:16:2:w", "4:8:2:w:0",
                                   "4:8:2:w:1:p", "4:8:2:w:0:p"])
def test_gluon_hostile_indices_gpu(device, monkeypatch, shape):
    """Slot ids far past the cache, INT32_MAX/MIN, lens past the width and negative: nothing
    out of bounds is read (run under compute-sanitizer memcheck in perf/run_gpu.sh); the pick
    table's shape and the one-stage ones."""
    _need_gluon_gpu()
    if shape:
        monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    _check(_hostile_case(device, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["4:0:3", "4:0:1", "4:0:1:h", "4:8:2:w", "4:8:2:w:0",
                                   "4:8:2:w:1:p", "4:8:2:w:0:p", "4:16:2:w", "8:64:2",
                                   "8:64:2:3", "8:64:2:3:0"])
def test_gluon_wide_ids_gpu(device, monkeypatch, shape):
    """int64 slot ids outside ``[0, rows)`` only at 64 bits (2**32 + a valid slot, ...) are
    skipped, as the reference and the tl kernel skip them, by every Gluon decode kernel."""
    _need_gluon_gpu()
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    args = _wide_ids_case(device, 64 if shape.startswith("8:64") else 3)
    _check(args)
    o_tl, _ = sparse_mla_decode(**args, _kernel="tl")
    o_ref, _ = sparse_mla_decode_ref(**args)
    assert rel_err(o_tl, o_ref) <= OUT_TOL


@pytest.mark.gpu
def test_gluon_forced_refused_off_sm90(device):
    """``_kernel='gluon'`` on a machine where it cannot run raises (never silently falls back)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if gluon_pkg.AVAILABLE and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("the kernel runs here")
    args = _case(device, 2, 8, 584, 584)
    with pytest.raises(ValueError, match="_kernel"):
        sparse_mla_decode(**args, _kernel="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["8:16:3", "4:16:2"])
@pytest.mark.parametrize("H", [1, 8, 16, 64])
@pytest.mark.parametrize("swa_rec,extra_rec", PAIRS)
def test_gluon_launch_shapes_gpu(device, monkeypatch, shape, H, swa_rec, extra_rec):
    """The other launch shapes the benchmark times (8 warps: two warpgroups; 2 stages)."""
    _need_gluon_gpu()
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    _check(_case(device, 7, H, swa_rec, extra_rec))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["8:16:3", "8:32:3", "8:16:2"])
@pytest.mark.parametrize("T,H", [(1, 8), (128, 8), (128, 64)])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288)])
def test_gluon_launch_shapes_v41_gpu(device, monkeypatch, shape, T, H, swa_rec, extra_rec):
    _need_gluon_gpu()
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    _check(_v41(device, T, H, swa_rec, extra_rec))


#: one ring stage, two CTAs per SM (bf16 and fp16 operands)
ONE_STAGE = ("4:0:1", "4:0:1:h")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ONE_STAGE)
@pytest.mark.parametrize("T", [1, 2, 128])
@pytest.mark.parametrize("H", [1, 3, 8, 16])
@pytest.mark.parametrize("swa_rec,extra_rec", PAIRS)
def test_gluon_one_stage_gpu(device, monkeypatch, shape, T, H, swa_rec, extra_rec):
    """One ring stage: each block's gathers are issued into the stage the previous block's
    dequant just read (its RoPE tail copied out first), under that block's products; split
    keys at T <= 2 (up to 20 splits) and at T = 128 (two splits: two CTAs per SM)."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import launch as gl_launch
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    _check(_case(device, T, H, swa_rec, extra_rec))
    assert gl_launch.LAST_LAUNCH["fwd"][1][3] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["4:8:2:w", "4:16:2:w"])
@pytest.mark.parametrize("T", [1, 2, 7, 128])
@pytest.mark.parametrize("H", [1, 3, 8, 16, 24])
@pytest.mark.parametrize("swa_rec,extra_rec", PAIRS)
def test_gluon_few_ws_gpu(device, monkeypatch, shape, T, H, swa_rec, extra_rec):
    """The warp-specialized few-heads kernel (producer, dequant and MMA partitions): every
    record pair, 1..24 heads (several head tiles of 8 or 16; 8 where 584 records meet 528
    ones), split keys at small T."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import launch as gl_launch
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    _check(_case(device, T, H, swa_rec, extra_rec))
    bh, _, _, _, kind = gl_launch.LAST_LAUNCH["fwd"][1]
    assert kind == "few_ws"
    mixed = {swa_rec, extra_rec} >= {584, 528}
    assert bh == (16 if shape == "4:16:2:w" and not mixed else 8)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["4:8:2:w:0", "4:16:2:w:0", "4:8:2:w:1:p", "4:16:2:w:0:p",
                                   "4:8:2:w:0:p"])
@pytest.mark.parametrize("T", [1, 7, 128])
@pytest.mark.parametrize("H", [3, 16])
@pytest.mark.parametrize("swa_rec,extra_rec", PAIRS)
def test_gluon_few_ws_idx_preload_gpu(device, monkeypatch, shape, T, H, swa_rec, extra_rec):
    """The warp-specialized few-heads kernel with its slot ids preloaded 8 blocks at a time
    (0) and / or the dequant group prefetch (p): every record pair, CTAs with fewer blocks than
    a preload chunk (split keys at T = 1), more than one chunk (T = 128: 10 blocks)."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import launch as gl_launch
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    _check(_case(device, T, H, swa_rec, extra_rec))
    assert gl_launch.LAST_LAUNCH["fwd"][1][4] == "few_ws"


@pytest.mark.gpu
@pytest.mark.parametrize("shape,H", [("4:8:2:w", 8), ("4:16:2:w", 16),
                                     ("4:8:2:w:0", 8), ("4:8:2:w:1:p", 8), ("4:16:2:w:0:p", 16),
                                     ("4:8:2:w:0:p", 8)])
@pytest.mark.parametrize("T", [1, 5, 512])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288)])
def test_gluon_few_ws_edges_gpu(device, monkeypatch, shape, H, T, swa_rec, extra_rec):
    """The warp-specialized few-heads kernel (8- and 16-head tiles): empty rows (len 0, only
    -1, only slots past the cache) under a -inf sink, V4.1 widths, a CUDA-graph replay."""
    _need_gluon_gpu()
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    if T < 512:
        _check_empty_rows(_empty_rows_case(device, T, H, swa_rec, extra_rec, sink="-inf"))
    _check(_v41(device, T, H, swa_rec, extra_rec))
    _check_graph_replay(device, T, H, swa_rec, extra_rec)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["4:8:2:w", "4:16:2:w:0:p", "4:8:2:w:0:p"])
@pytest.mark.parametrize("T", [1, 5, 300, 1000])
@pytest.mark.parametrize("H", [3, 16])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288), (584, None)])
def test_gluon_few_ws_persistent_gpu(device, monkeypatch, shape, T, H, swa_rec, extra_rec):
    """The few-heads ws kernel on its persistent grid (shape field ``W``: at most one CTA
    per SM, each looping over items with its ring running on): ragged and empty rows (len 0,
    only -1, only slots past the cache) among more items than SMs (T = 300, 1000; a CTA's
    items of different block counts back to back), split keys at T <= 5, a CUDA-graph
    replay."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import launch as gl_launch
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape.replace(":w", ":W"))
    _check_empty_rows(_empty_rows_case(device, T, H, swa_rec, extra_rec))
    assert gl_launch.LAST_LAUNCH["persist"] is True
    assert gl_launch.LAST_LAUNCH["fwd"][1][4] == "few_ws"
    if extra_rec is None:
        return
    _check_graph_replay(device, T, H, swa_rec, extra_rec)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["4:8:2:W", "4:8:2:W:0"])
@pytest.mark.parametrize("T", [1, 5, 300, 1000])
@pytest.mark.parametrize("H", [1, 3, 8, 13])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 528), (584, None),
                                               (528, None)])
def test_gluon_few_ds_gpu(device, monkeypatch, shape, T, H, swa_rec, extra_rec):
    """The few-heads kernel's dequant + S form with bf16 operands (``decode_few_ds.py``: two
    dequant warpgroups taking the blocks in turn, S^T from the registers they converted) on its
    persistent grid: ragged and empty rows (len 0, only -1, only slots past the cache) among
    more items than SMs, 1..13 heads (two head tiles at 13), split keys at T <= 5, a CUDA-graph
    replay. (The fp16 form, the paged prefill's default: ``test_gluon_few_ds_f16_gpu``.)"""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import launch as gl_launch
    monkeypatch.setattr(gl_launch, "OVERRIDE", {**gl_launch.parse_shape(shape), "ds": True,
                                                "ds_f16": False, "ds_split": 0})
    _check_empty_rows(_empty_rows_case(device, T, H, swa_rec, extra_rec))
    assert gl_launch.LAST_LAUNCH["fwd"][1][4] == "few_ds"
    _check(_case(device, T, H, swa_rec, extra_rec))
    if extra_rec is None:
        return
    _check_graph_replay(device, T, H, swa_rec, extra_rec)
    assert gl_launch.LAST_LAUNCH["fwd"][1][4] == "few_ds"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("H", [1, 8, 13])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, None)])
@pytest.mark.parametrize("split,ahead", [(0, 1), (1, 1), (4, 1), (4, 2)])
def test_gluon_few_ds_f16_gpu(device, monkeypatch, T, H, swa_rec, extra_rec, split, ahead):
    """The dequant + S form with fp16 operands (override key ``ds_f16``: each block's tiles in
    its own power-of-two units, the MMA warpgroup's running exponent; ``ds_split``: the key
    tiles freed in two parts; ``ds_ahead``: the producer's ids that many blocks ahead with 584
    records): ragged and empty rows, 1..13 heads, split keys at T <= 5, and every other page's
    keys 2**12 smaller (blocks of different exponents: the accumulators rescaled between
    blocks)."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import launch as gl_launch
    monkeypatch.setattr(gl_launch, "OVERRIDE", {**gl_launch.parse_shape("4:8:2:W:0"),
                                                "ds": True, "ds_f16": True, "ds_split": split,
                                                "ds_ahead": ahead})
    _check_empty_rows(_empty_rows_case(device, T, H, swa_rec, extra_rec))
    assert gl_launch.LAST_LAUNCH["fwd"][1][4] == "few_ds"
    args = _case(device, T, H, swa_rec, extra_rec)
    ca = args["swa_cache"]
    ca[1::2].copy_(random_k_cache(ca.shape[0], ca.shape[1], swa_rec, device,
                                  scale=2.0 ** -12)[1::2])
    _check(args)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 300])
@pytest.mark.parametrize("H", [1, 8, 13])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, None)])
@pytest.mark.parametrize("split,ahead", [(0, 1), (4, 2)])
@pytest.mark.parametrize("pv,sm", [(True, True), (True, False), (False, True)])
def test_gluon_few_ds_sync_gpu(device, monkeypatch, T, H, swa_rec, extra_rec, split, ahead, pv,
                               sm):
    """The fp16 dequant + S form with its MMA warpgroup's softmax per warp and ``O^T`` by
    ``mma.sync`` on or off (override key ``ds_pvsync``) and its logits masked by the dequant +
    S warpgroups on or off (``ds_smask``): as ``test_gluon_few_ds_f16_gpu``."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import launch as gl_launch
    monkeypatch.setattr(gl_launch, "OVERRIDE", {**gl_launch.parse_shape("4:8:2:W:0"),
                                                "ds": True, "ds_f16": True, "ds_split": split,
                                                "ds_ahead": ahead, "ds_pvsync": pv,
                                                "ds_smask": sm})
    _check_empty_rows(_empty_rows_case(device, T, H, swa_rec, extra_rec))
    k = gl_launch.LAST_LAUNCH["fwd"]
    assert k[1][4] == "few_ds"
    args = _case(device, T, H, swa_rec, extra_rec)
    ca = args["swa_cache"]
    ca[1::2].copy_(random_k_cache(ca.shape[0], ca.shape[1], swa_rec, device,
                                  scale=2.0 ** -12)[1::2])
    _check(args)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ONE_STAGE)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288)])
def test_gluon_one_stage_edges_gpu(device, monkeypatch, shape, T, swa_rec, extra_rec):
    """One ring stage: empty rows (len 0, only -1, only slots past the cache), a -inf sink,
    V4.1 widths."""
    _need_gluon_gpu()
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    _check_empty_rows(_empty_rows_case(device, T, 8, swa_rec, extra_rec, sink="-inf"))
    _check(_v41(device, T, 8, swa_rec, extra_rec))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_gluon_nan_sink_gpu(device, monkeypatch, splits, swa_rec=584, extra_rec=288):
    """A NaN sink: every row of its head is NaN, a token without keys included; the other
    heads as the reference (0 / +inf for that token); lse unaffected (the kernel's own
    epilogue and, with splits, the merge kernel)."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import launch as gl_launch
    shape = gl_launch.default_shape
    monkeypatch.setattr(gl_launch, "default_shape", lambda *a: (shape(*a)[0], splits))
    args = _case(device, 3, 8, swa_rec, extra_rec)
    args["attn_sink"][5] = float("nan")
    args["swa_lens"][1] = 0
    args["extra_lens"][1] = 0
    out = poison_(torch.empty(3, 8, 512, dtype=torch.bfloat16, device=device))
    o, lse = sparse_mla_decode(**args, out=out, _kernel="gluon")
    assert gl_launch.LAST_LAUNCH["fwd"][1][1] == splits
    ro, rl = sparse_mla_decode_ref(**args)
    assert torch.isnan(o[:, 5]).all() and torch.isnan(ro[:, 5]).all()
    keep = [0, 1, 2, 3, 4, 6, 7]
    assert rel_err(o[:, keep], ro[:, keep]) <= OUT_TOL
    assert (o[1, keep] == 0).all()
    assert max_abs_err(lse, rl) <= LSE_TOL and (lse[1] == float("inf")).all()


# --------------------------------------------------------------------------------------------
# GPU: the fp16-operand variant (launch shape suffix ":h", the kernel's F16)
# --------------------------------------------------------------------------------------------
F16_SHAPE = "4:0:3:h"


@pytest.fixture
def f16_shape(monkeypatch):
    """Run the Gluon kernel with fp16 operands (default block_h / splits)."""
    monkeypatch.setenv("DSV41_GLUON_SHAPE", F16_SHAPE)
    return F16_SHAPE


def _last_is_f16():
    from dsv41_triton.attention.gluon import launch as gl_launch
    return gl_launch.LAST_LAUNCH["fwd"][1][-1] == "f16"


def _f16_covers(swa_rec, extra_rec):
    """The fp16 variant runs 584-only and 528/288-only pairs; 584 mixed with 528/288 falls
    back to bf16 operands."""
    recs = {swa_rec} | ({extra_rec} if extra_rec else set())
    return recs == {584} or 584 not in recs


F16_PAIRS = [p for p in PAIRS if _f16_covers(*p)]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 7, 128])
@pytest.mark.parametrize("H", [1, 3, 8, 16])
@pytest.mark.parametrize("swa_rec,extra_rec", PAIRS)
def test_gluon_f16_records_gpu(device, f16_shape, T, H, swa_rec, extra_rec):
    """Every record pair, few heads, 1..128 tokens, ragged lens, -1 slots, random sink (pairs
    of 584 with 528/288: the bf16 fallback)."""
    _need_gluon_gpu()
    _check(_case(device, T, H, swa_rec, extra_rec))
    assert _last_is_f16() == _f16_covers(swa_rec, extra_rec)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["4:8:3:h", "4:16:2:h"])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288), (528, 528)])
def test_gluon_f16_head_tiles_gpu(device, monkeypatch, shape, swa_rec, extra_rec):
    """16 heads as two tiles of 8; 2 stages."""
    _need_gluon_gpu()
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    _check(_case(device, 7, 16, swa_rec, extra_rec))
    _check(_v41(device, 128, 16, swa_rec, extra_rec))
    assert _last_is_f16()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 7, 128])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288)])
def test_gluon_f16_v41_gpu(device, f16_shape, T, swa_rec, extra_rec):
    _need_gluon_gpu()
    _check(_v41(device, T, 8, swa_rec, extra_rec))


@pytest.mark.gpu
@pytest.mark.parametrize("sink", ["none", "-inf", "large", "+inf"])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288)])
def test_gluon_f16_sinks_gpu(device, f16_shape, sink, swa_rec, extra_rec):
    _need_gluon_gpu()
    o, _ = _check(_case(device, 7, 8, swa_rec, extra_rec, sink=sink))
    if sink == "+inf":
        assert (o == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288)])
def test_gluon_f16_nan_sink_gpu(device, f16_shape, monkeypatch, splits, swa_rec, extra_rec):
    test_gluon_nan_sink_gpu(device, monkeypatch, splits, swa_rec, extra_rec)
    assert _last_is_f16()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288), (584, 528)])
def test_gluon_f16_empty_rows_gpu(device, f16_shape, T, swa_rec, extra_rec):
    """len 0, only -1, only slots past the cache: out 0, lse +inf."""
    _need_gluon_gpu()
    _check_empty_rows(_empty_rows_case(device, T, 8, swa_rec, extra_rec))


@pytest.mark.gpu
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288), (528, 528)])
@pytest.mark.parametrize("mag", [2.0 ** 20, 2.0 ** -30, "mixed"])
def test_gluon_f16_q_range_gpu(device, f16_shape, swa_rec, extra_rec, mag):
    """|q| far outside fp16 (2**20: amax ~ 4e6 > 65504; 2**-30: below fp16's subnormals) with
    the softmax scale compensating, and heads 2**26 apart in one tile (not larger: with logits
    ~2**8 times the usual, |lse| ~ 1e3-1e4 and fp32's ulp there is ~1e-3, the lse tolerance)."""
    _need_gluon_gpu()
    args = _case(device, 7, 8, swa_rec, extra_rec)
    q = args["q"].float()
    scale = 512 ** -0.5
    if mag == "mixed":
        q[:, 0] *= 2.0 ** 6
        q[:, 1] *= 2.0 ** -20
        q[:, 2] *= 2.0 ** -8
    else:
        q *= mag
        scale /= mag
    args["q"] = q.to(torch.bfloat16)
    _check(args, scale=scale)
    assert _last_is_f16()


def _poison_slot(cache, record, slot, page):
    """Make ``slot``'s record decode to NaN: an e4m3 data byte 0x7F (584/528) or, for e2m1
    records, the first e4m3 scale byte."""
    from dsv41_triton.ops.records import record_views
    dv, sv = record_views(cache, get_record_format(record))
    b, o = divmod(slot, page)
    if record == 288:
        sv[b, o, 0] = 0x7F
    else:
        dv[b, o, 100] = 0x7F


def _selects(indices, lens, slot, rows):
    """[T] bool: token t reads ``slot`` (among its first ``lens[t]`` columns)."""
    W = indices.shape[1]
    cols = torch.arange(W, device=indices.device)[None, :]
    ok = (cols < lens.clamp(0, W)[:, None]) & (indices == slot)
    return ok.any(1) & (slot < rows)


#: (launch shape, heads, record pairs) of the NaN-key test: fp16 operands, bf16 operands, the
#: many-heads kernel (decode_heads.py)
NAN_KEY_CASES = ([(F16_SHAPE, 8, p) for p in F16_PAIRS if p[1]]
                 + [("4:0:3:b", 8, p) for p in PAIRS if p[1]]
                 + [("4:0:1:b", 8, p) for p in PAIRS if p[1]]
                 + [("4:0:1:h", 8, p) for p in F16_PAIRS if p[1]]
                 + [("8:64:2", 16, p) for p in PAIRS if p[1]])


@pytest.mark.gpu
@pytest.mark.parametrize("shape,H,pair", NAN_KEY_CASES)
def test_gluon_nan_keys_gpu(device, monkeypatch, shape, H, pair):
    """A key that decodes to NaN (an e4m3 data byte 0x7F, or 288's e4m3 scale byte 0x7F): the
    tokens that select it are NaN (every head, out and lse), the others as the reference
    (docs/semantics.md), in every Gluon variant."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import launch as gl_launch
    monkeypatch.setenv("DSV41_GLUON_SHAPE", shape)
    swa_rec, extra_rec = pair
    T, page = 6, 64
    args = _case(device, T, H, swa_rec, extra_rec, page=page)
    ia, ib, la, lb = (args[k] for k in ("swa_indices", "extra_indices", "swa_lens",
                                        "extra_lens"))
    la[0], lb[1] = max(int(la[0]), 1), max(int(lb[1]), 1)
    sa, sb = 7, 9
    ia[0, 0], ib[1, 0] = sa, sb
    ia[ia == sa] = -1
    ia[0, 0] = sa
    ib[ib == sb] = -1
    ib[1, 0] = sb
    ia[3, :2] = sa  # token 3 selects the window slot only if its len covers it
    la[3] = 1
    _poison_slot(args["swa_cache"], swa_rec, sa, page)
    _poison_slot(args["extra_cache"], extra_rec, sb, page)
    out = poison_(torch.empty(T, H, 512, dtype=torch.bfloat16, device=device))
    o, lse = sparse_mla_decode(**args, out=out, _kernel="gluon")
    if shape.endswith(":h"):
        assert _last_is_f16()
    elif shape.endswith(":b"):
        assert not _last_is_f16()
    else:
        assert gl_launch.LAST_LAUNCH["fwd"][1][0] == 64
    ro, rl = sparse_mla_decode_ref(**args)
    bad = torch.zeros(T, dtype=torch.bool, device=device)
    bad[[0, 1, 3]] = True
    assert torch.isnan(ro[bad]).all() and torch.isnan(rl[bad]).all()
    assert not torch.isnan(ro[~bad]).any()
    assert torch.isnan(o[bad]).all() and torch.isnan(lse[bad]).all()
    assert rel_err(o[~bad], ro[~bad]) <= OUT_TOL
    assert max_abs_err(lse[~bad], rl[~bad]) <= LSE_TOL


@pytest.mark.gpu
def test_gluon_f16_int64_offsets_gpu(device, f16_shape):
    _need_gluon_gpu()
    _check(large_offset_decode_case(device))
    assert _last_is_f16()


@pytest.mark.gpu
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288)])
def test_gluon_f16_layouts_gpu(device, f16_shape, swa_rec, extra_rec):
    test_gluon_layouts_gpu(device, swa_rec, extra_rec)
    assert _last_is_f16()


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,swa_rec,extra_rec", [(1, 8, 584, 584), (128, 8, 528, 288),
                                                   (7, 16, 528, 528)])
def test_gluon_f16_cuda_graph_gpu(device, f16_shape, T, H, swa_rec, extra_rec):
    test_gluon_cuda_graph_gpu(device, T, H, swa_rec, extra_rec)
    assert _last_is_f16()
