"""A random-interleaving model of the persistent Gluon prefill's mbarrier protocol
(``attention/gluon/prefill_wsp.py``; its docstring's phase table), on the CPU.

Agents: ``PW`` producer warps and ``CW`` warps per consumer, each running the kernel's sequence
of mbarrier waits / arrives, warpgroup barriers (``tb``) and shared-memory writes / reads
(tagged with the item or pair they belong to), over random item lists with empty items. Each
step runs one random runnable agent. Checked: no deadlock, no parity lap (a wait for absolute
phase ``x`` never sees more than ``x + 1`` completions: the hardware's parity wait would hang),
every read sees the version it expects (nothing overwritten before use), no barrier left
half-arrived. The model is hand-kept beside the kernel: change both together.
"""
import random

import pytest

#: producer warps, warps per consumer (the kernel has 4 and 4; 2 keep the model small)
PW, CW = 2, 2


class Bar:
    """An mbarrier: arrivals per phase, arrivals so far in this phase, phases completed."""

    def __init__(self, count):
        self.count, self.pend, self.done = count, 0, 0


def run(lens_pairs, seed, one_l_buffer=False, no_barrier_empty=False, ids_smem=False,
        ids_early=False, ids_late=False):
    """One CTA over items of ``lens_pairs[k]`` block pairs, scheduled by ``seed``; raises
    AssertionError (deadlock / lap / stale) on a protocol fault. ``ids_smem``: the ``wsp_ids``
    variant (each pair's ids copied by the producer into one shared buffer after the pair's
    first ``free0`` wait, before its rows; each consumer reads them after its QK). The other
    flags break the protocol on purpose (the mutation test): ``ids_early`` copies the ids
    before that wait, ``ids_late`` after the pair's last ``ready`` arrive."""
    rnd = random.Random(seed)
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
    mem = {}

    def producer(w):
        g = 0
        for k, npair in enumerate(lens_pairs):
            yield ("wait", "q_free", k - 1)
            yield ("write", ("Q", w), k)
            yield ("arrive", "q_ready")
            for i in range(npair):
                gi = g + i
                if ids_smem and not ids_late:
                    if not ids_early:
                        yield ("wait", "free0", gi - 1)
                    yield ("write", ("ids", w), gi)
                waited = ids_smem and not (ids_early or ids_late)  # free0 just above
                for S, HF in ((0, 0), (1, 1), (0, 1), (1, 0)):
                    if not (waited and (S, HF) == (0, 0)):
                        yield ("wait", f"free{2 * S + HF}", gi - 1)
                    yield ("write", ("ring", S, HF, w), gi)
                    yield ("arrive", f"ready{2 * S + HF}")
                    if ids_late and (S, HF) == (1, 0):
                        yield ("write", ("ids", w), gi)
            g += npair

    def consumer(C, w):
        g = 0
        def rd_ring(S, HF, gi):
            for pw in range(PW):
                yield ("read", ("ring", S, HF, pw), gi)
        for k, npair in enumerate(lens_pairs):
            yield ("wait", "q_ready", k)
            if not no_barrier_empty:
                yield ("tb", C)
            if npair == 0:
                yield ("arrive", "q_free")
            for i in range(npair):
                gi = g + i
                yield ("wait", f"ready{2 * C + C}", gi)
                yield from rd_ring(C, C, gi)
                for pw in range(PW):
                    yield ("read", ("Q", pw), k)
                yield ("wait", f"ready{2 * C + 1 - C}", gi)
                yield from rd_ring(C, 1 - C, gi)
                for pw in range(PW):
                    yield ("read", ("Q", pw), k)
                if ids_smem:  # the block's validity, after the QK
                    for pw in range(PW):
                        yield ("read", ("ids", pw), gi)
                yield ("tb", C)
                if i == npair - 1:
                    yield ("arrive", "q_free")
                yield ("arrive", f"free{2 * C + 1 - C}")
                if C == 0:
                    yield ("write", ("m", 0, w), gi)
                    yield ("tb", C)
                    yield ("arrive", "m0")
                else:
                    yield ("wait", "m0", gi)
                    for ww in range(CW):
                        yield ("read", ("m", 0, ww), gi)
                    yield ("write", ("m", 1, w), gi)
                    yield ("tb", C)
                    yield ("arrive", "m1")
                if C == 0:
                    yield ("wait", "m1", gi)
                    for ww in range(CW):
                        yield ("read", ("m", 1, ww), gi)
                    yield ("write", ("p", 0, w), gi)
                    yield ("tb", C)
                    yield ("arrive", "p0")
                else:
                    yield ("write", ("p", 1, w), gi)
                    yield ("tb", C)
                    yield ("arrive", "p1")
                yield from rd_ring(C, C, gi)  # local PV finished
                yield ("tb", C)
                yield ("arrive", f"free{2 * C + C}")
                yield ("wait", f"p{1 - C}", gi)
                for ww in range(CW):
                    yield ("read", ("p", 1 - C, ww), gi)
                yield from rd_ring(1 - C, C, gi)
                yield ("tb", C)
                yield ("arrive", f"free{2 * (1 - C) + C}")
            g += npair
            lb, lph = (0, k) if one_l_buffer else (k & 1, k >> 1)
            yield ("write", ("l", lb, C, w), k)
            yield ("tb", C)
            yield ("arrive", f"l{2 * lb + C}")
            yield ("wait", f"l{2 * lb + 1 - C}", lph)
            for ww in range(CW):
                yield ("read", ("l", lb, 1 - C, ww), k)

    agents = {("P", w): producer(w) for w in range(PW)}
    for C in range(2):
        for w in range(CW):
            agents[("C", C, w)] = consumer(C, w)
    cur = {a: next(gen) for a, gen in agents.items()}
    steps = 0
    while cur:
        runnable = []
        for a, op in cur.items():
            if op[0] == "wait":
                b = bars[op[1]]
                assert b.done <= op[2] + 1, ("lap", a, op, b.done)
                if b.done > op[2]:
                    runnable.append(a)
            elif op[0] == "tb":
                C = op[1]
                # all warps of the consumer at a tb with the same generation
                if all(("C", C, ww) in cur and cur[("C", C, ww)][0] == "tb" for ww in range(CW)):
                    runnable.append(a)
            else:
                runnable.append(a)
        if not runnable:
            raise AssertionError(("deadlock", lens_pairs, {a: op for a, op in cur.items()}))
        a = rnd.choice(runnable)
        op = cur[a]
        if op[0] == "tb":
            C = op[1]
            members = [("C", C, ww) for ww in range(CW)]
        else:
            members = [a]
        for m in members:
            op = cur[m]
            if op[0] == "arrive":
                if m[0] == "C" and m[2] != 0:
                    pass  # one thread of the warpgroup arrives
                else:
                    b = bars[op[1]]
                    b.pend += 1
                    if b.pend == b.count:
                        b.pend, b.done = 0, b.done + 1
            elif op[0] == "write":
                mem[op[1]] = op[2]
            elif op[0] == "read":
                assert mem.get(op[1]) == op[2], ("stale", m, op, mem.get(op[1]))
            try:
                cur[m] = next(agents[m])
            except StopIteration:
                del cur[m]
        steps += 1
    for name, b in bars.items():
        assert b.pend == 0, (name, b.pend)
    return steps


