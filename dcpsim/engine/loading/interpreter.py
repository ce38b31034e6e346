"""Triton's CPU interpreter (``TRITON_INTERPRET=1``), as the loaded engines' kernels need it.

``INTERPRETER_LOCK``: the interpreter patches a kernel module's globals while a kernel runs,
so ranks that are threads of one process (``--in-process``) launch one kernel at a time.
``mend_interpreter_bools``: three quirks of Triton 3.9's interpreter, mended in the
interpreter (never in an engine's code). ``drop_dead_overflow_checks``: the interpreter's
integer-overflow checks, which assert nothing outside debug mode, skipped for speed.
``quicken_interpreter``: other per-operation and per-launch costs of the interpreter that
change no result (a helper's re-patching of ``triton.language``, rebuilt block types, a dtype
table rebuilt per call, an import on the first launch), cut.
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


_QUICK = False


def quicken_interpreter() -> None:
    """Four costs of Triton 3.9's interpreter that change no result, cut (process-wide,
    idempotent; every loaded tree and the ranks' forkserver run it):

    * Its first ``mangle_type`` (the first launch of a process) imports
      ``triton.experimental.gluon``, about 0.1 s of every rank: imported here, once.
    * ``_get_np_dtype`` (numpy dtype of a Triton type, asked by most interpreted
      operations) builds a table of 19 types on every call: the answer for each scalar type
      (a block's is its element's) is remembered.
    * Every operation builds new ``tl.block_type`` objects for its result: one per
      (element type, shape) is shared (``_share_block_types``).
    * A ``@triton.jit`` helper called from a kernel (say vLLM's ``_load_ptr``) re-patches
      ``triton.language`` on every call (``_patch_lang``: ``inspect.getmembers`` over the
      language module, a tenth of a vLLM slot-mapping program) although the launch under way
      has patched the same modules: the call skips it then. A helper whose module sees a
      language module the launch has not patched is patched as Triton does. A launch's own
      patching finds the language modules' builtins once (not with ``inspect.getmembers`` on
      every launch).
    """
    global _QUICK
    if _QUICK:
        return
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.jit import mangle_type

    mangle_type(0)
    interpreter._get_np_dtype = _remembering_np_dtype(interpreter._get_np_dtype, tl)
    _share_block_types(interpreter, tl)
    _skip_repatching(interpreter, tl)
    _QUICK = True


def _remembering_np_dtype(original, tl):
    """``original`` (``_get_np_dtype``) remembered per scalar type."""
    known: dict = {}

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):  # as Triton's: unhashable, always uint64
            return np.dtype(np.uint64)
        try:
            return known[scalar]
        except KeyError:
            known[scalar] = found = original(scalar)
            return found
        except TypeError:  # an unhashable type: asked every time
            return original(tt_dtype)

    return get_np_dtype


def _share_block_types(interpreter, tl) -> None:
    """One ``tl.block_type`` object per (element type, shape of ints), shared by the
    interpreter's operations (``InterpreterBuilder.get_block_ty``,
    ``block_type.with_element_ty``) instead of a new one (its shape validated, its name
    formatted) for every operation: a block type is a value, compared by its element type
    and shape, never changed."""
    made: dict = {}
    block_type = tl.block_type

    def shared(dtype, shape):
        key = (dtype, shape if type(shape) is tuple else tuple(shape))
        try:
            found = made.get(key)
        except TypeError:  # an unhashable element type (a pointer)
            return block_type(dtype, shape)
        if found is None:
            if not all(type(d) is int for d in key[1]):  # kept only for shapes of ints
                return block_type(dtype, shape)
            found = made[key] = block_type(dtype, list(key[1]))
        return found

    interpreter.InterpreterBuilder.get_block_ty = lambda self, dtype, shape: shared(dtype, shape)
    block_type.with_element_ty = lambda self, scalar_ty: shared(scalar_ty, self.shape)


def _skip_repatching(interpreter, tl) -> None:
    """A helper's call (``InterpretedFunction.__call__``) skips ``_patch_lang`` while the
    launch under way (``GridExecutor``, through ``interpreter._patch_lang``) has patched every
    language module its globals hold."""
    original_patch_lang = interpreter._patch_lang
    original_patch_builtin = interpreter._patch_builtin
    under_way: list[frozenset] = []  # the language modules each launch under way patched, innermost last
    langs: dict = {}
    builtins: dict = {}  # per module or class: its builtins, as found outside any launch (nothing patched)

    def patch_builtin(pkg, builder, scope):  # Triton's, with inspect.getmembers run once per pkg
        if under_way:  # a helper's patching, over patched modules: as Triton does
            return original_patch_builtin(pkg, builder, scope)
        if pkg not in builtins:
            builtins[pkg] = [(name, member) for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
        for name, member in builtins[pkg]:
            interpreter._patch_attr(pkg, name, member, builder, scope)

    def langs_of(fn) -> frozenset:
        if fn not in langs:
            langs[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return langs[fn]

    def patch_lang(fn):  # a launch's: patched until its scope is restored
        scope = original_patch_lang(fn)
        under_way.append(langs_of(fn))
        restore = scope.restore

        def restore_and_forget():
            under_way.pop()
            restore()

        scope.restore = restore_and_forget
        return scope

    def call(self, *args, **kwargs):  # a helper's call from a kernel
        mine = langs_of(self.fn)
        if not (mine and under_way and mine <= under_way[-1]):
            original_patch_lang(self.fn)  # as Triton: never restored
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter._patch_builtin = patch_builtin
    interpreter._patch_lang = patch_lang
    interpreter.InterpretedFunction.__call__ = call
