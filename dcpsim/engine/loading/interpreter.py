"""Triton's CPU interpreter (``TRITON_INTERPRET=1``), as the loaded engines' kernels need it.

``INTERPRETER_LOCK``: the interpreter patches a kernel module's globals while a kernel runs,
so ranks that are threads of one process (``--in-process``) launch one kernel at a time.
``mend_interpreter_bools``: three quirks of Triton 3.9's interpreter, mended in the
interpreter (never in an engine's code). ``drop_dead_overflow_checks``: the interpreter's
integer-overflow checks, which assert nothing outside debug mode, skipped for speed.
``quicken_interpreter``: other per-operation and per-launch costs of the interpreter that
change no result (a helper's re-patching of ``triton.language``, rebuilt block types, a dtype
table rebuilt per call, an import on the first launch, per-operation wrappers, tensor shapes and
type checks whose answer is known), cut.
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
    """Costs of Triton 3.9's interpreter that change no result, cut (process-wide,
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
    * Every ``tl`` operation's Python: a patched builtin calls the function under Triton's
      ``@builtin`` wrapper itself (``_call_builtins_directly``); a new tensor shares what its
      type alone decides (its shape and element count) with the first tensor of that type
      (``_quicker_tensors``); a new handle's size check is answered once per item size and
      type (``_remembered_size_checks``); operands of one integer type, or a pointer beside an
      integer, skip the type checks that would return them as they are, and blocks of one shape
      the broadcast (``_skip_integer_operand_checks``, ``_skip_equal_broadcasts``); a cast to a tensor's own type
      and a binary operation's result type are answered without Triton's comparisons
      (``_quicker_type_rules``); a Python int beside a tensor (``offs < n``, ``pid * 4``) becomes
      the constant tensor Triton built for it the first time (``_remembered_number_operands``).
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
    _call_builtins_directly(interpreter, tl)
    _quicker_tensors(tl)
    _remembered_size_checks(interpreter)
    _skip_equal_broadcasts(interpreter)
    _quicker_type_rules(interpreter)
    _skip_integer_operand_checks(interpreter, tl)
    _remembered_number_operands(interpreter, tl)
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
    and shape, never changed. A pointer element type (unhashable: ``pointer_type`` defines
    ``__eq__`` only) is keyed by what its ``__eq__`` compares (element type, address space,
    constness), so a block of pointers is shared too."""
    made: dict = {}
    block_type, pointer_type = tl.block_type, tl.pointer_type

    def shared(dtype, shape):
        element = dtype
        if type(dtype) is pointer_type:
            element = (pointer_type, dtype.element_ty, dtype.address_space, dtype.const)
        key = (element, shape if type(shape) is tuple else tuple(shape))
        try:
            found = made.get(key)
        except TypeError:  # an unhashable element type (a pointer to a pointer)
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


def _call_builtins_directly(interpreter, tl) -> None:
    """A patched builtin (``_patch_attr``: every ``tl.*`` operation and ``tensor`` operator a
    kernel calls) calls the function under Triton's ``@builtin`` wrapper itself: that wrapper
    only refuses a call without ``_semantic``, and the patched builtin always passes the
    interpreter's. Its keyword arguments are copied only when there are any (Triton's drops a
    caller's ``_semantic``, as this does)."""
    wrapper_code = tl.core.builtin(lambda _semantic=None: None).__code__
    names = interpreter.__dict__  # interpreter_semantic, read at each call as Triton's lambda does
    original = interpreter._patch_attr

    def patch_attr(obj, name, member, builder, scope):
        fn = getattr(member, "__wrapped__", None)
        if fn is None or getattr(member, "__code__", None) is not wrapper_code:
            return original(obj, name, member, builder, scope)

        def patched(*args, **kwargs):
            if not kwargs:
                return fn(*args, _semantic=names["interpreter_semantic"])
            if "member" in kwargs:  # Triton's lambda takes it as the member to call
                callee = kwargs.pop("member")
                return callee(*args, **{k: v for k, v in kwargs.items() if k != "_semantic"}, _semantic=names["interpreter_semantic"])
            return fn(*args, **{k: v for k, v in kwargs.items() if k != "_semantic"}, _semantic=names["interpreter_semantic"])

        scope.set_attr(obj, name, patched)

    interpreter._patch_attr = patch_attr


