"""Lightning-indexer ops (``ops/indexer.py``) against their reference (``ops/indexer_ref.py``)."""
import pytest
import torch

from dsv41_triton.ops.indexer import (
    index_logits,
    index_topk,
    index_topk_torch,
    quantize_and_insert_index_k,
    select_topk,
)
from dsv41_triton.ops.indexer_ref import (
    allocate_index_k_cache,
    apply_candidates_ref,
    candidate_blocks_ref,
    fp4_exponents,
    fp4_simulate_ref,
    hadamard_ref,
    index_logits_ref,
    index_topk_ref,
    quantize_and_insert_index_k_ref,
    read_index_k_ref,
)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _spread_rows(T, dim, dtype, device, decades=3.0):
    """Random rows whose 32-groups have amplitudes spread over ``decades`` decades."""
    g = dim // 32
    amp = torch.logspace(-decades / 2, decades / 2, g, dtype=torch.float64)[torch.randperm(g)]
    x = torch.randn(T, dim, dtype=torch.float64) * amp.repeat_interleave(32)
    return x.to(dtype).to(device)


def test_fp4_simulate_rule():
    x = _spread_rows(64, 128, torch.float32, "cpu")
    x[0, :32] = 0.0  # an all-zero group: the amax floor
    x[1, :32] = 6.0  # amax exactly 6 -> scale 1
    v = fp4_simulate_ref(x).double()
    e = fp4_exponents(x)
    s = torch.pow(2.0, e.double()).repeat_interleave(32, -1)
    amax = x.double().unflatten(-1, (-1, 32)).abs().amax(-1).clamp_min(6 * 2.0 ** -126)
    # s is the smallest power of two with 6 * s >= amax
    assert torch.all(6 * torch.pow(2.0, e.double()) >= amax)
    assert torch.all(6 * torch.pow(2.0, e.double() - 1) < amax)
    assert torch.equal(e[1, 0], torch.tensor(0, dtype=torch.int32))
    y = (x.double() / s).clamp(-6, 6)
    # nearest grid value (ties: either neighbour is as near)
    d_best = (y.abs().unsqueeze(-1) - E2M1).abs().min(-1).values
    d_got = (y.abs() - (v / s).abs()).abs()
    assert torch.allclose(d_got, d_best, atol=0, rtol=0)
    assert torch.all(((v / s).abs().unsqueeze(-1) == E2M1).any(-1))
    assert torch.all((v == 0) | (torch.sign(v) == torch.sign(x.double())))


def test_hadamard_is_orthonormal():
    h = hadamard_ref(torch.eye(128, dtype=torch.float64))
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.all(h.abs() == 128 ** -0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp4", [True, False])
@pytest.mark.parametrize("page,T", [(16, 37), (3, 1), (64, 200)])
def test_insert_matches_reference(device, dtype, fp4, page, T):
    nb = 5
    cache = allocate_index_k_cache(nb, page, 128, device)
    cache.fill_(0xAB)  # poison: every byte not written must stay 0xAB
    k = _spread_rows(T, 128, dtype, device)
    slots = torch.randperm(nb * page + 7, device=device)[:T]  # some past the cache
    slots[::5] = -1
    want = cache.clone()
    quantize_and_insert_index_k_ref(k, want, slots, fp4)
    got = cache.clone()
    quantize_and_insert_index_k(k, got, slots.to(torch.int64), fp4)
    assert torch.equal(got, want)


def test_insert_fp4_rows_are_exact(device):
    k = _spread_rows(40, 128, torch.float32, device, decades=4.0)  # exponent spread <= 14
    cache = allocate_index_k_cache(3, 16, 128, device)
    slots = torch.arange(40, device=device, dtype=torch.int32)
    quantize_and_insert_index_k(k, cache, slots)
    assert torch.equal(read_index_k_ref(cache, slots), fp4_simulate_ref(k))


def test_insert_4d_view_empty_and_dims(device):
    cache = allocate_index_k_cache(2, 8, 64, device).unsqueeze(2)
    cache.fill_(0x5A)
    before = cache.clone()
    quantize_and_insert_index_k(torch.randn(0, 64, device=device), cache,
                                torch.zeros(0, dtype=torch.int32, device=device))
    assert torch.equal(cache, before)
    k = torch.randn(3, 64, device=device)
    slots = torch.tensor([15, -1, 2], device=device, dtype=torch.int32)
    quantize_and_insert_index_k(k, cache, slots)
    want = before.clone()
    quantize_and_insert_index_k_ref(k, want, slots)
    assert torch.equal(cache, want)


def test_insert_rejects_bad_input(device):
    cache = allocate_index_k_cache(2, 8, 128, device)
    slots = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="k"):
        quantize_and_insert_index_k(torch.randn(3, 64, device=device), cache, slots)
    with pytest.raises(TypeError, match="slot_mapping"):
        quantize_and_insert_index_k(torch.randn(3, 128, device=device), cache, slots.float())
    with pytest.raises(TypeError, match="index_cache"):
        quantize_and_insert_index_k(torch.randn(3, 128, device=device), cache.float(), slots)
    with pytest.raises(ValueError, match="index_cache"):
        quantize_and_insert_index_k(torch.randn(3, 128, device=device),
                                    torch.zeros(2, 8, 130, dtype=torch.uint8, device=device), slots)


