"""The ``sglang`` engine: SGLang's own DCP code, loaded from a source tree, inside the ranks.

* ``loader``: SGLang's four stubs over dcpsim's source loader (``dcpsim.engine.loading``);
* ``adapter``: ``SglangEngine``, the ``Engine`` whose decisions call SGLang's functions;
* ``writes``: SGLang's MLA write kernels run on a probe of a rank's store;
* ``mha_writes``: its Triton backend's MHA write over its pool's masked kernel, on a probe;
* ``reads``: its read-index builders (per-token ids, the MLA page table);
* ``merge``: its all-to-all combine and all-gather correction over the rank's group;
* ``rules``: what SGLang refuses under DCP, and its MLA merge's LSE base, quoted from its source.
"""
