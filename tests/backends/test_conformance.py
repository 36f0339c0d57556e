"""Every backend against the float64 reference, on the same cases (SPEC §7 tolerances).

Parametrized over every registered backend: one that cannot serve a case here is skipped with
its probe's reason (FlashMLA without its package, Triton without a GPU or the interpreter).
The FlashMLA backends' own plumbing (head padding to 64/128, index padding, Q re-layout, output
slicing and chunk permutation) is also checked on CPU against stand-ins of FlashMLA's kernels
that enforce its documented constraints and compute with the references.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from dsv41_triton import backends as B
from dsv41_triton.attention.ref import sparse_mla_decode_ref, sparse_mla_prefill_ref
from dsv41_triton.backends import Problem, _flashmla_common
from dsv41_triton.ops import layouts
from dsv41_triton.ops.mxfp8 import alloc_mxfp8_output
from dsv41_triton.ops.kv_cache_ref import quantize_and_insert_k_cache_ref
from dsv41_triton.ops.mxfp8_ref import mxfp8_dequantize_ref, rope_mxfp8_epilogue_ref
from dsv41_triton.ops.records import allocate_k_cache
from dsv41_triton.ops.rope_ref import apply_rope_ref, make_cos_sin_cache
from dsv41_triton.testing import max_abs_err, poison_, rel_err

NAMES = B.list_backends()
#: the backends that serve the plain decode / prefill kinds (flashmla_mega serves only the
#: fused ones, so its plain cases would be skipped everywhere). The torch backend runs the
#: references: its cases check the wrapper (out written in place, lse dtype and shape).
PLAIN_NAMES = tuple(n for n in NAMES if n != "flashmla_mega")
PAGE = 4


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------
@dataclass
class DecodeCase:
    q: torch.Tensor
    swa_cache: torch.Tensor
    swa_indices: torch.Tensor
    swa_lens: torch.Tensor
    extra_cache: Optional[torch.Tensor]
    extra_indices: Optional[torch.Tensor]
    extra_lens: Optional[torch.Tensor]
    sink: Optional[torch.Tensor]

    def args(self):
        return (self.q, self.swa_cache, self.swa_indices, self.swa_lens, self.extra_cache,
                self.extra_indices, self.extra_lens)


def _filled_cache(num_blocks, record, device, g):
    cache = allocate_k_cache(num_blocks, PAGE, record, device)
    k = (torch.randn(num_blocks * PAGE, 512, generator=g) * 2).bfloat16().to(device)
    quantize_and_insert_k_cache_ref(k, cache, torch.arange(num_blocks * PAGE, device=device))
    return cache


def _idx(T, K, nslots, g, device):
    idx = torch.randint(0, nslots, (T, K), generator=g, dtype=torch.int32)
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    lens = torch.randint(1, K + 1, (T,), generator=g, dtype=torch.int32)
    return idx.to(device), lens.to(device)


def make_decode(T, H, swa_record, extra_record, sink, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 512, generator=g).bfloat16().to(device)
    swa = _filled_cache(6, swa_record, device, g)
    si, sl = _idx(T, 8, 6 * PAGE, g, device)
    ec = ei = el = None
    if extra_record is not None:
        ec = _filled_cache(5, extra_record, device, g)
        ei, el = _idx(T, 6, 5 * PAGE, g, device)
    if T > 1:  # one token with no key at all
        sl[1] = 0
        if el is not None:
            el[1] = 0
    s = {"none": None, "rand": torch.randn(H, generator=g).float().to(device),
         "-inf": torch.full((H,), float("-inf"), device=device)}[sink]
    return DecodeCase(q, swa, si, sl, ec, ei, el, s)


def make_prefill(T, H, S, K, sink, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 512, generator=g).bfloat16().to(device)
    kv = (torch.randn(S, 512, generator=g) * 2).bfloat16().to(device)
    idx = torch.randint(-2, S + 3, (T, K), generator=g, dtype=torch.int32).to(device)  # <0, >=S too
    lens = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32).to(device)
    s = None if sink == "none" else torch.randn(H, generator=g).float().to(device)
    return q, kv, idx, lens, s


def _probe_or_skip(name, problems):
    a = B.probe(name, problems)
    if not a.available:
        pytest.skip(a.reason)
    return B.get_backend(name)


def check_decode(backend, c: DecodeCase):
    """(out rel err, lse abs err) of a backend's decode vs the float64 reference."""
    out = poison_(torch.empty_like(c.q))
    o, lse = backend.sparse_mla_decode(*c.args(), attn_sink=c.sink, out=out)
    ro, rl = sparse_mla_decode_ref(*c.args(), attn_sink=c.sink)
    assert o is out and lse.shape == rl.shape and lse.dtype == torch.float32
    return rel_err(o, ro), max_abs_err(lse, rl)


