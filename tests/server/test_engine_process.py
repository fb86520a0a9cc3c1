"""The engine in its own process (``lightllm.server.engine_proc``): one message per step holding every request's
tokens, TTFT and inter-token histograms fed from it, and a dying engine process failing its requests, turning
/health 503 and ending the server with one line instead of hanging it."""

import asyncio
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fake_model import CollectingRunner, CrashingRunner, FakeRunner, KilledRunner, Letters, SlowExitRunner
from fastapi.testclient import TestClient
from server_helpers import REPO

from lightllm.common import proc as procs
from lightllm.common.net import free_port, wait_healthy
from lightllm.server.http_server import Server
from lightllm.server.engine_proc import EngineExited, EngineProcess


def started(make_runner) -> Server:
    engine = EngineProcess(make_runner)
    try:
        engine.wait_ready()
    except BaseException:
        engine.stop()
        raise
    server = Server(engine, Letters(), "tiny")
    server.prompts.tokenizer = server.tokenizer
    return server


def metric(text, name):
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_one_message_per_step_holds_every_requests_tokens_and_feeds_the_latency_histograms():
    server = started(FakeRunner)
    engine = server.engine
    messages = []
    deliver = engine._deliver

    def recording(records, calls):
        messages.append((records, calls))
        deliver(records, calls)

    engine._deliver = recording
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 6, "ignore_eos": True}}
    try:
        with TestClient(server.app) as client:
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                replies = list(pool.map(lambda _: client.post("/generate", json=body).json(), range(8)))
            text = client.get("/metrics").text
    finally:
        assert engine.stop()
    assert [len(r["token_ids"]) for r in replies] == [6] * 8
    with_tokens = [(records, calls) for records, calls in messages if any(r[0] == "tokens" for r in records)]
    assert sum(len(r[1]) for records, _ in with_tokens for r in records if r[0] == "tokens") == 48
    for records, calls in with_tokens:  # a step's tokens travel together: one record of columns, one message
        steps = [args for name, args in calls if name == "on_step"]
        tokens = [r for r in records if r[0] == "tokens"]
        assert len(steps) == 1 and len(tokens) == 1 and len(tokens[0][1]) == steps[0][1]
        assert [name for name, _ in calls].count("on_tokens") == 1 and "on_token" not in dict(calls)
    assert len(with_tokens) == sum(metric(text, f'lightllm_step_seconds_count{{kind="{k}"}}') or 0
                                   for k in ("prefill", "decode"))  # fmt: skip
    # observed as the tokens left the engine: one first token per request, every later one an inter-token gap
    assert metric(text, "lightllm_time_to_first_token_seconds_count") == 8
    assert metric(text, "lightllm_inter_token_latency_seconds_count") == 8 * 5
    for name in ("lightllm_time_to_first_token_seconds", "lightllm_inter_token_latency_seconds"):
        assert f'{name}_bucket{{le="0.001"}}' in text and f'{name}_bucket{{le="60.0"}}' in text
    # every message carries its send time, last, and the HTTP side times the hop once per message it handles
    assert all(calls[-1][0] == "on_engine_message" for _, calls in messages)
    sent = [calls[-1][1][0] for _, calls in messages]
    assert sent == sorted(sent) and metric(text, "lightllm_engine_message_delay_seconds_count") >= len(with_tokens)
    assert (
        0
        < metric(text, "lightllm_engine_message_delay_seconds_sum")
        < metric(text, "lightllm_engine_message_delay_seconds_count")
    )  # a mean under a second: the send time is on the HTTP side's clock
    # both processes' CPU time: the HTTP process's own and the engine process's (it ran every step: not zero)
    assert metric(text, "process_cpu_seconds_total") > 0
    assert metric(text, "lightllm_engine_process_cpu_seconds_total") > 0
    assert metric(text, "lightllm_engine_process_start_time_seconds") > metric(text, "process_start_time_seconds")


def test_the_engine_process_freezes_its_start_up_heap_and_its_collector_passes_reach_the_metrics():
    server = started(CollectingRunner)  # a full pass at every decode step
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 4, "ignore_eos": True}}
    try:
        with TestClient(server.app) as client:
            assert len(client.post("/generate", json=body).json()["token_ids"]) == 4
            text = client.get("/metrics").text
    finally:
        assert server.engine.stop()
    assert server.engine.gc_frozen > 10000  # torch and the runner, built before it served
    passes = metric(text, 'lightllm_gc_pause_seconds_count{generation="2",process="engine"}')
    assert passes is not None and passes >= 3  # the decode steps' passes (the message of the last one may follow)
    assert metric(text, 'lightllm_gc_pause_seconds_count{generation="2",process="http"}') is not None


