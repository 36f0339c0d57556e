"""The V4 layer end to end against transformers' ``DeepseekV4Attention``: hidden states in,
output out, prefill in chunks then decode steps; the layer computes its compressed KV and
top-k itself (no hooks, no inputs from transformers but the weights)."""
import types

import pytest
import torch
from hf_v4 import hf_v4

from dsv41_triton.layers import DeepseekV41Attention, DeepseekV41AttentionConfig
from dsv41_triton.layers.metadata import RequestSpec, build_step_metadata
from dsv41_triton.testing import rel_err

PAGE = 8
CPAGE = 4


def _hf_mask(a, c, W):
    """transformers' eager mask for a chunk at positions ``a .. a + c - 1``: its keys are the
    cached ``min(a, W - 1)`` previous tokens then the chunk (causal, window ``W``)."""
    n_prev = min(a, W - 1)
    kp = torch.arange(a - n_prev, a + c)
    qp = torch.arange(a, a + c)
    ok = (kp[None, :] <= qp[:, None]) & (kp[None, :] > qp[:, None] - W)
    return torch.where(ok, 0.0, float("-inf"))[None, None]


def _untied_tokens(layer, pos, r, k, gap=0.1):
    """Tokens whose selection is robust to the FP8 rounding of the cached index keys: fewer
    than ``k`` visible entries, or a gap above ``gap * max|logit|`` between the k-th and the
    (k+1)-th logit (elsewhere transformers' fp32 keys may pick another near-tied entry)."""
    ix = layer.compressed_block.indexer
    if ix is None:
        return torch.ones(pos.shape[0], dtype=torch.bool)
    lg = ix.last_logits
    vis = (pos + 1) // r
    keep = torch.ones(pos.shape[0], dtype=torch.bool)
    for t in range(pos.shape[0]):
        row = lg[t, : int(vis[t])]
        if row.numel() > k:
            srt = row.sort(descending=True).values
            keep[t] = bool(srt[k - 1] - srt[k] > gap * row.abs().max())
    return keep


def _run(layer_id, chunks, seed, perturb=None):
    tr, cfg = hf_v4()
    torch.manual_seed(seed)
    hf = tr.DeepseekV4Attention(cfg, layer_id).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            scale = 1.0 if ("norm" in n or n.endswith(("sinks", "position_bias"))) else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape) * scale + (1.0 if "norm" in n else 0.0))
    rot = tr.DeepseekV4RotaryEmbedding(cfg)
    ocfg = DeepseekV41AttentionConfig.from_hf_config(cfg)
    S = sum(chunks)
    ours = DeepseekV41Attention(ocfg, layer_id, backend="torch", device="cpu", max_model_len=S + 8)
    sd = {k: v.detach() for k, v in hf.state_dict().items()}
    if perturb:
        sd[perturb] = sd[perturb] + 1.0
    ours.load_weights(sd)
    ours.compressed_block.set_indexer_numerics(hadamard=False, fp4=False)
    if ours.compressed_block.indexer is not None:
        ours.compressed_block.indexer.keep_logits = True
    nblk = S // PAGE + 3
    ours.allocate_kv_caches(nblk, PAGE, compressed_num_blocks=S // CPAGE + 3, compressed_page_size=CPAGE)
    assert ours.compressed_block.ready
    r = ocfg.compress_ratio(layer_id)
    table = torch.randperm(nblk).tolist()
    ctable = torch.randperm(S // CPAGE + 3).tolist()
    cl = tr.DeepseekV4CSACache(cfg) if r == 4 else tr.DeepseekV4HCACache(cfg)
    cache = types.SimpleNamespace(layers=[cl] * 2, update=lambda k, v, idx, **kw: cl.update(k, v))
    x = torch.randn(S, 64).bfloat16()
    a = 0
    errs, tops = [], []
    for c in chunks:
        pos = torch.arange(a, a + c)
        xs = x[a:a + c]
        with torch.no_grad():
            pe = {kind: rot(xs.float()[None], pos[None], layer_type=kind) for kind in ("main", "compress")}
            want, _ = hf(xs.float()[None], pe, pos[None], _hf_mask(a, c, cfg.sliding_window), cache)
        md = build_step_metadata([RequestSpec(c, a, table, {r: ctable})], window_size=cfg.sliding_window,
                                 swa_page_size=PAGE, compressed_page_sizes={r: CPAGE})
        got = ours(None, xs, md)
        keep = _untied_tokens(ours, pos, r, cfg.index_topk)
        errs.append((rel_err(got.float()[keep], want[0][keep]) if keep.any() else 0.0,
                     int(keep.sum()), c))
        tops.append(ours.last_topk_indices)
        a += c
    return errs, tops, r


@pytest.mark.parametrize("layer_id,chunks", [(0, [23, 14, 1, 1, 1, 5, 1, 1]),
                                              (1, [70, 65, 1, 1, 1, 3, 1, 1, 1])],
                         ids=["csa-ratio4", "hca-ratio128"])
def test_layer_matches_transformers_attention(layer_id, chunks):
    errs, tops, r = _run(layer_id, chunks, seed=7 + layer_id)
    # the window and compressed caches hold FP8 records (584: e4m3 with power-of-two scales per
    # 64 dims, as DeepSeek's reference simulates); transformers keeps fp32
    assert max(e for e, _, _ in errs) < 6e-2, errs
    assert sum(n for _, n, _ in errs) >= 0.75 * sum(chunks), errs
    for t in tops:
        assert t.dtype == torch.int32 and t.dim() == 2
    last = tops[-1]
    S = sum(chunks)
    if r == 4:
        assert last.shape[1] == 8 and int((last[-1] >= 0).sum()) == 8  # 8 of the S // 4 entries
    else:
        assert set(last[-1][last[-1] >= 0].tolist()) == {0}  # the one completed entry
    assert S // r >= 1


def test_layer_vs_transformers_can_fail():
    """A wrong compressor weight moves the output far past the tolerance."""
    errs, _, _ = _run(0, [23, 14, 1, 1], seed=7, perturb="compressor.kv_norm.weight")
    assert max(e for e, _, _ in errs) > 1e-1, errs
