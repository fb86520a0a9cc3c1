"""The server's engine loop: runs ``Engine.step()`` until stopped (an idle one steps every ``IDLE_WAIT_S``), times
the step in flight and the time since the last one ended (for /health),
hands each step's events to the HTTP side (``after_step``) and fails the requests of a step that raised. It runs on
a thread of its own (``start``, the in-process server of the tests) or on the engine process's main thread
(``run``, see ``engine_proc``)."""

import logging
import threading
import time
from typing import Callable, Optional

from lightllm.engine.engine import Engine

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05  # an idle loop wakes this often to notice a stop


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        after_step: Optional[Callable[[], None]] = None,
        clock: Callable[[], float] = time.monotonic,
        on_step: Optional[Callable[[Optional[float], Optional[float]], None]] = None,
    ):
        self.engine = engine
        self.after_step = after_step  # called on the loop's thread after every step: deliver its events
        self.clock = clock  # times the step in flight, for /health
        # told (start, None) as each step starts and (None, end) as it ends: another process's /health reads them
        self.on_step = on_step
        self._step_started: Optional[float] = None
        self._step_ended: Optional[float] = None  # the last step's end: a loop stuck between steps stops moving it
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="lightllm-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def exit_reason(self) -> str:
        return "engine loop stopped"

    def request_stop(self) -> None:
        """Make ``run`` return after the current step (from any thread)."""
        self._stop.set()

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop after the current step; False when the step is still running after ``timeout`` seconds."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def step_in_flight_s(self) -> Optional[float]:
        """How long the current step has run; None between steps."""
        started = self._step_started
        return None if started is None else self.clock() - started

    def between_steps_s(self) -> Optional[float]:
        """How long since the last step ended while none runs (an idle loop steps every ``IDLE_WAIT_S``, so more
        is a loop stuck outside its steps); None while a step runs and before the first has ended."""
        if self._step_started is not None:  # read first: the end is stored before the step is marked ended
            return None
        ended = self._step_ended
        return None if ended is None else self.clock() - ended

    def _mark(self, started: Optional[float]) -> None:
        ended = None
        if started is None:
            ended = self._step_ended = self.clock()  # first: between steps, the end read is never an older step's
        self._step_started = started
        if self.on_step is not None:
            self.on_step(started, ended)

    def run(self) -> None:
        """The loop, on the calling thread, until ``request_stop``."""
        self._run()

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = True
            self._mark(self.clock())
            try:
                busy = self.engine.step()
            except Exception:  # a failing step must not kill the server silently
                logger.exception("engine step failed; failing the requests in it")
                self.engine.fail_all()
            self._mark(None)
            if self.after_step is not None:  # before any wait: an idle step may still have finished aborts
                try:
                    self.after_step()
                except Exception:  # e.g. the HTTP loop closing under a shutdown: the engine thread goes on
                    logger.exception("delivering a step's events failed")
            if not busy:
                self.engine.wait_for_request(IDLE_WAIT_S)
