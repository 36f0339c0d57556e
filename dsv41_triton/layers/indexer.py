"""DeepSeek V4 / V4.1 lightning indexer (docs/compressor_indexer.md §2-§4).

``LightningIndexer`` scores a step's tokens against the compressed entries of their requests
and selects the top-k visible entries (ascending entry ids, ``-1`` padded):

* queries ``q = wq_b qr`` per index head, RoPE on the last 64 dims at the token's position
  (V4: then the normalized Hadamard transform), FP4-simulated, bf16;
* head weights ``w = weights_proj x * Di**-0.5 * Hi**-0.5``;
* keys: V4 -- the indexer's own ratio-4 compressor (width ``Di``), RoPE at the entry's first
  position, Hadamard; V4.1 -- ``k_norm(wk latent)`` of the KV source's pre-RoPE latent, RoPE.
  Stored FP4-simulated as FP8 rows + scale in the index-key cache
  (:func:`dsv41_triton.ops.indexer.quantize_and_insert_index_k`) at the compressed slots;
* logits ``sum_h relu(q_h . k_j) w_h`` over visible entries ``j < (pos + 1) // r``
  (:func:`~dsv41_triton.ops.indexer.index_logits`) and top-k
  (:func:`~dsv41_triton.ops.indexer.index_topk`); V4.1's two-level selection through
  candidate blocks (:func:`select_candidates` / ``candidates=``).

Arguments are checked (dtype, rank, shape, device, layout) before anything is computed or
written, raising ``TypeError`` / ``ValueError`` naming the argument; device tensors' values are
not read (a position outside ``[0, max_pos)`` of ``cos_sin_cache`` is left unrotated, as the
RoPE ops do; a ``token_to_req`` without a block-table row selects nothing).

``hadamard=False, fp4=False`` follow transformers' DeepSeek-V4 indexer (neither is applied
there). ``reference=True`` runs the torch references of the ops instead of the kernels.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .._contract import (INDEX_DTYPES, INT_DTYPES, check_bool, check_int, check_shape,
                         check_tensor)
from ..ops import indexer as K
from ..ops import indexer_ref as R
from .compressor import (
    CompressorSpec,
    KVCompressor,
    _check_cos_sin_cache,
    _check_per_token,
    _check_positions,
    _check_rows,
    _check_valid,
    rms_norm_f,
    rope_tail,
)

__all__ = ["IndexerSpec", "LightningIndexer", "dense_topk", "visible_lens"]


@dataclass(frozen=True)
class IndexerSpec:
    """``version`` "v4" / "v4.1"; ``n_heads`` (Hi), ``head_dim`` (Di), ``topk``, ``ratio`` of the
    layer; ``owns_keys``: this layer computes and stores index keys (V4: always; V4.1: the
    KV-source index layers). ``latent_dim``: the KV latent width ``wk`` reads (V4.1)."""

    version: str
    ratio: int
    hidden_size: int
    q_lora_rank: int
    n_heads: int = 64
    head_dim: int = 128
    topk: int = 512
    owns_keys: bool = True
    latent_dim: int = 512
    hadamard: bool | None = None
    fp4: bool = True
    eps: float = 1e-6
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 8

    def __post_init__(self):
        if self.version not in ("v4", "v4.1"):
            raise ValueError(f"version: expected 'v4' or 'v4.1', got {self.version!r}")
        for f in ("ratio", "hidden_size", "q_lora_rank", "n_heads", "head_dim", "topk",
                  "latent_dim", "candidate_block_size"):
            check_int(f, getattr(self, f), lo=1)
        check_int("candidate_topk_blocks", self.candidate_topk_blocks, lo=0)
        if self.head_dim & (self.head_dim - 1) or self.head_dim < 64:
            raise ValueError(f"head_dim: expected a power of two >= 64, got {self.head_dim}")
        if self.hadamard is None:
            object.__setattr__(self, "hadamard", self.version == "v4")


def visible_lens(positions: torch.Tensor, ratio: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """int32 ``(pos + 1) // ratio`` (0 for invalid tokens): the entries a token may attend."""
    T = _check_positions(positions, None)
    check_int("ratio", ratio, lo=1)
    _check_valid(valid, T, positions.device)
    v = torch.div(positions.long() + 1, ratio, rounding_mode="floor")
    if valid is not None:
        v = torch.where(valid, v, torch.zeros_like(v))
    return v.to(torch.int32)


