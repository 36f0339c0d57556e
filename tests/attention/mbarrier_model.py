"""A random-interleaving model of mbarrier protocols (shared by the ``*_protocol`` tests).

An agent is a generator of ops, one warp each: ``("wait", bar, x)`` (runnable once ``bar`` has
completed more than ``x`` phases: the kernel's parity wait for its use ``x + 1``),
``("arrive", bar)`` (counted once per warpgroup: only the warp with index 0 of a consumer
arrives, as the kernel's single elected thread after a ``thread_barrier``), ``("tb", group)``
(the warpgroup barrier: all the group's warps at once), ``("write", key, version)`` and
``("read", key, version)``. Agent names are ``("P", w)`` for producer warps (each arrives:
the kernel's per-thread cp.async arrive) and ``("C", group, w)`` for consumer warps. Each step
runs one random runnable agent. Checked: no deadlock, no parity lap (a wait for use ``x + 1``
never sees more than ``x + 1`` completions: the hardware's parity wait would hang), every read
sees the version it expects, no barrier left half-arrived.
"""
import random


class Bar:
    """An mbarrier: arrivals per phase, arrivals so far in this phase, phases completed."""

    def __init__(self, count):
        self.count, self.pend, self.done = count, 0, 0


def rd(key, ver, n):
    """Reads of ``key + (x,)`` for the ``n`` writers ``x`` at ``ver``."""
    for x in range(n):
        yield ("read", key + (x,), ver)


def schedule(agents, bars, seed, warps_per_group):
    """Runs ``agents`` (name -> op generator) against ``bars`` (name -> Bar) in a random order
    drawn from ``seed``; raises AssertionError on a deadlock, a lap, a stale read or a
    half-arrived barrier. Returns the number of steps."""
    rnd = random.Random(seed)
    mem = {}
    cur = {}
    for a, gen in agents.items():
        try:
            cur[a] = next(gen)
        except StopIteration:
            pass
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
                if all(("C", C, ww) in cur and cur[("C", C, ww)][0] == "tb"
                       for ww in range(warps_per_group)):
                    runnable.append(a)
            else:
                runnable.append(a)
        if not runnable:
            raise AssertionError(("deadlock", dict(cur)))
        a = rnd.choice(runnable)
        op = cur[a]
        members = ([("C", op[1], ww) for ww in range(warps_per_group)] if op[0] == "tb"
                   else [a])
        for m in members:
            op = cur[m]
            if op[0] == "arrive":
                if not (m[0] == "C" and m[2] != 0):  # one thread of a warpgroup arrives
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
