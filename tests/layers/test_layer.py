"""The drop-in attention layer: multi-step runs against a single-shot float64 recomputation.

A scenario runs several steps through one layer (prefills of several requests, a 1-token
prompt, decode steps, an idle request, CUDA-graph padding, then a mixed step with a second
prefill chunk of a request with a prefix and a new request) and compares every real token's
attention output and layer output with an oracle that recomputes each request from scratch:
projections over the whole sequence at once, the window and the selected compressed keys taken
from the (record-quantized) keys of the request's own tokens, softmax with the sink in float64,
inverse RoPE and the grouped output projection in float64. TP=2/4 shards must reproduce TP=1.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from dsv41_triton.layers.config import DeepseekV41AttentionConfig, build_cos_sin_cache
from dsv41_triton.layers.layer import (
    DeepseekV41Attention,
    MXFP8Activation,
    canonicalize_attention_state_dict,
    random_attention_state_dict,
    shard_attention_state_dict,
)
from dsv41_triton.layers.scenario import Scenario as BaseScenario
from dsv41_triton.backends import available_backends, Problem
from dsv41_triton.ops.records import quantize_dequantize_ref
from dsv41_triton.ops.rope_ref import apply_rope_ref
from dsv41_triton.testing import poison_, rel_err

CFG = DeepseekV41AttentionConfig(
    name="tiny", hidden_size=64, num_attention_heads=8, q_lora_rank=32, o_lora_rank=16,
    o_groups=4, sliding_window=8, index_topk=4, compress_ratios=(0, 1, 2),
)
PAGE, CPAGE, MAX_LEN = 4, 4, 64


# --------------------------------------------------------------------------------------------
# the oracle
# --------------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float() if w is not None else y).to(x.dtype)


def oracle_request(sd, cfg, layer_id, hidden, ckv, topk, swa_record=584, c_record=584,
                   max_len=MAX_LEN):
    """From-scratch float64 attention + projection of one request's whole sequence.

    hidden [L, hidden], ckv [L, 512] (compressor output per token), topk [L, K] local entries.
    Returns (o [L, H, 512] float64 attention output before the inverse RoPE, y [L, hidden]).
    """
    L = hidden.shape[0]
    H, D, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
    r, W = cfg.compress_ratio(layer_id), cfg.sliding_window
    cs = build_cos_sin_cache(cfg, r, max_len)
    pos = torch.arange(L)
    sd = {k: v.cpu() for k, v in sd.items()}
    qr_kv = F.linear(hidden, sd["fused_wqa_wkv.weight"])
    qr, kv = qr_kv.split([cfg.q_lora_rank, D], -1)
    qr = _rms(qr, sd["q_norm.weight"], cfg.rms_norm_eps)
    kv = _rms(kv, sd["kv_norm.weight"], cfg.rms_norm_eps)
    q = F.linear(qr, sd["wq_b.weight"]).view(L, H, D)
    if cfg.q_head_norm:
        q = _rms(q, None, cfg.rms_norm_eps)
    q = apply_rope_ref(q, pos, cs).double()
    kvq = quantize_dequantize_ref(apply_rope_ref(kv[:, None], pos, cs)[:, 0], swa_record).double()
    ckq = None
    if r > 0:
        ck = apply_rope_ref(ckv[:, None], (pos // r) * r, cs)[:, 0]
        ckq = quantize_dequantize_ref(ck, c_record).double()
    # key table: the window keys (rows 0..L-1), then the compressed entries (row L + e)
    table = kvq if ckq is None else torch.cat([kvq, ckq[r - 1::r]])
    K = cfg.index_topk if r > 0 else 0
    rows = torch.full((L, W + K), -1, dtype=torch.long)
    for p in range(L):
        win = torch.arange(max(p - W + 1, 0), p + 1)
        rows[p, : win.numel()] = win
        if r > 0:
            n = min((p + 1) // r, K)
            sel = topk[p, :n].long()
            sel = sel[sel >= 0]  # entry e is completed by token e*r + r - 1
            rows[p, W: W + sel.numel()] = L + sel
    valid = rows >= 0
    sink = sd["attn_sink"].double()
    o = torch.zeros(L, H, D, dtype=torch.float64)
    for a in range(0, L, 64):
        b = min(L, a + 64)
        keys = table[rows[a:b].clamp_min(0)]  # [t, W+K, D]
        z = torch.einsum("thd,tkd->thk", q[a:b], keys) * D ** -0.5
        z = z.masked_fill(~valid[a:b, None, :], float("-inf"))
        m = z.amax(-1, keepdim=True)
        e_ = torch.exp(z - m)
        den = e_.sum(-1, keepdim=True) + torch.exp(sink[None, :, None] - m)
        o[a:b] = torch.einsum("thk,tkd->thd", e_, keys) / den
    # inverse RoPE (float64), grouped wo_a, wo_b
    csd = cs.double()[:L]
    cos, sin = csd[:, None, :32], csd[:, None, 32:]
    a, b = o[..., 448::2], o[..., 449::2]
    oi = o.clone()
    oi[..., 448::2] = a * cos + b * sin
    oi[..., 449::2] = b * cos - a * sin
    hpg = H // G
    wo_a = sd["wo_a.weight"].double().view(G, cfg.o_lora_rank, hpg * D)
    z = torch.einsum("lgk,gok->lgo", oi.view(L, G, hpg * D), wo_a).reshape(L, -1)
    y = z @ sd["wo_b.weight"].double().T
    return o, y


# --------------------------------------------------------------------------------------------
# the scenario
# --------------------------------------------------------------------------------------------
class Scenario(BaseScenario):
    """The shared scenario (``dsv41_triton.layers.scenario``) with this file's defaults and
    the float64 oracle of its requests."""

    def __init__(self, cfg, layer_id, seed=0, num_blocks=64, page=PAGE, cpage=CPAGE,
                 blocks_per_req=6, device="cpu", max_len=MAX_LEN):
        super().__init__(cfg, layer_id, seed=seed, num_blocks=num_blocks, page=page, cpage=cpage,
                         blocks_per_req=blocks_per_req, device=device, max_len=max_len)

    def oracle(self, sd, swa_record=584, c_record=584):
        out = {}
        for name, st in self.req.items():
            o, y = oracle_request(sd, self.cfg, self.layer_id, torch.cat(st["hidden"]),
                                  torch.cat(st["ckv"]), torch.cat(st["topk"]), swa_record, c_record,
                                  self.max_len)
            out[name] = (o, y)
        return out


STEPS = [
    # (plan, padding): decodes (query_len <= 1) first, then prefills
    ([("C", 1), ("A", 11), ("B", 6), ("D", 7)], 0),  # a 1-token prompt + three prefills
    ([("A", 1), ("B", 1), ("C", 1), ("D", 0)], 0),  # decode + an idle request
    ([("A", 1), ("B", 1), ("C", 1)], 2),  # decode with CUDA-graph padding
    ([("A", 1), ("C", 1), ("D", 6), ("E", 5)], 0),  # mixed: 2nd chunk of D (prefix 7) + new E
]


def make_layer(cfg, layer_id, backend, sd, tp_rank=0, tp_size=1, device="cpu", page=PAGE,
               cpage=CPAGE, num_blocks=64, max_len=MAX_LEN, **kw):
    layer = DeepseekV41Attention(cfg, layer_id, tp_rank=tp_rank, tp_size=tp_size, backend=backend,
                                 device=device, max_model_len=max_len, **kw)
    layer.load_weights(sd)
    layer.allocate_kv_caches(num_blocks, page, num_blocks, cpage)

    orig = layer._alloc_attn_out

    def poisoned(T, hs):  # every element of the attention output must be written
        out = orig(T, hs)
        if isinstance(out, MXFP8Activation):
            poison_(out.data)
            out.scale.fill_(-1)
        else:
            poison_(out)
        return out

    layer._alloc_attn_out = poisoned
    return layer


def run_scenario(layers, cfg, layer_id, steps=STEPS, chunk_size=4, seed=0, **scenario_kw):
    """Run the steps through every layer (same inputs; the layers may be TP shards). Returns
    the scenario and per step [(md, owners, [(attn_out, y) per layer])] (outputs on the CPU)."""
    sc = Scenario(cfg, layer_id, seed=seed, **scenario_kw)
    results = []
    for plan, padding in steps:
        md, hid, ckv, tk, owners = sc.step(plan, padding, chunk_size)
        r = cfg.compress_ratio(layer_id)
        outs = []
        for layer in layers:
            a = layer.compute_attention(None, hid, md, compressed_kv=ckv if r else None,
                                        topk_indices=tk if r else None)
            y = layer._o_proj(a, md.positions)
            if isinstance(a, MXFP8Activation):
                a = MXFP8Activation(a.data.cpu(), a.scale.cpu(), a.layout)
            else:
                a = a.cpu()
            outs.append((a, y.cpu()))
        results.append((md, owners, outs))
    return sc, results


def _gather_oracle(orc, owners):
    o = torch.stack([orc[n][0][p] for n, p in owners])
    y = torch.stack([orc[n][1][p] for n, p in owners])
    return o, y


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer_id", [0, 1, 2], ids=["ratio0", "ratio1", "ratio2"])
@pytest.mark.parametrize("chunk_size", [4, 1])
@pytest.mark.parametrize("prefill_path", ["paged", "paged-window", "workspace"])
def test_multistep_torch_backend_equals_oracle(layer_id, chunk_size, prefill_path):
    """``paged``: window and top-k as slot ids; ``paged-window``: window rows from a small
    workspace, top-k as slot ids (``paged_window_rows``)."""
    sd = random_attention_state_dict(CFG, seed=layer_id)
    layer = make_layer(CFG, layer_id, "torch", sd, prefill_path=prefill_path.split("-")[0])
    layer.paged_window_rows = prefill_path == "paged-window"
    sc, results = run_scenario([layer], CFG, layer_id, chunk_size=chunk_size)
    orc = sc.oracle(sd)
    for md, owners, [(a, y)] in results:
        n = len(owners)
        o_ref, y_ref = _gather_oracle(orc, owners)
        assert torch.isfinite(a).all()
        assert rel_err(a[:n], o_ref) <= 1e-2, rel_err(a[:n], o_ref)
        assert rel_err(y[:n], y_ref) <= 1e-2, rel_err(y[:n], y_ref)
        if md.num_tokens > n:  # padding tokens: no keys -> exactly zero
            assert (a[n:] == 0).all() and (y[n:] == 0).all()


def test_oracle_detects_a_wrong_window():
    """The comparison can fail: a layer whose window is one token shorter is caught."""
    sd = random_attention_state_dict(CFG, seed=5)
    layer = make_layer(CFG, 0, "torch", sd)
    sc, results = run_scenario([layer], CFG, 0, steps=STEPS[:1])
    cfg_short = CFG.replace(sliding_window=CFG.sliding_window - 1)
    bad = {n: oracle_request(sd, cfg_short, 0, torch.cat(st["hidden"]), None, None)
           for n, st in sc.req.items()}
    md, owners, [(a, y)] = results[0]
    o_bad, _ = _gather_oracle(bad, owners)
    assert rel_err(a[: len(owners)], o_bad) > 1e-2


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("layer_id", [0, 2], ids=["ratio0", "ratio2"])
def test_tensor_parallel_shards_equal_tp1(tp_size, layer_id):
    sd = random_attention_state_dict(CFG, seed=11)
    full = make_layer(CFG, layer_id, "torch", sd)
    shards = [make_layer(CFG, layer_id, "torch", sd, tp_rank=k, tp_size=tp_size)
              for k in range(tp_size)]
    assert shards[0].n_local_heads == CFG.num_attention_heads // tp_size
    _, results = run_scenario([full] + shards, CFG, layer_id, steps=STEPS[:2] + STEPS[3:])
    for md, owners, outs in results:
        (a1, y1), rest = outs[0], outs[1:]
        a_cat = torch.cat([a for a, _ in rest], 1)
        assert torch.equal(a_cat, a1) or rel_err(a_cat, a1) < 1e-3
        y_sum = sum(y.float() for _, y in rest)
        assert rel_err(y_sum, y1) <= 1e-2


@pytest.mark.parametrize("layer_id", [0, 2])
def test_empty_and_idle_steps(layer_id):
    sd = random_attention_state_dict(CFG, seed=0)
    layer = make_layer(CFG, layer_id, "torch", sd)
    sc = Scenario(CFG, layer_id)
    md, hid, ckv, tk, _ = sc.step([("A", 0), ("B", 0)])
    y = layer(None, hid, md, compressed_kv=ckv if layer_id else None,
              topk_indices=tk if layer_id else None)
    assert y.shape == (0, CFG.hidden_size)


def test_forward_context_style_call():
    """vLLM's call shape: layer(positions, hidden_states) with the step bound by set_step."""
    sd = random_attention_state_dict(CFG, seed=8)
    layer = make_layer(CFG, 1, "torch", sd)
    other = make_layer(CFG, 1, "torch", sd)
    sc = Scenario(CFG, 1)
    md, hid, ckv, tk, _ = sc.step([("A", 5)])
    layer.set_step(md, topk_indices=tk, compressed_kv=ckv)
    y = layer(md.positions, hid)
    assert torch.equal(y, other(None, hid, md, compressed_kv=ckv, topk_indices=tk))