def check_prefill(backend, q, kv, idx, lens, sink):
    out = poison_(torch.empty_like(q))
    o, lse = backend.sparse_mla_prefill(q, kv, idx, lens, attn_sink=sink, out=out)
    ro, rl = sparse_mla_prefill_ref(q, kv, idx, lens, attn_sink=sink)
    assert o is out
    return rel_err(o, ro), max_abs_err(lse, rl)


# --------------------------------------------------------------------------------------------
# conformance over the registered backends
# --------------------------------------------------------------------------------------------
DECODE_CASES = [
    # (T, H, swa record, extra record, sink)
    (3, 3, 584, None, "rand"),
    (1, 1, 528, 584, "none"),
    (3, 8, 584, 288, "-inf"),
    (2, 3, 528, 528, "rand"),
]


@pytest.mark.parametrize("name", PLAIN_NAMES)
@pytest.mark.parametrize("T,H,swa,extra,sink", DECODE_CASES)
def test_decode_conformance(name, T, H, swa, extra, sink, device):
    backend = _probe_or_skip(name, Problem("decode", H, torch.device(device), swa, extra))
    c = make_decode(T, H, swa, extra, sink, device)
    e_out, e_lse = check_decode(backend, c)
    assert e_out <= 1e-2 and e_lse <= 1e-3, (e_out, e_lse)


@pytest.mark.parametrize("name", PLAIN_NAMES)
@pytest.mark.parametrize("T,H,S,K,sink", [(3, 3, 20, 10, "rand"), (1, 1, 5, 3, "none"),
                                          (4, 8, 30, 16, "rand")])
def test_prefill_conformance(name, T, H, S, K, sink, device):
    backend = _probe_or_skip(name, Problem("prefill", H, torch.device(device)))
    e_out, e_lse = check_prefill(backend, *make_prefill(T, H, S, K, sink, device))
    assert e_out <= 1e-2 and e_lse <= 1e-3, (e_out, e_lse)


def _fused_ref(q_std, positions, cs, attn, layout):
    """The fused contract from the float64 reference: RoPE(q) -> attention -> inverse RoPE."""
    out, lse = attn(apply_rope_ref(q_std, positions, cs))
    o = out.clone()
    o[..., 448:] = apply_rope_ref(out.float(), positions, cs, inverse=True)[..., 448:].double()
    return layouts.output_to_groups(o, layout), lse


def _check_fused(res, ref_groups, ref_lse, T, H):
    data, scale, lse = res
    assert data.shape == (T, H // 8, 4096) and scale.shape == (T, H // 8, 32)
    deq = mxfp8_dequantize_ref(data, scale)
    assert rel_err(deq, ref_groups) <= 4e-2  # e4m3 output: ~2^-5 rms per element
    assert max_abs_err(lse, ref_lse) <= 1e-3


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("layout", ["standard", "interleaved"])
def test_fused_decode_conformance(name, layout, device):
    T, H = 3, 8
    backend = _probe_or_skip(name, Problem("decode_fused", H, torch.device(device), 528, 288,
                                           layout=layout))
    c = make_decode(T, H, 528, 288, "rand", device, seed=3)
    cs = make_cos_sin_cache(64, device=device)
    pos = torch.tensor([5, 0, 63], device=device)
    q_in = layouts.q_to_interleaved(c.q) if layout == "interleaved" else c.q
    data, scale = alloc_mxfp8_output(T, 1, device)
    poison_(data)
    res = backend.sparse_mla_decode_fused(q_in, pos, cs, *c.args()[1:], attn_sink=c.sink,
                                          layout=layout, data=data, scale=scale)
    assert res[0] is data and res[1] is scale
    ref, rl = _fused_ref(c.q, pos, cs, lambda qr: sparse_mla_decode_ref(
        qr, *c.args()[1:], attn_sink=c.sink), layout)
    _check_fused(res, ref, rl, T, H)


@pytest.mark.parametrize("name", NAMES)
def test_fused_prefill_conformance(name, device):
    T, H, layout = 4, 16, "interleaved"
    backend = _probe_or_skip(name, Problem("prefill_fused", H, torch.device(device), layout=layout))
    q, kv, idx, lens, sink = make_prefill(T, H, 24, 12, "rand", device, seed=4)
    cs = make_cos_sin_cache(32, device=device)
    pos = torch.tensor([3, 4, 5, 31], device=device)
    res = backend.sparse_mla_prefill_fused(layouts.q_to_interleaved(q), pos, cs, kv, idx, lens,
                                           attn_sink=sink, layout=layout)
    ref, rl = _fused_ref(q, pos, cs, lambda qr: sparse_mla_prefill_ref(qr, kv, idx, lens,
                                                                        attn_sink=sink), layout)
    _check_fused(res, ref, rl, T, H)


def test_a_wrong_backend_fails_the_conformance_check(device):
    class Broken(B.AttentionBackend):
        name = "broken"

        def sparse_mla_decode(self, q, *a, attn_sink=None, softmax_scale=None, out=None):
            out.zero_()
            return out, torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)

    e_out, e_lse = check_decode(Broken(), make_decode(3, 3, 584, 584, "rand", device))
    assert e_out > 1e-2 or e_lse > 1e-3