def test_only_the_reader_waits_for_the_engine_process_and_stop_sees_its_clean_exit():
    """Once serving, one thread (the reader of the engine's pipe) waits for the engine process: a second wait would
    race it for the exit status, lose, take the exited engine for a live one and SIGKILL its pid. The engine here
    needs a second to exit after closing its pipe (as a GPU process tearing its CUDA context down), so the reader and
    ``stop`` both wait across the exit."""
    server = started(SlowExitRunner)
    engine = server.engine
    waits = []
    for name in ("join", "is_alive"):
        real = getattr(engine.process, name)
        setattr(engine.process, name, lambda *a, _real=real, _name=name: (waits.append(
            (_name, threading.current_thread().name)), _real(*a))[1])  # fmt: skip
    loop = asyncio.new_event_loop()
    try:
        engine.bind(loop)
        engine.start()
        assert engine.is_alive()
        assert engine.stop(timeout=30)
    finally:
        engine.stop()  # idempotent: a failed assertion above leaves no engine process behind
        loop.close()
    assert engine.process.exitcode == 0 and not engine.is_alive()
    assert waits == [("join", "lightllm-engine-read")]


def test_a_crashed_engine_process_fails_its_requests_and_turns_health_503():
    server = started(CrashingRunner)
    gone = []
    server.engine.on_exit.append(lambda: gone.append(1))
    try:
        with TestClient(server.app) as client:
            assert client.get("/health").status_code == 200
            reply = client.post("/generate", json={"inputs": "abc", "parameters": {"max_new_tokens": 4}}).json()
            assert reply["finish_reason"] == "error"  # its prefill token, then the engine died under its decode
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "engine process exited with code 1"
            after = client.post("/generate", json={"inputs": "abc", "parameters": {"max_new_tokens": 4}}).json()
            assert after["finish_reason"] == "error" and after["token_ids"] == []  # refused at once, not hung
    finally:
        server.engine.stop()
    assert gone == [1]


_FAKE_SERVER = """
import sys
sys.path.insert(0, {tests!r})
from fake_model import {runner}, Letters
from lightllm.server.api_server import run
from lightllm.server.http_server import Server
from lightllm.server.args import ServerArgs
from lightllm.server.engine_proc import EngineProcess
from lightllm.server.serving import bind
import logging

if __name__ == "__main__":  # the engine process (spawned) imports this file again
    logging.basicConfig(level=logging.INFO)
    engine = EngineProcess({runner})
    engine.wait_ready()
    server = Server(engine, Letters(), "tiny")
    server.prompts.tokenizer = server.tokenizer
    sys.exit(run(server, bind("127.0.0.1", {port}), ServerArgs()))
"""


def start_fake_server(tmp_path, runner: str):
    """The real ``api_server.run`` over ``EngineProcess(runner)`` (a class of fake_model) in a subprocess, answering
    /health: (process, base URL, log path)."""
    port = free_port()
    script = tmp_path / "fake_server.py"
    script.write_text(_FAKE_SERVER.format(tests=os.path.dirname(__file__), port=port, runner=runner))
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = procs.start([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": REPO}, stdout=out,
                           stderr=subprocess.STDOUT)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, procs.HANG_TIMEOUT_S)
    except BaseException:
        procs.stop(proc)
        raise
    return proc, base, log


def test_a_crashed_engine_process_ends_the_server_with_one_line(tmp_path):
    proc, base, log = start_fake_server(tmp_path, "CrashingRunner")
    try:
        body = {"inputs": "abc", "parameters": {"max_new_tokens": 4}}
        reply = httpx.post(base + "/generate", json=body, timeout=procs.HANG_TIMEOUT_S).json()
        assert reply["finish_reason"] == "error"
        assert proc.wait(timeout=procs.HANG_TIMEOUT_S) == 1  # it ends by itself; the old server served on
    finally:
        procs.stop(proc)
    text = log.read_text()
    lines = [line for line in text.splitlines() if "engine process exited with code 1" in line]
    assert len(lines) == 1, text[-3000:]
    assert "1 request(s) in flight end with finish_reason error and the server stops" in lines[0]


