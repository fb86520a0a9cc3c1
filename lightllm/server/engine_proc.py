"""The engine in a process of its own (LightLLM's layout). The HTTP process tokenizes, validates, streams and
detokenizes; the engine process runs the scheduler, the model and sampling (``Engine.step()`` on its main thread)
and never waits for HTTP: the two share no GIL.

What crosses, batched both ways, pickled over one ``multiprocessing`` pipe:

- HTTP -> engine, one message per wake-up of the HTTP side's sender thread, holding everything queued since the
  last: ``("submit", id, prompt ids, SamplingParams, arrival)``, ``("abort", id, reason)``, ``("abort_all",)``,
  ``("stop",)``. A thread of the engine process receives them and queues them for the next step.
- engine -> HTTP, one message per step, ``("step", records, calls)``: the step's events in order, and its observer
  calls (the step's token latencies in one ``on_tokens``; last, ``on_engine_message`` with the send time),
  replayed on the HTTP side's ``Metrics``. A record is either the step's sampled tokens as columns, ``("tokens",
  ids, token ids, logprobs, top logprobs or None, cached tokens)``, or one event, ``("event", id, kind, token id,
  logprob, finish reason, top logprobs, cached tokens)`` (finishes; MTP's tokens). ``replay`` turns them back into
  each request's ``Event``s.
- shared memory: the start time of the step in flight and the end time of the last step (``time.monotonic``, one
  clock per host), for ``/health``: a step running too long, or an engine process stuck between steps.

The engine process dying (a crash, a lost tensor-parallel rank, the OOM killer) ends every request in flight with
finish_reason "error", turns ``/health`` 503 and stops the server (``on_exit``). The engine process leaves when the
HTTP process does (its pipe closes, its parent changes) and ignores SIGINT: Ctrl+C reaches the whole process group,
and the HTTP process stops it after the drain.
"""

import itertools
import logging
import math
import queue
import signal
import threading
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence

import torch

from lightllm.common.gc_heap import GcPauses, freeze_startup_heap
from lightllm.engine.engine import Engine, eos_token_ids
from lightllm.engine.request import Event, Request
from lightllm.server.engine_loop import EngineLoop
from lightllm.server.engine_spawn import ENDED, STARTED, HeldWorkers, SpawnedEngine, spawn_engine
from lightllm.server import tp

logger = logging.getLogger(__name__)
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class EngineExited(RuntimeError):
    """The engine process ended before it was ready."""


class EngineStartError(ValueError):
    """The engine process rejected its input while building the runner (a malformed checkpoint, a size the memory
    can't take): its one-line message, reported like a bad flag."""


