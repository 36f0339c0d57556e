"""A random-interleaving model of the warp-specialized few-heads decode's mbarrier protocol
(``attention/gluon/decode_few_ws.py``) on its persistent grid (``PERSIST``): one CTA's
producer, dequant and MMA partitions over a list of items (tokens) of random block counts,
their ring stages ``g % NS`` and key tiles ``g % NT`` running on from item to item, the MMA
warpgroup storing each item's Q into the one Q buffer. Scheduled by
``mbarrier_model.schedule``; the model is hand-kept beside the kernel: change both together.

Agents: ``PW`` producer warps (each arrives on ``ready``: the kernel's per-thread cp.async
arrive), the dequant partition as warpgroup 0 and the MMA partition as warpgroup 1 of ``GW``
warps each (one elected arrive after a warpgroup barrier).
"""
import random

import pytest
from mbarrier_model import Bar, rd, schedule

#: producer warps, warps per dequant / MMA partition (the kernel: 4, 8 and 4; 2 keep it small)
PW, GW = 2, 2


def run(nblks, seed, ns=2, nt=2, no_block_barrier=False, free_before_read=False):
    """One CTA over items of ``nblks[k]`` blocks. The flags break the protocol on purpose
    (the mutation test): ``no_block_barrier`` (the MMA warps' elected thread frees a key tile
    without the warpgroup barrier after the block's O products; that barrier also orders an
    item's Q reads before the next item's Q store), ``free_before_read`` (the dequant
    partition frees a ring stage before reading it)."""
    bars = {}
    for s in range(ns):
        bars[f"ready{s}"] = Bar(PW)
        bars[f"free{s}"] = Bar(1)
    for t in range(nt):
        bars[f"tready{t}"] = Bar(1)
        bars[f"tfree{t}"] = Bar(1)

    def producer(w):
        g = 0
        for nblk in nblks:
            for _ in range(nblk):
                s = g % ns
                yield ("wait", f"free{s}", g // ns - 1)
                yield ("write", ("ring", s, w), g)
                yield ("arrive", f"ready{s}")
                g += 1

    def dequant(w):
        g = 0
        for nblk in nblks:
            for _ in range(nblk):
                s, t = g % ns, g % nt
                yield ("wait", f"ready{s}", g // ns)
                yield ("wait", f"tfree{t}", g // nt - 1)
                if free_before_read:
                    yield ("tb", 0)
                    yield ("arrive", f"free{s}")
                yield from rd(("ring", s), g, PW)
                yield ("write", ("tile", t, w), g)
                yield ("tb", 0)
                if not free_before_read:
                    yield ("arrive", f"free{s}")
                yield ("arrive", f"tready{t}")
                g += 1

    def mma(w):
        g = 0
        for k, nblk in enumerate(nblks):
            yield ("write", ("Q", w), k)
            yield ("tb", 1)
            for _ in range(nblk):
                t = g % nt
                yield ("wait", f"tready{t}", g // nt)
                yield from rd(("tile", t), g, GW)  # S
                yield from rd(("Q",), k, GW)
                yield ("tb", 1)  # P stored
                yield from rd(("tile", t), g, GW)  # O
                if not no_block_barrier:
                    yield ("tb", 1)
                yield ("arrive", f"tfree{t}")
                g += 1

    agents = {("P", w): producer(w) for w in range(PW)}
    for w in range(GW):
        agents[("C", 0, w)] = dequant(w)
        agents[("C", 1, w)] = mma(w)
    schedule(agents, bars, seed, GW)
    assert bars["tready0"].done == -(-sum(nblks) // nt)  # tile 0 took every nt-th block


def _items(rnd):
    return [rnd.choice([0, 0, 1, 2, 3, 5, 8, 10]) for _ in range(rnd.randint(1, 9))]


@pytest.mark.parametrize("ns,nt", [(2, 2), (1, 2), (3, 2)])
def test_few_ws_persistent_protocol_random_schedules(ns, nt):
    rnd = random.Random(ns * 10 + nt)
    for seed in range(300):
        run(_items(rnd), seed, ns=ns, nt=nt)
    run([0] * 9, 1, ns=ns, nt=nt)  # only empty items
    run([1] * 9, 2, ns=ns, nt=nt)  # one block per item: the ring turns over at every item
    run([10, 0, 10, 0, 1], 3, ns=ns, nt=nt)


@pytest.mark.parametrize("flags,what", [(dict(no_block_barrier=True), "stale"),
                                        (dict(free_before_read=True), "stale")])
def test_few_ws_persistent_protocol_model_catches_mutations(flags, what):
    """The model fails for a key tile freed while a lagging MMA warp may still read it (or the
    next item's Q stored under a lagging warp's read of this item's), and for a ring stage
    freed before the dequant read it."""
    rnd = random.Random(5)
    with pytest.raises(AssertionError, match=what):
        for seed in range(3000):
            run(_items(rnd), seed, **flags)


# ---- the loads each partition makes an item (or two) ahead ---------------------------------
def _ahead_walk(lens, pid, grid, two_ahead):
    """The item loop of ``decode_few_ws._producer_items`` (``two_ahead``) or of
    ``_dequant_items`` / ``_mma_items`` in Python, with the lens read as the kernel reads them
    (``_item_lens``: item clamped to the last; ``_item_step``). Returns, per item the CTA runs,
    ``(item, lens it used, lens its first ids were loaded with)``."""
    n = len(lens)

    def item_lens(i):
        return lens[min(i, n - 1)]

    out = []
    if two_ahead:
        la = item_lens(pid)
        la1 = item_lens(pid + grid)
        cur, first = la, la  # the first item's ranges and first ids, before the loop
        for item in range(pid, n, grid):
            nxt_ranges = la1  # _item_ranges(min(item + grid, n - 1), la1, ..)
            la1 = item_lens(item + 2 * grid)
            nxt_first = nxt_ranges  # _first_ids with the next item's ranges
            out.append((item, cur, first))
            cur, first = nxt_ranges, nxt_first
    else:
        la = item_lens(pid)
        for item in range(pid, n, grid):
            used, la = la, item_lens(item + grid)  # _item_step
            out.append((item, used, used))
    return out


@pytest.mark.parametrize("two_ahead", [False, True])
def test_few_ws_persistent_item_ahead_loads_reach_their_items(two_ahead):
    """Every item a CTA runs uses its own lens (and, in the producer, first slot ids loaded
    with them), though they were loaded one or two items earlier: any grid, item counts from
    1 to past the grid, the CTA's last items included."""
    rnd = random.Random(7)
    for _ in range(200):
        n = rnd.randint(1, 40)
        grid = rnd.randint(1, min(n, 12))
        lens = [(i, rnd.randint(0, 640)) for i in range(n)]  # tagged by their item
        for pid in range(grid):
            walk = _ahead_walk(lens, pid, grid, two_ahead)
            assert [w[0] for w in walk] == list(range(pid, n, grid))
            for item, used, first in walk:
                assert used[0] == item and first[0] == item, (n, grid, pid, walk)


# ---- the dequant + S form (``decode_few_ds.py``) -------------------------------------------
def run_ds(nblks, seed, no_q_barrier=False, s_before_wait=False, free_before_read=False,
           split_free=False, second_early=False, pv_sync=False):
    """One CTA of the dequant + S form over items of ``nblks[k]`` blocks: the producer (ring
    stage ``G % 2``), two dequant + S warpgroups (group ``k`` takes the blocks ``G`` with ``G %
    2 == k``, stage and key tile ``k``; it rewrites its own Q copy at the start of an item it
    has blocks in) and the MMA warpgroup (group 2: every block in order, S^T and the tile
    read, the tile freed). Flags break the protocol on purpose: ``no_q_barrier`` (no
    warpgroup barrier between a group's Q stores and its products), ``s_before_wait`` (S^T
    stored before the ``tfree`` wait, i.e. over the MMA warpgroup's read of the block two
    back), ``free_before_read`` (a ring stage freed before the group's reads of it).
    ``split_free`` (``FREE_SPLIT``): the MMA warpgroup frees each tile's first groups (with
    the slot ids beside it) once their products are done and the rest after them; the
    dequant + S warpgroup stores each part after its own wait (``second_early``: the second
    part stored after the first wait only, to be caught). ``pv_sync`` (``PV_SYNC`` with
    ``S_MASK``): the slot ids are not stored beside the tile nor read by the MMA warpgroup (the
    dequant + S warpgroup reads them with the stage), and P stays in registers (no barrier
    between the softmax and the products)."""
    bars = {}
    for s in range(2):
        bars[f"ready{s}"] = Bar(PW)
        bars[f"free{s}"] = Bar(1)
        bars[f"tready{s}"] = Bar(1)
        bars[f"tfree{s}"] = Bar(1)
        bars[f"tfreeb{s}"] = Bar(1)

    def producer(w):
        g = 0
        for nblk in nblks:
            for _ in range(nblk):
                s = g % 2
                yield ("wait", f"free{s}", g // 2 - 1)
                yield ("write", ("ring", s, w), g)
                yield ("arrive", f"ready{s}")
                g += 1

    def ds(k, w):
        g = 0
        for item, nblk in enumerate(nblks):
            j0 = (k - g) % 2
            if j0 < nblk:
                yield ("write", ("Q", k, w), item)
                if not no_q_barrier:
                    yield ("tb", k)
            for j in range(j0, nblk, 2):
                G = g + j
                if s_before_wait:
                    yield ("write", ("S", k, w), G)
                yield ("wait", f"ready{k}", G // 2)
                if not split_free:
                    yield ("wait", f"tfree{k}", G // 2 - 1)
                    if not pv_sync:
                        yield ("write", ("ids", k, w), G)
                # the first group's wgmma reads every warp's Q stores before the stage's
                # release barrier
                yield from rd(("Q", k), item, GW)
                if free_before_read:
                    yield ("tb", k)
                    yield ("arrive", f"free{k}")
                yield from rd(("ring", k), G, PW)
                if split_free:
                    yield ("wait", f"tfree{k}", G // 2 - 1)
                    if not pv_sync:
                        yield ("write", ("ids", k, w), G)
                    yield ("write", ("tile", k, w), G)
                    if not second_early:
                        yield ("wait", f"tfreeb{k}", G // 2 - 1)
                    yield ("write", ("tileb", k, w), G)
                if not free_before_read:
                    yield ("tb", k)  # the stage is freed once read, before the last stores
                    yield ("arrive", f"free{k}")
                if not split_free:
                    yield ("write", ("tile", k, w), G)
                    yield ("write", ("tileb", k, w), G)
                if not s_before_wait:
                    yield ("write", ("S", k, w), G)
                yield ("tb", k)
                yield ("arrive", f"tready{k}")
            g += nblk

    def mma(w):
        g = 0
        for nblk in nblks:
            for _ in range(nblk):
                t = g % 2
                yield ("wait", f"tready{t}", g // 2)
                yield from rd(("S", t), g, GW)
                if not pv_sync:
                    yield from rd(("ids", t), g, GW)
                    yield ("tb", 2)  # P stored
                yield from rd(("tile", t), g, GW)  # O of groups 0..3
                if split_free:
                    yield ("tb", 2)
                    yield ("arrive", f"tfree{t}")
                yield from rd(("tileb", t), g, GW)  # O of groups 4..7
                yield ("tb", 2)
                yield ("arrive", f"tfreeb{t}" if split_free else f"tfree{t}")
                g += 1

    agents = {("P", w): producer(w) for w in range(PW)}
    for w in range(GW):
        agents[("C", 0, w)] = ds(0, w)
        agents[("C", 1, w)] = ds(1, w)
        agents[("C", 2, w)] = mma(w)
    schedule(agents, bars, seed, GW)
    n = sum(nblks)
    assert bars["tready0"].done == -(-n // 2) and bars["tready1"].done == n // 2


@pytest.mark.parametrize("pv_sync", [False, True])
@pytest.mark.parametrize("split_free", [False, True])
def test_few_ds_protocol_random_schedules(split_free, pv_sync):
    rnd = random.Random(11)
    kw = dict(split_free=split_free, pv_sync=pv_sync)
    for seed in range(400):
        run_ds(_items(rnd), seed, **kw)
    run_ds([0] * 9, 1, **kw)
    run_ds([1] * 9, 2, **kw)  # one block per item: the groups alternate items
    run_ds([1, 0, 1, 2, 1, 1, 3], 3, **kw)
    run_ds([10, 0, 10, 0, 1], 4, **kw)


@pytest.mark.parametrize("flags", [dict(no_q_barrier=True), dict(s_before_wait=True),
                                   dict(free_before_read=True),
                                   dict(split_free=True, second_early=True),
                                   dict(split_free=True, s_before_wait=True),
                                   dict(split_free=True, pv_sync=True, second_early=True),
                                   dict(split_free=True, pv_sync=True, free_before_read=True)])
def test_few_ds_protocol_model_catches_mutations(flags):
    """The model fails for a group's products started before all its warps stored the item's
    Q, for an S^T stored before the tile it sits beside was freed, for a ring stage freed
    before it was read, and (tiles freed in two parts) for a second part stored before its own
    release."""
    rnd = random.Random(5)
    with pytest.raises(AssertionError, match="stale"):
        for seed in range(3000):
            run_ds(_items(rnd), seed, **flags)
