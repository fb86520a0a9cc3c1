"""The real server in a subprocess (tiny model, CPU), driven over HTTP with the openai client and httpx."""

import concurrent.futures
import contextlib
import http.client
import json
import re
import socket
import time

import httpx
import openai
import pytest
from server_helpers import MAX_BODY, MAX_LEN, MODEL

from lightllm.common import proc as procs


@pytest.fixture
def server(tiny_server):
    return tiny_server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


def metric(base, name, labels=""):
    text = httpx.get(base + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_completion_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client):
    msgs = [{"role": "user", "content": "tell me a story"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stream_ends_with_done(server):
    body = {"prompt": "abc", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=procs.HANG_TIMEOUT_S) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_native_generate_and_stream(server):
    body = {"inputs": [5, 6, 7, 8], "parameters": {"max_new_tokens": 24, "logprobs": True, "ignore_eos": True}}
    r = httpx.post(server + "/generate", json=body, timeout=procs.HANG_TIMEOUT_S).json()
    assert len(r["token_ids"]) == 24 and len(r["logprobs"]) == 24 and all(lp <= 0 for lp in r["logprobs"])
    with httpx.stream("POST", server + "/generate_stream", json=body, timeout=procs.HANG_TIMEOUT_S) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert [e["token"]["id"] for e in events if e["token"]["id"] is not None] == r["token_ids"]
    assert events[-1]["finish_reason"] == "length"
    # streamed deltas (incremental) add up to the text /generate decodes once at the end
    assert "".join(e["token"]["text"] for e in events) == r["generated_text"][0]


def test_concurrent_requests_match_sequential(server):
    prompts = [[3 + i, 40 + i, 7] for i in range(8)]

    def run(p):
        body = {"inputs": p, "parameters": {"max_new_tokens": 6, "ignore_eos": True}}
        return httpx.post(server + "/generate", json=body, timeout=procs.HANG_TIMEOUT_S).json()["token_ids"]

    sequential = [run(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        concurrent_ = list(pool.map(run, prompts))
    assert concurrent_ == sequential


def test_sampling_seed_and_stop_string(server):
    body = {"inputs": [9, 10, 11], "parameters": {"max_new_tokens": 8, "temperature": 1.0, "seed": 5,
                                                  "ignore_eos": True}}  # fmt: skip
    a = httpx.post(server + "/generate", json=body, timeout=procs.HANG_TIMEOUT_S).json()
    b = httpx.post(server + "/generate", json=body, timeout=procs.HANG_TIMEOUT_S).json()
    assert a["token_ids"] == b["token_ids"]
    greedy = {"inputs": [9, 10, 11], "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    text = httpx.post(server + "/generate", json=greedy, timeout=procs.HANG_TIMEOUT_S).json()["generated_text"][0]
    at = next(i for i in range(len(text) // 2, len(text)) if text[i].isalnum())  # a stop string mid-output
    stop = text[at]
    greedy["parameters"]["stop"] = [stop, "never-produced"]
    r = httpx.post(server + "/generate", json=greedy, timeout=procs.HANG_TIMEOUT_S).json()
    assert r["finish_reason"] == "stop" and r["generated_text"] == [text[: text.index(stop)]]
    assert len(r["token_ids"]) < 8


def wait_for_abort(server, aborted_before):
    deadline = time.monotonic() + procs.HANG_TIMEOUT_S  # only a request that is never aborted waits this long
    while time.monotonic() < deadline:
        done = metric(server, "lightllm_requests_finished_total", '{finish_reason="abort"}') or 0.0
        if done > aborted_before and metric(server, "lightllm_running_batch") == 0:
            return done
        time.sleep(0.05)
    return done


def idle_kv_usage(server):
    """KV in use once the engine holds no request: a request an earlier test ended by a stop string answers before
    the engine frees it (the abort follows), and the gauges are set at the start of each step."""
    deadline = time.monotonic() + procs.HANG_TIMEOUT_S
    while metric(server, "lightllm_running_batch") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return metric(server, "lightllm_kv_usage_ratio")


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_mid_stream_frees_kv(server, n):
    """With n > 1 every sample of the stream is aborted, not only the one whose chunk was being sent."""
    baseline = idle_kv_usage(server)
    aborted = metric(server, "lightllm_requests_finished_total", '{finish_reason="abort"}') or 0.0
    body = {"prompt": [4, 5, 6], "max_tokens": MAX_LEN - 10, "temperature": 0, "stream": True, "n": n}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=procs.HANG_TIMEOUT_S) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream: the connection closes
    assert wait_for_abort(server, aborted) == aborted + n, "the disconnected requests were not all aborted"
    assert metric(server, "lightllm_kv_usage_ratio") == baseline


def test_disconnect_while_generating_frees_kv(server):
    """Non-streaming: tokens keep arriving for the request, yet the client's departure is still noticed."""
    baseline = idle_kv_usage(server)
    aborted = metric(server, "lightllm_requests_finished_total", '{finish_reason="abort"}') or 0.0
    generated = metric(server, "lightllm_generated_tokens_total")
    body = {"inputs": [4, 5, 6], "parameters": {"max_new_tokens": MAX_LEN - 10, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/generate", json=body, timeout=0.3)  # the client gives up and closes
    assert wait_for_abort(server, aborted) > aborted, "the abandoned request kept generating"
    assert metric(server, "lightllm_generated_tokens_total") - generated < MAX_LEN - 10
    assert metric(server, "lightllm_kv_usage_ratio") == baseline


@pytest.mark.parametrize(
    "path, body, message",
    [
        ("/v1/completions", b"{not json", "invalid JSON"),
        ("/generate", {"inputs": "a", "bogus": 1}, "bogus"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 10**9}, "exceeds max_req_total_len"),
        ("/v1/completions", {"prompt": [1] * (MAX_LEN + 5), "max_tokens": 1}, "max_req_total_len"),
        ("/v1/completions", {"prompt": [10**7], "max_tokens": 1}, "token ids expected"),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, "messages"),
        ("/generate", {"inputs": "a", "parameters": {"top_p": 0}}, "top_p"),
        ("/generate", {"inputs": "a", "parameters": {"min_p": 1.5}}, "parameters.min_p: Input should be less than"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "min_p": -0.5},
         "min_p: Input should be greater than or equal to 0"),
        # strict types: nothing is coerced
        ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": "8"}}, "parameters.max_new_tokens: Input"),
        ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": 8.0}}, "parameters.max_new_tokens: Input"),
        ("/generate", {"inputs": "a", "parameters": {"max_new_tokens": True}}, "parameters.max_new_tokens: Input"),
        ("/generate", {"inputs": [1.0]}, "inputs.0: Input should be a valid integer"),
        ("/generate", {"inputs": [True]}, "inputs.0: Input should be a valid integer"),
        ("/generate", {"inputs": ["1"]}, "inputs.0: Input should be a valid integer"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stream": 1}, "stream: Input"),
        # ranges the engine cannot honour
        ("/generate", {"inputs": "a", "parameters": {"seed": 2**63}}, "parameters.seed: Input should be less than"),
        ("/v1/completions", {"prompt": "a", "seed": -1}, "seed: Input should be greater than or equal to 0"),
        ("/generate", b'{"inputs": "a", "parameters": {"temperature": NaN}}',
         "parameters.temperature: Input should be a finite number"),
        # text a tokenizer cannot take
        ("/v1/completions", b'{"prompt": "ok \\ud800"}',
         "prompt: expected valid Unicode text, got a lone surrogate U+D800 at"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
         "messages.0.content: expected valid Unicode text"),
        ("/v1/completions", b'{"prompt": "\xff\xfe"}', "body: expected UTF-8 JSON"),
        ("/v1/completions", b"[" * 100_000, "body: JSON nested too deeply"),
        # bounded before the work they would cost
        ("/generate", {"inputs": "x" * (32 * MAX_LEN + 1)}, f"inputs: {32 * MAX_LEN + 1} characters, more than the"),
        ("/generate", {"inputs": "a", "parameters": {"stop": ["x"] * 17}}, "stop: at most 16 strings, got 17"),
        ("/v1/completions", {"prompt": "a", "stop": "x" * 257}, "stop: at most 256 characters per string"),
    ],
    ids=["bad-json", "unknown-field", "wrong-type", "negative", "absurd", "too-long", "bad-token", "no-msgs", "top_p",
         "min_p", "chat-min_p",
         "str-int", "float-int", "bool-int", "float-id", "bool-id", "str-id", "int-bool", "big-seed", "negative-seed",
         "nan", "surrogate", "chat-surrogate", "bad-utf8", "deep-json", "long-text", "many-stops",
         "long-stop"],  # fmt: skip
)
def test_bad_input_is_400_and_server_keeps_serving(server, path, body, message):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(server + path, timeout=30, **kw)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == 400
    assert httpx.get(server + "/health").status_code == 200
    ok = httpx.post(server + "/generate", json={"inputs": "ok", "parameters": {"max_new_tokens": 1}}, timeout=30)
    assert ok.status_code == 200


def test_models_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).max_model_len == MAX_LEN
    counts = [responses(server, "/v1/completions", status) for status in (404, 200)]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="lightllm-tiny-qwen3", prompt="hi", max_tokens=1)
    assert e.value.code == "model_not_found"
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3)  # a decode step of its own (run alone too)
    assert [responses(server, "/v1/completions", status) for status in (404, 200)] == [c + 1 for c in counts]
    assert responses(server, "/v1/models/{model_id:path}", 200) >= 1  # a parametrized route by its declared path
    text = httpx.get(server + "/metrics").text
    for name in ("lightllm_queue_length", "lightllm_running_batch", "lightllm_generated_tokens_total",
                 "lightllm_time_to_first_token_seconds_bucket", "lightllm_inter_token_latency_seconds_bucket",
                 "lightllm_kv_usage_ratio", 'lightllm_step_seconds_count{kind="decode"}',
                 'lightllm_step_batch_size_sum{kind="prefill"}'):  # fmt: skip
        assert name in text
    assert metric(server, "lightllm_generated_tokens_total") > 0
    # every end observes its latency once, as it counts its finish (one scrape: a request may end in between)
    text = httpx.get(server + "/metrics").text
    finished = sum(float(v) for v in re.findall(r"^lightllm_requests_finished_total\{.*\} (\S+)$", text, re.M))
    ends = re.search(r"^lightllm_e2e_request_latency_seconds_count (\S+)$", text, re.M)
    assert float(ends.group(1)) == finished >= 1
    assert float(re.search(r"^lightllm_e2e_request_latency_seconds_sum (\S+)$", text, re.M).group(1)) > 0


def responses(base, route, status):
    """``lightllm_http_responses_total`` of one route and status (0 before the first)."""
    return metric(base, "lightllm_http_responses_total", f'{{route="{route}",status="{status}"}}') or 0


def test_unknown_routes_and_methods_answer_in_the_error_shape(server):
    before = [responses(server, "other", 404), responses(server, "/generate", 405)]
    for r, code in ((httpx.get(server + "/nope/" + "x" * 64), 404), (httpx.get(server + "/generate"), 405)):
        assert r.status_code == code and r.json()["error"]["code"] == code, r.text
    # counted by route, a path no route serves as "other" (the label set stays bounded)
    assert [responses(server, "other", 404), responses(server, "/generate", 405)] == [b + 1 for b in before]
    assert "/nope/" not in httpx.get(server + "/metrics").text


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    """A declared Content-Length over --max_request_body_bytes is a 413 at once: the server does not wait for
    (or parse) the 10 MB it announces. /metrics counts it under its route, though no route ran."""
    refused = responses(server, "/generate", 413)
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10000000\r\n\r\n")  # fmt: skip
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 413
        error = json.loads(response.read())["error"]
    assert error["code"] == 413
    assert error["message"] == f"body: 10000000 bytes, more than --max_request_body_bytes ({MAX_BODY})"
    assert httpx.get(server + "/health").status_code == 200
    assert responses(server, "/generate", 413) == refused + 1


def test_extreme_sampling_parameters_do_not_fail_their_neighbours(server):
    """temperature 1e-40 overflows logits / temperature and top_k 2**63 overflows int64: both once crashed the
    sampling step and with it every request in the step. Now they are greedy / every token, and the requests
    sharing their steps finish normally."""
    neighbour = {"inputs": [5, 6, 7], "parameters": {"max_new_tokens": 24, "ignore_eos": True}}
    tiny_t = {"inputs": [9, 10, 11], "parameters": {"max_new_tokens": 24, "temperature": 1e-40, "ignore_eos": True}}
    greedy = {**tiny_t, "parameters": {**tiny_t["parameters"], "temperature": 0}}
    greedy_ids = httpx.post(server + "/generate", json=greedy, timeout=procs.HANG_TIMEOUT_S).json()["token_ids"]
    calls = [("/generate", neighbour)] * 6 + [
        ("/generate", tiny_t),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 24, "temperature": 1.0, "top_k": 2**63, "seed": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24,
                                  "temperature": 1e-40}),
    ]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda c: httpx.post(server + c[0], json=c[1], timeout=procs.HANG_TIMEOUT_S), calls))
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    bodies = [r.json() for r in results]
    assert [b["finish_reason"] for b in bodies[:6]] == ["length"] * 6
    assert bodies[6]["token_ids"] == greedy_ids
    assert all(b["choices"][0]["finish_reason"] in ("length", "stop") for b in bodies[7:])


