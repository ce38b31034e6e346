"""Triton's CPU interpreter (``TRITON_INTERPRET=1``), as the loaded engines' kernels need it.

``INTERPRETER_LOCK``: the interpreter patches a kernel module's globals while a kernel runs,
so ranks that are threads of one process (``--in-process``) launch one kernel at a time.
``mend_interpreter_bools``: three quirks of Triton 3.9's interpreter, mended in the
interpreter (never in an engine's code). ``drop_dead_overflow_checks``: the interpreter's
integer-overflow checks, which assert nothing outside debug mode, skipped for speed.
"""

from __future__ import annotations

import inspect
import threading

import numpy as np

INTERPRETER_LOCK = threading.Lock()
"""Triton's interpreter patches the kernel module's globals while a kernel runs, so ranks
that are threads of one process (``--in-process``) launch one kernel at a time."""

_FIXED = False


def evenly_spaced(n: int, at_most: int) -> np.ndarray:
    """At most ``at_most`` of ``range(n)``: all of them, or evenly spaced with both ends (one:
    the first; none for ``at_most <= 0``). How the engines' kernels are sampled where the
    interpreter is too slow to run them on everything: a write's tokens, a merge's rows."""
    if n <= at_most:
        return np.arange(n, dtype=np.int64)
    if at_most <= 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.linspace(0, n - 1, at_most).round().astype(np.int64))


def sample_rows(rows: int, heads: int, programs: int) -> np.ndarray:
    """The rows of a ``rows x heads`` merge that run the engine's code: every row while
    ``rows * heads <= programs``, else ``max(1, programs // heads)`` evenly spaced rows,
    the first and the last among them."""
    return evenly_spaced(rows, max(1, programs // heads))


def mend_interpreter_bools() -> None:
    """Restore bool semantics in Triton 3.9's interpreter (never in an engine's code).

    * A ``torch.bool`` tensor argument becomes an int8 pointer, so a load through it comes
      back as int8 and ``~x`` is bitwise (``~1 == -2``, still true): such arguments are
      passed as int1 pointers instead.
    * A comparison (and the cast of a load to int1) yields numpy bools tagged with the
      operand's type (say int8), so a mask built from it is refused ("mask has
      unsupported dtype") or ``~`` flips every bit: a boolean result is tagged int1.
    * An interpreted kernel has no ``constexprs`` (the indices of its ``tl.constexpr``
      parameters, a ``JITFunction`` attribute vLLM's kernel launchers read): it gets one.
    """
    global _FIXED
    if _FIXED:
        return
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    original_cvt = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, torch.Tensor) and arg.dtype == torch.bool:
            ty = tl.pointer_type(tl.int1)
            return tl.tensor(interpreter.TensorHandle(np.array([arg.data_ptr()], dtype=np.uint64), ty), ty)
        return original_cvt(arg)

    builder = interpreter.InterpreterBuilder
    original_binary_op = builder.binary_op

    def binary_op(self, lhs, rhs, op):
        out = original_binary_op(self, lhs, rhs, op)
        if out.data.dtype == np.bool_ and out.dtype != tl.int1:
            return interpreter.TensorHandle(out.data, tl.int1)
        return out

    def constexprs(self) -> list[int]:  # what JITFunction has and vLLM's kernel launchers read
        params = inspect.signature(self.fn).parameters.values()
        return [i for i, p in enumerate(params) if "constexpr" in str(p.annotation)]

    interpreter._implicit_cvt = implicit_cvt
    builder.binary_op = binary_op
    if not hasattr(interpreter.InterpretedFunction, "constexprs"):
        interpreter.InterpretedFunction.constexprs = property(constexprs)
    _FIXED = True


def drop_dead_overflow_checks() -> None:
    """Skip the integer-overflow checks Triton's interpreter computes for every 32-bit ``+``,
    ``-`` and ``*`` (``binary_op_sanitize_overflow_impl``: two casts to int64, the operation
    again, two comparisons) when it is not in debug mode: their only consumer,
    ``device_assert``, returns without asserting unless ``debug`` (``semantic.py``), as a
    compiled kernel drops them, so they change no result and cost about a third of an
    interpreted kernel's time. Process-wide and idempotent; a no-op under ``debug``."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if not builder.options.debug and builder.options.sanitize_overflow:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
