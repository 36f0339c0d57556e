"""Small shared helpers: interpreter detection and integer helpers. The argument checks
live in ``_contract.py`` (re-exported here for older imports)."""
from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ._contract import (  # noqa: F401  (re-exported: the checks live in the contract module)
    HEAD_DIM,
    INDEX_DTYPES,
    INT_DTYPES,
    NOPE_DIM,
    ROPE_DIM,
    check_int,
    check_same_device,
    check_shape,
    check_tensor,
)


def is_interpreter() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


LATE_INTERPRETER_MESSAGE = (
    "TRITON_INTERPRET=1 is set, but it was not set yet when {module} defined its Triton "
    "kernels, so they were compiled for a GPU and cannot run on CPU tensors. Set it before "
    "anything imports the dsv41_triton kernels (e.g. `TRITON_INTERPRET=1 python script.py`, "
    "or `os.environ['TRITON_INTERPRET'] = '1'` at the very top of the script), or unset it: "
    "without it CPU tensors run the PyTorch reference path (same semantics)."
)


def kernel_is_interpreted(kernel) -> bool:
    """Whether a ``@triton.jit`` function was defined for Triton's CPU interpreter (Triton
    decides that when the function is defined, from ``TRITON_INTERPRET``)."""
    return type(kernel).__name__ == "InterpretedFunction"


def use_reference(device: torch.device, kernel) -> bool:
    """Where a public op runs: False = the Triton ``kernel``; True = the PyTorch reference
    (CPU tensors while the kernels were defined without the interpreter). Raises RuntimeError
    with what to do when ``TRITON_INTERPRET=1`` was set only after the kernels were defined."""
    if device.type != "cpu" or kernel_is_interpreted(kernel):
        return False
    if is_interpreter():
        fn = getattr(kernel, "fn", kernel)
        raise RuntimeError(LATE_INTERPRETER_MESSAGE.format(
            module=getattr(fn, "__module__", "dsv41_triton")))
    return True


#: argument types ``call_op`` runs directly (a module's parameters are plain tensors to it)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def call_op(op, *args):
    """Run the ``dsv41::`` custom op ``op`` (a ``torch.library.custom_op`` object) on ``args``.

    Eager calls on plain tensors and parameters run its Python implementation directly: the
    dispatcher round trip of a Python custom op costs 40-65 us of host time per call (measured
    on CPU), as much as a whole decode kernel. Traced calls (``torch.compile``, export, a
    dispatch mode, tensor subclasses such as fake or functional tensors) go through
    ``torch.ops.dsv41.<name>``, so the tracer records the op (with its fake implementation)
    instead of looking inside it."""
    if (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and all(type(a) in _PLAIN_TENSORS for a in args if isinstance(a, torch.Tensor))):
        return op._init_fn(*args)
    return getattr(torch.ops.dsv41, op._name)(*args)
