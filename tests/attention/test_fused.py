"""The fused ("mega") contract (SPEC §6): ``q_norm_rope``, ``sparse_mla_decode_fused`` and
``sparse_mla_prefill_fused`` against the float64 references of ``fused_ref``.

Three kinds of checks:

* against the float64 oracle, twice: once with ``bf16_steps=True`` (the oracle rounds q and
  the attention output to bf16 where the Triton path's bf16 attention interface must): ``lse``
  within 1e-3, the MXFP8 pair nearly bit-equal (``assert_mxfp8_close`` with 1% scale flips,
  1e-2 relative); once against the exact math (FlashMLA's semantics: only the rotated q is
  rounded, the norm factor scales the logits): ``lse`` within 1e-3 (1e-2 with the q norm on,
  whose folding into q rounds all 512 dims), the pair within one e4m3 step per element and
  3e-2 relative (the bf16 output rounding flips ~2% of the codes), and the dequantized output
  within MXFP8 noise (5e-2) of the unquantized float64 output;
* the reference epilogue fed the same attention output: the fused call equals ``q_norm_rope``
  -> ``sparse_mla_decode``/``_prefill`` -> ``fused_epilogue_ref`` with bit-equal scales (data
  bit-equal in the interpreter, within one ulp on a GPU);
* buffers (caller-provided, token-range slices, poisoned, padding rows untouched) and bad
  inputs (raise before any launch, checked by making every launch path raise).

CPU: the Triton interpreter with H = 8/16, T <= 7 and a few dozen keys. GPU-marked: 64/128
heads, V4.1-sized key sets, and a q/output larger than 2**31 elements.
"""
import pytest
import torch

from dsv41_triton._utils import is_interpreter, round_up
from dsv41_triton.attention import fused as fused_mod
from dsv41_triton.attention.decode import sparse_mla_decode
from dsv41_triton.attention.fused import (
    check_fused_output,
    q_norm_rope,
    sparse_mla_decode_fused,
    sparse_mla_prefill_fused,
)
from dsv41_triton.attention.fused_ref import (
    fused_epilogue_ref,
    q_norm_rope_ref,
    sparse_mla_decode_fused_ref,
    sparse_mla_prefill_fused_ref,
)
from dsv41_triton.attention.prefill import sparse_mla_prefill
from dsv41_triton.ops.layouts import output_from_groups, q_to_interleaved
from dsv41_triton.ops.mxfp8 import alloc_mxfp8_output
from dsv41_triton.ops.mxfp8_ref import mxfp8_dequantize_ref, unpack_ue8m0_words
from dsv41_triton.ops.rope_ref import make_cos_sin_cache
from dsv41_triton.testing import max_abs_err, poison_, random_k_cache, rel_err

#: where the GPU-marked tests run (a dry run on CPU can point them elsewhere)
GPU = "cuda"
#: the element count the int64-offset test must exceed
INT64_ELEMS = 1 << 31
LSE_TOL = 1e-3
LSE_TOL_EXACT_NORM = 1e-2
SENTINEL = -123456789
MAX_POS = 4096
EPS = 1e-6


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def _e4m3_ordinal(d: torch.Tensor) -> torch.Tensor:
    b = d.view(torch.uint8).to(torch.int64)
    mag = b & 0x7F
    return torch.where(b >= 128, -mag, mag)


def _no_nan(data):
    raw = data.view(torch.uint8).cpu()
    assert not ((raw & 0x7F) == 0x7F).any(), "NaN (unwritten) data bytes"


def assert_mxfp8_equal(data, scale, ref_data, ref_scale):
    """Scales bit-equal; data bit-equal in the interpreter, within one e4m3 ulp on a GPU."""
    _no_nan(data)
    assert torch.equal(scale.cpu().contiguous(), ref_scale.cpu().contiguous()), "scales differ"
    diff = (_e4m3_ordinal(data.cpu()) - _e4m3_ordinal(ref_data.cpu())).abs()
    limit = 0 if is_interpreter() else 1
    assert diff.max().item() <= limit, f"{int((diff > limit).sum())} bytes off by > {limit} ulp"


