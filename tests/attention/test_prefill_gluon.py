"""The Gluon Hopper prefill kernel (``attention/gluon/prefill.py``) against the float64 reference.

CPU: a compile-only check for an sm_90 target, run when the installed Triton has the Gluon API
the kernel needs (skipped otherwise, e.g. Triton 3.9); the pick table. GPU-marked: head counts
1..128 (64-head tiles, padded), tokens 1..128 (and up to 1000: many items per CTA of the
persistent variant), ragged lens, ``-1`` and out-of-range rows,
empty rows, sinks (none, -inf, large, +inf, NaN), NaN propagation, layouts, int64 indices,
a > 2 GiB workspace, CUDA graphs, hostile indices; skipped where the kernel cannot run.
"""
import os

import pytest
import torch

from dsv41_triton.attention import gluon as gluon_pkg
from dsv41_triton.attention.prefill import sparse_mla_prefill
from dsv41_triton.attention.ref import sparse_mla_prefill_ref
from dsv41_triton.testing import assert_graph_replay, max_abs_err, poison_, rel_err
from test_decode_gluon import _compile_facts, _need_gluon_gpu

OUT_TOL = 1e-2
LSE_TOL = 1e-3
VARIANTS = ("eager", "lazy", "ws", "wsp", "few")
#: the kernel the contract tests pin: "table" (the pick table's variant), "ws" (the
#: warp-specialized kernel, gluon/prefill_ws.py), "wsp" (its persistent form,
#: gluon/prefill_wsp.py), "few" (the few-heads kernel, gluon/prefill_few.py; "eager" where it
#: cannot run: more than 8 heads, int64 indices)
PINS = ("table", "ws", "wsp", "few")


@pytest.fixture(params=PINS)
def pin(request, monkeypatch):
    """Pins the Gluon variant of every ``_kernel='gluon'`` call in the test."""
    from dsv41_triton.attention.gluon import prefill_launch as pl
    if request.param != "table":
        monkeypatch.setenv(pl.VARIANT_ENV, request.param)
    return request.param


# --------------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lazy,variant", [(True, "0"), (False, "0"), (False, "ws"),
                                          (False, "wsp")])
def test_gluon_prefill_compiles_for_sm90(lazy, variant):
    """The kernel compiles for sm_90 on this machine (in a subprocess without the interpreter);
    wgmma and cp.async are in the PTX, shared memory fits; the warp-specialized ones set their
    partitions' register budgets (setmaxnreg) and spill nothing."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    facts = _compile_facts("prefill", int(lazy), variant)
    assert facts["wgmma"] and facts["cp_async"], facts
    assert 0 < facts["shared"] <= 227 * 1024, facts
    assert 0 < facts["regs"] <= 255, facts
    if variant != "0":
        assert facts["setmaxnreg"], facts
        # ptxas did not serialize the wgmmas (it waits after every one when it cannot keep
        # their registers: "insufficient register resources")
        assert 4 * facts["wgmma_waits"] < facts["hgmma"], facts
        assert facts["stack"] == 0 and facts["local_st"] == 0, facts
        assert all(lp["local_ld_st"] == 0 for lp in facts["loops"]), facts


def _prefill_module(variant: str) -> str:
    """The module of the prefill kernel a variant names."""
    return {"wsp": "prefill_wsp", "ws": "prefill_ws"}.get(variant, "prefill")


@pytest.mark.parametrize("H", [64, 128])
def test_gluon_prefill_pick_compiles_at_launch_values(H):
    """The picked prefill (``prefill_launch.PICK``): ``prefill_launch.launch`` run on the CPU
    at the benchmark's shape with recording kernels starts the picked variant's kernel once,
    and that launch compiled as the GPU builds it (integers specialized on the values passed:
    1 -> constant, i32 by range, 16-divisible marked) has no stack, i.e. nothing spilled (on the
    H200 this specialization reproduced the spill sizes the GPU build reported)."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    import json
    from dsv41_triton.attention.gluon import prefill_launch as pl
    variant = pl.PICK[(9, 0)][H]
    rows = _compile_facts("launch", json.dumps(dict(kind="prefill", T=4096, H=H, S=36991,
                                                    K=640)))
    module = _prefill_module(variant)
    assert [r["kernel"].split(".")[0] for r in rows] == [module], rows
    assert 0 < rows[0]["regs"] <= 255 and rows[0]["stack"] == 0, rows


