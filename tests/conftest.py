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
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
