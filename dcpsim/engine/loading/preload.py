"""Imported by the forkserver of a world whose jobs run an engine's own kernels (``--engine
vllm``, ``--engine sglang``): Triton (and its interpreter, with the loader's mends) is then
imported once, before the ranks fork, instead of once in every rank; and the builds the
harness asked for (``dcpsim.engine.loading.forkserver``: the jobs' engines, their source
trees loaded) run here once, every rank inheriting them."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language  # noqa: F401 - imported once, in the forkserver

from dcpsim.engine.loading import launch_cache
from dcpsim.engine.loading.forkserver import run_asked
from dcpsim.engine.loading.interpreter import mend_interpreter_bools, quicken_interpreter

mend_interpreter_bools()
quicken_interpreter()
launch_cache.install()
run_asked()
