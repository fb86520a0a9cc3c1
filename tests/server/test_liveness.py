"""/health reports a stuck engine step; slow clients are cut off; shutdown drains in-flight requests for a bounded
time and then aborts them."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from server_helpers import REPO, spawned_children, start_server

from lightllm.engine.args import EngineArgs
from lightllm.common import proc as procs
from lightllm.common.net import free_port
from lightllm.common.kv_cache import KVCacheManager
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.server.http_server import Server
from lightllm.server.serving import MAX_REQUEST_HEAD_BYTES, DrainingServer


class BlockingRunner:
    """Enough of a ModelRunner for the engine; ``prefill`` waits until the test releases it."""

    def __init__(self):
        self.args = EngineArgs(batch_max_tokens=64, max_req_total_len=64, running_max_req_size=4)
        self.config = SimpleNamespace(eos_token_ids=(), vocab_size=8)
        self.device = torch.device("cpu")
        self.kv = KVCacheManager(1000, 4, 64, "cpu")
        self.entered, self.release = threading.Event(), threading.Event()

    def add_request(self, prefix=()):
        return 0

    def free(self, slot, last_token=None):
        pass

    def prefill(self, slots, prompts, publish=(), following=()):
        self.entered.set()
        assert self.release.wait(procs.HANG_TIMEOUT_S), "the test never released the step"
        return torch.zeros(len(slots), self.config.vocab_size)


def test_health_is_503_while_a_step_runs_past_the_bound():
    runner = BlockingRunner()
    server = Server(runner, SimpleNamespace(eos_token_id=None), "m", health_step_timeout_s=30)
    now = [0.0]
    server.loop.clock = lambda: now[0]  # the step's age is what the test says, whatever the machine's speed
    finished = threading.Event()
    req = Request("r", [1, 2], SamplingParams(max_new_tokens=1),
                  lambda ev: finished.set() if ev.kind == "finish" else None)  # fmt: skip
    with TestClient(server.app) as client:
        assert client.get("/health").status_code == 200
        server.engine.submit(req)
        try:
            assert runner.entered.wait(procs.HANG_TIMEOUT_S)
            now[0] = 30.0  # at the bound: still healthy
            assert client.get("/health").status_code == 200
            now[0] = 31.5
            r = client.get("/health")
            assert r.status_code == 503
            assert r.json()["status"] == "engine step running for 31.5s, over --health_step_timeout_s 30"
        finally:
            runner.release.set()
        assert finished.wait(procs.HANG_TIMEOUT_S)  # emitted inside the step: wait for the step itself to end
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S
        while server.loop.step_in_flight_s() == 31.5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.get("/health").status_code == 200


def test_health_is_503_while_the_engine_loop_is_stuck_between_steps():
    """A loop that stops coming round (a deadlock outside a step; an idle loop steps every 50 ms) is reported as a
    long step is: it never starts the step whose time the rule above measures. Before its first step, nothing."""
    server = Server(BlockingRunner(), SimpleNamespace(eos_token_id=None), "m", health_step_timeout_s=30)
    now = [0.0]
    server.loop.clock = lambda: now[0]
    assert server.loop.between_steps_s() is None  # start-up: not timed
    waiting, release = threading.Event(), threading.Event()
    wait = server.engine.wait_for_request

    def stuck_wait(timeout):  # the idle loop's wait, after the step has ended
        waiting.set()
        assert release.wait(procs.HANG_TIMEOUT_S), "the test never released the loop"
        wait(timeout)

    server.engine.wait_for_request = stuck_wait
    with TestClient(server.app) as client:
        try:
            assert waiting.wait(procs.HANG_TIMEOUT_S)
            now[0] = 30.0  # at the bound: still healthy
            assert client.get("/health").status_code == 200
            now[0] = 31.5
            r = client.get("/health")
            assert r.status_code == 503
            assert r.json()["status"] == "engine loop has not run a step for 31.5s, over --health_step_timeout_s 30"
        finally:
            release.set()
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S  # the next step's end is at 31.5 too
        while server.loop.between_steps_s() != 0.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize("between, healthy", [(0.06, True), (0.08, False)])
def test_an_idle_loop_s_wait_is_no_hang_under_a_bound_shorter_than_it(between, healthy):
    """An idle loop waits 50 ms for a request between its steps: that is no hang, even where the bound (any positive
    number is a valid --health_step_timeout_s) is shorter; past the bound and that wait, it is."""
    loop = SimpleNamespace(is_alive=lambda: True, step_in_flight_s=lambda: None, between_steps_s=lambda: between)
    problem = Server._liveness_problem(SimpleNamespace(loop=loop, health_step_timeout_s=0.02))
    assert problem == (
        None if healthy else "engine loop has not run a step for 0.1s, over --health_step_timeout_s 0.02"
    )


def test_a_second_ctrl_c_before_the_drain_begins_still_ends_it_with_the_aborts(monkeypatch):
    """uvicorn begins its shutdown up to 0.1 s after the first signal: a second Ctrl+C in between must end the drain
    (the aborts) as one during it does, not set uvicorn's force quit; a third is the force quit."""
    import asyncio

    import uvicorn

    async def no_uvicorn_shutdown(self, sockets=None):
        await asyncio.sleep(0)  # the drain's scheduled end runs here

    monkeypatch.setattr(uvicorn.Server, "shutdown", no_uvicorn_shutdown)
    aborts = []
    server = DrainingServer(uvicorn.Config(app=None), drain_s=3600, abort_rest=lambda: aborts.append(1))
    server.handle_exit(signal.SIGINT, None)
    server.handle_exit(signal.SIGINT, None)  # before shutdown() began
    assert server.should_exit and not server.force_exit and aborts == []
    asyncio.run(server.shutdown())
    assert aborts == [1] and not server.force_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit


