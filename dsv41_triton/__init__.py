"""dsv41_triton: DeepSeek V4.1 sparse MLA attention in Triton, with a FlashMLA fast path.

The contract is docs/SPEC.md (edge cases: docs/semantics.md). Subpackages: ``ops`` (records,
cache and index ops, RoPE, MXFP8, indexer ops), ``attention`` (sparse MLA kernels, the fused
contract), ``backends`` (the dispatcher), ``layers`` (the drop-in layer, its config, step
metadata, compressor and indexer), ``integrations`` (transformers' DeepSeek-V4 on this
package's layer), ``perf`` (the comparison harness, ``dsv41-bench``).
Imports run one way: ops <- attention <- backends <- layers <- integrations, perf.

The most used names are re-exported here::

    from dsv41_triton import sparse_mla_decode, select_backend, DeepseekV41Attention

They are imported lazily (on first attribute access): Triton decides whether a kernel runs in
its CPU interpreter when the kernel is defined, so ``import dsv41_triton`` alone must not define
kernels before a tool (the test conftest, the ``dsv41-bench`` CLI) has set ``TRITON_INTERPRET``.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "sparse_mla_decode": "attention",
    "sparse_mla_prefill": "attention",
    "sparse_mla_decode_fused": "attention",
    "sparse_mla_prefill_fused": "attention",
    "DeepseekV41Attention": "layers",
    "DeepseekV41AttentionConfig": "layers",
    "build_step_metadata": "layers",
    "select_backend": "backends",
    "get_backend": "backends",
    "available_backends": "backends",
    "quantize_and_insert_k_cache": "ops",
    "dequantize_and_gather_k_cache": "ops",
    "combine_topk_swa_indices": "ops",
    "compute_global_topk_indices_and_lens": "ops",
    "allocate_k_cache": "ops",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
