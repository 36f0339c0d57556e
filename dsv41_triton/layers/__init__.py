"""The drop-in DeepSeek V4 / V4.1 attention layer and what it needs around the kernels.

- ``DeepseekV41Attention`` (``layer.py``): one tensor-parallel shard of the layer, running
  attention through a backend (``dsv41_triton.backends``).
- ``DeepseekV41AttentionConfig`` and the RoPE tables (``config.py``); its ``from_hf_config``
  reader of transformers', the checkpoint's, vLLM's and DeepSeek's configs (``hf_config.py``).
- Step metadata: ``RequestSpec`` -> ``build_step_metadata`` -> ``StepMetadata`` (``metadata.py``).
- Weights: checkpoint names, random init, TP sharding (``weights.py``).
- Synthetic serving steps (``scenario.py``) and tensor parallel under ``torch.distributed``
  (``distributed.py``: torchrun init, the rank's layer, TP=N vs TP=1 check).
"""
from .config import DeepseekV41AttentionConfig, build_cos_sin_cache
from .metadata import (
    PrefillChunk,
    RequestSpec,
    StepMetadata,
    build_step_metadata,
    completed_entries_topk,
)
from .weights import (
    PARAM_NAMES,
    canonicalize_attention_state_dict,
    random_attention_state_dict,
    shard_attention_state_dict,
)
from .layer import DeepseekV41Attention, MXFP8Activation
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
    "DeepseekV41AttentionConfig", "build_cos_sin_cache",
    "RequestSpec", "StepMetadata", "PrefillChunk", "build_step_metadata", "completed_entries_topk",
    "DeepseekV41Attention", "MXFP8Activation", "PARAM_NAMES", "random_attention_state_dict",
    "shard_attention_state_dict", "canonicalize_attention_state_dict",
    "Scenario", "ScenarioStep", "TPContext", "build_tp_layer", "check_tp_against_tp1",
    "init_tp_from_env", "launch_local", "run_step", "shutdown_tp",
]
