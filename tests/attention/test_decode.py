"""``sparse_mla_decode`` (Triton) against the float64 reference on fresh random records.

CPU: the Triton interpreter, small shapes (<= 7 tokens, <= ~200 keys). GPU-marked: V4.1 shapes,
64/128 heads, a > 2 GiB cache (int64 byte offsets), CUDA-graph capture and replay.
"""
import pytest
import torch

from dsv41_triton.attention import _configs
from dsv41_triton.attention._kernels import (GPU_CANDIDATES, MIN_BLOCK_N_GPU, KernelConfig,
                                             config_shape, default_config)
from dsv41_triton.attention.decode import sparse_mla_decode
from dsv41_triton.attention.ref import sparse_mla_decode_ref
from dsv41_triton.ops.records import (get_record_format)
from dsv41_triton.testing import (assert_graph_replay, large_offset_decode_case, max_abs_err,
                                  poison_, random_k_cache, rel_err)

OUT_TOL = 1e-2
#: key block for explicit configs: small on the CPU (more blocks per split in small cases);
#: a GPU refuses blocks under MIN_BLOCK_N_GPU
BN = 16 if not torch.cuda.is_available() else MIN_BLOCK_N_GPU
LSE_TOL = 1e-3


def _slots(T, W, nslots, device, p_neg=0.1):
    idx = torch.randint(0, nslots, (T, W), dtype=torch.int32)
    idx[torch.rand(T, W) < p_neg] = -1
    return idx.to(device)


def _case(device, T, H, swa_rec=584, extra_rec=584, Ws=24, K=40, page=16, nb_a=6, nb_b=9,
          q_scale=1.0, sink="rand"):
    ca = random_k_cache(nb_a, page, swa_rec, device)
    cb = random_k_cache(nb_b, page, extra_rec, device) if extra_rec else None
    ia = _slots(T, Ws, nb_a * page, device)
    la = torch.randint(0, Ws + 1, (T,), dtype=torch.int32).to(device)
    ib = lb = None
    if extra_rec:
        ib = _slots(T, K, nb_b * page, device)
        lb = torch.randint(0, K + 1, (T,), dtype=torch.int32).to(device)
    q = (torch.randn(T, H, 512) * q_scale).to(torch.bfloat16).to(device)
    s = None
    if sink == "rand":
        s = torch.randn(H).to(device)
    elif sink == "-inf":
        s = torch.full((H,), float("-inf"), device=device)
    elif sink == "large":
        s = torch.full((H,), 80.0, device=device)
    return dict(q=q, swa_cache=ca, swa_indices=ia, swa_lens=la, extra_cache=cb,
                extra_indices=ib, extra_lens=lb, attn_sink=s)


def _check(args, config=None, scale=None, out=None):
    T, H = args["q"].shape[:2]
    if out is None:
        out = poison_(torch.empty(T, H, 512, dtype=torch.bfloat16, device=args["q"].device))
    o, lse = sparse_mla_decode(**args, softmax_scale=scale, out=out, _config=config)
    assert o.data_ptr() == out.data_ptr()
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert lse.shape == (T, H)
    ro, rl = sparse_mla_decode_ref(**args, softmax_scale=scale)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    e_o, e_l = rel_err(o, ro), max_abs_err(lse, rl)
    assert e_o <= OUT_TOL, e_o
    assert e_l <= LSE_TOL, e_l
    return o, lse, ro, rl


@pytest.mark.parametrize("H", [1, 3, 8, 16])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (584, 528), (528, 288), (584, 288),
                                               (528, 528)])
def test_decode_records_heads(device, H, swa_rec, extra_rec):
    args = _case(device, 3, H, swa_rec, extra_rec)
    _check(args)


@pytest.mark.parametrize("H", [1, 3, 16])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (584, 528), (528, 288), (584, 288),
                                               (528, 528), (584, None), (528, None)])
