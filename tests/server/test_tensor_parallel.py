"""--tp 2 and 4 on the CPU (gloo): the sharded server generates what one process does, and shuts down cleanly."""

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import re
import threading
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import REPO, assert_generates_like, running_server, spawned_children, start_server

from lightllm import LLM, SamplingParams
from lightllm.common import proc as procs
from lightllm.tools.make_tiny_model import make_tiny_qwen3


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_one_process(tmp_path, tp):
    """In float32 only: in bf16 the all-reduce sums the ranks' partials in another order than one process does,
    and the rounding flips near-tied greedy tokens (docs/server.md, "Tensor parallelism")."""
    heads = 2 * tp  # every rank gets 1 KV head and 2 query heads
    model = str(make_tiny_qwen3(tmp_path / "model", num_attention_heads=heads, num_key_value_heads=tp, seed=4))
    args = ["--model_dir", model, "--tp", str(tp), "--data_type", "fp32", "--device", "cpu", "--batch_max_tokens", "64",
            "--max_req_total_len", "128", "--running_max_req_size", "4"]  # fmt: skip
    prompts = [[5, 6, 7, 8, 9], [11, 3], list(range(30, 50))]
    ref = LLM(model, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=128).generate(
        prompts, SamplingParams(max_new_tokens=8, logprobs=True, ignore_eos=True)
    )
    with running_server(tmp_path, args) as base:
        assert_generates_like(base, prompts, ref)
        # parameters that once crashed rank 0's sampling step: greedy / every token, beside a request that must
        # still get the one-process tokens (the ranks stayed in step)
        extreme = {"inputs": prompts[1], "parameters": {"max_new_tokens": 8, "temperature": 1e-40, "top_k": 2**63,
                                                        "ignore_eos": True}}  # fmt: skip
        neighbour = {"inputs": prompts[0], "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            done = list(
                pool.map(
                    lambda b: httpx.post(base + "/generate", json=b, timeout=procs.HANG_TIMEOUT_S).json(),
                    [extreme, neighbour],
                )
            )
        assert [d["token_ids"] for d in done] == [ref[1].token_ids, ref[0].token_ids]
        assert httpx.get(base + "/health").status_code == 200
    # SIGTERM: rank 0 stops the workers and waits for them, so no rank dies on a closed connection
    (log,) = tmp_path.glob("server-*.log")
    text = log.read_text()
    assert f"tensor-parallel workers stopped ({tp} ranks)" in text
    # started by the held engine process from the command line's --tp, before the flags were parsed
    assert "tensor-parallel workers started while the server read its arguments" in text
    assert f"autotune: all {tp} ranks hold identical configs" in text
    assert "Traceback" not in text


def test_tp_must_divide_heads(tmp_path):
    from lightllm.models.registry import read_model_config

    model = make_tiny_qwen3(tmp_path / "m", num_attention_heads=4, num_key_value_heads=2)
    family, cfg = read_model_config(model)
    family.check_tp(cfg, 2)
    with pytest.raises(ValueError, match="--tp 4: the model's num_key_value_heads \\(2\\) is not divisible"):
        family.check_tp(cfg, 4)


def _start_tp2(tmp_path, *extra):
    """A --tp 2 CPU server up and answering; returns (process, log path, rank 1's pid, base URL)."""
    model = str(make_tiny_qwen3(tmp_path / "model", num_attention_heads=4, num_key_value_heads=2))
    args = ["--model_dir", model, "--tp", "2", "--device", "cpu", "--data_type", "fp32", "--batch_max_tokens", "64",
            "--max_req_total_len", "128", *extra]  # fmt: skip
    proc, base, log_path = start_server(tmp_path, args)
    return proc, log_path, int(re.search(r"lightllm-tp1 pid (\d+)", log_path.read_text()).group(1)), base


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet (a container's init may not reap)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_a_dead_worker_ends_the_server_instead_of_hanging_it(tmp_path):
    """SIGKILL rank 1 (as the OOM killer would): rank 0 must not wait for it in the next step forever."""
    proc, log_path, pid, _ = _start_tp2(tmp_path)
    try:
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=procs.HANG_TIMEOUT_S) == 1
    finally:
        procs.stop(proc)
    assert f"tensor-parallel worker lightllm-tp1 (pid {pid}) exited with code -9" in log_path.read_text()


