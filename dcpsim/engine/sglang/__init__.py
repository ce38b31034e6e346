"""The ``sglang`` engine: SGLang's own DCP code, loaded from a source tree, inside the ranks.

* ``loader``: SGLang's four stubs over dcpsim's source loader (``dcpsim.engine.loading``);
* ``adapter``: ``SglangEngine``, the ``Engine`` whose decisions call SGLang's functions;
* ``writes``: SGLang's MLA write kernels run on a probe of a rank's store;
* ``merge``: SGLang's all-to-all combine over the rank's group;
* ``rules``: what SGLang refuses under DCP, quoted from its source.
"""