def test_bad_inputs_raise_before_any_work():
    be = B.get_backend("torch")
    c = make_decode(2, 3, 584, None, "none", "cpu")
    with pytest.raises(TypeError, match="q"):
        be.sparse_mla_decode(c.q.float(), *c.args()[1:])
    with pytest.raises(ValueError, match="swa_indices"):
        be.sparse_mla_decode(c.q, c.swa_cache, c.swa_indices[:1], c.swa_lens)
    with pytest.raises(ValueError, match="attn_sink"):
        be.sparse_mla_decode(*c.args(), attn_sink=torch.zeros(4))
    with pytest.raises(ValueError, match="extra_indices"):
        be.sparse_mla_decode(c.q, c.swa_cache, c.swa_indices, c.swa_lens, c.swa_cache)
    with pytest.raises(ValueError, match="out"):
        be.sparse_mla_decode(*c.args(), out=torch.empty(2, 4, 512, dtype=torch.bfloat16))
    q, kv, idx, lens, _ = make_prefill(2, 3, 5, 4, "none", "cpu")
    with pytest.raises(ValueError, match="lens"):
        be.sparse_mla_prefill(q, kv, idx, lens[:1])
    with pytest.raises(TypeError, match="indices"):
        be.sparse_mla_prefill(q, kv, idx.float())
    # int64 indices are accepted, as by the Triton kernels (FlashMLA's checks want int32)
    o64, l64 = be.sparse_mla_prefill(q, kv, idx.long())
    o32, l32 = be.sparse_mla_prefill(q, kv, idx)
    assert torch.equal(o64, o32) and torch.equal(l64, l32)


# --------------------------------------------------------------------------------------------
# FlashMLA plumbing against stand-ins of its kernels
# --------------------------------------------------------------------------------------------
class _Sched:
    pass


def _assert_flashmla_can_read(indices, rows, topk_length=None):
    """FlashMLA's kernels read int32 ids, skip only ``-1`` and read every other id and
    ``topk_length`` columns unchecked: the rows handed to them hold ``-1`` or an id in
    ``[0, rows)``, the lengths lie in ``[0, topk]``."""
    assert indices.dtype == torch.int32
    assert bool(((indices == -1) | ((indices >= 0) & (indices < rows))).all())
    if topk_length is not None:
        assert topk_length.dtype == torch.int32
        assert bool(((topk_length >= 0) & (topk_length <= indices.shape[-1])).all())