def test_a_dead_rank_0_ends_the_server_with_its_line_alone(tmp_path):
    """SIGKILL the engine process (rank 0): the server says so in one line, and rank 1, whose collective then fails
    on a reset connection, exits without a traceback (it would only name that connection)."""
    proc, log_path, pid, _ = _start_tp2(tmp_path)
    try:
        with open(f"/proc/{pid}/stat") as f:
            engine = int(f.read().rsplit(")", 1)[1].split()[1])  # rank 1's parent: rank 0, the engine process
        os.kill(engine, signal.SIGKILL)
        assert proc.wait(timeout=procs.HANG_TIMEOUT_S) == 1
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S
        while not _gone(pid):  # rank 1 writes to the same log until it exits
            assert time.monotonic() < deadline, "rank 1 outlived rank 0"
            time.sleep(0.05)
    finally:
        procs.stop(proc)
    text = log_path.read_text()
    assert "engine process exited with code -9; 0 request(s) in flight end with finish_reason error" in text
    assert "Traceback" not in text and "Connection reset" not in text, text[-3000:]


def _session(sid: int) -> list:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out


def test_a_failing_test_leaves_no_server_process_behind(tmp_path):
    """An exception inside running_server: the server, its engine process (rank 0), rank 0's worker and every
    other process of the server's session are gone when the block is left."""
    model = str(make_tiny_qwen3(tmp_path / "model", num_attention_heads=4, num_key_value_heads=2))
    args = ["--model_dir", model, "--tp", "2", "--device", "cpu", "--data_type", "fp32", "--batch_max_tokens", "64",
            "--max_req_total_len", "128"]  # fmt: skip
    with pytest.raises(RuntimeError, match="the test failed"):
        with running_server(tmp_path, args):
            (log,) = tmp_path.glob("server-*.log")
            rank1 = int(re.search(r"lightllm-tp1 pid (\d+)", log.read_text()).group(1))
            with open(f"/proc/{rank1}/stat") as f:
                engine = int(f.read().rsplit(")", 1)[1].split()[1])  # rank 1's parent: rank 0, the engine process
            with open(f"/proc/{engine}/stat") as f:
                server = int(f.read().rsplit(")", 1)[1].split()[1])  # the engine process's: the HTTP server
            assert len(_session(server)) >= 3 and {rank1, engine} <= set(_session(server))
            raise RuntimeError("the test failed")
    assert _gone(rank1) and _gone(engine) and _gone(server) and _session(server) == []


_ORPHAN = """
import multiprocessing as mp, os, time
from lightllm.server.engine_spawn import exit_with_parent

def child(parent):
    exit_with_parent(parent, interval_s=0.1)
    time.sleep(600)  # stands for a collective waiting on a rank that is gone

if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child, args=(os.getpid(),), daemon=True)
    p.start()
    print(p.pid, flush=True)
    time.sleep(600)
"""


