"""Imported by the forkserver of a world whose jobs run ``--engine vllm``: Triton (and its
interpreter, with the loader's fixes) is then imported once, before the ranks fork,
instead of once in every rank."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language  # noqa: F401 - imported once, in the forkserver

from dcpsim.engine.vllm.loader import mend_interpreter_bools

mend_interpreter_bools()