def _quicker_tensors(tl) -> None:
    """``tl.tensor(handle, type)`` (every operation's result) without rebuilding, per tensor,
    what depends on its type alone: its shape (a Triton ``tuple`` of ``constexpr``s) and its
    element count (a ``constexpr``), built once per block type (once for every scalar type:
    no dims, one element), with the values Triton's ``__init__`` gives, and shared by the
    tensors of that type. Under the interpreter nothing changes them once built: a
    ``constexpr``'s value is set by its ``__init__`` only, and a ``tl.tuple`` has no
    ``__setitem__`` (its ``_setitem`` is the compiler's code generator's, which the interpreter
    never runs)."""
    tensor, block_type = tl.core.tensor, tl.block_type
    original = tensor.__init__
    known: dict = {}  # id(type) -> (type, its shape tuple, numel)
    scalar: list = []  # (None, the shape tuple, numel) of every scalar type: (), 1

    def init(self, handle, type):
        if not isinstance(type, block_type):
            found = scalar[0] if scalar else None
        else:
            found = known.get(id(type))
            if found is not None and found[0] is not type:
                found = None
        if found is None:
            original(self, handle, type)
            if not isinstance(type, block_type):
                scalar[:] = [(None, self.shape, self.numel)]
            elif len(known) < 4096:
                known[id(type)] = (type, self.shape, self.numel)
            return
        _, shape, numel = found
        self.handle = handle
        self.shape = None  # set below, as Triton's __init__ sets it twice: the attributes keep their order
        self.numel = numel
        self.type = type
        self.dtype = type.scalar
        self.shape = shape

    tensor.__init__ = init


def _remembered_size_checks(interpreter) -> None:
    """``TensorHandle``'s check of every new handle (its numpy item size against its Triton
    type's width, ``_validate_np_data_size``) remembered per (item size, type): the answer
    depends on nothing else. A pointer passes it at once, as in Triton's, and is never kept
    (a launch makes new pointer types: they would fill the answers for good, as they did
    ``_quicker_tensors``' before blocks of pointers were shared). A handle that fails it still
    raises Triton's error."""
    handle = interpreter.TensorHandle
    pointer_type = interpreter.tl.pointer_type
    original, validate = handle.__post_init__, interpreter._validate_np_data_size
    answers: dict = {}  # (item size, id(type)) -> (type, the answer); types kept, so no id is reused

    def post_init(self):
        dtype = self.dtype
        if isinstance(dtype, pointer_type):
            return
        key = (self.data.itemsize, id(dtype))
        found = answers.get(key)
        if found is not None and found[0] is dtype:
            good = found[1]
        else:
            good = bool(validate(self.data, dtype))
            if len(answers) < 4096:
                answers[key] = (dtype, good)
        if not good:
            original(self)

    handle.__post_init__ = post_init