def _filled_cache(nb, page, device, dim=128):
    cache = allocate_index_k_cache(nb, page, dim, device)
    k = _spread_rows(nb * page, dim, torch.bfloat16, device, decades=2.0)
    quantize_and_insert_index_k_ref(k, cache, torch.arange(nb * page, device=device))
    return cache


@pytest.mark.parametrize("H", [1, 3, 16, 64])
@pytest.mark.parametrize("page", [16, 5])
def test_logits_match_reference(device, H, page):
    nb, B = 13, 3
    cache = _filled_cache(nb, page, device)
    max_cols = 4
    bt = torch.randperm(nb, device=device)[: B * max_cols].view(B, max_cols).int()
    bt[2, 3] = -1  # a hole: those entries are -inf
    T = 13
    N = max_cols * page + 3  # columns past the table: -inf
    req = torch.randint(0, B, (T,), device=device)
    req[4] = 7  # no such request: all -inf
    vis = torch.randint(0, N + 1, (T,), device=device)
    vis[0], vis[1] = 0, N
    q = torch.randn(T, H, 128, device=device).to(torch.bfloat16)
    w = torch.rand(T, H, device=device) - 0.2
    big = torch.full((T, N + 9), float("nan"), device=device)
    out = big[:, :N]  # a row stride that is not N
    index_logits(q, w, cache, bt, req.int(), vis.to(torch.int64), out=out)
    want = index_logits_ref(q, w, cache, bt, req, vis, max_len=N)
    assert torch.equal(out.isinf(), want.isinf())
    fin = ~want.isinf()
    assert torch.allclose(out[fin], want[fin], rtol=1e-5, atol=1e-4 * want[fin].abs().max().item())
    assert torch.all(big[:, N:].isnan())
    assert torch.all(out[4].isinf()) and torch.all(out[0].isinf())


def test_logits_empty_and_bad_input(device):
    cache = _filled_cache(2, 16, device)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=device)
    q = torch.randn(0, 4, 128, device=device).bfloat16()
    w = torch.rand(0, 4, device=device)
    e = torch.zeros(0, dtype=torch.int32, device=device)
    assert index_logits(q, w, cache, bt, e, e, max_len=32).shape == (0, 32)
    q = torch.randn(2, 4, 128, device=device).bfloat16()
    w = torch.rand(2, 4, device=device)
    z = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="q"):
        index_logits(q.float(), w, cache, bt, z, z, max_len=8)
    with pytest.raises(ValueError, match="weights"):
        index_logits(q, w[:, :3], cache, bt, z, z, max_len=8)
    with pytest.raises(ValueError, match="max_len"):
        index_logits(q, w, cache, bt, z, z)