def test_tp_reduce_hook_sums_partials():
    sd = random_attention_state_dict(CFG, seed=3)
    partials = []
    shards = [make_layer(CFG, 0, "torch", sd, tp_rank=k, tp_size=2,
                         output_reduce=lambda y: (partials.append(y), y)[1]) for k in range(2)]
    _, results = run_scenario(shards, CFG, 0, steps=STEPS[:1])
    assert len(partials) == 2 and partials[0].shape == partials[1].shape


def test_shard_state_dict_slices():
    sd = random_attention_state_dict(CFG, seed=1)
    s1 = shard_attention_state_dict(sd, CFG, 1, 2)
    D, R = 512, CFG.o_lora_rank
    assert torch.equal(s1["wq_b.weight"], sd["wq_b.weight"][4 * D:8 * D])
    assert torch.equal(s1["attn_sink"], sd["attn_sink"][4:])
    assert torch.equal(s1["wo_a.weight"], sd["wo_a.weight"][2 * R:4 * R])
    assert torch.equal(s1["wo_b.weight"], sd["wo_b.weight"][:, 2 * R:4 * R])
    assert torch.equal(s1["fused_wqa_wkv.weight"], sd["fused_wqa_wkv.weight"])


def test_checkpoint_names_and_fp8_weights():
    """DeepSeek's names (wq_a + wkv, .scale block multipliers on fp8 weights) load like the
    canonical ones."""
    sd = random_attention_state_dict(CFG, seed=2)
    qa, wkv = sd["fused_wqa_wkv.weight"].split([CFG.q_lora_rank, 512], 0)
    pre = "layers.1.attn."
    ck = {pre + "wq_a.weight": qa, pre + "wkv.weight": wkv, pre + "attn_sink": sd["attn_sink"],
          pre + "q_norm.weight": sd["q_norm.weight"], pre + "kv_norm.weight": sd["kv_norm.weight"],
          pre + "wo_a.weight": sd["wo_a.weight"], pre + "wo_b.weight": sd["wo_b.weight"],
          pre + "compressor.wkv.weight": torch.randn(512, CFG.hidden_size).bfloat16()}
    # wq_b as block-fp8 (128x128 blocks) with power-of-two multipliers
    w = sd["wq_b.weight"].float()
    s = torch.full((w.shape[0] // 128, 1), 2.0 ** -4)
    ck[pre + "wq_b.weight"] = (w / 2.0 ** -4).to(torch.float8_e4m3fn)
    ck[pre + "wq_b.scale"] = s
    can = canonicalize_attention_state_dict(ck, pre)
    assert torch.equal(can["fused_wqa_wkv.weight"], sd["fused_wqa_wkv.weight"])
    assert rel_err(can["wq_b.weight"], sd["wq_b.weight"]) < 0.05
    layer = DeepseekV41Attention(CFG, 1, backend="torch", device="cpu", max_model_len=MAX_LEN)
    layer.load_weights(ck, prefix=pre)
    assert torch.equal(layer.attn_sink, sd["attn_sink"])
    assert torch.equal(layer.extra_weights["compressor.wkv.weight"], ck[pre + "compressor.wkv.weight"])
    with pytest.raises(ValueError, match="missing"):
        layer.load_weights({pre + "wq_a.weight": qa}, prefix=pre)


def test_bad_topologies_and_inputs_raise():
    with pytest.raises(ValueError, match="prefill_path"):
        DeepseekV41Attention(CFG, 0, backend="torch", device="cpu", prefill_path="gather")
    with pytest.raises(ValueError, match="does not divide o_groups"):
        DeepseekV41Attention(CFG, 0, tp_rank=0, tp_size=8, backend="torch", device="cpu")
    with pytest.raises(ValueError, match="tp_rank"):
        DeepseekV41Attention(CFG, 0, tp_rank=2, tp_size=2, backend="torch", device="cpu")
    # the fused contract needs 8 heads per wo_a group (this config has 2)
    with pytest.raises(ValueError, match="8 heads per wo_a group"):
        DeepseekV41Attention(CFG, 0, backend="torch", fused=True, device="cpu")
    with pytest.raises(ValueError, match="not available"):
        DeepseekV41Attention(CFG, 0, backend="flashmla", device="cpu")
    sd = random_attention_state_dict(CFG, seed=0)
    layer = make_layer(CFG, 1, "torch", sd)
    sc = Scenario(CFG, 1)
    md, hid, ckv, tk, _ = sc.step([("A", 3)])
    with pytest.raises(ValueError, match="topk_indices"):
        layer(None, hid, md, compressed_kv=ckv)
    with pytest.raises(ValueError, match="tokens"):
        layer(None, hid[:2], md, compressed_kv=ckv[:2], topk_indices=tk[:2])
    with pytest.raises(ValueError, match="max_model_len"):
        sc2 = Scenario(CFG, 1)
        sc2.req["A"] = dict(blocks=list(range(20)), cblocks=list(range(20)), hidden=[
            torch.zeros(MAX_LEN, 64).bfloat16()], ckv=[], topk=[])
        md2, h2, c2, t2, _ = sc2.step([("A", 2)])
        layer(None, h2, md2, compressed_kv=c2, topk_indices=t2)


# --------------------------------------------------------------------------------------------
# fused contract (8 heads per group) and the Triton backend
# --------------------------------------------------------------------------------------------
CFG8 = CFG.replace(name="tiny8", o_groups=1)  # 8 heads, one wo_a group of 8


@pytest.mark.parametrize("layout", ["standard", "interleaved"])
@pytest.mark.parametrize("prefill_path", ["paged", "workspace"])
def test_fused_contract_torch_backend(layout, prefill_path):
    """fused=True: the backend RoPEs Q, the MXFP8 pair goes into _o_proj; equals the oracle
    within the MXFP8 quantization error of the attention output."""
    sd = random_attention_state_dict(CFG8, seed=7)
    layer = make_layer(CFG8, 2, "torch", sd, fused=True, layout=layout,
                       prefill_path=prefill_path)
    assert layer.accepts_unnormed_unroped_query
    sc, results = run_scenario([layer], CFG8, 2, steps=[STEPS[0], STEPS[3]])
    orc = sc.oracle(sd)
    for md, owners, [(a, y)] in results:
        assert isinstance(a, MXFP8Activation)
        o_ref, y_ref = _gather_oracle(orc, owners)
        assert rel_err(y[: len(owners)], y_ref) <= 5e-2  # e4m3 output: ~2^-4 per element


def _triton_ok():
    return "triton" in available_backends([Problem("decode", 8, swa_record=584, extra_record=584),
                                           Problem("prefill", 8)])


@pytest.mark.skipif(not _triton_ok(), reason="the triton backend is not available here")
@pytest.mark.parametrize("prefill_path,share", [("paged", False), ("paged", True),
                                                ("workspace", False), ("workspace", True)])
def test_multistep_triton_backend_equals_oracle(device, prefill_path, share, monkeypatch):
    """One small configuration through the Triton kernels (the interpreter on CPU); both paths
    with and without the window hint (which must reach the shared-window kernel: on the paged
    path with the top-k records as ``topk_cache``)."""
    if device != "cpu":
        pytest.skip("covered by the GPU variant")
    import dsv41_triton.attention.prefill_shared as shared

    calls = []
    real = shared.sparse_mla_prefill_shared_window

    def spy(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(shared, "sparse_mla_prefill_shared_window", spy)
    sd = random_attention_state_dict(CFG, seed=21)
    layer = make_layer(CFG, 2, "triton", sd, prefill_path=prefill_path)
    layer.share_window_keys = share
    layer.paged_window_rows = share
    steps = [([("C", 1), ("A", 6), ("B", 3)], 0), ([("A", 1), ("C", 1), ("B", 4)], 0)]
    sc, results = run_scenario([layer], CFG, 2, steps=steps)
    orc = sc.oracle(sd)
    for md, owners, [(a, y)] in results:
        o_ref, y_ref = _gather_oracle(orc, owners)
        assert rel_err(a[: len(owners)], o_ref) <= 1e-2
        assert rel_err(y[: len(owners)], y_ref) <= 1e-2
    assert bool(calls) == share, calls


@pytest.mark.skipif(not _triton_ok(), reason="the triton backend is not available here")
@pytest.mark.parametrize("window_rows", [False, True])
def test_auto_prefill_path_picks_per_chunk(device, window_rows, monkeypatch):
    """``prefill_path="auto"``: chunks whose workspace is large for their tokens go paged, the
    others through the workspace, in one step; the outputs match the oracle either way (the
    paged chunks with and without ``paged_window_rows``)."""
    sd = random_attention_state_dict(CFG, seed=22)
    layer = make_layer(CFG, 1, "triton", sd)  # ratio 1: a prefix of 30 is 30 workspace rows
    layer.paged_window_rows = window_rows
    assert layer.prefill_path == "auto"
    picks = []
    real = layer.prefers_paged

    def spy(rows, tokens):
        picks.append(real(rows, tokens))
        return picks[-1]

    monkeypatch.setattr(layer, "prefers_paged", spy)
    import dsv41_triton.layers.layer as layer_mod

    H = layer.n_local_heads
    assert layer._paged_window() == window_rows
    k = (layer_mod.AUTO_PAGED_ROWS_PER_TOKEN_HEAD if window_rows
         else layer_mod.AUTO_PAGED_SLOT_ROWS_PER_TOKEN_HEAD)
    assert not real(k * H * 5, 5) and real(k * H * 5 + 1, 5)
    # the paged path with window rows gathered wins from fewer rows than with every key a slot id
    assert real(3.5 * H * 5, 5) == window_rows
    monkeypatch.setattr(layer_mod, "AUTO_PAGED_ROWS_PER_TOKEN_HEAD", 1)
    monkeypatch.setattr(layer_mod, "AUTO_PAGED_SLOT_ROWS_PER_TOKEN_HEAD", 1)
    # request A: 2 new tokens after a prefix of 20 (31 workspace rows > 1 * 8 * 2: paged);
    # B: 12 new tokens of a 14-token sequence (28 rows: workspace)
    steps = [([("A", 20), ("B", 2)], 0), ([("A", 2), ("B", 12)], 0)]
    sc, results = run_scenario([layer], CFG, 1, steps=steps, chunk_size=1)
    orc = sc.oracle(sd)
    for md, owners, [(a, y)] in results:
        o_ref, y_ref = _gather_oracle(orc, owners)
        assert rel_err(a[: len(owners)], o_ref) <= 1e-2
        assert rel_err(y[: len(owners)], y_ref) <= 1e-2
    assert True in picks and False in picks, picks


# --------------------------------------------------------------------------------------------
# GPU: the same scenario at larger shapes through the GPU backends
# --------------------------------------------------------------------------------------------
GPU_CFG = DeepseekV41AttentionConfig(
    name="gpu-small", hidden_size=512, num_attention_heads=16, q_lora_rank=128, o_lora_rank=64,
    o_groups=2, sliding_window=128, index_topk=64, compress_ratios=(0, 1, 2),
)
GPU_STEPS = [
    ([("C", 1), ("A", 300), ("B", 150), ("D", 90)], 0),
    ([("A", 1), ("B", 1), ("C", 1), ("D", 0)], 0),
    ([("A", 1), ("B", 1), ("C", 1)], 5),
    ([("A", 1), ("C", 1), ("D", 70), ("E", 129), ("F", 3), ("G", 2), ("H", 40)], 0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashmla", "auto"])
@pytest.mark.parametrize("layer_id", [0, 1, 2], ids=["ratio0", "ratio1", "ratio2"])
@pytest.mark.parametrize("prefill_path", ["paged", "workspace"])
def test_gpu_multistep_equals_oracle(backend, layer_id, prefill_path):
    sd = random_attention_state_dict(GPU_CFG, seed=layer_id, device="cuda")
    try:
        layer = make_layer(GPU_CFG, layer_id, backend, sd, device="cuda", page=64, cpage=64,
                           num_blocks=128, max_len=1024, prefill_path=prefill_path)
    except ValueError as e:  # e.g. FlashMLA not installed: skip with the probe's reason
        pytest.skip(str(e))
    sc, results = run_scenario([layer], GPU_CFG, layer_id, steps=GPU_STEPS, device="cuda",
                               page=64, cpage=64, blocks_per_req=8, num_blocks=128, max_len=1024)
    orc = {n: oracle_request(sd, GPU_CFG, layer_id, torch.cat(st["hidden"]), torch.cat(st["ckv"]),
                             torch.cat(st["topk"]), max_len=1024) for n, st in sc.req.items()}
    for md, owners, [(a, y)] in results:
        n = len(owners)
        o_ref, y_ref = _gather_oracle(orc, owners)
        assert rel_err(a[:n], o_ref) <= 1e-2, (layer.selection.name, rel_err(a[:n], o_ref))
        assert rel_err(y[:n], y_ref) <= 1e-2
        assert (a[n:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("records", [(584, 584), (528, 288)], ids=["584", "528-288"])
@pytest.mark.parametrize("layer_id", [0, 1, 2], ids=["ratio0", "ratio1", "ratio2"])
@pytest.mark.parametrize("share", [True, False])
def test_gpu_paged_prefill_window_rows_equal_oracle(records, layer_id, share, monkeypatch):
    """8 local heads, ``prefill_path="paged"`` on the triton backend: the window rows from the
    chunk's small workspace and the top-k records as slot ids (``paged_window_rows``), or both
    as slot ids;
    both equal the oracle, and ``share`` reaches ``sparse_mla_prefill_paged_window`` on the
    layers with a compressed cache."""
    from dsv41_triton.backends.triton_backend import TritonBackend

    calls = []
    real = TritonBackend.sparse_mla_prefill_paged_window

    def spy(self, q, *args, **kw):
        calls.append(q.shape[0])
        return real(self, q, *args, **kw)

    monkeypatch.setattr(TritonBackend, "sparse_mla_prefill_paged_window", spy)
    cfg = GPU_CFG.replace(name="gpu-small8", num_attention_heads=8, o_groups=1)
    sd = random_attention_state_dict(cfg, seed=30 + layer_id, device="cuda")
    layer = make_layer(cfg, layer_id, "triton", sd, device="cuda", page=64, cpage=64,
                       num_blocks=128, max_len=1024, prefill_path="paged",
                       swa_record=records[0], compressed_record=records[1])
    layer.paged_window_rows = share
    sc, results = run_scenario([layer], cfg, layer_id, steps=GPU_STEPS, device="cuda",
                               page=64, cpage=64, blocks_per_req=8, num_blocks=128, max_len=1024)
    orc = {n: oracle_request(sd, cfg, layer_id, torch.cat(st["hidden"]), torch.cat(st["ckv"]),
                             torch.cat(st["topk"]), records[0], records[1], max_len=1024)
           for n, st in sc.req.items()}
    for md, owners, [(a, y)] in results:
        n = len(owners)
        o_ref, y_ref = _gather_oracle(orc, owners)
        assert rel_err(a[:n], o_ref) <= 1e-2, rel_err(a[:n], o_ref)
        assert rel_err(y[:n], y_ref) <= 1e-2
        assert (a[n:] == 0).all()
    assert bool(calls) == (share and cfg.compress_ratio(layer_id) > 0), calls


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashmla_mega", "flashmla"])
def test_gpu_fused_contract(backend):
    cfg = GPU_CFG.replace(o_groups=2)  # 8 heads per group
    sd = random_attention_state_dict(cfg, seed=4, device="cuda")
    try:
        layer = make_layer(cfg, 2, backend, sd, device="cuda", page=64, cpage=64, num_blocks=128,
                           max_len=1024, fused=True, layout="interleaved",
                           swa_record=528 if backend == "flashmla_mega" else 584)
    except ValueError as e:
        pytest.skip(str(e))
    sc, results = run_scenario([layer], cfg, 2, steps=GPU_STEPS[:2] + GPU_STEPS[3:], device="cuda",
                               page=64, cpage=64, blocks_per_req=8, num_blocks=128, max_len=1024)
    rec = layer.swa_record
    orc = {n: oracle_request(sd, cfg, 2, torch.cat(st["hidden"]), torch.cat(st["ckv"]),
                             torch.cat(st["topk"]), rec, rec, max_len=1024)
           for n, st in sc.req.items()}
    for md, owners, [(a, y)] in results:
        _, y_ref = _gather_oracle(orc, owners)
        assert rel_err(y[: len(owners)], y_ref) <= 5e-2


# --------------------------------------------------------------------------------------------
# config and RoPE tables
# --------------------------------------------------------------------------------------------
def test_presets_and_hf_config():
    v41, v4, pro = (DeepseekV41AttentionConfig.v41_flash(), DeepseekV41AttentionConfig.v4_flash(),
                    DeepseekV41AttentionConfig.v4_pro())
    assert (v41.num_attention_heads, v41.q_lora_rank, v41.o_groups, v41.heads_per_group) == (64, 1280, 8, 8)
    assert set(v41.compress_ratios) == {0, 1, 2} and not v41.q_head_norm
    assert (v4.index_topk, set(v4.compress_ratios), v4.q_head_norm) == (512, {0, 4, 128}, True)
    assert (pro.num_attention_heads, pro.index_topk, pro.heads_per_group) == (128, 1024, 8)
    assert v41.compress_ratio(10_000) == 0  # past the list (MTP): window only
    hf = {"model_type": "deepseek_v4", "hidden_size": 4096, "num_attention_heads": 64,
          "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "compress_ratios": [0, 4],
          "rope_theta": 10000, "compress_rope_theta": 160000,
          "rope_scaling": {"factor": 16, "original_max_position_embeddings": 65536,
                           "beta_fast": 32, "beta_slow": 1, "type": "yarn"}}
    c = DeepseekV41AttentionConfig.from_hf_config(hf)
    assert (c.rope_factor, c.original_max_position_embeddings, c.q_head_norm) == (16.0, 65536, True)
    with pytest.raises(ValueError, match="o_groups"):
        DeepseekV41AttentionConfig(num_attention_heads=12, o_groups=8)


def test_rope_tables_per_layer_type():
    from dsv41_triton.layers.config import yarn_inv_freq
    from dsv41_triton.ops.rope_ref import make_cos_sin_cache

    c = DeepseekV41AttentionConfig.v41_flash()
    plain = build_cos_sin_cache(c, 0, 128)
    assert torch.allclose(plain, make_cos_sin_cache(128, base=10000.0), atol=1e-6)
    inv = yarn_inv_freq(64, 160000.0, 16.0, 65536, 32, 1)
    base = 160000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(inv[:4], base[:4])  # fast dims keep their frequency
    assert torch.allclose(inv[-4:], base[-4:] / 16)  # slow dims are interpolated by the factor
    assert ((inv <= base + 1e-15) & (inv >= base / 16 - 1e-15)).all()
    comp = build_cos_sin_cache(c, 1, 128)
    ang = torch.arange(128, dtype=torch.float64)[:, None] * inv[None]
    assert torch.allclose(comp, torch.cat([ang.cos(), ang.sin()], -1).float(), atol=1e-6)
    assert build_cos_sin_cache(c, 2, 128) is comp  # one shared table per layer type
