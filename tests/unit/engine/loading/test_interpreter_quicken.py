"""``loading.interpreter.quicken_interpreter`` changes no result of an interpreted kernel: a
kernel calling ``@triton.jit`` helpers (one seeing ``triton.language``, which the launch has
patched, one seeing only ``triton.language.core``, which it has not), subtracting operands
of one type and shape (whose checks the quickened interpreter skips) and adding Python ints and
pointers (whose constants and checks it remembers or skips), computes the same values
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
    # a Python int beside a tensor on either side, on a scalar and on a block (one number, two
    # shapes: two constants), and a pointer plus an integer scalar
    t = (1 + offs) - (offs + 1) + (pid + 1) - (1 - pid) + tl.load(x_ptr + pid)
    tl.store(out_ptr + offs, z + s + t, mask=offs < N)


@triton.jit
def mixed(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    # result types of mixed operands (a float scalar, a Python int, an unsigned block), a
    # division, and casts to the type a tensor already has: the rules the quickened
    # interpreter remembers or answers by identity
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, other=0)
    f = x.to(tl.float32) * 0.75 + 1
    u = x.to(tl.uint32) + 3
    q = (u // 2).to(tl.int32).to(tl.int32) + (f / 2.0).to(tl.int32)
    r = ((x + f) * 10).to(tl.int32) + ((1 - u) // 2 % 7).to(tl.int32)  # int32 + float32: float32; 1 - uint32: uint32
    tl.store(out_ptr + offs, q.to(tl.int32) + r, mask=offs < N)


@triton.jit
def refused(x_ptr, out_ptr, BLOCK: tl.constexpr):  # Triton refuses // of unsigned by signed
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, (x.to(tl.uint32) // x).to(tl.int32))


@triton.jit
def too_big(x_ptr, out_ptr, BLOCK: tl.constexpr):  # a Python int out of int32's range
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x + 2**40)


@triton.jit
def negative(x_ptr, out_ptr, BLOCK: tl.constexpr):  # a negative Python int beside an unsigned block
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs).to(tl.uint32)
    tl.store(out_ptr + offs, (x + -1).to(tl.int32))


@triton.jit
def pointer_times(x_ptr, out_ptr, BLOCK: tl.constexpr):  # a pointer where the operation allows none
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr * tl.program_id(0) + offs))
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
mixed = torch.full((16,), -1, dtype=torch.int32)
kern.mixed[(1,)](x, mixed, N=10, BLOCK=16)
errors = []
for kernel in (kern.refused, kern.too_big, kern.negative, kern.pointer_times):
    for _ in range(2):  # a refusal is never remembered: refused every time, with Triton's message
        try:
            kernel[(1,)](x, torch.zeros(8, dtype=torch.int32), BLOCK=8)
        except Exception as e:
            errors.append(str(e))
print(json.dumps({"out": out.tolist(), "patches": calls[0], "mixed": mixed.tolist(), "errors": errors}))
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
    """The values of ``kernel`` and ``mixed``, and the refusals of ``refused``, ``too_big``,
    ``negative`` and ``pointer_times``, each twice, with Triton's own message, are the same with and without
    ``quicken_interpreter``."""
    plain, quick = _run(tmp_path, "plain"), _run(tmp_path, "quick")
    assert plain["out"] == [(8 * i + 1) // 2 + 2 * (i // 4) + 2 * (i // 4) + i // 4 for i in range(10)]
    assert quick["out"] == plain["out"]
    wrapped = [(1 - (i + 3)) % 2**32 // 2 % 7 for i in range(10)]  # 1 - u in uint32
    expected = [(i + 3) // 2 + int((i * 0.75 + 1) / 2) + int((i + i * 0.75 + 1) * 10) + wrapped[i] for i in range(10)]
    assert plain["mixed"] == expected + [-1] * 6
    assert quick["mixed"] == plain["mixed"]
    assert len(plain["errors"]) == 8 and "different signedness" in plain["errors"][0]
    assert "out of range" in plain["errors"][2] and "negative scalar" in plain["errors"][4], plain["errors"]
    assert "invalid operands of type pointer<int32> and triton.language.int32" in plain["errors"][6], plain["errors"]
    assert quick["errors"] == plain["errors"]
    # plain: the launch patches triton.language, and so does each of the 3 programs' 3 calls of
    # `twice` (as many patches as the launch's); quickened, those 9 calls skip it. `plus_one`
    # (seeing only triton.language.core, which the launch did not patch) is still patched as
    # Triton does: the quickened count is more than the launch's own.
    skipped = plain["patches"] - quick["patches"]
    assert skipped > 0 and skipped % 9 == 0
    per_call = skipped // 9
    assert quick["patches"] > per_call
