"""The many-heads Gluon decode kernels (``attention/gluon/decode_heads.py``, launch shape
``8:64:2``: 64-head tiles on the wgmma M, two warpgroups; its warp-specialized variant
``decode_heads_ws.py``, ``8:64:2:3``) against the float64 reference; every GPU contract test
runs both (the ``heads_kernel`` fixture).

CPU: compile-only for an sm_90 target where the installed Triton has the Gluon API (skipped
otherwise). GPU-marked: heads 16..128 (one padded tile, two tiles, 65 = one head in the second
tile), tokens 1..128 (1/2/7 split the keys), every record pair, ragged lens, ``-1`` and empty
rows, sinks, a > 2 GiB cache, strided layouts, CUDA graphs, hostile indices; outputs poisoned.
"""
import os

import pytest
import torch

from dsv41_triton.attention import gluon as gluon_pkg
from dsv41_triton.attention.decode import sparse_mla_decode
from dsv41_triton.attention.ref import sparse_mla_decode_ref
from dsv41_triton.testing import (assert_graph_replay, large_offset_decode_case, max_abs_err,
                                  poison_, rel_err)
from test_decode_gluon import (GRAPH_INPUTS, LSE_TOL, OUT_TOL, PAIRS, _case, _check,
                               _check_empty_rows, _check_layouts, _compile_facts,
                               _empty_rows_case, _hostile_case, _need_gluon_gpu, _v41)

SHAPE = "8:64:2"
#: the warp-specialized kernel (decode_heads_ws.py)
WS_SHAPE = "8:64:2:3"
#: the kernels every GPU contract test runs: the default order (serial) and the ws kernel
KERNELS = {"serial": SHAPE, "ws": WS_SHAPE}


def _launch_module():
    from dsv41_triton.attention.gluon import launch as gl_launch
    assert gl_launch.HEADS_SHAPE == SHAPE and gl_launch.HEADS_WS_SHAPE == WS_SHAPE
    return gl_launch


@pytest.fixture(params=list(KERNELS))
def heads_kernel(request, monkeypatch):
    """Route ``_kernel='gluon'`` to the many-heads kernel: the default variant and the
    warp-specialized one."""
    monkeypatch.setenv("DSV41_GLUON_SHAPE", KERNELS[request.param])
    yield _launch_module()


@pytest.fixture
def heads_launch(monkeypatch):
    """The many-heads launch shape (the variant set by the test)."""
    monkeypatch.setenv("DSV41_GLUON_SHAPE", SHAPE)
    yield _launch_module()


def _ran_heads(gl_launch, overlap=None):
    """The last launch ran the many-heads kernel in the variant the shape in the environment
    asks for (``overlap``: False / True / "ws", else from ``DSV41_GLUON_SHAPE``)."""
    k, shape = gl_launch.LAST_LAUNCH["fwd"]
    assert shape[0] == 64 and shape[2] == 8, shape
    if overlap is None:
        v = gl_launch.parse_shape(os.environ["DSV41_GLUON_SHAPE"]).get("variant")
        overlap = gl_launch.HEADS_VARIANTS.get(v, gl_launch.HEADS_OVERLAP)
    assert gl_launch.LAST_LAUNCH["heads_overlap"] == overlap
    assert type(gl_launch.LAST_LAUNCH["heads_overlap"]) is type(overlap)
    return shape


# --------------------------------------------------------------------------------------------
# CPU: compile-only
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["1", "0", "ws"])
@pytest.mark.parametrize("src_a,src_b,split", [(584, 584, False), (528, 288, True),
                                               (528, 584, False)])
