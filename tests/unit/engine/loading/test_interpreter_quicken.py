"""``loading.interpreter.quicken_interpreter`` changes no result of an interpreted kernel: a
kernel calling ``@triton.jit`` helpers (one seeing ``triton.language``, which the launch has
patched, one seeing only ``triton.language.core``, which it has not), and subtracting operands
of one type and shape (whose checks the quickened interpreter skips), computes the same values
with and without it, and with it the helpers' calls stop re-patching the language module.
Each run is its own process (the interpreter and its patches are process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

KERNEL = """
import triton
import triton.language as tl

from helpers import twice
from core_helpers import plus_one


@triton.jit
def kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0)
    for _ in range(3):
        x = twice(x)
    x = plus_one(x)
    # operands of one integer type and shape (blocks, scalars), and blocks of one shape cast to
    # one type: what quicken_interpreter answers without Triton's checks (in order: - is not
    # symmetric)
    y = x - x // 2
    z = x.to(tl.int64) - y
    pid = tl.program_id(0)
    s = pid * 3 - pid
    tl.store(out_ptr + offs, z + s, mask=offs < N)
"""

HELPERS = """
import triton
import triton.language as tl


@triton.jit
def twice(x):
    return x * 2
"""

CORE_HELPERS = """
import triton
from triton.language import core


@triton.jit
def plus_one(x):
    return core.add(x, 1)
"""

RUN = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[1])
import torch
from triton.runtime import interpreter
from dcpsim.engine.loading.interpreter import mend_interpreter_bools, quicken_interpreter
mend_interpreter_bools()
if sys.argv[2] == "quick":
    quicken_interpreter()
calls = [0]
original = interpreter._patch_builtin
def counting(*args):
    calls[0] += 1
    return original(*args)
interpreter._patch_builtin = counting
import kern
x = torch.arange(10, dtype=torch.int32)
out = torch.full((10,), -1, dtype=torch.int32)
kern.kernel[(3,)](x, out, N=10, BLOCK=4)
print(json.dumps({"out": out.tolist(), "patches": calls[0]}))
"""


def _run(tmp_path, mode: str) -> dict:
    for name, text in {"kern.py": KERNEL, "helpers.py": HELPERS, "core_helpers.py": CORE_HELPERS, "run.py": RUN}.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), str(tmp_path), mode], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two processes importing torch and Triton
def test_a_quickened_interpreter_computes_the_same_values_and_stops_repatching(tmp_path):
    plain, quick = _run(tmp_path, "plain"), _run(tmp_path, "quick")
    assert plain["out"] == [(8 * i + 1) // 2 + 2 * (i // 4) for i in range(10)]
    assert quick["out"] == plain["out"]
    # plain: the launch patches triton.language, and so does each of the 3 programs' 3 calls of
    # `twice` (as many patches as the launch's); quickened, those 9 calls skip it. `plus_one`
    # (seeing only triton.language.core, which the launch did not patch) is still patched as
    # Triton does: the quickened count is more than the launch's own.
    skipped = plain["patches"] - quick["patches"]
    assert skipped > 0 and skipped % 9 == 0
    per_call = skipped // 9
    assert quick["patches"] > per_call
