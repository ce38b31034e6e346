"""Load single modules of a vllm-ascend source tree over the vLLM tree it runs on.

vllm-ascend is a plugin package: its modules import ``vllm.*`` (its core, here a vLLM source
tree loaded by ``dcpsim.engine.vllm.loader``) and ``torch_npu``. ``AscendTree.load`` runs the
named ``vllm_ascend`` modules for real while the vLLM tree is importable (its loaded modules,
its stubs, automatic placeholders for the rest); ``torch_npu`` and every other ``vllm_ascend``
module they import are placeholders, so nothing of the NPU runtime is needed.
"""

from __future__ import annotations

import contextlib

from dcpsim.engine.loading import tree
from dcpsim.engine.vllm_ascend.releases import NEWEST

ABSENT_THIRD_PARTY = ("torch_npu",)


def source_dir(ascend_source: str | None) -> str:
    """The directory holding ``vllm_ascend/``: ``ascend_source``, else ``$DCPSIM_VLLM_ASCEND_SOURCE``."""
    return tree.source_dir(ascend_source, engine="vllm-ascend", package="vllm_ascend", fetch=f"vllm-ascend=={NEWEST}")


class AscendTree(tree.SourceTree):
    """A folder holding a ``vllm_ascend/`` package (an unpacked source archive, a checkout)."""

    def __init__(self, root, vllm_tree):
        super().__init__(
            root, package="vllm_ascend", label="vllm-ascend", flag="--vllm-ascend-source", absent_third_party=ABSENT_THIRD_PARTY
        )
        self.vllm_tree = vllm_tree

    def load(self, names, warm=None):
        with self.vllm_tree.importable():
            return super().load(names, warm=warm)

    @contextlib.contextmanager
    def importable(self):
        """Both trees importable: the plugin's code imports from each at call time."""
        with self.vllm_tree.importable(), super().importable():
            yield
