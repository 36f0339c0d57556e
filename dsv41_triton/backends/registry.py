"""The backend registry and the dispatcher.

A backend is one file plus one line in ``_FACTORIES`` below. ``select_backend`` probes them
(probes never raise) and picks one:

* ``"auto"``: FlashMLA's fused mega kernels on SM100 when available; else FlashMLA's sparse
  kernels where they run and the head count suits them (they pad to 64/128 heads, so a shard of
  few heads pays for 64: ``AUTO_FLASHMLA_MIN_HEADS``); else the Triton kernels (any CUDA/ROCm
  GPU); else the torch reference. The returned ``Selection.reason`` says why.
* an explicit name: that backend, or a ``RuntimeError`` carrying its probe's reason.
* the environment variable ``DSV41_BACKEND`` (a backend name or ``auto``) overrides whatever
  the caller asked for, for debugging.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .base import Availability, AttentionBackend, Problem, check_problem

ENV_VAR = "DSV41_BACKEND"
#: FlashMLA pads heads to 64 or 128; auto only prefers it from this many (local) heads on
AUTO_FLASHMLA_MIN_HEADS = 33
#: auto's order of preference
AUTO_ORDER = ("flashmla_mega", "flashmla", "triton", "torch")


def _torch():
    from .torch_backend import TorchBackend

    return TorchBackend()


def _triton():
    from .triton_backend import TritonBackend

    return TritonBackend()


def _flashmla():
    from .flashmla import FlashMLABackend

    return FlashMLABackend()


def _flashmla_mega():
    from .flashmla_mega import FlashMLAMegaBackend

    return FlashMLAMegaBackend()


# name -> factory. A new backend: one file + one line here (+ its place in AUTO_ORDER).
_FACTORIES: Dict[str, Callable[[], AttentionBackend]] = {
    "flashmla_mega": _flashmla_mega,
    "flashmla": _flashmla,
    "triton": _triton,
    "torch": _torch,
}
_INSTANCES: Dict[str, AttentionBackend] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    """Add (or replace) a backend; it joins ``auto`` only if listed in ``AUTO_ORDER``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty str, got {name!r}")
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def list_backends() -> List[str]:
    """Registered backend names."""
    return list(_FACTORIES)


def get_backend(name: str) -> AttentionBackend:
    """The (cached) instance of backend ``name``; ``TypeError`` for a name that is not a str,
    ``ValueError`` for an unknown one."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a backend name (str), got {type(name).__name__}")
    if name not in _FACTORIES:
        raise ValueError(f"unknown backend {name!r}; registered: {', '.join(_FACTORIES)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = _FACTORIES[name]()
    return _INSTANCES[name]


ProblemsLike = Union[Problem, Sequence[Problem]]


def _as_problems(problems: ProblemsLike) -> Tuple[Problem, ...]:
    if isinstance(problems, Problem):
        return (problems,)
    out = tuple(problems)
    if not out or not all(isinstance(p, Problem) for p in out):
        raise TypeError("problem: expected a Problem or a non-empty sequence of Problems")
    return out


def probe(name: str, problems: ProblemsLike) -> Availability:
    """Probe backend ``name`` for every problem; never raises. Unavailable if any problem is."""
    probs = _as_problems(problems)
    try:
        backend = get_backend(name)
    except Exception as e:  # an unknown name or a factory that failed to import
        return Availability(False, f"{name}: cannot be created ({type(e).__name__}: {e})")
    reasons, auto = [], True
    for p in probs:
        bad = check_problem(p)
        if bad is not None:
            return Availability(False, f"{name}: {bad}")
        try:
            a = backend.probe(p)
        except Exception as e:  # probes must not raise; a buggy one is reported, not fatal
            a = Availability(False, f"probe raised {type(e).__name__}: {e}")
        if not a.available:
            return Availability(False, f"{name} ({p.kind}): {a.reason}")
        auto = auto and a.auto
        if a.reason not in reasons:
            reasons.append(a.reason)
    return Availability(True, f"{name}: " + "; ".join(reasons), auto)


def probe_all(problems: ProblemsLike) -> Dict[str, Availability]:
    """``{name: Availability}`` for every registered backend."""
    return {name: probe(name, problems) for name in _FACTORIES}


def available_backends(problems: ProblemsLike) -> List[str]:
    """Names of the registered backends that can serve every problem."""
    return [n for n, a in probe_all(problems).items() if a.available]


@dataclass(frozen=True)
class Selection:
    """The dispatcher's answer: a backend and why it was chosen."""

    name: str
    backend: AttentionBackend
    reason: str