@pytest.mark.parametrize("variant", ["eager", "lazy", "ws", "wsp"])
@pytest.mark.parametrize("T,H,has_len", [(7, 64, True), (3, 65, False), (1, 128, True)])
def test_gluon_prefill_launch_wiring(variant, T, H, has_len):
    """``prefill_launch.launch`` on the CPU with recording kernels: one launch of the variant's
    kernel, with as many positional arguments as its non-constexpr parameters and only (and all
    required) constexprs of it, a grid of one CTA per (token, head tile) (``wsp``: at most one
    per SM); one argument short or an unknown constexpr is refused (so the check can fail)."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    from dsv41_triton.attention.gluon import compile_check as cc
    rows = cc.capture_prefill(T, H, 1000, 96, variant, has_len=has_len)
    module = _prefill_module(variant)
    assert [r["kernel"].split(".")[0] for r in rows] == [module]
    rec = rows[0]
    cc.launch_signature(rec)
    items = T * -(-H // 64)
    assert rec["grid"] == ((min(132, items),) if variant == "wsp" else (items,))
    assert rec["kwargs"]["HAS_LEN"] is has_len and rec["kwargs"]["LAZY"] is (variant == "lazy")
    with pytest.raises(ValueError, match="positional arguments"):
        cc.launch_signature(dict(rec, args=rec["args"][:-1]))
    with pytest.raises(ValueError, match="unknown"):
        cc.launch_signature(dict(rec, kwargs=dict(rec["kwargs"], NOT_A_PARAM=1)))


@pytest.mark.parametrize("T,H,K,has_len", [(4096, 8, 640, True), (7, 3, 96, False),
                                           (1, 1, 512, True)])
def test_gluon_prefill_few_launch_compiles(T, H, K, has_len):
    """The few-heads prefill (issue 11's 8-head kernel) as ``prefill_launch.launch`` starts it:
    one launch of ``prefill_few``'s kernel on at most one CTA per SM (132 here), two from 264
    tokens on (128 registers), compiled at the launch's values as the GPU builds it, with
    nothing spilled."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    import json
    rows = _compile_facts("launch", json.dumps(dict(kind="prefill", T=T, H=H, S=8192, K=K,
                                                    variant="few", has_len=has_len)))
    assert [r["kernel"] for r in rows] == ["prefill_few._sparse_mla_prefill_gluon_few_kernel"]
    two = T >= 2 * 132 and K <= 2048  # prefill_launch.few_ctas_per_sm
    assert rows[0]["grid"] == [min(132 * (2 if two else 1), T)], rows
    assert 0 < rows[0]["regs"] <= (128 if two else 255) and rows[0]["stack"] == 0, rows


@pytest.mark.parametrize("kw", [dict(form="bogus"), dict(ctas_per_sm=3),
                                dict(form="sync", ctas_per_sm=2), dict(form="movm", prior=True),
                                dict(ctas_per_sm=2, width=2049)])
def test_gluon_prefill_few_forms_are_checked(kw):
    """``_launch_few``'s knobs: an unknown form, a CTA count other than 1 / 2 (2 only for the
    wgmma form and at most 2048 index columns) and a prior for the movm form raise
    ``ValueError`` naming the argument, before any launch (CPU tensors: nothing could run)."""
    if not gluon_pkg.COMPILABLE:
        pytest.skip(f"installed Triton cannot build the Gluon kernels: {gluon_pkg.REASON}")
    from dsv41_triton.attention.gluon import prefill_launch as pl
    q = torch.randn(2, 8, 512).bfloat16()
    kw = dict(kw)
    prior = kw.pop("prior", False)
    width = kw.pop("width", 4)
    with pytest.raises(ValueError, match=next(iter(kw)) if not prior else "prior"):
        pl._launch_few(q, torch.randn(9, 512).bfloat16(),
                       torch.zeros(2, width, dtype=torch.int32), None, None, 0.1,
                       torch.empty_like(q), torch.empty(2, 8), prior, **kw)


@pytest.mark.parametrize("T,width,sms,want", [
    (264, 640, 132, 2), (263, 640, 132, 1), (4096, 2048, 132, 2), (4096, 2049, 132, 1),
    (4096, 4096, 132, 1), (1, 1, 132, 1), (160, 640, 78, 2), (155, 640, 78, 1)])
def test_gluon_prefill_few_ctas_per_sm(monkeypatch, T, width, sms, want):
    """The few-heads kernel runs two CTAs per SM from ``FEW_TWO_CTAS_TOKENS_PER_SM`` tokens per
    SM on, and only where its index slots fit twice (at most 2048 columns)."""
    if not gluon_pkg.COMPILABLE:
        pytest.skip(f"installed Triton cannot build the Gluon kernels: {gluon_pkg.REASON}")
    from dsv41_triton.attention.gluon import prefill_launch as pl
    monkeypatch.setattr(pl, "_sms", lambda device: sms)
    assert pl.FEW_TWO_CTAS_TOKENS_PER_SM == 2
    assert pl.few_ctas_per_sm(T, width, torch.device("cpu")) == want


def test_gluon_prefill_pick_table():
    """Every pick entry names a tested variant on a known heads bucket."""
    from dsv41_triton.attention.gluon import prefill_launch as pl
    for cap, table in pl.PICK.items():
        assert isinstance(cap, tuple) and len(cap) == 2
        for hb, variant in table.items():
            assert hb in (8, 16, 32, 64, 128, 1 << 30)
            assert variant in pl.VARIANTS
    assert VARIANTS == pl.VARIANTS  # the GPU tests below run every variant
    assert pl.heads_bucket(8) == 8 and pl.heads_bucket(9) == 16 and pl.heads_bucket(33) == 64
    assert pl.heads_bucket(65) == 128 and pl.heads_bucket(129) == 1 << 30


def test_gluon_prefill_pick_few_heads(monkeypatch):
    """On sm_90 the auto path takes the few-heads kernel for <= 8 heads from
    ``FEW_MIN_TOKENS`` tokens with int32 index rows it can copy, and keeps tl otherwise (one
    token, int64 ids, more than ``MAX_WIDTH`` columns); many heads keep their entries."""
    from dsv41_triton.attention.gluon import prefill_launch as pl
    MAX_WIDTH = pytest.importorskip("dsv41_triton.attention.gluon.prefill_few").MAX_WIDTH
    monkeypatch.setattr(pl, "_cap", lambda device: (9, 0))
    monkeypatch.delenv(pl.ENV, raising=False)
    dev = torch.device("cpu")
    i32 = torch.zeros(4, 640, dtype=torch.int32)
    n = pl.FEW_MIN_TOKENS
    assert pl.pick(n, 8, dev, i32) and pl.pick(n, 1, dev, i32) and pl.pick(n, 3, dev, i32)
    assert not pl.pick(n - 1, 8, dev, i32) and not pl.pick(1, 8, dev, i32)
    assert not pl.pick(n, 8, dev, i32.long())
    assert not pl.pick(n, 8, dev, torch.zeros(4, MAX_WIDTH + 1, dtype=torch.int32))
    assert pl.table_variant(8, dev, i32) == pl.FEW and pl.table_variant(8, dev) is None
    assert not pl.pick(n, 16, dev, i32) and pl.pick(1, 64, dev, i32) and pl.pick(1, 128, dev)
    assert pl.few_usable(8, i32) and not pl.few_usable(9, i32)
    assert pl.few_usable(8, torch.zeros(4, 17, dtype=torch.int32))  # any row alignment


def test_gluon_prefill_not_picked_without_gpu():
    """Without an sm_90 GPU (or with the gate closed) the auto path runs tl / the reference,
    and ``_kernel`` is validated."""
    from dsv41_triton.attention.gluon import prefill_launch as pl
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = _case(dev, 2, 3, S=40, K=30)
    o, lse = sparse_mla_prefill(**args)
    ro, rl = sparse_mla_prefill_ref(**args)
    assert rel_err(o, ro) <= OUT_TOL and max_abs_err(lse, rl) <= LSE_TOL
    if dev == "cpu":
        assert not pl.usable(args["q"], args["kv"], args["indices"])
        with pytest.raises(ValueError, match="_kernel"):
            sparse_mla_prefill(**args, _kernel="gluon")
    with pytest.raises(ValueError, match="_kernel"):
        sparse_mla_prefill(**args, _kernel="bogus")


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------
def _case(device, T, H, S=300, K=200, p_neg=0.1, p_oob=0.05, lens=True, sink="rand",
          q_scale=1.0, idx_dtype=torch.int32):
    kv = (torch.randn(S, 512) * torch.exp2(torch.randint(-2, 3, (S, 1)).float())).to(
        torch.bfloat16).to(device)
    idx = torch.randint(0, S, (T, K), dtype=torch.int64)
    r = torch.rand(T, K)
    idx[r < p_neg] = -1
    idx[(r >= p_neg) & (r < p_neg + p_oob)] = S + 3  # past the workspace: skipped
    q = (torch.randn(T, H, 512) * q_scale).to(torch.bfloat16).to(device)
    ln = torch.randint(0, K + 1, (T,), dtype=torch.int32).to(device) if lens else None
    s = {"rand": lambda: torch.randn(H), "none": lambda: None,
         "-inf": lambda: torch.full((H,), float("-inf")),
         "+inf": lambda: torch.full((H,), float("inf")),
         "large": lambda: torch.full((H,), 60.0)}[sink]()
    return dict(q=q, kv=kv, indices=idx.to(idx_dtype).to(device), lens=ln,
                attn_sink=s.to(device) if s is not None else None)


def _check(args, variant="lazy", out=None, scale=None, monkeypatch=None):
    from dsv41_triton.attention.gluon import prefill_launch as pl
    T, H = args["q"].shape[:2]
    if out is None:
        out = poison_(torch.empty(T, H, 512, dtype=torch.bfloat16, device=args["q"].device))
    if monkeypatch is not None:
        monkeypatch.setenv(pl.VARIANT_ENV, variant)
    o, lse = sparse_mla_prefill(**args, softmax_scale=scale, out=out, _kernel="gluon")
    torch.cuda.synchronize()
    pinned = variant if monkeypatch is not None else os.environ.get(pl.VARIANT_ENV)
    if pinned:
        ran = pl.LAST_LAUNCH["fwd"][1]
        few_ok = pl.few_usable(H, args["indices"])
        assert ran == (pinned if pinned != pl.FEW or few_ok else "eager"), (ran, pinned)
    assert o.data_ptr() == out.data_ptr() and lse.shape == (T, H)
    ro, rl = sparse_mla_prefill_ref(**args, softmax_scale=scale)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    e_o, e_l = rel_err(o, ro), max_abs_err(lse, rl)
    assert e_o <= OUT_TOL, e_o
    assert e_l <= LSE_TOL, e_l
    return o, lse


@pytest.mark.gpu
@pytest.mark.parametrize("H", [1, 3, 8, 16, 32, 64, 100, 128])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gluon_prefill_heads_gpu(device, monkeypatch, H, variant):
    _need_gluon_gpu()
    _check(_case(device, 7, H), variant, monkeypatch=monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 7, 128])
