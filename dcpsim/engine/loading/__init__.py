"""Running an engine's own code from its source tree (vLLM's, SGLang's), engine-neutral:

* ``fetch``: download a package's wheel (no dependencies) and unpack its source;
* ``tree``: ``SourceTree``, load single modules of a source tree under their real names,
  with small stubs for everything around them;
* ``placeholders``: the automatic stubs;
* ``interpreter``: Triton's CPU interpreter, its lock and the mends of its quirks.

Each engine's loader (``dcpsim.engine.vllm.loader``, ``dcpsim.engine.sglang.loader``) adds
its own hand-written stubs.
"""