def select_backend(
    name: str = "auto",
    problems: Optional[ProblemsLike] = None,
    **problem_kwargs,
) -> Selection:
    """Pick a backend for ``problems`` (a Problem, a sequence of them, or the keyword arguments
    of one Problem). See the module docstring for the policy. Raises ``RuntimeError`` with the
    probe's reason when an explicitly requested backend cannot serve the problems, ``ValueError``
    for an unknown name or a malformed problem (e.g. ``kind='bogus'``), ``TypeError`` for an
    unknown Problem field."""
    if problems is None:
        if not problem_kwargs:
            raise TypeError("select_backend: pass problems=... or the fields of one Problem")
        problems = Problem(**problem_kwargs)
    elif problem_kwargs:
        raise TypeError("select_backend: pass either problems or Problem fields, not both")
    probs = _as_problems(problems)
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    for p in probs:  # a malformed problem is the caller's error, not every backend's
        bad = check_problem(p)
        if bad is not None:
            raise ValueError(f"problem: {bad}")

    requested = name
    env = os.environ.get(ENV_VAR, "").strip()
    note = ""
    if env:
        if env != "auto" and env not in _FACTORIES:
            raise ValueError(
                f"{ENV_VAR}={env!r} names no backend; registered: {', '.join(_FACTORIES)} or auto"
            )
        if env != requested:
            note = f" ({ENV_VAR}={env} overrides the requested {requested!r})"
        name = env

    if name != "auto":
        if name not in _FACTORIES:
            raise ValueError(f"unknown backend {name!r}; registered: {', '.join(_FACTORIES)}")
        a = probe(name, probs)
        if not a.available:
            raise RuntimeError(f"backend {name!r} is not available: {a.reason}{note}")
        return Selection(name, get_backend(name), f"requested: {a.reason}{note}")

    skipped = []
    for cand in AUTO_ORDER:
        if cand not in _FACTORIES:
            continue
        a = probe(cand, probs)
        if not a.available:
            skipped.append(a.reason)
            continue
        if not a.auto:
            skipped.append(f"{a.reason} (not picked automatically)")
            continue
        if cand == "flashmla":
            heads = min(p.num_heads for p in probs)
            if heads < AUTO_FLASHMLA_MIN_HEADS:
                skipped.append(
                    f"flashmla: {heads} heads would be padded to 64 (auto prefers it from "
                    f"{AUTO_FLASHMLA_MIN_HEADS} heads on)"
                )
                continue
        why = f"auto picked {a.reason}"
        if skipped:
            why += " | passed over: " + " | ".join(skipped)
        return Selection(cand, get_backend(cand), why + note)
    raise RuntimeError("no backend can serve this problem: " + " | ".join(skipped) + note)


def describe(problems: ProblemsLike) -> str:
    """A short multi-line report of every backend's availability (for logs and reports)."""
    lines = []
    for n, a in probe_all(problems).items():
        mark = "yes" if a.available else "no "
        lines.append(f"{mark} {n}: {a.reason}")
    return "\n".join(lines)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True)
class BackendStatus:
    """One backend on this machine: ``kinds`` maps each of ``KINDS`` to its probe;
    ``available`` when it serves at least one kind; ``reason`` says what it runs on, or why not."""

    name: str
    available: bool
    reason: str
    auto: bool
    kinds: Dict[str, Availability]


def backend_status(num_heads: int = 64, device: Optional[Union[str, torch.device]] = None
                   ) -> List[BackendStatus]:
    """Every registered backend, probed for each kind of work on this machine's default device
    (CUDA when there is one, else the CPU) with the V4.1-Flash shapes (``num_heads`` query
    heads, 584-byte records). Never raises for an unavailable backend."""
    from .base import KINDS

    dev = default_device() if device is None else torch.device(device)
    rows = []
    for name in _FACTORIES:
        kinds = {k: probe(name, Problem(kind=k, num_heads=num_heads, device=dev)) for k in KINDS}
        ok = [a for a in kinds.values() if a.available]
        groups: Dict[str, List[str]] = {}  # reason -> kinds, the backend's name stripped
        for k, a in kinds.items():
            why = a.reason
            for prefix in (f"{name} ({k}): ", f"{name}: "):
                if why.startswith(prefix):
                    why = why[len(prefix):]
                    break
            groups.setdefault(why, []).append(k)
        if len(groups) == 1:
            reason = next(iter(groups))
        else:
            reason = " | ".join(f"{', '.join(ks)}: {why}" for why, ks in groups.items())
        rows.append(BackendStatus(name, bool(ok), reason, bool(ok) and all(a.auto for a in ok),
                                  kinds))
    return rows


def format_backend_status(rows: Optional[List[BackendStatus]] = None) -> str:
    """The table ``python -m dsv41_triton.backends`` prints."""
    from .base import KINDS

    rows = backend_status() if rows is None else rows
    head = ["backend", *KINDS, "auto", "reason"]
    body = [[r.name, *("yes" if r.kinds[k].available else "no" for k in KINDS),
             "yes" if r.auto else "no", r.reason] for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head) - 1)]
    lines = []
    for row in [head, *body]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])
    return "\n".join(lines)
