"""``prefill_slot_indices`` and ``prefill_window_slot_indices`` (Triton) against their
references, bit for bit, and against independent paths: the step metadata's decode window
rows, and the workspace index op's window row ranges."""
import pytest
import torch

from dsv41_triton.layers.metadata import RequestSpec, build_step_metadata
from dsv41_triton.ops.indices import combine_topk_swa_indices
from dsv41_triton.ops.prefill_indices import prefill_slot_indices, prefill_window_slot_indices
from dsv41_triton.ops.prefill_indices_ref import (prefill_slot_indices_ref,
                                                  prefill_window_slot_indices_ref)


def _case(device, T=37, B=3, W=20, K=45, spage=8, cpage=4, r=4, nb=64, gen=None):
    g = gen or torch.Generator().manual_seed(T * 7 + K)
    req = torch.randint(0, B, (T,), generator=g).sort().values.to(torch.int32)
    seq = torch.randint(1, 200, (B,), generator=g).to(torch.int32)
    pos = (seq.long()[req.long()] - 1 - torch.randint(0, 30, (T,), generator=g)).clamp_min(0)
    sbt = torch.randint(0, nb, (B, 26), generator=g).to(torch.int32)
    sbt[0, 3] = -1  # a hole in a block table
    cbt = torch.randint(0, nb, (B, 14), generator=g).to(torch.int32)
    tk = torch.randint(-5, 60, (T, K), generator=g).to(torch.int32)
    return dict(positions=pos.to(device), token_to_req=req.to(device), seq_lens=seq.to(device),
                swa_block_table=sbt.to(device), swa_page_size=spage, window_size=W,
                topk_indices=tk.to(device), compressed_block_table=cbt.to(device),
                compressed_page_size=cpage, compress_ratio=r)


def _same(a, b):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == torch.int32 and y.dtype == torch.int32
            assert torch.equal(x.cpu(), y.cpu())


@pytest.mark.parametrize("T,W,K,r", [(37, 20, 45, 4), (1, 128, 512, 4), (9, 7, 130, 1),
                                     (13, 33, 1, 128), (5, 16, 0, 4), (6, 9, 700, 4)])
def test_prefill_slot_indices_matches_ref(device, T, W, K, r):
    args = _case(device, T=T, W=W, K=K, r=r)
    _same(prefill_slot_indices(**args), prefill_slot_indices_ref(**args))


def test_prefill_slot_indices_window_only_and_hostile(device):
    args = _case(device, T=21, W=24, K=40)
    # invalid requests, negative positions, positions past the block table, int64 inputs
    args["token_to_req"] = args["token_to_req"].clone()
    args["token_to_req"][[0, 5]] = torch.tensor([-1, 7], dtype=torch.int32, device=device)
    args["positions"] = args["positions"].clone()
    args["positions"][[2, 9]] = torch.tensor([-3, 10 ** 6], device=device)
    args["topk_indices"] = args["topk_indices"].long()
    args["swa_block_table"] = args["swa_block_table"].long()
    out = prefill_slot_indices(**args)
    _same(out, prefill_slot_indices_ref(**args))
    assert out[1][[0, 5, 2]].eq(0).all() and out[3][[0, 5, 2]].eq(0).all()
    assert out[0][9].eq(-1).all() and out[1][9] == 24  # counted, all past the table
    w = dict(args, compress_ratio=0, topk_indices=None, compressed_block_table=None)
    got = prefill_slot_indices(**w)
    assert got[2] is None and got[3] is None
    _same(got, prefill_slot_indices_ref(**w))
    assert torch.equal(got[0].cpu(), out[0].cpu())


def test_prefill_slot_indices_strided_and_empty(device):
    args = _case(device, T=11, W=10, K=70)
    big = torch.randint(0, 50, (11, 140), dtype=torch.int32, device=device)
    args["topk_indices"] = big[:, ::2]
    args["swa_block_table"] = args["swa_block_table"].t().contiguous().t()
    _same(prefill_slot_indices(**args), prefill_slot_indices_ref(**args))
    e = dict(args, positions=args["positions"][:0], topk_indices=args["topk_indices"][:0])
    out = prefill_slot_indices(**e)
    assert out[0].shape == (0, 10) and out[2].shape == (0, 70)


