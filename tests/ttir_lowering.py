"""Lower the Triton kernels the CPU tests launch to TTIR for sm90, the step the interpreter skips.

Under ``TRITON_INTERPRET=1`` a kernel runs as Python, so code that the GPU compiler rejects can pass every test:
statements after an early ``return`` in a constexpr branch run in the interpreter only up to the return, while the
compiler keeps generating them (it failed on a ``// QGROUP`` with ``QGROUP=0``). A :class:`LaunchRecorder` notes each
interpreted launch as Triton's own binder would specialize it for an sm90 GPU (argument types, divisibility
attributes, constexpr values, launch options); :func:`lower` runs Triton's frontend (AST -> TTIR) on each distinct
specialization in child processes without the interpreter, where ``@triton.jit`` makes real ``JITFunction``s.

The frontend misses what fails later (TTGIR passes, LLVM lowering, ``ptxas``) and a kernel that needs more shared
memory than an sm90 block may have (it fails only at launch on the GPU), so :func:`build_cubins` also compiles
the :func:`representatives` (one launch per kernel, options and code path) all the way to an sm_90 cubin (Triton
bundles ``ptxas``) and checks its shared memory against ``SM90_MAX_SHARED_BYTES``.

Run as ``python -m tests.ttir_lowering`` it is that child: the stage and pickled launches on stdin, pickled results on
stdout.
"""

import ast
import contextlib
import importlib
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

from lightllm.kernels.launch_math import SM90_MAX_SHARED_BYTES

ROOT = Path(__file__).resolve().parent.parent
ARCH = 90  # the H200's compute capability, the GPU the project ships for
_ADDED_BY_RUN = ("debug", "instrumentation_mode")  # options JITFunction.run sets itself on every launch
_TTIR, _CUBIN = "ttir", "cubin"
MAX_CHILDREN = 4  # lowering processes side by side (one per core); each holds torch and Triton in memory


@dataclass(frozen=True)
class Launch:
    """One specialization of a kernel, as ``JITFunction.run`` would key its compile cache on an sm90 GPU."""

    module: str
    name: str
    signature: Tuple[Tuple[str, str], ...]  # parameter name -> Triton type ("*bf16", "i32", "fp32", "constexpr")
    constexprs: Tuple[Tuple[str, Any], ...]  # constexpr parameter (or int specialized to 1) -> its value
    attrs: Tuple[Tuple[str, Tuple[Tuple[str, int], ...]], ...]  # parameter -> e.g. (("tt.divisibility", 16),)
    options: Tuple[Tuple[str, Any], ...]  # launch options given (num_warps, num_stages, ...)
    # parameters not declared constexpr that Triton made constants of for this launch (an int equal to 1, None)
    specialized: Tuple[str, ...] = ()

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
        declared = {p.name for p in jit.params if p.is_constexpr}
        return Launch(
            module=kernel.fn.__module__,
            name=kernel.fn.__qualname__,
            signature=tuple(signature.items()),
            constexprs=tuple((names[path[0]], value) for path, value in sorted(constexprs.items())),
            attrs=tuple((names[path[0]], tuple(map(tuple, a))) for path, a in sorted(attrs.items())),
            options=tuple((k, v) for k, v in kwargs.items() if k in self._option_names and k not in _ADDED_BY_RUN),
            specialized=tuple(names[path[0]] for path in sorted(constexprs) if names[path[0]] not in declared),
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
    error: Optional[str]  # the compiler's message, None when it lowered (and, for a cubin, fits in shared memory)
    seconds: float
    shared_bytes: Optional[int] = None  # the cubin's dynamic shared memory; None for TTIR or when it did not compile
    pdl_wait: Optional[bool] = None  # whether the cubin's PTX waits on the previous grid (kernels/pdl.py); None: TTIR
    pdl_release: Optional[bool] = None  # whether it releases the next grid, after the wait


_cache: Dict[Tuple[str, Launch], Lowered] = {}


def lower(launches: List[Launch]) -> List[Lowered]:
    """Each launch lowered to TTIR for sm90 in child processes without the interpreter; cached per launch for
    the life of this process."""
    return _in_child(_TTIR, launches)


def build_cubins(launches: List[Launch]) -> List[Lowered]:
    """Each launch compiled to an sm_90 cubin in child processes, failed when it needs more shared memory than
    ``SM90_MAX_SHARED_BYTES``; cached per launch like :func:`lower`. Pass :func:`representatives`: a full compile costs
    about ten times a TTIR lowering."""
    return _in_child(_CUBIN, launches)


def representatives(launches: List[Launch]) -> List[Launch]:
    """The launches worth a full build: one per kernel, launch options and code path, at its biggest tiles.

    Integer constexprs are tile sizes or switches that kernels test against zero (``QUANT == 0``, ``QGROUP``), so
    a code path is the constexprs with each integer reduced to whether it is zero; flags, strings and ``None``
    arguments count as they are. An integer argument that Triton specialized to 1 for a launch (a stride of 1) is,
    like its specialization on alignment, the data's and not a path. Within a path the launch with the largest
    product of its integers is built (shared memory grows with the tiles), the first of equals. Launches that differ
    only in argument dtypes, alignment, strides of 1, other tile sizes or switch values share one build; every launch
    is still lowered to TTIR."""
    best: Dict[tuple, Launch] = {}
    for launch in launches:
        path = tuple((n, _path_value(v)) for n, v in launch.constexprs if not (n in launch.specialized and _is_int(v)))
        key = (launch.module, launch.name, launch.options, path)
        if key not in best or _tile_product(launch) > _tile_product(best[key]):
            best[key] = launch
    return list(best.values())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _path_value(value: Any) -> Any:
    return ("int", value == 0) if _is_int(value) else value


def _tile_product(launch: Launch) -> int:
    product = 1
    for _, value in launch.constexprs:
        if _is_int(value) and value > 0:
            product *= value
    return product


def _in_child(stage: str, launches: List[Launch]) -> List[Lowered]:
    todo = [launch for launch in dict.fromkeys(launches) if (stage, launch) not in _cache]
    if todo:
        for result in _run_children(stage, todo):
            _cache[(stage, result.launch)] = result
    return [_cache[(stage, launch)] for launch in launches]


def _run_children(stage: str, todo: List[Launch]) -> List[Lowered]:
    """``todo`` split over one child per core (at most :data:`MAX_CHILDREN`), every child stopped with its own
    children (``ptxas``) however this returns. Only a hang reaches the wait's limit (``proc.HANG_TIMEOUT_S``): a busy
    machine must not fail the check."""
    from lightllm.common import proc

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    count = max(1, min(len(os.sched_getaffinity(0)), MAX_CHILDREN, len(todo)))
    results: List[Lowered] = []
    with contextlib.ExitStack() as stack:
        env["TRITON_CACHE_DIR"] = stack.enter_context(tempfile.TemporaryDirectory(prefix="triton-cache-"))  # afresh
        children = []
        for part in (todo[i::count] for i in range(count)):
            stdin, stdout, stderr = (stack.enter_context(tempfile.TemporaryFile()) for _ in range(3))
            stdin.write(pickle.dumps((stage, part)))
            stdin.seek(0)
            child = stack.enter_context(proc.running([sys.executable, "-m", "tests.ttir_lowering"], stdin=stdin,
                                                     stdout=stdout, stderr=stderr, cwd=ROOT, env=env))  # fmt: skip
            children.append((child, stdout, stderr))
        for child, stdout, stderr in children:
            child.wait(timeout=proc.HANG_TIMEOUT_S)
            stdout.seek(0)
            stderr.seek(0)
            if child.returncode != 0:
                raise RuntimeError(f"the {stage} lowering process exited with {child.returncode}:\n"
                                   f"{stderr.read().decode(errors='replace')}")  # fmt: skip
            results += pickle.load(stdout)
    return results


# -- lowering (child side) -------------------------------------------------------------------------------------


def _source(launch: Launch):
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(launch.module), launch.name)
    while not isinstance(kernel, JITFunction) and hasattr(kernel, "fn"):
        kernel = kernel.fn  # a library's @triton.heuristics / @triton.autotune wrapper around the JITFunction
    if not isinstance(kernel, JITFunction):
        raise TypeError(f"{launch.module}.{launch.name} is a {type(kernel).__name__}, not a JITFunction")
    attrs = {(kernel.arg_names.index(name),): [list(a) for a in attr] for name, attr in launch.attrs}
    return ASTSource(kernel, dict(launch.signature), dict(launch.constexprs), attrs)


