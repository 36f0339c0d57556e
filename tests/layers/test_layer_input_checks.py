"""The layer's step checks: what it cannot use is a ValueError / TypeError naming the argument,
raised before any launch and before the KV caches are written, the same on every backend.

Block ids past the bound caches, metadata (or inputs) on another device, a chunk plan that
cannot be built, top-k rows wider than the indexer's ``index_topk``, and top-k rows / compressed
KV handed to a window-only layer. The checks read host data only (the metadata's host fields,
shapes, dtypes, devices): nothing here needs a device-to-host read.
"""
from __future__ import annotations

import pytest
import torch

from dsv41_triton.backends import Problem, available_backends
from dsv41_triton.layers import (DeepseekV41Attention, RequestSpec, build_step_metadata,
                                 random_attention_state_dict)
from test_layer import CFG, MAX_LEN

W, PAGE, NB = CFG.sliding_window, 4, 8


def _backends():
    ok = available_backends([Problem("decode", 8, swa_record=584, extra_record=584),
                             Problem("prefill", 8)])
    return ["torch"] + (["triton"] if "triton" in ok else [])


BACKENDS = _backends()


def _layer(layer_id, backend="torch", nb=NB, **kw):
    layer = DeepseekV41Attention(CFG, layer_id, backend=backend, device="cpu",
                                 max_model_len=MAX_LEN, **kw)
    layer.load_weights(random_attention_state_dict(CFG, seed=layer_id))
    layer.allocate_kv_caches(nb, PAGE, nb, PAGE)
    for c in (layer.swa_cache, layer.compressed_cache):
        if c is not None:
            c.zero_()  # never-written slots read as zeros (no NaN from random bytes)
    return layer


def _md(reqs, ratio=0, **kw):
    return build_step_metadata(reqs, window_size=W, swa_page_size=PAGE,
                               compressed_page_sizes={ratio: PAGE} if ratio else None, **kw)


def _inputs(T, ratio, width=None):
    hid = torch.randn(T, CFG.hidden_size).bfloat16()
    if not ratio:
        return hid, {}
    tk = torch.full((T, width or CFG.index_topk), -1, dtype=torch.int32)
    return hid, dict(compressed_kv=torch.randn(T, 512).bfloat16(), topk_indices=tk)


def _caches(layer):
    return [c.clone() for c in (layer.swa_cache, layer.compressed_cache) if c is not None]


def _untouched(layer, before):
    return all(torch.equal(a, b) for a, b in zip(before, _caches(layer)))


# --------------------------------------------------------------------------------------------
# block ids against the bound caches (G11)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["window-prefill", "window-decode", "compressed-prefill",
                                  "compressed-decode"])
def test_block_ids_past_the_bound_caches_raise_before_any_write(backend, case):
    """A block id past the cache would make the kernels skip (paged reads) or read a workspace
    row that nothing wrote (the gather skips it): the layer rejects it on every backend, from
    the metadata's host copy of its largest block id."""
    which, kind = case.split("-")
    ratio = 2 if which == "compressed" else 0
    layer = _layer(ratio, backend)
    q, prefix = (3, 0) if kind == "prefill" else (1, 5)
    swa = [0, 1000] if which == "window" else [0, 1]
    comp = {ratio: [999]} if ratio else {}
    md = _md([RequestSpec(q, prefix, swa, comp)], ratio)
    hid, kw = _inputs(q, ratio)
    before = _caches(layer)
    cache = "swa_cache" if which == "window" else "compressed_cache"
    with pytest.raises(ValueError, match=rf"metadata: .*block id {swa[1] if not ratio else 999}"
                                         rf".*\({cache}\) has {NB} blocks"):
        layer(None, hid, md, **kw)
    assert _untouched(layer, before)
    # the last block id of the cache is fine (and both backends run the step)
    swa = [0, NB - 1]
    md = _md([RequestSpec(q, prefix, swa, {ratio: [NB - 1]} if ratio else {})], ratio)
    y = layer(None, hid, md, **kw)
    assert y.shape == (q, CFG.hidden_size)


def test_block_ids_past_a_smaller_bound_cache():
    """The bound cache decides (bind_kv_caches with fewer blocks than the metadata's ids)."""
    layer = _layer(0, nb=16)
    md = _md([RequestSpec(3, 0, [12])])
    hid, _ = _inputs(3, 0)
    layer(None, hid, md)
    from dsv41_triton.ops.records import allocate_k_cache

    layer.bind_kv_caches(allocate_k_cache(12, PAGE, layer.swa_record, "cpu"))
    with pytest.raises(ValueError, match="block id 12.*has 12 blocks"):
        layer(None, hid, md)


