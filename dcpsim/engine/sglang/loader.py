"""Load single modules of an SGLang source tree: dcpsim's source loader
(``dcpsim.engine.loading.tree``) with SGLang's four hand-written stubs.

What the loaded modules (``srt/layers/dcp/layout.py``, ``kernels/ops/kvcache/mla_buffer.py``,
``kernels/ops/attention/dcp_kernels.py``; for MHA writes ``srt/layers/attention/triton_backend.py``
and ``srt/mem_cache/memory_pool.py``) import from around them:

* ``sglang.srt.runtime_context``: ``get_parallel()``, the process-wide parallel state
  (SGLang's is built from its server arguments); here a record the engine sets before each
  call (``dcp_size``, ``dcp_rank``, ``attn_dcp_size``, ...), one per thread: the ranks of an
  ``--in-process`` world are threads of one process, each its own rank; its other accessors
  (``get_platform``, ...: read at import time by the memory pool) are placeholders;
* ``sglang.kernels.jit.utils``: ``is_arch_support_pdl()`` is false (no Hopper, no PDL launch);
* ``sglang.srt.platforms`` (imported lazily by the write kernels' dispatcher):
  ``current_platform.capabilities.supports_triton`` is true, so the Triton kernels run;
* ``sglang.kernels.ops.kvcache.set_mla_kv_buffer`` (the JIT CUDA write, imported lazily on
  the rope path): ``can_use_set_mla_kv_buffer`` is false, so the Triton fallback runs.

Every other ``sglang`` module they import is an automatic placeholder.
"""

from __future__ import annotations

import threading
import types

from dcpsim.engine.loading import tree
from dcpsim.engine.loading.placeholders import StubModule
from dcpsim.engine.sglang.releases import NEWEST

DEFAULT_REQUIREMENT = f"sglang=={NEWEST}"


def source_dir(sglang_source: str | None) -> str:
    """The directory holding ``sglang/``: ``sglang_source``, else ``$DCPSIM_SGLANG_SOURCE``."""
    return tree.source_dir(sglang_source, engine="sglang", package="sglang", fetch=DEFAULT_REQUIREMENT)


def _parallel(dcp_size: int = 1, dcp_rank: int = 0) -> types.SimpleNamespace:
    """What SGLang's DCP code reads of ``get_parallel()``."""
    return types.SimpleNamespace(
        dcp_enabled=dcp_size > 1, dcp_size=dcp_size, dcp_rank=dcp_rank, attn_dcp_size=dcp_size, attn_dcp_rank=dcp_rank
    )


def _runtime_context_stub(name: str, tree) -> types.ModuleType:
    module = StubModule(name, tree)  # its other accessors (get_platform, ...) are placeholders
    module.PARALLEL = threading.local()
    module.get_parallel = lambda: getattr(module.PARALLEL, "state", None) or _parallel()
    return module


def _jit_utils_stub(name: str, tree) -> types.ModuleType:
    module = types.ModuleType(name)
    module.is_arch_support_pdl = lambda: False
    return module


def _platforms_stub(name: str, tree) -> types.ModuleType:
    module = types.ModuleType(name)
    module.current_platform = types.SimpleNamespace(capabilities=types.SimpleNamespace(supports_triton=True))
    return module


def _jit_write_stub(name: str, tree) -> types.ModuleType:
    module = types.ModuleType(name)
    module.can_use_set_mla_kv_buffer = lambda *args, **kwargs: False

    def set_mla_kv_buffer(*args, **kwargs):
        raise RuntimeError("SGLang's JIT CUDA MLA write is not available on the CPU (dcpsim's stub)")

    module.set_mla_kv_buffer = set_mla_kv_buffer
    return module


RUNTIME_CONTEXT = "sglang.srt.runtime_context"
STUBS = {
    RUNTIME_CONTEXT: _runtime_context_stub,
    "sglang.kernels.jit.utils": _jit_utils_stub,
    "sglang.srt.platforms": _platforms_stub,
    "sglang.kernels.ops.kvcache.set_mla_kv_buffer": _jit_write_stub,
}


class SourceTree(tree.SourceTree):
    """A folder holding an ``sglang/`` package: an unpacked wheel, a site-packages, a checkout."""

    def __init__(self, root):
        super().__init__(root, package="sglang", label="SGLang", flag="--sglang-source", stubs=STUBS)

    def set_parallel(self, dcp_size: int, dcp_rank: int) -> None:
        """What ``get_parallel()`` returns to the loaded code in this thread from now on (every
        loaded module imported the one stub of ``sglang.srt.runtime_context``)."""
        module = self._imported.get(RUNTIME_CONTEXT)
        if module is not None:
            module.PARALLEL.state = _parallel(dcp_size, dcp_rank)
