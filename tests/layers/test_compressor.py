"""The KV compressor (layers/compressor.py): V4.1 ratios 1/2 and V4 ratios 4/128 against the
float64 oracle written from the rules, in chunked prefill + decode steps over a paged state
cache; V4 ratios 4/128 against transformers' DeepSeek-V4 compressors."""
import types

import pytest
import torch
from hf_v4 import hf_cos_sin_cache, hf_v4

from dsv41_triton.layers.compressor import (
    CompressorSpec,
    KVCompressor,
    compress_sequence_ref,
    rms_norm_f,
    rope_tail,
)
from dsv41_triton.layers.metadata import RequestSpec, build_step_metadata
from dsv41_triton.ops.rope_ref import make_cos_sin_cache

PAGE = 4


def _random_compressor(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    comp = KVCompressor(spec)
    with torch.no_grad():
        for name, p in comp.named_parameters():
            if name == "norm.weight":
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if name == "ape" else 0.2))
    return comp


def run_steps(comp, xs, steps, poison=float("nan")):
    """Run ``steps`` (lists of ``(request, new tokens)``, decodes first) over requests whose
    inputs are ``xs[b] [S_b, hidden]``; return per request the entries the compressor emitted,
    ``{b: {entry: latent}}``."""
    B = len(xs)
    total = max(x.shape[0] for x in xs)
    nblk = -(-total // PAGE)
    perm = torch.randperm(B * nblk + 3)
    tables = [perm[b * nblk:(b + 1) * nblk].tolist() for b in range(B)]
    state = None
    if comp.spec.state_width:
        state = torch.full((B * nblk + 3, PAGE, comp.spec.state_width), poison)
    done = [0] * B
    got = {b: {} for b in range(B)}
    for step in steps:
        reqs = [RequestSpec(n, done[b], tables[b]) for b, n in step]
        md = build_step_metadata(reqs, window_size=128, swa_page_size=PAGE, decode_threshold=1)
        x = torch.cat([xs[b][done[b]:done[b] + n] for b, n in step])
        lat, comp_mask = comp(x, md.positions, md.token_to_req, state, md.swa_block_table,
                              md.swa_slot_mapping, md.is_valid_token)
        for t in comp_mask.nonzero().squeeze(1).tolist():
            b = step[md.token_to_req[t].item()][0]
            got[b][int(md.positions[t]) // comp.spec.ratio] = lat[t]
        assert torch.all(lat[~comp_mask] == 0)
        for b, n in step:
            done[b] += n
    return got


def _steps_for(lengths, prefill_chunks, decodes):
    """Chunked prefill of every request, then up to ``decodes`` single-token steps of each
    (a request keeps at least one prefill token)."""
    dec = [min(decodes, L - 1) for L in lengths]
    steps, pos = [], [0] * len(lengths)
    for chunk in prefill_chunks:
        st = []
        for b, L in enumerate(lengths):
            n = min(chunk, L - dec[b] - pos[b])
            if n > 0:
                st.append((b, n))
                pos[b] += n
        if st:  # decodes first: a 1-token chunk is a decode request for the metadata
            steps.append(sorted(st, key=lambda e: e[1] > 1))
    assert all(p + d == L for p, d, L in zip(pos, dec, lengths)), "prefill chunks too short"
    for i in range(decodes):
        st = [(b, 1) for b in range(len(lengths)) if i < dec[b]]
        if st:
            steps.append(st)
    return steps


@pytest.mark.parametrize("version,ratio", [("v4.1", 1), ("v4.1", 2), ("v4", 4), ("v4", 128)])
def test_compressor_matches_float64_oracle(version, ratio):
    hidden = 48
    spec = CompressorSpec.for_version(version, ratio, 512, hidden)
    comp = _random_compressor(spec)
    lengths = [3 * ratio + 5, 2 * ratio + 1, ratio - 1 if ratio > 1 else 1]
    xs = [torch.randn(L, hidden) for L in lengths]
    dec = 6
    steps = _steps_for(lengths, [ratio + 3, 5, 2 * ratio, 7 * ratio], dec)
    got = run_steps(comp, xs, steps)
    for b, x in enumerate(xs):
        want = compress_sequence_ref(x, comp)
        assert sorted(got[b]) == list(range(want.shape[0])), (b, sorted(got[b]))
        for e, v in got[b].items():
            torch.testing.assert_close(v.double(), want[e], rtol=2e-5, atol=2e-5)


def test_overlap_rule_by_hand():
    """V4 ratio 4, entry 1 pools tokens 0..3 through channels 0..D-1 and tokens 4..7 through
    D..2D-1 (softmax over the 8 per channel); entry 0 only tokens 0..3 through D..2D-1."""
    spec = CompressorSpec.for_version("v4", 4, 512, 16)
    comp = _random_compressor(spec, seed=3)
    x = torch.randn(8, 16, dtype=torch.float64)
    ref = compress_sequence_ref(x, comp)
    W = {n: p.double() for n, p in comp.named_parameters()}
    kv, sc = x @ W["wkv.weight"].t(), x @ W["wgate.weight"].t() + W["ape"].repeat(2, 1)
    k1 = torch.cat([kv[0:4, :512], kv[4:8, 512:]])
    s1 = torch.cat([sc[0:4, :512], sc[4:8, 512:]])
    p1 = (torch.softmax(s1, 0) * k1).sum(0)
    n1 = p1 * torch.rsqrt(p1.pow(2).mean() + spec.eps) * W["norm.weight"]
    torch.testing.assert_close(ref[1], n1)
    p0 = (torch.softmax(sc[0:4, 512:], 0) * kv[0:4, 512:]).sum(0)
    torch.testing.assert_close(ref[0], p0 * torch.rsqrt(p0.pow(2).mean() + spec.eps) * W["norm.weight"])


@pytest.mark.parametrize("ratio", [4, 128])
def test_v4_compressor_matches_transformers(ratio):
    tr, cfg = hf_v4()
    torch.manual_seed(5)
    hf = (tr.DeepseekV4CSACompressor if ratio == 4 else tr.DeepseekV4HCACompressor)(cfg).float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.2 if "proj" in n else 1.0) + (1.0 if "norm" in n else 0.0))
    comp = KVCompressor(CompressorSpec.for_version("v4", ratio, 512, 64, eps=cfg.rms_norm_eps))
    comp.load(hf.state_dict())
    S = 2 * ratio + 9
    x = torch.randn(1, S, 64)
    qres = torch.randn(1, S, 32)
    layer_cls = tr.DeepseekV4CSACache if ratio == 4 else tr.DeepseekV4HCACache
    cache = types.SimpleNamespace(layers=[layer_cls(cfg)])
    chunks = [ratio + 1, 3, ratio - 2] + [1] * (S - 2 * ratio - 2)
    a = 0
    for c in chunks:
        pos = torch.arange(a, a + c)[None]
        hf_kv, _ = hf(x[:, a:a + c], qres[:, a:a + c], pos, cache, 0)
        a += c
    assert a == S
    hf_kv = hf_kv[0, 0]  # [entries, 512], RoPE'd
    got = run_steps(comp, [x[0]], [[(0, c)] for c in chunks])[0]
    cs = hf_cos_sin_cache(hf.rotary_emb, S)
    ours = torch.stack([got[e] for e in range(S // ratio)])
    ours = rope_tail(ours, torch.arange(S // ratio) * ratio, cs)
    assert hf_kv.shape == ours.shape
    torch.testing.assert_close(ours, hf_kv, rtol=1e-4, atol=1e-4)


def _step(ratio=4, T=8):
    """A V4 compressor and one request's first step: ``(comp, kwargs of forward)``."""
    comp = _random_compressor(CompressorSpec.for_version("v4", ratio, 512, 16))
    kw = dict(x=torch.randn(T, 16), positions=torch.arange(T),
              token_to_req=torch.zeros(T, dtype=torch.int32),
              state_cache=torch.full((4, PAGE, comp.spec.state_width), 7.0),
              block_table=torch.tensor([[0, 1]], dtype=torch.int32), slot_mapping=torch.arange(T),
              valid=torch.ones(T, dtype=torch.bool))
    return comp, kw


_BAD_FORWARD = [
    ("x", lambda kw: torch.randn(8, 17), ValueError),
    ("x", lambda kw: kw["x"].int(), TypeError),
    ("x", lambda kw: kw["x"].to("meta"), ValueError),
    ("positions", lambda kw: kw["positions"].float(), TypeError),
    ("positions", lambda kw: kw["positions"][:-1], ValueError),
    ("token_to_req", lambda kw: kw["token_to_req"][None], ValueError),
    ("slot_mapping", lambda kw: kw["slot_mapping"][:-2], ValueError),
    ("state_cache", lambda kw: kw["state_cache"].transpose(0, 1), ValueError),
    ("block_table", lambda kw: None, ValueError),
    ("block_table", lambda kw: kw["block_table"][0], ValueError),
    ("block_table", lambda kw: kw["block_table"].float(), TypeError),
    ("valid", lambda kw: kw["valid"].int(), TypeError),
]


@pytest.mark.parametrize("name,bad,exc", _BAD_FORWARD)
def test_forward_rejects_bad_arguments_before_writing(name, bad, exc):
    comp, kw = _step()
    state = kw["state_cache"]
    kw[name] = bad(kw)
    with pytest.raises(exc, match=f"^{name}:"):
        comp(**kw)
    assert torch.all(state == 7.0)


@pytest.mark.parametrize("case", ["request -1", "request 5", "short table"])
def test_forward_missing_request_row_or_block_reads_nothing(case):
    """A token whose request has no block-table row (or a window past the table) reads no
    state row, as a ``-1`` block does; it never reads another request's row."""
    comp, kw = _step()
    kw["block_table"] = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    want_kw = dict(kw, state_cache=kw["state_cache"].clone())
    if case == "short table":
        kw["block_table"] = kw["block_table"][:, :1]
        want_kw["block_table"] = torch.tensor([[0, -1], [2, -1]], dtype=torch.int32)
    else:
        kw["token_to_req"] = torch.full((8,), int(case.split()[1]), dtype=torch.int32)
        want_kw["block_table"] = torch.full((2, 2), -1, dtype=torch.int32)
    got, done = comp(**kw)
    want, want_done = comp(**want_kw)
    assert torch.equal(done, want_done) and done.any()
    assert torch.equal(got, want)


def test_rope_tail_leaves_positions_past_the_table_unrotated():
    """As the RoPE ops: a position outside ``[0, max_pos)`` is not rotated."""
    x = torch.randn(5, 2, 128, dtype=torch.float64)
    cs = make_cos_sin_cache(16).double()
    pos = torch.tensor([0, 3, 4, 100, -1])
    got = rope_tail(x, pos, cs[:4])
    want = rope_tail(x, torch.where((pos >= 0) & (pos < 4), pos, 0), cs)  # position 0: identity
    assert torch.equal(got, want)
    assert torch.equal(got[2:], x[2:]) and not torch.equal(got[1], x[1])
    assert torch.equal(rope_tail(x, pos, cs[:0]), x)


@pytest.mark.parametrize("call,exc,match", [
    (lambda c: rope_tail(torch.randn(3, 128), torch.arange(3.0), make_cos_sin_cache(4)), TypeError, "positions"),
    (lambda c: rope_tail(torch.randn(3, 128), torch.arange(2), make_cos_sin_cache(4)), ValueError, "positions"),
    (lambda c: rope_tail(torch.randn(3, 128), torch.arange(3), torch.zeros(4, 32)), ValueError, "cos_sin_cache"),
    (lambda c: rope_tail(torch.randn(3, 32), torch.arange(3), make_cos_sin_cache(4)), ValueError, "x"),
    (lambda c: c.project(torch.randn(3, 15), torch.arange(3)), ValueError, "x"),
    (lambda c: c.pool(torch.randn(2, 8, 100), torch.zeros(2, dtype=torch.bool)), ValueError, "rows"),
    (lambda c: c.pool(torch.randn(2, 8, 2048), torch.zeros(3, dtype=torch.bool)), ValueError, "first_entry"),
    (lambda c: compress_sequence_ref(torch.randn(8, 17), c), ValueError, "x"),
    (lambda c: compress_sequence_ref(torch.randn(8, 16), None), TypeError, "comp"),
    (lambda c: rms_norm_f(torch.randn(3, 8), torch.ones(7), 1e-6), ValueError, "weight"),
    (lambda c: CompressorSpec(0, 512, 16), ValueError, "ratio"),
])
def test_pieces_reject_bad_arguments(call, exc, match):
    comp, _ = _step()
    with pytest.raises(exc, match=match):
        call(comp)