def _message(e: Exception, diagnostics: str) -> str:
    message, cause = f"{type(e).__name__}: {e}", e
    while cause.__cause__ is not None:  # Triton wraps the error (a ZeroDivisionError, ...) in a CompilationError
        cause = cause.__cause__
    if cause is not e:
        message = f"{type(cause).__name__}: {cause}\n{message}"
    # MLIR passes report why they failed on stderr, not in the exception ("PassManager::run failed")
    return f"{message}\n{diagnostics[-4000:]}" if diagnostics else message


@contextlib.contextmanager
def _stderr_captured() -> Iterator[List[str]]:
    """What the compiler (C++ included) writes to stderr inside the block, appended to the yielded list."""
    text: List[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            text.append(log.read().decode(errors="replace").strip())


def _lower_one(launch: Launch, backend, context_of) -> Lowered:
    start = time.perf_counter()
    with _stderr_captured() as diagnostics:
        try:
            options = backend.parse_options(dict(launch.options))
            _source(launch).make_ir(backend.target, options, backend.get_codegen_implementation(options),
                                    backend.get_module_map(), context_of())  # fmt: skip
            error = None
        except Exception as e:
            error = e
    seconds = time.perf_counter() - start
    return Lowered(launch, None if error is None else _message(error, diagnostics[0]), seconds)


def _build_one(launch: Launch, backend) -> Lowered:
    import triton

    start = time.perf_counter()
    with _stderr_captured() as diagnostics:
        try:
            compiled = triton.compile(_source(launch), target=backend.target, options=dict(launch.options))
            shared, error = compiled.metadata.shared, None
            ptx = compiled.asm["ptx"]
            waits = "griddepcontrol.wait" in ptx
            releases = waits and "griddepcontrol.launch_dependents" in ptx[ptx.index("griddepcontrol.wait") :]
        except Exception as e:
            shared, error = None, e
    seconds = time.perf_counter() - start
    if error is not None:
        return Lowered(launch, _message(error, diagnostics[0]), seconds)
    if shared > SM90_MAX_SHARED_BYTES:
        message = (f"needs {shared} bytes of shared memory per block, more than the {SM90_MAX_SHARED_BYTES} (227 KiB) "
                   "an H100 / H200 allows, so it would fail at launch: use smaller tiles or fewer stages")  # fmt: skip
        return Lowered(launch, message, seconds, shared, waits, releases)
    return Lowered(launch, None, seconds, shared, waits, releases)


def _child_main() -> None:
    from triton._C.libtriton import ir

    backend = _cuda_backend()

    def context_of():
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        return context

    results_out = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # Triton prints a failed kernel's whole PTX to stdout
    stage, launches = pickle.load(sys.stdin.buffer)
    if stage == _TTIR:
        results = [_lower_one(launch, backend, context_of) for launch in launches]
    else:
        results = [_build_one(launch, backend) for launch in launches]
    sys.stdout.flush()
    results_out.write(pickle.dumps(results))
    results_out.close()


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
