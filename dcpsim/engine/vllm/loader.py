"""Load single modules of a vLLM source tree: dcpsim's source loader
(``dcpsim.engine.loading.tree``) with vLLM's handful of hand-written stubs.

``SourceTree(DIR)`` is the loader's tree for ``DIR/vllm/``; the modules the adapter needs
from around the ones it runs have small stubs (``STUBS``: a logger, ``triton_utils`` over
the real ``triton``, ``get_dtype_size``, the KV event records, the KV connector package's
``SupportsHMA``); every other ``vllm``
module they import is an automatic placeholder. Kernels run under Triton's interpreter
(``dcpsim.engine.loading.interpreter``, re-exported here).
"""

from __future__ import annotations

import logging
import types

from dcpsim.engine.loading import tree
from dcpsim.engine.loading.interpreter import INTERPRETER_LOCK, mend_interpreter_bools
from dcpsim.engine.loading.placeholders import StubModule
from dcpsim.engine.vllm.connector import CONNECTOR_PACKAGE, connector_package_stub

__all__ = ["INTERPRETER_LOCK", "STUBS", "SourceTree", "mend_interpreter_bools", "source_dir"]


def source_dir(vllm_source: str | None) -> str:
    """The directory holding ``vllm/``: ``vllm_source``, else ``$DCPSIM_VLLM_SOURCE``."""
    return tree.source_dir(vllm_source, engine="vllm", package="vllm", fetch="vllm")


class _Logger(logging.LoggerAdapter):
    """vLLM's logger: a standard logger plus its ``*_once`` methods (each message once)."""

    def __init__(self, name: str):
        super().__init__(logging.getLogger(name), {})
        self._said: set = set()

    def _once(self, level: int, msg, *args, **kwargs) -> None:
        key = (level, msg, args)
        if key not in self._said:
            self._said.add(key)
            self.log(level, msg, *args, **{k: v for k, v in kwargs.items() if k != "scope"})

    def debug_once(self, msg, *args, **kwargs) -> None:
        self._once(logging.DEBUG, msg, *args, **kwargs)

    def info_once(self, msg, *args, **kwargs) -> None:
        self._once(logging.INFO, msg, *args, **kwargs)

    def warning_once(self, msg, *args, **kwargs) -> None:
        self._once(logging.WARNING, msg, *args, **kwargs)


def _logger_stub(name: str, tree) -> types.ModuleType:
    module = types.ModuleType(name)
    module.init_logger = _Logger
    module.logger = _Logger("vllm")
    return module


def _triton_utils_stub(name: str, tree) -> types.ModuleType:
    import triton
    import triton.language as tl

    module = types.ModuleType(name)
    module.triton, module.tl, module.HAS_TRITON = triton, tl, True
    module.LOG2E = 1.4426950408889634
    return module


def _torch_utils_stub(name: str, tree) -> types.ModuleType:
    import torch

    module = StubModule(name, tree)
    module.get_dtype_size = lambda dtype: torch.tensor([], dtype=dtype).element_size()
    return module


class _Event:
    """A KV cache event as vLLM's block pool builds it (keywords only), readable back."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


def _kv_events_stub(name: str, tree) -> types.ModuleType:
    """vLLM's KV event types (msgspec structs there) as plain records of the same names."""
    module = types.ModuleType(name)
    module.KVCacheEvent = type("KVCacheEvent", (_Event,), {})
    for event in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        setattr(module, event, type(event, (module.KVCacheEvent,), {}))
    module.MEDIUM_GPU, module.MEDIUM_CPU, module.MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
    module.KVEventBatch = type("KVEventBatch", (_Event,), {})
    module.EventPublisherFactory = _EventPublisherFactory
    return module


class _EventPublisher:
    """vLLM's event publisher (a ZMQ socket there): keeps each published batch's events,
    for whoever drives vLLM's scheduler to read back (``take``)."""

    def __init__(self):
        self.events: list = []

    def publish(self, batch) -> None:
        self.events += batch.events

    def take(self) -> list:
        events, self.events = self.events, []
        return events

    def shutdown(self) -> None:
        pass

    def get_publisher_config(self):
        return None


class _EventPublisherFactory:
    @staticmethod
    def create(config, data_parallel_rank: int = 0) -> _EventPublisher:
        return _EventPublisher()


ENV_DEFAULTS = {
    "VLLM_PREFIX_CACHE_RETENTION_INTERVAL": None,
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "localhost",  # NIXL's scheduler side (dcpsim.engine.vllm.nixl_scheduler)
    "VLLM_NIXL_SIDE_CHANNEL_PORT": 5600,
}
"""``vllm.envs`` values the loaded core reads at run time, as vLLM defaults them (with no such
variable set); every other name of it is a placeholder. 0.28.0's coordinator reads the retention
interval from here (later releases from the KV cache config)."""


def _envs_stub(name: str, tree) -> types.ModuleType:
    module = StubModule(name, tree)
    for key, value in ENV_DEFAULTS.items():
        setattr(module, key, value)
    return module


ABSENT_THIRD_PARTY = ("uvloop", "msgspec", "zmq")
"""Third-party modules vLLM imports at module level for code dcpsim never runs (the engine
core's event loop; NIXL's handshake listener, ``msgspec`` and ``zmq``, which its scheduler side
imports): placeholders while a tree loads, if they are not installed."""

STUBS = {
    "vllm.envs": _envs_stub,
    "vllm.logger": _logger_stub,
    "vllm.triton_utils": _triton_utils_stub,
    "vllm.utils.torch_utils": _torch_utils_stub,
    "vllm.distributed.kv_events": _kv_events_stub,
    CONNECTOR_PACKAGE: connector_package_stub,
}


class SourceTree(tree.SourceTree):
    """A folder holding a ``vllm/`` package: an unpacked wheel, a site-packages, a checkout."""

    def __init__(self, root):
        super().__init__(root, package="vllm", label="vLLM", flag="--vllm-source", stubs=STUBS, absent_third_party=ABSENT_THIRD_PARTY)
