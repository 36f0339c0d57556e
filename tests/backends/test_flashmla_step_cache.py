"""The ``flashmla`` backend builds FlashMLA's scheduler metadata once per shape and step and
shares it (and the window index rows) across the step's layers; checked on the CPU against a
stand-in ``flash_mla`` that counts schedules and enforces FlashMLA's reuse rules."""
import pytest
import torch

import sys
from pathlib import Path

from dsv41_triton.attention.ref import sparse_mla_decode_ref, sparse_mla_prefill_ref
from dsv41_triton.backends import Availability, _checks, _flashmla_common
from dsv41_triton.backends.flashmla import FlashMLABackend
from dsv41_triton.ops.index_mask import mask_index_rows
from dsv41_triton.ops.kv_cache_ref import quantize_and_insert_k_cache_ref
from dsv41_triton.ops.records import allocate_k_cache
from dsv41_triton.testing import rel_err


class _Meta:
    """FlashMLA's FlashMLASchedMeta stand-in: the config is fixed by the first call."""

    def __init__(self):
        self.config = None


class CountingFlashMLA:
    def __init__(self):
        self.schedules = 0
        self.calls = 0

    def get_metadata(self, *a, **k):
        self.schedules += 1
        return _Meta(), None

    def with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta,
                     num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                     indices=None, attn_sink=None, extra_k_cache=None,
                     extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):
        self.calls += 1
        assert isinstance(meta, _Meta) and num_splits is None
        # reusing a schedule is valid only for one shape and fixed topk lengths: we pass none
        assert topk_length is None and extra_topk_length is None
        cfg = (q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], indices.shape[-1],
               None if extra_k_cache is None else extra_k_cache.shape[1],
               None if extra_indices_in_kvcache is None else extra_indices_in_kvcache.shape[-1])
        if meta.config is None:
            meta.config = cfg
        assert meta.config == cfg, (meta.config, cfg)
        assert indices.shape[-1] % 64 == 0 and bool((indices >= -1).all())
        o, l = sparse_mla_decode_ref(
            q[:, 0], k_cache[:, :, 0], indices[:, 0], None,
            None if extra_k_cache is None else extra_k_cache[:, :, 0],
            None if extra_k_cache is None else extra_indices_in_kvcache[:, 0], None,
            attn_sink=attn_sink, softmax_scale=softmax_scale)
        return o.bfloat16().unsqueeze(1), l.float().unsqueeze(-1)


    def sparse_fwd(self, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        o, l = sparse_mla_prefill_ref(q, kv, indices, topk_length, attn_sink=attn_sink,
                                      softmax_scale=sm_scale)
        return o.bfloat16(), torch.zeros_like(l).float(), l.float()


@pytest.fixture
def fake(monkeypatch):
    f = CountingFlashMLA()
    ops = _flashmla_common.FlashMLAOps("fake", with_kvcache=f.with_kvcache,
                                       sparse_fwd=f.sparse_fwd, get_metadata=f.get_metadata)
    monkeypatch.setattr(_flashmla_common, "_CACHE", {"ops": ops, "why": ""})
    return f


def _filled(blocks, g):
    cache = allocate_k_cache(blocks, 64, 584, "cpu")
    k = (torch.randn(blocks * 64, 512, generator=g) * 2).bfloat16()
    quantize_and_insert_k_cache_ref(k, cache, torch.arange(blocks * 64))
    return cache


def _decode_inputs(T, H, K, extra, g):
    cache = _filled(8, g)
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    lens = torch.randint(1, K + 1, (T,), generator=g).int()
    idx = torch.randint(0, 8 * 64, (T, K), generator=g).int()  # valid slots past lens too
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    out = dict(q=q, swa_cache=cache, swa_indices=idx, swa_lens=lens,
               attn_sink=torch.randn(H, generator=g))
    if extra:
        out.update(extra_cache=_filled(4, g),
                   extra_indices=torch.randint(0, 4 * 64, (T, 70), generator=g).int(),
                   extra_lens=torch.randint(0, 71, (T,), generator=g).int())
    return out


def _ref(a):
    return sparse_mla_decode_ref(a["q"], a["swa_cache"], a["swa_indices"], a["swa_lens"],
                                 a.get("extra_cache"), a.get("extra_indices"),
                                 a.get("extra_lens"), attn_sink=a["attn_sink"])


def test_index_rows_given_to_flashmla():
    idx = torch.tensor([[5, -3, 7, 9], [1, 2, 3, 4]], dtype=torch.int32)
    lens = torch.tensor([3, 1], dtype=torch.int32)
    m = mask_index_rows(idx, lens, 8)
    assert m.dtype == torch.int32 and m.shape == (2, 8)
    assert m.tolist() == [[5, -1, 7, -1, -1, -1, -1, -1], [1] + [-1] * 7]
    p = _flashmla_common.pad_indices(idx.long(), 4)  # the prefill rows: lengths go separately
    assert p.dtype == torch.int32 and p.tolist() == [[5, -1, 7, 9], [1, 2, 3, 4]]
    assert _flashmla_common.pad_indices(idx[:, :3], 4).tolist() == [[5, -1, 7, -1], [1, 2, 3, -1]]


def test_int64_rows_converted_for_flashmla():
    """int64 ids and lens as FlashMLA reads them (int32; ``-1`` the only skipped id): every id
    outside ``[0, rows)`` at 64 bits and every column past the clamped length is ``-1``;
    lengths are clamped to ``[0, width]`` before the cast. The checks take int64."""
    g = torch.Generator().manual_seed(11)
    T, K, rows = 7, 70, 40
    idx = torch.randint(-3, rows + 3, (T, K), generator=g, dtype=torch.int64)
    idx[:, 0] = 2 ** 32 + 5  # slot 5 when cut to 32 bits
    idx[:, 1] = -7
    idx[:, 2] = 2 ** 31  # past int32
    idx[:, 3] = 5
    lens = torch.randint(-2, K + 3, (T,), generator=g, dtype=torch.int64)
    lens[0], lens[1], lens[2] = 2 ** 32 + 1, 2 - 2 ** 32, 4
    rows_i32 = _flashmla_common.index_rows_i32(idx, lens, rows, 64)
    src = torch.nn.functional.pad(idx, (0, 128 - K), value=-1)
    cols = torch.arange(128)
    keep = (src >= 0) & (src < rows) & (cols[None, :] < lens.clamp(0, K)[:, None])
    assert rows_i32.dtype == torch.int32
    assert torch.equal(rows_i32, torch.where(keep, src, -1).to(torch.int32))
    assert rows_i32[2, :4].tolist() == [-1, -1, -1, 5]
    lens_i32 = _flashmla_common.lens_i32(lens, K)
    assert lens_i32.dtype == torch.int32 and torch.equal(lens_i32, lens.clamp(0, K).int())
    assert lens_i32[:2].tolist() == [K, 0]

    q = torch.randn(T, 3, 512, generator=g).bfloat16()
    cache = allocate_k_cache(2, 64, 584, "cpu")
    _checks.check_decode(q, cache, idx, lens, cache, idx, lens, None, None)
    _checks.check_prefill(q, torch.randn(rows, 512).bfloat16(), idx, lens, None, None)
    with pytest.raises(TypeError, match="swa_indices"):
        _checks.check_decode(q, cache, idx.float(), lens, None, None, None, None, None)


@pytest.mark.parametrize("H", [3, 64])
def test_prefill_on_the_stand_in(fake, H):
    g = torch.Generator().manual_seed(2)
    T, N, K = 6, 300, 150
    q = torch.randn(T, H, 512, generator=g).bfloat16()
    kv = torch.randn(N, 512, generator=g).bfloat16()
    idx = torch.randint(0, N, (T, K), generator=g).int()
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    lens = torch.randint(0, K + 1, (T,), generator=g).int()
    sink = torch.randn(H, generator=g)
    out = torch.full((T, H, 512), float("nan")).bfloat16()
    o, l = FlashMLABackend().sparse_mla_prefill(q, kv, idx, lens, attn_sink=sink, out=out)
    ro, rl = sparse_mla_prefill_ref(q, kv, idx, lens, attn_sink=sink)
    assert o is out and rel_err(o, ro) <= 1e-2
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(l)) and (l[fin] - rl[fin]).abs().max() <= 1e-3


