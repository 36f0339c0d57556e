"""Deprecated: moved to ``dsv41_triton.layers.layer`` (this alias goes in the next release)."""
import warnings

from ..layers import layer as _moved

warnings.warn("dsv41_triton.attention.layer moved to dsv41_triton.layers.layer; "
              "the old path will be removed in the next release", DeprecationWarning, stacklevel=2)

globals().update({k: v for k, v in vars(_moved).items() if not k.startswith("__")})