def _fake_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                       num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                       indices=None, attn_sink=None, extra_k_cache=None,
                       extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):
    b, s_q, h_q, d = q.shape
    assert h_q in (64, 128) and d == 512 and head_dim_v == 512 and s_q == 1
    assert isinstance(tile_scheduler_metadata, _Sched) and num_splits is None
    assert is_fp8_kvcache and not causal and block_table is None and cache_seqlens is None
    assert k_cache.dim() == 4 and k_cache.shape[2] == 1 and k_cache.stride(1) == k_cache.shape[-1]
    assert indices.shape[:2] == (b, s_q) and indices.shape[2] % 64 == 0
    _assert_flashmla_can_read(indices, k_cache.shape[0] * k_cache.shape[1], topk_length)
    assert attn_sink is None or attn_sink.shape == (h_q,)
    if extra_k_cache is not None:
        assert extra_k_cache.shape[-1] == k_cache.shape[-1]  # one record for both caches
        assert extra_indices_in_kvcache.shape[2] % 64 == 0
        _assert_flashmla_can_read(extra_indices_in_kvcache,
                                  extra_k_cache.shape[0] * extra_k_cache.shape[1],
                                  extra_topk_length)
    else:
        assert extra_indices_in_kvcache is None and extra_topk_length is None
    o, l = sparse_mla_decode_ref(
        q[:, 0], k_cache[:, :, 0], indices[:, 0], topk_length,
        None if extra_k_cache is None else extra_k_cache[:, :, 0],
        None if extra_k_cache is None else extra_indices_in_kvcache[:, 0], extra_topk_length,
        attn_sink=attn_sink, softmax_scale=softmax_scale)
    return o.bfloat16().unsqueeze(1), l.float().unsqueeze(-1)  # lse [b, h_q, s_q]


def _fake_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    s_q, h_q, d = q.shape
    assert h_q in (64, 128) and kv.dim() == 3 and kv.shape[1] == 1
    assert indices.shape[:2] == (s_q, 1) and indices.shape[2] % 128 == 0
    _assert_flashmla_can_read(indices, kv.shape[0], topk_length)
    o, l = sparse_mla_prefill_ref(q, kv, indices, topk_length, attn_sink=attn_sink,
                                  softmax_scale=sm_scale)
    return o.bfloat16(), torch.zeros_like(l).float(), l.float()


def _fake_mega_common(enable_q_norm, eps, positions, neox, rope_dim, cs, n_wv_group, npc, tma,
                      round_sf, packed, q, attn):
    assert (neox, rope_dim, npc, tma, round_sf, packed) == (False, 64, 32, True, True, True)
    T, h_q, _ = q.shape
    assert h_q in (64, 128) and n_wv_group == h_q // 8 and positions.dtype == torch.int32
    assert bool(((positions >= 0) & (positions < cs.shape[0])).all()), "table row read unchecked"
    qs = layouts.q_from_interleaved(q)  # the kernel reads the interleaved layout
    if enable_q_norm:
        qf = qs.float()
        qs = (qf * torch.rsqrt(qf.square().mean(-1, keepdim=True) + eps)).bfloat16()
    out, lse = attn(apply_rope_ref(qs, positions, cs))
    data, scale = rope_mxfp8_epilogue_ref(out.bfloat16(), positions, cs, layout="interleaved")
    return data, scale, lse.float()


def _fake_mega_decode(enable_q_norm, eps, positions, neox, rope_dim, cs, n_wv_group, npc, tma,
                      round_sf, packed, q, k_cache, indices, sm_scale, d_v, attn_sink, topk_length,
                      extra_k_cache, extra_indices, extra_topk_length):
    assert indices.dim() == 2 and indices.shape[1] % 128 == 0 and k_cache.shape[-1] == 528
    _assert_flashmla_can_read(indices, k_cache.shape[0] * k_cache.shape[1], topk_length)
    if extra_k_cache is not None:
        _assert_flashmla_can_read(extra_indices, extra_k_cache.shape[0] * extra_k_cache.shape[1],
                                  extra_topk_length)
    return _fake_mega_common(
        enable_q_norm, eps, positions, neox, rope_dim, cs, n_wv_group, npc, tma, round_sf, packed,
        q, lambda qr: sparse_mla_decode_ref(
            qr, k_cache[:, :, 0], indices, topk_length,
            None if extra_k_cache is None else extra_k_cache[:, :, 0], extra_indices,
            extra_topk_length, attn_sink=attn_sink, softmax_scale=sm_scale))


