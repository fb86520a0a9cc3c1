"""Triton launches that skip ``JITFunction.run``'s per-call work once a kernel has compiled for its arguments.

``kernel[grid](...)`` binds every argument, derives Triton's specialization of each (pointer alignment to 16
bytes, integers equal to 1 or divisible by 16, dtypes), turns it into a cache key and looks the compiled kernel
up: about 11 µs of host time per launch on the H200's host, against about 5 µs for calling the compiled
kernel's launcher directly (``benchmarks/launch_cost.py``). A :class:`DirectLaunch` runs the first launch of each
specialization through ``kernel[grid]`` (Triton's own binder, cache and compile) and keeps the compiled kernel it
returned; a later
launch whose arguments have the same specialization classes (checked for the arguments that can change them:
tensors' dtype and alignment, ints' class, positional constexprs' values; the keyword constexprs and options are
the binding's key) calls that kernel's launcher on the current stream. Any difference falls back to
``kernel[grid]``, which binds again.

Under ``TRITON_INTERPRET=1`` (CI) the kernel is an interpreted function and every launch takes ``kernel[grid]``.
Launch hooks (a profiler's ``knobs.runtime.launch_enter_hook``) are passed on as ``kernel[grid]`` passes them;
a kernel with ``pre_run_hooks`` always takes ``kernel[grid]``. Not re-checked on the direct path: Triton's check
that the globals a kernel read at compile time still hold their values (module constants, never reassigned).

Inside a tuner's compile pass (``common/autotuner/precompile.py``) a launch only compiles, on the pass's thread pool:
Triton's ``kernel.warmup`` with the same arguments.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from lightllm.common.autotuner import precompile

_enabled = True
_compile_only = False  # a tuner's compile pass (common/autotuner/precompile.py): launches only compile
_pdl = False  # programmatic dependent launch for the kernels that declare USE_PDL (kernels/pdl.py)
LAUNCHERS: List["DirectLaunch"] = []  # every kernel's, in the order their modules made them (tests, benchmarks)
_MAX_BINDINGS = 8  # specializations kept per key (a few in practice: e.g. decode's split count changes a class)
_GUARD_CODE: Dict[str, Any] = {}  # guard source -> its compiled code: a new binding of a known shape costs no compile


def set_enabled(on: bool) -> bool:
    """Turn the direct path on or off for every kernel (off: every launch is ``kernel[grid]``); returns the
    previous setting. For tests and benchmarks that compare the two paths."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


def set_pdl(on: bool) -> bool:
    """Launch every kernel that declares a ``USE_PDL`` constexpr with programmatic dependent launch (``kernels/pdl.py``)
    or not (the default); returns the previous setting. Needs a CUDA GPU of compute capability 9.0 or later and no
    interpreter: ``ValueError`` otherwise, nothing changed. Set it before a CUDA graph is captured: a captured launch
    keeps what it was."""
    global _pdl
    if on:
        if knobs.runtime.interpret or not torch.cuda.is_available():
            raise ValueError("set_pdl(True): programmatic dependent launch expected a CUDA GPU without "
                             "TRITON_INTERPRET, got none")  # fmt: skip
        if torch.cuda.get_device_capability() < (9, 0):
            raise ValueError(f"set_pdl(True): programmatic dependent launch expected compute capability 9.0 or later, "
                             f"got {torch.cuda.get_device_capability()}")  # fmt: skip
    previous, _pdl = _pdl, bool(on)
    return previous


def _set_compile_only(on: bool) -> None:
    global _compile_only
    _compile_only = on


precompile.register_switch(_set_compile_only)


def int_class(value: int) -> int:
    """What Triton's specialization of a (non-bool) int argument depends on, as one small int: equal to 1 (a
    constexpr then), its type (i32, i64 or u64 by range) and whether 16 divides it."""
    if value == 1:
        return -1
    width = 0 if -0x80000000 <= value <= 0x7FFFFFFF else 2 if -(2**63) <= value < 2**63 else 4
    return width + (value & 15 == 0)


def tensor_class(tensor: torch.Tensor) -> Tuple[torch.dtype, bool]:
    """What Triton's specialization of a tensor argument depends on: its dtype, and whether its data pointer is
    16-byte aligned."""
    return tensor.dtype, not tensor.data_ptr() & 15


