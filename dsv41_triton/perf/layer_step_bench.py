"""One compressed attention layer step end to end, with the time of each part.

    python -m dsv41_triton.perf.layer_step_bench [--tp 8] [--ratio 2] [--out step.json]

A V4.1-Flash layer (rank 0 of TP ``--tp``: 8 local heads at TP8) computing its own compressed KV
and top-k (``DeepseekV41Attention.compressed_block``), random weights, for two steps:

* prefill: one request of ``--prefill`` (4096) new tokens;
* decode: ``--decode`` (128) requests of one token each at ``--context`` (4096) positions of
  context (the caches hold random bytes there: timing only).

Rows: the whole ``layer(None, x, metadata)`` call, and its parts timed one by one (CUDA events,
L2 flushed; :mod:`dsv41_triton.perf.timing`): projections (``fused_wqa_wkv``, norms, ``wq_b``),
compressor, indexer (keys + logits + top-k), attention (window/compressed inserts + sparse
attention), output projections (inverse RoPE, ``wo_a``, ``wo_b``); each part's share of their sum.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ..layers import DeepseekV41Attention, DeepseekV41AttentionConfig
from ..layers.metadata import RequestSpec, build_step_metadata
from .timing import time_call


def build(cfg: DeepseekV41AttentionConfig, layer_id: int, tp: int, device, backend: str,
          max_len: int, num_blocks: int, page: int, cnum_blocks: int, cpage: int):
    layer = DeepseekV41Attention(cfg, layer_id, tp_rank=0, tp_size=tp, backend=backend,
                                 device=device, max_model_len=max_len)
    layer.init_random_weights(seed=0)
    layer.compressed_block.init_random(seed=1)
    layer.allocate_kv_caches(num_blocks, page, cnum_blocks, cpage)
    blk = layer.compressed_block
    for c in (blk.state_cache, blk.index_state_cache):
        if c is not None:
            c.zero_()
    return layer


def _parts(layer, x, md):
    """Closures for each part of one step, with their inputs precomputed."""
    blk = layer.compressed_block
    T = x.shape[0]
    pos = md.positions
    cs = layer.cos_sin_cache

    def proj():
        qr_kv = layer.fused_wqa_wkv(x)
        qr, kv = qr_kv.split([layer.q_lora_rank, layer.head_dim], dim=-1)
        qr, kv = layer.q_norm(qr), layer.kv_norm(kv)
        return qr, kv, layer.wq_b(qr).view(T, layer.n_local_heads, layer.head_dim)

    qr, kv, q = proj()

    def compressor():
        return blk.compressor(x, pos, md.token_to_req, blk.state_cache, md.swa_block_table,
                              md.swa_slot_mapping, md.is_valid_token)

    latent, _ = compressor()
    ix = blk.indexer
    r = blk.ratio
    cm = md.compressed[r]
    width = max(max(cm.num_entries_cpu, default=0), 1)

    def indexer():
        keys = ix.keys_from_latent(latent, pos, cs)
        ix.store_keys(keys, blk.index_cache, cm.slot_mapping)
        return ix.select(x, qr, pos, cs, blk.index_cache, cm.block_table, md.token_to_req,
                         md.is_valid_token, width=width)[0]

    top = indexer()
    qh = layer._ops.rope(q, pos, cs)
    out = layer._alloc_attn_out(T, x)
    ckv = latent.to(torch.bfloat16)

    def attention():
        layer._insert_kv(kv, pos, md, ckv)
        layer.forward_mqa(qh, kv, pos, out, metadata=md, topk_indices=top)

    attention()

    def o_proj():
        return layer._o_proj(out, pos)

    return {"projections": proj, "compressor": compressor, "indexer": indexer,
            "attention": attention, "output projections": o_proj}


def run_step(layer, md, x, device):
    rows = {"step": time_call(lambda: layer(None, x, md), device).median_us}
    for name, fn in _parts(layer, x, md).items():
        rows[name] = time_call(fn, device).median_us
    parts = sum(v for k, v in rows.items() if k != "step")
    return {k: {"us": round(v, 1), "share": round(v / parts, 3) if k != "step" else None}
            for k, v in rows.items()}


def run(tp: int = 8, ratio: int = 2, prefill: int = 4096, decode: int = 128, context: int = 4096,
        device="cuda", backend="auto", cfg=None, page: int = 64) -> dict:
    cfg = cfg or DeepseekV41AttentionConfig.v41_flash()
    layer_id = next(i for i, r in enumerate(cfg.compress_ratios) if r == ratio)
    per_req = -(-(context + 1) // page)
    n_req = max(decode, 1)
    blocks = n_req * per_req + 2 * (-(-prefill // page)) + 4
    cblocks = n_req * (-(-(context + 1) // ratio // page) + 1) + (-(-prefill // ratio // page)) + 4
    layer = build(cfg, layer_id, tp, device, backend, max(context, prefill) + 8, blocks, page,
                  cblocks, page)
    g = torch.Generator(device="cpu").manual_seed(0)
    perm = torch.randperm(blocks, generator=g).tolist()
    cperm = torch.randperm(cblocks, generator=g).tolist()
    res = {"device": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu",
           "layer": f"{cfg.name} layer {layer_id} ratio {ratio} TP{tp} ({layer.n_local_heads} heads), "
                    f"backend {layer.selection.name}"}
    # prefill: one request
    npb, ncb = -(-prefill // page), -(-(prefill // ratio) // page) + 1
    md = build_step_metadata([RequestSpec(prefill, 0, perm[:npb], {ratio: cperm[:ncb]})],
                             window_size=cfg.sliding_window, swa_page_size=page,
                             compressed_page_sizes={ratio: page}, device=device)
    x = torch.randn(prefill, cfg.hidden_size, generator=g).bfloat16().to(device)
    res[f"prefill {prefill}"] = run_step(layer, md, x, device)
    # decode: n_req requests at `context`
    perm, cperm = perm[npb:], cperm[ncb:]
    cper = -(-(context + 1) // ratio // page) + 1
    reqs = [RequestSpec(1, context, perm[i * per_req:(i + 1) * per_req],
                        {ratio: cperm[i * cper:(i + 1) * cper]}) for i in range(n_req)]
    md = build_step_metadata(reqs, window_size=cfg.sliding_window, swa_page_size=page,
                             compressed_page_sizes={ratio: page}, device=device)
    x = torch.randn(n_req, cfg.hidden_size, generator=g).bfloat16().to(device)
    res[f"decode {n_req} x ctx {context}"] = run_step(layer, md, x, device)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--ratio", type=int, default=2, choices=(1, 2))
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("layer_step_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    res = run(a.tp, a.ratio, a.prefill, a.decode, a.context, backend=a.backend)
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