def test_gluon_heads_compiles_for_sm90(src_a, src_b, split, variant):
    """Compiles for sm_90 (subprocess without the interpreter), both dequant orders and the
    warp-specialized kernel: wgmma (32 for S, 4 for O), cp.async, shared memory within the
    227 KB of one CTA, registers within 255 for 256 threads, no large spills, and few CTA
    barriers (the key tile in one store: 4 per block serial, 5 overlapped, 10 / 12 in the whole
    kernel, two of them the epilogue's pass of O through the key tile; main had 12 per block and
    23 / 30 with one store per 64-dim group). ws: the
    partitions' register budgets (setmaxnreg: 224 for the 8 MMA warps, 48 for the producer),
    the gathers (cp.async + its mbarrier arrive) only in the producer's loop, 5 barriers per
    block in the consumers' loop (membar's around the mbarrier ops), 2 in the producer's."""
    if not gluon_pkg.AVAILABLE:
        pytest.skip(f"installed Triton lacks the Gluon API the kernel uses: {gluon_pkg.REASON}")
    facts = _compile_facts(src_a, src_b, 64, int(split), 8, 2, variant)
    assert facts["wgmma"] and facts["cp_async"], facts
    assert facts["wgmma_ptx"] == 36, facts
    assert 0 < facts["shared"] <= 227 * 1024, facts
    assert 0 < facts["regs"] <= 255 and 0 <= facts["stack"] <= 128, facts
    if variant == "ws":
        assert {"dec 224", "inc 48"} <= set(facts["setmaxnreg"]), facts
        cons, prod = facts["consumer"], facts["producer"]
        assert cons["bar_sync"] == 5 and prod["bar_sync"] == 2, facts
        assert cons["spill_ld_st"] <= 4 and prod["spill_ld_st"] == 0, facts
        assert 0 < prod["loop"] < cons["loop"], facts
    else:
        assert facts["bar_sync"] <= (12 if variant == "1" else 10), facts


def test_gluon_heads_shape_in_pick_vocabulary():
    """The many-heads launch shape is one the GPU tests run; the split count fills one wave."""
    from dsv41_triton.attention.gluon import launch as gl_launch
    assert SHAPE in gl_launch.TESTED_SHAPES
    assert gl_launch.parse_shape(SHAPE) == {"num_warps": 8, "block_h": 64, "stages": 2}
    assert gl_launch.parse_shape(SHAPE + ":1")["variant"] == 1
    assert gl_launch.parse_shape(WS_SHAPE)["variant"] == 3 and WS_SHAPE in gl_launch.TESTED_SHAPES
    assert gl_launch.HEADS_VARIANTS == {1: False, 2: True, 3: "ws"}
    for bad in (SHAPE + ":4", "8:64", "8:64:2:1:1"):
        with pytest.raises(ValueError, match="launch shape"):
            gl_launch.parse_shape(bad)
    assert gl_launch.default_splits(128, 1, 640, 132) == 1
    assert gl_launch.default_splits(1, 1, 640, 132) == 10
    assert gl_launch.default_splits(32, 2, 640, 132) == 2
    assert gl_launch.default_splits(1, 2, 64 * 100, 132) == 32


def test_gluon_heads_pick_entries():
    """The pick table sends only 33+ heads with more than 7 tokens to the many-heads kernel
    (it measured slower than tl at T = 1 and tied at 32 heads); 17..32 heads have their own
    bucket."""
    from dsv41_triton.attention.gluon import launch as gl_launch
    assert gl_launch.heads_bucket(32) == 32 and gl_launch.heads_bucket(33) == 64
    assert gl_launch.heads_bucket(65) == 128 and gl_launch.heads_bucket(16) == 16
    entries = [k for t in gl_launch.PICK.values() for k, v in t.items() if v == SHAPE]
    assert entries
    for hb, sa, sb, tb in entries:
        assert hb in (64, 128) and tb != 7, (hb, sa, sb, tb)


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32, 64, 65, 128])
@pytest.mark.parametrize("swa_rec,extra_rec", PAIRS)
def test_gluon_heads_records_gpu(device, heads_kernel, H, swa_rec, extra_rec):
    _need_gluon_gpu()
    _check(_case(device, 7, H, swa_rec, extra_rec))
    _ran_heads(heads_kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 7, 128])
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288), (584, 288)])
def test_gluon_heads_v41_shapes_gpu(device, heads_kernel, T, H, swa_rec, extra_rec):
    _need_gluon_gpu()
    _check(_v41(device, T, H, swa_rec, extra_rec))
    shape = _ran_heads(heads_kernel)
    if T == 1:
        assert shape[1] > 1, shape  # one token: the keys are split


@pytest.mark.gpu
@pytest.mark.parametrize("variant,overlap", [("1", False), ("2", True), ("3", "ws")])
@pytest.mark.parametrize("T,H", [(1, 64), (128, 128)])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288), (584, 288)])
def test_gluon_heads_variants_gpu(device, heads_launch, monkeypatch, variant, overlap, T, H,
                                  swa_rec, extra_rec):
    """Every variant forced by the launch shape's 4th field (serial / overlapped / ws)."""
    _need_gluon_gpu()
    monkeypatch.setenv("DSV41_GLUON_SHAPE", f"{SHAPE}:{variant}")
    _check(_v41(device, T, H, swa_rec, extra_rec))
    _ran_heads(heads_launch, overlap)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 64), (128, 128)])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288), (584, 528)])