def _device_functions() -> Tuple[Callable[[], int], Callable[[int], int]]:
    """Triton's own current-device and current-stream functions (the compiled kernels it caches are per device;
    kernel[grid] launches on that stream), looked up once per kernel: ``driver.active`` is a property."""
    active = driver.active
    return active.get_current_device, active.get_current_stream


_I32_MIN, _I32_MAX, _I64_MIN, _I64_MAX = -(2**31), 2**31 - 1, -(2**63), 2**63 - 1


class _Binding:
    """One compiled kernel and a guard that is true exactly for arguments of the specialization classes it was
    compiled for (:func:`tensor_class`, :func:`int_class`; types of floats; values of constexprs and None)."""

    __slots__ = ("device", "guard", "tail", "launcher", "function", "packed_metadata", "compiled")

    def matches(self, args: tuple) -> bool:
        try:
            return bool(self.guard(*args))
        except (AttributeError, TypeError):  # an argument of another kind (a tensor where an int was, ...)
            return False


def _guard_source(args: tuple, tensor_at, int_at, float_at, exact_at) -> Tuple[str, Dict[str, Any]]:
    """The guard of these arguments' classes as one generated expression (as Triton generates its binder): it
    runs per launch, so it makes no list, tuple or call per argument that a comparison can do instead."""
    names: Dict[str, Any] = {"int": int, "float": float}
    terms = []
    for i in tensor_at:
        names[f"d{i}"] = args[i].dtype
        terms.append(f"a{i}.dtype is d{i}")
    aligned = [i for i in tensor_at if tensor_class(args[i])[1]]
    if aligned:  # the low bits of an OR are the OR of the low bits: one test for every aligned pointer
        terms.append("not ((" + " | ".join(f"a{i}.data_ptr()" for i in aligned) + ") & 15)")
    terms += [f"a{i}.data_ptr() & 15" for i in tensor_at if i not in aligned]
    terms += [f"type(a{i}) is int" for i in int_at]  # a bool is an int to Python, not to Triton
    small = [i for i in int_at if _I32_MIN <= args[i] <= _I32_MAX and args[i] != 1]
    divisible = [i for i in small if not args[i] & 15]
    if divisible:
        terms.append("not ((" + " | ".join(f"a{i}" for i in divisible) + ") & 15)")
    terms += [f"a{i} & 15 and a{i} != 1" for i in small if i not in divisible]
    if small:  # an OR of non-negative ints is below 2**31 iff each is: one test, unless one is negative
        each = " and ".join(f"{_I32_MIN} <= a{i} <= {_I32_MAX}" for i in small)
        terms.append("(0 <= (" + " | ".join(f"a{i}" for i in small) + f") <= {_I32_MAX} or {each})")
    for i in int_at:
        value = args[i]
        if value == 1:
            terms.append(f"a{i} == 1")
        elif not _I32_MIN <= value <= _I32_MAX:
            wide = f"{_I64_MIN} <= a{i} <= {_I64_MAX}" if _I64_MIN <= value <= _I64_MAX else f"a{i} > {_I64_MAX}"
            low = f"a{i} & 15" if value & 15 else f"not (a{i} & 15)"
            terms.append(f"not {_I32_MIN} <= a{i} <= {_I32_MAX} and {wide} and {low}")
    terms += [f"type(a{i}) is float" for i in float_at]
    for i in exact_at:
        value = args[i]
        if value is None:
            terms.append(f"a{i} is None")
        else:
            names[f"c{i}"], names[f"t{i}"] = value, type(value)
            terms.append(f"type(a{i}) is t{i} and a{i} == c{i}")
    params = ", ".join(f"a{i}" for i in range(len(args)))
    return f"def guard({params}):\n    return " + (" and ".join(terms) or "True") + "\n", names