@pytest.mark.parametrize("H", [8, 64, 128])
@pytest.mark.parametrize("q_scale", [1.0, 8.0])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gluon_prefill_tokens_gpu(device, monkeypatch, T, H, q_scale, variant):
    """Ragged lens over 1..5 key blocks; q_scale 8 makes the running max grow often (the
    lazy rescale's branch)."""
    _need_gluon_gpu()
    _check(_case(device, T, H, S=2000, K=300, q_scale=q_scale), variant,
           monkeypatch=monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("H,K", [(8, 640), (1, 2048), (3, 2049)])
def test_gluon_prefill_few_two_ctas_gpu(device, H, K):
    """The auto path's few-heads launch with more tokens than two per SM: two CTAs per SM up to
    2048 index columns (one beyond), ragged lens, -1 and out-of-range rows, against the
    reference."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import prefill_launch as pl
    T = 2 * torch.cuda.get_device_properties(device).multi_processor_count + 5
    args = _case(device, T, H, S=5000, K=K)
    args["lens"][3] = 0
    _check(args)
    k, variant = pl.LAST_LAUNCH["fwd"]
    assert variant == pl.FEW
    assert k.n_regs == (128 if K <= 2048 else 255), k.n_regs


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
def test_gluon_prefill_v41_gpu(device, H, pin):
    """The V4.1 pattern: 512 random entries + a contiguous 128-row window, 640 keys a row."""
    _need_gluon_gpu()
    T, S = 64, 8192
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(S + T + 127, 512, generator=g).to(torch.bfloat16).to(device)
    top = torch.randint(0, S, (T, 512), generator=g)
    win = S + torch.arange(T)[:, None] + torch.arange(128)[None, :]
    idx = torch.cat([top, win], 1).to(torch.int32).to(device)
    q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(device)
    _check(dict(q=q, kv=kv, indices=idx, lens=None, attn_sink=torch.randn(H).to(device)))


@pytest.mark.gpu
@pytest.mark.parametrize("sink", ["none", "-inf", "large", "+inf", "rand"])
@pytest.mark.parametrize("H", [3, 64])
def test_gluon_prefill_sinks_gpu(device, sink, H, pin):
    _need_gluon_gpu()
    o, _ = _check(_case(device, 5, H, sink=sink))
    if sink == "large":  # exp(60) dominates the denominator
        assert o.abs().max().item() < 1e-12
    if sink == "+inf":
        assert (o == 0).all()


@pytest.mark.gpu
def test_gluon_prefill_nan_gpu(device, pin):
    """A NaN sink makes every row of its head NaN (rows without keys too), lse unaffected;
    a NaN in q or in a selected key propagates to that row's out and lse."""
    _need_gluon_gpu()
    args = _case(device, 4, 8, K=70)
    args["attn_sink"][5] = float("nan")
    args["lens"][1] = 0
    args["lens"][2] = 70
    args["q"][3, 2, 7] = float("nan")
    out = poison_(torch.empty(4, 8, 512, dtype=torch.bfloat16, device=device))
    o, lse = sparse_mla_prefill(**args, out=out, _kernel="gluon")
    ro, rl = sparse_mla_prefill_ref(**args)
    assert torch.isnan(o[:, 5]).all() and torch.isnan(ro[:, 5]).all()
    assert torch.isnan(o[3, 2]).all() and torch.isnan(lse[3, 2])
    keep = [0, 1, 2, 3, 4, 6, 7]
    ok_rows = torch.ones(4, 8, dtype=torch.bool, device=device)
    ok_rows[:, 5] = False
    ok_rows[3, 2] = False
    assert rel_err(o[ok_rows], ro[ok_rows]) <= OUT_TOL
    assert max_abs_err(lse[ok_rows], rl[ok_rows]) <= LSE_TOL
    assert (o[1, keep] == 0).all() and (lse[1] == float("inf")).all()
    # a NaN key read by token 2 (its lens cover every column; pick one valid column)
    args2 = _case(device, 3, 8, K=70, lens=False, p_neg=0.0, p_oob=0.0)
    row = int(args2["indices"][2, 11])
    args2["kv"][row, 100] = float("nan")
    hit = (args2["indices"] == row).any(1)
    o2, l2 = sparse_mla_prefill(**args2, _kernel="gluon")
    for t in range(3):
        assert bool(torch.isnan(o2[t]).all()) == bool(hit[t])
        assert bool(torch.isnan(l2[t]).all()) == bool(hit[t])


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 128])
def test_gluon_prefill_empty_rows_gpu(device, H, pin):
    """Rows with len 0, rows of only -1, rows whose every index is past the workspace, and an
    index width of 0."""
    _need_gluon_gpu()
    args = _case(device, 5, H, K=90)
    args["lens"][0] = 0
    args["indices"][1] = -1
    args["indices"][2] = 10 ** 6
    o, lse = _check(args)
    assert (o[0:3] == 0).all() and torch.isinf(lse[0:3]).all() and (lse[0:3] > 0).all()
    z = _case(device, 3, H, K=0, lens=False)
    out = poison_(torch.empty(3, H, 512, dtype=torch.bfloat16, device=device))
    o, lse = sparse_mla_prefill(**z, out=out, _kernel="gluon")
    assert (o == 0).all() and (lse == float("inf")).all()


