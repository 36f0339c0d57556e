"""CPU tensors with and without Triton's interpreter, in fresh processes (the interpreter is
chosen when the kernels are defined, so each case needs its own interpreter state)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: every public op and attention entry point on CPU tensors; prints "OK <interpreted>"
SCRIPT = r'''
import torch
from dsv41_triton import ops
from dsv41_triton.attention import (sparse_mla_decode, sparse_mla_prefill,
    sparse_mla_decode_fused, sparse_mla_prefill_fused, q_norm_rope)
from dsv41_triton.attention.ref import sparse_mla_decode_ref, sparse_mla_prefill_ref
from dsv41_triton.attention.fused_ref import sparse_mla_decode_fused_ref
from dsv41_triton.ops.kv_cache_ref import quantize_and_insert_k_cache_ref
from dsv41_triton.ops.rope_ref import make_cos_sin_cache
from dsv41_triton._utils import kernel_is_interpreted
from dsv41_triton.ops.kv_cache import _INSERT_KERNELS
torch.manual_seed(0)
k = torch.randn(10, 512).bfloat16()
c = ops.allocate_k_cache(3, 4, 584, fill=0)
c_ref = c.clone()
slots = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, -1])
ops.quantize_and_insert_k_cache(k, c, slots)
quantize_and_insert_k_cache_ref(k, c_ref, slots)
assert torch.equal(c, c_ref)
ws = torch.zeros(1, 12, 512, dtype=torch.bfloat16)
ops.dequantize_and_gather_k_cache(ws, c, torch.tensor([9], dtype=torch.int32), None,
                                  torch.tensor([[0, 1, 2]], dtype=torch.int32), 4, 0)
q = torch.randn(2, 8, 512).bfloat16()
idx = torch.tensor([[0, 3, 5, -1], [1, 2, 8, 7]], dtype=torch.int32)
o, lse = sparse_mla_decode(q, c, idx, None)
ro, rl = sparse_mla_decode_ref(q, c, idx, None)
assert (o.double() - ro).norm() <= 1e-2 * ro.norm() and (lse.double() - rl).abs().max() < 1e-3
o, lse = sparse_mla_prefill(q, ws[0], idx)
ro, rl = sparse_mla_prefill_ref(q, ws[0], idx)
assert (o.double() - ro).norm() <= 1e-2 * ro.norm()
cs = make_cos_sin_cache(32)
pos = torch.tensor([3, 9], dtype=torch.int32)
d, s, l = sparse_mla_decode_fused(q, c, idx, token_positions=pos, cos_sin_cache=cs)
dr, sr, lr, _ = sparse_mla_decode_fused_ref(q, c, idx, token_positions=pos, cos_sin_cache=cs,
                                            bf16_steps=True)
assert (l.double() - lr).abs().max() < 1e-3
sparse_mla_prefill_fused(q, ws[0], idx, token_positions=pos, cos_sin_cache=cs)
q_norm_rope(q, pos, cs, "standard")
ops.apply_rope(q, pos, cs)
ops.combine_topk_swa_indices(torch.zeros(2, 4, dtype=torch.int32),
                             torch.tensor([0, 2], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32), None, 4, 1, 4, 16, 4)
ops.compute_global_topk_indices_and_lens(idx, torch.zeros(2, dtype=torch.int32),
                                         torch.tensor([[0, 1, 2]], dtype=torch.int32), 4, None)
from dsv41_triton.attention.prefill_paged import sparse_mla_prefill_paged
from dsv41_triton.attention.prefill_shared import sparse_mla_prefill_shared_window
from dsv41_triton.ops.prefill_indices import prefill_slot_indices
sparse_mla_prefill_paged(q, pos, torch.zeros(2, dtype=torch.int32), torch.tensor([10], dtype=torch.int32),
                         c, torch.tensor([[0, 1, 2]], dtype=torch.int32), 4)
sparse_mla_prefill_shared_window(q, ws[0], torch.tensor([0, 1]), torch.tensor([3, 3]), idx, None,
                                 torch.tensor([0, 2], dtype=torch.int32))
from dsv41_triton.ops.indexer import index_logits, index_topk, quantize_and_insert_index_k
from dsv41_triton.ops.indexer_ref import (allocate_index_k_cache, index_logits_ref,
                                          index_topk_ref, quantize_and_insert_index_k_ref)
kc = allocate_index_k_cache(2, 4, 128)
kc_ref = kc.clone()
ki = torch.randn(6, 128).bfloat16()
quantize_and_insert_index_k(ki, kc, torch.arange(6))
quantize_and_insert_index_k_ref(ki, kc_ref, torch.arange(6))
assert torch.equal(kc, kc_ref)
iq, iw = torch.randn(2, 4, 128).bfloat16(), torch.rand(2, 4)
ia = (iq, iw, kc, torch.tensor([[0, 1]], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
      torch.tensor([3, 6], dtype=torch.int32))
lg = index_logits(*ia, max_len=8)
assert torch.allclose(lg, index_logits_ref(*ia, max_len=8), rtol=1e-3, atol=1e-3)
assert torch.equal(index_topk(lg, torch.tensor([3, 6]), 4), index_topk_ref(lg, torch.tensor([3, 6]), 4))
print("OK", kernel_is_interpreted(_INSERT_KERNELS[584]))
'''


def _run(code: str, interpret):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_cpu_tensors_without_the_interpreter_run_the_reference():
    r = _run(SCRIPT, None)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("OK False")
    assert "active drivers" not in r.stderr


def _interpreter_broken_reason():
    """Triton's interpreter before 3.9 turns 1-element arrays into loop bounds with ``int()``,
    an error since NumPy 2.5 (seen on the H200: Triton 3.6, NumPy 2.5.2)."""
    import numpy
    import triton

    def ver(m):
        return tuple(int(p) for p in m.__version__.split(".")[:2])
    if ver(numpy) >= (2, 5) and ver(triton) < (3, 9):
        return (f"Triton {triton.__version__}'s interpreter cannot run the kernels with NumPy "
                f"{numpy.__version__} (int() of a 1-element array)")
    return None


@pytest.mark.skipif(_interpreter_broken_reason() is not None,
                    reason=str(_interpreter_broken_reason()))
def test_cpu_tensors_with_the_interpreter_set_before_import_run_the_kernels():
    r = _run(SCRIPT, "1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("OK True")


def test_interpreter_set_after_the_kernels_were_defined_says_what_to_do():
    r = _run(r'''
        import os, torch
        from dsv41_triton import ops
        from dsv41_triton.attention import sparse_mla_decode
        os.environ["TRITON_INTERPRET"] = "1"
        c = ops.allocate_k_cache(2, 4, 584)
        for call in (lambda: ops.quantize_and_insert_k_cache(torch.randn(2, 512).bfloat16(), c,
                                                              torch.arange(2)),
                     lambda: sparse_mla_decode(torch.randn(1, 2, 512).bfloat16(), c,
                                               torch.zeros(1, 3, dtype=torch.int32), None)):
            try:
                call()
            except RuntimeError as e:
                msg = str(e)
                assert "before" in msg and "TRITON_INTERPRET=1" in msg and "unset" in msg, msg
                assert "active drivers" not in msg
            else:
                raise AssertionError("no error")
        print("OK")
    ''', None)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "OK"


@pytest.mark.parametrize("interpret", (None, "1"))
def test_backend_status_cli(interpret):
    r = _run("from dsv41_triton.backends.__main__ import main; main()", interpret)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "device: cpu" and lines[1].split()[:2] == ["backend", "decode"]
    rows = {ln.split()[0]: ln.split() for ln in lines[2:]}
    assert set(rows) == {"flashmla_mega", "flashmla", "triton", "torch"}
    assert rows["torch"][1:5] == ["yes"] * 4
    assert rows["triton"][1] == ("yes" if interpret else "no")