def _fake_mega_prefill(enable_q_norm, eps, positions, neox, rope_dim, cs, n_wv_group, npc, tma,
                       round_sf, packed, q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    _assert_flashmla_can_read(indices, kv.shape[0], topk_length)
    d, s, lse = _fake_mega_common(
        enable_q_norm, eps, positions, neox, rope_dim, cs, n_wv_group, npc, tma, round_sf, packed,
        q, lambda qr: sparse_mla_prefill_ref(qr, kv, indices, topk_length, attn_sink=attn_sink,
                                             softmax_scale=sm_scale))
    return d, s, torch.zeros_like(lse), lse


@pytest.fixture
def fake_flashmla(monkeypatch):
    ops = _flashmla_common.FlashMLAOps(
        "fake", with_kvcache=_fake_with_kvcache, sparse_fwd=_fake_sparse_fwd,
        get_metadata=lambda *a, **k: (_Sched(), None), mega_decode=_fake_mega_decode,
        mega_prefill=_fake_mega_prefill)
    monkeypatch.setattr(_flashmla_common, "_CACHE", {"ops": ops, "why": ""})
    return ops


@pytest.mark.parametrize("T,H,extra", [(3, 3, 584), (2, 64, None), (1, 100, 584)])
def test_flashmla_plumbing_decode(fake_flashmla, T, H, extra):
    a = B.probe("flashmla", Problem("decode", H, torch.device("cuda"), 584, extra,
                                    capability=(9, 0)))
    assert a.available and "fake" in a.reason
    e_out, e_lse = check_decode(B.get_backend("flashmla"), make_decode(T, H, 584, extra, "rand", "cpu"))
    assert e_out <= 1e-2 and e_lse <= 1e-3


def test_flashmla_plumbing_prefill(fake_flashmla):
    e_out, e_lse = check_prefill(B.get_backend("flashmla"),
                                 *make_prefill(3, 5, 20, 10, "rand", "cpu"))
    assert e_out <= 1e-2 and e_lse <= 1e-3


@pytest.mark.parametrize("layout,H", [("standard", 8), ("interleaved", 16), ("interleaved", 64)])
def test_flashmla_mega_plumbing(fake_flashmla, layout, H):
    """Q re-layout to 64 padded heads, output group slicing and (standard) chunk permutation
    give exactly what the torch backend's fused contract gives."""
    assert B.probe("flashmla_mega", Problem("decode_fused", H, torch.device("cuda"), 528, 288,
                                            capability=(10, 0), layout=layout))
    T = 3
    c = make_decode(T, H, 528, 288, "rand", "cpu", seed=9)
    cs = make_cos_sin_cache(16, device="cpu")
    pos = torch.tensor([1, 15, 7])
    q_in = layouts.q_to_interleaved(c.q) if layout == "interleaved" else c.q
    mega, ref = B.get_backend("flashmla_mega"), B.get_backend("torch")
    kw = dict(attn_sink=c.sink, layout=layout, q_norm_eps=1e-6)
    d1, s1, l1 = mega.sparse_mla_decode_fused(q_in, pos, cs, *c.args()[1:], **kw)
    d2, s2, l2 = ref.sparse_mla_decode_fused(q_in, pos, cs, *c.args()[1:], **kw)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)
    assert max_abs_err(l1, l2) == 0
    q, kv, idx, lens, sink = make_prefill(T, H, 12, 6, "rand", "cpu")
    q_in = layouts.q_to_interleaved(q) if layout == "interleaved" else q
    d1, s1, _ = mega.sparse_mla_prefill_fused(q_in, pos, cs, kv, idx, lens, attn_sink=sink,
                                              layout=layout)
    d2, s2, _ = ref.sparse_mla_prefill_fused(q_in, pos, cs, kv, idx, lens, attn_sink=sink,
                                             layout=layout)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)


def _wild_ids(idx, rows, g):
    """``idx`` (int32, ids ``< rows`` or ``-1``) as int64 with ids moved out of range: ``2**32 +
    id`` (``id`` when cut to 32 bits), ``rows + id`` (past the cache / workspace) and ``-7``."""
    wild = idx.to(torch.int64)
    r = torch.rand(idx.shape, generator=g).to(idx.device)
    valid = idx >= 0
    wild[valid & (r < 0.2)] += 2 ** 32
    wild[valid & (r >= 0.2) & (r < 0.35)] += rows
    wild[(r >= 0.35) & (r < 0.45)] = -7
    return wild


