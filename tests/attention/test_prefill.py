"""``sparse_mla_prefill`` (Triton) against the float64 reference on fresh random workspaces."""
import pytest
import torch

from dsv41_triton.attention._kernels import GPU_CANDIDATES, MIN_BLOCK_N_GPU, KernelConfig
from dsv41_triton.attention.prefill import sparse_mla_prefill
from dsv41_triton.attention.ref import sparse_mla_prefill_ref
from dsv41_triton.testing import max_abs_err, poison_, rel_err

OUT_TOL = 1e-2
#: key block for explicit configs: small on the CPU (more blocks per split in small cases);
#: a GPU refuses blocks under MIN_BLOCK_N_GPU
BN = 16 if not torch.cuda.is_available() else MIN_BLOCK_N_GPU
LSE_TOL = 1e-3


def _case(device, T, H, S=60, K=50, p_neg=0.1, p_oob=0.05, lens=True, sink="rand", q_scale=1.0):
    kv = (torch.randn(S, 512) * torch.exp2(torch.randint(-2, 3, (S, 1)).float())).to(
        torch.bfloat16).to(device)
    idx = torch.randint(0, S, (T, K), dtype=torch.int32)
    r = torch.rand(T, K)
    idx[r < p_neg] = -1
    idx[(r >= p_neg) & (r < p_neg + p_oob)] = S + 3  # past the workspace: skipped
    q = (torch.randn(T, H, 512) * q_scale).to(torch.bfloat16).to(device)
    ln = torch.randint(0, K + 1, (T,), dtype=torch.int32).to(device) if lens else None
    s = {"rand": lambda: torch.randn(H).to(device), None: lambda: None,
         "-inf": lambda: torch.full((H,), float("-inf"), device=device),
         "large": lambda: torch.full((H,), 60.0, device=device)}[sink]()
    return dict(q=q, kv=kv, indices=idx.to(device), lens=ln, attn_sink=s)


def _check(args, config=None, scale=None, out=None):
    T, H = args["q"].shape[:2]
    if out is None:
        out = poison_(torch.empty(T, H, 512, dtype=torch.bfloat16, device=args["q"].device))
    o, lse = sparse_mla_prefill(**args, softmax_scale=scale, out=out, _config=config)
    assert o.data_ptr() == out.data_ptr() and lse.shape == (T, H)
    ro, rl = sparse_mla_prefill_ref(**args, softmax_scale=scale)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    e_o, e_l = rel_err(o, ro), max_abs_err(lse, rl)
    assert e_o <= OUT_TOL, e_o
    assert e_l <= LSE_TOL, e_l
    return o, lse, ro, rl


@pytest.mark.parametrize("H", [1, 3, 8, 16])
@pytest.mark.parametrize("lens", [True, False])
def test_prefill_heads(device, H, lens):
    _check(_case(device, 3, H, lens=lens))


@pytest.mark.parametrize("H", [1, 3, 16])
@pytest.mark.parametrize("splits", [1, 3])
def test_prefill_heads_splits(device, H, splits):
    _check(_case(device, 3, H, K=77), KernelConfig(16, BN, splits))


def test_prefill_seven_tokens_one_token(device):
    _check(_case(device, 7, 3, S=150, K=200))
    _check(_case(device, 1, 16, S=30, K=130, p_neg=0.0, p_oob=0.0, lens=False))


@pytest.mark.parametrize("splits", [2, 5])
def test_prefill_split_k(device, splits):
    args = _case(device, 3, 8, K=100)
    o1, _, _, _ = _check(args, KernelConfig(16, BN, 1))
    o2, _, _, _ = _check(args, KernelConfig(16, BN, splits))
    assert rel_err(o2, o1) < 5e-3


@pytest.mark.parametrize("sink", [None, "-inf", "large"])
def test_prefill_sink(device, sink):
    o, lse, ro, rl = _check(_case(device, 3, 3, sink=sink))
    if sink == "large":
        assert o.abs().max().item() < 1e-20


