"""The server's engine thread: a step that raises fails its requests, and those events are delivered."""

import threading

import pytest

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
    r.decode = lambda slots, tokens: (_ for _ in ()).throw(RuntimeError("device lost"))
    engine.submit(Request("x", [3, 4, 5], SamplingParams(max_new_tokens=4, ignore_eos=True), pending.append))
    loop.start()
    try:
        assert done.wait(30)
    finally:
        assert loop.stop()
    assert [ev.kind for ev in delivered] == ["token", "finish"] and delivered[-1].finish_reason == "error"
    assert r.kv.num_free_tokens == 512 - 1  # its KV freed (all but the padding token)
