"""Tensor-parallel serving: rank 0 runs HTTP and the engine; every state-changing runner call is broadcast to the
workers.

Each rank holds its shard of the weights and of the KV heads and runs the same calls in the same order,
so their allocators stay identical. Commands travel over a gloo group (never the NCCL stream).
"""

import atexit
import contextlib
import datetime
import logging
import os
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightllm.common.gc_heap import freeze_startup_heap
from lightllm.common.net import free_port
from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.runner import STATE_CHANGING
from lightllm.layers.parallel import init_tp
from lightllm.server.engine_spawn import HeldWorkers, RankProgress

logger = logging.getLogger(__name__)
_COMMANDS = STATE_CHANGING
_HEARTBEAT_S = 0.5  # how often a worker marks itself alive
_FROZEN_S = 5.0  # a worker silent this long is stopped (SIGSTOP, a debugger) or frozen
# A worker killed inside a collective fails rank 0's side of it at once (its connection is reset) while its own
# process may still be exiting: rank 0 waits this long for that exit before blaming its own step.
_EXIT_WAIT_S = 5.0
# The command group's collectives: a worker waits in one for rank 0's next command for as long as the server is idle,
# and gloo's default (30 minutes) would end it, and with it the server, after half an hour without a request. A hang
# inside a step is the watchdog's (--tp_step_timeout_s, heartbeats), a dead rank 0 exit_with_parent's.
_COMMAND_TIMEOUT = datetime.timedelta(days=365)
# Where a rank's start-up error (a ValueError building its runner: a malformed checkpoint) goes instead of the log:
# the engine process sets it to its pipe, so the HTTP process prints it as one line.
start_error_sink: Optional[Callable[[str], None]] = None


