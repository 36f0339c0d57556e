"""The names the kernel
modules used to live under here (re-exported: the kernel is in ``_sparse_kernel.py``, the
split merge in ``_merge_kernel.py``, ``KeySet``/``launch`` in ``_launch.py``, launch shapes in
``_configs.py``), and the argument checks decode and prefill share (from
``dsv41_triton._contract``)."""
from __future__ import annotations

from .._contract import (check_indices, check_lens, check_out, check_q,  # noqa: F401
                         check_scale, check_sink, new_outputs)
from ._configs import (GPU_CANDIDATES, LAUNCH_TABLE, MIN_BLOCK_N_GPU, VARIANTS,  # noqa: F401
                       KernelConfig, config_from_template, config_shape, default_config)
from ._launch import LAST_LAUNCH, KeySet, launch  # noqa: F401
from ._sparse_kernel import SRC_BF16  # noqa: F401


def check_common(q, attn_sink, softmax_scale, out, what: str):
    """Validate ``q``, ``attn_sink``, ``softmax_scale`` and ``out`` (the contract's checks);
    return ``(T, H, scale)``."""
    T, H = check_q(q)
    check_sink(attn_sink, H)
    scale = check_scale(softmax_scale)
    check_out(out, T, H)
    return T, H, scale


__all__ = ["KeySet", "KernelConfig", "default_config", "launch", "SRC_BF16", "VARIANTS",
           "GPU_CANDIDATES", "config_from_template", "config_shape"]