def _wild_lens(lens):
    """``lens [T >= 4]`` as int64 with values that wrap at 32 bits: ``2**32 + 1`` (every
    column) and ``2 - 2**32`` (none)."""
    wild = lens.to(torch.int64)
    wild[0], wild[3] = 2 ** 32 + 1, 2 - 2 ** 32
    return wild


@pytest.mark.parametrize("H", [3, 64])
def test_flashmla_takes_int64_ids_and_lens(fake_flashmla, H):
    """int64 ids and lens, out of range at 32 or 64 bits: the flashmla backend hands FlashMLA
    int32 rows and lengths it can read (checked by the stand-ins) and returns the torch
    backend's result on the same inputs."""
    g = torch.Generator().manual_seed(100 + H)
    fm, ref = B.get_backend("flashmla"), B.get_backend("torch")
    c = make_decode(5, H, 584, 584, "rand", "cpu", seed=H)
    args = (c.q, c.swa_cache, _wild_ids(c.swa_indices, 6 * PAGE, g), _wild_lens(c.swa_lens),
            c.extra_cache, _wild_ids(c.extra_indices, 5 * PAGE, g), _wild_lens(c.extra_lens))
    o, lse = fm.sparse_mla_decode(*args, attn_sink=c.sink)
    ro, rl = ref.sparse_mla_decode(*args, attn_sink=c.sink)
    assert rel_err(o, ro) <= 1e-2 and max_abs_err(lse, rl) <= 1e-3
    q, kv, idx, lens, sink = make_prefill(5, H, 20, 10, "rand", "cpu", seed=H)
    idx64, lens64 = _wild_ids(idx.clamp(min=-1, max=19), 20, g), _wild_lens(lens)
    out = poison_(torch.empty_like(q))
    o, lse = fm.sparse_mla_prefill(q, kv, idx64, lens64, attn_sink=sink, out=out)
    ro, rl = ref.sparse_mla_prefill(q, kv, idx64, lens64, attn_sink=sink)
    assert o is out and rel_err(o, ro) <= 1e-2 and max_abs_err(lse, rl) <= 1e-3