@pytest.fixture(scope="module")
def short_timeouts_server(tmp_path_factory):
    """A server whose connections time out after 1 s and whose /health bound is 2 s: (process, base URL)."""
    args = ["--device", "cpu", "--request_read_timeout_s", "1", "--health_step_timeout_s", "2"]
    proc, base, _ = start_server(tmp_path_factory.mktemp("short"), args)
    try:
        yield proc, base
    finally:
        procs.stop(proc)


def test_health_is_503_while_the_engine_process_is_stopped_between_steps(short_timeouts_server):
    """SIGSTOP the idle engine process (standing in for any hang outside a step): /health turns 503 once it has
    not run a step for --health_step_timeout_s, and 200 again after SIGCONT. An idle engine process is never
    reported: its loop keeps stepping."""
    proc, base = short_timeouts_server
    (engine,) = spawned_children(proc.pid)
    statuses, end = [], time.monotonic() + 2.5  # idle past the bound
    while time.monotonic() < end:
        statuses.append(httpx.get(base + "/health", timeout=procs.HANG_TIMEOUT_S).status_code)
        time.sleep(0.1)
    assert set(statuses) == {200}
    os.kill(engine, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60  # the bound is 2 s; the old server answered 200 forever
        while (r := httpx.get(base + "/health", timeout=procs.HANG_TIMEOUT_S)).status_code == 200:
            assert time.monotonic() < deadline, "/health never reported the stopped engine process"
            time.sleep(0.1)
        # stopped between steps (all but always: an idle step takes microseconds of its 50 ms round) or inside one
        assert r.status_code == 503 and re.fullmatch(
            r"engine (loop has not run a step|step running) for [\d.]+s, over --health_step_timeout_s 2",
            r.json()["status"],
        ), r.text
    finally:
        os.kill(engine, signal.SIGCONT)
    deadline = time.monotonic() + procs.HANG_TIMEOUT_S
    while httpx.get(base + "/health", timeout=procs.HANG_TIMEOUT_S).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_client_that_never_finishes_its_headers_is_cut_off(short_timeouts_server):
    _, base = short_timeouts_server
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        slow.settimeout(120)  # the server closes it after 1 s; the old server never did
        assert slow.recv(1024) == b""
    # a connection that sends nothing at all is closed too, and one whose body stops short of its length
    with socket.create_connection(("127.0.0.1", port)) as idle:
        idle.settimeout(120)
        assert idle.recv(1024) == b""
    with socket.create_connection(("127.0.0.1", port)) as short:
        short.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"inputs\": [5,")  # fmt: skip
        short.settimeout(120)
        assert short.recv(1024) == b""
    # a head without end is refused once it passes the limit, long before the deadline (one byte past it: the
    # server has read everything when it closes, so the close is no reset that could drop its answer)
    with socket.create_connection(("127.0.0.1", port)) as huge:
        huge.settimeout(120)
        start = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: "
        huge.sendall(start + b"a" * (MAX_REQUEST_HEAD_BYTES + 1 - len(start)))
        assert huge.recv(1024).startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    body = {"inputs": [5, 6, 7], "parameters": {"max_new_tokens": 4, "ignore_eos": True}}
    assert len(httpx.post(base + "/generate", json=body, timeout=procs.HANG_TIMEOUT_S).json()["token_ids"]) == 4