@pytest.mark.parametrize("splits,lazy", [(1, False), (3, True)])
def test_decode_record_pairs_splits(device, H, swa_rec, extra_rec, splits, lazy):
    """Every record pair, with and without splits (and the lazy rescale); Ws/K not
    multiples of the key block, lens and -1 inside the rows."""
    args = _case(device, 3, H, swa_rec, extra_rec, Ws=37, K=45)
    _check(args, KernelConfig(16, BN, splits, lazy_rescale=lazy))


@pytest.mark.parametrize("T,H,splits", [(1, 33, 5), (16, 1, 3), (17, 1, 3), (9, 20, 2)])
def test_decode_split_merge_forms(device, T, H, splits):
    """Both forms of the split merge: all splits' partials at once over value-dim chunks (at
    most ``SMALL_MERGE`` token x head-tile programs) and the loop over the splits (more);
    T=16 / 17 at one head sit on either side of the boundary."""
    from dsv41_triton.attention._launch import SMALL_MERGE, small_merge
    assert small_merge(16, 1) and not small_merge(17, 1) and SMALL_MERGE == 16
    assert small_merge(1, 33) and not small_merge(9, 20)
    _check(_case(device, T, H, Ws=37, K=45), KernelConfig(16, BN, splits))


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_lazy_rescale_growing_max(device, splits):
    """Lazy rescale on sharp logits (std of ~40 in log2 units: row maxima jump by more than
    2**8 between blocks, and stay within 2**8 in others), and on mild ones; same result as
    the eager rescale and the float64 reference."""
    for scale in (0.3, None):
        args = _case(device, 3, 3, Ws=48, K=64, sink="rand")
        outs = []
        for lazy in (False, True):
            cfg = KernelConfig(16, BN, splits, lazy_rescale=lazy)
            outs.append(_check(args, cfg, scale=scale)[0])
        assert rel_err(outs[1], outs[0]) < 5e-3


@pytest.mark.parametrize("swa_rec", [584, 528])
def test_decode_window_only(device, swa_rec):
    args = _case(device, 5, 3, swa_rec, None, Ws=70)
    _check(args)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_decode_split_k(device, splits):
    args = _case(device, 4, 8, 584, 288, Ws=40, K=90)
    o1, l1, _, _ = _check(args, KernelConfig(block_h=16, block_n=BN, num_splits=1))
    os_, ls, _, _ = _check(args, KernelConfig(block_h=16, block_n=BN, num_splits=splits))
    # same math, other reduction order
    assert rel_err(os_, o1) < 5e-3


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_nan_sink_makes_the_whole_head_nan(device, splits):
    """A NaN sink: every row of its head is NaN, a token without keys included; other heads
    as the reference (0 / +inf for that token); lse unaffected (non-split epilogue and the
    split merge)."""
    args = _case(device, 3, 3, 584, 288, Ws=37, K=45)
    args["attn_sink"] = torch.tensor([0.5, float("nan"), -1.0], device=device)
    args["swa_lens"][1] = 0
    args["extra_lens"][1] = 0
    out = poison_(torch.empty(3, 3, 512, dtype=torch.bfloat16, device=device))
    o, lse = sparse_mla_decode(**args, out=out, _config=KernelConfig(16, BN, splits))
    ro, rl = sparse_mla_decode_ref(**args)
    assert torch.isnan(o[:, 1]).all() and torch.isnan(ro[:, 1]).all()
    keep = [0, 2]
    assert rel_err(o[:, keep], ro[:, keep]) <= OUT_TOL
    assert (o[1, keep] == 0).all()
    assert max_abs_err(lse, rl) <= LSE_TOL
    assert (lse[1] == float("inf")).all() and torch.isfinite(lse[[0, 2]]).all()


def test_decode_seven_tokens_one_token(device):
    _check(_case(device, 7, 3, K=100, Ws=30))
    _check(_case(device, 1, 8, K=130, Ws=60), KernelConfig(16, 32, 2))


