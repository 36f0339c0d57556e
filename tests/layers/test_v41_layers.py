"""V4.1 layers computing their own compressed KV and top-k, wired by ``link_layers``: the KV
source compresses, a non-source reads its cache and reuses its selection, a later index
source reads its keys and chooses inside its candidate blocks; outputs against the float64
oracle fed with the float64 compressor of the rules."""
import torch
from test_layer import CFG, STEPS, Scenario, make_layer, oracle_request

from dsv41_triton.layers.compressed import link_layers
from dsv41_triton.layers.compressor import compress_sequence_ref
from dsv41_triton.layers.weights import random_attention_state_dict
from dsv41_triton.testing import rel_err

V41 = CFG.replace(name="tiny-v41", compress_ratios=(2, 2, 2), kv_source_layer_ids=(0,),
                  index_source_layer_ids=(0, 2), index_n_heads=2, index_head_dim=64, index_topk=4)


def test_v41_layers_share_and_select():
    sds = {i: random_attention_state_dict(V41, seed=10 + i) for i in range(3)}
    layers = {i: make_layer(V41, i, "torch", sds[i]) for i in range(3)}
    for i, ly in layers.items():
        ly.compressed_block.init_random(seed=i)
    assert layers[0].compressed_block.indexer.spec.owns_keys
    assert layers[1].compressed_block.compressor is None and layers[1].compressed_block.indexer is None
    assert layers[2].compressed_block.compressor is None and not layers[2].compressed_block.indexer.spec.owns_keys
    link_layers(layers, candidate_source_layer_id=0, candidate_topk_blocks=2, candidate_block_size=2)
    assert layers[1].compressed_cache is layers[0].compressed_cache
    assert all(ly.compressed_block.ready for ly in layers.values())
    sc = Scenario(V41, 0)
    outs = {i: [] for i in range(3)}
    tops = {i: {} for i in range(3)}
    for plan, padding in STEPS:
        md, hid, _, _, owners = sc.step(plan, padding)
        for i in range(3):
            y = layers[i](None, hid, md)
            outs[i].append((owners, y))
            top = layers[i].last_topk_indices
            for t, (name, p) in enumerate(owners):
                tops[i][(name, p)] = top[t]
        assert layers[1].last_topk_indices is layers[0].last_topk_indices
        cand = layers[0].compressed_block.last_candidates
        top2 = layers[2].last_topk_indices
        for t in range(len(owners)):
            allowed = set(cand[t][cand[t] >= 0].tolist())
            assert {int(e) // 2 for e in top2[t] if e >= 0} <= allowed
    comp = layers[0].compressed_block.compressor
    for i in range(3):
        orc = {}
        for name, st in sc.req.items():
            hidden = torch.cat(st["hidden"])
            L = hidden.shape[0]
            lat = compress_sequence_ref(hidden.float(), comp)  # [L // 2, 512] float64
            ckv = torch.zeros(L, 512, dtype=torch.bfloat16)
            ckv[1::2][: lat.shape[0]] = lat.bfloat16()
            topk = torch.stack([tops[i][(name, p)] for p in range(L)])
            orc[name] = oracle_request(sds[i], V41, i, hidden, ckv, topk)
        for owners, y in outs[i]:
            want = torch.stack([orc[n][1][p] for n, p in owners])
            err = rel_err(y[: len(owners)], want)
            assert err <= 1e-2, (i, err)


def test_v41_layer_kernels_match_references(device):
    """The same linked layers with the Triton backend and kernels (interpreter on CPU) and with
    the torch backend and references: same outputs within the attention tolerance, the same
    top-k rows where the logits are not tied."""
    sds = {i: random_attention_state_dict(V41, seed=20 + i) for i in range(3)}
    runs = {}
    for backend in ("triton", "torch"):
        layers = {i: make_layer(V41, i, backend, sds[i], device=device) for i in range(3)}
        for i, ly in layers.items():
            ly.compressed_block.init_random(seed=i)
        link_layers(layers, candidate_source_layer_id=0, candidate_topk_blocks=2, candidate_block_size=2)
        sc = Scenario(V41, 0, device=device)
        outs = []
        for plan, padding in STEPS[:3]:
            md, hid, _, _, _ = sc.step(plan, padding)
            outs.append([(layers[i](None, hid, md), layers[i].last_topk_indices) for i in range(3)])
        runs[backend] = outs
    same_rows = total = 0
    for step_t, step_r in zip(runs["triton"], runs["torch"]):
        for (yt, kt), (yr, kr) in zip(step_t, step_r):
            assert rel_err(yt.float(), yr.float()) <= 1e-2
            same_rows += int((kt == kr).all(1).sum())
            total += kt.shape[0]
    assert same_rows >= 0.9 * total, (same_rows, total)


def test_block_caches_grow_keeping_contents():
    layer = make_layer(V41, 0, "torch", random_attention_state_dict(V41, seed=1), num_blocks=4)
    blk = layer.compressed_block
    blk.init_random(seed=0)
    blk.state_cache.normal_()
    blk.index_cache.random_(0, 256)
    s0, i0 = blk.state_cache.clone(), blk.index_cache.clone()
    blk.ensure_capacity(3, 4, 3, 4)  # already large enough: nothing changes
    assert blk.state_cache.data_ptr() == s0.data_ptr() or torch.equal(blk.state_cache, s0)
    blk.ensure_capacity(9, 4, 6, 4)
    assert blk.state_cache.shape[0] >= 9 and blk.index_cache.shape[0] >= 6
    assert torch.equal(blk.state_cache[:4], s0) and torch.equal(blk.index_cache[:4], i0)