def test_gluon_heads_ws_idx_preload_gpu(device, heads_launch, monkeypatch, T, H, swa_rec,
                                        extra_rec):
    """The warp-specialized kernel with its slot ids preloaded (the shape's 5th field 0; 584
    beside 528 falls back to 1: shared memory); one token splits its keys into CTAs of fewer
    blocks than a preload chunk."""
    _need_gluon_gpu()
    monkeypatch.setenv("DSV41_GLUON_SHAPE", f"{WS_SHAPE}:0")
    _check(_v41(device, T, H, swa_rec, extra_rec))
    _ran_heads(heads_launch, "ws")


@pytest.mark.gpu
@pytest.mark.parametrize("sink", ["none", "-inf", "large", "rand"])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("swa_rec,extra_rec", [(584, 584), (528, 288)])
def test_gluon_heads_sinks_gpu(device, heads_kernel, sink, T, swa_rec, extra_rec):
    _need_gluon_gpu()
    _check(_case(device, T, 64, swa_rec, extra_rec, sink=sink))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("splits", [1, 3])
def test_gluon_heads_empty_rows_gpu(device, heads_kernel, monkeypatch, T, splits):
    """Rows with len 0, rows of only -1, rows whose every slot is past the cache; with and
    without key splits."""
    _need_gluon_gpu()
    monkeypatch.setattr(heads_kernel, "default_splits", lambda *a: splits)
    _check_empty_rows(_empty_rows_case(device, T, 64, 584, 528))
    assert _ran_heads(heads_kernel)[1] == splits


@pytest.mark.gpu
def test_gluon_heads_layouts_gpu(device, heads_kernel):
    """Padded block stride, 4-D cache view, odd page size, strided q/out, int64 indices, 65
    heads; nothing outside the owned rows is written."""
    _need_gluon_gpu()
    _check_layouts(device, 65, 133, 584, 288)
    _ran_heads(heads_kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_gluon_heads_int64_offsets_gpu(device, heads_kernel, T):
    """A cache of > 2 GiB: slots in its last blocks have byte offsets beyond 2**31."""
    _need_gluon_gpu()
    _check(large_offset_decode_case(device, T=T, H=64))
    _ran_heads(heads_kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,swa_rec,extra_rec", [(1, 64, 584, 584), (128, 128, 528, 288),
                                                   (32, 64, 584, 584), (7, 65, 528, 584)])
def test_gluon_heads_cuda_graph_gpu(device, heads_kernel, T, H, swa_rec, extra_rec):
    _need_gluon_gpu()
    static = _v41(device, T, H, swa_rec, extra_rec)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=device)
    fresh = _v41(device, T, H, swa_rec, extra_rec)
    assert_graph_replay(sparse_mla_decode, static, {n: fresh[n] for n in GRAPH_INPUTS}, out,
                        sparse_mla_decode_ref, out_tol=OUT_TOL, lse_tol=LSE_TOL, _kernel="gluon")
    _ran_heads(heads_kernel)


@pytest.mark.gpu
def test_gluon_heads_hostile_indices_gpu(device, heads_kernel):
    """Slot ids far past the cache, INT32_MAX/MIN, lens past the width and negative."""
    _need_gluon_gpu()
    _check(_hostile_case(device, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_gluon_heads_nan_sink_gpu(device, heads_kernel, monkeypatch, splits):
    """A NaN sink: every row of its head is NaN, a token without keys included; the other
    heads as the reference (0 / +inf for that token); lse unaffected."""
    _need_gluon_gpu()
    monkeypatch.setattr(heads_kernel, "default_splits", lambda *a: splits)
    H = 64
    args = _case(device, 3, H, 584, 288)
    args["attn_sink"][37] = float("nan")
    args["swa_lens"][1] = 0
    args["extra_lens"][1] = 0
    out = poison_(torch.empty(3, H, 512, dtype=torch.bfloat16, device=device))
    o, lse = sparse_mla_decode(**args, out=out, _kernel="gluon")
    assert _ran_heads(heads_kernel)[1] == splits
    ro, rl = sparse_mla_decode_ref(**args)
    assert torch.isnan(o[:, 37]).all() and torch.isnan(ro[:, 37]).all()
    keep = [h for h in range(H) if h != 37]
    assert rel_err(o[:, keep], ro[:, keep]) <= OUT_TOL
    assert (o[1, keep] == 0).all()
    assert max_abs_err(lse, rl) <= LSE_TOL and (lse[1] == float("inf")).all()

