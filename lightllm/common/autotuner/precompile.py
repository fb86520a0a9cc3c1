"""Compile the configs a search will time (or a start-up will warm) on a thread pool, before any of them runs.

Otherwise each config's Triton kernels compile one after another as the config first launches, and on a GPU that
has never run them that is where a start-up's time goes: the first INT8 decode search on an H200 spent its whole
30 s budget after 29-35 of its 56 candidates (benchmarks/results/autotune_retime_h200.json). Most of a compile runs
without Python's GIL (MLIR and LLVM passes, ``ptxas`` in a child process): on an H100 machine with 16 CPUs that
search's 23 compiles took about 43 s one after another (the cold search less a second one) and 9.7 s on 8 threads,
and the search 49.9 s against 17.2 s (benchmarks/results/autotune_compile_h100.json).

How: every config's launcher runs once per input with each launch turned into a compile request (launchers
register the switch: ``kernels/direct_launch.py``), under Triton's ``AsyncCompileMode``, whose compiles go to a
pool of ``LIGHTLLM_AUTOTUNE_COMPILE_THREADS`` threads. No Triton kernel runs; the launcher's own torch work does
(buffers, copies), which is why the tuner restores mutated inputs afterwards. Leaving the mode waits for every
compile and puts each in its kernel's cache, where the launches that follow find it. A config whose launcher or
compile fails here is passed over quietly: its first real launch compiles it again and fails as it always did.
"""

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Iterable, List

try:  # Triton 3.4+
    from triton import knobs
    from triton.runtime._async_compile import AsyncCompileMode, active_mode
except ImportError:  # pragma: no cover - an older Triton compiles each kernel as it first launches
    AsyncCompileMode = None

logger = logging.getLogger(__name__)

# Called with True before a compile pass and False after it: each turns its launches into compile requests.
_switches: List[Callable[[bool], None]] = []
_active = False


def register_switch(switch: Callable[[bool], None]) -> None:
    """A launcher module's way to learn when its launches must only compile (``switch(True)``) and when they run
    again (``switch(False)``)."""
    _switches.append(switch)


def compiling() -> bool:
    """True inside a compile pass (a search must not start there: none of its launches would run)."""
    return _active


@dataclass
class CompilePass:
    """What one pass did: compile requests sent to the pool (a kernel already compiled in this process sends
    none), configs whose launcher raised, and the seconds it took, waiting for the compiles included."""

    kernels: int = 0
    failed: int = 0
    seconds: float = 0.0


def default_threads(ranks: int) -> int:
    """Compile threads when ``LIGHTLLM_AUTOTUNE_COMPILE_THREADS`` is unset: this process's CPUs shared among the
    ``ranks`` tensor-parallel ranks (each searches, and compiles, at the same time), at most 8. On an H100 machine
    with 16 CPUs the cold INT8 decode search's 23 compiles took 11.5 s on 4 threads, 9.7 s on 8 and 7.9 s on 16
    (benchmarks/results/autotune_compile_h100.json): past 8 little is left to gain."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // max(1, ranks)))


def usable(threads: int) -> bool:
    """Whether a pass can run here: more than one thread, a Triton with ``AsyncCompileMode`` and none active, no
    interpreter (nothing compiles under ``TRITON_INTERPRET``) and a launcher module that listens."""
    return (
        threads > 1
        and AsyncCompileMode is not None
        and not knobs.runtime.interpret
        and active_mode.get() is None  # also inside a pass of ours
        and bool(_switches)
    )


def compile_ahead(
    run: Callable[[object], object],
    configs: Iterable[object],
    threads: int,
    clock: Callable[[], float] = time.perf_counter,
) -> CompilePass:
    """Run ``run(config)`` for each config with launches compiling only, on ``threads`` threads; every compile has
    finished (or failed) when this returns. ``clock`` times it (the tuner passes its search clock)."""
    global _active
    done = CompilePass()
    start = clock()
    with ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(threads, thread_name_prefix="autotune-compile"))
        mode = AsyncCompileMode(pool, ignore_errors=True)  # leaving it waits for every compile
        queue = _Queue(pool, mode)
        stack.push(queue.on_exit)
        stack.enter_context(mode)
        _active = True
        for switch in _switches:
            switch(True)
        try:
            for config in configs:
                try:
                    run(config)
                except Exception as e:
                    done.failed += 1
                    logger.debug("compile ahead: config %s raised (%s: %s)", config, type(e).__name__, e)
        except BaseException:  # an interrupt: the compiles not started are dropped before the mode waits
            queue.drop()
            raise
        finally:
            for switch in _switches:
                switch(False)
            _active = False
        done.kernels = len(mode.raw_futures)
    done.seconds = clock() - start
    return done


class _Queue:
    """The pass's pool and compiles, for an interrupt (Ctrl-C, SIGTERM's exit): ``drop`` cancels the compiles still
    queued, so that leaving the mode waits only for the running ones. ``shutdown(cancel_futures=True)`` takes them
    off the queue and cancels their futures, but a future cancelled that way never tells its waiters (only the
    executor's own hand-off does), and leaving ``AsyncCompileMode`` waits on every future: done here, once."""

    def __init__(self, pool: ThreadPoolExecutor, mode):
        self.pool, self.mode, self.dropped = pool, mode, False

    def drop(self) -> None:
        if self.dropped:
            return
        self.dropped = True
        self.pool.shutdown(wait=False, cancel_futures=True)
        for future in self.mode.raw_futures:
            if future.cancelled():
                future.set_running_or_notify_cancel()  # CANCELLED -> CANCELLED_AND_NOTIFIED: its waiters wake

    def on_exit(self, exc_type, exc, traceback) -> bool:
        """After the mode's exit, before the pool's: an interrupt while the mode waited for the compiles drops the
        rest, and the mode, which never reached its own reset, is made inactive."""
        if exc_type is not None:
            self.drop()
            if active_mode.get() is self.mode:
                active_mode.set(None)
        return False