class EngineProcess:
    """The HTTP process's handle on the engine process: ``submit``, ``abort`` and ``abort_all`` as ``Engine`` has
    them (called on the HTTP event loop), ``start``/``stop``/``is_alive``/``step_in_flight_s``/``between_steps_s`` as
    ``EngineLoop``.

    ``make_runner`` (picklable, run in the engine process) builds the runner: a ``ModelRunner``, or rank 0 of
    tensor parallelism, whose ``stop`` the engine process calls on its way out. ``args`` and ``config`` (vocabulary
    size, EOS ids) are the runner's, known once ``wait_ready`` returns.

    Without ``make_runner`` the process is held: it starts (a spawned process imports torch and the engine, seconds)
    but builds and logs nothing until ``release`` gives it ``make_runner`` and the EOS ids, so the HTTP process parses
    its arguments and loads its tokenizer meanwhile, and ``stop`` ends it quietly if either fails."""

    def __init__(self, make_runner: Optional[Callable] = None, tokenizer_eos: Optional[int] = None,
                 extra_eos_ids: Sequence[int] = (), spawned: Optional[SpawnedEngine] = None):  # fmt: skip
        """``spawned``: a held engine process started already (``api_server`` starts it before its own imports)."""
        if spawned is None:
            spawned = spawn_engine(make_runner, tokenizer_eos, extra_eos_ids)
        self.process, self._conn, self._step_times = spawned.process, spawned.conn, spawned.step_times
        self.args = self.config = self.model_dir = None
        self.gc_frozen = 0
        self.observer = None  # the Metrics its step messages are replayed on
        self.on_exit: List[Callable[[], None]] = []  # called on the event loop when the engine process dies
        self.problem: Optional[str] = None  # why it is gone, once it is
        self._emits: Dict[str, Callable[[Event], None]] = {}  # request id -> its emit, on the event loop only
        self._outbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._loop = None
        self._stopping = False
        # Once the reader runs it is the only thread that waits for the engine process: two waits race, and the
        # loser's waitpid fails, so it would take a cleanly exited engine for a live one (and SIGKILL its pid)
        self._reader: Optional[threading.Thread] = None
        self._reaped = threading.Event()  # the reader has waited for the engine process's exit

    # ---- start-up, on the main thread ----------------------------------------------------------------------

    def release(self, make_runner: Callable, tokenizer_eos: Optional[int] = None, extra_eos_ids: Sequence[int] = ()):
        """Let a held engine process build its runner (the constructor's arguments). An engine process that died
        held (the OOM killer, a failed import) is no error here: ``wait_ready`` then says how it ended."""
        try:
            self._conn.send(("release", make_runner, tokenizer_eos, tuple(extra_eos_ids)))
        except OSError:  # BrokenPipeError, ConnectionResetError: its end of the pipe is gone
            pass

    def wait_ready(self) -> None:
        """Until the runner is built (weights, tuning, graphs); ``EngineStartError`` (one line) if building it raised
        a ValueError (a malformed checkpoint), ``EngineExited`` if the engine process ends first otherwise."""
        try:
            kind, info = self._conn.recv()
        except (EOFError, OSError):
            self.process.join()
            code = self.process.exitcode
            if code is not None and code < 0:  # a signal leaves no error of its own: the OOM killer's SIGKILL, mostly
                hint = (" (out of memory? check --running_max_req_size / --max_total_token_num)"
                        if -code == signal.SIGKILL else "")  # fmt: skip
                raise EngineExited(f"engine process was killed by signal {-code} while starting{hint}") from None
            raise EngineExited(f"engine process exited with code {code} while starting (its error is above)") from None
        if kind == "error":  # it leaves right after sending: wait, so nothing of it outlives this
            self.process.join(10)
            raise EngineStartError(info)
        self.args, self.config, self.model_dir = info["args"], SimpleNamespace(**info["config"]), info["model_dir"]
        self.gc_frozen = info["gc_frozen"]  # start-up objects the engine process keeps out of the collector's passes
        threading.Thread(target=self._send_loop, name="lightllm-engine-send", daemon=True).start()

    def bind(self, loop) -> None:
        """Deliver to ``loop`` (the HTTP event loop); ``start`` then starts reading the engine's messages."""
        self._loop = loop

    def start(self) -> None:
        self._reader = threading.Thread(target=self._read_loop, name="lightllm-engine-read", daemon=True)
        self._reader.start()

    # ---- the Engine's side, on the event loop --------------------------------------------------------------

    def submit(self, req: Request) -> None:
        if self.problem is not None:
            req.emit(Event("finish", finish_reason="error"))
            return
        self._emits[req.id] = req.emit
        self._outbox.put(("submit", req.id, req.prompt_ids, req.params, req.arrival))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._outbox.put(("abort", request_id, reason))

    def abort_all(self) -> None:
        self._outbox.put(("abort_all",))

    # ---- the EngineLoop's side -----------------------------------------------------------------------------

    def is_alive(self) -> bool:
        return self.problem is None and self._process_alive()

    def _process_alive(self) -> bool:
        if self._reader is not None:  # the reader waits for the process: asking it here would race with that
            return not self._reaped.is_set()
        return self.process.is_alive()

    def exit_reason(self) -> str:
        return self.problem or f"engine process exited with code {self.process.exitcode}"

    def step_in_flight_s(self) -> Optional[float]:
        started = self._step_times[STARTED]
        return None if math.isnan(started) else time.monotonic() - started

    def between_steps_s(self) -> Optional[float]:
        if not math.isnan(self._step_times[STARTED]):  # read first: the end is stored before the step is marked ended
            return None
        ended = self._step_times[ENDED]
        return None if math.isnan(ended) else time.monotonic() - ended

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop the engine process after its current step and wait for it (it stops its tensor-parallel workers);
        False when it was still running after ``timeout`` seconds: it is killed then. Idempotent."""
        self._stopping = True
        if self._process_alive() and self.args is None:  # still starting (Ctrl+C while loading): nothing to drain
            self.process.kill()  # it ignores SIGTERM (engine_spawn); its workers watch its pid and leave too
        elif self._process_alive():
            self._outbox.put(("stop",))
        if self._reader is None:
            self.process.join(timeout)
            clean = not self.process.is_alive()
        else:
            clean = self._reaped.wait(timeout)
        if not clean:
            self.process.kill()  # its workers watch its pid and leave too
            if self._reader is None:
                self.process.join()
            else:
                self._reaped.wait()
        return clean

    # ---- threads -------------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        """Everything queued since the last send goes in one message, so the event loop never waits on the pipe."""
        while True:
            items = [self._outbox.get()]
            while not self._outbox.empty():
                items.append(self._outbox.get())
            try:
                self._conn.send(items)
            except (OSError, ValueError):  # the engine is gone: the reader reports it
                return
            if any(item[0] == "stop" for item in items):
                return

    def _read_loop(self) -> None:
        deliver = True  # until the event loop is closed; the pipe is still drained then, so the engine never blocks
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if deliver and message[0] == "step":
                deliver = self._call_soon(self._deliver, message[1], message[2])
        self.process.join()  # its end of the pipe is closed: it has exited or is exiting
        self._reaped.set()
        if not self._stopping:
            self._call_soon(self._gone, f"engine process exited with code {self.process.exitcode}")

    def _call_soon(self, fn, *args) -> bool:
        """``fn(*args)`` on the event loop; False once that loop is closed (the server has shut down)."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def _deliver(self, records: list, calls: list) -> None:
        """One step's message, on the event loop: metrics first, then every request's events."""
        if self.observer is not None:
            for name, args in calls:
                getattr(self.observer, name)(*args)
        replay(records, self._emits)

    def _gone(self, problem: str) -> None:
        if self.problem is not None or self._stopping:
            return
        self.problem = problem
        emits, self._emits = self._emits, {}
        logger.error("%s; %d request(s) in flight end with finish_reason error and the server stops", problem,
                     len(emits))  # fmt: skip
        for emit in emits.values():
            emit(Event("finish", finish_reason="error"))
        for callback in self.on_exit:
            callback()


