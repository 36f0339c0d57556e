"""dsv41_triton: DeepSeek V4.1 sparse MLA attention in Triton, with a FlashMLA fast path.

See SPEC.md (the contract) and README.md. Subpackages:
``ops`` (records, cache and index ops, MXFP8), ``attention`` (sparse MLA kernels, the fused
contract, the drop-in layer), ``backends`` (the dispatcher), ``perf`` (the comparison harness).
"""
__version__ = "0.1.0"