def dense_topk(positions: torch.Tensor, ratio: int, width: int,
               valid: torch.Tensor | None = None) -> torch.Tensor:
    """The selection of a layer without an indexer (V4 ratio 128): every visible entry,
    ``[T, width]`` int32 ascending, ``-1`` padded."""
    check_int("width", width, lo=0)
    vis = visible_lens(positions, ratio, valid)
    j = torch.arange(width, device=positions.device, dtype=torch.int32)
    return torch.where(j[None, :] < vis[:, None], j[None, :], torch.full_like(j[None, :], -1))


class LightningIndexer(nn.Module):
    """One layer's indexer (parameters under DeepSeek's names: ``wq_b.weight``,
    ``weights_proj.weight``; V4: ``compressor.*``; V4.1 key owners: ``wk.weight``,
    ``k_norm.weight``)."""

    def __init__(self, spec: IndexerSpec, device=None, reference: bool = False):
        super().__init__()
        self.spec = spec
        self.reference = reference
        Hi, Di = spec.n_heads, spec.head_dim
        kw = {"device": device, "dtype": torch.float32}
        self.wq_b = nn.Linear(spec.q_lora_rank, Hi * Di, bias=False, **kw)
        self.weights_proj = nn.Linear(spec.hidden_size, Hi, bias=False, **kw)
        self.compressor = None
        self.wk = None
        self.k_norm = None
        if spec.owns_keys:
            if spec.version == "v4":
                self.compressor = KVCompressor(CompressorSpec.for_version(
                    "v4", spec.ratio, Di, spec.hidden_size, spec.eps), device=device)
            else:
                self.wk = nn.Linear(spec.latent_dim, Di, bias=False, **kw)
                self.k_norm = nn.Module()
                self.k_norm.weight = nn.Parameter(torch.ones(Di, **kw))
        for p in self.parameters():
            p.requires_grad_(False)
        #: keep the last step's logits ``[T, N]`` in :attr:`last_logits` (for inspection/tests)
        self.keep_logits = False
        #: the largest logits scratch (elements) :meth:`select` makes at once
        self.max_logits_elems = 1 << 28
        self.last_logits: torch.Tensor | None = None

    # ---- argument checks ---------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return self.wq_b.weight.device

    def _check_index_cache(self, index_cache: object) -> None:
        check_tensor("index_cache", index_cache, device=self._device)
        R.check_index_k_cache("index_cache", index_cache, self.spec.head_dim)

    # ---- queries, weights, keys ------------------------------------------------------------
    def _finish(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.hadamard:
            x = R.hadamard_ref(x)
        return x

    def queries(self, qr: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                quantize: bool = True) -> torch.Tensor:
        """``qr [T, q_lora]`` -> bf16 ``[T, Hi, Di]`` (RoPE'd, Hadamard'd for V4, FP4-simulated);
        ``quantize=False``: the fp32 values before the FP4 simulation and the bf16 cast."""
        dev = self._device
        _check_rows("qr", qr, self.spec.q_lora_rank, dev)
        _check_per_token("positions", positions, qr.shape[0], dev)
        _check_cos_sin_cache(cos_sin_cache, dev)
        check_bool("quantize", quantize)
        return self._queries(qr, positions, cos_sin_cache, quantize)

    def _queries(self, qr, positions, cos_sin_cache, quantize: bool = True) -> torch.Tensor:
        T = qr.shape[0]
        q = (qr.float() @ self.wq_b.weight.t()).view(T, self.spec.n_heads, self.spec.head_dim)
        q = self._finish(rope_tail(q, positions, cos_sin_cache))
        if not quantize:
            return q
        if self.spec.fp4:
            q = R.fp4_simulate_ref(q)
        return q.to(torch.bfloat16)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> fp32 ``[T, Hi]``."""
        _check_rows("x", x, self.spec.hidden_size, self._device)
        return self._head_weights(x)

    def _head_weights(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        return (x.float() @ self.weights_proj.weight.t()) * (s.head_dim ** -0.5 * s.n_heads ** -0.5)

    def keys_from_latent(self, latent: torch.Tensor, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """V4.1: the KV source's pre-RoPE latent rows ``[T, D]`` of tokens completing an entry
        -> fp32 index keys ``[T, Di]`` (RoPE at the entry's first position)."""
        if self.wk is None:
            raise RuntimeError("this indexer does not own index keys (V4.1: not a KV source)")
        dev = self._device
        _check_rows("latent", latent, self.spec.latent_dim, dev)
        _check_per_token("positions", positions, latent.shape[0], dev)
        _check_cos_sin_cache(cos_sin_cache, dev)
        k = rms_norm_f(latent.float() @ self.wk.weight.t(), self.k_norm.weight, self.spec.eps)
        first = torch.div(positions.long(), self.spec.ratio, rounding_mode="floor") * self.spec.ratio
        return self._finish(rope_tail(k, first, cos_sin_cache))

    def keys_from_hidden(self, x, positions, cos_sin_cache, token_to_req, state_cache, block_table,
                         slot_mapping, valid=None) -> tuple[torch.Tensor, torch.Tensor]:
        """V4: the indexer's compressor on the step's tokens -> ``(keys [T, Di] fp32, completes)``."""
        if self.compressor is None:
            raise RuntimeError("this indexer has no compressor (V4.1 keys come from the KV latent)")
        _check_cos_sin_cache(cos_sin_cache, self._device)  # before the compressor writes state
        lat, done = self.compressor(x, positions, token_to_req, state_cache, block_table,
                                    slot_mapping, valid)
        first = torch.div(positions.long(), self.spec.ratio, rounding_mode="floor") * self.spec.ratio
        return self._finish(rope_tail(lat, first, cos_sin_cache)), done

    def store_keys(self, keys: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write key rows at ``slot_mapping`` (the compressed cache's; ``-1`` skipped)."""
        _check_rows("keys", keys, self.spec.head_dim, self._device)
        self._check_index_cache(index_cache)
        f = R.quantize_and_insert_index_k_ref if self.reference else K.quantize_and_insert_index_k
        f(keys.float().contiguous(), index_cache, slot_mapping, self.spec.fp4)

    # ---- selection --------------------------------------------------------------------------
    def logits(self, q, w, index_cache, block_table, token_to_req, vis, width: int) -> torch.Tensor:
        """``[T, width]`` fp32 index logits (:func:`~dsv41_triton.ops.indexer.index_logits`)."""
        check_int("width", width, lo=0)
        self._check_index_cache(index_cache)
        return self._logits(q, w, index_cache, block_table, token_to_req, vis, width)

    def _logits(self, q, w, index_cache, block_table, token_to_req, vis, width: int) -> torch.Tensor:
        f = R.index_logits_ref if self.reference else K.index_logits
        return f(q, w, index_cache, block_table, token_to_req, vis, max_len=width)

    def topk(self, logits: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
        """``[T, topk]`` int32 (:func:`~dsv41_triton.ops.indexer.select_topk`)."""
        f = R.index_topk_ref if self.reference else K.select_topk
        return f(logits, vis, self.spec.topk)

    def select(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor, index_cache: torch.Tensor, block_table: torch.Tensor,
               token_to_req: torch.Tensor, valid: torch.Tensor | None = None, *,
               width: int | None = None, candidates: torch.Tensor | None = None,
               publish_candidates: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Top-k of the step's tokens over the keys already in ``index_cache``.

        Returns ``(topk [T, topk] int32, candidates or None)``. ``candidates``: restrict the
        choice to these blocks (a V4.1 consumer); ``publish_candidates``: also return this
        layer's candidate blocks (the V4.1 candidate source).

        Args: ``x [T, hidden]`` / ``qr [T, q_lora]`` float, ``positions`` / ``token_to_req``
        ``[T]`` int, ``cos_sin_cache [max_pos, 64]`` fp32 / fp64, ``index_cache`` uint8
        ``[num_blocks, page, head_dim + 4]``, ``block_table [B, blocks]`` int32, ``valid``
        ``[T]`` bool, ``width`` an int >= 0 (default: the largest visible length, one host
        read), ``candidates [T, n]`` int; all on the parameters' device."""
        s = self.spec
        self._check_select_args(x, qr, positions, cos_sin_cache, index_cache, block_table,
                                token_to_req, valid, width, candidates, publish_candidates)
        vis = visible_lens(positions, s.ratio, valid)
        T = positions.shape[0]
        if width is None:
            width = int(vis.max().item()) if T else 0
        if T == 0 or width == 0:
            empty = torch.full((T, s.topk), -1, dtype=torch.int32, device=positions.device)
            cand = None
            if publish_candidates:
                cand = torch.full((T, s.candidate_topk_blocks), -1, dtype=torch.int32, device=positions.device)
            return empty, cand
        q = self._queries(qr, positions, cos_sin_cache)
        w = self._head_weights(x)
        # the [tokens, width] fp32 logits are made a token chunk at a time (bounded scratch)
        step = max(1, self.max_logits_elems // width)
        tops, cands, kept = [], [], []
        for a in range(0, T, step):
            b = min(T, a + step)
            lg = self._logits(q[a:b], w[a:b], index_cache, block_table, token_to_req[a:b], vis[a:b], width)
            if self.keep_logits:
                kept.append(lg)
            if publish_candidates:
                cands.append(R.candidate_blocks_ref(lg, vis[a:b], s.candidate_topk_blocks,
                                                    s.candidate_block_size))
            if candidates is not None:
                lg = R.apply_candidates_ref(lg, candidates[a:b], s.candidate_block_size)
            tops.append(self.topk(lg, vis[a:b]))
        self.last_logits = torch.cat(kept) if self.keep_logits else None
        cand = torch.cat(cands) if publish_candidates else None
        return (tops[0] if len(tops) == 1 else torch.cat(tops)), cand

    def _check_select_args(self, x, qr, positions, cos_sin_cache, index_cache, block_table,
                           token_to_req, valid, width, candidates, publish_candidates) -> None:
        s, dev = self.spec, self._device
        T = _check_positions(positions, dev)
        _check_rows("x", x, s.hidden_size, dev, T)
        _check_rows("qr", qr, s.q_lora_rank, dev, T)
        _check_cos_sin_cache(cos_sin_cache, dev)
        self._check_index_cache(index_cache)
        check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndims=2, device=dev)
        _check_per_token("token_to_req", token_to_req, T, dev)
        _check_valid(valid, T, dev)
        if width is not None:
            check_int("width", width, lo=0)
        check_bool("publish_candidates", publish_candidates)
        if candidates is not None:
            check_tensor("candidates", candidates, dtypes=INT_DTYPES, ndims=2,
                         contiguous_last=False, device=dev)
            check_shape("candidates", candidates, (T, None))
        if publish_candidates:
            check_int("spec.candidate_topk_blocks", s.candidate_topk_blocks, lo=1)

    # ---- weights ----------------------------------------------------------------------------
    _ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "wq_b.weight": ("q_b_proj.weight",),
        "weights_proj.weight": ("scorer.weights_proj.weight",),
        "wk.weight": ("k_proj.weight",),
        "k_norm.weight": (),
    }

    def load(self, sd: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Load from DeepSeek names (``{prefix}wq_b.weight``, ``weights_proj.weight``,
        ``compressor.*`` / ``wk.weight``, ``k_norm.weight``) or transformers' (``q_b_proj``,
        ``scorer.weights_proj``, and the V4 compressor's ``kv_proj`` / ``gate_proj`` /
        ``position_bias`` / ``kv_norm`` directly under the indexer)."""
        for name, p in self.named_parameters():
            if name.startswith("compressor."):
                continue
            keys = (prefix + name,) + tuple(prefix + a for a in self._ALIASES.get(name, ()))
            t = next((sd[k] for k in keys if k in sd), None)
            if t is None:
                raise ValueError(f"state_dict: missing {' or '.join(keys)}")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"state_dict[{keys[0]!r}]: expected {tuple(p.shape)}, got {tuple(t.shape)}")
            with torch.no_grad():
                p.copy_(t.float())
        if self.compressor is not None:
            sub = prefix + "compressor."
            self.compressor.load(sd, sub if any(k.startswith(sub) for k in sd) else prefix)
