"""The server's engine thread: a step that raises fails its requests, and those events are delivered."""

import threading

import pytest

from lightllm.common import proc as procs
from lightllm.engine.engine import Engine
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.server.engine_loop import EngineLoop
from lightllm.tools.make_tiny_model import make_tiny_qwen3
from tests.engine.test_scheduler import runner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=2))


def test_a_failing_step_fails_its_requests_and_delivers_that(model_dir):
    """The loop's error path: the requests of a step that raised finish with "error", and those events are
    handed over by after_step like any other (the server's one wake-up of the HTTP loop per step)."""
    r = runner(model_dir, 512)
    delivered, done = [], threading.Event()
    pending = []

    def deliver():
        delivered.extend(pending)
        pending.clear()
        if any(ev.kind == "finish" for ev in delivered):
            done.set()

    engine = Engine(r, eos_ids=[])
    loop = EngineLoop(engine, after_step=deliver)
    real = engine.scheduler.schedule
    calls = []

    def schedule():  # the step itself raises (a bug outside the forward, which Engine.step does not contain)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("scheduler bug")
        return real()

    engine.scheduler.schedule = schedule
    engine.submit(Request("x", [3, 4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True), pending.append))
    loop.start()
    try:
        assert done.wait(procs.HANG_TIMEOUT_S)
    finally:
        assert loop.stop()
    assert [ev.kind for ev in delivered] == ["token", "finish"] and delivered[-1].finish_reason == "error"
    assert r.kv.num_free_tokens == 512 - 1  # its KV freed (all but the padding token)


def test_a_failing_delivery_does_not_end_the_engine_thread(model_dir):
    engine = Engine(runner(model_dir, 512), eos_ids=[])
    delivered, done, failures = [], threading.Event(), []

    def deliver():
        if not failures:
            failures.append(1)
            raise RuntimeError("Event loop is closed")
        if any(ev.kind == "finish" for ev in delivered):
            done.set()

    loop = EngineLoop(engine, after_step=deliver)
    engine.submit(Request("x", [3, 4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True), delivered.append))
    loop.start()
    try:
        assert done.wait(procs.HANG_TIMEOUT_S)
    finally:
        assert loop.stop()
    assert [ev.kind for ev in delivered] == ["token"] * 4 + ["finish"]


def test_a_request_whose_admission_raises_is_not_lost(model_dir):
    """The runner raising in ``add_request`` (a bug, inside the step): the loop's ``fail_all`` still ends that request
    with "error" (it was taken off the queue before its slot existed, so nothing ended it and its client hung)."""
    r = runner(model_dir, 512)
    events = []
    engine = Engine(r, eos_ids=[])

    def broken(prefix=()):
        raise RuntimeError("runner bug")

    r.add_request = broken
    engine.submit(Request("x", [3, 4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True), events.append))
    with pytest.raises(RuntimeError, match="runner bug"):
        engine.step()
    engine.fail_all()  # what the server's engine loop does after a step raises
    assert [(ev.kind, ev.finish_reason) for ev in events] == [("finish", "error")]
    assert not engine.has_unfinished() and r.kv.num_free_tokens == 512 - 1