def _skip_equal_broadcasts(interpreter) -> None:
    """``broadcast_impl_value`` of two blocks of the same shape returns them as they are (as
    Triton's does, after building the shape it compares): answered without building it."""
    semantic, block_type = interpreter.TritonSemantic, interpreter.tl.block_type
    original = semantic.broadcast_impl_value

    def broadcast_impl_value(self, lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        if type(lhs_ty) is block_type and type(rhs_ty) is block_type and lhs_ty.shape.values == rhs_ty.shape.values:
            return lhs, rhs
        return original(self, lhs, rhs)

    semantic.broadcast_impl_value = broadcast_impl_value


def _quicker_type_rules(interpreter) -> None:
    """Two of Triton's type rules, answered without their Python where the answer is known:
    ``cast`` to the very type object a tensor has returns it (as Triton's does, after comparing
    the types by name), and ``computation_type_impl`` (the result type of a binary operation,
    a function of its operands' types, which of them is a Python number, and whether it
    divides) is remembered per question; a question it refuses is asked every time."""
    semantic = interpreter.TritonSemantic
    original_cast, original_type = semantic.cast, semantic.computation_type_impl
    answers: dict = {}

    def cast(self, input, dst_ty, fp_downcast_rounding=None):
        if input.type.scalar is dst_ty.scalar:
            return input
        return original_cast(self, input, dst_ty, fp_downcast_rounding)

    def computation_type_impl(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod):
        key = (a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
        try:
            found = answers.get(key)
        except TypeError:  # an unhashable type
            return original_type(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
        if found is None:
            found = answers[key] = original_type(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
        return found

    semantic.cast = cast
    semantic.computation_type_impl = computation_type_impl


def _skip_integer_operand_checks(interpreter, tl) -> None:
    """``binary_op_type_checking_impl`` of two tensors of one integer type (the same dtype
    object: no pointer, nothing to refuse, the computation type is that integer type, no cast)
    or of a pointer and an integer (``ptr + pid``, ``ptr + offs``) where the call allows the
    pointer on its side (no arithmetic type, so no cast, and nothing to refuse): Triton's checks
    hand both back as they are, so only its broadcast is left. Two scalars, or two blocks of one
    shape, are returned as they are; a scalar beside a block goes to the broadcast at once."""
    semantic, tensor, block_type = interpreter.TritonSemantic, tl.tensor, tl.block_type
    original = semantic.binary_op_type_checking_impl

    def binary_op_type_checking_impl(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        if type(lhs) is tensor and type(rhs) is tensor:
            lhs_ty, rhs_ty = lhs.type, rhs.type
            left, right = lhs.dtype, rhs.dtype
            if left is right:
                same = not left.is_ptr() and left.is_int()
            elif left.is_ptr():
                same = allow_lhs_ptr and not right.is_ptr() and right.is_int()
            else:
                same = right.is_ptr() and allow_rhs_ptr and left.is_int()
            if same:
                if lhs_ty is left and rhs_ty is right:
                    return lhs, rhs
                if type(lhs_ty) is block_type and type(rhs_ty) is block_type and lhs_ty.shape.values == rhs_ty.shape.values:
                    return lhs, rhs
                return self.broadcast_impl_value(lhs, rhs)  # a scalar beside a block: splat, as Triton's
        return original(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    semantic.binary_op_type_checking_impl = binary_op_type_checking_impl


_NUMBERS_KEPT = 4096
"""At most this many constants kept by ``_remembered_number_operands`` (a kernel has a few)."""


def _remembered_number_operands(interpreter, tl) -> None:
    """``binary_op_type_checking_impl`` of a tensor and a Python int (``offs < n``, ``pid * 4``,
    ``ptr + 1``): Triton's answer (the number as a constant tensor of the computation type,
    splat to the tensor's shape) is a function of the number, the tensor's type (not its
    values), which side the number is on and the call's flags. Where Triton hands the tensor
    back as it is (no cast, no broadcast of it), its constant is remembered per those and
    handed out again; otherwise, or where Triton refuses (a number out of the type's range, a
    negative number beside an unsigned tensor), Triton answers every time. A remembered
    constant's numpy data is made read-only, so an operation that wrote into its operand
    would raise instead of changing the next use."""
    semantic, tensor = interpreter.TritonSemantic, tl.tensor
    previous = semantic.binary_op_type_checking_impl
    known: dict = {}  # (number, its place, id(tensor type), flags) -> (tensor type, constant)

    def binary_op_type_checking_impl(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        if type(rhs) is int and type(lhs) is tensor:
            at, operand, number = 1, lhs, rhs  # at: the number's place in the pair
        elif type(lhs) is int and type(rhs) is tensor:
            at, operand, number = 0, rhs, lhs
        else:
            return previous(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        ty = operand.type
        key = (number, at, id(ty), allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        found = known.get(key)
        if found is not None and found[0] is ty:  # the entry holds its type: the id is that type's
            return (operand, found[1]) if at else (found[1], operand)
        out = previous(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        constant = out[at]
        if out[1 - at] is operand and len(known) < _NUMBERS_KEPT:
            data = getattr(constant.handle, "data", None)
            if isinstance(data, np.ndarray):
                data.flags.writeable = False
                known[key] = (ty, constant)
        return out

    semantic.binary_op_type_checking_impl = binary_op_type_checking_impl
