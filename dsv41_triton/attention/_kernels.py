"""Argument checks shared by ``decode.py`` and ``prefill.py``, and the names the kernel
modules used to live under here (re-exported: the kernel is in ``_sparse_kernel.py``, the
split merge in ``_merge_kernel.py``, ``KeySet``/``launch`` in ``_launch.py``, launch shapes in
``_configs.py``)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .._utils import HEAD_DIM, INT_DTYPES, check_shape, check_tensor
from ._configs import (GPU_CANDIDATES, LAUNCH_TABLE, MIN_BLOCK_N_GPU, VARIANTS,  # noqa: F401
                       KernelConfig, config_from_template, config_shape, default_config)
from ._launch import LAST_LAUNCH, KeySet, launch  # noqa: F401
from ._sparse_kernel import SRC_BF16  # noqa: F401


def check_common(q, attn_sink, softmax_scale, out, what: str):
    """Validate ``q``, ``attn_sink``, ``softmax_scale`` and ``out`` (shared by decode and
    prefill); return ``(T, H, scale, out or None)``."""
    check_tensor("q", q, dtypes=(torch.bfloat16,), ndims=3)
    if q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q: expected head_dim {HEAD_DIM} (last dim), got shape {tuple(q.shape)}")
    check_tensor("q", q, last_dim=HEAD_DIM)
    T, H = int(q.shape[0]), int(q.shape[1])
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtypes=(torch.float32,), ndims=1,
                     contiguous_last=False)
        if attn_sink.shape[0] != H:
            raise ValueError(f"attn_sink: expected shape [{H}] (one per head of q), got "
                             f"{tuple(attn_sink.shape)}")
    if softmax_scale is None:
        scale = HEAD_DIM ** -0.5
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale: expected a float or None, got "
                            f"{type(softmax_scale).__name__}")
        scale = float(softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale: expected a finite number, got {scale}")
    if out is not None:
        check_tensor("out", out, dtypes=(torch.bfloat16,), ndims=3, last_dim=HEAD_DIM)
        check_shape("out", out, (T, H, HEAD_DIM))
    return T, H, scale


def check_lens(name: str, lens, T: int):
    if lens is None:
        return
    check_tensor(name, lens, dtypes=INT_DTYPES, ndims=1, contiguous_last=False)
    if lens.shape[0] != T:
        raise ValueError(f"{name}: expected shape [{T}] (one per query token), got "
                         f"{tuple(lens.shape)}")


def check_indices(name: str, idx, T: int):
    check_tensor(name, idx, dtypes=INT_DTYPES, ndims=2)
    if idx.shape[0] != T:
        raise ValueError(f"{name}: expected {T} rows (one per query token), got "
                         f"{tuple(idx.shape)}")


def new_outputs(q: torch.Tensor, out: Optional[torch.Tensor]):
    T, H = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty((T, H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    return out, lse


__all__ = ["KeySet", "KernelConfig", "default_config", "launch", "SRC_BF16", "VARIANTS",
           "GPU_CANDIDATES", "config_from_template", "config_shape"]
