"""Launch shapes of the sparse MLA kernel: ``KernelConfig``, the per-architecture table
``LAUNCH_TABLE`` and ``default_config`` (the shape used when a caller passes none).

``LAUNCH_TABLE`` is keyed by ``(backend, compute capability)``: ``("cuda", (9, 0))`` holds the
H200 measurements, ``("cuda", None)`` / ``("rocm", None)`` are the fallbacks for other
devices of that backend, ``("interpreter", None)`` is used for CPU tensors and under
``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from .._utils import cdiv, is_interpreter, next_power_of_2

#: smallest key block used on a GPU: 16-key blocks (BLOCK_H 16, 584 + 288 caches) gave wrong
#: outputs on an H200 with triton 3.6 while the interpreter and 32/64-key blocks were right
MIN_BLOCK_N_GPU = 32

#: kernel variants a KernelConfig can name (one: eight [BN, 64] key pieces per step)
VARIANTS = ("group",)


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: heads per program, keys per step, key splits, warps, pipeline stages,
    the kernel ``variant`` (``"group"``) and ``lazy_rescale``: skip the accumulator rescale
    unless a row max grows by more than 2**8 (exact: out, l and lse all use the kept max)."""

    block_h: int
    block_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2
    variant: str = "group"
    lazy_rescale: bool = False

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if not (isinstance(v, int) and 16 <= v <= 256 and v & (v - 1) == 0):
                raise ValueError(f"KernelConfig.{name}: expected a power of two in [16, 256], "
                                 f"got {v!r}")
        if not (isinstance(self.num_splits, int) and 1 <= self.num_splits <= 64):
            raise ValueError(f"KernelConfig.num_splits: expected 1..64, got {self.num_splits!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps: expected 1, 2, 4, 8 or 16, got "
                             f"{self.num_warps!r}")
        if not (isinstance(self.num_stages, int) and 1 <= self.num_stages <= 6):
            raise ValueError(f"KernelConfig.num_stages: expected 1..6, got {self.num_stages!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"KernelConfig.variant: expected one of {VARIANTS}, got "
                             f"{self.variant!r}")
        if not isinstance(self.lazy_rescale, bool):
            raise ValueError(f"KernelConfig.lazy_rescale: expected a bool, got "
                             f"{self.lazy_rescale!r}")


#: a launch shape: (variant, block_h, block_n, num_warps, num_stages, lazy_rescale)
Shape = Tuple[str, int, int, int, int, bool]


@dataclass(frozen=True)
class ArchLaunch:
    """Default launch rules of one architecture.

    ``templates``: ``(paged, block_h) -> (shape, resident programs per SM)`` for head tiles
    16/32/64; ``head_tile(T, H, paged)``: the head tile when the caller pins none;
    ``split``: derive a key split count from the residency (else always one split);
    ``window_block_n``: keys per step of the shared-window kernel."""

    templates: Dict[Tuple[bool, int], Tuple[Shape, int]]
    head_tile: Callable[[int, int, bool], int]
    split: bool
    window_block_n: int = 64


def _gpu_head_tile(T: int, H: int, paged: bool) -> int:
    # decode, 64 heads: 16-head tiles win at 1 and 32 tokens (16.0 vs 24.1 / 37.4 vs 45.8 us
    # for 64-head tiles), 64-head tiles at 128 (89.4 vs 115.1 us)
    if H <= 16 or (paged and T * cdiv(H, 64) <= 32):
        return 16  # few heads, or few tokens: more (smaller) programs
    if H <= 32:
        return 32
    return 64


def _interpreter_head_tile(T: int, H: int, paged: bool) -> int:
    return min(64, max(16, next_power_of_2(H)))  # few, large steps


