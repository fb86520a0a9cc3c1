"""Triton launches that skip ``JITFunction.run``'s per-call work once a kernel has compiled for its arguments.

``kernel[grid](...)`` binds every argument, derives Triton's specialization of each (pointer alignment to 16
bytes, integers equal to 1 or divisible by 16, dtypes), turns it into a cache key and looks the compiled kernel
up: about 11 µs of host time per launch on the H200's host, against about 5 µs for calling the compiled
kernel's launcher directly. A :class:`DirectLaunch` runs the first launch of each specialization through
``kernel[grid]`` (Triton's own binder, cache and compile) and keeps the compiled kernel it returned; a later
launch whose arguments have the same specialization classes (checked for the arguments that can change them:
tensors' dtype and alignment, ints' class, positional constexprs' values; the keyword constexprs and options are
the binding's key) calls that kernel's launcher on the current stream. Any difference falls back to
``kernel[grid]``, which binds again.

Under ``TRITON_INTERPRET=1`` (CI) the kernel is an interpreted function and every launch takes ``kernel[grid]``.
Launch hooks (a profiler's ``knobs.runtime.launch_enter_hook``) are passed on as ``kernel[grid]`` passes them;
a kernel with ``pre_run_hooks`` always takes ``kernel[grid]``. Not re-checked on the direct path: Triton's check
that the globals a kernel read at compile time still hold their values (module constants, never reassigned).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

_enabled = True
_MAX_BINDINGS = 4  # specializations kept per key (one in practice: a plan's shapes and dtypes are fixed)


def set_enabled(on: bool) -> bool:
    """Turn the direct path on or off for every kernel (off: every launch is ``kernel[grid]``); returns the
    previous setting. For tests and benchmarks that compare the two paths."""
    global _enabled
    previous, _enabled = _enabled, bool(on)
    return previous


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


def _current_device() -> int:
    return torch.cuda.current_device()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


class _Binding:
    """One compiled kernel and the specialization classes of the arguments it was compiled for."""

    __slots__ = ("device", "tensor_at", "tensor_classes", "int_at", "int_classes", "float_at", "exact_at",
                 "exact_values", "tail", "launcher", "function", "packed_metadata", "compiled")  # fmt: skip

    def matches(self, args: tuple) -> bool:
        try:
            if self.tensor_classes != tuple([tensor_class(args[i]) for i in self.tensor_at]):
                return False
            for i, value in zip(self.exact_at, self.exact_values):
                arg = args[i]
                if arg is not value and (type(arg) is not type(value) or arg != value):
                    return False
            for i in self.float_at:
                if type(args[i]) is not float:
                    return False
            return self.int_classes == tuple([int_class(args[i]) if type(args[i]) is int else None
                                              for i in self.int_at])  # fmt: skip
        except (AttributeError, TypeError):  # an argument of another kind (a tensor turned scalar, ...)
            return False


def bind(kernel: Any, compiled: Any, device: int, args: tuple, kwargs: dict) -> Optional[_Binding]:
    """A binding of ``compiled`` (what ``kernel[grid](*args, **kwargs)`` ran) for these arguments' classes, or None
    when an argument is of a kind this module does not classify (those launches stay on ``kernel[grid]``)."""
    params = kernel.params
    if len(args) > len(params):
        return None
    b = _Binding()
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
    b.device = device
    b.tensor_at, b.int_at, b.float_at, b.exact_at = tuple(tensor_at), tuple(int_at), tuple(float_at), tuple(exact_at)
    b.tensor_classes = tuple(tensor_class(args[i]) for i in tensor_at)
    b.int_classes = tuple(int_class(args[i]) for i in int_at)
    b.exact_values = tuple(args[i] for i in exact_at)
    b.tail = tuple(tail)
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
        self.slow_launches = 0  # launches that took kernel[grid] (tests and benchmarks read it)

    def launch(self, grid: Sequence[int], *args, **kwargs) -> None:
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
                device = _current_device()
                for b in bindings:
                    if b.device == device and b.matches(args):
                        return self._run(b, grid, args, device)
            return self._launch_and_bind(key, grid, args, kwargs)
        self.slow_launches += 1
        self.kernel[grid](*args, **kwargs)

    def _run(self, b: _Binding, grid: Sequence[int], args: tuple, device: int) -> None:
        full = args + b.tail
        stream = _current_stream(device)
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
        b = bind(self.kernel, compiled, _current_device(), args, kwargs)
        if b is not None:
            kept = self._bindings.setdefault(key, [])
            kept.insert(0, b)
            del kept[_MAX_BINDINGS:]
