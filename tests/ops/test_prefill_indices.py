"""``prefill_slot_indices`` (Triton) against its reference, bit for bit, and against the step
metadata's decode window rows."""
import pytest
import torch

from dsv41_triton.layers.metadata import RequestSpec, build_step_metadata
from dsv41_triton.ops.prefill_indices import prefill_slot_indices
from dsv41_triton.ops.prefill_indices_ref import prefill_slot_indices_ref


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
                                     (13, 33, 1, 128), (5, 16, 0, 4)])
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
