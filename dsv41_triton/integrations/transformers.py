"""Run a transformers DeepSeek-V4 model on this package's paged FP8 caches and kernels.

::

    from transformers import AutoModelForCausalLM
    from dsv41_triton.integrations.transformers import replace_attention
    model = replace_attention(AutoModelForCausalLM.from_pretrained(path), backend="auto")

:func:`replace_attention` swaps every ``DeepseekV4Attention`` of the model, in place, for a
:class:`DeepseekV41TransformersAttention`: the same forward signature and cache behaviour
(prefill, decode with ``past_key_values`` / ``cache``, ``generate()``), with the window and
compressed keys held as 584-byte FP8 records in paged caches and attention run by the selected
backend (:class:`~dsv41_triton.layers.DeepseekV41Attention` underneath).

The compressed entries and the CSA layers' top-k come from this package's compressor and
lightning indexer (``layer.compressed_block``: :mod:`dsv41_triton.layers.compressed`), loaded
from the replaced module's ``compressor.*`` / ``compressor.indexer.*`` weights; after the swap no
transformers attention, compressor or indexer forward runs. HCA layers attend to every completed
entry. ``indexer_numerics`` picks the index scores' numerics: ``"transformers"`` (the default:
no Hadamard transform, no FP4 simulation, as transformers' ``DeepseekV4Indexer`` computes them,
so the swapped model is the model it replaces up to the FP8 caches) or ``"deepseek"`` (DeepSeek's
V4 reference: Hadamard-transformed, FP4-simulated queries and keys). Index keys are cached as FP8
rows with a scale either way (docs/compressor_indexer.md §3). ``use_own_compressor=False`` keeps
transformers' compressor and indexer modules running (on its cache layer; their entries taken
before RoPE) for index shapes our indexer does not take (``index_head_dim`` not a power of two
>= 64) or to compare against them.

The paged caches (window, compressed, the compressor's state and the index keys) live on the
transformers cache object (one :class:`PagedKVState` per generation); transformers' own window
keys are not kept (a one-wide placeholder keeps its length bookkeeping). Every row of a batch
must hold the same positions (no padding masks; ``attention_mask`` is not read: causality and
the window come from the positions); beam search reordering and cache cropping are not
supported.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .._utils import ROPE_DIM, cdiv
from ..backends import AttentionBackend
from ..layers.config import DeepseekV41AttentionConfig
from ..layers.layer import DeepseekV41Attention
from ..layers.metadata import RequestSpec, StepMetadata, build_step_metadata

DEFAULT_PAGE_SIZE = 64
#: attribute of a transformers cache object holding its :class:`PagedKVState`
STATE_ATTR = "_dsv41_paged_state"
#: ``indexer_numerics`` -> (Hadamard transform, FP4 simulation) of the index queries / keys:
#: transformers' DeepseekV4Indexer applies neither, DeepSeek's V4 reference both
INDEXER_NUMERICS = {"transformers": (False, False), "deepseek": (True, True)}


class _UnrotatedRotary(nn.Module):
    """Stands in for a compressor's rotary embedding (``cos = 1``, ``sin = 0``) so the
    compressor returns its entries before RoPE; the layer RoPEs them as it inserts them."""

    def forward(self, x, position_ids, layer_type=None):
        shape = (*position_ids.shape, ROPE_DIM // 2)
        return (torch.ones(shape, dtype=x.dtype, device=x.device),
                torch.zeros(shape, dtype=x.dtype, device=x.device))


class PagedKVState:
    """The paged FP8 caches of one generation: per layer its window / compressed cache
    tensors and the tokens it holds; per batch row its block ids (row ``b``'s ``j``-th block is
    ``b + B * j``, the same in every cache); the step metadata shared by a step's layers."""

    def __init__(self, batch: int, page_size: int, ratios: Sequence[int], device):
        self.batch, self.page, self.device = batch, page_size, torch.device(device)
        self.ratios = tuple(sorted({int(r) for r in ratios if r > 0}))
        self.tokens: Dict[int, int] = {}
        self.caches: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        #: per layer: its compressed block's (state, index state, index-key) caches
        self.block_caches: Dict[int, Tuple[Optional[torch.Tensor], ...]] = {}
        self._md_key: Optional[tuple] = None
        self._md: Optional[StepMetadata] = None

    def _blocks(self, row: int, n: int):
        return [row + self.batch * j for j in range(max(n, 1))]

    def metadata(self, prefix: int, query_len: int, window: int) -> StepMetadata:
        """The step's metadata (every row: ``prefix`` cached tokens, ``query_len`` new ones);
        built once per step and shared by the layers."""
        key = (prefix, query_len, window)
        if key != self._md_key:
            seq = prefix + query_len
            reqs = [RequestSpec(query_len, prefix, self._blocks(b, cdiv(seq, self.page)),
                                {r: self._blocks(b, cdiv(seq // r, self.page)) for r in self.ratios})
                    for b in range(self.batch)]
            self._md = build_step_metadata(
                reqs, window_size=window, swa_page_size=self.page,
                compressed_page_sizes={r: self.page for r in self.ratios}, device=self.device)
            self._md_key = key
        return self._md

    def _grow(self, cache: Optional[torch.Tensor], blocks: int, record: int) -> torch.Tensor:
        from ..ops.records import allocate_k_cache

        if cache is not None and cache.shape[0] >= blocks:
            return cache
        have = 0 if cache is None else cache.shape[0]
        new = allocate_k_cache(max(blocks, 2 * have), self.page, record, self.device)
        if cache is not None:
            new[:have].copy_(cache)
        return new

    def bind(self, layer: DeepseekV41Attention, layer_idx: int, seq_len: int) -> None:
        """Grow the layer's caches to hold ``seq_len`` positions per row and bind them."""
        swa, comp = self.caches.get(layer_idx, (None, None))
        swa = self._grow(swa, self.batch * max(cdiv(seq_len, self.page), 1), layer.swa_record)
        r = layer.compress_ratio
        if r > 0:
            comp = self._grow(comp, self.batch * max(cdiv(seq_len // r, self.page), 1),
                              layer.compressed_record)
        self.caches[layer_idx] = (swa, comp)
        layer.bind_kv_caches(swa, comp)
        blk = layer.compressed_block
        if blk is not None and blk.loaded:
            # this generation's compressor state / index-key caches, grown beside the window
            # (state caches: window geometry) and compressed (index keys) caches
            blk.state_cache, blk.index_state_cache, blk.index_cache = \
                self.block_caches.get(layer_idx, (None, None, None))
            blk.ensure_capacity(swa.shape[0], self.page, comp.shape[0], self.page)
            self.block_caches[layer_idx] = (blk.state_cache, blk.index_state_cache,
                                            blk.index_cache)


class DeepseekV41TransformersAttention(nn.Module):
    """A transformers ``DeepseekV4Attention`` replacement (see the module docstring).

    ``forward(hidden_states [B, S, hidden], position_embeddings, position_ids [B or 1, S],
    attention_mask, cache / past_key_values, **kwargs) -> (output [B, S, hidden], None)``.
    ``position_embeddings`` and ``attention_mask`` are accepted and not read (the layer's own
    RoPE tables and the positions decide); ``output_attentions`` gives ``None`` weights."""

    def __init__(self, hf_attention: nn.Module, config: DeepseekV41AttentionConfig, *,
                 backend: Union[str, AttentionBackend] = "auto", page_size: int = DEFAULT_PAGE_SIZE,
                 max_model_len: Optional[int] = None, ratios: Sequence[int] = (),
                 check_positions: bool = True, use_own_compressor: bool = True,
                 indexer_numerics: str = "transformers"):
        super().__init__()
        if indexer_numerics not in INDEXER_NUMERICS:
            raise ValueError(f"indexer_numerics: expected one of {tuple(INDEXER_NUMERICS)}, got "
                             f"{indexer_numerics!r}")
        self.layer_idx = int(hf_attention.layer_idx)
        self.layer_type = getattr(hf_attention, "layer_type", None)
        dev = hf_attention.q_a_proj.weight.device
        self.layer = DeepseekV41Attention(config, self.layer_idx, backend=backend, device=dev,
                                          max_model_len=max_model_len)
        r = self.layer.compress_ratio
        hf_comp = getattr(hf_attention, "compressor", None)
        if (hf_comp is None) != (r == 0):
            raise ValueError(f"layer {self.layer_idx}: transformers' module "
                             f"{'has no' if hf_comp is None else 'has a'} compressor, the "
                             f"config gives ratio {r}")
        if hf_comp is not None and int(hf_comp.compress_rate) != r:
            raise ValueError(f"layer {self.layer_idx}: compressor rate "
                             f"{hf_comp.compress_rate}, the config gives ratio {r}")
        has_indexer = hf_comp is not None and hasattr(hf_comp, "indexer")
        if has_indexer != self.layer.has_indexer:
            raise ValueError(f"layer {self.layer_idx}: indexer present={has_indexer}, the config "
                             f"says {self.layer.has_indexer} (hca_ratios {config.hca_ratios})")
        self.use_own_compressor = bool(use_own_compressor) and r > 0
        self.indexer_numerics = indexer_numerics
        sd = hf_attention.state_dict()
        if not self.use_own_compressor:  # transformers' modules keep running: not copied
            sd = {k: v for k, v in sd.items() if not k.startswith("compressor.")}
        self.layer.load_weights(sd)
        blk = self.layer.compressed_block
        if self.use_own_compressor:
            if blk is None or not blk.loaded:
                why = ("an index shape the indexer kernels do not take (index_head_dim "
                       f"{config.index_head_dim}: a power of two >= 64)" if blk is None
                       else "compressor / indexer weights missing from the module")
                raise ValueError(f"layer {self.layer_idx}: this package's compressor cannot "
                                 f"replace transformers' ({why}); pass "
                                 "use_own_compressor=False to keep transformers' modules")
            hadamard, fp4 = INDEXER_NUMERICS[indexer_numerics]
            blk.set_indexer_numerics(hadamard, fp4)
        # the old path: transformers' compressor / indexer modules, on its cache layer
        self.compressor = None if self.use_own_compressor else hf_comp
        # its indexer reads q_residual = q_a_norm(q_a_proj(x)) as transformers computes it
        keep_q = has_indexer and not self.use_own_compressor
        self.q_a_proj = hf_attention.q_a_proj if keep_q else None
        self.q_a_norm = hf_attention.q_a_norm if keep_q else None
        self.page_size = page_size
        self.ratios = tuple(ratios) or ((r,) if r else ())
        self.check_positions = check_positions
        self.is_causal = True
        self.head_dim = config.head_dim
        self.sliding_window = config.sliding_window

    # ---- state --------------------------------------------------------------------------
    def _state(self, cache: Any, batch: int, device) -> PagedKVState:
        if cache is None:  # stateless call: the sequence starts at position 0
            return PagedKVState(batch, self.page_size, self.ratios, device)
        st = getattr(cache, STATE_ATTR, None)
        if st is None:
            st = PagedKVState(batch, self.page_size, self.ratios, device)
            setattr(cache, STATE_ATTR, st)
        if st.batch != batch:
            raise ValueError(f"hidden_states: batch {batch}, the cache holds {st.batch} rows")
        return st

    def _check_positions(self, position_ids: Optional[torch.Tensor], prefix: int, B: int, S: int):
        if position_ids is None or not self.check_positions:
            return
        want = torch.arange(prefix, prefix + S, device=position_ids.device)
        if not bool((position_ids.reshape(-1, S) == want).all()):
            raise ValueError(f"position_ids: expected {prefix}..{prefix + S - 1} in every row (the "
                             f"cache holds {prefix} tokens); padded or offset batches are not "
                             "supported")

    # ---- compressor / indexer ------------------------------------------------------------
    def _compress(self, hidden_states, position_ids, cache, prefix: int):
        """``compressed_kv [B*S, 512]`` (row of the token completing an entry: the entry before
        RoPE) and, with an indexer, ``topk_indices [B*S, index_topk]`` int32."""
        B, S, _ = hidden_states.shape
        r = self.layer.compress_ratio
        comp = self.compressor
        cache_layer = cache.layers[self.layer_idx] if cache is not None else None
        n0 = int(cache_layer.entry_count["compressor"]) if cache_layer is not None else 0
        q_residual = None
        if self.q_a_proj is not None:
            q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
        if position_ids is None:
            position_ids = torch.arange(prefix, prefix + S, device=hidden_states.device)[None]
        position_ids = position_ids.expand(B, S)
        rotary = comp.rotary_emb
        comp.rotary_emb = _UnrotatedRotary()
        try:
            entries, block_bias = comp(hidden_states, q_residual, position_ids, cache,
                                       self.layer_idx)
        finally:
            comp.rotary_emb = rotary
        n1 = entries.shape[2]
        dev = hidden_states.device
        ckv = torch.zeros(B, S, self.head_dim, dtype=torch.bfloat16, device=dev)
        if n1 > n0:
            e = torch.arange(n0, n1, device=dev)
            t = e * r + (r - 1) - prefix
            if int(t.min()) < 0 or int(t.max()) >= S:
                raise RuntimeError(f"layer {self.layer_idx}: compressor entries {n0}..{n1 - 1} do "
                                   f"not complete within this call's positions {prefix}..{prefix + S - 1}")
            ckv[:, t] = entries[:, 0, n0:n1].to(torch.bfloat16)
        topk = None
        if self.layer.has_indexer:
            K = self.layer.config.index_topk
            topk = torch.full((B, S, K), -1, dtype=torch.int32, device=dev)
            if n1 > 0 and block_bias is not None:
                picked = block_bias[:, 0] == 0  # [B, S, n1]: the indexer's valid picks
                cols = torch.arange(n1, device=dev)
                idx = torch.where(picked, cols, torch.full_like(cols, n1)).sort(-1).values
                k = min(K, n1)
                idx = idx[..., :k]
                topk[..., :k] = torch.where(idx == n1, torch.full_like(idx, -1), idx).to(torch.int32)
            topk = topk.view(B * S, K)
        return ckv.view(B * S, self.head_dim), topk

    # ---- forward --------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, position_embeddings=None,
                position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, cache=None, past_key_values=None,
                **kwargs) -> Tuple[torch.Tensor, None]:
        cache = cache if cache is not None else past_key_values
        B, S, hid = hidden_states.shape
        st = self._state(cache, B, hidden_states.device)
        prefix = st.tokens.get(self.layer_idx, 0)
        self._check_positions(position_ids, prefix, B, S)
        if cache is not None:  # transformers' length bookkeeping (its window keys are not kept)
            ph = hidden_states.new_zeros((B, 1, S, 1))
            cache.update(ph, ph, self.layer_idx)
        ckv = topk = None
        if self.compressor is not None:  # use_own_compressor=False: transformers' modules
            ckv, topk = self._compress(hidden_states, position_ids, cache, prefix)
        md = st.metadata(prefix, S, self.layer.window_size)
        st.bind(self.layer, self.layer_idx, prefix + S)
        x = hidden_states.reshape(B * S, hid).to(torch.bfloat16)
        y = self.layer(md.positions, x, md, compressed_kv=ckv, topk_indices=topk)
        st.tokens[self.layer_idx] = prefix + S
        return y.view(B, S, hid).to(hidden_states.dtype), None

    def extra_repr(self) -> str:
        src = ("window only" if self.layer.compress_ratio == 0
               else f"own compressor, {self.indexer_numerics} indexer numerics"
               if self.use_own_compressor else "transformers' compressor")
        return (f"layer_idx={self.layer_idx}, type={self.layer_type}, page_size={self.page_size}, "
                f"{src}")


def _is_hf_attention(module: nn.Module) -> bool:
    try:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention
    except ImportError:  # pragma: no cover - transformers without DeepSeek-V4
        return False
    return isinstance(module, DeepseekV4Attention)


def replace_attention(model: nn.Module, backend: Union[str, AttentionBackend] = "auto", *,
                      page_size: int = DEFAULT_PAGE_SIZE, max_model_len: Optional[int] = None,
                      config: Optional[DeepseekV41AttentionConfig] = None,
                      use_own_compressor: bool = True,
                      indexer_numerics: str = "transformers") -> nn.Module:
    """Swap every ``DeepseekV4Attention`` of ``model`` (a transformers DeepSeek-V4 model), in
    place, for :class:`DeepseekV41TransformersAttention`; returns ``model``.

    backend: ``"auto"``, a backend name or an instance (``dsv41_triton.backends``).
    page_size: tokens per page of the window caches (entries per page of the compressed ones).
    max_model_len: rows of the RoPE tables (default: the layer's, at most 131072).
    config: the attention config (default: ``DeepseekV41AttentionConfig.from_hf_config`` of
        ``model.config``).
    use_own_compressor: compressed entries and top-k from this package's compressor and
        indexer (default); ``False`` keeps transformers' compressor / indexer modules running.
    indexer_numerics: ``"transformers"`` (default: plain scores, as transformers computes them)
        or ``"deepseek"`` (Hadamard + FP4 simulation, as DeepSeek's V4 reference does).
    """
    if config is None:
        config = DeepseekV41AttentionConfig.from_hf_config(model.config)
    targets = [(name, m) for name, m in model.named_modules() if _is_hf_attention(m)]
    if not targets:
        raise ValueError("model: no transformers DeepseekV4Attention module to replace")
    ratios = sorted({config.compress_ratio(int(m.layer_idx)) for _, m in targets} - {0})
    first = min(int(m.layer_idx) for _, m in targets)
    for name, m in targets:
        new = DeepseekV41TransformersAttention(
            m, config, backend=backend, page_size=page_size, max_model_len=max_model_len,
            ratios=ratios, check_positions=int(m.layer_idx) == first,
            use_own_compressor=use_own_compressor, indexer_numerics=indexer_numerics)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
    return model


__all__ = ["INDEXER_NUMERICS", "DeepseekV41TransformersAttention", "PagedKVState",
           "replace_attention"]
