"""The engine process's step message (``engine_proc``): a step's tokens packed as columns, finishes as single
events, pickled as over the pipe, and ``replay``ed on the HTTP side give every request exactly the events the
engine gives it in-process (tokens, logprobs, top logprobs, cached tokens, EOS, stop ids, length, abort)."""

import math
import pickle

import pytest

from fake_model import FakeRunner

from lightllm.engine.engine import Engine
from lightllm.engine.request import Request
from lightllm.engine.sampler import SamplingParams
from lightllm.server.engine_proc import _EngineSide, replay

PROMPTS = {"a": [1, 2, 3], "b": [4, 5], "c": [6, 7, 8, 9], "d": [10], "e": [11, 12]}


class PipeEnd:
    """The engine's end of the pipe: keeps each message as the HTTP side unpickles it."""

    def __init__(self):
        self.messages = []

    def send(self, message):
        self.messages.append(pickle.loads(pickle.dumps(message)))


def step_times():
    """What the engine process shares for /health: the start of the step in flight and the last step's end."""
    return [math.nan, math.nan]


def greedy_run(eos):
    """Each prompt's greedy tokens alone (no stop), to pick stop ids that really come up."""
    engine, out = Engine(FakeRunner(), eos), {}
    for rid, prompt in PROMPTS.items():
        out[rid] = []
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        engine.submit(Request(rid, prompt, params, lambda ev, o=out[rid]: o.append(ev.token_id)))
    while engine.step():
        pass
    return out


def scenario():
    greedy = greedy_run(())
    eos = {greedy["b"][2]}  # "b" ends on EOS at its third token; the others ignore EOS
    params = {
        "a": SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3),
        "b": SamplingParams(max_new_tokens=6),
        "c": SamplingParams(max_new_tokens=6, ignore_eos=True, stop_token_ids=[greedy["c"][1]]),
        "d": SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=5),
        "e": SamplingParams(max_new_tokens=12, ignore_eos=True),
    }
    return eos, params


def run(engine, emitter, submit_later, step_done=lambda: None):
    """Every request of ``scenario``; "e" aborted after its third step; "a" again once the first "a" is done (its
    prompt then comes from the prefix cache)."""
    eos, params = scenario()
    for rid, prompt in PROMPTS.items():
        engine.submit(Request(rid, prompt, params[rid], emitter(rid)))
    steps = 0
    while engine.step() or engine.has_unfinished():
        step_done()
        steps += 1
        if steps == 3:
            engine.abort("e")
        if steps == 8:
            submit_later(Request("a2", PROMPTS["a"] + [0], params["a"], emitter("a2")))
    step_done()


def test_replayed_step_messages_give_each_request_the_events_of_the_in_process_engine():
    eos, _ = scenario()
    want = {}
    direct = Engine(FakeRunner(), eos)
    run(direct, lambda rid: want.setdefault(rid, []).append, direct.submit)

    pipe = PipeEnd()
    side = _EngineSide(pipe, FakeRunner(), eos, step_times())
    got, emits = {}, {}

    def emitter(rid):
        emits[rid] = got.setdefault(rid, []).append
        return side._emitter(rid)

    run(side.engine, emitter, side.engine.submit, side._send_step)
    for _, records, _ in pipe.messages:
        replay(records, emits)

    assert got == want
    reasons = {rid: evs[-1].finish_reason for rid, evs in want.items()}
    assert reasons == {"a": "length", "b": "stop", "c": "stop", "d": "length", "e": "abort", "a2": "length"}
    assert [len(evs) - 1 for evs in (want["b"], want["c"])] == [3, 2]  # EOS and the stop id are their last tokens
    assert want["a2"][0].cached_tokens > 0 and all(ev.top_logprobs for ev in want["a"][:-1])
    assert emits == {}  # every finish took its request out


def test_on_tokens_feeds_the_metrics_as_one_on_token_per_token():
    from prometheus_client import generate_latest

    from lightllm.server.metrics import Metrics

    first, later = [0.004, 0.2], [0.0003, 0.0003, 0.03, 7.0]
    one_by_one, batched = Metrics(), Metrics()
    for seconds in first:
        one_by_one.on_token(True, seconds)
    for seconds in later:
        one_by_one.on_token(False, seconds)
    batched.on_tokens(first, later)

    def exposition(m):  # without the creation timestamps and the process's own CPU time and memory (they move)
        return [line for line in generate_latest(m.registry).decode().splitlines()
                if "_created" not in line and "process_" not in line]  # fmt: skip

    text = "\n".join(exposition(batched))
    assert exposition(batched) == exposition(one_by_one)
    assert "lightllm_generated_tokens_total 6.0" in text and "lightllm_inter_token_latency_seconds_count 4.0" in text


def test_a_handler_waiting_for_its_finish_still_takes_its_events_every_few_tokens():
    """Events left in an inbox until the finish (``/generate``: 64 requests x 3072 tokens) are hundreds of
    thousands of objects every garbage collection walks: the handler is woken to take them every
    ``_DRAIN_EVENTS`` tokens, and at once for its finish."""
    import asyncio

    from lightllm.engine.request import Event
    from lightllm.server.http_server import _DRAIN_EVENTS, _Inbox

    async def woken_after(events):
        inbox = _Inbox(each_token=False)
        waiting = asyncio.ensure_future(inbox.get_all())
        await asyncio.sleep(0)  # it waits now
        for n, ev in enumerate(events, 1):
            inbox.put_nowait(ev)
            await asyncio.sleep(0)
            if waiting.done():
                return n
        waiting.cancel()
        return None

    tokens = [Event("token", 1)] * (2 * _DRAIN_EVENTS)
    assert asyncio.run(woken_after(tokens)) == _DRAIN_EVENTS
    assert asyncio.run(woken_after(tokens[:3] + [Event("finish", finish_reason="stop")])) == 4