def test_a_worker_does_not_outlive_rank_0(tmp_path):
    """SIGKILL rank 0 while a worker waits on it: the worker exits instead of holding its device forever."""
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    parent = procs.start([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": REPO},
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child)
        # maybe before the child has even started watching: it must exit all the same
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        # the child polls every 0.1 s; only a worker that never exits waits this long
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(child), "the worker outlived rank 0"
    finally:
        procs.stop(parent)  # its group: the worker, if it is still there


def test_a_failed_rank_0_step_ends_every_rank():
    """After the workers started a step, rank 0 failing leaves them inside its collectives: the server must end,
    not serve on with ranks out of step."""
    from lightllm.server.tp import TPRunner

    class FakeRunner:
        mtp = None  # no --mtp_mode

        def decode(self, slots, tokens):
            raise RuntimeError("CUDA error: an illegal memory access")

    class FakeWorkers:
        def command(self, name):
            return contextlib.nullcontext()

        def fail_if_one_exited(self, wait_s):
            pass  # every worker runs

        def fail(self, why):
            raise SystemExit(why)

    runner = TPRunner(FakeRunner(), group=None, workers=FakeWorkers())
    cast = []
    runner._cast = lambda *cmd: cast.append(cmd)
    with pytest.raises(SystemExit, match="rank 0's decode step failed after the workers started it .*illegal"):
        runner.decode([0], [5])
    assert cast == [("decode", [0], [5])]


def test_a_worker_dying_inside_a_step_is_named_not_rank_0s_step(monkeypatch):
    """SIGKILL rank 1 inside a decode: rank 0's side of the step's collective fails at once (connection reset),
    before the watchdog looks. The line must name the dead worker, as it does when the watchdog sees it first."""
    from lightllm.server import tp

    class Dead:
        name, pid, exitcode = "lightllm-tp1", 1234, -9

        def is_alive(self):
            return False

    class FakeRunner:
        mtp = None

        def decode(self, slots, tokens):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(tp.os, "_exit", exit_)
    logged = []
    monkeypatch.setattr(tp.logger, "error", lambda msg, *a: logged.append(msg % a))
    monkeypatch.setattr(tp.logger, "exception", lambda msg, *a: logged.append("traceback: " + msg % a))
    workers = tp.Workers([], interval_s=3600)  # its own watchdog sees no worker, then sleeps
    workers.procs = [Dead()]
    runner = tp.TPRunner(FakeRunner(), group=None, workers=workers)
    runner._cast = lambda *cmd: None
    with pytest.raises(Exited):
        runner.decode([0], [5])
    assert logged == ["tensor-parallel worker lightllm-tp1 (pid 1234) exited with code -9; the other ranks cannot go "
                      "on without it, so the server exits"]  # fmt: skip


def test_a_worker_killed_while_streaming_is_named(tmp_path):
    """The same with real processes: rank 1 killed while three requests decode."""
    proc, log_path, pid, base = _start_tp2(tmp_path, "--max_req_total_len", "1024")
    received = [[], [], []]  # each stream's events

    def stream(i):
        body = {"inputs": [5, 6, 7 + i], "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}
        with contextlib.suppress(httpx.HTTPError):
            with httpx.stream("POST", base + "/generate_stream", json=body, timeout=procs.HANG_TIMEOUT_S) as r:
                for line in r.iter_lines():
                    if line:
                        received[i].append(line)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S
        while min(map(len, received)) < 4:  # all three decode
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=procs.HANG_TIMEOUT_S) == 1
        for t in threads:
            t.join(procs.HANG_TIMEOUT_S)
    finally:
        procs.stop(proc)
    text = log_path.read_text()
    assert f"tensor-parallel worker lightllm-tp1 (pid {pid}) exited with code -9" in text, text[-3000:]
    assert "Traceback" not in text and "Connection reset" not in text, text[-3000:]
    assert all('"finish_reason": "error"' in events[-1] for events in received), [e[-1:] for e in received]


def test_a_stopped_worker_turns_health_503_and_then_ends_the_server_naming_it(tmp_path):
    """SIGSTOP rank 1: rank 0 waits for it inside the step's collective. /health must say so (503), and past
    --tp_step_timeout_s the server must end, naming rank 1, as it does for a dead rank."""
    proc, log_path, pid, base = _start_tp2(tmp_path, "--health_step_timeout_s", "0.5", "--tp_step_timeout_s", "8")
    try:
        os.kill(pid, signal.SIGSTOP)
        body = {"inputs": [5, 6, 7], "parameters": {"max_new_tokens": 4}}

        def send():
            with contextlib.suppress(httpx.HTTPError):  # the server ends while this waits
                httpx.post(base + "/generate", json=body, timeout=procs.HANG_TIMEOUT_S)

        threading.Thread(target=send, daemon=True).start()
        statuses, deadline = [], time.monotonic() + procs.HANG_TIMEOUT_S  # the old server: healthy forever
        while proc.poll() is None and 503 not in statuses and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                statuses.append(httpx.get(base + "/health", timeout=5).status_code)
            time.sleep(0.1)
        assert 503 in statuses, "the server ended before /health reported the stuck step"
        assert proc.wait(timeout=procs.HANG_TIMEOUT_S) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        procs.stop(proc)  # its session: rank 1 too
    text = log_path.read_text()
    assert re.search(
        r"tensor-parallel command '\w+' not finished after --tp_step_timeout_s 8: rank 1 \(no heartbeat "
        r"for [\d.]+s: stopped or frozen, never received it\), so the server exits",
        text,
    ), text[-3000:]


def test_the_rank_holding_up_a_step_is_named_not_the_ones_waiting_for_it():
    """tp 4, rank 2 frozen before receiving step 7: ranks 1 and 3 wait for it in the collective, alive."""
    from lightllm.server.tp import RankProgress, Workers

    class Alive:
        def is_alive(self):
            return True

    progress = RankProgress(multiprocessing.get_context("spawn"), 4)
    now = time.monotonic()
    for rank, received, beat in ((1, 7, now), (2, 6, now - 60), (3, 7, now)):
        progress.set(rank, progress.RECEIVED, received)
        progress.set(rank, progress.FINISHED, 6)
        progress.set(rank, progress.BEAT, beat)
    workers = Workers([Alive(), Alive(), Alive()], progress)
    workers.stopping = True  # no watchdog: this test only asks whom it would name
    assert re.fullmatch(r"rank 2 \(no heartbeat for 6\d\.\ds: stopped or frozen, never received it\)",
                        workers._holding_up(7))  # fmt: skip
    progress.set(2, progress.RECEIVED, 7)
    progress.set(2, progress.BEAT, now)  # every worker alive inside the step: rank 0 is as suspect as they are
    assert workers._holding_up(7) == (
        "ranks 1, 2, 3 are alive inside the step: a kernel or collective hangs on rank 0 or one of them"
    )
    for rank in (1, 2, 3):
        progress.set(rank, progress.FINISHED, 7)
    assert workers._holding_up(7) == "rank 0 (every other rank finished it)"


def test_a_workers_start_up_error_is_reported_not_logged(monkeypatch, caplog):
    """A worker's ValueError building its runner (a malformed checkpoint) reaches the engine process's pipe as its
    own message, not as "worker exited with code 1" with a traceback above it."""
    from lightllm.server import tp

    class Dead:
        name, pid, exitcode = "lightllm-tp1", 1234, 1

        def is_alive(self):
            return False

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    sent = []
    monkeypatch.setattr(tp, "start_error_sink", sent.append)
    monkeypatch.setattr(tp.os, "_exit", exit_)
    error_in, error_out = multiprocessing.get_context("spawn").Pipe(duplex=False)
    error_out.send("tensor-parallel rank 1: m/model.safetensors: tensor model.norm.weight has dtype F64")
    workers = tp.Workers([], errors=[error_in], interval_s=3600)  # its own watchdog sees no worker, then sleeps
    workers.procs = [Dead()]
    with pytest.raises(Exited):
        workers._watch()
    assert sent == ["tensor-parallel rank 1: m/model.safetensors: tensor model.norm.weight has dtype F64"]
    error_out.close()  # a worker killed at start-up sends nothing: its pipe is at its end
    with caplog.at_level(logging.ERROR, logger="lightllm.server.tp"), pytest.raises(Exited):
        workers.fail_if_one_exited(0.0)
    assert len(sent) == 1 and caplog.messages == [
        "tensor-parallel worker lightllm-tp1 (pid 1234) exited with code 1; the other ranks cannot go on without it, "
        "so the server exits"
    ]


def _run_script(tmp_path, source: str, argument) -> tuple:
    """``source`` run as a script with ``argument`` (a model folder) to its end, its process tree stopped if it hangs:
    (exit code, stdout + stderr)."""
    script = tmp_path / "script.py"
    script.write_text(source)
    done = procs.run([sys.executable, str(script), str(argument)], timeout=procs.HANG_TIMEOUT_S,
                     env={**os.environ, "PYTHONPATH": REPO})  # fmt: skip
    return done.returncode, done.stdout + done.stderr


_RANK_1_FAILS = """
import sys, time
from lightllm.engine.args import EngineArgs
from lightllm.server import tp


def refuse(args):
    raise ValueError("model.safetensors: tensor model.norm.weight has dtype F64")


if __name__ == "__mp_main__":  # rank 1 (spawned): a malformed checkpoint
    tp.ModelRunner = refuse
if __name__ == "__main__":  # rank 0 is still loading when rank 1 gives up
    tp.ModelRunner = lambda args: time.sleep(600)
    tp.start_tp(EngineArgs(model_dir=sys.argv[1], device="cpu"), 2)
"""


def test_a_workers_start_up_error_is_the_only_output(tmp_path):
    """Rank 0 leaves by os._exit once the watchdog has a worker's start-up error: nothing it leaves behind may add
    lines below the server's one error line (a multiprocessing queue's semaphores did: resource_tracker warned of
    leaked semaphore objects)."""
    # read to the end: the resource tracker, rank 0's child, writes to the same stderr as it exits
    code, out = _run_script(tmp_path, _RANK_1_FAILS, make_tiny_qwen3(tmp_path / "model"))
    assert code == 1, out
    assert "tensor-parallel rank 1: model.safetensors: tensor model.norm.weight has dtype F64" in out, out
    assert "leaked" not in out and "Traceback" not in out, out


_RANK_1_CRASHES = """
import sys
import torch.distributed as dist
from lightllm.engine.args import EngineArgs
from lightllm.server import tp


def crash(args):
    raise RuntimeError("rank 1 ran out of memory")


if __name__ == "__mp_main__":  # rank 1 (spawned): fails building its runner
    tp.ModelRunner = crash
if __name__ == "__main__":  # rank 0 builds its own in step, inside a collective that rank 1's exit then breaks
    tp.ModelRunner = lambda args: dist.barrier()
    tp.start_tp(EngineArgs(model_dir=sys.argv[1], device="cpu"), 2)
"""


def test_a_worker_crashing_at_start_up_is_named_not_rank_0s_collective(tmp_path):
    """A worker's runner fails to build (not bad input: out of memory, a bug): rank 0's own build fails in its next
    collective on the closed connection; the line must name the worker, whose own error is above it."""
    code, out = _run_script(tmp_path, _RANK_1_CRASHES, make_tiny_qwen3(tmp_path / "model"))
    assert code == 1, out
    assert "RuntimeError: rank 1 ran out of memory" in out, out
    assert re.search(r"tensor-parallel worker lightllm-tp1 \(pid \d+\) exited with code 1; the other ranks", out), out
    assert "Connection closed" not in out and "Connection reset" not in out, out


_IDLE = """
import datetime, sys, time
from types import SimpleNamespace
import torch.distributed.distributed_c10d as c10d
from lightllm.engine.args import EngineArgs
from lightllm.server import tp

real_init = tp.init_tp


def init_then_short_default(*args):  # the default timeout of the groups made after the rendezvous: 2 s, not 30 min
    real_init(*args)
    c10d.default_pg_timeout = datetime.timedelta(seconds=2)


tp.init_tp = init_then_short_default
tp.ModelRunner = lambda args: SimpleNamespace(mtp=None)
if __name__ == "__main__":
    runner = tp.start_tp(EngineArgs(model_dir=sys.argv[1], device="cpu"), 2)
    time.sleep(4)  # idle: no command, the worker waits for the next one
    runner.stop()
    print("worker exit code", runner.workers.procs[0].exitcode)
"""


def test_an_idle_server_keeps_its_workers_past_the_groups_default_timeout(tmp_path):
    """Idle, a worker waits for rank 0's next command in a gloo collective: the group's default timeout (30 minutes,
    2 s here) must not end it, and with it the server, after that long without a request."""
    code, out = _run_script(tmp_path, _IDLE, tmp_path)
    assert code == 0, out
    assert "worker exit code 0" in out and "Traceback" not in out, out


_HELD = """
import sys
from types import SimpleNamespace
from lightllm.engine.args import EngineArgs
from lightllm.server import tp

tp.ModelRunner = lambda args: SimpleNamespace(mtp=None, args=args)  # every rank: no model, the start-up protocol only
if __name__ == "__main__":
    held = tp.HeldWorkers({world})
    tp.held_workers = held
    if {state!r} == "dead":  # a worker gone before the release (its imports failed): its pipe is closed
        held.procs[0].kill()
        held.procs[0].join()
    runner = tp.start_tp(EngineArgs(model_dir=sys.argv[1], device="cpu"), 2)
    print("taken", [p.pid for p in runner.workers.procs] == [p.pid for p in held.procs])
    print("held ended", [p.exitcode is not None for p in held.procs])
    print("left", tp.held_workers)
    runner.stop()
    print("worker exit codes", [p.exitcode for p in runner.workers.procs])
"""


@pytest.mark.parametrize("held_world, state", [(2, "alive"), (3, "alive"), (2, "dead")])
def test_start_tp_takes_the_held_workers_of_its_world_size_and_dismisses_others(tmp_path, held_world, state):
    """Workers a held engine process started from the command line's --tp: ``start_tp`` releases them when their
    world size is its own and all are alive, and runs with them; otherwise it ends them and starts its own."""
    code, out = _run_script(tmp_path, _HELD.format(world=held_world, state=state), make_tiny_qwen3(tmp_path / "m"))
    assert code == 0 and "Traceback" not in out, out
    taken = held_world == 2 and state == "alive"
    assert f"taken {taken}" in out, out
    assert f"held ended {[not taken] * (held_world - 1)}" in out, out
    assert "left None" in out and "worker exit codes [0]" in out, out


def test_the_command_lines_tp_is_read_before_the_flags_are_parsed():
    """``api_server`` reads --tp off the command line before its parser (which imports torch) to start the workers
    early: a hint, so anything unreadable or out of [2, 64] is 1 (no early workers) and the parser reports it."""
    from lightllm.server.api_server import _early_tp

    argvs = (["--tp", "2"], ["--tp=4"], ["--port", "9", "--tp", "2", "--tp", "3"], ["--tp", "64"], [], ["--tp"],
             ["--tp", "x"], ["--tp", "1"], ["--tp", "-2"], ["--tp", "65"], ["--tp_step_timeout_s", "8"])  # fmt: skip
    assert [_early_tp(argv) for argv in argvs] == [2, 4, 3, 64, 1, 1, 1, 1, 1, 1, 1]


def test_a_held_engine_never_released_leaves_no_worker_behind():
    """The server command's engine process starts its --tp workers while it is held; when the HTTP side fails before
    the release (a bad flag) and stops it, the workers end too instead of waiting for a start that never comes."""
    from lightllm.server.engine_spawn import spawn_engine

    spawned = spawn_engine(tp=3)
    workers = []
    try:
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S
        while len(workers) < 2 and time.monotonic() < deadline:  # the engine process's children, once it started them
            time.sleep(0.1)
            workers = spawned_children(spawned.process.pid)
        assert len(workers) == 2, workers
        spawned.stop()
        while not all(_gone(w) for w in workers) and time.monotonic() < deadline:  # each watches its parent
            time.sleep(0.1)
        assert all(_gone(w) for w in workers), "a held worker outlived its engine process"
    finally:  # whatever failed above: nothing of it stays behind
        if spawned.process.is_alive():
            spawned.stop()
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w, signal.SIGKILL)