def test_prefill_slot_indices_equals_decode_window_rows(device):
    """A token's window slots are the metadata's decode window row for the same position."""
    W, page = 16, 4
    reqs = [RequestSpec(1, prefix_len=p, swa_block_table=torch.randperm(64)[:20].tolist())
            for p in (0, 3, 17, 40)]
    md = build_step_metadata(reqs, window_size=W, swa_page_size=page, device=device)
    s, sl, _, _ = prefill_slot_indices(md.positions, md.token_to_req, md.seq_lens,
                                       md.swa_block_table, page, W)
    assert torch.equal(s, md.decode_swa_indices) and torch.equal(sl, md.decode_swa_lens)


def test_prefill_slot_indices_bad_inputs(device):
    args = _case(device, T=4, K=8)
    for kw, exc, name in (
        (dict(positions=args["positions"].float()), TypeError, "positions"),
        (dict(token_to_req=args["token_to_req"][:2]), ValueError, "token_to_req"),
        (dict(topk_indices=args["topk_indices"][:3]), ValueError, "topk_indices"),
        (dict(topk_indices=None), TypeError, "topk_indices"),
        (dict(swa_page_size=0), ValueError, "swa_page_size"),
        (dict(window_size=0), ValueError, "window_size"),
        (dict(compressed_block_table=args["compressed_block_table"][0]), ValueError,
         "compressed_block_table"),
    ):
        with pytest.raises(exc, match=name):
            prefill_slot_indices(**dict(args, **kw))


def _window_case(device, T=37, W=20, K=45, r=4, G=60, first=1):
    """``_case`` as the window entry's arguments: the workspace holds requests ``first ..``
    (``G`` rows each), some gather lens past ``G`` or negative, tokens of request 0 outside."""
    a = _case(device, T=T, W=W, K=K, r=r)
    g = torch.Generator().manual_seed(T + 3 * W)
    nreq = a["seq_lens"].shape[0] - first
    glen = torch.randint(-2, G + 9, (nreq,), generator=g).to(torch.int32)
    return dict(positions=a["positions"], token_to_req=a["token_to_req"],
                seq_lens=a["seq_lens"], gather_lens=glen.to(device), first_request=first,
                rows_per_request=G, window_size=W, topk_indices=a["topk_indices"],
                compressed_block_table=a["compressed_block_table"],
                compressed_page_size=a["compressed_page_size"], compress_ratio=r)


@pytest.mark.parametrize("T,W,K,r,G,first", [(37, 20, 45, 4, 60, 1), (1, 128, 512, 4, 300, 0),
                                             (9, 7, 130, 1, 5, 0), (13, 33, 1, 128, 40, 2),
                                             (5, 16, 0, 4, 16, 0), (21, 24, 40, 0, 70, 1),
                                             (6, 9, 700, 4, 20, 0)])
def test_prefill_window_slot_indices_matches_ref(device, T, W, K, r, G, first):
    args = _window_case(device, T=T, W=W, K=K, r=r, G=G, first=first)
    if r == 0:
        args.update(topk_indices=None, compressed_block_table=None)
    poison = torch.full((3, T), -7, dtype=torch.int32, device=device)
    got = prefill_window_slot_indices(**args)
    assert not got[0].eq(poison).all()
    _same(got, prefill_window_slot_indices_ref(**args))
    if r == 0:
        assert got[1] is None and got[2] is None and got[0][2].eq(0).all()
    else:  # the top-k part is prefill_slot_indices'
        p = prefill_slot_indices(args["positions"], args["token_to_req"], args["seq_lens"],
                                 torch.zeros(3, 1, dtype=torch.int32, device=device), 1, W,
                                 args["topk_indices"], args["compressed_block_table"],
                                 args["compressed_page_size"], r)
        _same(got[1:], p[2:])
        assert torch.equal(got[0][2], p[3])


