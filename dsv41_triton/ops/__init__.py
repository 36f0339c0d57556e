"""Cache, index, RoPE and MXFP8 ops (SPEC §2, §4–§6): Triton kernels, references beside them.

Each op family is a module pair ``<family>.py`` (Triton kernels + wrappers) and
``<family>_ref.py`` (plain PyTorch reference with the same signature, suffix ``_ref``);
``records`` (the record formats, with their encode / decode references) and ``layouts`` (q and
output layout conversions, torch only) have no kernels of their own.
"""
from .records import (
    FP8_DS_MLA,
    MXFP8,
    NVFP4,
    RECORD_FORMATS,
    RecordFormat,
    allocate_k_cache,
    check_k_cache,
    decode_records_ref,
    encode_records_ref,
    get_record_format,
)
from .kv_cache import dequantize_and_gather_k_cache, quantize_and_insert_k_cache
from .indices import combine_topk_swa_indices, compute_global_topk_indices_and_lens
from .rope import apply_rope
from .mxfp8 import (
    alloc_mxfp8_output,
    check_mxfp8_output,
    mxfp8_dequantize,
    mxfp8_quantize,
    rope_mxfp8_epilogue,
)
from .layouts import (
    output_from_groups,
    output_to_groups,
    permute_wo_a,
    permute_wq_b,
    q_from_interleaved,
    q_to_interleaved,
    unpermute_wo_a,
    unpermute_wq_b,
)

__all__ = [
    "FP8_DS_MLA", "MXFP8", "NVFP4", "RECORD_FORMATS", "RecordFormat",
    "allocate_k_cache", "check_k_cache", "decode_records_ref", "encode_records_ref",
    "get_record_format",
    "quantize_and_insert_k_cache", "dequantize_and_gather_k_cache",
    "combine_topk_swa_indices", "compute_global_topk_indices_and_lens",
    "apply_rope",
    "alloc_mxfp8_output", "check_mxfp8_output", "mxfp8_quantize", "mxfp8_dequantize",
    "rope_mxfp8_epilogue",
    "q_to_interleaved", "q_from_interleaved", "output_to_groups", "output_from_groups",
    "permute_wq_b", "unpermute_wq_b", "permute_wo_a", "unpermute_wo_a",
]
