"""Shared test setup.

Without a GPU the Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``,
set here before anything imports triton kernels) on CPU tensors. With a GPU they compile for
it. The same tests therefore run in CI (CPU) and on the H200; tests marked ``gpu`` (large
shapes, CUDA graphs) are skipped without CUDA.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # set outright: with TRITON_INTERPRET=0 and no GPU every call would take the reference,
    # and each kernel test would compare the reference with itself
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where the kernels under test run: the GPU when there is one, else the CPU interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


# The quick subset, `python -m pytest tests -q -m "not slow"` (under a minute on 2 CPU cores),
# keeps one case of every test; the full suite runs them all. Tests are named by function, so
# this holds wherever a test file lives; a renamed or new long test needs its name here.
#: every case of these is slow (subprocess runs, multi-process TP, the whole CLI)
SLOW_TESTS = {
    "test_default_command_writes_a_checked_report",
    "test_kernels_compile_and_fit_on",
    "test_list_and_module_entry_point",
    "test_tp2_gloo_equals_tp1_torch_backend",
    "test_tp_run_script_under_torchrun",
    "test_decode_lazy_rescale_growing_max",
    "test_decode_seven_tokens_one_token",
    "test_token_range_slices_of_one_step_buffer",
    "test_v41_layer_kernels_match_references",
    "test_every_entry_point_compiles_to_one_graph_without_recompiles",
    "test_paged_and_shared_window_prefill_compile",
    "test_aot_eager_functionalizes_the_mutating_ops",
    "test_wrong_backends_are_flagged_and_the_run_goes_on",
    "test_module_run_sets_up_triton_itself",
    "test_cpu_tensors_with_the_interpreter_set_before_import_run_the_kernels",
    "test_prefill_paged_window_only",
    "test_shared_window_equals_general_prefill_on_the_layer_workspace",
    "test_indexer_families_opt_in_and_checked",
    "test_attention_does_not_import_backends_or_layers",
    "test_backends_do_not_import_layers",
    "test_interpreter_set_after_the_kernels_were_defined_says_what_to_do",
    "test_v4_indexer_matches_transformers",
}
#: parametrized tests whose first case stays in the quick subset; the other cases are slow
SLOW_AFTER_FIRST_CASE = {
    "test_decode_group_variant",
    "test_decode_record_pairs_splits",  # the name of the test above on the kernel branches
    "test_prefill_heads_splits",
    "test_decode_records_heads",
    "test_decode_sink",
    "test_decode_split_k",
    "test_decode_sharp_softmax_and_scale",
    "test_decode_empty_rows",
    "test_decode_fused_matches_ref",
    "test_prefill_fused_matches_ref",
    "test_prefill_group_variant",
    "test_q_norm_rope_matches_ref",
    "test_epilogue_matches_ref",
    "test_multistep_torch_backend_equals_oracle",
    "test_tensor_parallel_shards_equal_tp1",
    "test_fused_contract_torch_backend",
    "test_flashmla_mega_plumbing",
    "test_fused_decode_conformance",
    "test_prefill_heads",
    "test_mxfp8_quantize_matches_ref",
    "test_padded_block_stride_and_block_slices_are_accepted",
    "test_backend_status_cli",
    "test_layer_forward_compiles_without_breaks_or_recompiles",
    "test_v41_indexer_matches_float64_rules",
    "test_prefill_paged_matches_ref_and_workspace",
    "test_multistep_triton_backend_equals_oracle",
    "test_prefill_paged_sinks",
    "test_shared_window_tile_sizes",
    "test_shared_window_matches_ref",
    "test_shared_window_sinks",
    "test_shared_window_tiles_kernel_matches_torch",
}


def pytest_itemcollected(item):
    name = getattr(item, "originalname", item.name)
    spec = getattr(item, "callspec", None)
    later_case = spec is not None and any(i != 0 for i in spec.indices.values())
    if name in SLOW_TESTS or (name in SLOW_AFTER_FIRST_CASE and later_case):
        item.add_marker(pytest.mark.slow)