@pytest.mark.gpu
def test_gluon_prefill_layouts_gpu(device, pin):
    """Strided q / out, a [S, 1, 512] workspace with padded rows, int64 indices, a row
    width not a multiple of 64; nothing outside the owned rows is written."""
    _need_gluon_gpu()
    T, H, S, K = 3, 70, 500, 133
    big = torch.randn(S, 1, 512 + 64).to(torch.bfloat16).to(device)
    kv = big[:, :, 64:]
    idx = torch.randint(-5, S + 5, (T, K), dtype=torch.int64).to(device)
    qbig = torch.randn(T, 2 * H, 1024).to(torch.bfloat16).to(device)
    q = qbig[:, ::2, 256:768]
    obig = poison_(torch.empty(T, H + 2, 600, dtype=torch.bfloat16, device=device))
    out = obig[:, 1:H + 1, 48:560]
    args = dict(q=q, kv=kv, indices=idx, lens=torch.tensor([133, 64, 1], device=device),
                attn_sink=torch.randn(H, device=device))
    _check(args, out=out)
    _check(args, out=out, scale=0.01)
    assert torch.isnan(obig[:, 0]).all() and torch.isnan(obig[:, H + 1]).all()
    assert torch.isnan(obig[:, :, :48]).all() and torch.isnan(obig[:, :, 560:]).all()


