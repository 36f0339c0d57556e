"""The step metadata builder: slot mappings, decode window indices, chunk plans, validity."""
from __future__ import annotations

import random

import pytest
import torch

from dsv41_triton.layers.metadata import (
    RequestSpec,
    build_step_metadata,
    plan_prefill_chunks,
)
from dsv41_triton.ops.indices_ref import combine_topk_swa_indices_ref
from dsv41_triton.ops.kv_cache_ref import (
    dequantize_and_gather_k_cache_ref,
    quantize_and_insert_k_cache_ref,
)
from dsv41_triton.ops.records import allocate_k_cache

W, PAGE, CPAGE = 8, 4, 4


class _Pool:
    """Distinct random block ids (per cache) across the requests of a test."""

    def __init__(self, rng):
        self.free = {k: rng.sample(range(100), 100) for k in ("swa", 1, 2)}

    def take(self, kind):
        return [self.free[kind].pop() for _ in range(8)]


def _req(q, prefix, rng, ratios=(1, 2)):
    pool = rng.pool if hasattr(rng, "pool") else None
    if pool is None:
        rng.pool = pool = _Pool(rng)
    return RequestSpec(q, prefix, pool.take("swa"), {r: pool.take(r) for r in ratios})


def _slot(table, pos, page):
    return table[pos // page] * page + pos % page


def test_tokens_slots_and_decode_windows():
    rng = random.Random(0)
    reqs = [_req(1, 9, rng), _req(1, 0, rng), _req(0, 5, rng), _req(5, 3, rng), _req(2, 0, rng)]
    md = build_step_metadata(reqs, window_size=W, swa_page_size=PAGE,
                             compressed_page_sizes={1: CPAGE, 2: CPAGE})
    assert (md.num_decodes, md.num_prefills) == (3, 2)
    assert (md.num_decode_tokens, md.num_prefill_tokens, md.num_tokens) == (2, 7, 9)
    assert md.query_start_loc_cpu == [0, 1, 2, 2, 7, 9]
    assert md.positions.tolist() == [9, 0, 3, 4, 5, 6, 7, 0, 1]
    assert md.token_to_req.tolist() == [0, 1, 3, 3, 3, 3, 3, 4, 4]
    assert md.is_valid_token.all() and md.max_position == 9
    owners = [(0, 9), (1, 0)] + [(3, p) for p in range(3, 8)] + [(4, 0), (4, 1)]
    assert md.swa_slot_mapping.tolist() == [
        _slot(reqs[b].swa_block_table, p, PAGE) for b, p in owners]
    # decode windows: positions max(pos-W+1, 0)..pos ascending, -1 after
    assert md.decode_swa_indices.shape == (2, W)
    assert md.decode_swa_lens.tolist() == [8, 1]
    assert md.decode_swa_indices[0].tolist() == [
        _slot(reqs[0].swa_block_table, p, PAGE) for p in range(2, 10)]
    assert md.decode_swa_indices[1].tolist() == [_slot(reqs[1].swa_block_table, 0, PAGE)] + [-1] * 7
    # prefill
    assert md.prefill_seq_lens.tolist() == [8, 2]
    assert md.prefill_gather_lens.tolist() == [5 + 3, 2 + 0]
    # compressed slots: the token at pos completes entry pos // r when (pos + 1) % r == 0
    for r in (1, 2):
        cm = md.compressed[r]
        want = [_slot(reqs[b].compressed_block_tables[r], p // r, CPAGE) if (p + 1) % r == 0 else -1
                for b, p in owners]
        assert cm.slot_mapping.tolist() == want
        assert cm.num_entries_cpu == [(rq.prefix_len + rq.query_len) // r for rq in reqs]


def test_padding_tokens_and_ordering_errors():
    rng = random.Random(1)
    md = build_step_metadata([_req(1, 4, rng), _req(1, 0, rng)], window_size=W,
                             swa_page_size=PAGE, num_padding_tokens=3)
    assert md.num_tokens == md.num_decode_tokens == 5
    assert md.is_valid_token.tolist() == [True, True, False, False, False]
    assert md.swa_slot_mapping[2:].tolist() == [-1] * 3
    assert md.decode_swa_lens[2:].tolist() == [0] * 3
    assert (md.decode_swa_indices[2:] == -1).all()
    with pytest.raises(ValueError, match="decodes first"):
        build_step_metadata([_req(3, 0, rng), _req(1, 2, rng)], window_size=W, swa_page_size=PAGE)
    with pytest.raises(ValueError, match="pure-decode"):
        build_step_metadata([_req(3, 0, rng)], window_size=W, swa_page_size=PAGE,
                            num_padding_tokens=1)
    with pytest.raises(ValueError, match="cannot hold"):
        build_step_metadata([RequestSpec(5, 0, [1])], window_size=W, swa_page_size=PAGE)
    with pytest.raises(ValueError, match="ratio 2"):
        build_step_metadata([RequestSpec(5, 0, [1, 2])], window_size=W, swa_page_size=PAGE,
                            compressed_page_sizes={2: 4})
    with pytest.raises(ValueError, match="query_len"):
        build_step_metadata([RequestSpec(-1, 0, [1])], window_size=W, swa_page_size=PAGE)
    with pytest.raises(TypeError, match="RequestSpec"):
        build_step_metadata([(1, 0)], window_size=W, swa_page_size=PAGE)


def test_empty_step():
    md = build_step_metadata([], window_size=W, swa_page_size=PAGE)
    assert md.num_tokens == 0 and md.positions.numel() == 0 and md.chunk_plan(0) == []


def test_chunk_plans():
    seq = [30, 3, 17, 9, 12, 40]
    gather = [10, 3, 8, 9, 7, 7]
    qsl = [0, 1, 2] + [2 + sum(gather[:i + 1]) for i in range(6)]  # 2 decodes, then prefills
    plan = plan_prefill_chunks(seq, gather, qsl, 2, 2)
    assert [(c.req_start, c.req_end) for c in plan] == [(2, 6), (6, 8)]
    c0 = plan[0]
    assert c0.N == max(s // 2 for s in seq[:4]) and c0.M == c0.N + max(gather[:4])
    assert (c0.tok_start, c0.tok_end) == (qsl[2], qsl[6])
    assert plan[1].N == 20 and plan[1].M == 20 + 7
    # window-only layers: N = 0; the row budget splits chunks (a lone request always fits)
    plan = plan_prefill_chunks(seq, gather, qsl, 2, 0, 4, max_workspace_rows=20)
    assert all(c.N == 0 for c in plan)
    assert all((c.req_end - c.req_start) * c.M <= 20 or c.req_end - c.req_start == 1
               for c in plan)
    assert [c.req_start for c in plan] == sorted({c.req_start for c in plan})
    assert plan[0].req_start == 2 and plan[-1].req_end == 8
    assert all(a.req_end == b.req_start and a.tok_end == b.tok_start for a, b in zip(plan, plan[1:]))


@pytest.mark.parametrize("ratio", [0, 1, 2])
def test_chunk_workspace_matches_the_index_ops(ratio):
    """Gathering a chunk per its plan and combining indices per SPEC §5 references exactly each
    token's window positions and its top-k entries: keys are labelled (request, position) in
    the raw bf16 RoPE part of 584-byte records."""
    rng = random.Random(ratio)
    reqs = [_req(1, 6, rng), _req(6, 0, rng), _req(4, 9, rng), _req(7, 2, rng), _req(3, 0, rng),
            _req(5, 11, rng)]
    cps = {ratio: CPAGE} if ratio else None
    md = build_step_metadata(reqs, window_size=W, swa_page_size=PAGE, compressed_page_sizes=cps)
    swa = allocate_k_cache(100, PAGE, 584)
    comp = allocate_k_cache(100, CPAGE, 584)

    def label(b, p, kind):
        k = torch.randn(512).bfloat16()
        k[448], k[449], k[450] = b, p, kind
        return k

    for b, rq in enumerate(reqs):
        n = rq.prefix_len + rq.query_len
        keys = torch.stack([label(b, p, 1) for p in range(n)])
        quantize_and_insert_k_cache_ref(
            keys, swa, torch.tensor([_slot(rq.swa_block_table, p, PAGE) for p in range(n)]))
        if ratio:
            tb = rq.compressed_block_tables[ratio]
            ne = n // ratio
            ck = torch.stack([label(b, e, 2) for e in range(ne)]) if ne else torch.empty(0, 512).bfloat16()
            quantize_and_insert_k_cache_ref(ck, comp, torch.tensor([_slot(tb, e, CPAGE)
                                                                    for e in range(ne)], dtype=torch.long))
    topk = 3
    T = md.num_tokens
    tk = torch.full((T, topk), -1, dtype=torch.int32)
    pos = md.positions.tolist()
    for t in range(T):
        if ratio:
            avail = (pos[t] + 1) // ratio
            picks = rng.sample(range(avail), min(avail, topk))
            tk[t, :len(picks)] = torch.tensor(picks, dtype=torch.int32)
    nd = md.num_decodes
    seen = 0
    for ch in md.chunk_plan(ratio):
        assert ch.req_end - ch.req_start <= 4
        pr = slice(ch.req_start - nd, ch.req_end - nd)
        ws = torch.full((ch.req_end - ch.req_start, ch.M, 512), float("nan")).bfloat16()
        seq = md.prefill_seq_lens[pr]
        if ratio:
            cm = md.compressed[ratio]
            dequantize_and_gather_k_cache_ref(ws, comp, seq // ratio, None,
                                              cm.block_table[ch.req_start:ch.req_end], CPAGE, 0)
        dequantize_and_gather_k_cache_ref(ws, swa, seq, md.prefill_gather_lens[pr],
                                          md.swa_block_table[ch.req_start:ch.req_end], PAGE, ch.N)
        qsl = md.query_start_loc[ch.req_start:ch.req_end + 1]
        idx, lens = combine_topk_swa_indices_ref(
            tk[ch.tok_start:ch.tok_end], qsl, seq, md.prefill_gather_lens[pr], W, ratio,
            topk if ratio else 0, ch.M, ch.N)
        flat = ws.view(-1, 512)
        for i in range(ch.tok_end - ch.tok_start):
            t = ch.tok_start + i
            b, p = md.token_to_req[t].item(), pos[t]
            got = sorted(tuple(int(v) for v in flat[j, 448:451].tolist())
                         for j in idx[i, :lens[i]].tolist() if j >= 0)
            want = [(b, q, 1) for q in range(max(p - W + 1, 0), p + 1)]
            if ratio:
                want += [(b, e, 2) for e in tk[t].tolist() if e >= 0]
            assert got == sorted(want), (t, got, want)
            seen += 1
    assert seen == md.num_prefill_tokens


# --------------------------------------------------------------------------------------------
# argument checks (host data: everything is checked before any tensor is built)
# --------------------------------------------------------------------------------------------
def _md(reqs, **kw):
    return build_step_metadata(reqs, window_size=W, swa_page_size=PAGE, **kw)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(prefill_chunk_size=0), ValueError, "prefill_chunk_size"),
    (dict(prefill_chunk_size="4"), TypeError, "prefill_chunk_size"),
    (dict(prefill_chunk_size=2.0), TypeError, "prefill_chunk_size"),
    (dict(max_workspace_rows=-5), ValueError, "max_workspace_rows"),
    (dict(max_workspace_rows=0), ValueError, "max_workspace_rows"),
    (dict(max_workspace_rows=2.5), TypeError, "max_workspace_rows"),
    (dict(device="gpu"), ValueError, "device"),
    (dict(compressed_page_sizes=[(2, 4)]), TypeError, "compressed_page_sizes"),
])
def test_step_arguments_are_checked_up_front(kw, exc, match):
    with pytest.raises(exc, match=match):
        _md([RequestSpec(3, 0, [0])], **kw)
    # a prefill-free step too: the plan is built later, but the values are checked now
    with pytest.raises(exc, match=match):
        _md([RequestSpec(1, 2, [0])], **kw)


def test_plan_checks_the_row_budget():
    with pytest.raises(ValueError, match="max_workspace_rows"):
        plan_prefill_chunks([4], [4], [0, 4], 0, 0, 4, max_workspace_rows=-1)
    with pytest.raises(TypeError, match="max_workspace_rows"):
        plan_prefill_chunks([4], [4], [0, 4], 0, 0, 4, max_workspace_rows=2.5)


@pytest.mark.parametrize("requests", [None, 3, RequestSpec(3, 0, [0])])
def test_requests_must_be_a_sequence_of_request_specs(requests):
    with pytest.raises(TypeError, match=r"^requests"):
        _md(requests)


@pytest.mark.parametrize("table,exc,match", [
    ([1.9], TypeError, r"swa_block_table\[0\]: expected an int block id, got 1.9"),
    ([0, 2.0], TypeError, r"swa_block_table\[1\]"),
    ([True], TypeError, r"swa_block_table\[0\]"),
    (["0"], TypeError, r"swa_block_table\[0\]"),
    ("ab", TypeError, "swa_block_table: expected a sequence of ints"),
    (torch.tensor([1.0]), TypeError, "swa_block_table: expected an integer tensor"),
    (torch.tensor([True]), TypeError, "swa_block_table: expected an integer tensor"),
    (torch.tensor([[0], [1]]), ValueError, "swa_block_table: expected a 1-D tensor"),
    (torch.tensor(0), ValueError, "swa_block_table: expected a 1-D tensor"),
    ([-1, 0], ValueError, r"swa_block_table\[0\]: block id -1 for a block in use"),
    ([0, -1], ValueError, r"swa_block_table\[1\]: block id -1 for a block in use"),
    ([-3, 0], ValueError, r"swa_block_table\[0\]: block id -3"),
    ([0, 1, -2], ValueError, r"swa_block_table\[2\]: block id -2"),
    ([0, 2**31], ValueError, r"swa_block_table\[1\]: block id 2147483648"),
])
def test_swa_block_ids_are_checked(table, exc, match):
    """Block ids are ints (no truncation of 1.9 to 1), >= -1, and the blocks that hold the
    request's positions are real (no negative slots)."""
    with pytest.raises(exc, match=match):
        _md([RequestSpec(5, 0, table)])  # positions 0..4: blocks 0 and 1 of the table


@pytest.mark.parametrize("table,match", [
    ([0.0], r"compressed_block_tables\[2\]\[0\]: expected an int"),
    ([-1], r"compressed_block_tables\[2\]\[0\]: block id -1 for a block in use"),
    ([-7], r"compressed_block_tables\[2\]\[0\]: block id -7"),
    (torch.tensor([[3]]), r"compressed_block_tables\[2\]: expected a 1-D tensor"),
    ("x", r"compressed_block_tables\[2\]: expected a sequence"),
])
def test_compressed_block_ids_are_checked(table, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _md([RequestSpec(5, 0, [0, 1], {2: table})], compressed_page_sizes={2: CPAGE})
    with pytest.raises(TypeError, match=r"compressed_block_tables: expected a mapping"):
        _md([RequestSpec(5, 0, [0, 1], [[0]])], compressed_page_sizes={2: CPAGE})


def test_block_tables_accept_ints_tensors_and_padding_and_record_the_largest_id():
    """-1 pads a table after the blocks in use; integer tensors, numpy-style ints and 0-d
    integer tensors are ids. The largest id of each cache's tables is kept on the host, for
    the layer to check against its caches without reading the device tables."""
    md = _md([RequestSpec(1, 4, torch.tensor([3, 9], dtype=torch.int64), {2: [torch.tensor(5), -1]}),
              RequestSpec(5, 0, [2, 7, -1, -1], {2: (4, -1)})], compressed_page_sizes={2: CPAGE})
    assert md.swa_max_block_id == 9 and md.compressed[2].max_block_id == 5
    assert md.swa_block_table.tolist() == [[3, 9, -1, -1], [2, 7, -1, -1]]
    assert md.swa_slot_mapping.tolist() == [9 * PAGE] + [2 * PAGE + i for i in range(4)] + [7 * PAGE]
    assert md.compressed[2].block_table.tolist() == [[5, -1], [4, -1]]
    # a request that holds no position yet needs no block: its table may be all padding
    md = _md([RequestSpec(0, 0, [-1])])
    assert md.swa_max_block_id == -1
    assert _md([]).swa_max_block_id == -1

