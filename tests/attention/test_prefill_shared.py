"""``sparse_mla_prefill_shared_window`` against its float64 reference and against the general
prefill over the layer's workspace."""
import pytest
import torch

from dsv41_triton.attention._configs import MIN_BLOCK_N_GPU
from dsv41_triton.attention.prefill import sparse_mla_prefill
from dsv41_triton.attention.prefill_shared import (
    shared_window_tiles,
    shared_window_tiles_ref,
    sparse_mla_prefill_shared_window,
)
from dsv41_triton.attention.prefill_shared_ref import sparse_mla_prefill_shared_window_ref
from dsv41_triton.ops.indices import combine_topk_swa_indices
from dsv41_triton.ops.kv_cache import dequantize_and_gather_k_cache
from dsv41_triton.testing import max_abs_err, poison_, rel_err

OUT_TOL, LSE_TOL = 1e-2, 1e-3
#: key block for explicit shapes: small on the CPU; a GPU refuses blocks under 32
BN = 16 if not torch.cuda.is_available() else MIN_BLOCK_N_GPU


def _case(device, qlens=(3, 0, 13, 6), extra=2, H=3, W=10, K=17, S=300, seed=0):
    """Requests with sliding windows (row ranges), ragged top-k rows with -1 and rows >= S;
    ``extra`` tokens past the last request."""
    g = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0] + list(qlens)).cumsum(0).to(torch.int32)
    T = int(qsl[-1]) + extra
    ws = torch.zeros(T, dtype=torch.int32)
    wl = torch.zeros(T, dtype=torch.int32)
    base = 5
    for b, n in enumerate(qlens):
        for i in range(n):
            t = int(qsl[b]) + i
            ws[t] = base + max(0, i - W + 1)
            wl[t] = min(i + 1, W)
        base += n + 40
    tk = torch.randint(0, S + 20, (T, K), generator=g).to(torch.int32)
    tk[torch.rand(T, K, generator=g) < 0.1] = -1
    tl_ = torch.randint(0, K + 1, (T,), generator=g).to(torch.int32)
    q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16)
    kv = torch.randn(S, 512, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    d = dict(q=q, kv=kv, win_start=ws, win_len=wl, topk_indices=tk, topk_lens=tl_,
             query_start_loc=qsl, attn_sink=sink)
    return {k: v.to(device) for k, v in d.items()}


def _check(args, out=None, **kw):
    T, H = args["q"].shape[:2]
    if out is None:
        out = poison_(torch.empty(T, H, 512, dtype=torch.bfloat16, device=args["q"].device))
    o, lse = sparse_mla_prefill_shared_window(**args, out=out, **kw)
    assert o.data_ptr() == out.data_ptr()
    ro, rl = sparse_mla_prefill_shared_window_ref(**args)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    e_o, e_l = rel_err(o, ro), max_abs_err(lse, rl)
    assert e_o <= OUT_TOL, e_o
    assert e_l <= LSE_TOL, e_l
    return o, lse


def test_shared_window_tiles_cover_each_token_once(device):
    qsl = torch.tensor([2, 2, 7, 7, 30, 31], dtype=torch.int32, device=device)  # offset start
    T = 33
    for bt in (1, 4, 8):
        tiles = shared_window_tiles(qsl, T, bt).cpu()
        assert tiles.shape == (-(-T // bt) + 6, 2)
        seen = torch.zeros(T, dtype=torch.int32)
        bounds = [0, 5, 28, 29, T]  # request starts relative to qsl[0], then the leftover
        for s, c in tiles.tolist():
            assert 0 <= c <= bt
            if c:
                seen[s:s + c] += 1
                b = max(i for i in range(len(bounds) - 1) if bounds[i] <= s)
                assert s + c <= bounds[b + 1]  # never across a request boundary
        assert torch.equal(seen, torch.ones(T, dtype=torch.int32))


@pytest.mark.parametrize("seed", range(4))
def test_shared_window_tiles_kernel_matches_torch(device, seed):
    g = torch.Generator().manual_seed(seed)
    nq = [1, 2, 7, 300][seed]
    lens = torch.randint(0, 40, (nq - 1,), generator=g)
    lens[torch.rand(nq - 1, generator=g) < 0.3] = 0  # empty requests
    qsl = torch.cat([torch.tensor([int(torch.randint(0, 9, (1,), generator=g))]),
                     lens]).cumsum(0)
    for T in (1, int(qsl[-1] - qsl[0]) + 5, max(1, int(qsl[-1] - qsl[0]) // 2)):
        for bt in (1, 4, 8, 16):
            for dt in (torch.int32, torch.int64):
                q = qsl.to(dt).to(device)
                got = shared_window_tiles(q, T, bt)
                want = shared_window_tiles_ref(q, T, bt)
                assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu()), (T, bt)


@pytest.mark.parametrize("H", [1, 3, 8, 16])
def test_shared_window_matches_ref(device, H):
    _check(_case(device, H=H, seed=H))


@pytest.mark.parametrize("H,block_t", [(3, 4), (3, 32), (1, 16), (16, 1), (8, 2)])
def test_shared_window_tile_sizes(device, H, block_t):
    _check(_case(device, H=H, seed=block_t), block_t=block_t, block_n=BN)


@pytest.mark.parametrize("sink", [None, "-inf", "large"])
def test_shared_window_sinks(device, sink):
    args = _case(device, H=3)
    args["attn_sink"] = {None: None, "-inf": torch.full((3,), float("-inf"), device=device),
                         "large": torch.full((3,), 80.0, device=device)}[sink]
    o, _ = _check(args)
    if sink == "large":
        assert o.abs().max().item() < 1e-20


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_shared_window_empty_rows_and_hostile(device, idx_dtype):
    """Tokens with neither window nor top-k get 0 / +inf; windows past either end of kv and
    negative lengths are clipped; top-k lens past K are clamped; int64 index inputs (int32:
    on sm_90 the Gluon window and few-heads kernels)."""
    args = _case(device, H=3, S=120, seed=3)
    T = args["q"].shape[0]
    ws, wl, tlen = args["win_start"].clone(), args["win_len"].clone(), args["topk_lens"].clone()
    wl[[0, T - 1]] = 0
    tlen[[0, T - 1]] = 0
    ws[5], wl[5] = -4, 9  # starts before row 0
    ws[6], wl[6] = 115, 9  # runs past S
    wl[7] = -3
    tlen[8] = 999
    args.update(win_start=ws.long(), win_len=wl, topk_lens=tlen,
                topk_indices=args["topk_indices"].to(idx_dtype))
    o, lse = _check(args)
    for t in (0, T - 1):
        assert torch.all(o[t] == 0) and torch.all(torch.isinf(lse[t]) & (lse[t] > 0))


def test_shared_window_nan_sink_makes_the_whole_head_nan(device):
    """A NaN sink: every row of its head is NaN, the tokens without keys included; the other
    heads as the reference (0 / +inf for those tokens); lse unaffected."""
    args = _case(device, H=3, seed=5)
    T = args["q"].shape[0]
    args["win_len"][0] = 0
    args["topk_lens"][0] = 0
    args["attn_sink"] = torch.tensor([0.5, float("nan"), -1.0], device=device)
    out = poison_(torch.empty(T, 3, 512, dtype=torch.bfloat16, device=device))
    o, lse = sparse_mla_prefill_shared_window(**args, out=out)
    ro, rl = sparse_mla_prefill_shared_window_ref(**args)
    assert torch.isnan(o[:, 1]).all() and torch.isnan(ro[:, 1]).all()
    keep = [0, 2]
    assert rel_err(o[:, keep], ro[:, keep]) <= OUT_TOL
    assert (o[0, keep] == 0).all()  # no keys: 0
    assert max_abs_err(lse, rl) <= LSE_TOL
    assert (lse[0] == float("inf")).all() and torch.isfinite(lse[1]).all()


def test_shared_window_nan_in_q_propagates(device):
    """NaN in one query row: that row's out and lse are NaN (as the general kernels and the
    reference: docs/semantics.md); the other tokens are untouched by it."""
    args = _case(device, H=3, seed=6)
    args["q"] = args["q"].clone()
    args["q"][1, 2, 7] = float("nan")
    T = args["q"].shape[0]
    out = poison_(torch.empty(T, 3, 512, dtype=torch.bfloat16, device=device))
    o, lse = sparse_mla_prefill_shared_window(**args, out=out)
    ro, rl = sparse_mla_prefill_shared_window_ref(**args)
    assert torch.isnan(o[1, 2]).all() and torch.isnan(lse[1, 2]) and torch.isnan(rl[1, 2])
    ok = torch.ones(T, 3, dtype=torch.bool)
    ok[1, 2] = False
    assert rel_err(o[ok], ro[ok]) <= OUT_TOL
    assert max_abs_err(lse[ok], rl[ok]) <= LSE_TOL


def test_shared_window_equals_general_prefill_on_the_layer_workspace(device):
    """The layer's workspace (gather + combine) through both entry points."""
    from tests.attention.test_prefill_paged import _step

    s = _step(device, H=3, seed=2)
    md, r, W = s["md"], s["r"], s["W"]
    nd = md.num_decodes
    for ch in md.chunk_plan(r):
        a, b = ch.tok_start, ch.tok_end
        pr = slice(ch.req_start - nd, ch.req_end - nd)
        seq, glen = md.prefill_seq_lens[pr], md.prefill_gather_lens[pr]
        ws = torch.zeros((ch.req_end - ch.req_start, ch.M, 512), dtype=torch.bfloat16,
                         device=device)
        cm = md.compressed[r]
        dequantize_and_gather_k_cache(ws, s["comp"], torch.div(seq, r, rounding_mode="floor")
                                      .to(torch.int32), None,
                                      cm.block_table[ch.req_start:ch.req_end], cm.page_size, 0)
        dequantize_and_gather_k_cache(ws, s["swa"], seq, glen,
                                      md.swa_block_table[ch.req_start:ch.req_end],
                                      md.swa_page_size, ch.N)
        qsl = md.query_start_loc[ch.req_start:ch.req_end + 1]
        qsl = qsl - qsl[0]
        tk = s["tk"][a:b]
        win = torch.full((3, b - a), -7, dtype=torch.int32, device=device)
        idx, lens = combine_topk_swa_indices(tk, qsl, seq, glen, W, r, tk.shape[1], ch.M, ch.N,
                                             window_rows=win)
        wst, wln, tln = win.unbind(0)
        kv = ws.view(-1, 512)
        q = s["q"][a:b]
        o1, l1 = sparse_mla_prefill(q, kv, idx, lens, attn_sink=s["sink"])
        o2, l2 = sparse_mla_prefill_shared_window(q, kv, wst, wln, idx, tln, qsl,
                                                  attn_sink=s["sink"])
        assert torch.equal(tln + wln, lens)
        assert rel_err(o2, o1) < 5e-3 and max_abs_err(l2, l1) < 1e-3


def test_shared_window_bad_inputs(device):
    a = _case(device, H=3)

    def call(exc, match, **kw):
        with pytest.raises(exc, match=match):
            sparse_mla_prefill_shared_window(**dict(a, **kw))

    call(ValueError, "heads", q=torch.randn(a["q"].shape[0], 17, 512, device=device)
         .to(torch.bfloat16), attn_sink=None)
    call(TypeError, "q", q=a["q"].float())
    call(ValueError, "win_start", win_start=a["win_start"][:3])
    call(TypeError, "win_len", win_len=a["win_len"].float())
    call(ValueError, "topk_indices", topk_indices=a["topk_indices"][:3])
    call(ValueError, "kv", kv=a["kv"][:, :256])
    call(ValueError, "block_t", block_t=3)
    call(ValueError, "block_t", block_t=64)
    call(ValueError, "block_n", block_n=48)
    out = poison_(torch.empty_like(a["q"]))
    with pytest.raises(ValueError):
        sparse_mla_prefill_shared_window(**dict(a, topk_lens=a["topk_lens"][:2]), out=out)
    assert torch.isnan(out).all()


def test_shared_window_zero_tokens(device):
    a = _case(device, qlens=(), extra=0, H=3)
    o, lse = sparse_mla_prefill_shared_window(**a)
    assert o.shape == (0, 3, 512) and lse.shape == (0, 3)


# --------------------------------------------------------------------------------------------
# GPU: V4.1 sizes (128-key window, 512 top-k), CUDA graph
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16])
@pytest.mark.parametrize("block_t,block_n,warps", [(None, 64, None), (4, 32, 4)])
def test_shared_window_v41_gpu(device, H, block_t, block_n, warps):
    """On sm_90 with at most 8 heads the top-k rows run on the Gluon few-heads kernel, which
    merges the window partial (its prior)."""
    from dsv41_triton.attention import gluon as gluon_pkg
    from dsv41_triton.attention.gluon import prefill_launch as pl
    a = _case(device, qlens=(700, 1, 300), extra=3, H=H, W=128, K=512, S=8192, seed=H)
    pl.LAST_LAUNCH.clear()
    _check(a, block_t=block_t, block_n=block_n, num_warps=warps)
    few = (gluon_pkg.AVAILABLE and torch.cuda.get_device_capability() == (9, 0) and H <= 8
           and pl.pick(a["q"].shape[0], H, a["q"].device, a["topk_indices"]))
    assert (pl.LAST_LAUNCH.get("fwd", (None, None))[1] == pl.FEW) == few
    # the default tiles (64 rows) put the window partial on the Gluon window kernel too
    assert ("window" in pl.LAST_LAUNCH) == (few and block_t is None)


@pytest.mark.gpu
def test_shared_window_cuda_graph_gpu(device):
    a = _case(device, qlens=(200, 77), extra=0, H=8, W=128, K=512, S=4096)
    out = torch.empty_like(a["q"])
    sparse_mla_prefill_shared_window(**a, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, lse = sparse_mla_prefill_shared_window(**a, out=out)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    ro, rl = sparse_mla_prefill_shared_window_ref(**a)
    assert rel_err(out, ro) <= OUT_TOL and max_abs_err(lse, rl) <= LSE_TOL


# --------------------------------------------------------------------------------------------
# top-k keys from a paged record cache (``topk_cache``): the layer's paged prefill
# --------------------------------------------------------------------------------------------
def _paged_case(device, rec=584, page=16, blocks=24, H=3, seed=0, **kw):
    """``_case`` with its top-k columns as slot ids into a random ``rec``-byte record cache
    (``-1``, ids past the cache's slots and ragged lens included)."""
    from dsv41_triton.testing import random_k_cache

    a = _case(device, H=H, seed=seed, S=kw.pop("S", 300), **kw)
    g = torch.Generator().manual_seed(100 + seed)
    n = blocks * page
    T, K = a["topk_indices"].shape
    slots = torch.randint(0, n + 30, (T, K), generator=g).to(torch.int32)
    slots[torch.rand(T, K, generator=g) < 0.1] = -1
    cache = random_k_cache(blocks, page, rec, device, generator=g)
    a.update(topk_indices=slots.to(device), topk_cache=cache)
    return a


def _check_paged(args, **kw):
    T, H = args["q"].shape[:2]
    out = poison_(torch.empty(T, H, 512, dtype=torch.bfloat16, device=args["q"].device))
    o, lse = sparse_mla_prefill_shared_window(**args, out=out, **kw)
    assert o.data_ptr() == out.data_ptr()
    ro, rl = sparse_mla_prefill_shared_window_ref(**args)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel_err(o, ro) <= OUT_TOL, rel_err(o, ro)
    assert max_abs_err(lse, rl) <= LSE_TOL, max_abs_err(lse, rl)
    return o, lse


@pytest.mark.parametrize("rec", [584, 528, 288])
@pytest.mark.parametrize("H", [1, 3, 8])
def test_shared_window_paged_topk_matches_ref(device, rec, H):
    _check_paged(_paged_case(device, rec=rec, H=H, seed=H))


@pytest.mark.gpu
@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("rec", [584, 528])
@pytest.mark.parametrize("H", [1, 8])
@pytest.mark.parametrize("qlens", [(3, 0, 13, 6), (200, 1, 77)])
def test_shared_window_paged_topk_few_ds_gpu(device, monkeypatch, rec, H, qlens, f16):
    """The top-k records on the few-heads kernel's dequant + S form (``launch.FEW_DS``, with
    fp16 operands: ``FEW_DS_F16``): the same results as the reference, the prior merged."""
    from dsv41_triton.attention.gluon import launch as gl_launch
    if (device != "cuda" or not gl_launch.AVAILABLE
            or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("the Gluon kernels target sm_90")
    monkeypatch.setattr(gl_launch, "FEW_DS", True)
    monkeypatch.setattr(gl_launch, "FEW_DS_F16", f16)
    _check_paged(_paged_case(device, rec=rec, H=H, seed=H + len(qlens), qlens=qlens, K=600))
    assert gl_launch.LAST_LAUNCH["fwd"][1][4] == "few_ds"


def test_shared_window_paged_topk_equals_decoded_rows(device):
    """An independent path: the top-k records decoded into extra workspace rows
    (``read_slots_ref``) and read as bf16 rows by the plain entry point give the same result."""
    from dsv41_triton.ops.records import read_slots_ref

    a = _paged_case(device, rec=528, H=3, seed=5)
    o1, l1 = sparse_mla_prefill_shared_window(**a)
    slots = a["topk_indices"]
    n = a["topk_cache"].shape[0] * a["topk_cache"].shape[1]
    ok = (slots >= 0) & (slots < n)
    rows = read_slots_ref(a["topk_cache"], torch.where(ok, slots, -1).long()).view(-1, 512)
    S = a["kv"].shape[0]
    T, K = slots.shape
    kv2 = torch.cat([a["kv"], rows.to(a["kv"].dtype)], 0)
    idx = torch.where(ok, S + torch.arange(T * K, device=device).view(T, K), -1).to(torch.int32)
    b = dict(a, kv=kv2, topk_indices=idx)
    del b["topk_cache"]
    o2, l2 = sparse_mla_prefill_shared_window(**b)
    assert rel_err(o1, o2) < 5e-3 and max_abs_err(l1, l2) < 1e-3


def test_shared_window_paged_topk_empty_rows(device):
    """Tokens without window rows and top-k columns get 0 / +inf; all-``-1`` slot rows and a
    window past kv's end add nothing."""
    a = _paged_case(device, rec=584, H=3, seed=7)
    T = a["q"].shape[0]
    wl, tlen, slots = a["win_len"].clone(), a["topk_lens"].clone(), a["topk_indices"].clone()
    wl[[0, T - 1]] = 0
    tlen[0] = 0
    slots[T - 1] = -1
    ws = a["win_start"].clone()
    ws[4], wl[4] = a["kv"].shape[0] - 2, 9
    a.update(win_len=wl, topk_lens=tlen, topk_indices=slots, win_start=ws)
    o, lse = _check_paged(a)
    for t in (0, T - 1):
        assert torch.all(o[t] == 0) and torch.all(torch.isinf(lse[t]) & (lse[t] > 0))


def test_shared_window_paged_topk_bad_inputs(device):
    a = _paged_case(device, rec=584, H=3)
    with pytest.raises(TypeError, match="topk_indices"):
        sparse_mla_prefill_shared_window(**dict(a, topk_indices=a["topk_indices"].long()))
    with pytest.raises((TypeError, ValueError), match="topk_cache"):
        sparse_mla_prefill_shared_window(**dict(a, topk_cache=a["topk_cache"].float()))
    with pytest.raises(ValueError, match="topk_cache"):
        sparse_mla_prefill_shared_window(**dict(a, topk_cache=a["topk_cache"][..., :500]))


@pytest.mark.gpu
@pytest.mark.parametrize("rec", [584, 528, 288])
@pytest.mark.parametrize("H", [1, 8, 16])
@pytest.mark.parametrize("persist", [False, True])
def test_shared_window_paged_topk_v41_gpu(device, monkeypatch, rec, H, persist):
    """V4.1 sizes; on sm_90 the top-k records run on the Gluon decode kernel with its prior
    (584 / 528 records; 288 alone: the ``tl`` kernel), on its per-token or persistent grid
    (``PRIOR_PERSIST``; there, at <= 8 heads, its dequant + S form)."""
    from dsv41_triton.attention import gluon as gluon_pkg
    from dsv41_triton.attention.gluon import launch as dl
    monkeypatch.setattr(dl, "PRIOR_PERSIST", persist)
    a = _paged_case(device, rec=rec, page=64, blocks=64, H=H, seed=rec + H,
                    qlens=(700, 1, 300), extra=3, W=128, K=512, S=8192)
    dl.LAST_LAUNCH.clear()
    _check_paged(a)
    gluon = (gluon_pkg.AVAILABLE and torch.cuda.get_device_capability() == (9, 0)
             and rec != 288)
    got = dl.LAST_LAUNCH.get("fwd", (None, ()))[1]
    # the dequant + S form (``FEW_DS``) takes 8-head tiles on the persistent grid
    kind = "few_ds" if dl.FEW_DS and persist and H <= 8 else "few_ws"
    assert (bool(got) and got[-1] == kind and got[1] == 1) == gluon, got
    assert dl.LAST_LAUNCH.get("persist", False) == (gluon and persist)


@pytest.mark.gpu
def test_shared_window_paged_topk_cuda_graph_gpu(device):
    a = _paged_case(device, rec=584, page=64, blocks=64, H=8, qlens=(200, 77), extra=0, W=128,
                    K=512, S=4096)
    out = torch.empty_like(a["q"])
    o1, l1 = sparse_mla_prefill_shared_window(**a)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, lse = sparse_mla_prefill_shared_window(**a, out=out)
    poison_(out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o1) and torch.equal(lse, l1)


@pytest.mark.gpu
@pytest.mark.parametrize("persist", [False, True])
def test_shared_window_paged_topk_int64_offsets_gpu(device, monkeypatch, persist):
    """Top-k records at byte offsets past 2**31 (a > 2 GiB 584 cache whose slots all lie in its
    last blocks) merged with window rows of a small workspace: the reference's result."""
    from dsv41_triton.attention.gluon import launch as dl
    from dsv41_triton.testing import large_offset_decode_case
    monkeypatch.setattr(dl, "PRIOR_PERSIST", persist)
    d = large_offset_decode_case(device, T=300, H=8, W=96)
    a = _case(device, qlens=(200, 100), extra=0, H=8, W=128, K=96, S=600, seed=11)
    a.update(q=d["q"], topk_indices=d["swa_indices"], topk_lens=d["swa_lens"],
             topk_cache=d["swa_cache"], attn_sink=d["attn_sink"])
    _check_paged(a)