@pytest.mark.gpu
def test_gluon_prefill_int64_offsets_gpu(device, pin):
    """A workspace of > 2 GiB: rows near its end have byte offsets beyond 2**31."""
    _need_gluon_gpu()
    S = (1 << 21) + 4096  # 2 GiB + 4 MiB of bf16 rows
    try:
        kv = torch.empty(S, 512, dtype=torch.bfloat16, device=device)
    except torch.OutOfMemoryError:
        pytest.skip("no room for a > 2 GiB workspace")
    kv[:512].normal_()
    kv[-2048:].normal_()
    T, H, K = 4, 64, 160
    idx = torch.cat([torch.randint(0, 512, (T, 32)),
                     torch.randint(S - 2048, S, (T, K - 32))], 1).to(torch.int32).to(device)
    q = torch.randn(T, H, 512, device=device).to(torch.bfloat16)
    _check(dict(q=q, kv=kv, indices=idx, lens=None, attn_sink=torch.randn(H, device=device)))
    del kv
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 8), (32, 64), (16, 128)])
def test_gluon_prefill_cuda_graph_gpu(device, T, H, pin):
    _need_gluon_gpu()
    static = _case(device, T, H, S=1000, K=300)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device)
    fresh = _case(device, T, H, S=1000, K=300)
    assert_graph_replay(sparse_mla_prefill, static,
                        {n: fresh[n] for n in ("q", "kv", "indices", "lens", "attn_sink")}, out,
                        sparse_mla_prefill_ref, out_tol=OUT_TOL, lse_tol=LSE_TOL, _kernel="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1000, 64), (700, 128), (300, 100), (1000, 8), (700, 3)])
def test_gluon_prefill_many_items_gpu(device, T, H, pin):
    """Far more (token, head tile) items than SMs x 3 (the persistent kernel's loop wraps many
    times), ragged lens with empty rows scattered (lens 0 and rows of only -1) between full
    ones; every row checked, empty rows 0 / +inf."""
    _need_gluon_gpu()
    g = torch.Generator().manual_seed(T + H)
    args = _case(device, T, H, S=4000, K=260)
    args["lens"][torch.randperm(T, generator=g)[:T // 5].to(device)] = 260
    args["lens"][torch.randperm(T, generator=g)[:T // 7].to(device)] = 0
    only_neg = torch.randperm(T, generator=g)[:T // 13].to(device)
    args["indices"][only_neg] = -1
    o, lse = _check(args)
    ix = args["indices"]
    cols = torch.arange(ix.shape[1], device=device)[None, :]
    live = ((ix >= 0) & (ix < 4000) & (cols < args["lens"][:, None])).any(1)
    assert (~live).sum() >= T // 7
    assert (o[~live] == 0).all() and (lse[~live] == float("inf")).all()
    assert torch.isfinite(lse[live]).all()
    # the same items again into a poisoned output (launch-to-launch state: none)
    out = poison_(torch.empty_like(o))
    o2, lse2 = sparse_mla_prefill(**args, out=out, _kernel="gluon")
    assert torch.equal(o2, o) and torch.equal(lse2, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 8])
def test_gluon_prefill_hostile_indices_gpu(device, pin, H):
    """Indices far past the workspace, INT32_MAX/MIN, lens past the width and negative:
    nothing out of bounds is read (compute-sanitizer memcheck in the device run)."""
    _need_gluon_gpu()
    args = _case(device, 4, H, S=100, K=150)
    ix = args["indices"]
    ix[:, ::3] = 2 ** 31 - 1
    ix[:, 1::5] = -(2 ** 31)
    ix[:, 2::7] = 100  # exactly one past the last row
    args["lens"][:] = torch.tensor([150, 10 ** 6, -5, 33], dtype=torch.int32)
    _check(args)


@pytest.mark.gpu
def test_gluon_prefill_auto_env_gpu(device, monkeypatch, pin):
    """``DSV41_PREFILL_KERNEL=gluon`` routes the public op (custom-op boundary) to the Gluon
    kernel; ``=tl`` to the tl kernel; both agree with the reference."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import prefill_launch as pl
    args = _case(device, 9, 64)
    for mode in ("gluon", "tl"):
        monkeypatch.setenv(pl.ENV, mode)
        pl.LAST_LAUNCH.clear()
        o, lse = sparse_mla_prefill(**args)
        torch.cuda.synchronize()
        assert ("fwd" in pl.LAST_LAUNCH) == (mode == "gluon")
        ro, rl = sparse_mla_prefill_ref(**args)
        assert rel_err(o, ro) <= OUT_TOL and max_abs_err(lse, rl) <= LSE_TOL


@pytest.mark.gpu
def test_gluon_prefill_forced_refused_off_sm90(device):
    """``_kernel='gluon'`` where it cannot run raises (never silently falls back)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if gluon_pkg.AVAILABLE and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("the kernel runs here")
    with pytest.raises(ValueError, match="_kernel"):
        sparse_mla_prefill(**_case(device, 2, 8), _kernel="gluon")


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["wgmma", "wgmma2", "sync", "movm"])
@pytest.mark.parametrize("T,H,K,S,lens,sink", [
    (1, 1, 1, 10, True, "rand"), (3, 3, 70, 100, False, "none"), (7, 8, 640, 3000, True, "rand"),
    (300, 8, 200, 5000, True, "-inf"), (700, 2, 1100, 9000, False, "rand"),
    (5, 8, 64, 64, True, "large")])
def test_gluon_prefill_few_forms_gpu(device, form, T, H, K, S, lens, sink):
    """Every form of the few-heads kernel (``prefill_launch._launch_few``: the picked wgmma one,
    the same at two CTAs per SM, the unpicked mma.sync ones) against the reference: ragged lens and an empty row, -1 and
    out-of-range rows, 1 / 3 / 8 heads, more tokens than SMs, one-block and many-block rows;
    outputs poisoned first."""
    _need_gluon_gpu()
    from dsv41_triton.attention.gluon import prefill_launch as pl
    args = _case(device, T, H, S=S, K=K, lens=lens, sink=sink)
    if lens:
        args["lens"][0] = 0
    scale = 512 ** -0.5
    out = poison_(torch.empty(T, H, 512, dtype=torch.bfloat16, device=device))
    lse = poison_(torch.empty(T, H, dtype=torch.float32, device=device))
    pl._launch_few(args["q"], args["kv"], args["indices"].to(torch.int32), args["lens"],
                   args["attn_sink"], scale, out, lse, False,
                   **(dict(ctas_per_sm=2) if form == "wgmma2" else dict(form=form)))
    torch.cuda.synchronize()
    ro, rl = sparse_mla_prefill_ref(**args, softmax_scale=scale)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_err(out, ro) <= OUT_TOL, rel_err(out, ro)
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    fin = torch.isfinite(rl)
    assert not fin.any() or max_abs_err(lse[fin], rl[fin]) <= LSE_TOL