def assert_mxfp8_close(data, scale, ref_data, ref_scale, max_scale_flips=0.05, rel=1e-2):
    """An MXFP8 pair against one quantized from slightly different values (the float64
    oracle's output, which the bf16 attention output differs from by rounding).

    Per 32-element chunk the scale bytes are equal or one apart (an amax at a power-of-two
    boundary; at most ``max_scale_flips`` of the chunks). Per element the dequantized values
    agree within both grids' half-steps (``2**-4 * (|a| + |b|)``) plus ``2**-7`` of the chunk's
    amax (the attention output's own error, which on elements near zero is many e4m3 steps
    of the fine grid there). Overall, the dequantized tensors agree within ``rel``
    (relative Frobenius)."""
    _no_nan(data)
    T, G = data.shape[:2]
    e = unpack_ue8m0_words(scale.cpu()).view(T, G, 128).to(torch.int64)
    er = unpack_ue8m0_words(ref_scale.cpu()).view(T, G, 128).to(torch.int64)
    if e.numel() == 0:
        return
    de = (e - er).abs()
    assert de.max().item() <= 1, "scale bytes more than one apart"
    flips = (de > 0).float().mean().item()
    assert flips <= max_scale_flips, f"{flips:.3f} of the chunks have another scale"
    a = mxfp8_dequantize_ref(data.cpu(), scale.cpu()).double().view(T, G, 128, 32)
    b = mxfp8_dequantize_ref(ref_data.cpu(), ref_scale.cpu()).double().view(T, G, 128, 32)
    amax = torch.maximum(a.abs().amax(-1, keepdim=True), b.abs().amax(-1, keepdim=True))
    tol = 2.0 ** -4 * (a.abs() + b.abs()) + 2.0 ** -7 * amax
    bad = (a - b).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements differ by more than one step"
    err = rel_err(a, b)
    assert err <= rel, err


def _deq_heads(data, scale, layout):
    """The pair as fp64 ``[T, H, 512]`` head-major values."""
    x = mxfp8_dequantize_ref(data.cpu(), scale.cpu()).double()
    return output_from_groups(x, layout)


