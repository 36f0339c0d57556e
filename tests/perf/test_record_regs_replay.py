"""``perf/record_regs_replay.py``: the register-operand record kernel's index algebra (its
logical ops replayed in torch) against the float64 oracle, on the CPU."""
import sys
from pathlib import Path

import pytest
import torch

from dsv41_triton.attention.ref import sparse_mla_decode_ref
from dsv41_triton.testing import random_k_cache, rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import record_regs_replay as rr  # noqa: E402


@pytest.mark.parametrize("T,H,K,two", [(2, 8, 130, False), (1, 3, 64, True), (2, 1, 7, False)])
def test_record_regs_algebra_matches_the_oracle(T, H, K, two):
    g = torch.Generator().manual_seed(T * 100 + H * 10 + K)
    sets = []
    for _ in range(2 if two else 1):
        cache = random_k_cache(4, 64, 584, "cpu", generator=g)
        idx = torch.randint(0, 4 * 64, (T, K), generator=g).to(torch.int32)
        idx[torch.rand(T, K, generator=g) < 0.1] = -1
        idx[0, 0] = 4 * 64 + 3  # out of range: skipped
        sets.append((cache, idx, torch.randint(1, K + 1, (T,), generator=g).to(torch.int32)))
    q = torch.randn(T, H, 512, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    b = sets[1] if two else (None, None, None)
    ro, rl = sparse_mla_decode_ref(q, *sets[0], *b, sink)
    o, lse = rr.replay(q, sets, sink, 512 ** -0.5)
    assert rel_err(o, ro) <= 1e-2
    assert (lse - rl).abs().max().item() <= 1e-3
