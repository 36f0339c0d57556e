"""A random-interleaving model of the persistent Gluon prefill's mbarrier protocol
(``attention/gluon/prefill_wsp.py``; its docstring's phase table), on the CPU.

Agents: ``PW`` producer warps and ``CW`` warps per consumer, each running the kernel's sequence
of mbarrier waits / arrives, warpgroup barriers (``tb``) and shared-memory writes / reads
(tagged with the item or pair they belong to), over random item lists with empty items, run by
``mbarrier_model.schedule`` (its checks: no deadlock, no parity lap, no stale read, no
half-arrived barrier). The model is hand-kept beside the kernel: change both together.
"""
import random

import pytest
from mbarrier_model import Bar, rd, schedule

#: producer warps, warps per consumer (the kernel has 4 and 4; 2 keep the model small)
PW, CW = 2, 2


def run(lens_pairs, seed, one_l_buffer=False, no_barrier_empty=False, free_other_early=False):
    """One CTA over items of ``lens_pairs[k]`` block pairs, scheduled by ``seed``; raises
    AssertionError (deadlock / lap / stale) on a protocol fault. An async product reads its
    operands at issue and at completion. The flags break the protocol on purpose (the
    mutation test): ``free_other_early`` has each consumer free its half of the other stage
    between issuing and completing its remote PV."""
    bars = {"q_ready": Bar(PW), "q_free": Bar(2)}
    for i in range(4):
        bars[f"ready{i}"] = Bar(PW)
    for i, c in enumerate((1, 2, 2, 1)):
        bars[f"free{i}"] = Bar(c)
    for c in range(2):
        bars[f"m{c}"] = Bar(1)
        bars[f"p{c}"] = Bar(1)
    for i in range(4):
        bars[f"l{i}"] = Bar(1)

    def producer(w):
        g = 0
        for k, npair in enumerate(lens_pairs):
            yield ("wait", "q_free", k - 1)
            yield ("write", ("Q", w), k)
            yield ("arrive", "q_ready")
            for i in range(npair):
                gi = g + i
                for S, HF in ((0, 0), (1, 1), (0, 1), (1, 0)):
                    yield ("wait", f"free{2 * S + HF}", gi - 1)
                    yield ("write", ("ring", S, HF, w), gi)
                    yield ("arrive", f"ready{2 * S + HF}")
            g += npair

    def qk_half(S, HF, gi, k):
        yield ("wait", f"ready{2 * S + HF}", gi)
        yield from rd(("ring", S, HF), gi, PW)
        yield from rd(("Q",), k, PW)

    def consumer(C, w):
        g = 0
        for k, npair in enumerate(lens_pairs):
            yield ("wait", "q_ready", k)
            if not no_barrier_empty:
                yield ("tb", C)
            if npair == 0:
                yield ("arrive", "q_free")
            for i in range(npair):
                gi = g + i
                last = i == npair - 1
                yield from qk_half(C, C, gi, k)
                yield from qk_half(C, 1 - C, gi, k)
                yield ("tb", C)
                if last:
                    yield ("arrive", "q_free")
                yield ("arrive", f"free{2 * C + 1 - C}")
                if C == 0:
                    yield ("write", ("m", 0, w), gi)
                    yield ("tb", C)
                    yield ("arrive", "m0")
                else:
                    yield ("wait", "m0", gi)
                    yield from rd(("m", 0), gi, CW)
                    yield ("write", ("m", 1, w), gi)
                    yield ("tb", C)
                    yield ("arrive", "m1")
                yield from rd(("ring", C, C), gi, PW)  # local PV issued
                if C == 0:
                    yield ("wait", "m1", gi)
                    yield from rd(("m", 1), gi, CW)
                    yield ("write", ("p", 0, w), gi)
                    yield ("tb", C)
                    yield ("arrive", "p0")
                else:
                    yield ("write", ("p", 1, w), gi)
                    yield ("tb", C)
                    yield ("arrive", "p1")
                yield from rd(("ring", C, C), gi, PW)  # local PV finished
                yield ("tb", C)
                yield ("arrive", f"free{2 * C + C}")
                yield ("wait", f"p{1 - C}", gi)
                remote = list(rd(("p", 1 - C), gi, CW)) + list(rd(("ring", 1 - C, C), gi, PW))
                yield from remote  # the remote PV issued
                if free_other_early:
                    yield ("tb", C)
                    yield ("arrive", f"free{2 * (1 - C) + C}")
                yield from remote  # the remote PV completes
                if not free_other_early:
                    yield ("tb", C)
                    yield ("arrive", f"free{2 * (1 - C) + C}")
            g += npair
            lb, lph = (0, k) if one_l_buffer else (k & 1, k >> 1)
            yield ("write", ("l", lb, C, w), k)
            yield ("tb", C)
            yield ("arrive", f"l{2 * lb + C}")
            yield ("wait", f"l{2 * lb + 1 - C}", lph)
            yield from rd(("l", lb, 1 - C), k, CW)

    agents = {("P", w): producer(w) for w in range(PW)}
    for C in range(2):
        for w in range(CW):
            agents[("C", C, w)] = consumer(C, w)
    return schedule(agents, bars, seed, CW)


def _items(rnd):
    return [rnd.choice([0, 0, 1, 2, 3, 5]) for _ in range(rnd.randint(1, 9))]


def test_wsp_protocol_random_schedules():
    rnd = random.Random(0)
    for seed in range(400):
        run(_items(rnd), seed)
    run([0] * 12, 1)  # only empty items
    run([5] * 6, 2)


@pytest.mark.parametrize("mutation,what", [("one_l_buffer", "stale"),
                                           ("no_barrier_empty", "lap"),
                                           ("free_other_early", "stale")])
def test_wsp_protocol_model_catches_mutations(mutation, what):
    """The model fails for a single row-sum buffer (an empty item lets one consumer overwrite
    its sum before the other read it), for an empty item's Q hand-back without the
    warpgroup barrier after the wait (a lagging warp's parity wait laps), and for a consumer
    freeing its half of the other stage before its remote PV completed (the producer refills
    it under the product)."""
    rnd = random.Random(0)
    flags = {mutation: True}
    with pytest.raises(AssertionError, match=what):
        for seed in range(3000):
            run(_items(rnd), seed, **flags)
