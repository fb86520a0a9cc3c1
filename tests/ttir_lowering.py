"""Lower the Triton kernels the CPU tests launch to TTIR for sm90, the step the interpreter skips.

Under ``TRITON_INTERPRET=1`` a kernel runs as Python, so code that the GPU compiler rejects can pass every test:
statements after an early ``return`` in a constexpr branch run in the interpreter only up to the return, while the
compiler keeps generating them (it failed on a ``// QGROUP`` with ``QGROUP=0``). A :class:`LaunchRecorder` notes each
interpreted launch as Triton's own binder would specialize it for an sm90 GPU (argument types, divisibility
attributes, constexpr values, launch options); :func:`lower` runs Triton's frontend (AST -> TTIR) on each distinct
specialization in a child process without the interpreter, where ``@triton.jit`` makes real ``JITFunction``s.

Run as ``python -m tests.ttir_lowering`` it is that child: pickled launches on stdin, pickled results on stdout.
"""

import ast
import contextlib
import importlib
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent
ARCH = 90  # the H200's compute capability, the GPU the project ships for
_ADDED_BY_RUN = ("debug", "instrumentation_mode")  # options JITFunction.run sets itself on every launch


@dataclass(frozen=True)
class Launch:
    """One specialization of a kernel, as ``JITFunction.run`` would key its compile cache on an sm90 GPU."""

    module: str
    name: str
    signature: Tuple[Tuple[str, str], ...]  # parameter name -> Triton type ("*bf16", "i32", "fp32", "constexpr")
    constexprs: Tuple[Tuple[str, Any], ...]  # constexpr parameter (or int specialized to 1) -> its value
    attrs: Tuple[Tuple[str, Tuple[Tuple[str, int], ...]], ...]  # parameter -> e.g. (("tt.divisibility", 16),)
    options: Tuple[Tuple[str, Any], ...]  # launch options given (num_warps, num_stages, ...)

    def describe(self) -> str:
        values = ", ".join(f"{name}={value!r}" for name, value in self.constexprs)
        options = ", ".join(f"{name}={value!r}" for name, value in self.options)
        return f"{self.module}.{self.name}({values})" + (f" [{options}]" if options else "")


def interpreting() -> bool:
    """Whether ``@triton.jit`` makes interpreted functions in this process (the CPU test runs)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _cuda_backend():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", ARCH, 32))


class LaunchRecorder:
    """The distinct launches made while it records (see :func:`recording`), each derived with Triton's binder for
    an sm90 target from the interpreted kernel's arguments. ``failures`` holds launches the binder rejected."""

    def __init__(self):
        self.launches: Dict[Launch, int] = {}  # launch -> how many times it was made
        self.failures: List[str] = []
        self._binders: Dict[Any, Any] = {}
        self._backend = None
        self._option_names: Set[str] = set()

    def record(self, kernel: Any, args: tuple, kwargs: dict) -> None:
        try:
            launch = self._specialize(kernel, args, kwargs)
        except Exception as e:  # reported by the check; the test that launched goes on
            self.failures.append(f"{kernel.fn.__module__}.{kernel.fn.__qualname__}: {type(e).__name__}: {e}")
            return
        self.launches[launch] = self.launches.get(launch, 0) + 1

    def _specialize(self, kernel: Any, args: tuple, kwargs: dict) -> Launch:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        if self._backend is None:
            from triton.backends.nvidia.compiler import CUDAOptions

            self._backend = _cuda_backend()
            self._option_names = set(CUDAOptions.__dataclass_fields__)
        entry = self._binders.get(kernel)
        if entry is None:
            jit = JITFunction(kernel.fn, **kernel.kwargs)
            binder = create_function_from_signature(jit.signature, jit.params, self._backend)
            entry = self._binders[kernel] = (jit, binder)
        jit, binder = entry
        kwargs = dict(kwargs, debug=False, instrumentation_mode="")  # what JITFunction.run adds
        bound, specialization, options = binder(*args, **kwargs)
        _, signature, constexprs, attrs = jit._pack_args(self._backend, kwargs, bound, specialization, options)
        names = list(signature)
        return Launch(
            module=kernel.fn.__module__,
            name=kernel.fn.__qualname__,
            signature=tuple(signature.items()),
            constexprs=tuple((names[path[0]], value) for path, value in sorted(constexprs.items())),
            attrs=tuple((names[path[0]], tuple(map(tuple, a))) for path, a in sorted(attrs.items())),
            options=tuple((k, v) for k, v in kwargs.items() if k in self._option_names and k not in _ADDED_BY_RUN),
        )


_active: List[LaunchRecorder] = []  # innermost last; only it records
_original_run = None


def _recording_run(self, *args, grid, warmup, **kwargs):
    if _active and not warmup:
        _active[-1].record(self, args, kwargs)
    return _original_run(self, *args, grid=grid, warmup=warmup, **kwargs)