@pytest.mark.parametrize("H", [3, 64])
def test_one_schedule_per_shape_and_step(fake, H):
    be = FlashMLABackend()
    g = torch.Generator().manual_seed(0)
    step = {}
    window = _decode_inputs(5, H, 20, False, g)
    compressed = dict(_decode_inputs(5, H, 20, True, g), swa_indices=window["swa_indices"],
                      swa_lens=window["swa_lens"])
    for layer in range(6):  # alternating window-only / compressed layers of one step
        a = window if layer % 2 == 0 else compressed
        o, l = be.sparse_mla_decode(**a, step_cache=step)
        ro, rl = _ref(a)
        assert rel_err(o, ro) <= 1e-2 and (l - rl).abs().max() <= 1e-3
        assert o.shape == (5, H, 512) and l.shape == (5, H)
    assert fake.calls == 6 and fake.schedules == 2  # one per shape
    assert sum(1 for k in step if k[0] == "swa_idx") == 1  # window rows masked once
    window["swa_lens"].clamp_(max=3)  # refilled in place: the kept rows are not reused
    o, _ = be.sparse_mla_decode(**window, step_cache=step)
    assert rel_err(o, _ref(window)[0]) <= 1e-2
    assert sum(1 for k in step if k[0] == "swa_idx") == 2
    # a new step gets new schedules; eager calls without a step cache share one per shape
    be.sparse_mla_decode(**window, step_cache={})
    assert fake.schedules == 3
    for _ in range(3):
        be.sparse_mla_decode(**window)
    assert fake.schedules == 4
    be.sparse_mla_decode(**compressed)
    be.sparse_mla_decode(**compressed)
    assert fake.schedules == 5
    assert FlashMLABackend().sparse_mla_decode(**window) and fake.schedules == 6  # per backend


