"""``sparse_mla_prefill_paged`` against its float64 reference and against the gather +
workspace prefill the layer runs (same keys: the outputs agree)."""
import pytest
import torch

from dsv41_triton.layers.metadata import RequestSpec, build_step_metadata
from dsv41_triton.attention.prefill import sparse_mla_prefill
from dsv41_triton.attention.prefill_paged import sparse_mla_prefill_paged
from dsv41_triton.attention.prefill_paged_ref import sparse_mla_prefill_paged_ref
from dsv41_triton.ops.indices import combine_topk_swa_indices
from dsv41_triton.ops.kv_cache import dequantize_and_gather_k_cache
from dsv41_triton.testing import (assert_graph_replay, max_abs_err, poison_, random_k_cache,
                                  rel_err)

OUT_TOL, LSE_TOL = 1e-2, 1e-3


def _step(device, qlens=(0, 5, 9, 1 + 6), prefixes=(3, 0, 37, 20), W=16, spage=8, cpage=4,
          r=4, K=12, H=3, swa_rec=584, c_rec=584, seed=0):
    """A prefill step (an idle request first), its caches and the indexer's top-k rows: causal
    local entries, with -1 and out-of-range entries mixed in."""
    g = torch.Generator().manual_seed(seed)
    seqs = [q + p for q, p in zip(qlens, prefixes)]
    nb_s = sum(-(-x // spage) for x in seqs) + 3
    nb_c = sum(-(-(x // r) // cpage) for x in seqs) + 3 if r else 1
    perm_s = torch.randperm(nb_s, generator=g).tolist()
    perm_c = torch.randperm(nb_c, generator=g).tolist()
    reqs, o_s, o_c = [], 0, 0
    for q, p, s in zip(qlens, prefixes, seqs):
        ns, nc = -(-s // spage), -(-(s // r) // cpage) if r else 0
        reqs.append(RequestSpec(q, prefix_len=p, swa_block_table=perm_s[o_s:o_s + ns],
                                compressed_block_tables={r: perm_c[o_c:o_c + nc]} if r else {}))
        o_s, o_c = o_s + ns, o_c + nc
    md = build_step_metadata(reqs, window_size=W, swa_page_size=spage,
                             compressed_page_sizes={r: cpage} if r else None, device=device)
    swa = random_k_cache(nb_s, spage, swa_rec, device)
    comp = random_k_cache(nb_c, cpage, c_rec, device) if r else None
    T = md.num_tokens
    pos = md.positions.cpu()
    tk = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        n = (int(pos[t]) + 1) // r if r else 0
        if n:
            tk[t] = torch.randint(0, n, (K,), generator=g, dtype=torch.int32)
    tk[torch.rand(T, K, generator=g) < 0.15] = -1
    tk[1, 0] = 10 ** 6  # past every table / entry count
    q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(device)
    sink = torch.randn(H, generator=g).to(device)
    return dict(md=md, swa=swa, comp=comp, tk=tk.to(device), q=q, sink=sink, W=W, r=r)


def _paged_args(s):
    md, r = s["md"], s["r"]
    cm = md.compressed[r] if r else None
    return dict(q=s["q"], positions=md.positions, token_to_req=md.token_to_req,
                seq_lens=md.seq_lens, swa_cache=s["swa"], swa_block_table=md.swa_block_table,
                window_size=s["W"], compressed_cache=s["comp"],
                compressed_block_table=cm.block_table if r else None,
                topk_indices=s["tk"] if r else None, compress_ratio=r, attn_sink=s["sink"])


def workspace_prefill(s, out):
    """The layer's gather + workspace prefill (non-fused) over the step's chunks."""
    md, r, W = s["md"], s["r"], s["W"]
    nd = md.num_decodes
    for ch in md.chunk_plan(r):
        a, b = ch.tok_start, ch.tok_end
        if a == b:
            continue
        pr = slice(ch.req_start - nd, ch.req_end - nd)
        seq, glen = md.prefill_seq_lens[pr], md.prefill_gather_lens[pr]
        ws = torch.zeros((ch.req_end - ch.req_start, ch.M, 512), dtype=torch.bfloat16,
                         device=s["q"].device)
        if r:
            cm = md.compressed[r]
            dequantize_and_gather_k_cache(ws, s["comp"], torch.div(seq, r, rounding_mode="floor")
                                          .to(torch.int32), None,
                                          cm.block_table[ch.req_start:ch.req_end], cm.page_size, 0)
            tk = s["tk"][a:b]
        else:
            tk = torch.full((b - a, 1), -1, dtype=torch.int32, device=s["q"].device)
        dequantize_and_gather_k_cache(ws, s["swa"], seq, glen,
                                      md.swa_block_table[ch.req_start:ch.req_end],
                                      md.swa_page_size, ch.N)
        qsl = md.query_start_loc[ch.req_start:ch.req_end + 1]
        idx, lens = combine_topk_swa_indices(tk, qsl - qsl[0], seq, glen, W, r, tk.shape[1] if r
                                             else 0, ch.M, ch.N)
        sparse_mla_prefill(s["q"][a:b], ws.view(-1, 512), idx, lens, attn_sink=s["sink"],
                           out=out[a:b])
    return out


def _check(args, out=None):
    T, H = args["q"].shape[:2]
    if out is None:
        out = poison_(torch.empty(T, H, 512, dtype=torch.bfloat16, device=args["q"].device))
    o, lse = sparse_mla_prefill_paged(**args, out=out)
    assert o.data_ptr() == out.data_ptr() and lse.shape == (T, H)
    ro, rl = sparse_mla_prefill_paged_ref(**args)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel_err(o, ro) <= OUT_TOL and max_abs_err(lse, rl) <= LSE_TOL
    return o, lse


@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("swa_rec,c_rec", [(584, 584), (528, 288)])
def test_prefill_paged_matches_ref_and_workspace(device, H, swa_rec, c_rec):
    s = _step(device, H=H, swa_rec=swa_rec, c_rec=c_rec, seed=H)
    o, _ = _check(_paged_args(s))
    w = workspace_prefill(s, poison_(torch.empty_like(o)))
    assert rel_err(o, w) < 5e-3  # the same keys (records decode exactly to bf16)


def test_prefill_paged_window_only(device):
    s = _step(device, r=0, H=3, seed=5)
    o, _ = _check(_paged_args(s))
    w = workspace_prefill(s, poison_(torch.empty_like(o)))
    assert rel_err(o, w) < 5e-3


@pytest.mark.parametrize("sink", [None, "-inf", "large"])
def test_prefill_paged_sinks(device, sink):
    s = _step(device, H=3, seed=7)
    args = _paged_args(s)
    args["attn_sink"] = {None: None, "-inf": torch.full((3,), float("-inf"), device=device),
                         "large": torch.full((3,), 80.0, device=device)}[sink]
    o, _ = _check(args)
    if sink == "large":
        assert o.abs().max().item() < 1e-20


def test_prefill_paged_empty_rows_and_hostile_indices(device):
    """Tokens of no request (-1, past the batch) get 0 / +inf; -1, huge and past-the-count
    top-k entries and holes in the block tables are skipped."""
    s = _step(device, H=3, seed=11)
    args = _paged_args(s)
    T = args["q"].shape[0]
    ttr = args["token_to_req"].clone()
    ttr[[0, 4]] = torch.tensor([-1, 99], dtype=ttr.dtype, device=device)
    args["token_to_req"] = ttr
    tk = args["topk_indices"].clone()
    tk[2] = -1
    tk[3, ::2] = 2 ** 31 - 1
    args["topk_indices"] = tk.long()  # int64 entries
    bt = args["swa_block_table"].clone()
    bt[1, 0] = -1
    args["swa_block_table"] = bt
    o, lse = _check(args)
    for t in (0, 4):
        assert torch.all(o[t] == 0) and torch.all(torch.isinf(lse[t]) & (lse[t] > 0))
    assert T > 5


def test_prefill_paged_zero_tokens(device):
    s = _step(device, H=3)
    args = _paged_args(s)
    for k in ("q", "positions", "topk_indices"):
        args[k] = args[k][:0]
    o, lse = sparse_mla_prefill_paged(**args)
    assert o.shape == (0, 3, 512) and lse.shape == (0, 3)


def test_prefill_paged_bad_inputs(device):
    s = _step(device, H=3)
    a = _paged_args(s)

    def call(exc, match, **kw):
        with pytest.raises(exc, match=match):
            sparse_mla_prefill_paged(**dict(a, **kw))

    call(TypeError, "q", q=a["q"].float())
    call(ValueError, "positions", positions=a["positions"][:2])
    call(ValueError, "swa_cache", swa_cache=random_k_cache(2, 8, 288, device))
    call(ValueError, "compressed_cache", compressed_cache=None)
    call(TypeError, "compressed_cache", compressed_cache=a["compressed_cache"].view(torch.int8))
    call(ValueError, "topk_indices", topk_indices=a["topk_indices"][:2])
    call(ValueError, "attn_sink", attn_sink=torch.zeros(4, device=device))
    out = poison_(torch.empty_like(a["q"]))
    with pytest.raises(ValueError):
        sparse_mla_prefill_paged(**dict(a, positions=a["positions"][:1]), out=out)
    assert torch.isnan(out).all()


# --------------------------------------------------------------------------------------------
# GPU: V4.1 sizes, heads, int64 byte offsets, CUDA graphs
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16, 64, 128])
def test_prefill_paged_v41_gpu(device, H):
    s = _step(device, qlens=(0, 300, 41, 700), prefixes=(5, 0, 900, 3000), W=128, spage=64,
              cpage=64, r=4, K=512, H=H, seed=H)
    o, _ = _check(_paged_args(s))
    w = workspace_prefill(s, poison_(torch.empty_like(o)))
    assert rel_err(o, w) < 5e-3


@pytest.mark.gpu
def test_prefill_paged_int64_offsets_gpu(device):
    """A window cache of > 2 GiB: the request's blocks are the last ones (byte offsets past
    2**31)."""
    page, rec = 64, 584
    nb = (2 ** 31) // (page * rec) + 64
    swa = torch.empty((nb, page, rec), dtype=torch.uint8, device=device)
    small = random_k_cache(64, page, rec, device)
    swa[-64:] = small
    del small
    s = _step(device, qlens=(0, 40, 70), prefixes=(1, 10, 200), W=128, spage=page, cpage=64,
              r=4, K=64, H=8, seed=3)
    md = s["md"]
    md.swa_block_table = torch.where(md.swa_block_table >= 0, md.swa_block_table + nb - 64,
                                     md.swa_block_table)
    s["swa"] = swa
    _check(_paged_args(s))
    del swa


@pytest.mark.gpu
def test_prefill_paged_cuda_graph_gpu(device):
    s = _step(device, qlens=(0, 120, 33), prefixes=(2, 10, 400), W=128, spage=64, cpage=64,
              r=4, K=128, H=8, seed=9)
    f = _step(device, qlens=(0, 120, 33), prefixes=(2, 10, 400), W=128, spage=64, cpage=64,
              r=4, K=128, H=8, seed=10)
    fresh = {k: v for k, v in _paged_args(f).items()
             if k in ("q", "swa_cache", "compressed_cache", "topk_indices", "attn_sink")}
    args = _paged_args(s)
    assert_graph_replay(sparse_mla_prefill_paged, args, fresh, torch.empty_like(args["q"]),
                        sparse_mla_prefill_paged_ref, out_tol=OUT_TOL, lse_tol=LSE_TOL)