def test_a_request_failing_alone_keeps_the_ranks_in_step(tmp_path, monkeypatch):
    """Rank 0 samples. A request whose own draw fails ends there, and its slot is freed through the same
    broadcast as any finish: a worker replaying rank 0's commands ends with rank 0's KV bookkeeping."""
    import lightllm.engine.engine as engine_module
    from lightllm.engine.args import EngineArgs
    from lightllm.engine.model_runner import ModelRunner
    from lightllm.engine.engine import Engine
    from lightllm.engine.request import Request
    from lightllm.server.tp import TPRunner

    model = str(make_tiny_qwen3(tmp_path / "model", seed=4))
    args = dict(model_dir=model, data_type="fp32", device="cpu", batch_max_tokens=64, max_req_total_len=32,
                running_max_req_size=4, max_total_token_num=256)  # fmt: skip

    class Workers:  # no processes: the test replays rank 0's broadcast commands on a second runner itself
        def command(self, name):
            return contextlib.nullcontext()

    rank0 = TPRunner(ModelRunner(EngineArgs(**args)), group=None, workers=Workers())
    worker, commands, drawn = ModelRunner(EngineArgs(**args)), [], []
    rank0._cast = lambda *cmd: commands.append(cmd)
    ahead = rank0.runner.decode_ahead  # overlapped decode: rank 0's draws, which a worker receives on the device
    rank0.runner.decode_ahead = lambda slots, rows, d: (drawn.append(d), ahead(slots, rows, d))[1]
    poisoned = SamplingParams(max_new_tokens=6, ignore_eos=True, top_p=0.5)  # greedy: top_p only marks it
    real = engine_module.sample

    def sample(logits, params, generators):
        if any(p is poisoned for p in params):
            raise RuntimeError("this request's parameters break the sampler")
        return real(logits, params, generators)

    monkeypatch.setattr(engine_module, "sample", sample)
    sched, reasons = Engine(rank0, eos_ids=[]), {}
    for i, p in enumerate([poisoned, SamplingParams(max_new_tokens=6, ignore_eos=True)] * 2):
        emit = (lambda i: lambda ev: reasons.update({i: ev.finish_reason}) if ev.kind == "finish" else None)(i)
        sched.submit(Request(str(i), [3 + i, 4, 5], p, emit))
    while len(reasons) < 4:
        sched.step()
    assert reasons == {0: "error", 1: "length", 2: "error", 3: "length"}
    assert [c[0] for c in commands[:8]] == ["add_request"] * 4 + ["prefill", "free", "free", "decode"]
    draws = iter(drawn)
    for name, *cmd_args in commands:
        getattr(worker, name)(*cmd_args, *([next(draws)] if name == "decode_ahead" else []))
    assert "decode_ahead" in {c[0] for c in commands}
    assert worker.kv.num_free_tokens == rank0.kv.num_free_tokens == 256 - 1
    assert worker.kv.num_free_slots == rank0.kv.num_free_slots


