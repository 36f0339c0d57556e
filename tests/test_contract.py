"""The contract module: kernel-free, and the one place the shared checks live."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv41_triton import _contract as C


def test_contract_imports_no_triton():
    code = ("import sys; import dsv41_triton._contract; "
            "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       env={"PYTHONPATH": str(root), "PATH": ""})
    assert r.returncode == 0, r.stderr


def test_spec_constants():
    assert (C.HEAD_DIM, C.ROPE_DIM, C.NOPE_DIM, C.WV_GROUP_SIZE, C.GROUP_WIDTH) == (
        512, 64, 448, 8, 4096)
    assert {f.record_bytes: (f.data_bytes, f.scale_bytes) for f in C.RECORD_FORMATS.values()} == {
        584: (576, 8), 528: (512, 16), 288: (256, 32)}
    assert C.SWA_RECORDS == (584, 528) and C.EXTRA_RECORDS == (584, 528, 288)


def test_the_callers_use_the_contract():
    from dsv41_triton.attention import _kernels
    from dsv41_triton.backends import _compose, base
    from dsv41_triton.ops import layouts, records

    assert records.check_k_cache is C.check_k_cache and records.RecordFormat is C.RecordFormat
    assert _kernels.check_lens is C.check_lens and _kernels.new_outputs is C.new_outputs
    assert _compose.check_fused_common is C.check_fused_common
    assert base.WV_GROUP_SIZE is C.WV_GROUP_SIZE and layouts.check_layout is C.check_layout


def test_checks_name_the_argument():
    q = torch.zeros(2, 3, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^q: expected at least one head"):
        C.check_q(q[:, :0])
    with pytest.raises(ValueError, match="^q: the fused contract"):
        C.check_q(q, fused=True)
    with pytest.raises(TypeError, match="^softmax_scale"):
        C.check_scale("0.1")
    with pytest.raises(ValueError, match="^my_lens: expected shape"):
        C.check_lens("my_lens", torch.zeros(3, dtype=torch.int32), 2)
    assert C.problem_error("bogus", 8, 512, 584, None, "standard").startswith("unknown kind")


def test_outputs_with_repeated_elements_are_rejected():
    """An ``expand``-ed output (stride 0 on a dim of size > 1) would make the kernels race."""
    from dsv41_triton.attention import sparse_mla_decode
    from dsv41_triton.ops import dequantize_and_gather_k_cache
    from dsv41_triton.ops.mxfp8 import alloc_mxfp8_output, mxfp8_quantize
    from dsv41_triton.testing import random_k_cache

    T, H = 3, 2
    q = torch.randn(T, H, 512).bfloat16()
    cache = random_k_cache(2, 4, 584, "cpu")
    idx = torch.randint(0, 8, (T, 5), dtype=torch.int32)
    lens = torch.full((T,), 5, dtype=torch.int32)
    shared_row = torch.empty(512, dtype=torch.bfloat16).expand(T, H, 512)
    with pytest.raises(ValueError, match="^out: expected distinct elements"):
        sparse_mla_decode(q, cache, idx, lens, out=shared_row)
    with pytest.raises(ValueError, match="^out: expected distinct elements"):
        dequantize_and_gather_k_cache(torch.empty(512, dtype=torch.bfloat16).expand(1, 6, 512),
                                      cache, torch.tensor([6]), None,
                                      torch.tensor([[0, 1]], dtype=torch.int32), 4, 0)
    data, scale = alloc_mxfp8_output(T, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="^data: expected distinct elements"):
        mxfp8_quantize(torch.randn(T, 1, 4096).bfloat16(), data=data[:1].expand(T, 1, 4096),
                       scale=scale)
    C.check_distinct_elements("out", torch.empty(1, 4).expand(1, 4))  # size-1 dims are free


def test_no_overlap_checks_byte_spans():
    buf = torch.zeros(10, 4)
    C.check_no_overlap("out", buf[5:], "q", buf[:5])  # adjacent, disjoint
    C.check_no_overlap("out", torch.zeros(3), "q", torch.zeros(3))
    with pytest.raises(ValueError, match="^out: must not overlap q"):
        C.check_no_overlap("out", buf[4:], "q", buf[:5])
    with pytest.raises(ValueError, match="^out: must not overlap q"):
        C.check_no_overlap("out", buf[:, 1], "q", buf[:, 2])  # interleaved columns share a span


def test_q_norm_rope_out_overlapping_q_and_token_positions_name():
    from dsv41_triton.attention.fused import q_norm_rope
    from dsv41_triton.ops.rope_ref import make_cos_sin_cache

    buf = torch.randn(4, 8, 512).bfloat16()
    cs = make_cos_sin_cache(16)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="^out: must not overlap q"):
        q_norm_rope(buf[1:], pos, cs, "standard", out=buf[:-1])
    with pytest.raises(TypeError, match="^token_positions: expected dtype"):
        q_norm_rope(buf[1:], pos.float(), cs, "standard")


def test_allocate_k_cache_and_softmax_scale_arguments():
    import numpy as np

    from dsv41_triton.ops import allocate_k_cache

    assert C.check_scale(np.float32(0.25)) == 0.25
    with pytest.raises(TypeError, match="^softmax_scale"):
        C.check_scale(True)
    with pytest.raises(ValueError, match="^block_stride: expected a multiple of 16"):
        allocate_k_cache(2, 4, 584, block_stride=4 * 584 + 8)
    with pytest.raises(ValueError, match="^fill: expected <= 255"):
        allocate_k_cache(2, 4, 584, fill=300)
    with pytest.raises(ValueError, match="^fill: expected >= 0"):
        allocate_k_cache(2, 4, 584, fill=-1)
    with pytest.raises(ValueError, match="^device: expected"):
        allocate_k_cache(2, 4, 584, device="gpu")
    c = allocate_k_cache(2, 4, 584, block_stride=4 * 584 + 16, fill=7)
    assert c.stride(0) == 4 * 584 + 16 and int(c[1, 3, 0]) == 7