def bind(kernel: Any, compiled: Any, device: int, args: tuple, kwargs: dict) -> Optional[_Binding]:
    """A binding of ``compiled`` (what ``kernel[grid](*args, **kwargs)`` ran) for these arguments' classes, or None
    when an argument is of a kind this module does not classify (those launches stay on ``kernel[grid]``)."""
    params = kernel.params
    if len(args) > len(params):
        return None
    tensor_at, int_at, float_at, exact_at = [], [], [], []
    for i, (param, arg) in enumerate(zip(params, args)):
        if param.is_constexpr or arg is None or type(arg) in (bool, str):
            exact_at.append(i)
        elif isinstance(arg, torch.Tensor):
            tensor_at.append(i)
        elif type(arg) is int:
            int_at.append(i)
        elif type(arg) is float:
            float_at.append(i)
        else:
            return None
    tail = []
    for param in params[len(args) :]:  # the keyword arguments and defaults: fixed by the binding's key
        if param.name in kwargs:
            tail.append(kwargs[param.name])
        elif param.has_default:
            tail.append(param.default)
        else:
            return None
    source, names = _guard_source(args, tensor_at, int_at, float_at, exact_at)
    code = _GUARD_CODE.get(source)
    if code is None:
        code = _GUARD_CODE[source] = compile(source, f"<guard of {getattr(kernel, '__name__', 'kernel')}>", "exec")
    exec(code, names)
    b = _Binding()
    b.device, b.guard, b.tail = device, names["guard"], tuple(tail)
    b.compiled = compiled
    b.launcher, b.function, b.packed_metadata = compiled.run, compiled.function, compiled.packed_metadata
    return b


class DirectLaunch:
    """``launch(grid, *args, **kwargs)`` runs ``kernel[grid](*args, **kwargs)``, directly once bound (see the
    module's doc). One per Triton kernel, shared by every launcher of it.

    ``direct``: whether the kernel can be bound (default: it is a compiled ``JITFunction``, not the interpreter's
    function); tests pass a stand-in kernel with ``direct=True``.
    """

    def __init__(self, kernel: Any, direct: Optional[bool] = None):
        self.kernel = kernel
        self.direct = isinstance(kernel, JITFunction) if direct is None else direct
        self._bindings: Dict[tuple, List[_Binding]] = {}
        # Triton's current-device and current-stream functions, looked up at the first bind
        self._device_of: Optional[Callable[[], int]] = None
        self._stream_of: Optional[Callable[[int], int]] = None
        self.slow_launches = 0  # launches that took kernel[grid] (tests and benchmarks read it)
        self.pdl_ready = "USE_PDL" in getattr(kernel, "arg_names", ())  # see kernels/pdl.py
        LAUNCHERS.append(self)

    def launch(self, grid: Sequence[int], *args, **kwargs) -> None:
        if _pdl and self.pdl_ready:  # a keyword constexpr and option: part of the binding's key
            kwargs["USE_PDL"] = kwargs["launch_pdl"] = True
        if _compile_only:  # Triton's warm-up compiles for these arguments without launching (on the pass's pool)
            if self.direct:
                self.kernel.warmup(*args, grid=grid, **kwargs)
            return
        if _enabled and self.direct and not self.kernel.pre_run_hooks:
            key = (len(args), tuple(kwargs), tuple(kwargs.values()), knobs.runtime.debug,
                   knobs.compilation.instrumentation_mode)  # fmt: skip
            try:
                bindings = self._bindings.get(key)
            except TypeError:  # an unhashable keyword argument: this call site stays on kernel[grid]
                self.slow_launches += 1
                self.kernel[grid](*args, **kwargs)
                return
            if bindings is not None:
                device = self._device_of()
                for b in bindings:
                    if b.device == device and b.matches(args):
                        return self._run(b, grid, args, device)
            return self._launch_and_bind(key, grid, args, kwargs)
        self.slow_launches += 1
        self.kernel[grid](*args, **kwargs)

    def _run(self, b: _Binding, grid: Sequence[int], args: tuple, device: int) -> None:
        full = args + b.tail
        stream = self._stream_of(device)
        enter = knobs.runtime.launch_enter_hook
        metadata = None if enter is None else b.compiled.launch_metadata(grid, stream, *full)
        n = len(grid)
        b.launcher(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, b.function, b.packed_metadata,
                   metadata, enter, knobs.runtime.launch_exit_hook, *full)  # fmt: skip

    def _launch_and_bind(self, key: tuple, grid: Sequence[int], args: tuple, kwargs: dict) -> None:
        self.slow_launches += 1
        compiled = self.kernel[grid](*args, **kwargs)
        if compiled is None:
            return
        if self._device_of is None:
            self._device_of, self._stream_of = _device_functions()
        b = bind(self.kernel, compiled, self._device_of(), args, kwargs)
        if b is not None:
            kept = self._bindings.setdefault(key, [])
            kept.insert(0, b)
            del kept[_MAX_BINDINGS:]