def test_out_buffer_and_empty_step(fake):
    be = FlashMLABackend()
    a = _decode_inputs(4, 64, 16, True, torch.Generator().manual_seed(1))
    out = torch.full((4, 64, 512), float("nan")).bfloat16()
    o, _ = be.sparse_mla_decode(**a, out=out, step_cache={})
    assert o is out and torch.isfinite(out.float()).all()
    e = dict(a, q=a["q"][:0], swa_indices=a["swa_indices"][:0], swa_lens=a["swa_lens"][:0],
             extra_indices=a["extra_indices"][:0], extra_lens=a["extra_lens"][:0])
    o, l = be.sparse_mla_decode(**e, step_cache={})
    assert o.shape == (0, 64, 512) and l.shape == (0, 64) and fake.calls == 1


class _CpuFlashMLA(FlashMLABackend):
    """The backend with its GPU probe waived, to run a layer on the CPU stand-in."""

    def probe(self, problem):
        return Availability(True, "stand-in")


def test_layers_of_a_step_share_one_schedule(fake):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "layers"))
    from test_layer import CFG, Scenario, make_layer
    from dsv41_triton.layers.weights import random_attention_state_dict

    sd = random_attention_state_dict(CFG, seed=3)
    be = _CpuFlashMLA()
    layers = {i: make_layer(CFG, i, be, sd) for i in (0, 1, 2)}
    refs = {i: make_layer(CFG, i, "torch", sd) for i in (0, 1, 2)}
    assert all(layer._step_cache_ok for layer in layers.values())
    scen = {i: Scenario(CFG, i, seed=i) for i in (0, 1, 2)}
    plans = [[("A", 5), ("B", 3)], [("A", 1), ("B", 1)], [("A", 1), ("B", 1)]]
    for step, plan in enumerate(plans):
        before = fake.schedules
        shared = None
        for i in (0, 1, 2):
            md, hid, ckv, tk, owners = scen[i].step(plan)
            if shared is None:
                shared = md.backend_cache
            else:  # the step's layers share one cache (one StepMetadata per step in serving)
                md.backend_cache = shared
            kw = dict(compressed_kv=ckv, topk_indices=tk) if i else {}
            y = layers[i](None, hid, md, **kw)
            y_ref = refs[i](None, hid, md, **kw)
            assert rel_err(y, y_ref) <= 1e-2, (step, i)
        if step > 0:  # decode steps: window-only and compressed shapes, once each
            assert fake.schedules - before == 2, fake.schedules - before


def _real_flashmla_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _flashmla_common._CACHE.clear()
    ops, why = _flashmla_common.load_flashmla()
    if ops is None or ops.source != "flash_mla":
        pytest.skip(f"FlashMLA not available: {why}")
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("FlashMLA's sparse kernels: SM90/SM100")
    return ops


@pytest.mark.gpu
def test_real_flashmla_shared_schedule_eager_graph_and_no_sync():
    """On the GPU with FlashMLA: the shared schedule gives the reference's values eagerly and
    when first filled inside a CUDA graph capture (three 'layers' sharing one step cache), and
    the backend's decode does not synchronize with the host."""
    _real_flashmla_or_skip()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    from bench_flashmla_backend import build_case

    be = FlashMLABackend()
    for H in (8, 64):
        case = build_case(16, H, seed=H)
        ro, rl = sparse_mla_decode_ref(**case)
        step: dict = {}
        o, l = be.sparse_mla_decode(**case, step_cache=step)
        o2, _ = be.sparse_mla_decode(**case, step_cache=step)  # reused schedule
        assert rel_err(o, ro) <= 1e-2 and rel_err(o2, ro) <= 1e-2
        assert float((l.double() - rl.double()).abs().max()) <= 1e-3
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            be.sparse_mla_decode(**case, step_cache={})
        finally:
            torch.cuda.set_sync_debug_mode(prev)
        outs = [torch.full_like(case["q"], float("nan")) for _ in range(3)]
        graph_step: dict = {}
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g):
            for out in outs:
                be.sparse_mla_decode(**case, step_cache=graph_step, out=out)
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        for out in outs:
            assert rel_err(out, ro) <= 1e-2
        # no step cache: the eagerly kept schedule inside a capture, a fresh one for a new shape
        be.sparse_mla_decode(**case)
        small = dict(case, q=case["q"][:4], swa_indices=case["swa_indices"][:4],
                     swa_lens=case["swa_lens"][:4], extra_indices=case["extra_indices"][:4],
                     extra_lens=case["extra_lens"][:4])
        o_small = torch.full_like(small["q"], float("nan"))
        g2 = torch.cuda.CUDAGraph()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g2):
            be.sparse_mla_decode(**case, out=outs[0])
            be.sparse_mla_decode(**small, out=o_small)
        torch.cuda.current_stream().wait_stream(s)
        for out in outs:
            out.fill_(float("nan"))
        g2.replay()
        torch.cuda.synchronize()
        assert rel_err(outs[0], ro) <= 1e-2 and rel_err(o_small, ro[:4]) <= 1e-2
        del g, g2