def test_stopping_does_not_wait_for_a_stopped_worker_and_leaves_none_behind():
    """A worker stopped by SIGSTOP (no heartbeat) neither holds the stop to its whole timeout (the HTTP side's own
    60 s, after which the server logged a step that was not running) nor stays behind: it is killed (SIGKILL reaches
    a stopped process; a server's workers ignore SIGTERM)."""
    from lightllm.server.tp import RankProgress, Workers

    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(600,), daemon=True)
    proc.start()
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        # Stopped before the join: the test is about a stopped worker, not one a busy machine has not scheduled yet
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        progress = RankProgress(ctx, 2)
        progress.set(1, progress.BEAT, time.monotonic() - 60)  # its last heartbeat, a minute ago
        workers = Workers([proc], progress, interval_s=3600)
        workers.stopping = True  # a clean stop: the watchdog does not fail the process
        t0 = time.monotonic()
        workers.join(600)
        assert not proc.is_alive() and time.monotonic() - t0 < 300  # not the join's 600 s
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()


def test_a_failure_is_reported_once_when_two_threads_fail_at_once(monkeypatch, caplog):
    """The watchdog and rank 0's own failure path can fail together (a worker dies inside a step): the first owns
    the report and the exit, the second waits for that exit instead of adding a second, misleading line."""
    from lightllm.server import tp

    release = threading.Event()
    monkeypatch.setattr(tp.os, "_exit", lambda code: release.wait(30))  # the first "exits" when released
    workers = tp.Workers([], interval_s=3600)
    workers.stopping = True
    caplog.set_level(logging.ERROR, logger="lightllm.server.tp")
    first = threading.Thread(target=workers.fail, args=("first",))
    first.start()
    deadline = time.monotonic() + 30
    while not caplog.messages and time.monotonic() < deadline:
        time.sleep(0.01)
    second = threading.Thread(target=workers.fail, args=("second",), daemon=True)
    second.start()
    second.join(0.5)
    release.set()
    first.join()
    second.join(1.0)
    assert caplog.messages == ["first, so the server exits"]