def _tied_logits(T, N, device):
    x = torch.randn(T, N, device=device)
    x[:, ::3] = 0.25  # many ties
    x[:, 5::11] = float("-inf")
    return x


@pytest.mark.parametrize("N,k", [(1, 1), (7, 512), (300, 1), (3000, 512), (4099, 1024), (2500, 2048)])
def test_topk_matches_reference(device, N, k):
    T = 6
    x = _tied_logits(T, N, device)
    lens = torch.tensor([N, 0, N // 2, 1, N + 5, max(N - 1, 0)], device=device)
    out = torch.full((T, k), 0x7777, dtype=torch.int32, device=device)
    index_topk(x, lens.int(), k, out=out)
    assert torch.equal(out, index_topk_ref(x, lens, k))


def test_topk_negative_and_equal_rows(device):
    x = -torch.rand(3, 5000, device=device) - 1.0
    x[1] = -3.0  # a whole row tied
    x[2, 100:] = float("-inf")
    lens = torch.full((3,), 5000, dtype=torch.int64, device=device)
    got = index_topk(x, lens, 512)
    assert torch.equal(got, index_topk_ref(x, lens, 512))
    assert torch.equal(got[1], torch.arange(512, device=device, dtype=torch.int32))
    assert torch.all(got[2, 100:] == -1)


def test_topk_torch_variant_same_set_without_ties(device):
    T, N, k = 4, 3000, 512
    x = torch.randperm(T * N, device=device).float().view(T, N)  # all distinct
    lens = torch.tensor([N, 10, 0, 2999], device=device)
    assert torch.equal(index_topk_torch(x, lens, k), index_topk_ref(x, lens, k))
    assert torch.equal(index_topk(x, lens, k), index_topk_ref(x, lens, k))


def test_topk_bad_input(device):
    x = torch.randn(2, 10, device=device)
    with pytest.raises(ValueError, match="lens"):
        index_topk(x, torch.zeros(3, dtype=torch.int32, device=device), 4)
    with pytest.raises(TypeError, match="logits"):
        index_topk(x.double(), torch.zeros(2, dtype=torch.int32, device=device), 4)
    with pytest.raises(ValueError, match="k"):
        index_topk(x, torch.zeros(2, dtype=torch.int32, device=device), 0)


def test_candidate_blocks_rules():
    x = torch.tensor([[5.0, 1.0, 0.0, 9.0, -1.0, 2.0, 3.0, float("-inf"), 4.0, 0.5]])
    lens = torch.tensor([9])
    # blocks of 3: [5,1,0]->5, [9,-1,2]->9, [3,-inf,4]->inf (holds entry 8, the newest)
    assert candidate_blocks_ref(x, lens, 2, 3).tolist() == [[1, 2]]
    assert candidate_blocks_ref(x, lens, 5, 3).tolist() == [[0, 1, 2, -1, -1]]
    assert candidate_blocks_ref(x, torch.tensor([0]), 2, 3).tolist() == [[-1, -1]]
    masked = apply_candidates_ref(x, torch.tensor([[2, -1]]), 3)
    assert torch.all(masked[0, :6].isinf()) and masked[0, 6] == 3.0 and masked[0, 8] == 4.0
    assert masked[0, 9] == float("-inf")


@pytest.mark.gpu
def test_topk_1m_and_logits_8k_gpu():
    dev = "cuda"
    x = torch.randn(8, 1 << 20, device=dev)
    x[:, ::17] = 0.5
    lens = torch.tensor([1 << 20, 0, 1000, 513, 512, 1 << 19, 77777, 1 << 20], device=dev)
    for k in (512, 1024):
        assert torch.equal(index_topk(x, lens, k), index_topk_ref(x, lens, k))
    cache = _filled_cache(130, 64, dev)
    bt = torch.randperm(130, device=dev)[:128].view(1, 128).int()
    q = torch.randn(4, 64, 128, device=dev).bfloat16()
    w = torch.rand(4, 64, device=dev)
    z = torch.zeros(4, dtype=torch.int32, device=dev)
    vis = torch.tensor([8192, 1, 4000, 0], device=dev, dtype=torch.int32)
    got = index_logits(q, w, cache, bt, z, vis, max_len=8192)
    want = index_logits_ref(q, w, cache, bt, z, vis, max_len=8192)
    fin = ~want.isinf()
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.allclose(got[fin], want[fin], rtol=1e-4, atol=1e-3 * want[fin].abs().max().item())


@pytest.mark.gpu
def test_select_topk_dispatch_gpu():
    from dsv41_triton.ops.indexer import TORCH_TOPK_MIN_WIDTH, select_topk

    x = torch.randperm(4 * TORCH_TOPK_MIN_WIDTH, device="cuda").float().view(4, -1)  # distinct
    lens = torch.tensor([TORCH_TOPK_MIN_WIDTH, 5, 0, 1000], device="cuda")
    assert torch.equal(select_topk(x, lens, 512), index_topk_ref(x, lens, 512))
    y = x[:, :4096].contiguous()
    assert torch.equal(select_topk(y, lens.clamp_max(4096), 512), index_topk_ref(y, lens.clamp_max(4096), 512))


def test_index_cache_width_is_a_power_of_two(device):
    with pytest.raises(ValueError, match="power of two"):
        allocate_index_k_cache(2, 4, 96, device)
    with pytest.raises(ValueError, match="power of two"):
        quantize_and_insert_index_k(torch.randn(1, 96, device=device),
                                    torch.zeros(2, 4, 100, dtype=torch.uint8, device=device),
                                    torch.zeros(1, dtype=torch.int32, device=device))


def test_logits_many_tiles_per_program(device):
    """More entries than one program's tiles (8 x 64): programs start mid-row; causal rows end
    inside, at and past a program's range."""
    nb, page = 48, 16
    cache = _filled_cache(nb, page, device)
    bt = torch.randperm(nb, device=device)[:45].view(1, 45).int()
    N = 45 * page  # 720 = 11.25 tiles
    T = 5
    vis = torch.tensor([N, 512, 513, 3, 700], device=device, dtype=torch.int32)
    req = torch.zeros(T, dtype=torch.int32, device=device)
    q = torch.randn(T, 3, 128, device=device).bfloat16()
    w = torch.rand(T, 3, device=device)
    out = torch.full((T, N), float("nan"), device=device)
    index_logits(q, w, cache, bt, req, vis, out=out)
    want = index_logits_ref(q, w, cache, bt, req, vis, max_len=N)
    assert torch.equal(out.isinf(), want.isinf())
    fin = ~want.isinf()
    assert torch.allclose(out[fin], want[fin], rtol=1e-5, atol=1e-4 * want[fin].abs().max().item())


@pytest.mark.gpu
def test_int64_offsets_gpu():
    """An index cache past 2**31 bytes: a request whose blocks are the last ones."""
    dev, page = "cuda", 64
    nb = (1 << 31) // (page * 132) + 8
    cache = allocate_index_k_cache(nb, page, 128, dev)
    blocks = torch.arange(nb - 6, nb, device=dev, dtype=torch.int32)
    slots = (blocks.long()[:, None] * page + torch.arange(page, device=dev)).flatten()
    k = _spread_rows(slots.numel(), 128, torch.bfloat16, dev)
    quantize_and_insert_index_k(k, cache, slots)
    want = cache[nb - 6:].clone()
    cache[nb - 6:].zero_()
    quantize_and_insert_index_k_ref(k, cache, slots)
    assert torch.equal(cache[nb - 6:], want)
    q = torch.randn(3, 64, 128, device=dev).bfloat16()
    w = torch.rand(3, 64, device=dev)
    bt = blocks.flip(0)[None]
    z = torch.zeros(3, dtype=torch.int32, device=dev)
    vis = torch.tensor([6 * page, 100, 1], dtype=torch.int32, device=dev)
    got = index_logits(q, w, cache, bt, z, vis, max_len=6 * page)
    ref = index_logits_ref(q, w, cache, bt, z, vis, max_len=6 * page)
    fin = ~ref.isinf()
    assert torch.equal(got.isinf(), ref.isinf())
    assert torch.allclose(got[fin], ref[fin], rtol=1e-4, atol=1e-3 * ref[fin].abs().max().item())


def _strided_rows(device):
    """Rows of 132 bytes 264 apart: not a cache (its rows are not back to back)."""
    return torch.zeros(2, 8, 264, dtype=torch.uint8, device=device)[..., :132]


@pytest.mark.parametrize("cache_of,match", [
    (_strided_rows, "back to back"),
    (lambda dev: allocate_index_k_cache(2, 16, 128, dev)[:, :8], "page-dim slice"),
    (lambda dev: torch.zeros(2, 0, 132, dtype=torch.uint8, device=dev), "page size"),
])
def test_index_cache_layout_is_checked(device, cache_of, match):
    cache = cache_of(device)
    k = torch.randn(3, 128, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match=match):
        quantize_and_insert_index_k(k, cache, slots)
    with pytest.raises(ValueError, match=match):
        quantize_and_insert_index_k_ref(k, cache, slots)
    assert not cache.any()


def _logits_args(device):
    return dict(q=torch.randn(2, 4, 128, device=device).bfloat16(), weights=torch.rand(2, 4, device=device),
                index_cache=_filled_cache(2, 16, device),
                block_table=torch.zeros(1, 2, dtype=torch.int32, device=device),
                token_to_req=torch.zeros(2, dtype=torch.int32, device=device),
                visible_lens=torch.zeros(2, dtype=torch.int32, device=device), max_len=8)


@pytest.mark.parametrize("change,exc,match", [
    (dict(q=torch.zeros(2, 0, 128).bfloat16(), weights=torch.zeros(2, 0)), ValueError, "at least one head"),
    (dict(out=torch.zeros(2, 9)), ValueError, "max_len"),
])
def test_logits_rejects_bad_arguments(device, change, exc, match):
    kw = _logits_args(device)
    kw.update({n: v.to(device) for n, v in change.items()})
    for f in (index_logits, index_logits_ref):
        with pytest.raises(exc, match=match):
            f(**kw)


@pytest.mark.parametrize("call,exc,match", [
    (lambda d: quantize_and_insert_index_k(torch.randn(1, 128, device=d), allocate_index_k_cache(1, 4, 128, d),
                                           torch.zeros(1, dtype=torch.int32, device=d), fp4=1), TypeError, "fp4"),
    (lambda d: select_topk(None, torch.zeros(2, dtype=torch.int32, device=d), 4), TypeError, "logits"),
    (lambda d: candidate_blocks_ref(torch.randn(2, 8, device=d), torch.zeros(2, dtype=torch.int32, device=d), 0, 4),
     ValueError, "num_blocks"),
    (lambda d: apply_candidates_ref(torch.randn(2, 8, device=d), torch.zeros(2, 3, device=d), 4), TypeError, "candidates"),
    (lambda d: apply_candidates_ref(torch.randn(2, 8, device=d), torch.zeros(3, 1, dtype=torch.int32, device=d), 4),
     ValueError, "candidates"),
    (lambda d: apply_candidates_ref(torch.randn(2, 8, device=d), torch.zeros(2, 1, dtype=torch.int32, device=d), 0),
     ValueError, "block_size"),
    (lambda d: read_index_k_ref(allocate_index_k_cache(1, 4, 128, d), torch.zeros(2, device=d)), TypeError, "slots"),
    (lambda d: fp4_simulate_ref(torch.zeros(2, 64, dtype=torch.int32, device=d)), TypeError, "x"),
    (lambda d: hadamard_ref(torch.zeros(2, 64, dtype=torch.int32, device=d)), TypeError, "x"),
])
def test_indexer_ops_reject_bad_arguments(device, call, exc, match):
    with pytest.raises(exc, match=match):
        call(device)