def _items(rnd):
    return [rnd.choice([0, 0, 1, 2, 3, 5]) for _ in range(rnd.randint(1, 9))]


@pytest.mark.parametrize("ids_smem", [False, True])
def test_wsp_protocol_random_schedules(ids_smem):
    rnd = random.Random(0)
    for seed in range(400):
        run(_items(rnd), seed, ids_smem=ids_smem)
    run([0] * 12, 1, ids_smem=ids_smem)  # only empty items
    run([5] * 6, 2, ids_smem=ids_smem)


@pytest.mark.parametrize("mutation,what", [("one_l_buffer", "stale"),
                                           ("no_barrier_empty", "lap"),
                                           ("ids_early", "stale"), ("ids_late", "stale")])
def test_wsp_protocol_model_catches_mutations(mutation, what):
    """The model fails for a single row-sum buffer (an empty item lets one consumer overwrite
    its sum before the other read it), for an empty item's Q hand-back without the
    warpgroup barrier after the wait (a lagging warp's parity wait laps), and for ``wsp_ids``'
    id copy before the pair's ``free0`` wait (the last pair's ids overwritten before consumer
    1 read them) or after the pair's last ``ready`` arrive (no ``ready`` covers them: a
    consumer reads them too early)."""
    rnd = random.Random(0)
    flags = {mutation: True}
    if mutation.startswith("ids_"):
        flags["ids_smem"] = True
    with pytest.raises(AssertionError, match=what):
        for seed in range(3000):
            run(_items(rnd), seed, **flags)
