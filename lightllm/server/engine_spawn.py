"""Starting the engine process, with nothing heavier than ``multiprocessing`` imported: ``api_server`` starts it
before it imports torch, FastAPI and the model code itself, so that the engine process's own imports (seconds, the
longest part of a small model's start) run beside the HTTP process's instead of after them. ``EngineProcess``
(``engine_proc``) is the handle on what this starts. With ``--tp`` the engine process starts its tensor-parallel
workers (``HeldWorkers``) from here too, before its own imports; what those processes share with it from their first
instruction (``RankProgress``, ``exit_with_parent``) lives here for that reason."""

import ctypes
import logging
import math
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


class RankProgress:
    """Per rank, in shared memory: commands received, commands finished and the time of the last heartbeat
    (``time.monotonic``, one clock for every process of the host). Rank 0 reads it to name a rank that holds
    up a step: the others wait for that one inside a collective, so only this tells them apart."""

    RECEIVED, FINISHED, BEAT = range(3)

    def __init__(self, ctx, world: int):
        self.values = ctx.RawArray(ctypes.c_double, 3 * world)

    def set(self, rank: int, field: int, value: float) -> None:
        self.values[3 * rank + field] = value

    def get(self, rank: int, field: int) -> float:
        return self.values[3 * rank + field]


def exit_with_parent(parent: int, interval_s: float = 0.5) -> None:
    """End this process when ``parent`` does (killed, crashed): a tensor-parallel worker outliving rank 0 would hold
    its GPU inside a collective that never ends, an engine process outliving the HTTP process its memory. ``parent``
    is the pid that spawned us: it may already be gone by the time this runs."""

    def watch():
        while os.getppid() == parent:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="lightllm-parent-watch", daemon=True).start()


STARTED, ENDED = range(2)  # the fields of ``SpawnedEngine.step_times``


@dataclass
class SpawnedEngine:
    """A started engine process and the HTTP side's ends of what it shares: the pipe and ``step_times``, the start
    of the step in flight (NaN between steps) and the end of the last one (NaN before the first): ``time.monotonic``,
    one clock for every process of the host."""

    process: Any  # multiprocessing's Process
    conn: Any  # the HTTP side's end of the pipe
    step_times: Any  # two shared c_doubles: STARTED, ENDED

    def stop(self) -> None:
        """End a process that was never released (the HTTP process failed to start): quietly, it builds nothing."""
        self.process.kill()  # SIGTERM is ignored there (_DRAINED); its held workers watch its pid and leave too
        self.process.join()
        self.conn.close()


# Signals the HTTP process drains on: its engine process and workers ignore them, and are stopped by it (a kill, not
# SIGTERM, where one must end without a drain)
_DRAINED = (signal.SIGINT, signal.SIGTERM)


def spawn_engine(make_runner: Optional[Callable] = None, tokenizer_eos: Optional[int] = None,
                 extra_eos_ids: Sequence[int] = (), tp: int = 1) -> SpawnedEngine:  # fmt: skip
    """Start the engine process; without ``make_runner`` it is held (see ``EngineProcess``), and with ``tp`` > 1
    (the command line's ``--tp``, before it is checked) it starts that many tensor-parallel workers meanwhile,
    held too (``HeldWorkers``)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    step_times = ctx.RawArray(ctypes.c_double, [math.nan, math.nan])  # STARTED, ENDED
    process = ctx.Process(target=_child_main, name="lightllm-engine",
                          args=(child, make_runner, tokenizer_eos, tuple(extra_eos_ids), step_times, os.getpid(),
                                logging.getLogger().level or logging.INFO, tp))  # fmt: skip
    # Ctrl+C reaches the whole process group, and a service manager's SIGTERM the whole control group (systemd's
    # default KillMode): the child and its workers must not die of either, the HTTP process drains and then stops
    # them (and they end with it if it dies). A signal ignored here stays ignored across the child's exec (a blocked
    # one does not stay blocked: /proc showed the child's mask empty), Python then installs no KeyboardInterrupt
    # handler, and the workers the child spawns inherit it too. This process's own handlers are back once the child
    # is started (a signal in those milliseconds is lost). Only the main thread may set a handler: started from
    # another thread, the child takes both as this process does.
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in _DRAINED} if main else {}
    try:
        process.start()  # not a daemon: it starts tensor-parallel workers of its own
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    child.close()  # ours closed: the engine's end of the pipe is then its only one, so its death is an EOF here
    return SpawnedEngine(process, conn, step_times)


class HeldWorkers:
    """Tensor-parallel ranks 1..world-1, started before their arguments are known; ``release`` sends them. A held
    engine process starts them first thing (``api_server`` read ``--tp`` off the command line), so their imports
    (seconds) run beside its own and the HTTP process's flag parsing and tokenizer load, not after; ``tp.start_tp``
    releases those, or dismisses them for another world size, and otherwise starts and releases its own at once."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world = world
        self.progress = RankProgress(ctx, world)
        self.procs, self.errors, self._inboxes = [], [], []
        for rank in range(1, world):
            error_in, error_out = ctx.Pipe(duplex=False)
            inbox_out, inbox_in = ctx.Pipe(duplex=False)  # (read end, write end)
            args = (rank, world, os.getpid(), self.progress, error_out, inbox_out)
            proc = ctx.Process(target=_worker_main, args=args, daemon=True, name=f"lightllm-tp{rank}")
            proc.start()
            error_out.close()  # the worker's alone from here: its exit is an EOF
            inbox_out.close()
            self.procs.append(proc)
            self.errors.append(error_in)
            self._inboxes.append(inbox_in)

    def release(self, init_method: str, args) -> bool:
        """Send every worker its start (the rendezvous, the ``EngineArgs``); False if one is gone already (a worker
        not reached then ends at its inbox's end)."""
        try:
            for inbox in self._inboxes:
                inbox.send((init_method, args))
            return True
        except OSError:  # BrokenPipeError: that worker exited (its imports failed)
            return False
        finally:
            for inbox in self._inboxes:
                inbox.close()

    def dismiss(self) -> None:
        """End workers that will not be used (they have built nothing: mostly still importing)."""
        for inbox in self._inboxes:
            inbox.close()
        for proc in self.procs:
            proc.kill()  # SIGTERM is ignored there (inherited from the engine process: _DRAINED)
            proc.join()
        for conn in self.errors:
            conn.close()


def _worker_main(rank: int, world: int, parent: int, progress: RankProgress, errors, inbox) -> None:
    """A worker's entry: it watches its parent before its imports (seconds), so it never outlives an engine process
    that is stopped meanwhile."""
    exit_with_parent(parent)
    from lightllm.server.tp import _worker

    _worker(rank, world, parent, progress, errors, inbox)


def _child_main(conn, make_runner, tokenizer_eos, extra_eos, step_times, parent: int, log_level: int,
                tp: int) -> None:  # fmt: skip
    """The engine process's entry: it watches its parent and starts its held workers before its own imports, which
    happen here, in the child."""
    exit_with_parent(parent)
    held = HeldWorkers(tp) if make_runner is None and tp > 1 else None
    from lightllm.server.engine_proc import _engine_main

    _engine_main(conn, make_runner, tokenizer_eos, extra_eos, step_times, log_level, held)