#: H200 (sm_90) templates. The split count is derived from the residency (splitting the keys
#: pays only up to about one wave of resident programs: the fp32 partials cost bandwidth).
#: Measured (H200, triton 3.6, CUDA graph; perf/NOTES.md "Session 2 results"): decode 8 heads
#: x 128 tokens 82.8 -> 39.2 us, 64 heads 208.8 -> 89.4 us; prefill 8 heads 733 -> 528 us,
#: 64 heads 1548 -> 1472 us. The 32-head templates were timed at 64/128 heads (two tiles).
_SM90_TEMPLATES = {
    (True, 16): (("group", 16, 64, 4, 2, False), 2),
    (True, 32): (("group", 32, 64, 8, 3, False), 1),
    (True, 64): (("group", 64, 64, 8, 2, False), 1),
    (False, 16): (("group", 16, 64, 4, 3, True), 2),
    (False, 32): (("group", 32, 64, 4, 3, False), 2),
    (False, 64): (("group", 64, 64, 8, 3, False), 1),
}

#: GPUs with about 99 KB of shared memory per CTA (sm_86, sm_89, RTX Blackwell sm_120, and
#: any CUDA GPU without an entry of its own): 16-head tiles of 32 paged keys
#: (65-67 KB on sm_120) or 64 workspace rows (84 KB), one program per SM. Compiled, not
#: measured: ``tests/test_targets.py`` checks they fit.
_SMALL_SMEM_TEMPLATES = {
    (paged, bh): ((("group", 16, 32, 4, 3, False), 1) if paged
                  else (("group", 16, 64, 4, 3, False), 1))
    for paged in (True, False) for bh in (16, 32, 64)}


def _small_smem_head_tile(T: int, H: int, paged: bool) -> int:
    return 16


def _rocm_head_tile(T: int, H: int, paged: bool) -> int:
    """AMD (64 KB of LDS per workgroup on MI300 / MI250) takes the sm_90 shapes: the decode ones
    fit (at most 45 KB on gfx942), the workspace prefill's up to 32-head tiles (64 KB; 64-head
    tiles need 72). Compiled, not measured."""
    bh = _gpu_head_tile(T, H, paged)
    return bh if paged else min(bh, 32)


#: the interpreter: 64-key steps, one split unless asked, one stage
_INTERPRETER_TEMPLATES = {(paged, bh): (("group", bh, 64, 4, 1, False), 1)
                          for paged in (True, False) for bh in (16, 32, 64)}

#: default launch rules by (backend, compute capability); ``None``: any other device of that
#: backend. sm_90 is measured (H200); A100 (sm_80, 163 KB of shared memory per CTA) and B200
#: (sm_100, 227 KB) take the same shapes (they fit: at most 161 / 194 KB there) and AMD most of
#: them, unmeasured; other CUDA GPUs the small shapes. ``tests/test_targets.py`` compiles every
#: launch for sm_80 / sm_90 / sm_100 / sm_120 / gfx942 and checks it fits.
LAUNCH_TABLE: Dict[Tuple[str, Optional[Tuple[int, int]]], ArchLaunch] = {
    ("cuda", (9, 0)): ArchLaunch(_SM90_TEMPLATES, _gpu_head_tile, split=True),
    ("cuda", (8, 0)): ArchLaunch(_SM90_TEMPLATES, _gpu_head_tile, split=True),
    ("cuda", (10, 0)): ArchLaunch(_SM90_TEMPLATES, _gpu_head_tile, split=True),
    ("cuda", None): ArchLaunch(_SMALL_SMEM_TEMPLATES, _small_smem_head_tile, split=True,
                               window_block_n=32),
    ("rocm", None): ArchLaunch(_SM90_TEMPLATES, _rocm_head_tile, split=True, window_block_n=32),
    ("interpreter", None): ArchLaunch(_INTERPRETER_TEMPLATES, _interpreter_head_tile,
                                      split=False),
}