def test_decode_lens_and_negative_indices(device):
    args = _case(device, 4, 3, Ws=32, K=48)
    # lens shorter than the width, with garbage past len that must not be read
    args["swa_lens"] = torch.tensor([5, 32, 0, 17], dtype=torch.int32, device=device)
    args["extra_lens"] = torch.tensor([48, 1, 20, 0], dtype=torch.int32, device=device)
    args["swa_indices"][0, 5:] = 10 ** 6  # out of range but past len: never read
    args["extra_indices"][2, :20:3] = -1
    args["extra_indices"][1, 0] = -1  # the only extra column of token 1 skipped
    o, lse, _, _ = _check(args)
    # lens past the width are clamped to it
    args["extra_lens"] = torch.tensor([999, 48, 48, 48], dtype=torch.int32, device=device)
    _check(args)


def test_decode_empty_rows(device):
    args = _case(device, 5, 3, Ws=20, K=30)
    args["swa_lens"][1] = 0
    args["extra_lens"][1] = 0  # token 1: no columns
    args["swa_indices"][3] = -1
    args["extra_indices"][3] = -1  # token 3: only -1
    args["extra_indices"][4, :] = 10 ** 7  # token 4's extra slots are past the cache
    args["swa_lens"][4] = 0
    for cfg in (KernelConfig(16, BN, 1),
                KernelConfig(16, BN, 3)):
        o, lse, _, _ = _check(args, cfg)
        for t in (1, 3, 4):
            assert torch.all(o[t] == 0)
            assert torch.all(torch.isinf(lse[t]) & (lse[t] > 0))


def test_decode_all_empty(device):
    args = _case(device, 3, 16, Ws=16, K=16)
    args["swa_lens"].zero_()
    args["extra_indices"].fill_(-1)
    for cfg in (KernelConfig(16, BN, 1),
                KernelConfig(16, BN, 2)):
        out = poison_(torch.empty(3, 16, 512, dtype=torch.bfloat16, device=device))
        o, lse = sparse_mla_decode(**args, out=out, _config=cfg)
        assert torch.all(o == 0)
        assert torch.all(lse == float("inf"))


@pytest.mark.parametrize("sink", [None, "-inf", "large"])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_sink(device, sink, splits):
    args = _case(device, 3, 3, sink=sink)
    cfg = KernelConfig(16, BN, splits)
    o, lse, ro, rl = _check(args, cfg)
    if sink == "large":
        assert o.abs().max().item() < 1e-20
    if sink == "-inf":
        args2 = dict(args, attn_sink=None)
        o2, l2 = sparse_mla_decode(**args2, _config=cfg)
        assert torch.equal(o, o2) and torch.equal(lse, l2)


@pytest.mark.parametrize("cfg", [None, KernelConfig(16, BN, 2),
                                 KernelConfig(16, BN, 1, lazy_rescale=True)])
def test_decode_sharp_softmax_and_scale(device, cfg):
    args = _case(device, 3, 8, q_scale=6.0)
    _check(args, cfg)
    _check(args, cfg, scale=0.01)


def test_decode_layouts(device):
    """Padded block stride, 4-D cache view, odd page size, strided q/out, int64 indices."""
    T, H, page = 3, 3, 5
    fmt = get_record_format(584)
    ca = random_k_cache(7, page, 584, device, block_stride=fmt.block_bytes(page) + 576 * 2)
    cb = random_k_cache(11, page, 288, device)
    ia = _slots(T, 19, 7 * page, device).long()
    ib = _slots(T, 33, 11 * page, device)
    la = torch.tensor([19, 3, 11], dtype=torch.int32, device=device)
    qbig = torch.randn(T, 2 * H, 1024).to(torch.bfloat16).to(device)
    q = qbig[:, ::2, 256:768]
    obig = poison_(torch.empty(T, H + 2, 600, dtype=torch.bfloat16, device=device))
    out = obig[:, 1:H + 1, 50:562]
    args = dict(q=q, swa_cache=ca.unsqueeze(2), swa_indices=ia, swa_lens=la, extra_cache=cb,
                extra_indices=ib, extra_lens=None, attn_sink=torch.randn(H, device=device))
    _check(args, KernelConfig(16, BN, 2), out=out)
    # nothing outside the owned rows was written
    assert torch.isnan(obig[:, 0]).all() and torch.isnan(obig[:, H + 1]).all()
    assert torch.isnan(obig[:, :, :50]).all() and torch.isnan(obig[:, :, 562:]).all()


