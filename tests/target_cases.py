"""The public calls ``compile_targets.py`` makes, as ``CASES = [(label, fn)]``: every Triton
kernel of the package at the launch shapes the host picks for V4.1's shapes (8 and 64 heads,
1 / 128 / 512 tokens, every record pair; 128 heads launch the 64-head shapes twice), on small
CPU tensors (nothing runs)."""
from __future__ import annotations

import torch

from dsv41_triton import ops
from dsv41_triton.attention import (q_norm_rope, sparse_mla_decode, sparse_mla_decode_fused,
                                    sparse_mla_prefill, sparse_mla_prefill_fused)
from dsv41_triton.attention.prefill_shared import sparse_mla_prefill_shared_window
from dsv41_triton.ops import indexer, index_mask, prefill_indices
from dsv41_triton.ops.rope_ref import make_cos_sin_cache

PAGE, BLOCKS = 64, 8
RECORDS = (584, 528, 288)


def _i32(*shape, hi=PAGE * BLOCKS):
    return torch.randint(0, hi, shape, dtype=torch.int32)


def _q(T, H):
    return torch.randn(T, H, 512, dtype=torch.bfloat16)


def _cache(rec):
    return ops.allocate_k_cache(BLOCKS, PAGE, rec)


def _block_table(reqs=2):
    return torch.arange(reqs * BLOCKS // 2, dtype=torch.int32).view(reqs, -1)


def _cos_sin():
    return make_cos_sin_cache(4096)


def _insert(rec):
    ops.quantize_and_insert_k_cache(torch.randn(16, 512, dtype=torch.bfloat16), _cache(rec),
                                    torch.arange(16))


def _gather(rec, with_lens):
    out = torch.empty(2, 160, 512, dtype=torch.bfloat16)
    seq = torch.tensor([100, 150], dtype=torch.int32)
    gl = torch.tensor([60, 90], dtype=torch.int32) if with_lens else None
    ops.dequantize_and_gather_k_cache(out, _cache(rec), seq, gl, _block_table(), PAGE, 0)


def _index_ops():
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    seq = torch.tensor([200, 300], dtype=torch.int32)
    gl = torch.tensor([130, 131], dtype=torch.int32)
    ops.combine_topk_swa_indices(_i32(7, 512, hi=50), qsl, seq, gl, 128, 4, 512, 200, 75)
    ops.combine_topk_swa_indices(_i32(7, 512, hi=50), qsl, seq, gl, 128, 4, 512, 200, 75,
                                 window_rows=torch.empty(3, 7, dtype=torch.int32))
    ops.compute_global_topk_indices_and_lens(_i32(7, 512, hi=50), _i32(7, hi=2), _block_table(),
                                             PAGE, None)
    index_mask.mask_index_rows(_i32(7, 640), _i32(7, hi=640), 64)
    pos = torch.tensor([120, 121, 122, 290, 291, 292, 293], dtype=torch.int32)
    t2r = torch.tensor([0, 0, 0, 1, 1, 1, 1], dtype=torch.int32)
    prefill_indices.prefill_slot_indices(pos, t2r, seq, _block_table(), PAGE, 128,
                                         _i32(7, 512, hi=50), _block_table(), PAGE, 4)
    prefill_indices.prefill_window_slot_indices(pos, t2r, seq, gl, 0, 140, 128,
                                                _i32(7, 512, hi=50), _block_table(), PAGE, 4)


def _rope_mxfp8():
    cs = _cos_sin()
    pos = _i32(5, hi=4096)
    ops.apply_rope(_q(5, 8), pos, cs)
    ops.mxfp8_quantize(torch.randn(5, 1, 4096, dtype=torch.bfloat16))
    for layout in ("standard", "interleaved"):
        ops.rope_mxfp8_epilogue(_q(5, 8), pos, cs, layout)
        q_norm_rope(_q(5, 8), pos, cs, layout, enable_q_norm=True)


def _indexer_ops():
    cache = torch.empty(BLOCKS, PAGE, 128 + 4, dtype=torch.uint8)
    indexer.quantize_and_insert_index_k(torch.randn(16, 128, dtype=torch.bfloat16), cache,
                                        torch.arange(16))
    indexer.index_logits(torch.randn(5, 64, 128, dtype=torch.bfloat16), torch.randn(5, 64),
                         cache, _block_table(), _i32(5, hi=2), _i32(5, hi=200) + 1, max_len=256)
    indexer.index_topk(torch.randn(5, 256), _i32(5, hi=256) + 1, 64)


def _decode(H, T, rec_a, rec_b):
    b = dict(extra_cache=_cache(rec_b), extra_indices=_i32(T, 512),
             extra_lens=_i32(T, hi=512)) if rec_b else {}
    sparse_mla_decode(_q(T, H), _cache(rec_a), _i32(T, 128), _i32(T, hi=128),
                      attn_sink=torch.randn(H), **b)


def _prefill(H, T):
    sparse_mla_prefill(_q(T, H), torch.randn(1000, 512, dtype=torch.bfloat16),
                       _i32(T, 640, hi=1000), _i32(T, hi=640), attn_sink=torch.randn(H))


def _shared_window(H, rec):
    T = 70
    qsl = torch.tensor([0, 30, T], dtype=torch.int32)
    kv = torch.randn(1000, 512, dtype=torch.bfloat16)
    start = torch.arange(T, dtype=torch.int32)
    cache = _cache(rec) if rec else None
    sparse_mla_prefill_shared_window(_q(T, H), kv, start, torch.full((T,), 128, dtype=torch.int32),
                                     _i32(T, 512, hi=500), _i32(T, hi=512), qsl,
                                     attn_sink=torch.randn(H), topk_cache=cache)


def _fused(H, T):
    cs = _cos_sin()
    pos = _i32(T, hi=4096)
    sparse_mla_decode_fused(_q(T, H), _cache(584), _i32(T, 128),
                            attn_sink=torch.randn(H), topk_length=_i32(T, hi=128),
                            extra_kv=_cache(584), extra_indices=_i32(T, 512),
                            extra_topk_length=_i32(T, hi=512), token_positions=pos,
                            cos_sin_cache=cs, n_wv_group=H // 8 if H >= 8 else 1)
    sparse_mla_prefill_fused(_q(T, H), torch.randn(1000, 512, dtype=torch.bfloat16),
                             _i32(T, 1, 640, hi=1000), attn_sink=torch.randn(H),
                             topk_length=_i32(T, hi=640), token_positions=pos,
                             cos_sin_cache=cs, n_wv_group=H // 8 if H >= 8 else 1)


CASES = (
    [(f"insert {r}", lambda r=r: _insert(r)) for r in RECORDS]
    + [(f"gather {r}{' lens' if g else ''}", lambda r=r, g=g: _gather(r, g))
       for r in RECORDS for g in (False, True)]
    + [("index ops", _index_ops), ("rope / mxfp8 / q norm", _rope_mxfp8),
       ("indexer ops", _indexer_ops)]
    + [(f"decode {H}h T={T} {a}+{b}", lambda H=H, T=T, a=a, b=b: _decode(H, T, a, b))
       for H, T in ((8, 1), (8, 128), (64, 128)) for a in (584, 528) for b in (0,) + RECORDS]
    + [(f"prefill {H}h T={T}", lambda H=H, T=T: _prefill(H, T))
       for H, T in ((8, 1), (8, 512), (64, 512))]
    + [(f"shared window {H}h {r or 'bf16'}", lambda H=H, r=r: _shared_window(H, r))
       for H, r in ((1, 0), (16, 0)) + tuple((8, r) for r in (0,) + RECORDS)]
    + [(f"fused {H}h T={T}", lambda H=H, T=T: _fused(H, T)) for H, T in ((8, 1), (64, 128))]
)
