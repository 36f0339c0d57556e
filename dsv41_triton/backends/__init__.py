"""Backend dispatcher: one interface (``base.AttentionBackend``), four backends
(``flashmla_mega``, ``flashmla``, ``triton``, ``torch``), probing that never raises, and
``select_backend`` (``DSV41_BACKEND`` overrides). Optional packages are imported lazily.
``backend_status()`` (or ``python -m dsv41_triton.backends``): which backends run here, and why
not the others."""
from .base import KINDS, LAYOUTS, WV_GROUP_SIZE, Availability, AttentionBackend, Problem
from .registry import (
    AUTO_FLASHMLA_MIN_HEADS,
    AUTO_ORDER,
    ENV_VAR,
    BackendStatus,
    Selection,
    available_backends,
    backend_status,
    describe,
    get_backend,
    list_backends,
    probe,
    probe_all,
    register_backend,
    select_backend,
)

__all__ = [
    "KINDS",
    "LAYOUTS",
    "WV_GROUP_SIZE",
    "Availability",
    "AttentionBackend",
    "Problem",
    "AUTO_FLASHMLA_MIN_HEADS",
    "AUTO_ORDER",
    "ENV_VAR",
    "BackendStatus",
    "Selection",
    "available_backends",
    "backend_status",
    "describe",
    "get_backend",
    "list_backends",
    "probe",
    "probe_all",
    "register_backend",
    "select_backend",
]