def finished(base):
    return {reason: metric(base, "lightllm_requests_finished_total", f'{{finish_reason="{reason}"}}') or 0.0
            for reason in ("stop", "length", "abort", "error")}  # fmt: skip


def test_a_stop_string_finish_is_counted_as_stop(server):
    greedy = {"inputs": [9, 10, 11], "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    text = httpx.post(server + "/generate", json=greedy, timeout=procs.HANG_TIMEOUT_S).json()["generated_text"][0]
    stop = text[next(i for i in range(len(text) // 2, len(text)) if text[i].isalnum())]
    before = finished(server)
    greedy["parameters"]["stop"] = [stop]
    assert httpx.post(server + "/generate", json=greedy, timeout=procs.HANG_TIMEOUT_S).json()["finish_reason"] == "stop"
    after_stop = finished(server)
    greedy["parameters"]["stop"] = []  # a whole request after it: the scheduler has long applied its abort
    assert (
        httpx.post(server + "/generate", json=greedy, timeout=procs.HANG_TIMEOUT_S).json()["finish_reason"] == "length"
    )
    after = finished(server)
    assert after_stop["stop"] - before["stop"] == 1
    assert {k: after[k] - before[k] for k in after} == {"stop": 1, "length": 1, "abort": 0, "error": 0}


def test_a_request_dropped_while_queued_is_counted_once_as_abort(server):
    """Eight long requests fill every slot (--running_max_req_size 8); a ninth waits in the queue, and its
    client leaves. Every request is counted exactly once."""
    before = finished(server)
    body = {"inputs": [4, 5, 6], "parameters": {"max_new_tokens": MAX_LEN - 10, "ignore_eos": True}}
    with httpx.Client(timeout=procs.HANG_TIMEOUT_S) as client, contextlib.ExitStack() as running:
        streams = [running.enter_context(client.stream("POST", server + "/generate_stream", json=body))
                   for _ in range(8)]  # fmt: skip
        lines = [s.iter_lines() for s in streams]  # kept: a dropped iterator closes its connection
        for it in lines:
            next(it)  # its first token: it is running
        with client.stream("POST", server + "/generate_stream", json=body):
            deadline = time.monotonic() + procs.HANG_TIMEOUT_S
            while (metric(server, "lightllm_queue_length") or 0) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metric(server, "lightllm_queue_length") == 1, "the ninth request was meant to wait"
        deadline = time.monotonic() + procs.HANG_TIMEOUT_S  # it left while queued: counted as abort at once
        while finished(server)["abort"] - before["abort"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert finished(server)["abort"] - before["abort"] == 1
    deadline = time.monotonic() + procs.HANG_TIMEOUT_S  # the eight end too (aborted, or done if they were fast)
    while sum(finished(server).values()) - sum(before.values()) < 9 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = finished(server)
    assert sum(after.values()) - sum(before.values()) == 9 and after["error"] == before["error"]
