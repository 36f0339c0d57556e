"""The lightning indexer (layers/indexer.py): V4 against transformers' DeepSeek-V4 indexer
(keys, scores, top-k sets where not tied), V4.1 against a float64 reference written from the
rules (keys from the KV latent, FP4 groups of 32, the two-level candidate selection)."""
import types

import pytest
import torch
from hf_v4 import hf_cos_sin_cache, hf_v4

from dsv41_triton._utils import is_interpreter
from dsv41_triton.layers.compressor import rms_norm_f, rope_tail
from dsv41_triton.layers.indexer import (
    IndexerSpec,
    LightningIndexer,
    dense_topk,
    visible_lens,
)
from dsv41_triton.layers.metadata import RequestSpec, build_step_metadata
from dsv41_triton.ops.indexer_ref import (
    allocate_index_k_cache,
    apply_candidates_ref,
    candidate_blocks_ref,
    fp4_simulate_ref,
    index_logits_ref,
    index_topk_ref,
    read_index_k_ref,
)
from dsv41_triton.ops.rope_ref import make_cos_sin_cache

PAGE = 4
#: these tests run on CPU tensors: the Triton kernels there only in the interpreter (on a GPU
#: machine the references stand in; tests/ops/test_indexer.py covers the kernels on the GPU)
KERNELS = is_interpreter()


def _sets_equal_where_untied(got, want_idx, scores, vis, k, gap):
    """Rows whose k-th and (k+1)-th visible scores differ by more than ``gap``: same sets."""
    checked = 0
    for t in range(got.shape[0]):
        n = int(vis[t])
        if n == 0:
            assert torch.all(got[t] == -1)
            continue
        row = scores[t, :n].double()
        srt = row.sort(descending=True).values
        if n > k and srt[k - 1] - srt[k] <= gap:
            continue
        a = set(got[t][got[t] >= 0].tolist())
        b = set(want_idx[t][want_idx[t] >= 0].tolist())
        assert a == b, (t, sorted(a ^ b))
        checked += 1
    return checked