def test_the_engine_process_does_not_outlive_a_killed_server(tmp_path):
    """SIGKILL the HTTP process (no shutdown runs): the engine process notices and exits by itself, quietly (its last
    messages go nowhere: no BrokenPipeError traceback in the log, which reads as a crash)."""
    proc, base, log = start_fake_server(tmp_path, "FakeRunner")
    engine = None
    try:
        (engine,) = [p for p in procs._tree(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S  # only an engine that never leaves waits this long
        while procs._alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not procs._alive(engine), "the engine process outlived the server"
    finally:
        procs.stop(proc)
        if engine is not None and procs._alive(engine):  # orphaned by the failure above: not left behind
            os.kill(engine, signal.SIGKILL)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_an_engine_killed_while_starting_says_so_and_names_the_sizes():
    """SIGKILL (the OOM killer) leaves no error of its own: not "its error is above" over nothing."""
    engine = EngineProcess(KilledRunner)
    try:
        with pytest.raises(EngineExited) as e:
            engine.wait_ready()
    finally:
        engine.stop()
    assert str(e.value) == ("engine process was killed by signal 9 while starting (out of memory? check "
                            "--running_max_req_size / --max_total_token_num)")  # fmt: skip


def test_an_engine_killed_before_its_release_says_so_at_wait_ready():
    """Killed while held (the HTTP process still loads its tokenizer): releasing it writes to a closed pipe, which
    must not raise a BrokenPipeError traceback instead of the one line wait_ready gives."""
    engine = EngineProcess()  # held
    try:
        engine.process.kill()
        engine.process.join(procs.HANG_TIMEOUT_S)
        engine.release(FakeRunner)
        with pytest.raises(EngineExited, match=r"^engine process was killed by signal 9 while starting"):
            engine.wait_ready()
    finally:
        engine.stop()


class _MarkingRunner(FakeRunner):
    """A FakeRunner that leaves a file behind when built (picklable: a class with a path given by functools)."""

    def __init__(self, marker):
        Path(marker).write_text("built")
        super().__init__()


def test_a_held_engine_process_builds_nothing_until_released(tmp_path):
    """Started held and never released (the HTTP process's arguments or tokenizer failed, or it died), the engine
    process ends on its pipe's end without building anything; released, it builds the runner it is given and stops
    at the tokenizer's EOS."""
    import functools

    from fake_model import WEIGHTS

    marker = tmp_path / "built"
    make_runner = functools.partial(_MarkingRunner, str(marker))
    engine = EngineProcess()  # held: nothing to build yet
    try:
        engine._conn.close()  # the HTTP side gone before any release
        engine.process.join(procs.HANG_TIMEOUT_S)
        assert engine.process.exitcode == 0 and not marker.exists()
    finally:
        engine.stop()

    first = int(WEIGHTS[2].argmax())  # the fake model's greedy token after "c"
    engine = EngineProcess()
    try:
        engine.release(make_runner, first)
        engine.wait_ready()
        assert marker.exists()
        server = Server(engine, Letters(), "tiny")
        server.prompts.tokenizer = server.tokenizer
        with TestClient(server.app) as client:
            body = {"inputs": "abc", "parameters": {"max_new_tokens": 6}}
            got = client.post("/generate", json=body).json()
        assert got["token_ids"] == [first] and got["finish_reason"] == "stop", got
    finally:
        engine.stop()


def test_stop_ends_a_held_engine_process_quietly(capfd):
    """Stopped before its release (a bad flag or tokenizer), mid-import or waiting: it ends and writes nothing (its
    stderr is this process's)."""
    engine = EngineProcess()
    assert engine.stop() and engine.process.exitcode is not None
    assert capfd.readouterr().err == ""


def test_ctrl_c_while_the_engine_process_imports_does_not_end_it(capfd):
    """Ctrl+C goes to the whole process group: one that reaches the engine process while it still imports (before it
    ignores SIGINT) must neither end it nor print a traceback (its stderr is this process's)."""
    engine = EngineProcess()
    try:
        with open(f"/proc/{engine.process.pid}/status") as f:  # from its start: a blocked SIGINT did not survive exec
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1))
        os.kill(engine.process.pid, signal.SIGINT)  # at once: the spawned interpreter is still starting
        time.sleep(0.3)
        os.kill(engine.process.pid, signal.SIGINT)  # and while it imports torch (this killed it before 2026-12-07)
        engine.release(FakeRunner)
        engine.wait_ready()
        assert engine.process.is_alive()
    finally:
        engine.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_the_server_command_starts_its_engine_process_before_importing_anything_heavy():
    """``python -m lightllm.server.api_server`` spawns its held engine process first, so the engine's imports run
    beside the HTTP process's: the command's module imports no torch, FastAPI or transformers (every process spawned
    from it imports that module again as its main, and neither would they)."""
    code = ("import sys, lightllm.server.api_server, lightllm.server.engine_spawn; "
            "print(sorted(m for m in ('torch', 'fastapi', 'transformers', 'triton') if m in sys.modules))")  # fmt: skip
    done = procs.run([sys.executable, "-c", code], timeout=procs.HANG_TIMEOUT_S)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_spawned_engine_that_is_never_released_stops_quietly(capfd):
    """The server command's own path when its HTTP side fails before the release (a bad flag, Ctrl+C while it
    imports): ``SpawnedEngine.stop`` ends the held process and prints nothing."""
    from lightllm.server.engine_spawn import spawn_engine

    spawned = spawn_engine()
    spawned.stop()
    assert spawned.process.exitcode is not None and spawned.conn.closed
    assert capfd.readouterr().err == ""
