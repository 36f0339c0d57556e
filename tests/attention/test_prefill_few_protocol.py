"""A random-interleaving model of the few-heads Gluon prefill's mbarrier protocol
(``attention/gluon/prefill_few.py``: its docstring's barriers), on the CPU, for the picked kernel
(one consumer warpgroup) and for the two-``mma.sync``-consumer form (alternate blocks, the
softmax states merged at each token's end).

Agents: ``PW`` producer warps and ``CW`` warps per consumer running the kernel's waits, arrives,
warpgroup barriers and shared-memory reads / writes (index slots ``k % 3``, Q slots ``k % 2``,
ring stages ``g % NS``, the merge buffer), over random token lists with empty tokens, scheduled
by ``mbarrier_model.schedule``. The model is hand-kept beside the kernel: change both together.
"""
import random

import pytest
from mbarrier_model import Bar, rd, schedule

#: producer warps, warps per consumer (the kernel has 4 and 4; 2 keep the model small)
PW, CW = 2, 2
IDX_SLOTS = 3


def producer(nblks, w, ns, idx_slots):
    """Producer warp ``w`` (the same in every form): index rows two tokens ahead, Q per token,
    each block's rows into ring stage ``g % ns``."""
    n_tok = len(nblks)

    def copy_index_row(k):
        if k < n_tok:
            s = k % idx_slots
            yield ("wait", f"i_free{s}", k // idx_slots - 1)
            yield ("write", ("idx", s, w), k)
            yield ("arrive", f"i_ready{s}")

    yield from copy_index_row(0)
    yield from copy_index_row(1)
    g = 0
    for k, nblk in enumerate(nblks):
        yield from copy_index_row(k + 2)
        qs = k % 2
        yield ("wait", f"q_free{qs}", k // 2 - 1)
        yield ("write", ("Q", qs, w), k)
        yield ("arrive", f"q_ready{qs}")
        si = k % idx_slots
        yield ("wait", f"i_ready{si}", k // idx_slots)
        for b in range(nblk):
            s = g % ns
            yield from rd(("idx", si), k, PW)
            yield ("wait", f"free{s}", g // ns - 1)
            yield ("write", ("ring", s, w), g)
            yield ("arrive", f"ready{s}")
            g += 1


def run(nblks, seed, ns=2, consumers=1, idx_slots=IDX_SLOTS, no_barrier_empty=False,
        early_q_free=False, no_merge_free=False):
    """One CTA over tokens of ``nblks[k]`` 64-key blocks; ``consumers`` 1 (the wgmma kernel)
    or 2 (the mma.sync form). The flags break the protocol on purpose (the mutation test):
    ``idx_slots=2`` (the index row copied two tokens ahead into only two slots),
    ``no_barrier_empty`` (an empty token hands its slots back without the warpgroup barrier
    after the waits), ``early_q_free`` (Q freed before the last block's S read it),
    ``no_merge_free`` (consumer 1 writes the merge buffer without waiting for consumer 0 to
    have read the previous token's)."""
    n_tok = len(nblks)
    bars = {}
    for s in range(2):
        bars[f"q_ready{s}"] = Bar(PW)
        bars[f"q_free{s}"] = Bar(consumers)
    for s in range(idx_slots):
        bars[f"i_ready{s}"] = Bar(PW)
        bars[f"i_free{s}"] = Bar(consumers)
    for s in range(ns):
        bars[f"ready{s}"] = Bar(PW)
        bars[f"free{s}"] = Bar(1)
    bars["mg_ready"] = Bar(1)
    bars["mg_free"] = Bar(1)

    def consumer(C, w):
        g = 0
        for k, nblk in enumerate(nblks):
            qs, si = k % 2, k % idx_slots
            if consumers == 1:
                mine = list(range(nblk))
            else:
                mine = [b for b in range(nblk) if (g + b) % 2 == C]
            yield ("wait", f"q_ready{qs}", k // 2)
            yield ("wait", f"i_ready{si}", k // idx_slots)
            if not no_barrier_empty:
                yield ("tb", C)
            if not mine:
                yield ("arrive", f"q_free{qs}")
                yield ("arrive", f"i_free{si}")
            for j, b in enumerate(mine):
                gg = g + b
                s = gg % ns
                last = j == len(mine) - 1
                yield from rd(("idx", si), k, PW)
                yield ("wait", f"ready{s}", gg // ns)
                if early_q_free and last:
                    yield ("tb", C)
                    yield ("arrive", f"q_free{qs}")
                yield from rd(("ring", s), gg, PW)  # the S products
                yield from rd(("Q", qs), k, PW)
                yield ("tb", C)
                if last:
                    if not early_q_free:
                        yield ("arrive", f"q_free{qs}")
                    yield ("arrive", f"i_free{si}")
                yield from rd(("ring", s), gg, PW)  # the O products
                yield ("tb", C)
                yield ("arrive", f"free{s}")
            if consumers == 2:
                if C == 1:
                    if not no_merge_free:
                        yield ("wait", "mg_free", k - 1)
                    yield ("write", ("mg", w), k)
                    yield ("tb", C)
                    yield ("arrive", "mg_ready")
                else:
                    yield ("wait", "mg_ready", k)
                    yield from rd(("mg",), k, CW)
                    yield ("tb", C)
                    yield ("arrive", "mg_free")
            g += nblk

    agents = {("P", w): producer(nblks, w, ns, idx_slots) for w in range(PW)}
    for C in range(consumers):
        for w in range(CW):
            agents[("C", C, w)] = consumer(C, w)
    steps = schedule(agents, bars, seed, CW)
    if not no_merge_free and consumers == 2:
        assert bars["mg_ready"].done == n_tok
    return steps


def _tokens(rnd):
    return [rnd.choice([0, 0, 1, 2, 3, 5, 8]) for _ in range(rnd.randint(1, 9))]


@pytest.mark.parametrize("consumers,ns", [(1, 2), (1, 3), (2, 2)])
def test_few_protocol_random_schedules(consumers, ns):
    rnd = random.Random(consumers * 10 + ns)
    for seed in range(300):
        run(_tokens(rnd), seed, ns=ns, consumers=consumers)
    run([0] * 12, 1, ns=ns, consumers=consumers)  # only empty tokens
    run([8] * 6, 2, ns=ns, consumers=consumers)
    run([1] * 9, 3, ns=ns, consumers=consumers)  # every token on one consumer of two


@pytest.mark.parametrize("consumers,flags,what", [
    (1, dict(idx_slots=2), "deadlock"),
    (1, dict(no_barrier_empty=True), "lap"),
    (1, dict(early_q_free=True), "stale"),
    (2, dict(no_merge_free=True), "stale|lap"),
    (2, dict(early_q_free=True), "stale"),
])
def test_few_protocol_model_catches_mutations(consumers, flags, what):
    """The model fails for two index slots (the copy two tokens ahead waits for a slot whose
    token still needs blocks the producer has not copied), for an empty token's hand-back
    without the warpgroup barrier (a lagging warp's parity wait laps), for Q freed before the
    last S read it (the producer refills it), and for a merge buffer written before consumer 0
    read the previous token's (or consumer 1 running tokens ahead of consumer 0's waits)."""
    rnd = random.Random(7)
    with pytest.raises(AssertionError, match=what):
        for seed in range(3000):
            run(_tokens(rnd), seed, consumers=consumers, **flags)