def replay(records: list, emits: Dict[str, Callable[[Event], None]]) -> None:
    """A step message's records as ``Event``s, each to its request's emit in ``emits`` (request id -> emit); a
    finish removes the request from ``emits``. Requests not in ``emits`` (already gone) are skipped."""
    for record in records:
        if record[0] == "tokens":
            _, rids, token_ids, logprobs, tops, cached = record
            for rid, tok, lp, top, hits in zip(rids, token_ids, logprobs, tops or itertools.repeat(None), cached):
                emit = emits.get(rid)
                if emit is not None:
                    emit(Event("token", tok, lp, top_logprobs=top, cached_tokens=hits))
            continue
        _, rid, kind, token_id, logprob, reason, top, hits = record
        emit = emits.get(rid) if kind == "token" else emits.pop(rid, None)
        if emit is not None:
            emit(Event(kind, token_id, logprob, reason, top_logprobs=top, cached_tokens=hits))


# ---- the engine process ----------------------------------------------------------------------------------------


class _Recorder:
    """The engine's StepObserver in the engine process: each call is recorded, to be replayed on the HTTP side's
    ``Metrics`` (any ``on_*`` method, ``on_tokens`` included, so one added to the observer needs nothing here).
    ``on_queues`` is sent only when it changed, so an idle engine sends nothing."""

    def __init__(self):
        self.calls: List[tuple] = []
        self._queues = self._sent_queues = None

    def on_queues(self, *args) -> None:
        self._queues = args

    def __getattr__(self, name: str):
        if not name.startswith("on_"):
            raise AttributeError(name)

        def record(*args):
            self.calls.append((name, args))

        setattr(self, name, record)  # found directly from now on
        return record

    def take(self) -> List[tuple]:
        calls, self.calls = self.calls, []
        if self._queues != self._sent_queues:
            calls.append(("on_queues", self._queues))
            self._sent_queues = self._queues
        return calls


