"""Streams write what is ready together in one chunk: the tokens of one step (MTP) or of several steps the HTTP
process fell behind on go out in one send, not one send per token; tokens that arrive apart still go out apart."""

import asyncio
import json

import pytest

from fake_model import make_server

from lightllm.engine.request import Event
from lightllm.engine.sampler import SamplingParams
from lightllm.server.openai_api import OpenAIReply


class Connected:
    async def is_disconnected(self):
        return False


def scripted(server, bursts):
    """``server.engine.submit`` replaced: each request's events arrive in ``bursts`` (lists of events), a burst
    handed over at once (one mailbox flush, as after one engine step), the next only once the stream has taken
    the previous one."""
    loop = asyncio.get_running_loop()
    server.mailbox.bind(loop)
    gates = []

    def submit(req):
        async def feed():
            for burst in bursts:
                for ev in burst:
                    req.emit(ev)
                server.mailbox.flush()
                gate = loop.create_future()
                gates.append(gate)
                await gate

        loop.create_task(feed())

    server.engine.submit = submit
    return gates


async def chunks_of(stream, gates):
    out = []
    async for chunk in stream:
        out.append(chunk)
        for gate in gates:
            if not gate.done():
                gate.set_result(None)
    return out


def events(chunk):
    assert chunk.endswith("\n\n")
    return [json.loads(e[len("data: ") :]) for e in chunk[:-2].split("\n\n")]


BURSTS = [
    [Event("token", 1, -0.5)],  # a step's one token
    [Event("token", 2, -0.25), Event("token", 3, -0.125), Event("token", 4, -1.0)],  # an MTP step's three
    [Event("token", 5, -2.0), Event("finish", finish_reason="length")],
]


def test_native_stream_writes_each_burst_as_one_chunk():
    async def main():
        server = make_server()
        gates = scripted(server, BURSTS)
        params = SamplingParams(max_new_tokens=5)
        body = type("P", (), {"return_details": False})()
        return await chunks_of(server._native_events([0, 1], params, body, Connected()), gates)

    chunks = asyncio.run(main())
    assert [len(events(c)) for c in chunks] == [1, 3, 2]
    flat = [e for c in chunks for e in events(c)]
    assert [e["token"]["id"] for e in flat] == [1, 2, 3, 4, 5, None]
    assert [e["token"]["logprob"] for e in flat[:5]] == [-0.5, -0.25, -0.125, -1.0, -2.0]
    assert [e["token"]["count_output_tokens"] for e in flat] == [1, 2, 3, 4, 5, 5]
    assert [e["finished"] for e in flat] == [False] * 5 + [True]
    assert flat[-1]["generated_text"] == "bcdef" and flat[-1]["finish_reason"] == "length"


def test_openai_stream_writes_each_burst_as_one_chunk():
    async def main():
        server = make_server()
        gates = scripted(server, BURSTS)
        reply = OpenAIReply(server, False, [[0, 1]], 1, 1, None, False)
        seqs = [([0, 1], SamplingParams(max_new_tokens=5))]
        return await chunks_of(reply.stream(seqs, Connected(), include_usage=True), gates)

    chunks = asyncio.run(main())
    assert chunks[-1] == "data: [DONE]\n\n"
    assert [len(events(c)) for c in chunks[:-2]] == [1, 3, 2]
    flat = [e for c in chunks[:-2] for e in events(c)]
    assert "".join(e["choices"][0]["text"] for e in flat) == "bcdef"
    assert [e["choices"][0]["finish_reason"] for e in flat] == [None] * 5 + ["length"]
    assert events(chunks[-2])[0]["usage"]["completion_tokens"] == 5


def test_collect_takes_every_token_of_a_burst():
    async def main():
        server = make_server()
        gates = scripted(server, BURSTS)
        task = asyncio.ensure_future(server._collect([0, 1], SamplingParams(max_new_tokens=5), Connected()))
        while not task.done():
            for gate in gates:
                if not gate.done():
                    gate.set_result(None)
            await asyncio.sleep(0)
        return task.result()

    out = asyncio.run(main())
    assert out["token_ids"] == [1, 2, 3, 4, 5] and out["text"] == "bcdef" and out["finish_reason"] == "length"
    assert out["logprobs"] == [-0.5, -0.25, -0.125, -1.0, -2.0]


def test_token_events_are_the_json_of_the_event_they_stand_for():
    """The hot path formats a token's event directly; it is ``json.dumps`` of the event dict, character for
    character: text with quotes, backslashes, control and non-ASCII characters; logprobs finite, tiny, huge and
    not finite (those as the JSON floor a response carries); booleans and counts."""
    import math
    import random

    from lightllm.server.http_server import _token_event
    from lightllm.server.openai_api import finite_logprob

    rng = random.Random(0)
    alphabet = 'ab "\\\n\t\r\x00\x1f\x7f/é你🙂\u2028\ufffd'
    floats = [0.0, -0.0, -1e-300, -1e300, -math.inf, math.inf, math.nan, -0.1, -1 / 3]
    for i in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 6)))
        logprob = floats[i] if i < len(floats) else -rng.expovariate(0.5)
        token_id, special, count, prompt = rng.randrange(200000), rng.random() < 0.5, rng.randrange(1, 5000), 128
        event = {"token": {"id": token_id, "text": text, "logprob": finite_logprob(logprob), "special": special,
                           "count_output_tokens": count, "prompt_tokens": prompt},
                 "generated_text": None, "finished": False, "finish_reason": None, "details": None}  # fmt: skip
        assert _token_event(token_id, text, logprob, special, count, prompt) == f"data: {json.dumps(event)}\n\n"


