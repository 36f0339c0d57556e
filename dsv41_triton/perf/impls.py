"""The implementations the harness compares ("backends" in the report).

An :class:`Impl` maps family names to callables with the SPEC signatures and answers
``availability(case, device)``. Sources:

* attention (``decode``/``prefill``): every backend of the dispatcher
  (``dsv41_triton.backends.registry``: ``torch``, ``triton``, ``flashmla``, ``flashmla_mega``, and
  whatever else is registered), probed with the pinned ``Problem``;
* ops: ``triton`` (``dsv41_triton.ops``), ``torch`` (their exact references) and ``vllm``
  (``vllm.models.deepseek_v41.common.ops``) when vLLM imports;
* ``load_impl("pkg.mod:obj")``: any ``AttentionBackend`` (instance or class), ``Impl``, or a
  zero-argument factory of either — how forks and tests add a backend.

Nothing here imports a kernel module at import time: Triton decides between compiling and
interpreting when a kernel is defined, so the CLI sets ``TRITON_INTERPRET`` first.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .cases import ATTENTION_FAMILIES, INDEXER_FAMILIES, OP_FAMILIES, Case
from .families import resolve

ProbeFn = Callable[[Case, torch.device], Tuple[bool, str]]


@dataclass
class Impl:
    """One implementation: ``fns[family]`` has that family's SPEC signature.

    graph_safe: its calls can be captured in a CUDA graph (no host syncs).
    max_work: skip cases with more than this many ``tokens * keys`` (slow references).
    """

    name: str
    fns: Dict[str, Callable]
    description: str = ""
    probe: Optional[ProbeFn] = None
    graph_safe: bool = True
    max_work: Optional[int] = None

    def supports(self, family: str) -> bool:
        return family in self.fns

    def availability(self, case: Case, device: torch.device) -> Tuple[bool, str]:
        if not self.supports(case.family):
            return False, f"{self.name} has no {case.family}"
        if self.probe is None:
            return True, self.description or self.name
        try:
            return self.probe(case, device)
        except Exception as e:  # a probe must never abort the run
            return False, f"probe raised {type(e).__name__}: {e}"


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------
# attention: the dispatcher's backends
# ---------------------------------------------------------------------------------------------
def problem_for(case: Case, device: torch.device):
    """The pinned ``Problem`` a backend is probed with for ``case``."""
    from ..backends.base import Problem

    if case.family in ("decode", "decode_fused"):
        return Problem(case.family, case.heads, torch.device(device), swa_record=case.swa_record,
                       extra_record=case.extra_record if case.ratio > 0 else None,
                       layout=case.layout)
    return Problem(case.family, case.heads, torch.device(device), layout=case.layout)


def backend_impl(backend, name: Optional[str] = None) -> Impl:
    """Wrap an ``AttentionBackend`` instance."""
    nm = name or getattr(backend, "name", type(backend).__name__)

    def probe(case, device):
        a = backend.probe(problem_for(case, device))
        return bool(a.available), str(a.reason)

    fns = {f: getattr(backend, f"sparse_mla_{f}") for f in ATTENTION_FAMILIES
           if hasattr(backend, f"sparse_mla_{f}")}
    return Impl(nm, fns, getattr(backend, "description", "") or nm, probe,
                graph_safe=nm != "torch")


def _registry_impl(name: str) -> Impl:
    from ..backends import registry

    def get():
        return registry.get_backend(name)

    def entry(family):
        def call(*a, **k):
            return getattr(get(), f"sparse_mla_{family}")(*a, **k)

        call.__name__ = f"sparse_mla_{family}"
        return call

    def probe(case, device):
        a = registry.probe(name, problem_for(case, device))
        return bool(a.available), str(a.reason)

    desc = ""
    try:
        desc = get().description
    except Exception as e:  # e.g. a backend whose package is missing: its probe says why
        desc = f"({type(e).__name__}: {e})"
    return Impl(name, {f: entry(f) for f in ATTENTION_FAMILIES}, desc, probe,
                graph_safe=name != "torch")


def attention_impls() -> List[Impl]:
    """One Impl per registered backend (empty when the registry is not there)."""
    try:
        from ..backends import registry
    except ImportError:
        return []
    return [_registry_impl(n) for n in registry.list_backends()]


# ---------------------------------------------------------------------------------------------
# ops: ours, their references, vLLM's
# ---------------------------------------------------------------------------------------------
#: family -> (module, attribute) of the project's Triton op
OP_SOURCES: Dict[str, Tuple[str, str]] = {
    "insert": ("dsv41_triton.ops.kv_cache", "quantize_and_insert_k_cache"),
    "gather": ("dsv41_triton.ops.kv_cache", "dequantize_and_gather_k_cache"),
    "combine_indices": ("dsv41_triton.ops.indices", "combine_topk_swa_indices"),
    "global_topk": ("dsv41_triton.ops.indices", "compute_global_topk_indices_and_lens"),
    "index_logits": ("dsv41_triton.ops.indexer", "index_logits"),
    "index_topk": ("dsv41_triton.ops.indexer", "index_topk"),
}
VLLM_OPS_MODULE = "vllm.models.deepseek_v41.common.ops"


def _lazy(module: str, attr: str) -> Callable:
    def call(*a, **k):
        fn = resolve(module, attr)
        if fn is None:
            raise ImportError(f"{module}.{attr} is missing")
        return fn(*a, **k)

    call.__name__ = attr
    return call


def triton_ops_impl() -> Impl:
    def probe(case, device):
        mod, attr = OP_SOURCES[case.family]
        if not _module_exists(mod):
            return False, f"{mod} is missing"
        dev = torch.device(device)
        if dev.type == "cpu":
            if _interp():
                return True, "Triton CPU interpreter (TRITON_INTERPRET=1)"
            return False, "CPU tensors need TRITON_INTERPRET=1"
        return True, "Triton kernels"

    return Impl("triton", {f: _lazy(*OP_SOURCES[f]) for f in OP_FAMILIES + INDEXER_FAMILIES},
                "the project's Triton ops", probe)


def torch_ops_impl() -> Impl:
    from .families import REFERENCES

    def probe(case, device):
        mod, attr = REFERENCES[case.family]
        if not _module_exists(mod):
            return False, f"{mod} is missing"
        return True, "PyTorch reference (exact)"

    return Impl("torch", {f: _lazy(*REFERENCES[f]) for f in OP_FAMILIES + INDEXER_FAMILIES},
                "the exact PyTorch references", probe, graph_safe=False)


def _vllm_insert(fn):
    """vLLM's insert takes the cache as ``[num_blocks, block_bytes]`` plus its geometry."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}

    def insert(k, k_cache, slot_mapping):
        if "block_size" in params:
            c = k_cache.squeeze(2) if k_cache.dim() == 4 else k_cache
            nb, s0 = c.shape[0], c.stride(0)
            flat = c.as_strided((nb, s0), (s0, 1), c.storage_offset())
            kw = {"block_size": c.shape[1]}
            if "bytes_per_token" in params:
                kw["bytes_per_token"] = c.shape[-1]
            return fn(k, flat, slot_mapping, **kw)
        return fn(k, k_cache, slot_mapping)

    return insert


