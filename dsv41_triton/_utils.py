"""Small shared helpers: argument checks that run before any kernel launch, interpreter
detection, and integer helpers.

Every public op validates its arguments with these helpers *before* launching anything, so
bad input raises a ``TypeError`` (wrong type/dtype) or ``ValueError`` (wrong shape, size,
layout) that names the argument, and no output or cache is touched.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence, Union

import torch

HEAD_DIM = 512  # D: the one KV head's width; dims 0..447 NoPE, 448..511 RoPE
ROPE_DIM = 64  # R: the RoPE'd tail
NOPE_DIM = HEAD_DIM - ROPE_DIM  # 448

INDEX_DTYPES = (torch.int32,)
INT_DTYPES = (torch.int32, torch.int64)


def is_interpreter() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndims: Optional[Union[int, Sequence[int]]] = None,
    last_dim: Optional[int] = None,
    contiguous_last: bool = True,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Validate one tensor argument; raise TypeError/ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name}: expected dtype {_dtype_names(dtypes)}, got {t.dtype}")
    if ndims is not None:
        allowed = (ndims,) if isinstance(ndims, int) else tuple(ndims)
        if t.dim() not in allowed:
            want = " or ".join(f"{n}-D" for n in allowed)
            raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(t.shape)}")
    if last_dim is not None and (t.dim() == 0 or t.shape[-1] != last_dim):
        raise ValueError(
            f"{name}: expected last dim {last_dim}, got shape {tuple(t.shape)}"
        )
    if contiguous_last and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: the last dim must be contiguous (stride 1), got strides {tuple(t.stride())}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: Sequence[Optional[int]]) -> None:
    """Check ``t.shape`` against ``shape`` (``None`` = any size)."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")


def check_int(name: str, v: object, *, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """Validate a Python integer argument within [lo, hi]."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"{name}: expected >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name}: expected <= {hi}, got {v}")
    return v


def check_same_device(**tensors: Optional[torch.Tensor]) -> torch.device:
    """All given tensors (None skipped) must share one device; return it."""
    devs = {n: t.device for n, t in tensors.items() if t is not None}
    first = next(iter(devs.values()))
    for n, d in devs.items():
        if d != first:
            names = ", ".join(f"{k} on {v}" for k, v in devs.items())
            raise ValueError(f"{n}: all tensors must be on one device ({names})")
    return first
