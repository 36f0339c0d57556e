"""mask_index_rows (Triton) vs its PyTorch reference vs a literal per-entry reading; bit-equal."""
import pytest
import torch

from dsv41_triton.ops.index_mask import mask_index_rows
from dsv41_triton.ops.index_mask_ref import mask_index_rows_ref, masked_width
from dsv41_triton.testing import POISON_INT, poison_


def mask_loop(idx, lens, multiple, num_rows=None):
    T, K = idx.shape
    bound = 2 ** 31 if num_rows is None else min(num_rows, 2 ** 31)
    Kp = max(-(-K // multiple) * multiple, multiple)
    rows = []
    for t in range(T):
        n = K if lens is None else int(lens[t])
        row = []
        for c in range(Kp):
            e = int(idx[t, c]) if c < K else -1
            row.append(e if (0 <= e < bound and c < n) else -1)
        rows.append(row)
    return rows


def _idx(T, K, dtype, device, stride_pad=0):
    base = torch.randint(-5, 1 << 20, (T, K + stride_pad), dtype=dtype)
    base[torch.rand(T, K + stride_pad) < 0.25] = -1
    idx = base.to(device)
    return idx[:, :K] if stride_pad else idx


def _lens(kind, T, K, device):
    if kind is None:
        return None
    if kind == "ragged":
        return torch.randint(0, K + 1, (T,), dtype=torch.int32).to(device)
    if kind == "over":  # past K: clamped to K
        return torch.randint(K + 1, K + 100, (T,), dtype=torch.int64).to(device)
    if kind == "negative":  # clamped to 0 (a mix of negative and in-range lengths)
        v = torch.randint(-(1 << 40), K + 1, (T,), dtype=torch.int64)
        v[::2] = -torch.randint(1, 50, (v[::2].numel(),))
        return v.to(device)
    raise AssertionError(kind)


def _check(idx, lens, multiple, num_rows=None):
    out = poison_(torch.empty((idx.shape[0], masked_width(idx.shape[1], multiple)),
                              dtype=torch.int32, device=idx.device))
    got = mask_index_rows(idx, lens, multiple, out=out, num_rows=num_rows)
    assert got is out
    ref = mask_index_rows_ref(idx, lens, multiple, num_rows=num_rows)
    assert ref.dtype == torch.int32 and got.dtype == torch.int32
    assert torch.equal(got.cpu(), ref.cpu())
    assert ref.cpu().tolist() == mask_loop(idx.cpu(), None if lens is None else lens.cpu(),
                                           multiple, num_rows)
    fresh = mask_index_rows(idx, lens, multiple, num_rows=num_rows)
    assert torch.equal(fresh.cpu(), ref.cpu())
    return got


@pytest.mark.parametrize("lens_kind", [None, "ragged", "over", "negative"])
@pytest.mark.parametrize("T,K,multiple", [(1, 1, 64), (5, 70, 64), (37, 128, 64),
                                          (3, 200, 128), (17, 33, 8)])
def test_mask_index_rows_matches_reference(device, T, K, multiple, lens_kind):
    idx = _idx(T, K, torch.int32, device)
    _check(idx, _lens(lens_kind, T, K, device), multiple)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_mask_index_rows_strided_rows_and_int64(device, dtype):
    idx = _idx(19, 150, dtype, device, stride_pad=13)  # rows of stride 163
    assert idx.stride(0) == 163
    lens = _lens("ragged", 19, 150, device)
    _check(idx, lens, 64)
    _check(idx, None, 64)
    # transposed storage: column stride != 1
    t = _idx(150, 19, dtype, device).t()
    assert t.stride(1) != 1
    _check(t, _lens("ragged", 19, 150, device)[:19], 64)


def test_mask_index_rows_int64_past_int32(device):
    """int64 ids of 2**31 and more are past every cache: -1, not truncated to a valid slot."""
    idx = _idx(7, 90, torch.int64, device)
    idx[:, ::3] += 2 ** 32
    idx[:, 1::5] = 2 ** 31
    idx[:, 2::7] = 2 ** 31 - 1
    idx[:, 4::11] = -(2 ** 63)
    got = _check(idx, None, 64).cpu()[:, :90]
    wide = idx.cpu() >= 2 ** 31
    assert bool(wide.any()) and bool((got[wide] == -1).all())
    assert bool((got[idx.cpu() == 2 ** 31 - 1] == 2 ** 31 - 1).all())
    _check(idx, _lens("ragged", 7, 90, device), 64)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_mask_index_rows_num_rows(device, dtype):
    """Ids at or past ``num_rows`` are -1; ``num_rows - 1`` is kept; int64 ids past int32 never
    wrap into a row below the bound; a bound of 0 keeps nothing, one past int32 bounds nothing."""
    idx = _idx(11, 150, dtype, device)  # ids up to 2**20
    for n in (1, 1000, (1 << 19) + 3):
        idx[:, 7] = n - 1
        idx[:, 9] = n
        _check(idx, _lens("ragged", 11, 150, device), 64, num_rows=n)
        got = _check(idx, None, 64, num_rows=n).cpu()
        assert bool((got[:, 7] == n - 1).all()) and bool((got[:, 9] == -1).all())
        kept = got[got >= 0]
        assert kept.numel() > 0 and int(kept.max()) < n
    assert bool((_check(idx, None, 64, num_rows=0) == -1).all())
    assert torch.equal(_check(idx, None, 64, num_rows=2 ** 40).cpu(),
                       _check(idx, None, 64).cpu())
    if dtype == torch.int64:
        idx[:, 3] = 2 ** 32 + 5  # slot 5 if truncated
        assert bool((_check(idx, None, 64, num_rows=10).cpu()[:, 3] == -1).all())


def test_mask_index_rows_edges(device):
    # K already a multiple: same width, negatives still -1
    idx = _idx(4, 128, torch.int32, device)
    assert _check(idx, None, 64).shape == (4, 128)
    # K = 0: one block of -1
    e = torch.empty((3, 0), dtype=torch.int32, device=device)
    got = _check(e, torch.tensor([0, 5, -2], device=device), 64)
    assert got.shape == (3, 64) and bool((got == -1).all())
    # T = 0
    z = torch.empty((0, 10), dtype=torch.int64, device=device)
    assert mask_index_rows(z, torch.empty(0, dtype=torch.int32, device=device), 64).shape == (0, 64)
    # -1 everywhere
    m = torch.full((6, 40), -1, dtype=torch.int32, device=device)
    assert bool((_check(m, None, 64) == -1).all())
    # lens strided (a column of a 2-D tensor)
    idx = _idx(9, 70, torch.int32, device)
    ls = torch.randint(0, 71, (9, 3), dtype=torch.int32).to(device)[:, 1]
    _check(idx, ls, 64)


def test_mask_index_rows_literal():
    idx = torch.tensor([[5, -3, 7, 9], [1, 2, 3, 4]], dtype=torch.int32)
    lens = torch.tensor([3, 1], dtype=torch.int32)
    assert mask_index_rows(idx, lens, 8).tolist() == [[5, -1, 7, -1, -1, -1, -1, -1],
                                                      [1] + [-1] * 7]
    assert mask_index_rows(idx, None, 4).tolist() == [[5, -1, 7, 9], [1, 2, 3, 4]]


def test_mask_index_rows_bad_input():
    idx = torch.zeros((2, 4), dtype=torch.int32)
    with pytest.raises(TypeError, match="idx"):
        mask_index_rows(idx.float(), None, 8)
    with pytest.raises(ValueError, match="idx"):
        mask_index_rows(idx[0], None, 8)
    with pytest.raises(ValueError, match="lens"):
        mask_index_rows(idx, torch.zeros(3, dtype=torch.int32), 8)
    with pytest.raises(TypeError, match="lens"):
        mask_index_rows(idx, torch.zeros(2), 8)
    with pytest.raises(ValueError, match="multiple"):
        mask_index_rows(idx, None, 0)
    with pytest.raises(ValueError, match="num_rows"):
        mask_index_rows(idx, None, 8, num_rows=-1)
    with pytest.raises(ValueError, match="out"):
        mask_index_rows(idx, None, 8, out=torch.empty((2, 4), dtype=torch.int32))
    with pytest.raises(TypeError, match="out"):
        mask_index_rows(idx, None, 8, out=torch.empty((2, 8), dtype=torch.int64))


@pytest.mark.gpu
def test_mask_index_rows_cuda_graph():
    idx = _idx(128, 512, torch.int32, "cuda")
    lens = _lens("ragged", 128, 512, "cuda")
    out = torch.empty((128, 512), dtype=torch.int32, device="cuda")
    mask_index_rows(idx, lens, 64, out=out)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mask_index_rows(idx, lens, 64, out=out)
    idx.copy_(_idx(128, 512, torch.int32, "cuda"))
    lens.copy_(_lens("ragged", 128, 512, "cuda"))
    poison_(out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), mask_index_rows_ref(idx, lens, 64).cpu())
    assert not bool((out == POISON_INT).any())