@pytest.mark.parametrize("chat", [False, True])
def test_openai_token_chunks_are_the_json_of_the_event_they_stand_for(chat):
    """A plain token's chunk (no logprobs, not the last) is formatted directly; every chunk is ``data: `` and
    ``json.dumps`` of {id, object, created, model, choices[, usage]}, character for character."""
    import random

    server = make_server()
    server.model_name = 'a "model" % with \\ and é'
    reply = OpenAIReply(server, chat, [[0, 1]], 1, 1, None, False)
    kind = reply.kind + ".chunk" if chat else reply.kind
    plain = reply._plain_chunk(kind)
    rng = random.Random(int(chat))
    alphabet = 'ab "\\\n\t\r\x00\x1f\x7f/é你🙂\u2028\ufffd%s{}'
    for n in range(300):
        delta, i = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 6))), rng.randrange(300)
        field = ("content", "reasoning_content")[n % 2]  # chat: the answer's text, or its reasoning's
        choice = {"index": i, "delta": {field: delta}} if chat else {"index": i, "text": delta}
        choices = [{**choice, "logprobs": None, "finish_reason": None}]
        body = {"id": reply.id, "object": kind, "created": reply.created, "model": server.model_name,
                "choices": choices}  # fmt: skip
        formatted = plain(i, delta, field) if chat else plain(i, delta)
        assert formatted == reply._sse(kind, choices) == f"data: {json.dumps(body)}\n\n"
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    body = {"id": reply.id, "object": kind, "created": reply.created, "model": server.model_name, "choices": [],
            "usage": usage}  # fmt: skip
    assert reply._sse(kind, [], usage=usage) == f"data: {json.dumps(body)}\n\n"


def test_a_single_sequence_stream_needs_no_task_of_its_own_and_aborts_when_closed():
    """One sequence (the usual request) is followed directly, not through a pump task; leaving it early aborts it."""

    async def main():
        server = make_server()
        gates = scripted(server, BURSTS)
        aborted = []
        server.engine.abort = lambda rid, reason="abort": aborted.append(reason)
        tasks_before = len(asyncio.all_tasks())
        stream = server.merged_streams([([0, 1], SamplingParams(max_new_tokens=5))], Connected())
        first = await stream.__anext__()
        tasks_during = len(asyncio.all_tasks())
        for gate in gates:
            gate.set_result(None)
        await stream.aclose()  # the client left after its first chunk
        return first, tasks_during - tasks_before, aborted

    first, extra_tasks, aborted = asyncio.run(main())
    assert [(i, ev.token_id) for i, (_, ev, _) in first] == [(0, 1)]
    assert extra_tasks == 1  # the scripted engine's feeder, no pump
    assert aborted == ["abort"]


def finished_counts(server):
    return {s.labels["finish_reason"]: s.value for m in server.metrics.registry.collect()
            if m.name == "lightllm_requests_finished" for s in m.samples if s.name.endswith("_total")}  # fmt: skip


def test_a_streamed_request_is_submitted_before_its_response_starts(monkeypatch):
    """The handler submits (every sample of an OpenAI stream too): Starlette starts a streamed body in a task of its
    own after the headers, turns of a busy event loop later, which would all count in the time to first token. Each
    request is still counted once, with its own finish reason."""
    from fastapi.testclient import TestClient

    from lightllm.server import http_server

    server = make_server()
    seen = []
    call = http_server._SubmittedStream.__call__

    async def recording(self, scope, receive, send):
        seen.append(len(server.submitted))  # requests in the engine as the response starts
        await call(self, scope, receive, send)

    monkeypatch.setattr(http_server._SubmittedStream, "__call__", recording)
    native = {"inputs": "ab", "parameters": {"max_new_tokens": 3, "ignore_eos": True}}
    openai = {"prompt": "ab", "max_tokens": 3, "n": 2, "stream": True, "ignore_eos": True}
    with TestClient(server.app) as client:
        native_events = client.post("/generate_stream", json=native).text.count("data:")
        openai_events = client.post("/v1/completions", json=openai).text
    assert seen == [1, 3] and native_events == 4 and openai_events.endswith("data: [DONE]\n\n")
    assert finished_counts(server).get("length") == 3 and not finished_counts(server).get("abort")


def test_a_stream_whose_body_never_starts_aborts_what_its_handler_submitted():
    """The client leaves before the body's task runs (the ASGI server reports the disconnect at once): the body
    never reads its requests, and the response still aborts each of them, counted once as "abort"."""
    from lightllm.server.http_server import _SubmittedStream

    async def main():
        server = make_server()
        aborted = []
        server.engine.abort = lambda rid, reason="abort": aborted.append((rid, reason))
        subs = [server._submit([0, 1], SamplingParams(max_new_tokens=4)) for _ in range(2)]
        started = []

        async def body():
            started.append(True)
            yield "data: x\n\n"

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            await asyncio.sleep(3600)  # never returns: the disconnect ends the response first

        scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
        await _SubmittedStream(body(), subs)(scope, receive, send)
        return server, subs, aborted, started

    server, subs, aborted, started = asyncio.run(main())
    assert not started and aborted == [(sub.request_id, "abort") for sub in subs]
    assert finished_counts(server) == {"abort": 2.0}
