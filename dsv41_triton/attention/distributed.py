"""Deprecated: moved to ``dsv41_triton.layers.distributed`` (this alias goes in the next release)."""
import warnings

from ..layers import distributed as _moved

warnings.warn("dsv41_triton.attention.distributed moved to dsv41_triton.layers.distributed; "
              "the old path will be removed in the next release", DeprecationWarning, stacklevel=2)

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
