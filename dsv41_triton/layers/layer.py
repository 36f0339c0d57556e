"""The drop-in DeepSeek V4 / V4.1 sparse MLA attention layer.

``DeepseekV41Attention(config, layer_id, tp_rank=, tp_size=, backend=, fused=)`` holds one
tensor-parallel shard of the layer's weights (checkpoint names) and runs one step::

    qr, kv   = split(fused_wqa_wkv(x))                      # [T, q_lora], [T, 512]
    qr, kv   = q_norm(qr), kv_norm(kv)                      # RMSNorm with weight
    q        = wq_b(qr).view(T, H_local, 512)               # (V4: per-head RMSNorm, no weight)
    kv, q    = RoPE(kv), RoPE(q)  at each token's position  # dims 448..511 (GPT-J pairs)
    window cache   <- kv record at the token's slot          (quantize_and_insert_k_cache)
    compressed cache <- RoPE(compressed_kv) at (pos // r) * r, for tokens completing an entry
    o        = sparse attention over window + top-k compressed keys, with attn_sink
    o        = inverse RoPE(o);  z_g = wo_a_g(o of group g);  y = wo_b(z)   (+ all-reduce)

Attention goes through the selected backend (``dsv41_triton.backends``): decode tokens (first
``num_decode_tokens``) read the paged caches directly; so do prefill tokens with
``prefill_path="paged"`` (memory independent of the context: window and top-k keys as slot
ids, like decode tokens; with ``paged_window_rows``, where the backend supports
``sparse_mla_prefill_paged_window``, the default, only the chunk's window rows are gathered
into a small bf16 workspace, shared by consecutive tokens, and the top-k records read as slot
ids); with
``"workspace"`` prefill
requests are processed in chunks of at most 4 requests whose compressed and window keys are
gathered into a bf16 workspace (SPEC §5); ``"auto"`` (the default) picks one of the two per
chunk, by the workspace's size. On the bf16 workspace path the backend also gets each token's
window as a row range of it (``sparse_mla_prefill_shared_window``: the Triton backend loads a
window key once for a tile of consecutive tokens when there are at most 8 local heads). With
the fused
contract (``fused=True``, or ``"auto"`` picking FlashMLA's mega kernel) the backend RoPEs Q
itself and returns the MXFP8 pair after the inverse RoPE; the layer then declares
``accepts_unnormed_unroped_query`` and ``_o_proj`` consumes the pair. Mixed prefill + decode
steps write disjoint token ranges of one output buffer.

The interface mirrors vLLM's ``DeepseekV4Attention``: ``accepts_unnormed_unroped_query``,
``_alloc_attn_out``, ``forward_mqa(q, kv, positions, output)``, ``_o_proj(attn_out,
positions)``. Metadata and the indexer's top-k indices are passed to ``forward`` (or bound with
``set_step``) instead of a global forward context.

Tensor parallel: heads, ``wq_b`` rows, ``attn_sink``, ``wo_a`` groups and ``wo_b`` columns are
sharded (:func:`shard_attention_state_dict`); the KV caches and ``fused_wqa_wkv``/norms are
replicated. ``wo_b`` is row-parallel, so each rank returns a partial sum: pass
``process_group`` (``torch.distributed.all_reduce``) or an ``output_reduce`` callable, or sum
the ranks' outputs yourself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Union

import torch
import torch.nn as nn

from .._utils import HEAD_DIM, call_op, check_int, check_tensor
from ..backends import (AttentionBackend, Problem, Selection, get_backend, list_backends,
                        select_backend)
from ..backends import _custom_ops  # noqa: F401  (registers torch.ops.dsv41.backend_*)
from ..backends._custom_ops import step_cache_key
from ..backends.base import WV_GROUP_SIZE
from .compressed import build_compressed_block
from .config import DeepseekV41AttentionConfig, build_cos_sin_cache
from .metadata import StepMetadata, check_max_workspace_rows
from .weights import (
    EXTRA_PARAM_NAMES,
    PARAM_NAMES,
    canonicalize_attention_state_dict,
    check_tp,
    full_param_shapes,
    random_attention_state_dict,
    shard_attention_state_dict,
)

DEFAULT_MAX_MODEL_LEN = 131072
PREFILL_CHUNK_SIZE = 4
#: prefill paths: "paged" (top-k slot ids into the paged compressed cache, records dequantized
#: in the attention kernel; the window rows of the chunk's tokens only in a bf16 workspace, or
#: as slot ids too), "workspace" (gather + bf16 workspace, chunks of requests)
PREFILL_PATHS = ("paged", "workspace")
#: prefill_path="auto", per chunk of requests: the paged path when the chunk's workspace would
#: hold more than this many rows per chunk token and local head, else the workspace; with the
#: paged path's window rows gathered (``paged_window_rows``). The paged chunk takes about the same
#: time at every context, the workspace's grows with its rows. 2048 tokens x 8 heads, CUDA-graph
#: GPU time, paged vs workspace, us (perf/NOTES.md, "Session 35", the top-k records on the
#: fp16 dequant + S form with its softmax per warp): H100 261.6 / 263.9 / 298.7 vs 227.2 /
#: 261.5 / 561.6 at 8K / 128K / 1M context (4.3K / 35K / 264K rows), the workspace's time
#: growing ~1.3 ns a row past 35K and the paged one's ~0.15: the two meet near 37K rows, 2.3
#: rows per token and head. (Session 33: 2.9; session 28, the record kernel: 3.4; before the
#: few-heads kernel's faster copies, sessions 23 / 26: 1.6 on the H200, 1.0 on the H100.)
AUTO_PAGED_ROWS_PER_TOKEN_HEAD = 2.3
#: the same for the paged path with every key a slot id (``paged_window_rows = False``): H200
#: (perf/NOTES.md "Session 16"): the workspace costs ~0.6 ns per gathered row more, its
#: attention ~(3.5 x heads) rows' worth per token less than the paged kernel; at 8 heads and
#: 2048 tokens the workspace wins at 8K / 128K context, the paged path at 1M. Not re-measured
#: since the workspace path got faster (session 28); it stays above the window-rows value.
AUTO_PAGED_SLOT_ROWS_PER_TOKEN_HEAD = 4
#: the layer's default ``paged_window_rows``: whether the paged prefill gathers the chunk's
#: window rows into a small bf16 workspace (read once per tile of consecutive tokens) and reads
#: only the top-k records as slot ids (the backend's ``sparse_mla_prefill_paged_window``).
#: H200, 2048 tokens x 8 heads, CUDA graph (perf/NOTES.md, "Session 23"): 278.4 / 281.9 /
#: 292.4 us at 8K / 128K / 1M context against the slot-id path's 322.9 / 323.1 / 330.5, with
#: 6.3 MiB at every context.
PAGED_WINDOW_ROWS = True
#: the StepMetadata tensors the layer reads (checked to be on the layer's device)
_METADATA_TENSORS = ("positions", "query_start_loc", "seq_lens", "token_to_req", "is_valid_token",
                     "swa_block_table", "swa_slot_mapping", "decode_swa_indices",
                     "decode_swa_lens", "prefill_seq_lens", "prefill_gather_lens")


# --------------------------------------------------------------------------------------------
# the fused output pair
# --------------------------------------------------------------------------------------------
@dataclass
class MXFP8Activation:
    """The fused contract's output: ``data [T, G, 4096]`` e4m3 + ``scale [T, G, 32]`` int32
    (MN-major), what ``_o_proj`` consumes (vLLM's ``QuantizedActivation``)."""

    data: torch.Tensor
    scale: torch.Tensor
    layout: str = "standard"

    def token_slice(self, start: int, end: int) -> "MXFP8Activation":
        return MXFP8Activation(self.data[start:end], self.scale[start:end], self.layout)


AttnOut = Union[torch.Tensor, MXFP8Activation]


# --------------------------------------------------------------------------------------------
# small numerics
# --------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm in fp32, result in ``x.dtype`` (no weight: plain re-normalization)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a weight (fp32 math, output in the input dtype)."""

    def __init__(self, dim: int, eps: float, **kw):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class _Ops:
    """The cache/index/RoPE ops: the references for the torch backend (fast on CPU, no
    interpreter), the Triton kernels otherwise."""

    def __init__(self, reference: bool):
        self._reference = reference

    @property
    def reference(self) -> bool:
        # under torch.compile the public ops (torch.library custom ops; CPU tensors without the
        # interpreter run these same references behind them): the references themselves have
        # data-dependent shapes (boolean indexing), which would break the graph
        return self._reference and not torch.compiler.is_compiling()

    def rope(self, x, positions, cos_sin_cache, inverse=False):
        if self.reference:
            from ..ops.rope_ref import apply_rope_ref

            return apply_rope_ref(x, positions, cos_sin_cache, inverse=inverse)
        from ..ops.rope import apply_rope

        return apply_rope(x, positions, cos_sin_cache, inverse=inverse)

    def insert(self, k, cache, slots):
        if self.reference:
            from ..ops.kv_cache_ref import quantize_and_insert_k_cache_ref as f
        else:
            from ..ops.kv_cache import quantize_and_insert_k_cache as f
        f(k, cache, slots)

    def gather(self, *args):
        if self.reference:
            from ..ops.kv_cache_ref import dequantize_and_gather_k_cache_ref as f
        else:
            from ..ops.kv_cache import dequantize_and_gather_k_cache as f
        f(*args)

    def combine(self, *args):
        if self.reference:
            from ..ops.indices_ref import combine_topk_swa_indices_ref as f
        else:
            from ..ops.indices import combine_topk_swa_indices as f
        return f(*args)

    def global_topk(self, *args):
        if self.reference:
            from ..ops.indices_ref import compute_global_topk_indices_and_lens_ref as f
        else:
            from ..ops.indices import compute_global_topk_indices_and_lens as f
        return f(*args)

    def prefill_slots(self, *args):
        if self.reference:
            from ..ops.prefill_indices_ref import prefill_slot_indices_ref as f
        else:
            from ..ops.prefill_indices import prefill_slot_indices as f
        return f(*args)

    def prefill_window_slots(self, *args):
        if self.reference:
            from ..ops.prefill_indices_ref import prefill_window_slot_indices_ref as f
        else:
            from ..ops.prefill_indices import prefill_window_slot_indices as f
        return f(*args)


# --------------------------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------------------------
class DeepseekV41Attention(nn.Module):
    """One TP shard of a DeepSeek V4.1 attention layer (see the module docstring).

    Args:
        config: the model's :class:`DeepseekV41AttentionConfig`.
        layer_id: index of the layer (selects its compress ratio and RoPE type).
        tp_rank, tp_size: tensor-parallel position (heads and ``wo_a`` groups are split).
        backend: ``"auto"``, a backend name, or an :class:`AttentionBackend` instance.
        fused: ``False`` (bf16 attention output, inverse RoPE in ``_o_proj``), ``True`` (the
            fused contract: MXFP8 output pair), or ``"auto"`` (fused iff the dispatcher picks
            FlashMLA's mega kernel).
        layout: the fused contract's layout; ``"interleaved"`` permutes ``wq_b`` rows and
            ``wo_a`` columns at load so the GEMMs speak FlashMLA's chunk-interleaved layouts.
        swa_record, compressed_record: cache record widths (584 / 528 / 288). Default 584
            (528 when the mega kernel is used); the compressed record defaults to the window's.
        max_model_len: rows of the RoPE tables (positions must stay below it).
        process_group / output_reduce: how the row-parallel ``wo_b`` partial sums are reduced
            (neither: the caller sums the ranks' outputs).
        prefill_path: ``"paged"`` (prefill tokens read the paged caches like decode tokens:
            no workspace, memory independent of the context), ``"workspace"`` (gather +
            bf16 workspace in chunks of ``prefill_chunk_size`` requests) or ``"auto"`` (per
            chunk: paged when its workspace would be large for its tokens,
            :data:`AUTO_PAGED_ROWS_PER_TOKEN_HEAD` or, with ``paged_window_rows = False``,
            :data:`AUTO_PAGED_SLOT_ROWS_PER_TOKEN_HEAD`).
    """

    def __init__(
        self,
        config: DeepseekV41AttentionConfig,
        layer_id: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        backend: Union[str, AttentionBackend] = "auto",
        fused: Union[bool, str] = False,
        layout: str = "standard",
        swa_record: Optional[int] = None,
        compressed_record: Optional[int] = None,
        max_model_len: Optional[int] = None,
        device: Union[str, torch.device, None] = None,
        dtype: torch.dtype = torch.bfloat16,
        process_group=None,
        output_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        prefill_chunk_size: int = PREFILL_CHUNK_SIZE,
        prefill_path: str = "auto",
    ):
        super().__init__()
        if not isinstance(config, DeepseekV41AttentionConfig):
            raise TypeError(f"config: expected a DeepseekV41AttentionConfig, got {type(config).__name__}")
        check_int("layer_id", layer_id, lo=0)
        if fused not in (True, False, "auto"):
            raise ValueError(f"fused: expected True, False or 'auto', got {fused!r}")
        if layout not in ("standard", "interleaved"):
            raise ValueError(f"layout: expected 'standard' or 'interleaved', got {layout!r}")
        if layout == "interleaved" and fused is False:
            raise ValueError("layout: 'interleaved' is a layout of the fused contract; it needs "
                             "fused=True or 'auto'")
        self.config = config
        self.layer_id = layer_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.n_local_heads, self.n_local_groups = check_tp(config, tp_rank, tp_size)
        self.heads_per_group = config.heads_per_group
        self.compress_ratio = config.compress_ratio(layer_id)
        #: False on HCA layers: no indexer, they attend to every completed compressed entry
        self.has_indexer = config.has_indexer(layer_id)
        self.head_dim = config.head_dim
        self.window_size = config.sliding_window
        self.q_lora_rank, self.o_lora_rank = config.q_lora_rank, config.o_lora_rank
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5
        self.layout = layout
        self.process_group = process_group
        self.output_reduce = output_reduce
        self.prefill_chunk_size = check_int("prefill_chunk_size", prefill_chunk_size, lo=1)
        if prefill_path not in PREFILL_PATHS + ("auto",):
            raise ValueError(f"prefill_path: expected one of {PREFILL_PATHS + ('auto',)}, got "
                             f"{prefill_path!r}")
        self.prefill_path = prefill_path
        #: workspace prefill (bf16 path): pass the backend each token's window as a row range
        #: (``sparse_mla_prefill_shared_window``), so that it may load a window key once for
        #: consecutive tokens; False: the plain ``sparse_mla_prefill`` call
        self.share_window_keys = True
        #: paged prefill: the chunk's window rows from a small bf16 workspace, the top-k records
        #: as slot ids (where the backend supports it); False: both as slot ids
        self.paged_window_rows = PAGED_WINDOW_ROWS
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")

        self.selection, self.fused, self.swa_record, self.compressed_record = self._select(
            backend, fused, layout, swa_record, compressed_record, dev)
        self.backend: AttentionBackend = self.selection.backend
        if not self.fused:
            self.layout = "standard"  # fused="auto" fell back to the bf16 path
        self._ops = _Ops(reference=self.backend.name == "torch")
        # backends that share per-step state (FlashMLA's schedule) across the step's layers
        self._step_cache_ok = bool(getattr(self.backend, "accepts_step_cache", False))
        # asked once here: Dynamo would break the graph on a call into backends/
        self._backend_paged_window = self.backend.supports_paged_window(self.n_local_heads)
        # a registered backend is called through its torch.library op (the dispatcher stays
        # out of torch.compile's tracing); an unregistered instance directly
        self._backend_op = (self.backend.name if self.backend.name in list_backends()
                            and get_backend(self.backend.name) is self.backend else None)

        c = config
        D, Hl, Gl = self.head_dim, self.n_local_heads, self.n_local_groups
        kw = dict(device=dev, dtype=dtype)
        self.fused_wqa_wkv = nn.Linear(c.hidden_size, c.q_lora_rank + D, bias=False, **kw)
        self.q_norm = RMSNorm(c.q_lora_rank, self.eps, **kw)
        self.kv_norm = RMSNorm(D, self.eps, **kw)
        self.wq_b = nn.Linear(c.q_lora_rank, Hl * D, bias=False, **kw)
        self.wo_a = nn.Linear(self.heads_per_group * D, Gl * c.o_lora_rank, bias=False, **kw)
        self.wo_b = nn.Linear(Gl * c.o_lora_rank, c.hidden_size, bias=False, **kw)
        self.attn_sink = nn.Parameter(torch.full((Hl,), float("-inf"), device=dev),
                                      requires_grad=False)
        for p in self.parameters():
            p.requires_grad_(False)
        self._layouts_ready = self.layout == "standard"

        self.max_model_len = int(max_model_len or min(c.max_position_embeddings,
                                                      DEFAULT_MAX_MODEL_LEN))
        self.register_buffer("cos_sin_cache",
                             build_cos_sin_cache(c, self.compress_ratio, self.max_model_len, dev),
                             persistent=False)
        self.swa_cache: Optional[torch.Tensor] = None
        self.compressed_cache: Optional[torch.Tensor] = None
        self._step: Dict[str, object] = {}
        #: the compressor's / indexer's tensors from the last load (DeepSeek's names)
        self.extra_weights: Dict[str, torch.Tensor] = {}
        #: the compressor + indexer that compute compressed_kv / topk_indices when the caller
        #: passes neither (None: window-only layer, or an index shape the kernels do not take)
        self.compressed_block = build_compressed_block(config, layer_id, dev,
                                                       reference=self.backend.name == "torch")
        #: the selection the last forward used: [T, K] int32 local entry ids, -1 padded
        self.last_topk_indices: Optional[torch.Tensor] = None

    # ---- backend selection ------------------------------------------------------------------
    def _problems(self, fused: bool, layout: str, swa: int, extra: Optional[int], dev):
        Hl = self.n_local_heads
        k = ("decode_fused", "prefill_fused") if fused else ("decode", "prefill")
        return [Problem(k[0], Hl, dev, swa_record=swa, extra_record=extra, layout=layout),
                Problem(k[1], Hl, dev, layout=layout)]

    def _select(self, backend, fused, layout, swa_record, compressed_record, dev):
        r = self.compress_ratio

        def records(default_swa):
            swa = swa_record or default_swa
            extra = (compressed_record or swa) if r > 0 else None
            return swa, extra

        def topology(sel: Selection, fz: bool):
            if fz and self.heads_per_group != WV_GROUP_SIZE:
                raise ValueError(
                    f"layer {self.layer_id}: the fused contract ({sel.name}) needs "
                    f"{WV_GROUP_SIZE} heads per wo_a group; this config has "
                    f"{self.heads_per_group} (num_attention_heads / o_groups)")
            return sel

        def pick(name, fz, default_swa):
            swa, extra = records(default_swa)
            try:
                sel = select_backend(name, self._problems(fz, layout, swa, extra, dev))
            except RuntimeError as e:
                raise ValueError(
                    f"layer {self.layer_id} (tp_rank {self.tp_rank}/{self.tp_size}, "
                    f"{self.n_local_heads} local heads, ratio {r}): {e}") from e
            return sel, swa, extra

        if isinstance(backend, AttentionBackend):
            fz = bool(fused is True)
            swa, extra = records(584)
            for p in self._problems(fz, layout, swa, extra, dev):
                a = backend.probe(p)
                if not a.available:
                    raise ValueError(f"layer {self.layer_id}: backend {backend.name!r} cannot "
                                     f"serve {p.kind}: {a.reason}")
            return topology(Selection(backend.name, backend, "given instance"), fz), fz, swa, extra
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a name or an AttentionBackend, got {type(backend).__name__}")
        if fused == "auto":
            try:
                sel, swa, extra = pick(backend, True, 528)
                if sel.name == "flashmla_mega":
                    return topology(sel, True), True, swa, extra
            except ValueError:
                pass
            sel, swa, extra = pick(backend, False, 584)
            return sel, False, swa, extra
        default = 528 if (fused and backend == "flashmla_mega") else 584
        sel, swa, extra = pick(backend, bool(fused), default)
        return topology(sel, bool(fused)), bool(fused), swa, extra

    # ---- vLLM's attention-interface contract -------------------------------------------------
    @property
    def accepts_unnormed_unroped_query(self) -> bool:
        """True when the backend RoPEs (and, for V4, norms) Q itself: the fused contract."""
        return self.fused

    @classmethod
    def get_padded_num_q_heads(cls, num_heads: int) -> int:
        """Our buffers are never padded (backends that need 64/128 heads pad internally)."""
        return num_heads

    def _alloc_attn_out(self, num_tokens: int, hidden_states: torch.Tensor) -> AttnOut:
        """``[T, H_local, 512]`` bf16, or the MXFP8 pair of the fused contract."""
        if self.fused:
            from ..ops.mxfp8 import alloc_mxfp8_output

            data, scale = alloc_mxfp8_output(num_tokens, self.n_local_groups, hidden_states.device)
            return MXFP8Activation(data, scale, self.layout)
        return torch.empty((num_tokens, self.n_local_heads, self.head_dim),
                           dtype=torch.bfloat16, device=hidden_states.device)

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "",
                     sharded: bool = False) -> None:
        """Load checkpoint tensors (DeepSeek's, vLLM's or transformers' names, see
        :func:`canonicalize_attention_state_dict`). ``sharded=False``: the state dict holds the
        full layer and this rank's shard is cut from it; ``True``: it already is the shard.

        The compressor's and indexer's tensors, when present, are kept (replicated, DeepSeek's
        names) in :attr:`extra_weights` for the compressor / indexer that feed this layer."""
        sd = canonicalize_attention_state_dict(state_dict, prefix, self.wq_b.weight.dtype,
                                               extras=True)
        extra = {k: sd.pop(k) for k in EXTRA_PARAM_NAMES if k in sd}
        missing = [n for n in PARAM_NAMES if n not in sd]
        if missing:
            raise ValueError(f"state_dict: missing {', '.join(prefix + m for m in missing)}")
        self._check_extra_weights(extra, prefix)
        if not sharded:
            sd = shard_attention_state_dict(sd, self.config, self.tp_rank, self.tp_size)
        params = dict(self.named_parameters())
        for name in PARAM_NAMES:
            p, t = params[name], sd[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"state_dict[{prefix + name!r}]: expected shape "
                                 f"{tuple(p.shape)} for this shard, got {tuple(t.shape)}")
            with torch.no_grad():
                p.copy_(t.to(p.dtype))
        dev = self.wq_b.weight.device
        self.extra_weights = {k: v.to(dev) for k, v in extra.items()}
        if self.compressed_block is not None:
            self.compressed_block.load(self.extra_weights)
        self._layouts_ready = self.layout == "standard"
        self.finalize_loaded_weights()

    def _check_extra_weights(self, extra: Mapping[str, torch.Tensor], prefix: str) -> None:
        """The compressor / indexer tensors must belong to this layer type: none on a
        window-only layer; ``ape`` rows equal to the compress ratio; input width ``hidden``."""
        r = self.compress_ratio
        if r == 0 and extra:
            raise ValueError(f"state_dict: {prefix}{next(iter(extra))} belongs to a compressor, "
                             f"but layer {self.layer_id} is window-only (ratio 0)")
        for name, t in extra.items():
            if name.endswith("ape") and t.shape[0] != r:
                raise ValueError(f"state_dict[{prefix + name!r}]: {t.shape[0]} rows, the layer's "
                                 f"compress ratio is {r}")
            if name.endswith(("wkv.weight", "wgate.weight", "weights_proj.weight")) and \
                    t.shape[-1] != self.config.hidden_size:
                raise ValueError(f"state_dict[{prefix + name!r}]: input width {t.shape[-1]}, "
                                 f"hidden_size is {self.config.hidden_size}")

    def init_random_weights(self, seed: int = 0) -> None:
        """Random weights (the ``tp_rank`` shard of :func:`random_attention_state_dict`)."""
        self.load_weights(random_attention_state_dict(self.config, seed=seed))

    def finalize_loaded_weights(self) -> None:
        """Permute ``wq_b`` rows / ``wo_a`` columns into the interleaved layouts (idempotent)."""
        if self._layouts_ready:
            return
        from ..ops.layouts import permute_wo_a, permute_wq_b

        with torch.no_grad():
            self.wq_b.weight.copy_(permute_wq_b(self.wq_b.weight, self.n_local_heads))
            self.wo_a.weight.copy_(permute_wo_a(self.wo_a.weight))
        self._layouts_ready = True

    # ---- caches -----------------------------------------------------------------------------
    def allocate_kv_caches(self, num_blocks: int, page_size: int,
                           compressed_num_blocks: Optional[int] = None,
                           compressed_page_size: Optional[int] = None) -> None:
        """Allocate (random bytes: never-written slots are garbage, not zeros) and bind the
        window cache and, for a compressed layer, its compressed cache."""
        from ..ops.records import allocate_k_cache

        dev = self.wq_b.weight.device
        swa = allocate_k_cache(num_blocks, page_size, self.swa_record, dev)
        comp = None
        if self.compress_ratio > 0:
            comp = allocate_k_cache(compressed_num_blocks or num_blocks,
                                    compressed_page_size or page_size, self.compressed_record, dev)
        self.bind_kv_caches(swa, comp)
        if self.compressed_block is not None:
            self.compressed_block.allocate(num_blocks, page_size, compressed_num_blocks or num_blocks,
                                           compressed_page_size or page_size)

    def bind_kv_caches(self, swa_cache: torch.Tensor,
                       compressed_cache: Optional[torch.Tensor] = None) -> None:
        from ..ops.records import check_k_cache

        fmt, _ = check_k_cache("swa_cache", swa_cache)
        if fmt.record_bytes != self.swa_record:
            raise ValueError(f"swa_cache: this layer writes {self.swa_record}-byte records, "
                             f"the cache holds {fmt.record_bytes}")
        if self.compress_ratio > 0:
            if compressed_cache is None:
                raise ValueError(f"compressed_cache: required for a ratio-{self.compress_ratio} layer")
            cfmt, _ = check_k_cache("compressed_cache", compressed_cache)
            if cfmt.record_bytes != self.compressed_record:
                raise ValueError(f"compressed_cache: expected {self.compressed_record}-byte "
                                 f"records, got {cfmt.record_bytes}")
        self.swa_cache = swa_cache.squeeze(2) if swa_cache.dim() == 4 else swa_cache
        if compressed_cache is not None and compressed_cache.dim() == 4:
            compressed_cache = compressed_cache.squeeze(2)
        self.compressed_cache = compressed_cache

    # ---- one step ---------------------------------------------------------------------------
    def set_step(self, metadata: StepMetadata, topk_indices: Optional[torch.Tensor] = None,
                 compressed_kv: Optional[torch.Tensor] = None) -> None:
        """Bind the step's metadata, top-k indices and compressed KV for calls that do not pass
        them (vLLM's forward-context style: ``layer(positions, hidden_states)``)."""
        self._step = {"metadata": metadata, "topk_indices": topk_indices,
                      "compressed_kv": compressed_kv}

    def _topk_rows(self, md: StepMetadata, topk_indices: Optional[torch.Tensor]):
        """The given rows, else the bound ones, else (HCA layer) every completed entry."""
        if topk_indices is None:
            topk_indices = self._step.get("topk_indices")
        if topk_indices is None and self.compress_ratio > 0 and not self.has_indexer:
            topk_indices = md.all_entries_topk(self.compress_ratio)
        return topk_indices

    def _check_step(self, md: StepMetadata, T: int, topk_indices, compressed_kv) -> None:
        """Everything about the step that can be checked without reading device values (the
        metadata's host fields, shapes, dtypes, devices), before anything is written."""
        if not isinstance(md, StepMetadata):
            raise TypeError(f"metadata: expected a StepMetadata, got {type(md).__name__}")
        check_int("metadata.prefill_chunk_size", md.prefill_chunk_size, lo=1)
        check_max_workspace_rows(md.max_workspace_rows, "metadata.max_workspace_rows")
        if md.num_tokens != T:
            raise ValueError(f"hidden_states: {T} tokens, metadata describes {md.num_tokens}")
        if md.window_size != self.window_size:
            raise ValueError(f"metadata: window {md.window_size}, the layer's is {self.window_size}")
        if md.max_position >= self.max_model_len:
            raise ValueError(f"metadata: position {md.max_position} is past max_model_len "
                             f"{self.max_model_len} (the RoPE table)")
        if self.swa_cache is None:
            raise RuntimeError("no KV cache bound: call allocate_kv_caches or bind_kv_caches")
        if md.swa_page_size != self.swa_cache.shape[1]:
            raise ValueError(f"metadata: window page size {md.swa_page_size}, the cache's is "
                             f"{self.swa_cache.shape[1]}")
        dev = self.swa_cache.device
        r = self.compress_ratio
        cm = None
        if r > 0:
            if r not in md.compressed:
                raise ValueError(f"metadata: no compressed block tables for ratio {r}")
            cm = md.compressed[r]
            if cm.page_size != self.compressed_cache.shape[1]:
                raise ValueError(f"metadata: compressed page size {cm.page_size}, "
                                 f"the cache's is {self.compressed_cache.shape[1]}")
        self._check_step_devices(md, cm, dev)
        # block ids against the bound caches: host ints recorded by build_step_metadata (no
        # device read); an id past the cache would make the layer read unwritten workspace rows
        nb = self.swa_cache.shape[0]
        if md.swa_max_block_id is not None and md.swa_max_block_id >= nb:
            raise ValueError(f"metadata: the window block tables hold block id "
                             f"{md.swa_max_block_id}, the bound window cache (swa_cache) has "
                             f"{nb} blocks (ids 0..{nb - 1})")
        if cm is not None and cm.max_block_id is not None:
            nc = self.compressed_cache.shape[0]
            if cm.max_block_id >= nc:
                raise ValueError(f"metadata: the ratio-{r} compressed block tables hold block id "
                                 f"{cm.max_block_id}, the bound compressed cache "
                                 f"(compressed_cache) has {nc} blocks (ids 0..{nc - 1})")
        if r == 0:
            # nothing of a window-only layer reads them: a caller passing them has mixed up
            # its layers
            for name, v in (("topk_indices", topk_indices), ("compressed_kv", compressed_kv)):
                if v is not None:
                    raise ValueError(f"{name}: layer {self.layer_id} is window-only (compress "
                                     f"ratio 0) and does not use {name}; pass None (given or "
                                     "bound by set_step)")
            return
        if T > 0:
            if topk_indices is None:
                raise ValueError(f"topk_indices: required for a ratio-{r} layer with an "
                                 "indexer (only HCA layers build their own rows)")
            check_tensor("topk_indices", topk_indices, dtypes=(torch.int32,), ndims=2,
                         device=dev)
            if topk_indices.shape[0] != T:
                raise ValueError(f"topk_indices: expected {T} rows, got {topk_indices.shape[0]}")
            k = self.config.index_topk
            if self.has_indexer and topk_indices.shape[1] > k:
                raise ValueError(f"topk_indices: {topk_indices.shape[1]} columns; the layer's "
                                 f"indexer selects at most index_topk = {k} entries per token")
        if compressed_kv is not None:
            check_tensor("compressed_kv", compressed_kv, dtypes=(torch.bfloat16,), ndims=2,
                         last_dim=HEAD_DIM, device=dev)
            if compressed_kv.shape[0] != T:
                raise ValueError(f"compressed_kv: expected {T} rows, got {compressed_kv.shape[0]}")

    @staticmethod
    def _check_step_devices(md: StepMetadata, cm, dev: torch.device) -> None:
        """The metadata's tensors must be where the layer (its caches) is."""
        for name in _METADATA_TENSORS:
            t = getattr(md, name)
            if t.device != dev:
                raise ValueError(f"metadata: {name} is on {t.device}, the layer on {dev}; build "
                                 f"the step metadata with device={str(dev)!r}")
        if cm is not None:
            for name in ("block_table", "slot_mapping"):
                t = getattr(cm, name)
                if t.device != dev:
                    raise ValueError(f"metadata: compressed[{cm.ratio}].{name} is on {t.device}, "
                                     f"the layer on {dev}; build the step metadata with "
                                     f"device={str(dev)!r}")

    def _check_positions(self, positions, T) -> None:
        """Caller-given positions: ``[T]`` int and inside the RoPE table ``[0, max_model_len)``
        (a position past it would silently not be rotated). The bound needs the values: one
        device-to-host read, skipped while compiling or capturing a CUDA graph (there the
        metadata's positions, checked on the host, are the ones to pass)."""
        check_tensor("positions", positions, dtypes=(torch.int32, torch.int64), ndims=1,
                     contiguous_last=False, device=self.swa_cache.device)
        if positions.shape[0] != T:
            raise ValueError(f"positions: expected {T} entries, got {positions.shape[0]}")
        if (T == 0 or torch.compiler.is_compiling()
                or (positions.is_cuda and torch.cuda.is_current_stream_capturing())):
            return
        lo, hi = (int(v) for v in torch.aminmax(positions))
        if lo < 0 or hi >= self.max_model_len:
            bad = lo if lo < 0 else hi
            raise ValueError(f"positions: position {bad} is outside the RoPE table "
                             f"[0, {self.max_model_len}) (max_model_len)")

    def forward(
        self,
        positions: Optional[torch.Tensor],
        hidden_states: torch.Tensor,
        metadata: Optional[StepMetadata] = None,
        *,
        compressed_kv: Optional[torch.Tensor] = None,
        topk_indices: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """One step: ``hidden_states [T, hidden]`` bf16 -> ``[T, hidden]`` (this rank's partial
        sum unless a reduction is configured).

        compressed_kv: ``[T, 512]`` bf16 compressor output (pre-RoPE); the rows of tokens that
            complete a compressed entry are RoPE'd at the entry's first position and inserted
            (None: nothing inserted, e.g. a layer sharing another layer's compressed cache).
        topk_indices: ``[T, K]`` int32 local compressed-entry indices from the indexer (``-1``
            padded), ``K <= config.index_topk``; required by compressed layers with an indexer.
            HCA layers (ratio in ``config.hca_ratios``) given none attend to every completed
            entry (:meth:`StepMetadata.all_entries_topk`; any ``K`` when given).
            A window-only layer (ratio 0) takes neither (``ValueError``).

        Everything is checked before anything is written (``ValueError`` / ``TypeError``
        naming the argument), from host data only: the metadata's tensors must be on the
        layer's device, its block ids (as recorded by :func:`build_step_metadata`) inside the
        bound caches, its positions below ``max_model_len``.

        Given neither, a layer whose :attr:`compressed_block` is ready (its compressor /
        indexer weights loaded, caches allocated; V4.1 sharing wired by
        :func:`~dsv41_triton.layers.compressed.link_layers`) computes both itself. The rows
        used are kept in :attr:`last_topk_indices`.
        """
        attn_out = self.compute_attention(positions, hidden_states, metadata,
                                          compressed_kv=compressed_kv, topk_indices=topk_indices)
        md = metadata if metadata is not None else self._step.get("metadata")
        return self._o_proj(attn_out, md.positions if positions is None else positions)

    def compute_attention(
        self,
        positions: Optional[torch.Tensor],
        hidden_states: torch.Tensor,
        metadata: Optional[StepMetadata] = None,
        *,
        compressed_kv: Optional[torch.Tensor] = None,
        topk_indices: Optional[torch.Tensor] = None,
    ) -> AttnOut:
        """Everything up to (not including) the output projection: returns the buffer of
        ``_alloc_attn_out`` filled by ``forward_mqa``."""
        md = metadata if metadata is not None else self._step.get("metadata")
        if md is None:
            raise ValueError("metadata: pass the step's StepMetadata (or set_step it first)")
        if not isinstance(md, StepMetadata):
            raise TypeError(f"metadata: expected a StepMetadata, got {type(md).__name__}")
        if compressed_kv is None:
            compressed_kv = self._step.get("compressed_kv")
        blk = self.compressed_block
        auto = (blk is not None and compressed_kv is None and topk_indices is None
                and self._step.get("topk_indices") is None and blk.ready)
        topk_indices = self._topk_rows(md, topk_indices)
        check_tensor("hidden_states", hidden_states, dtypes=(torch.bfloat16,), ndims=2,
                     last_dim=self.config.hidden_size, device=self.wq_b.weight.device)
        T = hidden_states.shape[0]
        # auto: the block computes the rows below; check the rest of the step now
        pending = torch.empty((T, 1), dtype=torch.int32, device=hidden_states.device)
        self._check_step(md, T, pending if auto else topk_indices, compressed_kv)
        if not self._layouts_ready:
            raise RuntimeError("wq_b / wo_a were never permuted for the interleaved layout: "
                               "load weights (load_weights / finalize_loaded_weights) first")
        if positions is None or positions is md.positions:
            positions = md.positions  # bounded by md.max_position (checked in _check_step)
        else:
            self._check_positions(positions, T)
        attn_out = self._alloc_attn_out(T, hidden_states)

        qr_kv = self.fused_wqa_wkv(hidden_states)
        qr, kv = qr_kv.split([self.q_lora_rank, self.head_dim], dim=-1)
        qr, kv = self.q_norm(qr), self.kv_norm(kv)
        if auto:
            compressed_kv, topk_indices = blk(hidden_states, qr, positions, md, self.cos_sin_cache)
        self.last_topk_indices = topk_indices
        q = self.wq_b(qr).view(T, self.n_local_heads, self.head_dim)
        if not self.accepts_unnormed_unroped_query:
            if self.config.q_head_norm:
                q = rms_norm(q, None, self.eps)
            q = self._ops.rope(q, positions, self.cos_sin_cache)
        self._insert_kv(kv, positions, md, compressed_kv)
        self.forward_mqa(q, kv, positions, attn_out, metadata=md, topk_indices=topk_indices)
        return attn_out

    def _insert_kv(self, kv, positions, md: StepMetadata, compressed_kv) -> None:
        T = kv.shape[0]
        if T == 0:
            return
        kv_r = self._ops.rope(kv.view(T, 1, self.head_dim), positions, self.cos_sin_cache)
        self._ops.insert(kv_r.view(T, self.head_dim), self.swa_cache, md.swa_slot_mapping)
        r = self.compress_ratio
        if r > 0 and compressed_kv is not None:
            cpos = torch.div(positions, r, rounding_mode="floor") * r
            ck = self._ops.rope(compressed_kv.view(T, 1, self.head_dim), cpos, self.cos_sin_cache)
            self._ops.insert(ck.view(T, self.head_dim), self.compressed_cache,
                             md.compressed[r].slot_mapping)

    # ---- attention --------------------------------------------------------------------------
    def forward_mqa(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor,
                    output: AttnOut, *, metadata: Optional[StepMetadata] = None,
                    topk_indices: Optional[torch.Tensor] = None) -> None:
        """Sparse MLA attention of the step into ``output`` (decode tokens first, then the
        prefill chunks; each writes its own token range). ``q`` is RoPE'd unless
        ``accepts_unnormed_unroped_query``; ``kv`` is unused (it was inserted already)."""
        del kv
        md = metadata if metadata is not None else self._step.get("metadata")
        if md is None:
            raise ValueError("metadata: pass the step's StepMetadata (or set_step it first)")
        topk_indices = self._topk_rows(md, topk_indices)
        Td = md.num_decode_tokens
        if md.num_prefills > 0:
            self._forward_prefill(q, positions, output, md, topk_indices)
        if Td > 0:
            self._forward_decode(q[:Td], positions[:Td], output, md, topk_indices)

    def _sink(self):
        return self.attn_sink

    def _write(self, output: AttnOut, start: int, end: int, res) -> None:
        """Make sure a fused backend's ``(data, scale, lse)`` landed in the step's output pair:
        backends write into the token slices they were given; one that returned other tensors
        is copied."""
        for got, dst in ((res[0], output.data[start:end]), (res[1], output.scale[start:end])):
            if got.data_ptr() != dst.data_ptr() or got.stride() != dst.stride():
                dst.copy_(got)

    def _forward_decode(self, q, positions, output: AttnOut, md: StepMetadata, topk_indices):
        Td = q.shape[0]
        extra = (None, None, None)
        r = self.compress_ratio
        if r > 0:
            cm = md.compressed[r]
            gidx, glens = self._ops.global_topk(
                topk_indices[:Td], md.token_to_req[:Td], cm.block_table[:md.num_decodes],
                cm.page_size, md.is_valid_token[:Td])
            extra = (self.compressed_cache, gidx, glens)
        self._attend_paged(q, positions, md.decode_swa_indices, md.decode_swa_lens, extra,
                           output, 0, Td, md, step_cache=self._step_cache_ok)

    def _attend_paged(self, q, positions, si, sl, extra, output: AttnOut, a: int, b: int,
                      md: StepMetadata, step_cache: bool = False) -> None:
        """Tokens ``a:b`` (``q`` already sliced) over the paged caches through the backend: its
        torch.library op when it is registered (keeps the dispatcher out of torch.compile's
        tracing), else the method."""
        q_norm_eps = self.eps if self.config.q_head_norm else None
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if self.fused and self._backend_op is not None:
            call_op(_custom_ops.backend_sparse_mla_decode_fused,
                self._backend_op, q, positions, self.cos_sin_cache, self.swa_cache, si, sl,
                *extra, self._sink(), self.scale, q_norm_eps, self.layout, output.data[a:b],
                output.scale[a:b], lse)
        elif self.fused:
            res = self.backend.sparse_mla_decode_fused(
                q, positions, self.cos_sin_cache, self.swa_cache, si, sl, *extra,
                attn_sink=self._sink(), softmax_scale=self.scale, q_norm_eps=q_norm_eps,
                layout=self.layout, data=output.data[a:b], scale=output.scale[a:b])
            self._write(output, a, b, res)
        elif self._backend_op is not None:
            # a compiled forward cannot register the step's dict (Dynamo skips backends/):
            # there the backend keeps its schedule per shape instead of per step
            key = (step_cache_key(md.backend_cache)
                   if step_cache and not torch.compiler.is_compiling() else -1)
            call_op(_custom_ops.backend_sparse_mla_decode,
                self._backend_op, q, self.swa_cache, si, sl, *extra, self._sink(), self.scale,
                key, output[a:b], lse)
        else:
            kw = {"step_cache": md.backend_cache} if step_cache else {}
            self.backend.sparse_mla_decode(
                q, self.swa_cache, si, sl, *extra, attn_sink=self._sink(),
                softmax_scale=self.scale, out=output[a:b], **kw)

    def _attend_workspace(self, q, positions, kv, idx, lens, output: AttnOut, a: int,
                          b: int, window=None) -> None:
        """Tokens ``a:b`` (``q`` already sliced) over a bf16 workspace, as ``_attend_paged``;
        ``window``: ``(window_rows [3, b - a], query_start_loc)``, the key-sharing hint of the
        bf16 path (the fused contract has none)."""
        q_norm_eps = self.eps if self.config.q_head_norm else None
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if self.fused and self._backend_op is not None:
            call_op(_custom_ops.backend_sparse_mla_prefill_fused,
                self._backend_op, q, positions, self.cos_sin_cache, kv, idx, lens,
                self._sink(), self.scale, q_norm_eps, self.layout, output.data[a:b],
                output.scale[a:b], lse)
        elif self.fused:
            res = self.backend.sparse_mla_prefill_fused(
                q, positions, self.cos_sin_cache, kv, idx, lens, attn_sink=self._sink(),
                softmax_scale=self.scale, q_norm_eps=q_norm_eps, layout=self.layout,
                data=output.data[a:b], scale=output.scale[a:b])
            self._write(output, a, b, res)
        elif window is not None and self._backend_op is not None:
            call_op(_custom_ops.backend_sparse_mla_prefill_shared_window,
                self._backend_op, q, kv, idx, lens, window[0], window[1], self._sink(),
                self.scale, output[a:b], lse)
        elif window is not None:
            self.backend.sparse_mla_prefill_shared_window(
                q, kv, idx, lens, window[0], window[1], attn_sink=self._sink(),
                softmax_scale=self.scale, out=output[a:b])
        elif self._backend_op is not None:
            call_op(_custom_ops.backend_sparse_mla_prefill,
                self._backend_op, q, kv, idx, lens, self._sink(), self.scale, output[a:b], lse)
        else:
            self.backend.sparse_mla_prefill(q, kv, idx, lens, attn_sink=self._sink(),
                                            softmax_scale=self.scale, out=output[a:b])

    def _forward_prefill_paged(self, q, positions, output: AttnOut, md: StepMetadata,
                               topk_indices, a: int, b: int):
        """Prefill tokens ``a:b`` at once, as decode tokens over the paged caches: their window
        and top-k entries as slot ids (the workspace path's keys), no workspace."""
        r = self.compress_ratio
        if b == a:
            return
        cm = md.compressed[r] if r > 0 else None
        si, sl, ei, el = self._ops.prefill_slots(
            positions[a:b], md.token_to_req[a:b], md.seq_lens, md.swa_block_table,
            md.swa_page_size, self.window_size, topk_indices[a:b] if r > 0 else None,
            cm.block_table if r > 0 else None, cm.page_size if r > 0 else 1, r)
        extra = (self.compressed_cache, ei, el) if r > 0 else (None, None, None)
        self._attend_paged(q[a:b], positions[a:b], si, sl, extra, output, a, b, md)

    def _paged_window(self) -> bool:
        """Whether the paged prefill takes its window keys from a small bf16 workspace of the
        chunk's window rows (shared by consecutive tokens) and only the top-k keys as slot
        ids (the backend's ``sparse_mla_prefill_paged_window``)."""
        return self.paged_window_rows and not self.fused and self._backend_paged_window

    def _forward_prefill_paged_window(self, q, positions, output: AttnOut, md: StepMetadata,
                                      topk_indices, ch) -> None:
        """The chunk ``ch``'s tokens over the paged caches, their window rows gathered into a
        ``[requests, max gather_len, 512]`` bf16 workspace (memory independent of the context)
        and read once per tile of consecutive tokens, their top-k entries as slot ids."""
        r = self.compress_ratio
        a, b = ch.tok_start, ch.tok_end
        nreq = ch.req_end - ch.req_start
        pr = slice(ch.req_start - md.num_decodes, ch.req_end - md.num_decodes)
        seq = md.prefill_seq_lens[pr]
        glen = md.prefill_gather_lens[pr]
        G = ch.M - ch.N
        dev = q.device
        ws = torch.empty((nreq, G, self.head_dim), dtype=torch.bfloat16, device=dev)
        self._ops.gather(ws, self.swa_cache, seq, glen,
                         md.swa_block_table[ch.req_start:ch.req_end], md.swa_page_size, 0)
        # both the index op and the tiles count tokens from query_start_loc[0]
        qsl = md.query_start_loc[ch.req_start:ch.req_end + 1]
        kv = ws.view(-1, self.head_dim)
        if r == 0:
            win = torch.empty((3, b - a), dtype=torch.int32, device=dev)
            # compress ratio 0, top-k 0: only the window (its top-k argument is not read)
            idx, lens = self._ops.combine(positions[a:b, None], qsl, seq, glen,
                                          self.window_size, 0, 0, G, 0, None, win)
            self._attend_workspace(q[a:b], positions[a:b], kv, idx, lens, output, a, b,
                                   (win, qsl))
            return
        cm = md.compressed[r]
        # one launch: the window row ranges of ws and the top-k slot ids
        win, ei, el = self._ops.prefill_window_slots(
            positions[a:b], md.token_to_req[a:b], md.seq_lens, glen, ch.req_start, G,
            self.window_size, topk_indices[a:b], cm.block_table, cm.page_size, r)
        qa = q[a:b]
        lse = torch.empty(qa.shape[:2], dtype=torch.float32, device=dev)
        if self._backend_op is not None:
            call_op(_custom_ops.backend_sparse_mla_prefill_paged_window,
                self._backend_op, qa, kv, win, qsl, self.compressed_cache, ei, el,
                self._sink(), self.scale, output[a:b], lse)
        else:
            self.backend.sparse_mla_prefill_paged_window(
                qa, kv, win, qsl, self.compressed_cache, ei, el, attn_sink=self._sink(),
                softmax_scale=self.scale, out=output[a:b])

    def _forward_prefill(self, q, positions, output: AttnOut, md: StepMetadata, topk_indices):
        paged_window = self._paged_window()
        if self.prefill_path == "paged" and not paged_window:
            return self._forward_prefill_paged(q, positions, output, md, topk_indices,
                                               md.num_decode_tokens, md.num_tokens)
        r = self.compress_ratio
        nd = md.num_decodes
        dev = q.device
        for ch in md.chunk_plan(r):
            nreq = ch.req_end - ch.req_start
            a, b = ch.tok_start, ch.tok_end
            if b == a:
                continue
            if self.prefill_path == "paged" or (self.prefill_path == "auto"
                                                and self.prefers_paged(nreq * ch.M, b - a)):
                if paged_window:
                    self._forward_prefill_paged_window(q, positions, output, md, topk_indices,
                                                       ch)
                else:
                    self._forward_prefill_paged(q, positions, output, md, topk_indices, a, b)
                continue
            pr = slice(ch.req_start - nd, ch.req_end - nd)
            seq = md.prefill_seq_lens[pr]
            glen = md.prefill_gather_lens[pr]
            ws = torch.empty((nreq, ch.M, self.head_dim), dtype=torch.bfloat16, device=dev)
            if r > 0:
                cm = md.compressed[r]
                self._ops.gather(ws, self.compressed_cache,
                                 torch.div(seq, r, rounding_mode="floor").to(torch.int32), None,
                                 cm.block_table[ch.req_start:ch.req_end], cm.page_size, 0)
                tk = topk_indices[a:b]
                topk = tk.shape[1]
            else:
                tk = torch.full((b - a, 1), -1, dtype=torch.int32, device=dev)
                topk = 0
            self._ops.gather(ws, self.swa_cache, seq, glen,
                             md.swa_block_table[ch.req_start:ch.req_end], md.swa_page_size, ch.N)
            qsl = md.query_start_loc[ch.req_start:ch.req_end + 1]
            qsl = qsl - qsl[0]
            win = None
            if self.share_window_keys and not self.fused:
                win = torch.empty((3, b - a), dtype=torch.int32, device=dev)
            idx, lens = self._ops.combine(tk, qsl, seq, glen, self.window_size, r, topk, ch.M,
                                          ch.N, None, win)
            kv = ws.view(-1, self.head_dim)
            self._attend_workspace(q[a:b], positions[a:b], kv, idx, lens, output, a, b,
                                   None if win is None else (win, qsl))

    def prefers_paged(self, workspace_rows: int, tokens: int) -> bool:
        """What ``prefill_path="auto"`` picks for a chunk of ``tokens`` query tokens whose
        workspace would hold ``workspace_rows`` rows: True for the paged path."""
        per = (AUTO_PAGED_ROWS_PER_TOKEN_HEAD if self._paged_window()
               else AUTO_PAGED_SLOT_ROWS_PER_TOKEN_HEAD)
        return workspace_rows > per * self.n_local_heads * tokens

    # ---- output projection ------------------------------------------------------------------
    def _group_proj(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, G_local, heads_per_group*512]`` -> ``z [T, G_local * o_lora]`` through each
        group's slice of ``wo_a``."""
        T, G, K = x.shape
        w = self.wo_a.weight.view(G, self.o_lora_rank, K)
        z = torch.bmm(x.transpose(0, 1).to(w.dtype), w.transpose(1, 2))  # [G, T, o_lora]
        return z.transpose(0, 1).reshape(T, G * self.o_lora_rank)

    def _o_proj(self, attn_out: AttnOut, positions: torch.Tensor) -> torch.Tensor:
        """Grouped ``wo_a`` then ``wo_b`` (then the TP reduction if configured). A bf16 buffer
        gets its inverse RoPE here; the MXFP8 pair already had it in the kernel."""
        if isinstance(attn_out, MXFP8Activation):
            from ..ops.mxfp8 import mxfp8_dequantize

            x = mxfp8_dequantize(attn_out.data, attn_out.scale).to(torch.bfloat16)
        else:
            T = attn_out.shape[0]
            o = self._ops.rope(attn_out, positions, self.cos_sin_cache, inverse=True)
            x = o.reshape(T, self.n_local_groups, self.heads_per_group * self.head_dim)
        y = self.wo_b(self._group_proj(x))
        return self._reduce(y)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The explicit all-reduce point of the row-parallel ``wo_b``."""
        if self.output_reduce is not None:
            return self.output_reduce(y)
        if self.process_group is not None and self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(y, group=self.process_group)
        return y

    def extra_repr(self) -> str:
        return (f"layer_id={self.layer_id}, ratio={self.compress_ratio}, "
                f"heads={self.n_local_heads}/{self.config.num_attention_heads}, "
                f"tp={self.tp_rank}/{self.tp_size}, backend={self.selection.name}, "
                f"fused={self.fused}, layout={self.layout}, records={self.swa_record}/"
                f"{self.compressed_record}")


__all__ = [
    "DeepseekV41Attention",
    "MXFP8Activation",
    "PARAM_NAMES",
    "RMSNorm",
    "canonicalize_attention_state_dict",
    "check_tp",
    "full_param_shapes",
    "random_attention_state_dict",
    "rms_norm",
    "shard_attention_state_dict",
]