def test_the_server_keeps_its_start_up_objects_out_of_garbage_collection_while_it_serves(server):
    import gc

    from fastapi.testclient import TestClient

    assert gc.get_freeze_count() == 0
    with TestClient(server.app):
        assert gc.get_freeze_count() > 10000
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("values", [[0.0, 0.001, 0.0025, 0.0026, 60.0, 61.0, -1.0], [0.003] * 5, []])
def test_the_step_histogram_exposes_what_prometheus_histogram_would(values):
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from lightllm.server.metrics import LATENCY_BUCKETS, StepHistogram

    values = values + [random.Random(len(values)).expovariate(200) for _ in range(300)]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    step = StepHistogram("x_seconds", "a latency", LATENCY_BUCKETS, ours)
    reference = Histogram("x_seconds", "a latency", registry=theirs, buckets=LATENCY_BUCKETS)
    step.observe_many(values[:100])
    for v in values[100:]:
        step.observe(v)
    for v in values:
        reference.observe(v)

    def lines(registry):
        return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]

    assert lines(ours) == lines(theirs)
    created = [line for line in generate_latest(ours).decode().splitlines() if line.startswith("x_seconds_created ")]
    assert len(created) == 1 and float(created[0].split()[1]) > 1e9


def test_the_ticker_wakes_an_inbox_that_waited_a_whole_period_and_takes_it_out_of_waiting():
    """Only inboxes idle for a period: a stream whose tokens flow is not woken (a tick waking all 64 streams at once
    made a burst of disconnect checks that delayed everything behind it)."""
    import asyncio

    from lightllm.engine.request import Event
    from lightllm.server.http_server import _Inbox, _Ticker

    async def main():
        loop = asyncio.get_running_loop()
        waiting = set()
        ticker = _Ticker(loop, 0.01, waiting)
        idle, fresh, busy = _Inbox(waiting=waiting), _Inbox(waiting=waiting), _Inbox(waiting=waiting)
        busy.put_nowait(Event("token", 7))
        got_busy = await busy.get_all()  # an event is there: no wait, never entered
        assert not waiting
        idle_task, fresh_task = asyncio.ensure_future(idle.get_all()), asyncio.ensure_future(fresh.get_all())
        await asyncio.sleep(0)
        assert waiting == {idle, fresh}
        fresh._since = loop.time() + 3600  # as if it had only just begun waiting at every tick
        got_idle = await asyncio.wait_for(idle_task, 30)
        await asyncio.sleep(0.05)  # several more ticks
        assert not fresh_task.done() and waiting == {fresh}
        fresh.put_nowait(Event("token", 8))
        got_fresh = await fresh_task
        ticker.stop()
        return got_busy, got_idle, got_fresh, waiting

    busy, idle, fresh, waiting = asyncio.run(main())
    assert [ev.token_id for ev in busy] == [7] and idle == [] and [ev.token_id for ev in fresh] == [8]
    assert waiting == set()


def test_the_engine_process_sends_its_collector_passes_when_they_change_and_metrics_show_both_processes():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from lightllm.common.gc_heap import GcPauses
    from lightllm.server.metrics import Metrics

    pauses, pipe = GcPauses(), PipeEnd()
    side = _EngineSide(pipe, FakeRunner(), (), step_times(), pauses)

    def sent_pauses():
        side._send_step()
        calls = pipe.messages[-1][2] if pipe.messages else []
        pipe.messages.clear()
        return [args for name, args in calls if name == "on_gc_pauses"]

    assert sent_pauses() == []  # no pass yet
    for generation in (0, 2, 2):
        pauses._callback("start", {"generation": generation})
        pauses._callback("stop", {"generation": generation})
    (counts, sums), *more = sent_pauses()
    assert more == [] and [sum(c) for c in counts] == [1, 0, 2] and sums[2] > 0
    assert sent_pauses() == []  # unchanged: not sent again

    metrics = Metrics()
    metrics.gc_pauses._callback("start", {"generation": 1})  # this (HTTP) process's own pass
    metrics.gc_pauses._callback("stop", {"generation": 1})
    metrics.on_gc_pauses(counts, sums)
    samples = {(s.name, s.labels["process"], s.labels["generation"], s.labels.get("le")): s.value
               for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               if f.name == "lightllm_gc_pause_seconds" for s in f.samples}  # fmt: skip
    count = {(p, g): samples[("lightllm_gc_pause_seconds_count", p, g, None)] for p in ("http", "engine")
             for g in "012"}  # fmt: skip
    assert count == {("http", "0"): 0, ("http", "1"): 1, ("http", "2"): 0,
                     ("engine", "0"): 1, ("engine", "1"): 0, ("engine", "2"): 2}  # fmt: skip
    assert samples[("lightllm_gc_pause_seconds_bucket", "engine", "2", "+Inf")] == 2
    assert samples[("lightllm_gc_pause_seconds_sum", "engine", "2", None)] == pytest.approx(sums[2])
    buckets = [v for (name, p, g, le), v in samples.items() if name.endswith("_bucket") and (p, g) == ("engine", "2")]
    assert buckets == sorted(buckets)  # cumulative
    assert len(buckets) == len(pauses.bounds) + 1