def _events(lines):
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("to", ["server", "group"])
def test_shutdown_drains_then_aborts_what_is_left(tmp_path, to):
    """SIGTERM with one request 4000 tokens from its end and two waiting behind it (one request runs at a time),
    and a 0.5 s drain: each client gets what was generated and finish_reason abort, and the server exits,
    instead of finishing the requests first. Sent to the whole process group (a service manager stopping the
    service's control group) the engine process does not die of it: the HTTP process drains and stops it. A request
    whose body is still coming has its connection closed then (its handler was cancelled after the grace, with a
    traceback and a 500), but not one that answers a request with the next one's head begun behind it (pipelined):
    its stream still ends."""
    args = ["--device", "cpu", "--shutdown_drain_s", "0.5", "--running_max_req_size", "1"]
    proc, base, log = start_server(tmp_path, args)
    try:
        body = {"inputs": [5, 6, 7], "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}
        with httpx.stream("POST", base + "/generate_stream", json=body, timeout=procs.HANG_TIMEOUT_S) as running:
            lines = running.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            port = int(base.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port)) as sending, socket.create_connection(
                ("127.0.0.1", port)
            ) as pipelined:
                sending.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 100\r\n\r\n{\"inputs\": [5,")  # fmt: skip
                raw = json.dumps(body).encode()
                pipelined.sendall(b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))  # fmt: skip
                pipelined.settimeout(procs.HANG_TIMEOUT_S)
                answer = b""
                while b"\r\n\r\n" not in answer:  # its answer begun: the server took both connections (in order)
                    answer += pipelined.recv(65536)
                pipelined.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the next request's head, begun
                with httpx.stream(
                    "POST", base + "/generate_stream", json=body, timeout=procs.HANG_TIMEOUT_S
                ) as waiting:
                    if to == "group":
                        os.killpg(proc.pid, signal.SIGTERM)
                    else:
                        proc.send_signal(signal.SIGTERM)
                    events = _events([first, *lines])
                    waited = _events(waiting.iter_lines())
                sending.settimeout(procs.HANG_TIMEOUT_S)
                assert sending.recv(1024) == b""
                while chunk := pipelined.recv(65536):
                    answer += chunk
        tokens = [e for e in events if e["token"]["id"] is not None]
        assert 1 <= len(tokens) < 4000 and events[-1]["finish_reason"] == "abort"  # delivered up to the abort
        assert [e["finish_reason"] for e in waited] == ["abort"]
        assert answer.endswith(b"\r\n0\r\n\r\n") and b'"finish_reason": "abort"' in answer, answer[-300:]
        assert proc.wait(timeout=procs.HANG_TIMEOUT_S) in (0, -signal.SIGTERM)
    finally:
        procs.stop(proc)
    text = log.read_text()
    assert (
        "still running after 0.5s (--shutdown_drain_s); aborting them" in text and "engine process exited" not in text
    )
    assert "Traceback" not in text and "timeout graceful shutdown exceeded" not in text, text[-3000:]


