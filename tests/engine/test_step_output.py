"""A step's tokens leave the engine in one call: to a token sink (the engine process's step message) and to an
observer that takes them batched (``on_tokens``), with the same tokens and latencies as one call per token."""

import itertools

import pytest

import lightllm.engine.engine as engine_module
from lightllm.engine.engine import Engine
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.tools.make_tiny_model import make_tiny_qwen3
from tests.engine.test_scheduler import runner

PROMPTS = [[3, 4, 5, 6], [20, 21, 22], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=2))


class PerToken:
    def __init__(self):
        self.tokens, self.steps = [], 0

    def on_queues(self, *a): ...

    def on_step(self, *a):  # once per step read (an overlapped decode step is read in the next step() call)
        self.steps += 1

    def on_token(self, first, seconds):
        self.tokens.append((first, seconds))


class Batched(PerToken):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def on_tokens(self, first, later):
        self.calls += 1
        self.tokens += [(True, s) for s in first] + [(False, s) for s in later]


def run(model_dir, observer=None, sink=None, events=None):
    """PROMPTS to the end (12 tokens, the second stops at 6): (each request's events, steps read)."""
    observer = observer or PerToken()
    engine = Engine(runner(model_dir, 512), eos_ids=[], observer=observer, emit_tokens=sink)
    events = {} if events is None else events
    for i, p in enumerate(PROMPTS):
        params = SamplingParams(max_new_tokens=6 if i == 1 else 12, ignore_eos=True, logprobs=True)
        engine.submit(Request(str(i), p, params, events.setdefault(str(i), []).append, arrival=0.0))
    while engine.step():
        pass
    return events, observer.steps


def tick_clock(monkeypatch):
    """The engine's clock from 0, one tick per reading: two runs read the same times."""
    ticks = itertools.count()
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: float(next(ticks)))


def test_an_observer_with_on_tokens_gets_one_call_per_step_and_the_same_latencies(model_dir, monkeypatch):
    per_token, batched = PerToken(), Batched()
    tick_clock(monkeypatch)
    run(model_dir, per_token)
    tick_clock(monkeypatch)
    _, steps = run(model_dir, batched)
    assert batched.calls == steps and sorted(batched.tokens) == sorted(per_token.tokens)
    assert len(per_token.tokens) == 12 + 6 + 12 and sum(first for first, _ in batched.tokens) == 3


def test_a_token_sink_gets_each_steps_tokens_in_one_call_before_its_finishes(model_dir):
    want, _ = run(model_dir)
    calls, got, events = [], {}, {}

    def sink(reqs, tokens, logprobs, tops):
        calls.append([r.id for r in reqs])
        for req, tok, lp, top in zip(reqs, tokens, logprobs, tops):
            got.setdefault(req.id, []).append((tok, lp, top))
            assert req.output_ids[-1] == tok and events[req.id] == []  # appended, and not finished before it

    _, steps = run(model_dir, sink=sink, events=events)
    assert len(calls) == steps and calls[0] == ["0", "1", "2"]
    assert got == {rid: [(ev.token_id, ev.logprob, None) for ev in evs[:-1]] for rid, evs in want.items()}
    assert {rid: [ev.kind for ev in evs] for rid, evs in events.items()} == {rid: ["finish"] for rid in want}