class Workers:
    """Ranks 1..N-1, one process each, and a watchdog: when one dies the others (rank 0 included) would wait for
    it in their next collective forever, so the whole server exits at once, non-zero, saying which rank died.
    It does the same when a step is still running after ``step_timeout_s``, naming the rank(s) holding it up."""

    def __init__(self, procs, progress: Optional[RankProgress] = None, step_timeout_s: Optional[float] = None,
                 interval_s: float = 0.5, errors=()):  # fmt: skip
        self.procs = list(procs)
        # per worker, the read end of a pipe its start-up error is sent on just before it exits (a pipe, not a
        # multiprocessing queue: a queue's named semaphores outlive a rank 0 that leaves by os._exit, and
        # multiprocessing's resource tracker then warns about them below the server's one error line)
        self.errors = errors
        self.progress = progress
        self.step_timeout_s = step_timeout_s
        self.stopping = False  # set before a clean stop: workers exiting then is expected
        # one report: the watchdog and rank 0's own failure paths may fail at once, and a worker's start-up error is
        # read from its pipe under this lock, so the thread that read it is the one that reports it
        self._fail_lock = threading.RLock()
        self._interval_s = interval_s
        self._sent = 0  # commands broadcast so far
        self._in_flight = None  # (command, its number, start time) while rank 0 runs one
        atexit.register(self._exiting)  # runs before multiprocessing's own hook terminates daemon workers
        threading.Thread(target=self._watch, name="lightllm-tp-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def command(self, name: str):
        """Rank 0 broadcasts and runs one command inside this: the watchdog times it."""
        self._sent += 1
        self._in_flight = (name, self._sent, time.monotonic())
        try:
            yield
        finally:
            self._in_flight = None

    def _watch(self) -> None:
        while not self.stopping:
            self.fail_if_one_exited(0.0)
            in_flight = self._in_flight
            if in_flight and self.step_timeout_s is not None and not self.stopping:
                name, number, t0 = in_flight
                if time.monotonic() - t0 > self.step_timeout_s:
                    self.fail(f"tensor-parallel command '{name}' not finished after --tp_step_timeout_s "
                              f"{self.step_timeout_s:g}: {self._holding_up(number)}")  # fmt: skip
            time.sleep(self._interval_s)

    def fail_if_one_exited(self, wait_s: float) -> None:
        """``fail``, naming the worker (or with its start-up error), when one has exited or exits within ``wait_s``
        and no clean stop has begun; else return."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [p for p in self.procs if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if not dead or self.stopping:  # a clean stop's workers exit as expected
            return
        with self._fail_lock:
            for conn in self.errors:
                with contextlib.suppress(EOFError, OSError):  # EOF: that worker exited without one
                    if conn.poll():  # a start-up error: its own one-line reason
                        self.fail(conn.recv(), start_error=True)
            p = dead[0]
            self.fail(f"tensor-parallel worker {p.name} (pid {p.pid}) exited with code {p.exitcode}; the other "
                      "ranks cannot go on without it")  # fmt: skip

    def _holding_up(self, number: int) -> str:
        """Which rank(s) hold up command ``number``: a worker that did not receive it or is frozen; when every
        worker received it and is alive, each one that has not finished it (a hung kernel or collective)."""
        pr, now = self.progress, time.monotonic()
        unfinished = [r for r in range(1, len(self.procs) + 1) if pr.get(r, pr.FINISHED) < number]
        if not unfinished:
            return "rank 0 (every other rank finished it)"
        why = {}
        for r in unfinished:
            silent = now - pr.get(r, pr.BEAT)
            reasons = [f"no heartbeat for {silent:.1f}s: stopped or frozen"] if silent > _FROZEN_S else []
            if pr.get(r, pr.RECEIVED) < number:
                reasons.append("never received it")
            why[r] = reasons
        culprits = [r for r in unfinished if why[r]]
        if culprits:
            return "; ".join(f"rank {r} ({', '.join(why[r])})" for r in culprits)
        # every worker is alive inside the step: one of them or rank 0 hangs in a kernel while the rest wait for it
        # in a collective, and from here the two look the same
        ranks = ", ".join(str(r) for r in unfinished)
        return f"ranks {ranks} are alive inside the step: a kernel or collective hangs on rank 0 or one of them"

    def fail(self, why: str, start_error: bool = False) -> None:
        """The ranks can no longer run in step: end every one of them and this process, saying why. A rank's
        ``start_error`` goes to ``start_error_sink`` when one is set (the server's one error line), else to the log."""
        self._fail_lock.acquire()  # never released: this process exits below
        sink = start_error_sink if start_error else None
        if sink is not None:
            sink(why)
        else:
            logger.error("%s, so the server exits", why)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        logging.shutdown()
        os._exit(1)

    def _exiting(self) -> None:
        self.stopping = True

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the workers to stop; one still running then is killed. A worker without a
        heartbeat for ``_FROZEN_S`` (stopped by SIGSTOP, or frozen) is not waited for: it would hold the stop to the
        end of ``timeout`` (the HTTP side's own limit)."""
        deadline = time.monotonic() + timeout
        for rank, proc in enumerate(self.procs, start=1):
            while proc.is_alive() and time.monotonic() < deadline and not self._frozen(rank):
                proc.join(0.1)
            if not proc.is_alive():
                continue
            why = "has no heartbeat" if self._frozen(rank) else f"did not stop in {timeout:g}s"
            logger.warning("tensor-parallel worker %s %s; killing it", proc.name, why)
            proc.kill()  # a server's workers ignore SIGTERM (engine_spawn: the HTTP process drains on it)
            proc.join(5)

    def _frozen(self, rank: int) -> bool:
        """No heartbeat from ``rank`` for ``_FROZEN_S`` (it beats from the start, loading included)."""
        if self.progress is None:
            return False
        beat = self.progress.get(rank, self.progress.BEAT)
        return beat > 0 and time.monotonic() - beat > _FROZEN_S


class TPRunner:
    """Rank 0's runner (``engine.runner.Runner``): the state-changing calls go to the workers first, then run here;
    the read-only ones are answered by rank 0's runner. Nothing else is forwarded, so a new state-changing call
    cannot reach rank 0 alone and put the ranks out of step."""

    def __init__(self, runner: ModelRunner, group, workers: Workers):
        self.runner = runner
        self.group = group
        self.workers = workers
        self._stopped = False
        self._mtp = TPMTPSteps(self) if runner.mtp is not None else None

    @property
    def args(self):
        return self.runner.args

    @property
    def config(self):
        return self.runner.config

    @property
    def device(self):
        return self.runner.device

    @property
    def model_dir(self) -> str:
        return self.runner.model_dir

    @property
    def mtp(self) -> Optional["TPMTPSteps"]:
        """With --mtp_mode: the MTP steps, broadcast as the runner's own state-changing calls are."""
        return self._mtp

    @property
    def kv(self):
        """Rank 0's KV cache, for the policy's questions; it changes only through the broadcast calls."""
        return self.runner.kv

    def set_launch_hook(self, hook) -> None:
        """Rank 0's own launches (after the command's broadcast): ``ModelRunner.set_launch_hook``."""
        self.runner.set_launch_hook(hook)

    def _cast(self, *cmd) -> None:
        try:
            dist.broadcast_object_list([cmd], src=0, group=self.group)
        except Exception:  # a worker gone before the watchdog saw it: name it, not the broken connection
            self.workers.fail_if_one_exited(_EXIT_WAIT_S)
            raise

    def prefill(self, slots, prompts, publish=(), following=()):
        args = (list(slots), [list(p) for p in prompts], list(publish), list(following))
        return self._step("prefill", self.runner.prefill, args)

    def decode(self, slots, last_tokens):
        return self._step("decode", self.runner.decode, (list(slots), list(last_tokens)))

    def decode_ahead(self, slots, rows, drawn):
        # the draws are rank 0's alone (it samples): the workers receive them on the device, inside the step
        return self._step("decode_ahead", self.runner.decode_ahead, (list(slots), list(rows)), drawn)

    def inputs_known(self, slots, tokens):
        return self._step("inputs_known", self.runner.inputs_known, (list(slots), list(tokens)))

    def _step(self, name: str, step, args: tuple, *rank0_only):
        """Broadcast ``name`` with ``args``, then run ``step(*args, *rank0_only)`` here."""
        with self.workers.command(name):
            self._cast(name, *args)
            return self._run(step, *args, *rank0_only)

    def _run(self, step, *args):
        """Rank 0's half of a step the workers have started: if it fails, they are left inside its collectives
        and their KV bookkeeping has moved on without ours, so no later step can be right."""
        try:
            return step(*args)
        except Exception as e:
            # a worker that died inside the step fails it here first (a collective's lost connection): name it
            self.workers.fail_if_one_exited(_EXIT_WAIT_S)
            logger.exception("tensor-parallel rank 0: %s failed", step.__name__)
            self.workers.fail(f"rank 0's {step.__name__} step failed after the workers started it ({e})")

    def add_request(self, prefix=()) -> int:
        with self.workers.command("add_request"):
            self._cast("add_request", list(prefix))
            return self.runner.add_request(prefix)

    def free(self, slot: int, last_token=None) -> None:
        with self.workers.command("free"):
            self._cast("free", slot, last_token)
            self.runner.free(slot, last_token)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the workers and wait for them, then leave the process group: rank 0 hosts the store the
        workers tear down against, so it must outlive them. Idempotent; the engine loop must be stopped first."""
        if self._stopped:
            return
        self._stopped = True
        self.workers.stopping = True
        self._cast("stop")
        self.workers.join(timeout)
        dist.destroy_process_group()
        logger.info("tensor-parallel workers stopped (%d ranks)", len(self.workers.procs) + 1)


class TPMTPSteps:
    """Rank 0's MTP steps (``engine.runner.MTPSteps``): each is broadcast to the workers, which run it with rank 0's
    arguments. Only rank 0 picks the draft tokens and decides acceptance: ``draft`` broadcasts each pick inside the
    step (``MTPRunner._pick``) and ``accept`` carries rank 0's counts, so every rank keeps the same KV, state slots
    and head entries."""

    def __init__(self, tp: TPRunner):
        self._tp, self._mtp = tp, tp.runner.mtp

    @property
    def step(self) -> int:
        return self._mtp.step

    def draft(self, slots, last_tokens, choose):
        return self._tp._step("mtp.draft", self._mtp.draft, (list(slots), list(last_tokens)), choose)

    def verify(self, slots, last_tokens, drafts=None):
        # this step's drafts (None or draft's tensor) are on every rank's device already: only host lists travel
        args = (list(slots), list(last_tokens))
        if drafts is not None and not isinstance(drafts, torch.Tensor):
            args += ([list(d) for d in drafts],)
        return self._tp._step("mtp.verify", self._mtp.verify, args)

    def accept(self, slots, accepted):
        return self._tp._step("mtp.accept", self._mtp.accept, (list(slots), list(accepted)))


def _command_target(runner: ModelRunner, name: str):
    """The call a command names: ``runner.<name>``, or ``runner.mtp.<step>`` for ``mtp.<step>``."""
    if name.startswith("mtp."):
        return getattr(runner.mtp, name[len("mtp.") :])
    return getattr(runner, name)


def worker_loop(runner: ModelRunner, group, progress: Optional[RankProgress] = None, rank: int = 0) -> None:
    """Run rank 0's commands until it says stop, counting them in ``progress``."""
    done = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        name, *args = box[0]
        if name == "stop":
            return
        if name not in _COMMANDS:
            raise RuntimeError(f"tensor-parallel worker: unknown command {name!r}")
        if progress is not None:
            progress.set(rank, progress.RECEIVED, done + 1)
        _command_target(runner, name)(*args)
        done += 1
        if progress is not None:
            progress.set(rank, progress.FINISHED, done)


def _for_rank(args: EngineArgs, rank: int) -> EngineArgs:
    args = EngineArgs(**vars(args))
    if args.device.startswith("cuda"):
        args.device = f"cuda:{rank}"
    return args


def _parent_gone(parent: int, wait_s: float) -> bool:
    """Whether ``parent`` (rank 0 as it spawned us) has exited, or exits within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _heartbeat(progress: RankProgress, rank: int) -> None:
    """Marks this process alive every _HEARTBEAT_S from a thread of its own: it stops only when the whole process
    does (SIGSTOP, a debugger), not when the main thread waits in a collective."""

    def beat():
        while True:
            progress.set(rank, progress.BEAT, time.monotonic())
            time.sleep(_HEARTBEAT_S)

    threading.Thread(target=beat, name="lightllm-tp-heartbeat", daemon=True).start()


def _worker(rank: int, world: int, parent: int, progress: RankProgress, errors, inbox) -> None:
    """A worker (``HeldWorkers``; its entry, ``engine_spawn._worker_main``, watches its parent already): it imports
    what building its runner needs, then waits for ``(init_method, args)``, or for its inbox's end (dismissed: it
    exits quietly)."""
    _heartbeat(progress, rank)
    from transformers import AutoConfig  # noqa: F401  (ModelRunner reads the config through it first)

    try:
        init_method, args = inbox.recv()
    except (EOFError, OSError):
        return
    inbox.close()
    _serve_rank(rank, world, init_method, args, parent, progress, errors)


def _serve_rank(rank: int, world: int, init_method: str, args: EngineArgs, parent: int, progress: RankProgress,
                errors) -> None:  # fmt: skip
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    args = _for_rank(args, rank)
    init_tp(rank, world, init_method, torch.device(args.device))
    group = dist.new_group(backend="gloo", timeout=_COMMAND_TIMEOUT)
    try:
        runner = ModelRunner(args)
    except ValueError as e:  # bad input (a malformed checkpoint): rank 0's watchdog reports it, no traceback here
        errors.send(f"tensor-parallel rank {rank}: {e}")
        os._exit(1)
    # a collector pass over the model's objects here would hold every rank's step (lightllm/common/gc_heap.py)
    freeze_startup_heap()
    try:
        worker_loop(runner, group, progress, rank)
    except Exception:
        # rank 0 gone (killed, crashed): the collective this waited in fails with a reset connection, but the server
        # has reported the engine process's end already; a traceback from here would only add a misleading one
        if _parent_gone(parent, _EXIT_WAIT_S):
            os._exit(1)
        raise
    dist.destroy_process_group()


# The workers a held engine process started for the command line's ``--tp`` (``engine_spawn.HeldWorkers``), set by
# ``engine_proc`` while it waits for its release, until ``start_tp`` takes them.
held_workers: Optional[HeldWorkers] = None


def rendezvous_address(port: Optional[int] = None) -> str:
    """Where the ranks meet (torch.distributed's init_method): ``port`` (--nccl_port), else a free one."""
    return f"tcp://127.0.0.1:{port if port is not None else free_port()}"


def _start_workers(tp: int, init_method: str, args: EngineArgs) -> tuple:
    """Ranks 1..tp-1 given their start: the ``held_workers`` when they are of this world size and all alive, else
    workers started now. ``(HeldWorkers, how they were started)``."""
    global held_workers
    held, held_workers = held_workers, None
    if held is not None:
        if held.world == tp and held.release(init_method, args):
            return held, "started while the server read its arguments"
        held.dismiss()
    fresh = HeldWorkers(tp)
    fresh.release(init_method, args)  # one that died already is the watchdog's to report, as any exited worker
    return fresh, "started"


def start_tp(args: EngineArgs, tp: int, step_timeout_s: Optional[float] = None, port: Optional[int] = None) -> TPRunner:
    """Start ranks 1..tp-1 (or release the ``held_workers``), join as rank 0 and build every rank's runner (start-up
    runs in lockstep). ``port``: the ranks' rendezvous port (``--nccl_port``), default a free one."""
    if not args.model_dir:  # resolve (and build, once) the built-in model here, not in every rank
        from lightllm.tools.make_tiny_model import default_model_dir

        args = EngineArgs(**{**vars(args), "model_dir": str(default_model_dir())})
    init_method = rendezvous_address(port)
    logger.info("tensor-parallel rendezvous at %s", init_method)
    workers, how = _start_workers(tp, init_method, args)
    procs, progress, errors = workers.procs, workers.progress, workers.errors
    logger.info("tensor-parallel workers %s: %s", how, ", ".join(f"{p.name} pid {p.pid}" for p in procs))
    # Watched from here on: a rank dying at start-up must not hang rank 0 either. Start-up itself (loading,
    # compiles, tuning, graph capture) is not timed: only the commands of serving are.
    workers = Workers(procs, progress, step_timeout_s, errors=errors)
    args = _for_rank(args, 0)
    import torch

    try:  # rank 0 hosts the rendezvous: it listens on the port
        init_tp(0, tp, init_method, torch.device(args.device))
    except dist.DistNetworkError as e:  # the port is taken by another process: bad input, one line
        flag = f"--nccl_port {port}" if port is not None else "tensor-parallel rendezvous"
        raise ValueError(f"{flag}: the ranks cannot meet at {init_method} ({e}); pass a free --nccl_port") from None
    group = dist.new_group(backend="gloo", timeout=_COMMAND_TIMEOUT)
    try:
        runner = ModelRunner(args)
    except ValueError:  # bad input rank 0 found itself (a malformed checkpoint): its own line, at once
        raise
    except Exception:  # a worker that failed or died while building its own runner fails our collectives: name it
        workers.fail_if_one_exited(_EXIT_WAIT_S)
        raise
    return TPRunner(runner, group, workers)
