"""combine_topk_swa_indices / compute_global_topk_indices_and_lens (Triton) vs the vectorized
references vs a literal per-token reading of SPEC §5. Bit-equal everywhere."""
import pytest
import torch

from dsv41_triton._utils import round_up
from dsv41_triton.ops.indices import combine_topk_swa_indices, compute_global_topk_indices_and_lens
from dsv41_triton.ops.indices_ref import (
    combine_topk_swa_indices_ref,
    compute_global_topk_indices_and_lens_ref,
)
from dsv41_triton.testing import poison_


# --------------------------------------------------------------------------------------------
# literal SPEC readings (slow Python loops, small sizes only)
# --------------------------------------------------------------------------------------------
def combine_loop(topk_indices, qsl, seq_lens, gather_lens, W, r, topk, M, N):
    T = topk_indices.shape[0]
    width = round_up(topk + W, 128)
    out = [[-1] * width for _ in range(T)]
    lens = [0] * T
    win = [[0] * T for _ in range(3)]  # window_rows: first row, length, top-k length
    q = [int(v) - int(qsl[0]) for v in qsl]
    for b in range(len(q) - 1):
        sl = int(seq_lens[b])
        gl = sl if gather_lens is None else int(gather_lens[b])
        qlen = q[b + 1] - q[b]
        for i in range(qlen):
            t = q[b] + i
            if t >= T:
                continue
            pos = sl - qlen + i
            tl_ = 0 if r == 0 else min((pos + 1) // r, topk)
            row = []
            for c in range(tl_):
                e = int(topk_indices[t, c])
                row.append(M * b + e if 0 <= e < N else -1)
            first = max(pos - W + 1, 0, sl - gl)
            for p in range(first, pos + 1):
                row.append(M * b + N + (p - (sl - gl)))
            out[t][: len(row)] = row
            lens[t] = len(row)
            win[0][t], win[1][t], win[2][t] = M * b + N + first - (sl - gl), len(row) - tl_, tl_
    return (torch.tensor(out, dtype=torch.int32).view(T, width),
            torch.tensor(lens, dtype=torch.int32), torch.tensor(win, dtype=torch.int32).view(3, T))


def global_loop(topk_indices, tok2req, block_table, bs, valid):
    T, K = topk_indices.shape
    R, MB = block_table.shape
    out = torch.full((T, K), -1, dtype=torch.int32)
    lens = torch.zeros(T, dtype=torch.int32)
    for t in range(T):
        req = int(tok2req[t])
        kept = []
        for k in range(K):
            i = int(topk_indices[t, k])
            if i < 0 or not (0 <= req < R) or i // bs >= MB:
                continue
            slot = int(block_table[req, i // bs]) * bs + i % bs
            if 0 <= slot < 2**31:
                kept.append(slot)
        out[t, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
        lens[t] = len(kept) if (valid is None or bool(valid[t])) else 0
    return out, lens


def _check_combine(device, ti, qsl, seq, gl, W, r, topk, M, N, loop=True):
    T = ti.shape[0]
    width = round_up(topk + W, 128)
    out = (poison_(torch.empty(T, width, dtype=torch.int32, device=device)),
           poison_(torch.empty(T, dtype=torch.int32, device=device)))
    win = poison_(torch.empty(3, T, dtype=torch.int32, device=device))
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    idx, lens = combine_topk_swa_indices(dev(ti), dev(qsl), dev(seq), dev(gl), W, r, topk, M, N,
                                         out=out, window_rows=win)
    assert idx is out[0] and lens is out[1]
    ref_out = (torch.empty(T, width, dtype=torch.int32), torch.empty(T, dtype=torch.int32))
    ref_win = torch.empty(3, T, dtype=torch.int32)
    ref_idx, ref_lens = combine_topk_swa_indices_ref(ti, qsl, seq, gl, W, r, topk, M, N,
                                                     out=ref_out, window_rows=ref_win)
    assert ref_idx is ref_out[0]
    assert torch.equal(idx.cpu(), ref_idx)
    assert torch.equal(lens.cpu(), ref_lens)
    assert torch.equal(win.cpu(), ref_win)
    # the window part of every row is the range the hint names
    start, wlen, tlen = ref_win.long()
    assert torch.equal(tlen + wlen, ref_lens.long())
    cols = torch.arange(width)[None, :]
    in_win = (cols >= tlen[:, None]) & (cols < ref_lens[:, None])
    assert torch.equal(ref_idx.long()[in_win], (start[:, None] + cols - tlen[:, None])[in_win])
    if loop:
        loop_idx, loop_lens, loop_win = combine_loop(ti, qsl, seq, gl, W, r, topk, M, N)
        assert torch.equal(ref_idx, loop_idx) and torch.equal(ref_lens, loop_lens)
        assert torch.equal(ref_win, loop_win)
    return ref_idx, ref_lens


# --------------------------------------------------------------------------------------------
# combine_topk_swa_indices
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("r", [0, 1, 2])
@pytest.mark.parametrize("with_gather", [False, True])
def test_combine_mixed_batch(device, r, with_gather):
    # requests: empty first, a long prefix, one token at pos 0, empty, a short prefix (< W),
    # a chunked prefill with gather_len < seq_len; query_start_loc[0] != 0
    qlens = [0, 5, 1, 0, 3, 6]
    seq = torch.tensor([0, 40, 1, 9, 3, 70], dtype=torch.int32)
    gl = torch.tensor([0, 40, 1, 9, 3, 20], dtype=torch.int32) if with_gather else None
    qsl = torch.tensor([7] + [7 + sum(qlens[: i + 1]) for i in range(len(qlens))], dtype=torch.int32)
    T = sum(qlens) + 2  # two padding tokens past the last request
    W, topk, N = 8, 12, 30
    M = N + 70
    ti = torch.randint(-3, N + 4, (T, topk), dtype=torch.int32)
    ti[1] = -1  # a -1 row
    idx, lens = _check_combine(device, ti, qsl, seq, gl, W, r, topk, M, N)
    assert (lens[-2:] == 0).all() and (idx[-2:] == -1).all()
    assert (lens[:-2] > 0).all()
    if r:
        assert ((idx[:, :topk] >= 0).sum() > 0) and (lens > W).any()


def test_combine_out_of_range_entries_count(device):
    """top-k entries >= N or < 0 become -1 but still count in lens."""
    T, topk, W, N, M = 3, 4, 2, 10, 50
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    seq = torch.tensor([100], dtype=torch.int32)
    ti = torch.tensor([[0, 9, 10, -1], [-5, 3, 99, 2], [1, 2, 3, 4]], dtype=torch.int32)
    idx, lens = _check_combine(device, ti, qsl, seq, None, W, 1, topk, M, N)
    assert idx[0, :6].tolist() == [0, 9, -1, -1, N + 96, N + 97]  # pos 97, window 96..97
    assert idx[1, :4].tolist() == [-1, 3, -1, 2]
    assert lens.tolist() == [6, 6, 6]
    assert idx.shape == (3, 128)


def test_combine_prefix_shorter_than_window_and_ratio2(device):
    qsl = torch.tensor([0, 5], dtype=torch.int32)
    seq = torch.tensor([5], dtype=torch.int32)  # positions 0..4
    ti = torch.randint(0, 3, (5, 8), dtype=torch.int32)
    idx, lens = _check_combine(device, ti, qsl, seq, None, 128, 2, 8, 64, 3)
    # topk_len = (pos+1)//2 = 0,1,1,2,2 ; window = pos+1
    assert lens.tolist() == [1, 3, 4, 6, 7]
    assert idx[0, :2].tolist() == [3, -1]
    assert idx[4, 2:7].tolist() == [3, 4, 5, 6, 7]
    assert idx.shape[1] == 256


def test_combine_gather_shorter_than_seq(device):
    qsl = torch.tensor([0, 2, 4], dtype=torch.int32)
    seq = torch.tensor([50, 10], dtype=torch.int32)
    gl = torch.tensor([3, 10], dtype=torch.int32)  # request 0 gathered positions 47..49 only
    ti = torch.randint(0, 5, (4, 4), dtype=torch.int32)
    idx, lens = _check_combine(device, ti, qsl, seq, gl, 8, 0, 4, 100, 20)
    # token 0: pos 48 -> window 47..48 -> rows N + 0, N + 1
    assert idx[0, :3].tolist() == [20, 21, -1] and lens[0].item() == 2
    assert idx[1, :4].tolist() == [20, 21, 22, -1] and lens[1].item() == 3
    # request 1 at M*1: token 2 pos 8 -> window 1..8
    assert idx[2, :8].tolist() == [100 + 20 + p for p in range(1, 9)]


def test_combine_one_token_and_int64_and_strided(device):
    full = torch.randint(-1, 40, (1, 32), dtype=torch.int64)
    ti = full[:, 8:24]  # strided, wider than topk
    qsl = torch.tensor([5, 6], dtype=torch.int64)
    seq = torch.tensor([33], dtype=torch.int64)
    _check_combine(device, ti, qsl, seq, None, 4, 1, 10, 100, 40)


def test_combine_no_requests_and_empty(device):
    ti = torch.randint(0, 5, (3, 4), dtype=torch.int32)
    qsl = torch.tensor([0], dtype=torch.int32)
    seq = torch.empty(0, dtype=torch.int32)
    idx, lens = _check_combine(device, ti, qsl, seq, None, 8, 1, 4, 10, 5)
    assert (idx == -1).all() and (lens == 0).all()
    i0, l0 = combine_topk_swa_indices(torch.empty(0, 4, dtype=torch.int32, device=device),
                                      torch.tensor([0, 0], device=device), torch.tensor([3], device=device),
                                      None, 8, 1, 4, 10, 5)
    assert i0.shape == (0, 128) and l0.shape == (0,)


def test_combine_out_reuse_overwrites_stale_rows(device):
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    seq = torch.tensor([3], dtype=torch.int32)
    ti = torch.randint(0, 3, (3, 4), dtype=torch.int32)
    out = (torch.full((3, 128), 777, dtype=torch.int32, device=device),
           torch.full((3,), 777, dtype=torch.int32, device=device))
    idx, lens = combine_topk_swa_indices(ti.to(device), qsl.to(device), seq.to(device), None, 4, 1, 4, 10, 3, out=out)
    ref = combine_topk_swa_indices_ref(ti, qsl, seq, None, 4, 1, 4, 10, 3)
    assert torch.equal(idx.cpu(), ref[0]) and torch.equal(lens.cpu(), ref[1])


def test_combine_random_batches(device):
    g = torch.Generator().manual_seed(7)
    for trial in range(4):
        B = int(torch.randint(1, 6, (1,), generator=g))
        qlens = torch.randint(0, 5, (B,), generator=g)
        seq = qlens + torch.randint(0, 300, (B,), generator=g)
        gl = torch.minimum(seq, torch.randint(0, 300, (B,), generator=g) + qlens)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlens.cumsum(0)]) + trial
        T = int(qlens.sum()) + trial
        W, topk, r = [(128, 16, 1), (5, 7, 2), (3, 0, 0), (16, 200, 2)][trial]
        N = 150
        M = N + 310
        ti = torch.randint(-2, N + 2, (T, max(topk, 1)), generator=g).to(torch.int32)
        _check_combine(device, ti, qsl.to(torch.int32), seq.to(torch.int32), gl.to(torch.int32),
                       W, r, topk, M, N)


def test_combine_bad_inputs():
    ti = torch.zeros(3, 4, dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    seq = torch.tensor([3], dtype=torch.int32)
    ok = dict(window_size=4, compress_ratio=1, topk=4, M=10, N=3)
    with pytest.raises(TypeError, match="topk_indices"):
        combine_topk_swa_indices(ti.float(), qsl, seq, None, **ok)
    with pytest.raises(ValueError, match="topk_indices"):
        combine_topk_swa_indices(ti, qsl, seq, None, **{**ok, "topk": 5})
    with pytest.raises(ValueError, match="seq_lens"):
        combine_topk_swa_indices(ti, qsl, torch.tensor([3, 4], dtype=torch.int32), None, **ok)
    with pytest.raises(ValueError, match="gather_lens"):
        combine_topk_swa_indices(ti, qsl, seq, torch.tensor([1, 2], dtype=torch.int32), **ok)
    with pytest.raises(ValueError, match="window_size"):
        combine_topk_swa_indices(ti, qsl, seq, None, **{**ok, "window_size": -1})
    with pytest.raises(TypeError, match="compress_ratio"):
        combine_topk_swa_indices(ti, qsl, seq, None, **{**ok, "compress_ratio": 1.0})
    with pytest.raises(ValueError, match="M"):
        combine_topk_swa_indices(ti, qsl, seq, None, **{**ok, "M": 2**31})
    with pytest.raises(ValueError, match="^N: expected <= M"):
        combine_topk_swa_indices(ti, qsl, seq, None, **{**ok, "N": 11})
    with pytest.raises(ValueError, match="indices"):
        combine_topk_swa_indices(ti, qsl, seq, None, **ok,
                                 out=(torch.empty(3, 64, dtype=torch.int32), torch.empty(3, dtype=torch.int32)))
    with pytest.raises(TypeError, match="lens"):
        combine_topk_swa_indices(ti, qsl, seq, None, **ok,
                                 out=(torch.empty(3, 128, dtype=torch.int32), torch.empty(3, dtype=torch.int64)))
    with pytest.raises(TypeError, match="out"):
        combine_topk_swa_indices(ti, qsl, seq, None, **ok, out=torch.empty(3, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="window_rows"):
        combine_topk_swa_indices(ti, qsl, seq, None, **ok, window_rows=torch.empty(3, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="window_rows"):
        combine_topk_swa_indices(ti, qsl, seq, None, **ok, window_rows=torch.empty(3, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("r", [1, 2])
def test_combine_large_gpu(r):
    # 8192 tokens x width 640 (topk 512 + W 128)
    B = 4
    qlens = torch.tensor([2048, 1, 4095, 2048])
    seq = qlens + torch.tensor([0, 5000, 300, 60000])
    gl = torch.minimum(seq, qlens + 127)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlens.cumsum(0)]).to(torch.int32)
    T = int(qlens.sum())
    N = 32768
    ti = torch.randint(-1, N + 10, (T, 512), dtype=torch.int32)
    args = (qsl, seq.to(torch.int32), gl.to(torch.int32), 128, r, 512, N + 8192, N)
    win = poison_(torch.empty(3, T, dtype=torch.int32, device="cuda"))
    idx, lens = combine_topk_swa_indices(ti.cuda(), *[a.cuda() if torch.is_tensor(a) else a for a in args],
                                         window_rows=win)
    ref_win = torch.empty(3, T, dtype=torch.int32)
    ref = combine_topk_swa_indices_ref(ti, *args, window_rows=ref_win)
    assert idx.shape == (8192, 640)
    assert torch.equal(idx.cpu(), ref[0]) and torch.equal(lens.cpu(), ref[1])
    assert torch.equal(win.cpu(), ref_win)


# --------------------------------------------------------------------------------------------
# compute_global_topk_indices_and_lens
# --------------------------------------------------------------------------------------------
def _check_global(device, ti, tok2req, bt, bs, valid):
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    idx, lens = compute_global_topk_indices_and_lens(dev(ti), dev(tok2req), dev(bt), bs, dev(valid))
    ref_idx, ref_lens = compute_global_topk_indices_and_lens_ref(ti, tok2req, bt, bs, valid)
    assert idx.dtype == torch.int32 and lens.dtype == torch.int32
    assert torch.equal(idx.cpu(), ref_idx) and torch.equal(lens.cpu(), ref_lens)
    loop_idx, loop_lens = global_loop(ti, tok2req, bt, bs, valid)
    assert torch.equal(ref_idx, loop_idx) and torch.equal(ref_lens, loop_lens)
    return ref_idx, ref_lens


@pytest.mark.parametrize("bs", [1, 4, 64])
def test_global_edge_cases(device, bs):
    R, MB = 3, 5
    bt = torch.randperm(100)[: R * MB].view(R, MB).to(torch.int32)
    bt[2, 3] = -1  # a negative block id: dropped
    T, K = 7, 13
    ti = torch.randint(-2, bs * (MB + 2), (T, K), dtype=torch.int32)  # some block columns >= MB
    ti[3] = -1
    ti[4, :] = bs * MB  # all past the table
    tok2req = torch.tensor([0, 1, 2, 0, 1, -1, 3], dtype=torch.int32)  # out-of-range requests
    valid = torch.tensor([1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    idx, lens = _check_global(device, ti, tok2req, bt, bs, valid)
    assert lens[2] == 0 and (idx[2] >= 0).any()  # invalid token: row translated, len 0
    assert (idx[3:7] == -1).all() and (lens[3:7] == 0).all()
    assert (lens[:2] > 0).all()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bs", [1, 4, 64])
def test_global_slots_past_int32_dropped(device, bs, dtype):
    """Block ids whose slots pass 2**31 - 1 (the int32 output) are dropped, never wrapped; the
    last representable slot survives."""
    last = (2**31 - 1) // bs
    ids = [last - 1, last, last + 1, 2**30 if bs > 1 else 2**31 - 1]
    if dtype == torch.int64:
        ids.append(2**32 // bs)  # the same low 32 bits as slot 0
    ids = [i for i in ids if dtype == torch.int64 or i < 2**31]
    bt = torch.tensor([ids], dtype=dtype)
    ti = torch.arange(bs * len(ids), dtype=torch.int32)[None].repeat(2, 1)
    ti[1] = ti[1].flip(0)
    idx, lens = _check_global(device, ti, torch.tensor([0, 0], dtype=torch.int32), bt, bs, None)
    assert int(idx.max()) == 2**31 - 1 and (idx[0, : lens[0]] >= bs * (last - 1)).all()


def test_global_left_packing_order(device):
    bt = torch.tensor([[10, 20], [30, 40]], dtype=torch.int32)
    ti = torch.tensor([[-1, 5, -1, 0, 9, 2, -1]], dtype=torch.int32)  # bs 4: 9 -> col 2 (past)
    idx, lens = _check_global(device, ti, torch.tensor([1], dtype=torch.int32), bt, 4, None)
    assert idx[0].tolist() == [40 * 4 + 1, 30 * 4, 30 * 4 + 2, -1, -1, -1, -1]
    assert lens.tolist() == [3]


def test_global_multi_chunk_rows_and_strided(device):
    """K > 1024 (two chunks: the running count carries over) and a strided input."""
    R, MB, bs = 2, 40, 64
    bt = torch.randint(0, 5000, (R, MB), dtype=torch.int64)
    full = torch.randint(-1, bs * (MB + 1), (3, 2 * 1500), dtype=torch.int32)
    ti = full[:, ::2]
    _check_global(device, ti, torch.tensor([1, 0, 1, 9]), bt, bs, torch.tensor([1, 1, 1, 0], dtype=torch.uint8))


def test_global_empty(device):
    idx, lens = compute_global_topk_indices_and_lens(
        torch.empty(0, 8, dtype=torch.int32, device=device), torch.empty(0, dtype=torch.int32, device=device),
        torch.zeros(1, 1, dtype=torch.int32, device=device), 64, torch.empty(0, dtype=torch.bool, device=device))
    assert idx.shape == (0, 8) and lens.shape == (0,)
    _check_global(device, torch.randint(-1, 5, (2, 3), dtype=torch.int32), torch.tensor([0, 0]),
                  torch.empty(0, 4, dtype=torch.int32), 4, None)


def test_global_bad_inputs():
    ti = torch.zeros(3, 4, dtype=torch.int32)
    req = torch.zeros(3, dtype=torch.int32)
    bt = torch.zeros(2, 2, dtype=torch.int32)
    valid = torch.ones(3, dtype=torch.bool)
    with pytest.raises(TypeError, match="topk_indices"):
        compute_global_topk_indices_and_lens(ti.float(), req, bt, 4, valid)
    with pytest.raises(ValueError, match="token_to_req_indices"):
        compute_global_topk_indices_and_lens(ti, req[:2], bt, 4, valid)
    with pytest.raises(ValueError, match="block_table"):
        compute_global_topk_indices_and_lens(ti, req, bt[0], 4, valid)
    with pytest.raises(ValueError, match="block_size"):
        compute_global_topk_indices_and_lens(ti, req, bt, 0, valid)
    with pytest.raises(ValueError, match="is_valid_token"):
        compute_global_topk_indices_and_lens(ti, req, bt, 4, valid[:1])
    with pytest.raises(TypeError, match="is_valid_token"):
        compute_global_topk_indices_and_lens(ti, req, bt, 4, valid.float())


@pytest.mark.gpu
def test_global_large_gpu():
    T, K, R, MB, bs = 8192, 512, 64, 512, 64
    bt = torch.randperm(R * MB).view(R, MB).to(torch.int32)
    ti = torch.randint(-1, bs * MB + 100, (T, K), dtype=torch.int32)
    req = torch.randint(-1, R + 1, (T,), dtype=torch.int32)
    valid = torch.rand(T) > 0.1
    idx, lens = compute_global_topk_indices_and_lens(ti.cuda(), req.cuda(), bt.cuda(), bs, valid.cuda())
    ref = compute_global_topk_indices_and_lens_ref(ti, req, bt, bs, valid)
    assert torch.equal(idx.cpu(), ref[0]) and torch.equal(lens.cpu(), ref[1])