def test_prefill_window_slot_indices_hostile(device):
    """Invalid requests, requests outside the workspace, negative positions, positions past
    the request, int64 and strided inputs: every window stays inside its request's rows."""
    G = 50
    args = _window_case(device, T=21, W=24, K=40, G=G, first=1)
    args["token_to_req"] = args["token_to_req"].clone()
    args["token_to_req"][[0, 5]] = torch.tensor([-1, 7], dtype=torch.int32, device=device)
    args["positions"] = args["positions"].clone()
    args["positions"][[2, 9]] = torch.tensor([-3, 10 ** 6], device=device)
    # a few positions just past their request's end
    past = torch.tensor([17, 19, 20], device=device)  # (sorted: of the last requests)
    args["positions"][past] = args["seq_lens"][args["token_to_req"][past].long()].long() + 3
    args["topk_indices"] = args["topk_indices"].long()
    args["seq_lens"] = args["seq_lens"].long()
    glen = torch.randint(G - 5, G + 9, (args["gather_lens"].shape[0],), dtype=torch.int32)
    args["gather_lens"] = torch.stack([glen.to(device)] * 2, 1).view(-1)[::2]  # strided
    win, ext, el = prefill_window_slot_indices(**args)
    _same((win, ext, el), prefill_window_slot_indices_ref(**args))
    assert win[:2, [0, 5, 2]].eq(0).all()
    i = (args["token_to_req"].long() - 1).cpu()
    start, n = win[0].long().cpu(), win[1].long().cpu()
    has = n > 0
    assert has.sum() > 5
    assert (start[has] >= G * i[has]).all() and (start[has] + n[has] <= G * (i[has] + 1)).all()
    assert (n <= 24).all() and n[past.cpu()].gt(0).all()


def test_prefill_window_slot_indices_equals_index_op(device):
    """On a layer's step metadata, each chunk's window rows are the workspace index op's
    (``combine_topk_swa_indices(..., window_rows=)``, which derives positions from the query
    starts instead) and its top-k slots are ``prefill_slot_indices``'."""
    W, page, r, cpage = 16, 4, 4, 2
    g = torch.Generator().manual_seed(5)
    reqs = [RequestSpec(q, prefix_len=p, swa_block_table=torch.randperm(64, generator=g)[:20]
                        .tolist(),
                        compressed_block_tables={r: torch.randperm(40, generator=g)[:12]
                                                 .tolist()})
            for q, p in ((1, 9), (1, 30), (7, 0), (2, 5), (13, 3), (20, 17), (9, 40))]
    md = build_step_metadata(reqs, window_size=W, swa_page_size=page,
                             compressed_page_sizes={r: cpage}, prefill_chunk_size=2,
                             device=device)
    K = 6
    tk = torch.randint(-1, 12, (md.num_tokens, K), generator=g, dtype=torch.int32).to(device)
    plan = md.chunk_plan(r)
    assert len(plan) >= 2
    for ch in plan:
        a, b = ch.tok_start, ch.tok_end
        pr = slice(ch.req_start - md.num_decodes, ch.req_end - md.num_decodes)
        G = ch.M - ch.N
        win, ext, el = prefill_window_slot_indices(
            md.positions[a:b], md.token_to_req[a:b], md.seq_lens, md.prefill_gather_lens[pr],
            ch.req_start, G, W, tk[a:b], md.compressed[r].block_table, cpage, r)
        want = torch.empty(3, b - a, dtype=torch.int32, device=device)
        combine_topk_swa_indices(md.positions[a:b, None], md.query_start_loc[ch.req_start:
                                                                             ch.req_end + 1],
                                 md.prefill_seq_lens[pr], md.prefill_gather_lens[pr], W, 0, 0,
                                 G, 0, None, want)
        assert torch.equal(win[:2], want[:2]) and win[1].gt(0).all()
        p = prefill_slot_indices(md.positions[a:b], md.token_to_req[a:b], md.seq_lens,
                                 md.swa_block_table, page, W, tk[a:b],
                                 md.compressed[r].block_table, cpage, r)
        _same((ext, el), p[2:])


def test_prefill_window_slot_indices_bad_inputs(device):
    args = _window_case(device, T=4, K=8)
    for kw, exc, name in (
        (dict(gather_lens=args["gather_lens"].float()), TypeError, "gather_lens"),
        (dict(gather_lens=args["gather_lens"][None]), ValueError, "gather_lens"),
        (dict(first_request=-1), ValueError, "first_request"),
        (dict(rows_per_request=2 ** 31), ValueError, "rows_per_request"),
        (dict(positions=args["positions"].float()), TypeError, "positions"),
        (dict(topk_indices=args["topk_indices"][:3]), ValueError, "topk_indices"),
        (dict(window_size=0), ValueError, "window_size"),
    ):
        with pytest.raises(exc, match=name):
            prefill_window_slot_indices(**dict(args, **kw))
