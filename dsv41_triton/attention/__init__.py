"""Sparse MLA attention (SPEC §3, §6): Triton kernels, float64 references and the fused
("mega") contract.

- ``sparse_mla_decode`` / ``sparse_mla_prefill``: Triton kernels (``decode.py``, ``prefill.py``,
  one kernel in ``_sparse_kernel.py``, launched by ``_launch.py``); references in ``ref.py``.
- ``sparse_mla_decode_fused`` / ``sparse_mla_prefill_fused``: FlashMLA's fused-op argument order
  (q norm + RoPE -> attention -> inverse RoPE -> MXFP8 pair); reference in ``fused_ref.py``.

The drop-in layer, its config, step metadata, scenario and tensor-parallel helpers live in
``dsv41_triton.layers``. Their old names here (``dsv41_triton.attention.DeepseekV41Attention``,
``dsv41_triton.attention.layer`` / ``.config`` / ``.metadata`` / ``.scenario`` /
``.distributed``) still resolve for one release, with a ``DeprecationWarning``; this package
never imports ``backends`` or ``layers`` at import time.
"""
import importlib
import warnings

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

#: names that moved to ``dsv41_triton.layers`` -> their module there
_MOVED = {
    "DeepseekV41AttentionConfig": "config",
    "build_cos_sin_cache": "config",
    "RequestSpec": "metadata",
    "StepMetadata": "metadata",
    "PrefillChunk": "metadata",
    "build_step_metadata": "metadata",
    "DeepseekV41Attention": "layer",
    "MXFP8Activation": "layer",
    "random_attention_state_dict": "weights",
    "shard_attention_state_dict": "weights",
    "canonicalize_attention_state_dict": "weights",
    "Scenario": "scenario",
    "ScenarioStep": "scenario",
    "TPContext": "distributed",
    "build_tp_layer": "distributed",
    "check_tp_against_tp1": "distributed",
    "init_tp_from_env": "distributed",
    "launch_local": "distributed",
    "run_step": "distributed",
    "shutdown_tp": "distributed",
}


def __getattr__(name):
    if name in _MOVED:
        warnings.warn(f"dsv41_triton.attention.{name} moved to dsv41_triton.layers.{name}; the "
                      "old name will be removed in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(f"..layers.{_MOVED[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_MOVED))


__all__ = [
    "sparse_mla_decode", "sparse_mla_prefill", "sparse_mla_decode_ref", "sparse_mla_prefill_ref",
    "sparse_mla_decode_fused", "sparse_mla_prefill_fused", "q_norm_rope", "check_fused_output",
    "sparse_mla_decode_fused_ref", "sparse_mla_prefill_fused_ref", "q_norm_rope_ref",
    "fused_epilogue_ref",
]
