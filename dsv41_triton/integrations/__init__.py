"""Bridges to other libraries (imported on demand; each needs its library installed).

- ``transformers``: :func:`~dsv41_triton.integrations.transformers.replace_attention` swaps the
  attention of a transformers DeepSeek-V4 model for this package's paged FP8 layer.
"""