class _EngineSide:
    """The engine process: the engine loop on its main thread, a thread receiving the HTTP side's messages."""

    def __init__(self, conn, runner, eos_ids, step_times, gc_pauses: Optional[GcPauses] = None):
        self.conn = conn
        self.gc_pauses = gc_pauses
        self._gc_passes_sent = 0
        self.runner = runner
        self.recorder = _Recorder()
        self.engine = Engine(runner, eos_ids, observer=self.recorder, emit_tokens=self._emit_tokens)
        self.records: List[tuple] = []  # the step's events so far, as ``replay`` reads them
        self._step_times = step_times
        self.loop = EngineLoop(self.engine, after_step=self._send_step, on_step=self._mark)

    def _mark(self, started: Optional[float], ended: Optional[float]) -> None:
        if started is None:
            self._step_times[ENDED] = ended  # first: between steps the HTTP side never reads an older step's end
            self._step_times[STARTED] = math.nan
        else:
            self._step_times[STARTED] = started

    def _emitter(self, request_id: str) -> Callable[[Event], None]:
        """A request's emit (its finish; MTP's tokens): one record per event."""
        append = self.records.append

        def emit(ev: Event) -> None:
            append(("event", request_id, ev.kind, ev.token_id, ev.logprob, ev.finish_reason, ev.top_logprobs,
                    ev.cached_tokens))  # fmt: skip

        return emit

    def _emit_tokens(self, reqs: List[Request], tokens: List[int], logprobs: List[float], tops: list) -> None:
        """The engine's token sink: a step's sampled tokens as one record of columns."""
        ids = [r.id for r in reqs]
        cached = [r.num_cached_tokens or 0 for r in reqs]
        self.records.append(("tokens", ids, tokens, logprobs, tops if any(tops) else None, cached))

    def _send_step(self) -> None:
        # The queues as this step left them (the engine reports them as the step starts): a client that gets its
        # finish from this message then reads metrics that already count its KV as free.
        sched = self.engine.scheduler
        self.recorder.on_queues(len(sched.waiting), len(sched.running) + len(sched.prefilling), self.runner.kv.usage())
        pauses = self.gc_pauses
        if pauses is not None and pauses.passes != self._gc_passes_sent:  # a few a second at most under load
            self._gc_passes_sent = pauses.passes
            self.recorder.on_gc_pauses(*pauses.snapshot())
        records, calls = self.records, self.recorder.take()
        if not records and not calls:
            return
        out = list(records)
        records.clear()  # the same list: every emitter appends to it
        calls.append(("on_engine_message", (time.perf_counter(),)))  # last: the HTTP side times the hop
        try:
            self.conn.send(("step", out, calls))
        except (EOFError, OSError):  # the HTTP process is gone (its requests with it): stop, as its EOF also says
            self.loop.request_stop()

    def _receive(self) -> None:
        while True:
            try:
                items = self.conn.recv()
            except (EOFError, OSError):  # the HTTP process is gone
                items = [("stop",)]
            for item in items:
                op = item[0]
                if op == "submit":
                    _, rid, ids, params, arrival = item
                    self.engine.submit(Request(rid, ids, params, self._emitter(rid), arrival=arrival))
                elif op == "abort":
                    self.engine.abort(item[1], item[2])
                elif op == "abort_all":
                    self.engine.abort_all()
                elif op == "stop":
                    self.loop.request_stop()
                    return

    def run(self) -> None:
        threading.Thread(target=self._receive, name="lightllm-engine-receive", daemon=True).start()
        self.loop.run()
        # Stopped: whatever is left hears "abort" (after the drain it is only what the drain already aborted).
        self.engine.abort_all()
        try:
            self.engine.step()
        except Exception:
            logger.exception("aborting the requests left at shutdown")
            self.engine.fail_all()
        self._send_step()
        stop = getattr(self.runner, "stop", None)  # tensor parallelism: the workers, then the process group
        if stop is not None:
            stop()


def _engine_main(conn, make_runner, tokenizer_eos, extra_eos, step_times, log_level: int,
                 held_workers: Optional[HeldWorkers] = None) -> None:  # fmt: skip
    """The engine process (``engine_spawn._child_main`` watches its parent and starts ``held_workers`` first)."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl+C, a service's stop: the HTTP process drains, then stops us
        signal.signal(signum, signal.SIG_IGN)
    if make_runner is None:  # held until released; the HTTP side's end (EOF) while we wait: nothing to do
        tp.held_workers = held_workers  # start_tp takes them, or ends them if the checked --tp differs
        # What building the runner imports first (a second: transformers reads the model's config.json), imported
        # while the HTTP process still parses its arguments and loads its tokenizer
        from transformers import AutoConfig  # noqa: F401

        try:
            _, make_runner, tokenizer_eos, extra_eos = conn.recv()
        except (EOFError, OSError):
            return
    logging.basicConfig(level=log_level, format=_LOG_FORMAT)
    lock = threading.Lock()  # a tensor-parallel worker's error comes from the watchdog thread

    def report(message: str) -> None:
        with lock:
            conn.send(("error", message))

    tp.start_error_sink = report
    try:
        runner = make_runner()
    except ValueError as e:  # bad input (ModelLoadError, a size): one line from the HTTP process, no traceback
        report(str(e))
        return
    tp.start_error_sink = None
    if runner.device.type == "cuda":
        # The GPU does the math; this process's own torch ops are bookkeeping-sized (staging, KV tables), where
        # intra-op threads only add a barrier per op (1 ms for a 64 x 512 log_softmax on a busy 2-core host).
        torch.set_num_threads(1)
    # built: what this process serves with is never garbage (the collector's passes would walk it, stopping steps)
    frozen = freeze_startup_heap()
    gc_pauses = GcPauses().install()
    config = {"vocab_size": runner.config.vocab_size, "eos_token_ids": tuple(runner.config.eos_token_ids)}
    conn.send(("ready", {"args": runner.args, "config": config, "model_dir": getattr(runner, "model_dir", None),
                         "gc_frozen": frozen}))  # fmt: skip
    eos = eos_token_ids(runner.config, SimpleNamespace(eos_token_id=tokenizer_eos), extra_eos)
    side = _EngineSide(conn, runner, eos, step_times, gc_pauses)
    side.run()
    try:
        conn.send(("stopped",))
    except (EOFError, OSError):  # the HTTP process is gone: nobody waits for it
        pass
    conn.close()