def _sigint_as_in_a_terminal():
    """In the server's process before it starts: SIGINT's default action, as a terminal's foreground job has it. A
    shell without job control starts a background command (``pytest &``, ``nohup``) with SIGINT ignored, its children
    inherit that, and Python then installs no KeyboardInterrupt handler: the Ctrl+C these tests send would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_streaming_ends_the_server_without_a_traceback(tmp_path):
    """Ctrl+C (SIGINT to the whole process group) drains as SIGTERM does, and a second one ends the drain at once,
    aborting what runs (uvicorn's own second Ctrl+C cut the streams mid-body, a traceback each); the server then
    ends as Ctrl+C ends a program (killed by SIGINT), not with uvicorn's re-raised KeyboardInterrupt as a traceback."""
    proc, base, log = start_server(tmp_path, ["--device", "cpu", "--shutdown_drain_s", "3600"],
                                   preexec_fn=_sigint_as_in_a_terminal)  # fmt: skip
    try:
        body = {"inputs": [5, 6, 7], "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}
        with httpx.stream("POST", base + "/generate_stream", json=body, timeout=procs.HANG_TIMEOUT_S) as running:
            lines = running.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.killpg(proc.pid, signal.SIGINT)
            draining = time.monotonic() + procs.HANG_TIMEOUT_S
            while "Waiting for connections to close" not in log.read_text():  # uvicorn is draining: a second press
                assert time.monotonic() < draining and proc.poll() is None, log.read_text()[-3000:]
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)
            events = _events([first, *lines])
        assert events[-1]["finish_reason"] == "abort"
        assert proc.wait(timeout=procs.HANG_TIMEOUT_S) == -signal.SIGINT
    finally:
        procs.stop(proc)
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def _catches(pid, signum):
    """Whether process ``pid`` has a handler of its own for ``signum`` now (/proc's SigCgt mask)."""
    with open(f"/proc/{pid}/status") as f:
        caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signum - 1)))


def _maps(pid, name):
    """Whether process ``pid`` has a file whose path holds ``name`` mapped (a shared library it has loaded)."""
    with open(f"/proc/{pid}/maps") as f:
        return any(name in line for line in f)


def test_ctrl_c_while_the_http_process_still_imports_ends_it_and_its_engine_process(tmp_path):
    """The engine process is spawned before the HTTP process's own imports (torch, FastAPI: seconds): a Ctrl+C in
    that window stops the held engine process too, and the server ends as Ctrl+C ends it, without a traceback."""
    from lightllm.tools.make_tiny_model import default_model_dir

    default_model_dir()  # built here: a first start builds it while parsing its flags, with transformers' imports
    env = {**os.environ, "PYTHONPATH": REPO, "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(tmp_path / "autotune"),
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--device", "cpu", "--port", str(free_port())]
    with procs.running(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       preexec_fn=_sigint_as_in_a_terminal) as proc:  # fmt: skip
        # The engine process exists, the HTTP process handles SIGINT again (its start, with SIGINT ignored around it
        # so that the child inherits that, is over) and has begun loading torch's libraries: the interrupt lands in
        # the imports, where one inside torch's C initialization used to surface as another error. Found, not timed.
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if spawned_children(proc.pid) and _catches(proc.pid, signal.SIGINT) and _maps(proc.pid, "libtorch"):
                break
            time.sleep(0.005)
        (engine,) = spawned_children(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        hung = threading.Timer(procs.HANG_TIMEOUT_S, proc.kill)  # a server that ignored it: the read ends, failing
        hung.start()
        try:
            text = proc.stdout.read()
        finally:
            hung.cancel()
        assert proc.wait(timeout=procs.HANG_TIMEOUT_S) == -signal.SIGINT, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert not os.path.exists(f"/proc/{engine}"), "the engine process outlived the server"


def test_ctrl_c_while_starting_ends_the_server_without_a_traceback(tmp_path):
    """Ctrl+C while the engine process loads the model: the HTTP process stops it and ends, without a traceback."""
    env = {**os.environ, "PYTHONPATH": REPO, "LIGHTLLM_TINY_MODEL_DIR": str(tmp_path / "tiny"),
           "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(tmp_path / "autotune"), "HF_HUB_OFFLINE": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "lightllm.server.api_server", "--device", "cpu", "--port", str(free_port())]
    with procs.running(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       preexec_fn=_sigint_as_in_a_terminal) as proc:  # fmt: skip
        hung = threading.Timer(procs.HANG_TIMEOUT_S, proc.kill)  # a start that never prints ends the read: a failure
        hung.start()
        lines = []
        try:
            for line in proc.stdout:  # the engine process's first line: the HTTP process waits for it to be ready
                lines.append(line)
                if "KV cache sizing" in line:
                    break
            os.killpg(proc.pid, signal.SIGINT)
            lines += proc.stdout.readlines()
        finally:
            hung.cancel()
        assert proc.wait(timeout=procs.HANG_TIMEOUT_S) == -signal.SIGINT
    text = "".join(lines)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