def _alloc_poisoned(T, G, device):
    data, scale = alloc_mxfp8_output(T, G, device)
    poison_(data)
    storage = torch.as_strided(scale, (scale.untyped_storage().nbytes() // 4,), (1,), 0)
    storage.fill_(SENTINEL)
    return data, scale, storage


def _padding_untouched(storage, T):
    tp = round_up(T, 4)
    rows = torch.arange(storage.numel(), device=storage.device) % tp
    return bool((storage[rows >= T] == SENTINEL).all())


def _positions(T, device, with_oob=False):
    pos = torch.randint(0, MAX_POS, (T,), dtype=torch.int32)
    if with_oob and T >= 3:
        pos[1] = -1  # not rotated
        pos[2] = MAX_POS  # past the cache: not rotated
    return pos.to(device)


def _q(T, H, layout, device, scale=1.0):
    """``(q in layout, q standard)``; fresh random bf16, never zeros."""
    qs = (torch.randn(T, H, 512) * scale).to(torch.bfloat16).to(device)
    return (q_to_interleaved(qs) if layout == "interleaved" else qs), qs


def _slots(T, W, nslots, device, p_neg=0.15):
    idx = torch.randint(0, nslots, (T, W), dtype=torch.int32)
    idx[torch.rand(T, W) < p_neg] = -1
    return idx.to(device)


def _decode_case(device, T, H, layout, swa_rec=584, extra_rec=288, Ws=16, K=24, page=16,
                 nb=4, sink=True, empty_token=None):
    q, qs = _q(T, H, layout, device)
    kv = random_k_cache(nb, page, swa_rec, device)
    ia = _slots(T, Ws, nb * page, device)
    la = torch.randint(1, Ws + 1, (T,), dtype=torch.int32).to(device)
    ekv = ib = lb = None
    if extra_rec:
        ekv = random_k_cache(nb + 1, page, extra_rec, device)
        ib = _slots(T, K, (nb + 1) * page, device)
        lb = torch.randint(0, K + 1, (T,), dtype=torch.int32).to(device)
    if empty_token is not None:
        ia[empty_token] = -1
        if extra_rec:
            lb[empty_token] = 0
    s = torch.randn(H).to(device) if sink else None
    return dict(q=q, kv=kv, indices=ia, topk_length=la, extra_kv=ekv, extra_indices=ib,
                extra_topk_length=lb, attn_sink=s), qs


def _prefill_case(device, T, H, layout, S=40, K=24, kv3=False, idx3=False, lens=True,
                  sink=True, empty_token=None):
    q, qs = _q(T, H, layout, device)
    kv = torch.randn(S, 512).to(torch.bfloat16).to(device)
    idx = torch.randint(-1, S + 3, (T, K), dtype=torch.int32).to(device)  # some >= S: skipped
    ln = torch.randint(1, K + 1, (T,), dtype=torch.int32).to(device) if lens else None
    if empty_token is not None:
        idx[empty_token] = -1
    if kv3:
        kv = kv.view(S, 1, 512)
    if idx3:
        idx = idx.view(T, 1, K)
    s = torch.randn(H).to(device) if sink else None
    return dict(q=q, kv=kv, indices=idx, topk_length=ln, attn_sink=s), qs


def _decode_fused(args, pos, cs, norm, layout, data=None, scale=None, sm_scale=None):
    a = args
    return sparse_mla_decode_fused(
        a["q"], a["kv"], a["indices"], sm_scale, 512, a["attn_sink"], a["topk_length"],
        a["extra_kv"], a["extra_indices"], a["extra_topk_length"], norm, EPS, pos, False, 64,
        cs, a["q"].shape[1] // 8, 32, True, True, True, data, scale, layout=layout)


def _decode_ref(args, pos, cs, norm, layout, bf16_steps, sm_scale=None):
    a = args
    return sparse_mla_decode_fused_ref(
        a["q"].cpu(), a["kv"].cpu(), a["indices"].cpu(), sm_scale,
        None if a["attn_sink"] is None else a["attn_sink"].cpu(), a["topk_length"].cpu(),
        None if a["extra_kv"] is None else a["extra_kv"].cpu(),
        None if a["extra_indices"] is None else a["extra_indices"].cpu(),
        None if a["extra_topk_length"] is None else a["extra_topk_length"].cpu(),
        norm, EPS, pos.cpu(), cs.cpu(), layout=layout, bf16_steps=bf16_steps)


def _prefill_fused(args, pos, cs, norm, layout, data=None, scale=None, sm_scale=None):
    a = args
    return sparse_mla_prefill_fused(
        a["q"], a["kv"], a["indices"], sm_scale, 512, a["attn_sink"], a["topk_length"], norm,
        EPS, pos, False, 64, cs, a["q"].shape[1] // 8, 32, True, True, True, data, scale,
        layout=layout)


def _prefill_ref(args, pos, cs, norm, layout, bf16_steps, sm_scale=None):
    a = args
    cpu = {k: (None if v is None else v.cpu()) for k, v in a.items()}
    return sparse_mla_prefill_fused_ref(
        cpu["q"], cpu["kv"], cpu["indices"], sm_scale, cpu["attn_sink"], cpu["topk_length"],
        norm, EPS, pos.cpu(), cs.cpu(), layout=layout, bf16_steps=bf16_steps)


def _check_pair_shapes(data, scale, T, G):
    assert data.dtype == torch.float8_e4m3fn and tuple(data.shape) == (T, G, 4096)
    assert scale.dtype == torch.int32 and tuple(scale.shape) == (T, G, 32)
    tp = round_up(T, 4)
    if T > 1:
        assert scale.stride(0) == 1
    assert scale.stride(2) == tp and (G == 1 or scale.stride(1) == 32 * tp)


def _check_vs_oracle(data, scale, lse, ref_rounded, ref_exact, norm, lse_idx, layout):
    """``ref_rounded`` / ``ref_exact``: tuples of the fused references with / without
    ``bf16_steps`` (``lse`` at ``lse_idx``, the float64 output last)."""
    assert not torch.isnan(lse).any()
    assert max_abs_err(lse.cpu(), ref_rounded[lse_idx]) <= LSE_TOL
    assert max_abs_err(lse.cpu(), ref_exact[lse_idx]) <= (LSE_TOL_EXACT_NORM if norm else LSE_TOL)
    # same roundings as the kernels: nearly every code and scale equal
    assert_mxfp8_close(data, scale, ref_rounded[0], ref_rounded[1], max_scale_flips=0.01,
                       rel=1e-2)
    # exact math: the bf16 output rounding flips ~2% of the codes by one step (~1.5% rel)
    assert_mxfp8_close(data, scale, ref_exact[0], ref_exact[1], rel=3e-2)
    # and against the unquantized float64 output: MXFP8 noise only (~2.7% rms)
    assert rel_err(_deq_heads(data, scale, layout), ref_exact[-1]) <= 0.05


# --------------------------------------------------------------------------------------------
# the prologue
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["standard", "interleaved"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T,H", [(1, 8), (7, 3), (3, 16), (2, 1)])
def test_q_norm_rope_matches_ref(device, layout, norm, T, H):
    cs = make_cos_sin_cache(MAX_POS, device=device)
    pos = _positions(T, device, with_oob=True)
    q, _ = _q(T, H, layout, device, scale=3.0)
    big = poison_(torch.empty(T, H + 2, 512, dtype=torch.bfloat16, device=device))
    out = big[:, 1:H + 1]  # strided rows inside a poisoned buffer
    res = q_norm_rope(q, pos, cs, layout, norm, EPS, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.isnan(big[:, 0]).all() and torch.isnan(big[:, H + 1]).all(), "wrote outside"
    ref = q_norm_rope_ref(q.cpu(), pos.cpu(), cs.cpu(), layout, norm, EPS)
    o = res.double().cpu()
    assert not torch.isnan(o).any()
    # one bf16 rounding (unit roundoff 2**-8) of an fp32 computation
    tol = 2.0 ** -8 * 1.01 * ref.abs() + 2.0 ** -20 * ref.abs().amax(-1, keepdim=True)
    assert ((o - ref).abs() <= tol).all(), (o - ref).abs().max().item()
    if norm:  # the rows really are normalized (rms 1 up to eps and rounding)
        rms = o.square().mean(-1).sqrt()
        assert ((rms - 1).abs() < 1e-2).all()


def test_q_norm_rope_rotates_and_keeps_nope(device):
    """Without the norm dims 0..447 are copied bit-exactly; the RoPE dims are rotated."""
    T, H = 3, 8
    cs = make_cos_sin_cache(MAX_POS, device=device)
    pos = torch.tensor([0, 17, 1000], dtype=torch.int64, device=device)
    q, qs = _q(T, H, "interleaved", device)
    o = q_norm_rope(q, pos, cs, "interleaved")
    assert torch.equal(o[..., :448].cpu(), qs[..., :448].cpu())
    assert torch.equal(o[0, :, 448:].cpu(), qs[0, :, 448:].cpu())  # position 0: identity
    assert not torch.equal(o[2, :, 448:].cpu(), qs[2, :, 448:].cpu())


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------
DECODE_CASES = [
    # layout, norm, H, T, window record, compressed record
    ("standard", False, 8, 1, 584, 288),
    ("interleaved", False, 8, 3, 528, 528),
    ("standard", True, 16, 7, 584, 584),
    ("interleaved", True, 16, 1, 528, 288),
    ("interleaved", True, 8, 7, 584, None),
    ("standard", False, 16, 3, 528, None),
]


@pytest.mark.parametrize("layout,norm,H,T,swa_rec,extra_rec", DECODE_CASES)
def test_decode_fused_matches_ref(device, layout, norm, H, T, swa_rec, extra_rec):
    G = H // 8
    args, _ = _decode_case(device, T, H, layout, swa_rec, extra_rec,
                           empty_token=T - 1 if T >= 3 else None)
    cs = make_cos_sin_cache(MAX_POS, device=device)
    pos = _positions(T, device, with_oob=T >= 3)
    data, scale, storage = _alloc_poisoned(T, G, device)
    d, s, lse = _decode_fused(args, pos, cs, norm, layout, data, scale)
    assert d is data and s is scale and _padding_untouched(storage, T)
    _check_pair_shapes(d, s, T, G)
    assert lse.dtype == torch.float32 and tuple(lse.shape) == (T, H)

    ref_r = _decode_ref(args, pos, cs, norm, layout, bf16_steps=True)
    ref_x = _decode_ref(args, pos, cs, norm, layout, bf16_steps=False)
    _check_vs_oracle(d, s, lse, ref_r, ref_x, norm, lse_idx=2, layout=layout)
    if T >= 3:  # the token without keys: zero output, lse +inf
        assert torch.isinf(lse[T - 1]).all() and (lse[T - 1] > 0).all()
        assert (d[T - 1].view(torch.uint8) & 0x7F == 0).all()

    # the reference path fed the same attention output: bit-equal scales
    a = args
    q_rot = q_norm_rope(a["q"], pos, cs, layout, norm, EPS)
    o, l2 = sparse_mla_decode(q_rot, a["kv"], a["indices"], a["topk_length"], a["extra_kv"],
                              a["extra_indices"], a["extra_topk_length"],
                              attn_sink=a["attn_sink"])
    assert torch.equal(l2, lse)
    pd, ps, _ = fused_epilogue_ref(o.cpu(), pos.cpu(), cs.cpu(), layout)
    assert_mxfp8_equal(d, s, pd, ps)


def test_decode_fused_defaults_and_sm_scale(device):
    """Keyword call with defaults (layout interleaved, n_wv_group derived, buffers allocated),
    a custom sm_scale, no sink, int64 positions."""
    T, H = 2, 8
    args, _ = _decode_case(device, T, H, "interleaved", 528, 288, sink=False)
    cs = make_cos_sin_cache(MAX_POS, device=device)
    pos = _positions(T, device).long()
    d, s, lse = sparse_mla_decode_fused(
        args["q"], args["kv"], args["indices"], 0.07, topk_length=args["topk_length"],
        extra_kv=args["extra_kv"], extra_indices=args["extra_indices"],
        extra_topk_length=args["extra_topk_length"], token_positions=pos, cos_sin_cache=cs,
        tile_scheduler_metadata=object(), num_splits=None)
    _check_pair_shapes(d, s, T, 1)
    ref_r = _decode_ref(args, pos, cs, False, "interleaved", bf16_steps=True, sm_scale=0.07)
    ref_x = _decode_ref(args, pos, cs, False, "interleaved", bf16_steps=False, sm_scale=0.07)
    _check_vs_oracle(d, s, lse, ref_r, ref_x, False, lse_idx=2, layout="interleaved")


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------
PREFILL_CASES = [
    # layout, norm, H, T, kv [S,1,512], indices [T,1,K], lens
    ("interleaved", False, 8, 1, False, False, True),
    ("standard", True, 8, 3, True, True, True),
    ("interleaved", True, 16, 7, True, False, False),
    ("standard", False, 16, 7, False, True, True),
]


@pytest.mark.parametrize("layout,norm,H,T,kv3,idx3,lens", PREFILL_CASES)
def test_prefill_fused_matches_ref(device, layout, norm, H, T, kv3, idx3, lens):
    G = H // 8
    args, _ = _prefill_case(device, T, H, layout, kv3=kv3, idx3=idx3, lens=lens,
                            empty_token=T - 1 if T >= 3 else None)
    cs = make_cos_sin_cache(MAX_POS, device=device)
    pos = _positions(T, device, with_oob=T >= 3)
    data, scale, storage = _alloc_poisoned(T, G, device)
    res = _prefill_fused(args, pos, cs, norm, layout, data, scale)
    assert len(res) == 4 and res[2] is None  # FlashMLA's (data, scale, max_logits, lse)
    d, s, _, lse = res
    assert d is data and s is scale and _padding_untouched(storage, T)
    _check_pair_shapes(d, s, T, G)

    ref_r = _prefill_ref(args, pos, cs, norm, layout, bf16_steps=True)
    ref_x = _prefill_ref(args, pos, cs, norm, layout, bf16_steps=False)
    _check_vs_oracle(d, s, lse, ref_r, ref_x, norm, lse_idx=3, layout=layout)
    if T >= 3:
        assert torch.isinf(lse[T - 1]).all() and (lse[T - 1] > 0).all()
        assert (d[T - 1].view(torch.uint8) & 0x7F == 0).all()

    a = args
    q_rot = q_norm_rope(a["q"], pos, cs, layout, norm, EPS)
    o, l2 = sparse_mla_prefill(q_rot, a["kv"], a["indices"], a["topk_length"],
                               attn_sink=a["attn_sink"])
    assert torch.equal(l2, lse)
    pd, ps, _ = fused_epilogue_ref(o.cpu(), pos.cpu(), cs.cpu(), layout)
    assert_mxfp8_equal(d, s, pd, ps)


def test_prefill_ref_max_logits():
    """The reference's max_logits (FlashMLA returns it; the Triton path does not) bounds lse:
    ``max <= lse <= max + log(n)``; -inf for a token without keys."""
    T, H = 4, 8
    args, _ = _prefill_case("cpu", T, H, "standard", empty_token=2, sink=False)
    cs = make_cos_sin_cache(MAX_POS)
    pos = _positions(T, "cpu")
    _, _, ml, lse, _ = _prefill_ref(args, pos, cs, True, "standard", bf16_steps=False)
    n = args["topk_length"].double()[:, None]
    ok = torch.ones(T, dtype=torch.bool)
    ok[2] = False
    assert (ml[ok] <= lse[ok] + 1e-12).all()
    assert (lse[ok] <= ml[ok] + torch.log(n[ok]) + 1e-12).all()
    assert torch.isneginf(ml[2]).all()


# --------------------------------------------------------------------------------------------
# layouts, buffers, empty input
# --------------------------------------------------------------------------------------------
def test_layouts_agree(device):
    """The same q given in either layout gives the same values, only permuted."""
    T, H = 2, 8
    args, qs = _decode_case(device, T, H, "standard", 584, 288)
    cs = make_cos_sin_cache(MAX_POS, device=device)
    pos = _positions(T, device)
    d1, s1, l1 = _decode_fused(args, pos, cs, True, "standard")
    args["q"] = q_to_interleaved(qs)
    d2, s2, l2 = _decode_fused(args, pos, cs, True, "interleaved")
    assert torch.equal(l1, l2)
    assert torch.equal(_deq_heads(d1, s1, "standard"), _deq_heads(d2, s2, "interleaved"))
    assert not torch.equal(d1.view(torch.uint8), d2.view(torch.uint8))


def test_token_range_slices_of_one_step_buffer(device):
    """vLLM's pattern: decode tokens [0, Td) and prefill tokens [Td, T) write token slices of
    one per-step pair; the result equals separate calls, padding rows stay untouched."""
    Td, Tp, H = 3, 4, 8
    T, G = Td + Tp, H // 8
    cs = make_cos_sin_cache(MAX_POS, device=device)
    pos = _positions(T, device)
    dec, _ = _decode_case(device, Td, H, "interleaved", 528, 288)
    pre, _ = _prefill_case(device, Tp, H, "interleaved")
    data, scale, storage = _alloc_poisoned(T, G, device)
    dd, ds, _ = _decode_fused(dec, pos[:Td], cs, False, "interleaved", data[:Td], scale[:Td])
    assert dd.data_ptr() == data.data_ptr()
    _no_nan(data[:Td])
    assert (data[Td:].view(torch.uint8) == 0x7F).all(), "decode wrote past its tokens"
    _prefill_fused(pre, pos[Td:], cs, False, "interleaved", data[Td:], scale[Td:])
    assert _padding_untouched(storage, T)
    d1, s1, _ = _decode_fused(dec, pos[:Td], cs, False, "interleaved")
    d2, s2, _, _ = _prefill_fused(pre, pos[Td:], cs, False, "interleaved")
    assert torch.equal(data[:Td].view(torch.uint8), d1.view(torch.uint8))
    assert torch.equal(data[Td:].view(torch.uint8), d2.view(torch.uint8))
    assert torch.equal(scale[:Td], s1) and torch.equal(scale[Td:], s2)


def test_half_of_the_output_pair_given(device):
    """The missing half is allocated; the result equals a call given neither."""
    T, H = 3, 8
    args, _ = _prefill_case(device, T, H, "standard")
    cs = make_cos_sin_cache(MAX_POS, device=device)
    pos = _positions(T, device)
    d0, s0, _, _ = _prefill_fused(args, pos, cs, False, "standard")
    data = poison_(torch.empty(T, 1, 4096, dtype=torch.float8_e4m3fn, device=device))
    d, s, _, _ = _prefill_fused(args, pos, cs, False, "standard", data=data)
    assert d is data
    _check_pair_shapes(d, s, T, 1)
    assert torch.equal(d.view(torch.uint8), d0.view(torch.uint8)) and torch.equal(s, s0)
    _, scale, _ = _alloc_poisoned(T, 1, device)
    d, s, _, _ = _prefill_fused(args, pos, cs, False, "standard", scale=scale)
    assert s is scale
    assert torch.equal(d.view(torch.uint8), d0.view(torch.uint8)) and torch.equal(s, s0)


def test_zero_tokens(device):
    H = 16
    args, _ = _decode_case(device, 0, H, "interleaved", 584, 288)
    cs = make_cos_sin_cache(MAX_POS, device=device)
    pos = torch.empty(0, dtype=torch.int32, device=device)
    d, s, lse = _decode_fused(args, pos, cs, True, "interleaved")
    assert d.shape == (0, 2, 4096) and s.shape == (0, 2, 32) and lse.shape == (0, H)
    pargs, _ = _prefill_case(device, 0, H, "standard")
    d, s, _, lse = _prefill_fused(pargs, pos, cs, False, "standard")
    assert d.shape == (0, 2, 4096) and lse.shape == (0, H)


# --------------------------------------------------------------------------------------------
# bad input: raise before any launch, buffers untouched
# --------------------------------------------------------------------------------------------
def _bad_decode_calls(device):
    T, H = 3, 8
    args, qs = _decode_case(device, T, H, "standard", 584, 288)
    cs = make_cos_sin_cache(64, device=device)
    pos = _positions(T, device) % 64
    data, scale = alloc_mxfp8_output(T, 1, device)
    base = dict(q=args["q"], kv=args["kv"], indices=args["indices"],
                topk_length=args["topk_length"], extra_kv=args["extra_kv"],
                extra_indices=args["extra_indices"],
                extra_topk_length=args["extra_topk_length"], attn_sink=args["attn_sink"],
                token_positions=pos, cos_sin_cache=cs, data=data, scale=scale,
                layout="standard")

    def with_(**kw):
        d = dict(base)
        d.update(kw)
        return d

    q12 = torch.randn(T, 12, 512).to(torch.bfloat16).to(device)
    q4 = torch.randn(T, 4, 512).to(torch.bfloat16).to(device)
    q_gap = torch.randn(T, 2 * H, 512).to(torch.bfloat16).to(device)[:, ::2]
    contiguous_scale = torch.empty(T, 1, 32, dtype=torch.int32, device=device)
    odd_stride_scale = torch.empty(T * 5 * 32, dtype=torch.int32, device=device).as_strided(
        (T, 1, 32), (1, 32 * 5, 5))
    bad = [
        (ValueError, with_(q=q12, attn_sink=None)),  # H not a multiple of 8
        (ValueError, with_(q=q4, attn_sink=None)),
        (ValueError, with_(layout="blocked")),
        (ValueError, with_(q=q_gap, layout="interleaved")),  # token's values not contiguous
        (TypeError, with_(q=args["q"].float())),
        (TypeError, with_(data=torch.empty(T, 1, 4096, dtype=torch.bfloat16, device=device))),
        (ValueError, with_(data=torch.empty(T, 2, 4096, dtype=torch.float8_e4m3fn, device=device))),
        (TypeError, with_(scale=scale.to(torch.int64))),
        (ValueError, with_(scale=contiguous_scale)),  # token-major, not MN-major
        (ValueError, with_(scale=odd_stride_scale)),  # stride(2) not a multiple of 4
        (ValueError, with_(is_rope_neox_style=True)),
        (ValueError, with_(rope_dim=128)),
        (ValueError, with_(num_per_channels=128)),
        (ValueError, with_(use_packed_ue8m0=False)),
        (ValueError, with_(use_tma_aligned_col_major_sf=False)),
        (ValueError, with_(round_sf=False)),
        (ValueError, with_(d_v=448)),
        (ValueError, with_(n_wv_group=2)),
        (TypeError, with_(n_wv_group=1.0)),
        (ValueError, with_(token_positions=None)),
        (ValueError, with_(cos_sin_cache=None)),
        (ValueError, with_(token_positions=pos[:2])),
        (TypeError, with_(token_positions=pos.float())),
        (TypeError, with_(cos_sin_cache=cs.half())),
        (ValueError, with_(cos_sin_cache=cs[:, :32])),
        (ValueError, with_(attn_sink=torch.zeros(H + 1, device=device))),
        (TypeError, with_(sm_scale="0.1")),
        (ValueError, with_(sm_scale=float("nan"))),
        (TypeError, with_(enable_q_norm=1)),
        (ValueError, with_(enable_q_norm=True, rms_norm_eps=-1.0)),
        (TypeError, with_(rms_norm_eps=None)),
        (ValueError, with_(indices=args["indices"][:2])),
        (TypeError, with_(indices=args["indices"].float())),
        (ValueError, with_(topk_length=args["topk_length"][:1])),
        (ValueError, with_(kv=random_k_cache(2, 16, 288, device))),  # nvfp4 window
        (TypeError, with_(kv=args["kv"].view(torch.int8))),
        (ValueError, with_(extra_kv=None)),  # extra indices without the cache
        (ValueError, with_(extra_indices=None, extra_topk_length=None)),
        (ValueError, with_(extra_indices=args["extra_indices"][:, None])),
        (TypeError, with_(data=[1, 2, 3])),
        (TypeError, with_(q=[[0.5] * 512])),
    ]
    return bad, data, scale


def _forbid_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel was launched before the bad argument was caught")

    monkeypatch.setattr(fused_mod, "_launch_q_prologue", boom)
    monkeypatch.setattr(fused_mod, "rope_mxfp8_epilogue", boom)
    monkeypatch.setattr(fused_mod, "sparse_mla_decode", boom)
    monkeypatch.setattr(fused_mod, "sparse_mla_prefill", boom)


def _expect_errors(fn, cases):
    for i, (exc, kw) in enumerate(cases):
        try:
            fn(**kw)
        except exc:
            continue
        except Exception as e:  # noqa: BLE001 - report which case went wrong
            pytest.fail(f"case {i}: expected {exc.__name__}, got {type(e).__name__}: {e}")
        pytest.fail(f"case {i}: expected {exc.__name__}, nothing raised")


def test_decode_bad_inputs_raise_before_launch(device, monkeypatch):
    bad, data, scale = _bad_decode_calls(device)
    poison_(data)
    scale.fill_(SENTINEL)
    _forbid_launch(monkeypatch)
    _expect_errors(sparse_mla_decode_fused, bad)
    assert (data.view(torch.uint8) == 0x7F).all() and (scale == SENTINEL).all()


def test_prefill_bad_inputs_raise_before_launch(device, monkeypatch):
    T, H = 3, 8
    args, _ = _prefill_case(device, T, H, "standard")
    cs = make_cos_sin_cache(64, device=device)
    pos = _positions(T, device) % 64
    base = dict(q=args["q"], kv=args["kv"], indices=args["indices"],
                topk_length=args["topk_length"], attn_sink=args["attn_sink"],
                token_positions=pos, cos_sin_cache=cs, layout="standard")

    def with_(**kw):
        d = dict(base)
        d.update(kw)
        return d

    S = args["kv"].shape[0]
    bad = [
        (ValueError, with_(kv=torch.zeros(S, 2, 512, dtype=torch.bfloat16, device=device))),
        (TypeError, with_(kv=args["kv"].float())),
        (ValueError, with_(kv=args["kv"][:, :256])),
        (ValueError, with_(indices=args["indices"].view(T, 1, -1).expand(T, 2, -1))),
        (ValueError, with_(indices=args["indices"][:1])),
        (TypeError, with_(indices=args["indices"].to(torch.int16))),
        (ValueError, with_(topk_length=args["topk_length"][:2])),
        (ValueError, with_(q=torch.randn(T, 9, 512).to(torch.bfloat16).to(device),
                           attn_sink=None)),
        (ValueError, with_(layout="Standard")),
        (ValueError, with_(scale=torch.empty(T, 1, 32, dtype=torch.int32, device=device))),
    ]
    _forbid_launch(monkeypatch)
    _expect_errors(sparse_mla_prefill_fused, bad)


def test_check_fused_output_accepts_slices():
    data, scale = alloc_mxfp8_output(10, 2)
    check_fused_output(data[3:9], scale[3:9], 6, 2, torch.device("cpu"))
    check_fused_output(data[9:], scale[9:], 1, 2, torch.device("cpu"))
    with pytest.raises(ValueError):
        check_fused_output(data, scale.contiguous(), 10, 2, torch.device("cpu"))


def test_q_norm_rope_bad_inputs():
    cs = make_cos_sin_cache(64)
    q = torch.randn(2, 8, 512).to(torch.bfloat16)
    pos = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError):
        q_norm_rope(q, pos, cs, "chunked")
    with pytest.raises(ValueError):
        q_norm_rope(q, pos, cs, "standard", out=q)  # aliasing
    with pytest.raises(TypeError):
        q_norm_rope(q, pos, cs, "standard", out=torch.empty(2, 8, 512))
    with pytest.raises(ValueError):
        q_norm_rope(q, pos[:1], cs, "standard")


# --------------------------------------------------------------------------------------------
# GPU: real head counts and key sets, > 2**31 elements
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("layout,norm", [("interleaved", False), ("standard", True)])
def test_decode_fused_gpu(H, layout, norm):
    T = 48
    args, _ = _decode_case(GPU, T, H, layout, 528, 288, Ws=128, K=512, page=64, nb=40,
                           empty_token=5)
    cs = make_cos_sin_cache(1 << 17, device=GPU)
    pos = torch.randint(0, 1 << 17, (T,), dtype=torch.int32, device=GPU)
    d, s, lse = _decode_fused(args, pos, cs, norm, layout)
    ref_r = _decode_ref(args, pos, cs, norm, layout, bf16_steps=True)
    ref_x = _decode_ref(args, pos, cs, norm, layout, bf16_steps=False)
    _check_vs_oracle(d, s, lse, ref_r, ref_x, norm, lse_idx=2, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("layout,norm", [("interleaved", True), ("standard", False)])
def test_prefill_fused_gpu(H, layout, norm):
    T, S, K = 96, 3000, 640
    args, _ = _prefill_case(GPU, T, H, layout, S=S, K=K, kv3=True, idx3=True,
                            empty_token=7)
    cs = make_cos_sin_cache(1 << 17, device=GPU)
    pos = torch.randint(0, 1 << 17, (T,), dtype=torch.int32, device=GPU)
    d, s, ml, lse = _prefill_fused(args, pos, cs, norm, layout)
    assert ml is None
    ref_r = _prefill_ref(args, pos, cs, norm, layout, bf16_steps=True)
    ref_x = _prefill_ref(args, pos, cs, norm, layout, bf16_steps=False)
    _check_vs_oracle(d, s, lse, ref_r, ref_x, norm, lse_idx=3, layout=layout)


@pytest.mark.gpu
def test_prefill_fused_int64_offsets_gpu():
    """q and the output pair past 2**31 elements: the tail tokens land where they should."""
    H, K, S = 128, 8, 64
    T = INT64_ELEMS // (H * 512) + 40  # q: > 2**31 elements (> 4 GiB)
    cs = make_cos_sin_cache(1 << 16, device=GPU)
    q = torch.randn(T, H, 512, device=GPU).to(torch.bfloat16)
    kv = torch.randn(S, 512, device=GPU).to(torch.bfloat16)
    idx = torch.randint(0, S, (T, K), dtype=torch.int32, device=GPU)
    pos = torch.randint(0, 1 << 16, (T,), dtype=torch.int32, device=GPU)
    data, scale = alloc_mxfp8_output(T, H // 8, GPU)
    poison_(data[-8:])
    d, s, _, lse = sparse_mla_prefill_fused(q, kv, idx, None, 512, None, None, True, EPS, pos,
                                            False, 64, cs, H // 8, 32, True, True, True, data,
                                            scale, layout="interleaved")
    tail = slice(T - 8, T)
    ref = sparse_mla_prefill_fused_ref(q[tail].cpu(), kv.cpu(), idx[tail].cpu(), None, None,
                                       None, True, EPS, pos[tail].cpu(), cs.cpu(),
                                       layout="interleaved", bf16_steps=True)
    assert max_abs_err(lse[tail].cpu(), ref[3]) <= LSE_TOL
    assert_mxfp8_close(d[tail], s[tail], ref[0], ref[1])


@pytest.mark.gpu
def test_decode_fused_cuda_graph():
    """Fixed shapes, no host sync: the whole fused decode captures into a CUDA graph, and a
    replay on new inputs (copied into the captured tensors) equals an eager call."""
    T, H, layout = 8, 64, "interleaved"
    args, _ = _decode_case(GPU, T, H, layout, 528, 288, Ws=128, K=512, page=64, nb=40)
    cs = make_cos_sin_cache(1 << 17, device=GPU)
    pos = torch.randint(0, 1 << 17, (T,), dtype=torch.int32, device=GPU)
    data, scale = alloc_mxfp8_output(T, H // 8, GPU)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles the kernels) outside the capture
        _decode_fused(args, pos, cs, True, layout, data, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, _, lse_g = _decode_fused(args, pos, cs, True, layout, data, scale)
    args["q"].copy_(torch.randn(T, H, 512, device=GPU).to(torch.bfloat16))
    pos.copy_(torch.randint(0, 1 << 17, (T,), dtype=torch.int32, device=GPU))
    poison_(data)
    graph.replay()
    torch.cuda.synchronize()
    d, s, lse = _decode_fused(args, pos, cs, True, layout)
    assert torch.equal(data.view(torch.uint8), d.view(torch.uint8))
    assert torch.equal(scale, s) and torch.equal(lse_g, lse)
