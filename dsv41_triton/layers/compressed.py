"""What a compressed attention layer computes before attention: its compressed KV rows and its
top-k selection (docs/compressor_indexer.md).

``CompressedBlock`` is owned by a compressed :class:`~dsv41_triton.layers.DeepseekV41Attention`
(``layer.compressed_block``) and runs when the caller passes neither ``compressed_kv`` nor
``topk_indices``:

* V4: every compressed layer has a compressor (:class:`KVCompressor`); ratio-4 layers an indexer
  with its own compressor (:class:`LightningIndexer`); ratio-128 layers attend to every
  completed entry.
* V4.1: the KV-source layers (``kv_source_layer_ids``) compress; the index-source layers
  (``index_source_layer_ids``) select; the index sources that are KV sources own the index
  keys. The others read their source's caches and reuse its selection: wire them with
  :func:`link_layers` (which also configures the two-level candidate selection).

Caches (allocated by ``layer.allocate_kv_caches``): the compressor's fp32 state cache (window
geometry), the V4 indexer compressor's state cache, and the index-key cache (compressed
geometry, ``uint8 [blocks, page, Di + 4]``).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .compressor import CompressorSpec, KVCompressor
from .indexer import IndexerSpec, LightningIndexer

__all__ = ["CompressedBlock", "build_compressed_block", "link_layers"]


class CompressedBlock(nn.Module):
    """The compressor and indexer of one compressed layer (see the module docstring)."""

    def __init__(self, config, layer_id: int, device=None, reference: bool = False):
        super().__init__()
        r = config.compress_ratio(layer_id)
        self.ratio = r
        self.layer_id = layer_id
        self.version = "v4" if config.q_head_norm else "v4.1"
        v41 = self.version == "v4.1"
        self.is_kv_source = (layer_id in config.kv_source_layer_ids or not config.kv_source_layer_ids) \
            if v41 else True
        self.is_index_source = (layer_id in config.index_source_layer_ids
                                or not config.index_source_layer_ids) if v41 else config.has_indexer(layer_id)
        self.has_indexer = config.has_indexer(layer_id)
        self.compressor = KVCompressor(CompressorSpec.for_version(
            self.version, r, config.head_dim, config.hidden_size, config.rms_norm_eps),
            device=device) if self.is_kv_source else None
        self.indexer = None
        if self.has_indexer and self.is_index_source:
            self.indexer = LightningIndexer(IndexerSpec(
                self.version, r, config.hidden_size, config.q_lora_rank,
                n_heads=config.index_n_heads, head_dim=config.index_head_dim, topk=config.index_topk,
                owns_keys=self.is_kv_source, latent_dim=config.head_dim, eps=config.rms_norm_eps),
                device=device, reference=reference)
        #: V4.1 wiring (link_layers): the layers whose caches / selection this one reads
        self.kv_source: nn.Module | None = None
        self.key_source: nn.Module | None = None
        self.index_source: nn.Module | None = None
        self.candidate_source: nn.Module | None = None
        self.publish_candidates = False
        self.loaded = False
        self.state_cache: torch.Tensor | None = None
        self.index_state_cache: torch.Tensor | None = None
        self.index_cache: torch.Tensor | None = None
        self.last_candidates: torch.Tensor | None = None

    # ---- weights ----------------------------------------------------------------------------
    def load(self, extra: Mapping[str, torch.Tensor]) -> bool:
        """Load from the layer's ``extra_weights`` (DeepSeek's names: ``compressor.*``,
        ``indexer.*``). Returns whether everything this layer owns was there."""
        try:
            if self.compressor is not None:
                self.compressor.load(extra, "compressor.")
            if self.indexer is not None:
                self.indexer.load(extra, "indexer.")
        except ValueError:
            self.loaded = False
            return False
        self.loaded = True
        return True

    def init_random(self, seed: int = 0) -> None:
        """Random weights for everything this layer owns (norm weights near 1)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                t = torch.randn(p.shape, generator=g)
                if name.endswith("norm.weight"):
                    t = 1.0 + 0.1 * t
                elif not name.endswith("ape"):
                    t = t * p.shape[-1] ** -0.5
                p.copy_(t.to(p.device, p.dtype))
        self.loaded = True

    def set_indexer_numerics(self, hadamard: bool, fp4: bool) -> None:
        """Switch the index queries' / keys' Hadamard transform and FP4 simulation (DeepSeek's
        reference applies both on V4; transformers' DeepSeek-V4 neither). Call before the first
        step: keys already cached keep the numerics they were stored with."""
        if self.indexer is not None:
            object.__setattr__(self.indexer.spec, "hadamard", bool(hadamard))
            object.__setattr__(self.indexer.spec, "fp4", bool(fp4))

    # ---- caches -----------------------------------------------------------------------------
    def allocate(self, num_blocks: int, page_size: int, compressed_num_blocks: int,
                 compressed_page_size: int) -> None:
        dev = next(self.parameters()).device if any(True for _ in self.parameters()) else None
        if self.compressor is not None and self.compressor.spec.state_width:
            self.state_cache = torch.full((num_blocks, page_size, self.compressor.spec.state_width),
                                          float("nan"), device=dev)
        if self.indexer is not None and self.indexer.spec.owns_keys:
            if self.indexer.compressor is not None:
                self.index_state_cache = torch.full(
                    (num_blocks, page_size, self.indexer.compressor.spec.state_width), float("nan"), device=dev)
            from ..ops.indexer_ref import allocate_index_k_cache

            self.index_cache = allocate_index_k_cache(compressed_num_blocks, compressed_page_size,
                                                      self.indexer.spec.head_dim, dev)

    def ensure_capacity(self, num_blocks: int, page_size: int, compressed_num_blocks: int,
                        compressed_page_size: int) -> None:
        """Grow the block's caches (keeping their contents) to at least these geometries; for
        callers that grow the layer's KV caches step by step (``bind_kv_caches``)."""
        old = (self.state_cache, self.index_state_cache, self.index_cache)
        need = ((num_blocks, page_size), (num_blocks, page_size),
                (compressed_num_blocks, compressed_page_size))
        if any(c is not None for c in old) and all(
                c is None or (c.shape[0] >= n and c.shape[1] == p) for c, (n, p) in zip(old, need)):
            return
        have = [c.shape[0] if c is not None else 0 for c in old]
        self.allocate(max(num_blocks, 2 * have[0], 2 * have[1]), page_size,
                      max(compressed_num_blocks, 2 * have[2]), compressed_page_size)
        for c_old, name in zip(old, ("state_cache", "index_state_cache", "index_cache")):
            new = getattr(self, name)
            if c_old is not None and new is not None and c_old.shape[1:] == new.shape[1:]:
                new[: c_old.shape[0]].copy_(c_old)

    def _index_cache(self) -> torch.Tensor | None:
        if self.index_cache is not None:
            return self.index_cache
        src = self.key_source
        return None if src is None else src.compressed_block.index_cache

    @property
    def ready(self) -> bool:
        """Whether the block can compute the layer's inputs on its own."""
        if not self.loaded:
            return False
        if self.compressor is None and self.kv_source is None:
            return False
        if self.has_indexer and self.indexer is None and self.index_source is None:
            return False
        return not (self.has_indexer and self.indexer is not None and self._index_cache() is None)

    # ---- one step ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, md,
                cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(compressed_kv [T, 512] bf16 pre-RoPE rows or None, topk [T, K] int32)`` of a step
        (``md``: its :class:`~dsv41_triton.layers.metadata.StepMetadata`)."""
        r = self.ratio
        cm = md.compressed[r]
        ckv, latent = None, None
        if self.compressor is not None:
            latent, _ = self.compressor(x, positions, md.token_to_req, self.state_cache,
                                        md.swa_block_table, md.swa_slot_mapping, md.is_valid_token)
            ckv = latent.to(torch.bfloat16)
        if not self.has_indexer:
            return ckv, md.all_entries_topk(r)
        ix = self.indexer
        if ix is None:  # V4.1: reuse the index source's selection of this step
            top = self.index_source.last_topk_indices
            if top is None or top.shape[0] != x.shape[0]:
                raise RuntimeError(f"layer {self.layer_id}: its index source (layer "
                                   f"{self.index_source.layer_id}) has not run this step")
            return ckv, top
        if ix.spec.owns_keys:
            if ix.compressor is not None:
                keys, _ = ix.keys_from_hidden(x, positions, cos_sin_cache, md.token_to_req,
                                              self.index_state_cache, md.swa_block_table,
                                              md.swa_slot_mapping, md.is_valid_token)
            else:
                keys = ix.keys_from_latent(latent, positions, cos_sin_cache)
            ix.store_keys(keys, self.index_cache, cm.slot_mapping)
        width = max(max(cm.num_entries_cpu, default=0), 1)
        cand_in = None
        if self.candidate_source is not None:
            cand_in = self.candidate_source.compressed_block.last_candidates
        top, cand = ix.select(x, qr, positions, cos_sin_cache, self._index_cache(), cm.block_table,
                              md.token_to_req, md.is_valid_token, width=width, candidates=cand_in,
                              publish_candidates=self.publish_candidates)
        self.last_candidates = cand
        return ckv, top


def build_compressed_block(config, layer_id: int, device=None, reference: bool = False) -> CompressedBlock | None:
    """The block of a compressed layer, or None (window-only layer, or an index shape the
    kernels do not take: ``index_head_dim`` a power of two, at least 64)."""
    if config.compress_ratio(layer_id) == 0:
        return None
    d = config.index_head_dim
    if config.has_indexer(layer_id) and (d & (d - 1) or d < 64):
        return None
    if not config.q_head_norm and config.compress_ratio(layer_id) not in (1, 2):
        return None
    return CompressedBlock(config, layer_id, device=device, reference=reference)


def link_layers(layers: Mapping[int, nn.Module], *, candidate_source_layer_id: int = -1,
                candidate_topk_blocks: int = 2048, candidate_block_size: int = 8) -> None:
    """Wire V4.1 layers (``{layer_id: DeepseekV41Attention}``, all of one model, in order): a
    compressed layer that is not a KV source binds the compressed cache (and index keys) of the
    latest KV source at or before it; one that is not an index source reuses the latest index
    source's selection; index sources after ``candidate_source_layer_id`` choose inside its
    candidate blocks. Call after ``allocate_kv_caches``."""
    ids = sorted(layers)
    for lid in ids:
        blk = getattr(layers[lid], "compressed_block", None)
        if blk is None:
            continue
        ratio = blk.ratio

        def latest(pred, lid=lid, ratio=ratio):
            cands = [i for i in ids if i <= lid and getattr(layers[i], "compressed_block", None) is not None
                     and layers[i].compressed_block.ratio == ratio and pred(layers[i].compressed_block)]
            return layers[cands[-1]] if cands else None

        if not blk.is_kv_source:
            src = latest(lambda b: b.is_kv_source)
            if src is None:
                raise ValueError(f"layer {lid}: no KV source of ratio {ratio} at or before it")
            blk.kv_source = src
            layers[lid].bind_kv_caches(layers[lid].swa_cache, src.compressed_cache)
        if blk.has_indexer and not blk.is_index_source:
            src = latest(lambda b: b.is_index_source and b.indexer is not None)
            if src is None:
                raise ValueError(f"layer {lid}: no index source of ratio {ratio} at or before it")
            blk.index_source = src
        if blk.indexer is not None and not blk.indexer.spec.owns_keys:
            blk.key_source = latest(lambda b: b.indexer is not None and b.indexer.spec.owns_keys)
            if blk.key_source is None:
                raise ValueError(f"layer {lid}: no layer of ratio {ratio} at or before it owns index keys")
        if blk.indexer is not None:
            spec = blk.indexer.spec
            object.__setattr__(spec, "candidate_topk_blocks", candidate_topk_blocks)
            object.__setattr__(spec, "candidate_block_size", candidate_block_size)
            blk.publish_candidates = lid == candidate_source_layer_id
            if 0 <= candidate_source_layer_id < lid and candidate_source_layer_id in layers:
                blk.candidate_source = layers[candidate_source_layer_id]