def test_decode_zero_tokens(device):
    args = _case(device, 1, 3)
    args = {k: (v[:0] if k in ("q", "swa_indices", "swa_lens", "extra_indices", "extra_lens")
                else v) for k, v in args.items()}
    o, lse = sparse_mla_decode(**args)
    assert o.shape == (0, 3, 512) and lse.shape == (0, 3)


# --------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------
def test_decode_bad_inputs(device):
    a = _case(device, 2, 3)

    def call(exc, match, **kw):
        args = dict(a)
        args.update(kw)
        with pytest.raises(exc, match=match):
            sparse_mla_decode(**args)

    call(TypeError, "q", q=a["q"].float())
    call(ValueError, "q", q=a["q"][..., :256])
    call(ValueError, "q", q=a["q"][0])
    call(ValueError, "q", q=torch.randn(2, 3, 1024, device=device).to(torch.bfloat16)[..., ::2])
    call(ValueError, "swa_indices", swa_indices=a["swa_indices"][:1])
    call(TypeError, "swa_indices", swa_indices=a["swa_indices"].float())
    call(ValueError, "swa_lens", swa_lens=a["swa_lens"][:1])
    call(TypeError, "swa_lens", swa_lens=a["swa_lens"].float())
    call(ValueError, "extra_indices", extra_indices=a["extra_indices"][:1])
    call(ValueError, "extra_lens", extra_lens=torch.zeros(5, dtype=torch.int32, device=device))
    call(ValueError, "extra_indices", extra_indices=None)
    call(ValueError, "extra_cache", extra_cache=None)
    call(ValueError, "attn_sink", attn_sink=torch.zeros(4, device=device))
    call(TypeError, "attn_sink", attn_sink=torch.zeros(3, device=device, dtype=torch.float64))
    call(TypeError, "softmax_scale", softmax_scale="x")
    call(ValueError, "softmax_scale", softmax_scale=float("nan"))
    call(ValueError, "out", out=torch.empty(2, 4, 512, dtype=torch.bfloat16, device=device))
    call(TypeError, "out", out=torch.empty(2, 3, 512, dtype=torch.float32, device=device))
    # record widths
    call(ValueError, "swa_cache", swa_cache=random_k_cache(2, 16, 288, device))
    call(ValueError, "extra_cache", extra_cache=torch.zeros(2, 16, 512, dtype=torch.uint8,
                                                            device=device))
    call(TypeError, "swa_cache", swa_cache=a["swa_cache"].view(torch.int8))
    # nothing was launched: a bad call leaves out untouched
    out = poison_(torch.empty(2, 3, 512, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError):
        sparse_mla_decode(**dict(a, attn_sink=torch.zeros(4, device=device)), out=out)
    assert torch.isnan(out).all()


def test_kernel_config_validation():
    for bad in (dict(block_h=8), dict(block_h=48), dict(block_n=512), dict(num_splits=0),
                dict(num_warps=3), dict(num_stages=0), dict(variant="fast"),
                dict(variant="tile"), dict(lazy_rescale=1)):
        kw = dict(block_h=16, block_n=32, num_splits=1)
        kw.update(bad)
        with pytest.raises(ValueError, match="KernelConfig"):
            KernelConfig(**kw)


def test_default_config_only_returns_gpu_candidates(monkeypatch):
    """Every launch shape the GPU defaults can pick (sm_90, another CUDA GPU, ROCm) is one the
    GPU tests below run."""
    monkeypatch.setattr(_configs, "is_interpreter", lambda: False)
    monkeypatch.setattr(_configs, "_sm_count", lambda device: 132)
    default_config.cache_clear()
    try:
        dev = torch.device("cuda")
        for cap, hip in (((9, 0), None), ((8, 0), None), ((10, 0), None), ((12, 0), None),
                         ((8, 9), None), ((9, 4), "6.2")):
            monkeypatch.setattr(_configs, "_capability", lambda device, c=cap: c)
            monkeypatch.setattr(torch.version, "hip", hip)
            default_config.cache_clear()
            assert _configs.arch_key(dev) == ("rocm" if hip else "cuda", cap)
            for paged, fam in ((True, "decode"), (False, "prefill")):
                for T in (1, 2, 7, 16, 33, 128, 512, 4096):
                    for H in (1, 3, 8, 16, 24, 32, 40, 64, 128):
                        cfg = default_config(T, H, 640, dev, paged=paged)
                        assert config_shape(cfg) in GPU_CANDIDATES[fam], (fam, T, H, cfg)
                        assert cfg.block_n >= MIN_BLOCK_N_GPU
                        assert 1 <= cfg.num_splits <= 32
    finally:
        default_config.cache_clear()


def test_default_config_sm90_shapes(monkeypatch):
    """The sm_90 entry of the launch table: the H200 picks (head tile, shape, splits)."""
    monkeypatch.setattr(_configs, "is_interpreter", lambda: False)
    monkeypatch.setattr(_configs, "_sm_count", lambda device: 132)
    monkeypatch.setattr(_configs, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    default_config.cache_clear()
    try:
        dev = torch.device("cuda")
        assert default_config(128, 8, 640, dev, paged=True) == KernelConfig(16, 64, 2, 4, 2)
        assert default_config(128, 64, 640, dev, paged=True) == KernelConfig(64, 64, 1, 8, 2)
        assert default_config(1, 64, 640, dev, paged=True) == KernelConfig(16, 64, 10, 4, 2)
        assert default_config(4096, 8, 640, dev, paged=False) == KernelConfig(
            16, 64, 1, 4, 3, lazy_rescale=True)
        assert default_config(4096, 64, 640, dev, paged=False) == KernelConfig(64, 64, 1, 8, 3)
        assert default_config(4096, 32, 640, dev, paged=False) == KernelConfig(32, 64, 1, 4, 3)
    finally:
        default_config.cache_clear()


def test_default_config_interpreter():
    """CPU tensors: the interpreter entry (64-key steps, one split, head tile from H)."""
    cpu = torch.device("cpu")
    assert _configs.arch_key(cpu) == ("interpreter", None)
    assert default_config(3, 3, 100, cpu, paged=True) == KernelConfig(16, 64, 1, 4, 1)
    assert default_config(3, 40, 100, cpu, paged=False) == KernelConfig(64, 64, 1, 4, 1)
    assert default_config(3, 3, 100, cpu, paged=True, block_h=32, block_n=16) == \
        KernelConfig(32, 16, 1, 4, 1)


# --------------------------------------------------------------------------------------------
# GPU: V4.1 shapes, int64 offsets, CUDA graphs
# --------------------------------------------------------------------------------------------
def _v41_case(device, T, H, extra_rec=584, nb=512, page=64, W=128, K=512, swa_rec=584):
    ca = random_k_cache(nb, page, swa_rec, device)
    cb = random_k_cache(nb, page, extra_rec, device)
    ia = torch.randint(0, nb * page, (T, W), dtype=torch.int32, device=device)
    ib = torch.randint(0, nb * page, (T, K), dtype=torch.int32, device=device)
    la = torch.randint(1, W + 1, (T,), dtype=torch.int32, device=device)
    lb = torch.randint(0, K + 1, (T,), dtype=torch.int32, device=device)
    q = torch.randn(T, H, 512, device=device).to(torch.bfloat16)
    return dict(q=q, swa_cache=ca, swa_indices=ia, swa_lens=la, extra_cache=cb,
                extra_indices=ib, extra_lens=lb, attn_sink=torch.randn(H, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("T", [1, 37, 128, 600])
def test_decode_v41_shapes_gpu(device, H, T):
    _check(_v41_case(device, T, H))


@pytest.mark.gpu
@pytest.mark.parametrize("cand", GPU_CANDIDATES["decode"], ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("splits,swa_rec,extra_rec", [(1, 584, 584), (3, 584, 288),
                                                      (2, 528, 528), (20, 584, 584)])
def test_decode_gpu_configs(device, cand, splits, swa_rec, extra_rec):
    """Every launch shape the defaults or the benchmark sweep use (GPU_CANDIDATES), without a
    split (the kernel applies the sink itself) and with splits (merge kernel), on the V4.1
    record pair and on the other dequant paths; 40 heads = two full 16-head tiles + a partial
    one (or a partial 64-head tile)."""
    variant, bh, bn, warps, stages, lazy = cand
    cfg = KernelConfig(bh, bn, splits, warps, stages, variant=variant, lazy_rescale=lazy)
    _check(_v41_case(device, 19, 40, extra_rec, swa_rec=swa_rec), cfg)


def test_split_merge_pdl_off_without_gpu():
    """The programmatic dependent launch of the split merge is never used on the CPU or in
    the interpreter (it needs sm_90+ and griddepcontrol)."""
    from dsv41_triton.attention._launch import pdl_enabled
    assert not pdl_enabled(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,splits", [(1, 64, 10), (7, 8, 3), (33, 40, 20)])
def test_decode_split_merge_pdl_gpu(device, monkeypatch, T, H, splits):
    """The tl split kernel with its merge as a programmatic dependent launch (the sm_90
    default) gives the same bits as the stream-ordered merge (``DSV41_PDL=0``), and matches
    the reference."""
    from dsv41_triton.attention._launch import PDL_ENV
    args = _v41_case(device, T, H)
    cfg = KernelConfig(16, 64, splits, 4, 2)
    monkeypatch.setenv(PDL_ENV, "0")
    o0, l0 = (x.clone() for x in _check(args, cfg)[:2])
    monkeypatch.setenv(PDL_ENV, "1")
    o1, l1 = _check(args, cfg)[:2]
    assert torch.equal(o0, o1) and torch.equal(l0, l1)


@pytest.mark.gpu
def test_decode_small_block_refused_gpu(device):
    args = _case(device, 2, 8)
    with pytest.raises(ValueError, match="block_n"):
        sparse_mla_decode(**args, _config=KernelConfig(16, 16, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("extra_rec", [528, 288])
def test_decode_v41_records_gpu(device, extra_rec):
    _check(_v41_case(device, 64, 64, extra_rec))


@pytest.mark.gpu
def test_decode_int64_offsets_gpu(device):
    """A cache of > 2 GiB: slots in its last blocks have byte offsets beyond 2**31."""
    _check(large_offset_decode_case(device))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 64), (32, 8), (128, 16)])
def test_decode_cuda_graph_gpu(device, T, H):
    static = _v41_case(device, T, H)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device)
    fresh = _v41_case(device, T, H)
    names = ("q", "swa_indices", "swa_lens", "extra_indices", "extra_lens", "attn_sink")
    assert_graph_replay(sparse_mla_decode, static, {n: fresh[n] for n in names}, out,
                        sparse_mla_decode_ref, out_tol=OUT_TOL, lse_tol=LSE_TOL)