def test_prefill_empty_rows(device):
    args = _case(device, 4, 3, K=20)
    args["lens"][0] = 0
    args["indices"][1] = -1
    args["indices"][2] = 10 ** 6
    for cfg in (KernelConfig(16, BN, 1),
                KernelConfig(16, BN, 2)):
        o, lse, _, _ = _check(args, cfg)
        for t in (0, 1, 2):
            assert torch.all(o[t] == 0) and torch.all(lse[t] == float("inf"))


def test_prefill_shapes_and_strides(device):
    """kv [S, 1, 512] and a strided [S, 512] view, indices [T, 1, K] and int64, strided q/out."""
    T, H, S, K = 3, 3, 40, 33
    cfg = KernelConfig(16, BN, 1)
    base = _case(device, T, H, S=S, K=K)
    _check(dict(base, kv=base["kv"].unsqueeze(1), indices=base["indices"].unsqueeze(1)), cfg)
    wide = torch.randn(S, 2, 512).to(torch.bfloat16).to(device)
    obig = poison_(torch.empty(T, H + 1, 520, dtype=torch.bfloat16, device=device))
    out = obig[:, 1:, 8:]
    _check(dict(base, kv=wide[:, 1], indices=base["indices"].long(),
                q=torch.randn(T, 2 * H, 512).to(torch.bfloat16).to(device)[:, 1::2]), cfg, out=out)
    assert torch.isnan(obig[:, 0]).all() and torch.isnan(obig[:, :, :8]).all()


def test_prefill_sharp_softmax(device):
    _check(_case(device, 3, 8, q_scale=8.0))
    _check(_case(device, 2, 3), scale=0.003)


def test_prefill_empty_workspace_and_tokens(device):
    args = _case(device, 2, 3)
    args["kv"] = args["kv"][:0]
    out = poison_(torch.empty(2, 3, 512, dtype=torch.bfloat16, device=device))
    o, lse = sparse_mla_prefill(**args, out=out)
    assert o is out and torch.all(o == 0) and torch.all(lse == float("inf"))
    o, lse = sparse_mla_prefill(args["q"][:0], args["kv"], args["indices"][:0])
    assert o.shape == (0, 3, 512)


def test_prefill_bad_inputs(device):
    a = _case(device, 2, 3)

    def call(exc, match, **kw):
        args = dict(a)
        args.update(kw)
        with pytest.raises(exc, match=match):
            sparse_mla_prefill(**args)

    call(TypeError, "q", q=a["q"].half())
    call(ValueError, "q", q=a["q"][..., :128])
    call(TypeError, "kv", kv=a["kv"].float())
    call(ValueError, "kv", kv=a["kv"][:, :256])
    call(ValueError, "kv", kv=a["kv"].view(-1, 2, 256).transpose(1, 2).reshape(-1, 512)[:, :].t()
         .contiguous().t())
    call(ValueError, "kv", kv=torch.zeros(4, 2, 512, dtype=torch.bfloat16, device=device))
    call(ValueError, "indices", indices=a["indices"][:1])
    call(ValueError, "indices", indices=a["indices"].view(2, 2, -1))
    call(TypeError, "indices", indices=a["indices"].float())
    call(ValueError, "lens", lens=a["lens"][:1])
    call(ValueError, "attn_sink", attn_sink=torch.zeros(2, device=device))
    call(ValueError, "out", out=torch.empty(2, 3, 256, dtype=torch.bfloat16, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("cand", GPU_CANDIDATES["prefill"], ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("splits", [1, 3])
def test_prefill_gpu_configs(device, cand, splits):
    """Every launch shape the defaults or the benchmark sweep use (GPU_CANDIDATES); 24 heads =
    one full 16-head tile + a partial one (or a partial 32/64-head tile)."""
    variant, bh, bn, warps, stages, lazy = cand
    args = _case(device, 96, 24, S=2048, K=640, p_neg=0.05, p_oob=0.0)
    _check(args, KernelConfig(bh, bn, splits, warps, stages, variant=variant, lazy_rescale=lazy))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [8, 16, 64, 128])
def test_prefill_v41_shapes_gpu(device, H):
    T, S, K = 512, 8192, 640
    args = _case(device, T, H, S=S, K=K, p_neg=0.05, p_oob=0.0)
    args["lens"] = torch.randint(K // 2, K + 1, (T,), dtype=torch.int32, device=device)
    _check(args)
