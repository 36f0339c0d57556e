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