def install() -> None:
    """Route every interpreted launch (``kernel[grid](...)``, ``DirectLaunch`` included) through the innermost
    active recorder. Idempotent."""
    global _original_run
    from triton.runtime.interpreter import InterpretedFunction

    if _original_run is None:
        _original_run = InterpretedFunction.run
        InterpretedFunction.run = _recording_run


@contextlib.contextmanager
def recording(recorder: Optional[LaunchRecorder] = None) -> Iterator[LaunchRecorder]:
    """Launches inside the block go to ``recorder`` (a new one by default) and to no outer recorder."""
    install()
    recorder = recorder or LaunchRecorder()
    _active.append(recorder)
    try:
        yield recorder
    finally:
        _active.remove(recorder)


def push(recorder: LaunchRecorder) -> None:
    """Make ``recorder`` the active one for the rest of the process (the test session's)."""
    install()
    _active.insert(0, recorder)


# -- lowering (parent side) ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lowered:
    launch: Launch
    error: Optional[str]  # the compiler's message, None when it lowered
    seconds: float


_lowered_cache: Dict[Launch, Lowered] = {}


def lower(launches: List[Launch]) -> List[Lowered]:
    """Each launch lowered to TTIR for sm90 in one child process without the interpreter; cached per launch for
    the life of this process."""
    todo = [launch for launch in dict.fromkeys(launches) if launch not in _lowered_cache]
    if todo:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        # no timeout: a busy machine must not fail the check; subprocess.run kills the child if this one is stopped
        done = subprocess.run([sys.executable, "-m", "tests.ttir_lowering"], input=pickle.dumps(todo),
                              capture_output=True, cwd=ROOT, env=env)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"the TTIR lowering process exited with {done.returncode}:\n{done.stderr.decode()}")
        for result in pickle.loads(done.stdout):
            _lowered_cache[result.launch] = result
    return [_lowered_cache[launch] for launch in launches]


# -- lowering (child side) -------------------------------------------------------------------------------------


def _lower_one(launch: Launch, backend, context_of) -> Optional[str]:
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(launch.module), launch.name)
    if not isinstance(kernel, JITFunction):
        return f"{launch.module}.{launch.name} is a {type(kernel).__name__}, not a JITFunction"
    options = backend.parse_options(dict(launch.options))
    attrs = {(kernel.arg_names.index(name),): [list(a) for a in attr] for name, attr in launch.attrs}
    source = ASTSource(kernel, dict(launch.signature), dict(launch.constexprs), attrs)
    try:
        source.make_ir(backend.target, options, backend.get_codegen_implementation(options),
                       backend.get_module_map(), context_of())  # fmt: skip
    except Exception as e:
        message, cause = f"{type(e).__name__}: {e}", e
        while cause.__cause__ is not None:  # Triton wraps the error (a ZeroDivisionError, ...) in a CompilationError
            cause = cause.__cause__
        return message if cause is e else f"{type(cause).__name__}: {cause}\n{message}"
    return None


def _child_main() -> None:
    from triton._C.libtriton import ir

    backend = _cuda_backend()

    def context_of():
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        return context

    results = []
    for launch in pickle.load(sys.stdin.buffer):
        start = time.perf_counter()
        error = _lower_one(launch, backend, context_of)
        results.append(Lowered(launch, error, time.perf_counter() - start))
    sys.stdout.buffer.write(pickle.dumps(results))


# -- which kernels exist ---------------------------------------------------------------------------------------


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Attribute) and target.attr == "jit") or (
        isinstance(target, ast.Name) and target.id == "jit"
    )


def _resolve(node: ast.expr, names: dict) -> Any:
    """What a called name (``helper`` or ``module.helper``) is in a module's globals; None if neither."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return getattr(names.get(node.value.id), node.attr, None)
    return None


def jit_functions(package: str = "lightllm") -> Dict[Tuple[str, str], Set[Tuple[str, str]]]:
    """Every ``@triton.jit`` function under ``package`` as (module, name) -> the jit functions it calls (by
    module and name), found from the source and resolved through the module's globals."""
    found: Dict[Tuple[str, str], Set[Tuple[str, str]]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and any(map(_is_jit, n.decorator_list))]
        if not functions:
            continue
        module_name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        module = importlib.import_module(module_name)
        for function in functions:
            callees = set()
            for node in ast.walk(function):
                if isinstance(node, ast.Call):
                    fn = getattr(_resolve(node.func, module.__dict__), "fn", None)
                    if fn is not None and fn is not getattr(module.__dict__[function.name], "fn", None):
                        callees.add((fn.__module__, fn.__qualname__))
            found[(module_name, function.name)] = callees
    return found


def entry_kernels(functions: Dict[Tuple[str, str], Set[Tuple[str, str]]]) -> Set[Tuple[str, str]]:
    """The jit functions no other jit function calls: the ones launched (the rest are lowered inside them)."""
    called = set().union(*functions.values()) if functions else set()
    return set(functions) - called


if __name__ == "__main__":  # results pickle as this module's classes, not __main__'s
    from tests.ttir_lowering import _child_main as main

    main()