#: launch shapes that the GPU tests check (with and without splits, every record width) and
#: ``perf/bench_attention.py --sweep`` times; ``default_config`` on a GPU only ever returns
#: one of these. Registers / spills / shared memory from an sm_90 compile: perf/NOTES.md.
GPU_CANDIDATES = {
    "decode": (
        ("group", 16, 32, 4, 3, False), ("group", 16, 32, 4, 3, True),
        ("group", 16, 64, 4, 2, False), ("group", 16, 64, 4, 2, True),
        ("group", 16, 64, 8, 3, False), ("group", 32, 64, 8, 3, False),
        ("group", 32, 64, 8, 3, True), ("group", 64, 32, 8, 2, False),
        ("group", 64, 64, 8, 2, False), ("group", 64, 64, 8, 2, True),
    ),
    "prefill": (
        ("group", 16, 32, 4, 3, False), ("group", 16, 64, 4, 3, False),
        ("group", 16, 64, 4, 3, True), ("group", 32, 64, 4, 3, False),
        ("group", 32, 64, 8, 3, False), ("group", 64, 64, 8, 2, False),
        ("group", 64, 64, 8, 2, True), ("group", 64, 64, 8, 3, False),
    ),
}

_SM_COUNT: Dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SM_COUNT:
        _SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SM_COUNT[i]


def _capability(device: torch.device) -> Tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def arch_key(device: torch.device) -> Tuple[str, Optional[Tuple[int, int]]]:
    """``("interpreter", None)`` for CPU tensors or TRITON_INTERPRET, else
    ``("cuda" | "rocm", (major, minor))``."""
    if device.type != "cuda" or is_interpreter():
        return ("interpreter", None)
    return ("rocm" if torch.version.hip else "cuda", _capability(device))


def arch_launch(device: torch.device) -> ArchLaunch:
    """The ``LAUNCH_TABLE`` entry of ``device`` (its backend's fallback when the capability
    has none)."""
    key = arch_key(device)
    return LAUNCH_TABLE.get(key) or LAUNCH_TABLE[(key[0], None)]


def config_shape(cfg: KernelConfig) -> tuple:
    """The launch shape of ``cfg`` as in ``GPU_CANDIDATES`` (everything but the split)."""
    return (cfg.variant, cfg.block_h, cfg.block_n, cfg.num_warps, cfg.num_stages,
            cfg.lazy_rescale)


def config_from_template(T: int, H: int, total_width: int, sms: int, shape: tuple,
                         resident: int, block_n: Optional[int] = None) -> KernelConfig:
    """A KernelConfig for one launch shape (a ``GPU_CANDIDATES`` tuple), with the split
    count of ``default_config`` for ``resident`` programs per SM."""
    variant, bh, bn, warps, stages, lazy = shape
    bn = block_n or bn
    progs = max(1, T * cdiv(H, bh))
    slots = sms * resident
    splits = 1
    if progs < slots:
        splits = max(1, min(slots // progs, cdiv(max(total_width, 1), bn), 32))
    return KernelConfig(block_h=bh, block_n=bn, num_splits=splits, num_warps=warps,
                        num_stages=stages, variant=variant, lazy_rescale=lazy)


@functools.lru_cache(maxsize=4096)
def default_config(T: int, H: int, total_width: int, device: torch.device, *,
                   paged: bool, block_h: Optional[int] = None,
                   block_n: Optional[int] = None) -> KernelConfig:
    """The launch shape used when the caller passes none: a pure function of the shapes (so a
    captured graph replays the same launch). ``block_h``/``block_n`` pin those two.

    The ``LAUNCH_TABLE`` entry of the device gives the head tile and its template; with
    ``split`` the key split count fills about one wave of resident programs.
    """
    rules = arch_launch(device)
    bh = block_h or rules.head_tile(T, H, paged)
    shape, resident = rules.templates[(paged, min(64, max(16, bh)))]
    shape = (shape[0], bh) + shape[2:]
    if not rules.split:
        _, _, bn, warps, stages, lazy = shape
        return KernelConfig(block_h=bh, block_n=block_n or bn, num_splits=1, num_warps=warps,
                            num_stages=stages, variant=shape[0], lazy_rescale=lazy)
    return config_from_template(T, H, total_width, _sm_count(device), shape, resident,
                                block_n)


__all__ = ["KernelConfig", "VARIANTS", "MIN_BLOCK_N_GPU", "LAUNCH_TABLE", "ArchLaunch",
           "GPU_CANDIDATES", "arch_key", "arch_launch", "config_from_template", "config_shape",
           "default_config"]