# --------------------------------------------------------------------------------------------
# the chunk plan's parameters (G12)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,exc", [
    ("prefill_chunk_size", 0, ValueError), ("prefill_chunk_size", "4", TypeError),
    ("max_workspace_rows", -5, ValueError), ("max_workspace_rows", 2.5, TypeError)])
def test_metadata_plan_parameters_are_checked_before_the_cache_is_written(field, value, exc):
    """Metadata built by hand (or edited after build_step_metadata, which checks them too)."""
    layer = _layer(0)
    md = _md([RequestSpec(3, 0, [0])])
    setattr(md, field, value)
    hid, _ = _inputs(3, 0)
    before = _caches(layer)
    with pytest.raises(exc, match=f"metadata.{field}"):
        layer(None, hid, md)
    assert _untouched(layer, before)


# --------------------------------------------------------------------------------------------
# devices (G13)
# --------------------------------------------------------------------------------------------
def test_metadata_on_another_device_is_named():
    layer = _layer(0)
    hid, _ = _inputs(3, 0)
    md = _md([RequestSpec(3, 0, [0])], device="meta")
    with pytest.raises(ValueError, match="metadata: positions is on meta, the layer on cpu"):
        layer(None, hid, md)
    # one tensor moved: still named
    md = _md([RequestSpec(3, 0, [0])])
    md.decode_swa_indices = md.decode_swa_indices.to("meta")
    with pytest.raises(ValueError, match="metadata: decode_swa_indices is on meta"):
        layer(None, hid, md)
    layer2 = _layer(2)
    md = _md([RequestSpec(3, 0, [0], {2: [0]})], 2)
    md.compressed[2].slot_mapping = md.compressed[2].slot_mapping.to("meta")
    hid, kw = _inputs(3, 2)
    before = _caches(layer2)
    with pytest.raises(ValueError, match=r"metadata: compressed\[2\].slot_mapping is on meta"):
        layer2(None, hid, md, **kw)
    assert _untouched(layer2, before)


@pytest.mark.parametrize("arg", ["hidden_states", "positions", "topk_indices", "compressed_kv"])
def test_inputs_on_another_device_are_named(arg):
    layer = _layer(2)
    md = _md([RequestSpec(3, 0, [0], {2: [0]})], 2)
    hid, kw = _inputs(3, 2)
    pos = md.positions.clone()
    if arg == "hidden_states":
        hid = hid.to("meta")
    elif arg == "positions":
        pos = pos.to("meta")
    else:
        kw[arg] = kw[arg].to("meta")
    with pytest.raises(ValueError, match=f"{arg}: expected a tensor on cpu, got one on meta"):
        layer(pos, hid, md, **kw)


# --------------------------------------------------------------------------------------------
# top-k rows and compressed KV (G14)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bound", [False, True])
@pytest.mark.parametrize("arg", ["topk_indices", "compressed_kv"])
def test_window_only_layer_rejects_compressed_inputs(arg, bound):
    layer = _layer(0)
    md = _md([RequestSpec(3, 0, [0])])
    hid, _ = _inputs(3, 0)
    bad = {"topk_indices": torch.zeros(3, 4), "compressed_kv": torch.zeros(7, 3)}[arg]
    before = _caches(layer)
    with pytest.raises(ValueError, match=f"{arg}: layer 0 is window-only"):
        if bound:
            layer.set_step(md, **{arg: bad})
            layer(None, hid)
        else:
            layer(None, hid, md, **{arg: bad})
    assert _untouched(layer, before)


def test_topk_width_is_at_most_index_topk():
    """The indexer selects ``index_topk`` entries per token: wider rows would attend to more
    entries than the model does. Narrower rows are fine; an HCA layer (no indexer) takes every
    completed entry, whatever the width."""
    layer = _layer(2)
    md = _md([RequestSpec(3, 0, [0], {2: [0]})], 2)
    hid, kw = _inputs(3, 2, width=5000)
    before = _caches(layer)
    with pytest.raises(ValueError, match="topk_indices: 5000 columns.*index_topk = 4"):
        layer(None, hid, md, **kw)
    with pytest.raises(ValueError, match="topk_indices: 5 columns"):
        layer(None, hid, md, **_inputs(3, 2, width=5)[1])
    assert _untouched(layer, before)
    for width in (CFG.index_topk, 1):
        layer(None, hid, md, **_inputs(3, 2, width=width)[1])
    hca_cfg = CFG.replace(hca_ratios=(2,))
    hca = DeepseekV41Attention(hca_cfg, 2, backend="torch", device="cpu", max_model_len=MAX_LEN)
    hca.load_weights(random_attention_state_dict(hca_cfg, seed=2))
    hca.allocate_kv_caches(NB, PAGE, NB, PAGE)
    assert not hca.has_indexer
    hca(None, hid, md, **_inputs(3, 2, width=64)[1])
