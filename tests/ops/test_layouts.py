"""SPEC §6 layouts: Q chunk-interleaving, output group interleaving, wq_b / wo_a permutations."""
import pytest
import torch

from dsv41_triton.ops.layouts import (
    inverse_permutation,
    o_interleave_index,
    output_from_groups,
    output_to_groups,
    permute_wo_a,
    permute_wq_b,
    q_from_interleaved,
    q_interleave_index,
    q_to_interleaved,
    unpermute_wo_a,
    unpermute_wq_b,
)
from dsv41_triton.ops.mxfp8 import mxfp8_dequantize, rope_mxfp8_epilogue
from dsv41_triton.ops.rope_ref import make_cos_sin_cache


def _ints(*shape, lo=-8, hi=8, dtype=torch.float32):
    """Small-integer-valued floats: every GEMM below is exact, whatever the summation order."""
    return torch.randint(lo, hi, shape).to(dtype)


@pytest.mark.parametrize("H", [1, 3, 8])
def test_q_interleaved_formula(H):
    T = 2
    q = torch.randn(T, H, 512)
    qi = q_to_interleaved(q)
    assert qi.shape == (T, H, 512)
    flat = qi.reshape(T, -1)
    for h in range(H):
        for d in (0, 1, 15, 16, 17, 447, 448, 511):
            assert torch.equal(flat[:, (d // 16) * (H * 16) + h * 16 + d % 16], q[:, h, d])
    assert torch.equal(flat, q.reshape(T, -1)[:, q_interleave_index(H)])
    assert torch.equal(q_from_interleaved(qi), q)
    if H > 1:
        assert not torch.equal(qi, q)


@pytest.mark.parametrize("H", [8, 24])
@pytest.mark.parametrize("layout", ["standard", "interleaved"])
def test_output_groups_formula(H, layout):
    T = 3
    o = torch.randn(T, H, 512)
    x = output_to_groups(o, layout)
    assert x.shape == (T, H // 8, 4096)
    for g in range(H // 8):
        for h in range(8):
            for d in (0, 31, 32, 100, 448, 511):
                c, j = divmod(d, 32)
                p = h * 512 + d if layout == "standard" else (c * 8 + h) * 32 + j
                assert x[:, g, p].equal(o[:, g * 8 + h, d])
    assert torch.equal(output_from_groups(x, layout), o)
    if layout == "interleaved":
        assert torch.equal(x, o.reshape(T, H // 8, 4096)[..., o_interleave_index()])


def test_inverse_permutation():
    idx = torch.randperm(50)
    inv = inverse_permutation(idx)
    assert torch.equal(idx[inv], torch.arange(50)) and torch.equal(inv[idx], torch.arange(50))


@pytest.mark.parametrize("H", [1, 3, 16])
def test_wq_b_permutation_gemm(H):
    T, K = 5, 24
    x = _ints(T, K)
    w = _ints(H * 512, K)
    wp = permute_wq_b(w)
    q_std = (x @ w.T).view(T, H, 512)
    q_int = (x @ wp.T).view(T, H, 512)
    assert torch.equal(q_int, q_to_interleaved(q_std))
    assert torch.equal(q_from_interleaved(q_int), q_std)
    assert torch.equal(unpermute_wq_b(wp), w)
    # the [in, out] storage of the same weight: permute dim 1
    wt = w.T.contiguous()
    assert torch.equal(permute_wq_b(wt, num_heads=H, dim=1), wp.T)
    assert torch.equal(unpermute_wq_b(permute_wq_b(wt, dim=1), dim=1), wt)


@pytest.mark.parametrize("H", [8, 16])
def test_wo_a_permutation_gemm(H):
    T, G, L = 4, H // 8, 40
    o = _ints(T, H, 512)
    w = _ints(G, L, 4096)
    wp = permute_wo_a(w)
    y_std = torch.einsum("tgk,glk->tgl", output_to_groups(o, "standard"), w)
    y_int = torch.einsum("tgk,glk->tgl", output_to_groups(o, "interleaved"), wp)
    assert torch.equal(y_std, y_int)
    assert torch.equal(unpermute_wo_a(wp), w)
    # the flat [G*L, 4096] storage
    assert torch.equal(permute_wo_a(w.reshape(G * L, 4096)), wp.reshape(G * L, 4096))
    # a weight stored [4096, L] per group: permute dim 0
    assert torch.equal(permute_wo_a(w[0].T.contiguous(), dim=0), wp[0].T)


def test_epilogue_interleaved_feeds_permuted_wo_a(device):
    """End to end: the interleaved MXFP8 output through the permuted wo_a equals the standard
    output through the original wo_a."""
    T, H, L = 3, 16, 24
    cs = make_cos_sin_cache(64, device=device)
    o = torch.randn(T, H, 512).to(torch.bfloat16).to(device)
    pos = torch.tensor([0, 17, 63], device=device)
    w = _ints(H // 8, L, 4096, dtype=torch.float64)

    def through(layout, weight):
        x = mxfp8_dequantize(*rope_mxfp8_epilogue(o, pos, cs, layout)).double().cpu()
        return torch.einsum("tgk,glk->tgl", x, weight)

    ys = through("standard", w)
    yi = through("interleaved", permute_wo_a(w))
    torch.testing.assert_close(yi, ys, rtol=1e-12, atol=1e-9)


def test_layout_bad_inputs():
    with pytest.raises(ValueError, match="w"):
        permute_wq_b(torch.zeros(500, 4))
    with pytest.raises(ValueError, match="w"):
        permute_wq_b(torch.zeros(1024, 4), num_heads=3)
    with pytest.raises(ValueError, match="w"):
        permute_wo_a(torch.zeros(4, 2048))
    with pytest.raises(ValueError, match="dim"):
        permute_wo_a(torch.zeros(4, 4096), dim=2)
    with pytest.raises(ValueError, match="o"):
        output_to_groups(torch.zeros(2, 12, 512))
    with pytest.raises(ValueError, match="layout"):
        output_to_groups(torch.zeros(2, 8, 512), "blocked")
    with pytest.raises(ValueError, match="q"):
        q_to_interleaved(torch.zeros(2, 4, 256))
    with pytest.raises(TypeError, match="q"):
        q_to_interleaved([1, 2])