@pytest.mark.parametrize("H", [8, 64])
def test_flashmla_mega_takes_int64_ids_and_lens(fake_flashmla, H):
    """The same for the mega kernels: exactly the torch backend's fused contract."""
    g = torch.Generator().manual_seed(200 + H)
    mega, ref = B.get_backend("flashmla_mega"), B.get_backend("torch")
    c = make_decode(5, H, 528, 288, "rand", "cpu", seed=H)
    cs = make_cos_sin_cache(16, device="cpu")
    pos = torch.tensor([1, 15, 7, 0, 3])
    args = (c.q, pos, cs, c.swa_cache, _wild_ids(c.swa_indices, 6 * PAGE, g),
            _wild_lens(c.swa_lens), c.extra_cache, _wild_ids(c.extra_indices, 5 * PAGE, g),
            _wild_lens(c.extra_lens))
    d1, s1, l1 = mega.sparse_mla_decode_fused(*args, attn_sink=c.sink)
    d2, s2, l2 = ref.sparse_mla_decode_fused(*args, attn_sink=c.sink)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)
    assert max_abs_err(l1, l2) == 0
    q, kv, idx, lens, sink = make_prefill(5, H, 20, 10, "rand", "cpu", seed=H)
    args = (q, pos, cs, kv, _wild_ids(idx.clamp(min=-1, max=19), 20, g), _wild_lens(lens))
    d1, s1, _ = mega.sparse_mla_prefill_fused(*args, attn_sink=sink)
    d2, s2, _ = ref.sparse_mla_prefill_fused(*args, attn_sink=sink)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_flashmla_mega_positions_outside_the_table(fake_flashmla, dtype):
    """A position outside the table (negative, ``max_pos``, int64 past int32 that would wrap
    to a row) is not rotated on the mega backend either (the stand-in asserts every row it is
    handed lies in the table), bit-equal to the torch backend."""
    mega, ref = B.get_backend("flashmla_mega"), B.get_backend("torch")
    c = make_decode(5, 64, 528, 288, "rand", "cpu", seed=3)
    cs = make_cos_sin_cache(16, device="cpu")
    pos = torch.tensor([-1, 16, 3, 2 ** 32 + 5 if dtype == torch.int64 else 2 ** 31 - 1, 15],
                       dtype=dtype)
    d1, s1, l1 = mega.sparse_mla_decode_fused(c.q, pos, cs, *c.args()[1:], attn_sink=c.sink)
    d2, s2, l2 = ref.sparse_mla_decode_fused(c.q, pos, cs, *c.args()[1:], attn_sink=c.sink)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)
    q, kv, idx, lens, sink = make_prefill(5, 64, 20, 10, "rand", "cpu", seed=4)
    d1, s1, _ = mega.sparse_mla_prefill_fused(q, pos, cs, kv, idx, lens, attn_sink=sink)
    d2, s2, _ = ref.sparse_mla_prefill_fused(q, pos, cs, kv, idx, lens, attn_sink=sink)
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8)) and torch.equal(s1, s2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("H", [3, 8, 12])
def test_prefill_shared_window_hint_conformance(name, H, device):
    """``sparse_mla_prefill_shared_window`` (the layer's call on its workspace, with the window
    hint from ``combine_topk_swa_indices``) gives ``sparse_mla_prefill``'s result on every
    backend: the triton one takes the shared-window kernel up to 8 heads, the others ignore
    the hint."""
    from dsv41_triton.ops.indices import combine_topk_swa_indices

    backend = _probe_or_skip(name, Problem("prefill", H, torch.device(device)))
    g = torch.Generator().manual_seed(H)
    qlens, seq = [5, 0, 9], [40, 3, 30]  # an empty request in the middle
    W, r, topk = 6, 2, 7
    N = max(s // r for s in seq)
    M = N + max(seq)
    qsl = torch.tensor([0] + qlens, device=device).cumsum(0).to(torch.int32)
    T = sum(qlens) + 1  # one token past the last request
    tk = torch.randint(-1, N + 2, (T, topk), generator=g, dtype=torch.int32).to(device)
    win = poison_(torch.empty(3, T, dtype=torch.int32, device=device))
    idx, lens = combine_topk_swa_indices(tk, qsl, torch.tensor(seq, device=device), None, W, r,
                                         topk, M, N, window_rows=win)
    kv = torch.randn(3 * M, 512, generator=g).bfloat16().to(device)
    q = torch.randn(T, H, 512, generator=g).bfloat16().to(device)
    sink = torch.randn(H, generator=g).float().to(device)
    out = poison_(torch.empty_like(q))
    o, lse = backend.sparse_mla_prefill_shared_window(q, kv, idx, lens, win, qsl,
                                                      attn_sink=sink, out=out)
    ro, rl = sparse_mla_prefill_ref(q, kv, idx, lens, attn_sink=sink)
    assert o is out
    assert rel_err(o, ro) <= 1e-2 and max_abs_err(lse, rl) <= 1e-3


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("H", [3, 16])
def test_prefill_shared_window_hint_is_checked(name, H):
    """Every backend, for every head count, rejects a malformed hint naming it before any
    work (``out`` keeps its poison), whether or not it uses the hint."""
    backend = B.get_backend(name)
    g = torch.Generator().manual_seed(H)
    T = 4
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    kv = torch.randn(12, 512, generator=g).bfloat16()
    idx = torch.randint(-1, 12, (T, 6), generator=g, dtype=torch.int32)
    lens = torch.full((T,), 6, dtype=torch.int32)
    win = torch.zeros(3, T, dtype=torch.int32)
    qsl = torch.tensor([0, T], dtype=torch.int32)
    out = poison_(torch.empty_like(q))
    before = out.clone()
    bad = [
        (TypeError, "window_rows", win.float(), qsl),
        (TypeError, "window_rows", None, qsl),
        (ValueError, "window_rows", torch.zeros(3, T + 1, dtype=torch.int32), qsl),
        (ValueError, "window_rows", win[:2], qsl),
        (TypeError, "query_start_loc", win, "x"),
        (TypeError, "query_start_loc", win, qsl.float()),
        (ValueError, "query_start_loc", win, qsl[None]),
        (ValueError, "query_start_loc", win, qsl[:0]),
        (ValueError, "query_start_loc", win, qsl.to("meta")),
        (ValueError, "window_rows", win.to("meta"), qsl),
    ]
    for err, arg, w, s in bad:
        with pytest.raises(err, match=f"^{arg}"):
            backend.sparse_mla_prefill_shared_window(q, kv, idx, lens, w, s, out=out)
    assert torch.equal(out.view(torch.int16), before.view(torch.int16))
