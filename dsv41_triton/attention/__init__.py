"""Sparse MLA attention (SPEC §3, §6): Triton kernels, float64 references, the fused ("mega")
contract, and the drop-in V4.1 attention layer.

- ``sparse_mla_decode`` / ``sparse_mla_prefill``: Triton kernels (``decode.py``, ``prefill.py``,
  one kernel in ``_sparse_kernel.py``, launched by ``_launch.py``); references in ``ref.py``.
- ``sparse_mla_decode_fused`` / ``sparse_mla_prefill_fused``: FlashMLA's fused-op argument order
  (q norm + RoPE -> attention -> inverse RoPE -> MXFP8 pair); reference in ``fused_ref.py``.
- ``DeepseekV41Attention`` (``layer.py``) with its config (``config.py``) and the step metadata
  builder (``metadata.py``).
- Tensor parallel under ``torch.distributed`` (``distributed.py``: torchrun init, the rank's
  layer, TP=N vs TP=1 check) and synthetic serving steps (``scenario.py``).
"""
from .decode import sparse_mla_decode
from .prefill import sparse_mla_prefill
from .ref import sparse_mla_decode_ref, sparse_mla_prefill_ref
from .fused import check_fused_output, q_norm_rope, sparse_mla_decode_fused, sparse_mla_prefill_fused
from .fused_ref import (
    fused_epilogue_ref,
    q_norm_rope_ref,
    sparse_mla_decode_fused_ref,
    sparse_mla_prefill_fused_ref,
)
from .config import DeepseekV41AttentionConfig, build_cos_sin_cache
from .metadata import PrefillChunk, RequestSpec, StepMetadata, build_step_metadata
from .layer import (
    DeepseekV41Attention,
    MXFP8Activation,
    canonicalize_attention_state_dict,
    random_attention_state_dict,
    shard_attention_state_dict,
)
from .scenario import Scenario, ScenarioStep
from .distributed import (
    TPContext,
    build_tp_layer,
    check_tp_against_tp1,
    init_tp_from_env,
    launch_local,
    run_step,
    shutdown_tp,
)

__all__ = [
    "sparse_mla_decode", "sparse_mla_prefill", "sparse_mla_decode_ref", "sparse_mla_prefill_ref",
    "sparse_mla_decode_fused", "sparse_mla_prefill_fused", "q_norm_rope", "check_fused_output",
    "sparse_mla_decode_fused_ref", "sparse_mla_prefill_fused_ref", "q_norm_rope_ref",
    "fused_epilogue_ref",
    "DeepseekV41AttentionConfig", "build_cos_sin_cache",
    "RequestSpec", "StepMetadata", "PrefillChunk", "build_step_metadata",
    "DeepseekV41Attention", "MXFP8Activation", "random_attention_state_dict",
    "shard_attention_state_dict", "canonicalize_attention_state_dict",
    "Scenario", "ScenarioStep", "TPContext", "build_tp_layer", "check_tp_against_tp1",
    "init_tp_from_env", "launch_local", "run_step", "shutdown_tp",
]
