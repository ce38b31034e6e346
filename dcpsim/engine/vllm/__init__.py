"""The ``vllm`` engine: vLLM's own DCP code, loaded from a source tree, inside the ranks.

* ``loader``: load single modules of a vLLM source tree with small stubs; Triton kernels
  run under Triton's CPU interpreter.
* ``adapter``: ``VllmEngine``, the ``Engine`` whose decisions call vLLM's functions.
* ``fetch``: download vLLM's wheel (no dependencies) and unpack it.
"""