def vllm_ops_impl() -> Optional[Impl]:
    """vLLM's ``deepseek_v41`` ops, or None when vLLM is not installed."""
    if not _module_exists("vllm"):
        return None
    names = {
        "insert": "quantize_and_insert_k_cache",
        "gather": "dequantize_and_gather_k_cache",
        "combine_indices": "combine_topk_swa_indices",
        "global_topk": "compute_global_topk_indices_and_lens",
    }
    err = {}

    def load():
        try:
            return importlib.import_module(VLLM_OPS_MODULE)
        except Exception as e:  # vLLM present but its model code does not import here
            err["e"] = f"{type(e).__name__}: {e}"
            return None

    def wrap(family, attr):
        def call(*a, **k):
            mod = load()
            fn = getattr(mod, attr, None) if mod is not None else None
            if fn is None:
                raise ImportError(f"{VLLM_OPS_MODULE}.{attr} is missing {err.get('e', '')}")
            if family == "insert":
                fn = _vllm_insert(fn)
            return fn(*a, **k)

        return call

    def probe(case, device):
        if torch.device(device).type != "cuda":
            return False, "vLLM's ops need a CUDA device"
        mod = load()
        if mod is None or not hasattr(mod, names[case.family]):
            return False, f"{VLLM_OPS_MODULE}.{names[case.family]} unavailable {err.get('e', '')}"
        return True, "vLLM deepseek_v41 ops"

    return Impl("vllm", {f: wrap(f, a) for f, a in names.items()}, "vLLM's deepseek_v41 ops",
                probe)


# ---------------------------------------------------------------------------------------------
def load_impl(spec: str) -> Impl:
    """``"pkg.mod:obj"`` -> Impl. ``obj``: an ``Impl``, an ``AttentionBackend`` instance or
    class, or a zero-argument callable returning one of those."""
    if ":" not in spec:
        raise ValueError(f"extra backend: expected 'module:attribute', got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    obj = getattr(importlib.import_module(mod_name), attr)
    for _ in range(2):
        if isinstance(obj, Impl):
            return obj
        if hasattr(obj, "sparse_mla_decode") and not isinstance(obj, type):
            return backend_impl(obj)
        if callable(obj):
            obj = obj()
    raise TypeError(f"extra backend {spec!r}: expected an Impl or an AttentionBackend, got {obj!r}")


def default_impls(extra: Sequence[Impl] = ()) -> List[Impl]:
    """All implementations, merged by name: attention backends and op sets sharing a name
    (``torch``, ``triton``) become one row label in the report."""
    merged: Dict[str, Impl] = {}

    def add(impl: Impl):
        if impl.name not in merged:
            merged[impl.name] = impl
            return
        a = merged[impl.name]
        fns = dict(a.fns)
        fns.update(impl.fns)

        def probe(case, device, a=a, b=impl):
            return (b if b.supports(case.family) else a).availability(case, device)

        merged[impl.name] = Impl(a.name, fns, a.description or impl.description, probe,
                                 a.graph_safe and impl.graph_safe, a.max_work or impl.max_work)

    for impl in attention_impls():
        add(impl)
    for impl in (torch_ops_impl(), triton_ops_impl(), vllm_ops_impl()):
        if impl is not None:
            add(impl)
    for impl in extra:
        if impl.name in merged:
            raise ValueError(f"extra backend name {impl.name!r} clashes with a built-in one")
        merged[impl.name] = impl
    return list(merged.values())