def test_v4_indexer_matches_transformers():
    tr, cfg = hf_v4()
    torch.manual_seed(11)
    hf = tr.DeepseekV4Indexer(cfg).float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if "proj" in n else 1.0) + (1.0 if "norm" in n else 0.0))
    spec = IndexerSpec("v4", 4, 64, 32, n_heads=4, head_dim=128, topk=8, hadamard=False, fp4=False,
                       eps=cfg.rms_norm_eps)
    ours = LightningIndexer(spec, reference=not KERNELS)
    ours.load(hf.state_dict())
    S = 90
    x = torch.randn(1, S, 64)
    qres = torch.randn(1, S, 32)
    cache = types.SimpleNamespace(layers=[tr.DeepseekV4CSACache(cfg)])
    seen = {}
    hf.scorer.register_forward_hook(lambda m, a, out: seen.__setitem__("scores", out))
    cs = hf_cos_sin_cache(hf.rotary_emb, S)
    nblk = S // PAGE + 2
    swa_table = torch.randperm(nblk).tolist()
    c_table = torch.randperm(nblk).tolist()
    state = torch.full((nblk, PAGE, ours.compressor.spec.state_width), float("nan"))
    icache = allocate_index_k_cache(nblk, PAGE, 128)
    checked = 0
    a = 0
    for c in [37, 6, 1, 1, 1, 3, 1, 40]:
        pos = torch.arange(a, a + c)
        with torch.no_grad():
            hf_top = hf(x[:, a:a + c], qres[:, a:a + c], pos[None], cache, 0)[0]
        hf_scores = seen["scores"][0]
        md = build_step_metadata([RequestSpec(c, a, swa_table, {4: c_table})], window_size=128,
                                 swa_page_size=PAGE, compressed_page_sizes={4: PAGE})
        keys, done = ours.keys_from_hidden(x[0, a:a + c], md.positions, cs, md.token_to_req, state,
                                           md.swa_block_table, md.swa_slot_mapping)
        ours.store_keys(keys, icache, md.compressed[4].slot_mapping)
        # the keys are transformers' compressed index keys
        hf_keys = cache.layers[0].compressed_kv["indexer"][0]
        e = (md.positions[done] // 4)
        torch.testing.assert_close(keys[done], hf_keys[e], rtol=1e-4, atol=1e-4)
        # float scores equal transformers'
        q = ours.queries(qres[0, a:a + c], md.positions, cs, quantize=False)
        w = ours.head_weights(x[0, a:a + c])
        kf = hf_keys.double()
        sf = (torch.einsum("thd,nd->thn", q.double(), kf).relu() * w.double()[..., None]).sum(1)
        vis = visible_lens(md.positions, 4)
        n = kf.shape[0]
        fin = torch.arange(n)[None, :] < vis[:, None]
        torch.testing.assert_close(sf[fin].float(), hf_scores[fin], rtol=1e-4, atol=1e-3)
        # the kernel path (FP8 keys, bf16 queries) picks transformers' set where not tied
        top, _ = ours.select(x[0, a:a + c], qres[0, a:a + c], md.positions, cs, icache,
                             md.compressed[4].block_table, md.token_to_req)
        gap = 0.08 * float(sf[fin].abs().max()) if fin.any() else 0.0
        checked += _sets_equal_where_untied(top, hf_top, sf, vis, 8, gap)
        a += c
    assert a == S and checked > 20


def _v41_reference_keys(ix, latent, pos, cs):
    W = {n: p.double() for n, p in ix.named_parameters()}
    k = rms_norm_f(latent.double() @ W["wk.weight"].t(), W["k_norm.weight"], ix.spec.eps)
    return rope_tail(k, (pos // ix.spec.ratio) * ix.spec.ratio, cs.double())


@pytest.mark.parametrize("ratio", [1, 2])
def test_v41_indexer_matches_float64_rules(ratio):
    torch.manual_seed(3)
    hidden, qlora, S = 40, 24, 70
    spec = IndexerSpec("v4.1", ratio, hidden, qlora, n_heads=3, head_dim=128, topk=16,
                       candidate_topk_blocks=3, candidate_block_size=4)
    ix = LightningIndexer(spec, reference=not KERNELS)
    with torch.no_grad():
        for n, p in ix.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if "norm" in n else 0.0))
    cs = make_cos_sin_cache(S + 1, base=160000.0)
    latent = torch.randn(S, 512)
    pos = torch.arange(S)
    done = (pos + 1) % ratio == 0
    keys = ix.keys_from_latent(latent, pos, cs)
    want = _v41_reference_keys(ix, latent, pos, cs)
    torch.testing.assert_close(keys[done].double(), want[done], rtol=1e-5, atol=1e-5)
    n_ent = S // ratio
    nblk = n_ent // PAGE + 2
    table = torch.randperm(nblk).int()
    icache = allocate_index_k_cache(nblk, PAGE, 128)
    icache.fill_(0xCD)
    e = pos // ratio
    slots = torch.where(done, table[e // PAGE].long() * PAGE + e % PAGE, torch.full_like(e, -1))
    ix.store_keys(keys, icache, slots)
    stored = read_index_k_ref(icache, table[torch.arange(n_ent) // PAGE].long() * PAGE + torch.arange(n_ent) % PAGE)
    ref_fp4 = fp4_simulate_ref(want[done].float())
    close = (stored - ref_fp4).abs() <= 1e-6 * ref_fp4.abs().amax()
    assert close.float().mean() > 0.995  # fp32 vs fp64 may flip a rounding at a grid midpoint
    # scores and top-k over the stored keys, every token of the request at once
    x = torch.randn(S, hidden)
    qr = torch.randn(S, qlora)
    bt = table[None]
    req = torch.zeros(S, dtype=torch.int32)
    top, cand = ix.select(x, qr, pos, cs, icache, bt, req, publish_candidates=True)
    q = ix.queries(qr, pos, cs)
    q64 = fp4_simulate_ref(rope_tail((qr.double() @ ix.wq_b.weight.double().t()).view(S, 3, 128),
                                     pos, cs.double()).float())
    # bf16 holds FP4-simulated values exactly; fp32 vs fp64 may flip a rounding at a midpoint
    assert (q.float() == q64).float().mean() > 0.995
    w = x.double() @ ix.weights_proj.weight.double().t() * (128 ** -0.5 * 3 ** -0.5)
    vis = visible_lens(pos, ratio)
    lg = index_logits_ref(q, w.float(), icache, bt, req, vis, max_len=n_ent)
    assert _sets_equal_where_untied(top, index_topk_ref(lg, vis, 16), lg, vis, 16, 1e-4) > S // 2
    assert torch.equal(cand, candidate_blocks_ref(lg, vis, 3, 4))
    # token chunks (a small logits scratch) give the same rows
    ix.max_logits_elems = 3 * n_ent
    top_c, cand_c = ix.select(x, qr, pos, cs, icache, bt, req, publish_candidates=True)
    ix.max_logits_elems = 1 << 28
    assert torch.equal(top_c, top) and torch.equal(cand_c, cand)
    # a later index source chooses inside the candidate blocks
    top2, _ = ix.select(x, qr, pos, cs, icache, bt, req, candidates=cand)
    lg2 = apply_candidates_ref(lg, cand, 4)
    assert _sets_equal_where_untied(top2, index_topk_ref(lg2, vis, 16), lg2, vis, 16, 1e-4) > S // 2
    blocks = torch.where(top2 >= 0, top2 // 4, torch.full_like(top2, -1))
    for t in range(S):
        allowed = set(cand[t][cand[t] >= 0].tolist())
        assert set(blocks[t][blocks[t] >= 0].tolist()) <= allowed
        if vis[t] > 0:
            assert int((vis[t] - 1) // 4) in allowed  # the newest block is always a candidate


def test_dense_topk_and_visibility():
    pos = torch.tensor([0, 126, 127, 128, 300, 5])
    valid = torch.tensor([True, True, True, True, True, False])
    assert visible_lens(pos, 128, valid).tolist() == [0, 0, 1, 1, 2, 0]
    d = dense_topk(pos, 128, 3, valid)
    assert d.tolist() == [[-1, -1, -1], [-1, -1, -1], [0, -1, -1], [0, -1, -1], [0, 1, -1], [-1, -1, -1]]


def _v41_select_args(S=20):
    """A V4.1 indexer (3 heads of 128) and the arguments of one ``select`` call."""
    spec = IndexerSpec("v4.1", 2, 40, 24, n_heads=3, head_dim=128, topk=16,
                       candidate_topk_blocks=2, candidate_block_size=4)
    ix = LightningIndexer(spec, reference=not KERNELS)
    kw = dict(x=torch.randn(S, 40), qr=torch.randn(S, 24), positions=torch.arange(S),
              cos_sin_cache=make_cos_sin_cache(S + 1), index_cache=allocate_index_k_cache(4, 4, 128),
              block_table=torch.tensor([[0, 1, 2]], dtype=torch.int32),
              token_to_req=torch.zeros(S, dtype=torch.int32), valid=torch.ones(S, dtype=torch.bool))
    return ix, kw


_BAD_SELECT = [
    ("x", lambda kw: kw["x"][:5], ValueError),
    ("x", lambda kw: kw["x"].to("meta"), ValueError),
    ("qr", lambda kw: torch.randn(20, 25), ValueError),
    ("positions", lambda kw: kw["positions"].float(), TypeError),
    ("cos_sin_cache", lambda kw: kw["cos_sin_cache"][:, :32], ValueError),
    ("index_cache", lambda kw: allocate_index_k_cache(4, 4, 64), ValueError),
    ("valid", lambda kw: kw["valid"].int(), TypeError),
    ("width", lambda kw: -1, ValueError),
    ("candidates", lambda kw: torch.zeros(20, 3), TypeError),
    ("candidates", lambda kw: torch.zeros(19, 3, dtype=torch.int32), ValueError),
    ("publish_candidates", lambda kw: 1, TypeError),
]


@pytest.mark.parametrize("name,bad,exc", _BAD_SELECT)
def test_select_rejects_bad_arguments(name, bad, exc):
    ix, kw = _v41_select_args()
    kw[name] = bad(kw)
    with pytest.raises(exc, match=f"^{name}:"):
        ix.select(**kw)


def test_select_publishing_needs_candidate_blocks():
    ix, kw = _v41_select_args()
    object.__setattr__(ix.spec, "candidate_topk_blocks", 0)
    with pytest.raises(ValueError, match="candidate_topk_blocks"):
        ix.select(**kw, publish_candidates=True)


def test_positions_past_the_cos_sin_cache_are_not_rotated():
    """As the RoPE ops: the query (and key) of a position past the table is not rotated."""
    ix, kw = _v41_select_args()
    with torch.no_grad():
        ix.wq_b.weight.normal_()
        ix.wk.weight.normal_()
    pos, cs = kw["positions"], kw["cos_sin_cache"]
    at0 = torch.where(pos < 4, pos, 0)  # position 0: identity
    assert torch.equal(ix.queries(kw["qr"], pos, cs[:4]), ix.queries(kw["qr"], at0, cs))
    latent = torch.randn(20, 512)
    assert torch.equal(ix.keys_from_latent(latent, pos, cs[:4]),
                       ix.keys_from_latent(latent, torch.where(pos < 4, pos, 0) // 2 * 2, cs))
    top, _ = ix.select(**dict(kw, cos_sin_cache=cs[:4]))
    assert top.shape == (20, 16)


@pytest.mark.parametrize("call,exc,match", [
    (lambda ix: ix.keys_from_latent(torch.randn(4, 511), torch.arange(4), make_cos_sin_cache(8)), ValueError, "latent"),
    (lambda ix: ix.keys_from_latent(torch.randn(4, 512), torch.arange(3), make_cos_sin_cache(8)), ValueError, "positions"),
    (lambda ix: ix.store_keys(torch.randn(4, 64), allocate_index_k_cache(2, 4, 128), torch.arange(4)), ValueError, "keys"),
    (lambda ix: ix.store_keys(torch.randn(4, 128), allocate_index_k_cache(2, 4, 128)[:, :2], torch.arange(4)),
     ValueError, "index_cache"),
    (lambda ix: ix.head_weights(torch.randn(4, 41)), ValueError, "x"),
    (lambda ix: ix.queries(torch.randn(4, 24), torch.arange(4), make_cos_sin_cache(8).half()), TypeError, "cos_sin_cache"),
    (lambda ix: visible_lens(torch.arange(4.0), 2), TypeError, "positions"),
    (lambda ix: visible_lens(torch.arange(4), 2, torch.ones(3, dtype=torch.bool)), ValueError, "valid"),
    (lambda ix: dense_topk(torch.arange(4), 2, -1), ValueError, "width"),
    (lambda ix: IndexerSpec("v4.1", 2, 40, 24, candidate_block_size=0), ValueError, "candidate_block_size"),
])
def test_pieces_reject_bad_arguments(call, exc, match):
    ix, _ = _v41_select_args()
    with pytest.raises(exc, match=match):
        call(ix)


def test_v4_keys_check_cos_sin_cache_before_writing_state():
    spec = IndexerSpec("v4", 4, 16, 24, n_heads=2, head_dim=128, topk=8)
    ix = LightningIndexer(spec, reference=not KERNELS)
    state = torch.full((4, PAGE, ix.compressor.spec.state_width), 7.0)
    T = 8
    with pytest.raises(ValueError, match="cos_sin_cache"):
        ix.keys_from_hidden(torch.randn(T, 16), torch.arange(T), torch.zeros(16, 32),
                            torch.zeros(T, dtype=torch.int32), state,
                            torch.tensor([[0, 1]], dtype=torch.int32), torch.arange(T))
    assert torch.all(state == 7.0)
