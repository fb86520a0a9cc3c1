"""Starting the engine process, with nothing heavier than ``multiprocessing`` imported: ``api_server`` starts it
before it imports torch, FastAPI and the model code itself, so that the engine process's own imports (seconds, the
longest part of a small model's start) run beside the HTTP process's instead of after them. ``EngineProcess``
(``engine_proc``) is the handle on what this starts."""

import ctypes
import logging
import math
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


@dataclass
class SpawnedEngine:
    """A started engine process and the HTTP side's ends of what it shares: the pipe and the start time of the step
    in flight (``time.monotonic``; NaN between steps)."""

    process: Any  # multiprocessing's Process
    conn: Any  # the HTTP side's end of the pipe
    step_started: Any  # a shared c_double

    def stop(self) -> None:
        """End a process that was never released (the HTTP process failed to start): quietly, it builds nothing."""
        self.process.terminate()
        self.process.join()
        self.conn.close()


def spawn_engine(make_runner: Optional[Callable] = None, tokenizer_eos: Optional[int] = None,
                 extra_eos_ids: Sequence[int] = (), tp: int = 1) -> SpawnedEngine:  # fmt: skip
    """Start the engine process; without ``make_runner`` it is held (see ``EngineProcess``), and with ``tp`` > 1
    (the command line's ``--tp``, before it is checked) it starts that many tensor-parallel workers meanwhile,
    held too (``tp.HeldWorkers``)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    step_started = ctx.RawValue(ctypes.c_double, math.nan)
    process = ctx.Process(target=_child_main, name="lightllm-engine",
                          args=(child, make_runner, tokenizer_eos, tuple(extra_eos_ids), step_started, os.getpid(),
                                logging.getLogger().level or logging.INFO, tp))  # fmt: skip
    # Ctrl+C reaches the whole process group, and the child must not die of it while it imports. A SIGINT ignored
    # here stays ignored across the child's exec (a blocked one does not stay blocked: /proc showed the child's mask
    # empty), and Python then installs no KeyboardInterrupt handler; ``_engine_main`` keeps ignoring it. This
    # process's own handler is back once the child is started (a Ctrl+C in those milliseconds is lost). Only the main
    # thread may set a handler: started from another thread, the child takes SIGINT as this process does.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        process.start()  # not a daemon: it starts tensor-parallel workers of its own
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    child.close()  # ours closed: the engine's end of the pipe is then its only one, so its death is an EOF here
    return SpawnedEngine(process, conn, step_started)


def _child_main(*args) -> None:
    """The engine process's entry: the engine's imports happen here, in the child."""
    from lightllm.server.engine_proc import _engine_main

    _engine_main(*args)
