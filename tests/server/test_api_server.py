"""The real server in a subprocess (tiny model, CPU), driven over HTTP with the openai client and httpx."""

import concurrent.futures
import json
import re
import time

import httpx
import openai
import pytest
from server_helpers import running_server

MAX_LEN = 1024  # long enough that a full-length request outlives a client that gives up


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("server")
    args = ["--data_type", "fp32", "--device", "cpu", "--batch_max_tokens", "128", "--max_req_total_len", str(MAX_LEN),
            "--running_max_req_size", "8"]  # fmt: skip
    with running_server(home, args) as base:
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


def metric(base, name, labels=""):
    text = httpx.get(base + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_completion_and_usage(client):
    r = client.completions.create(model="x", prompt="hello world", max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client):
    msgs = [{"role": "user", "content": "tell me a story"}]
    full = client.chat.completions.create(model="x", messages=msgs, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model="x", messages=msgs, max_tokens=8, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stream_ends_with_done(server):
    body = {"prompt": "abc", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_native_generate_and_stream(server):
    body = {"inputs": [5, 6, 7, 8], "parameters": {"max_new_tokens": 24, "logprobs": True, "ignore_eos": True}}
    r = httpx.post(server + "/generate", json=body, timeout=60).json()
    assert len(r["token_ids"]) == 24 and len(r["logprobs"]) == 24 and all(lp <= 0 for lp in r["logprobs"])
    with httpx.stream("POST", server + "/generate_stream", json=body, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert [e["token"]["id"] for e in events if e["token"]["id"] is not None] == r["token_ids"]
    assert events[-1]["finish_reason"] == "length"
    # streamed deltas (incremental) add up to the text /generate decodes once at the end
    assert "".join(e["token"]["text"] for e in events) == r["generated_text"]


def test_concurrent_requests_match_sequential(server):
    prompts = [[3 + i, 40 + i, 7] for i in range(8)]

    def run(p):
        body = {"inputs": p, "parameters": {"max_new_tokens": 6, "ignore_eos": True}}
        return httpx.post(server + "/generate", json=body, timeout=120).json()["token_ids"]

    sequential = [run(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        concurrent_ = list(pool.map(run, prompts))
    assert concurrent_ == sequential


def test_sampling_seed_and_stop_string(server):
    body = {"inputs": [9, 10, 11], "parameters": {"max_new_tokens": 8, "temperature": 1.0, "seed": 5,
                                                  "ignore_eos": True}}  # fmt: skip
    a = httpx.post(server + "/generate", json=body, timeout=60).json()
    b = httpx.post(server + "/generate", json=body, timeout=60).json()
    assert a["token_ids"] == b["token_ids"]
    greedy = {"inputs": [9, 10, 11], "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    text = httpx.post(server + "/generate", json=greedy, timeout=60).json()["generated_text"]
    at = next(i for i in range(len(text) // 2, len(text)) if text[i].isalnum())  # a stop string mid-output
    stop = text[at]
    greedy["parameters"]["stop"] = [stop, "never-produced"]
    r = httpx.post(server + "/generate", json=greedy, timeout=60).json()
    assert r["finish_reason"] == "stop" and r["generated_text"] == text[: text.index(stop)]
    assert len(r["token_ids"]) < 8


def wait_for_abort(server, aborted_before):
    deadline = time.time() + 15
    while time.time() < deadline:
        done = metric(server, "lightllm_requests_finished_total", '{finish_reason="abort"}') or 0.0
        if done > aborted_before and metric(server, "lightllm_running_batch") == 0:
            return done
        time.sleep(0.05)
    return done


def test_disconnect_mid_stream_frees_kv(server):
    baseline = metric(server, "lightllm_kv_usage_ratio")
    aborted = metric(server, "lightllm_requests_finished_total", '{finish_reason="abort"}') or 0.0
    body = {"prompt": [4, 5, 6], "max_tokens": MAX_LEN - 10, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream: the connection closes
    assert wait_for_abort(server, aborted) > aborted, "the disconnected request was not aborted"
    assert metric(server, "lightllm_kv_usage_ratio") == baseline


def test_disconnect_while_generating_frees_kv(server):
    """Non-streaming: tokens keep arriving for the request, yet the client's departure is still noticed."""
    baseline = metric(server, "lightllm_kv_usage_ratio")
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
        ("/v1/completions", {"prompt": "a", "max_tokens": 2, "bogus": 1}, "bogus"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": -3}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 10**9}, "exceeds max_req_total_len"),
        ("/v1/completions", {"prompt": [1] * (MAX_LEN + 5), "max_tokens": 1}, "max_req_total_len"),
        ("/v1/completions", {"prompt": [10**7], "max_tokens": 1}, "token ids expected"),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, "messages"),
        ("/generate", {"inputs": "a", "parameters": {"top_p": 0}}, "top_p"),
    ],
    ids=["bad-json", "unknown-field", "wrong-type", "negative", "absurd", "too-long", "bad-token", "no-msgs", "top_p"],
)
def test_bad_input_is_400_and_server_keeps_serving(server, path, body, message):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(server + path, timeout=30, **kw)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200
    ok = httpx.post(server + "/generate", json={"inputs": "ok", "parameters": {"max_new_tokens": 1}}, timeout=30)
    assert ok.status_code == 200


def test_models_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["lightllm-tiny-qwen3"]
    text = httpx.get(server + "/metrics").text
    for name in ("lightllm_queue_length", "lightllm_running_batch", "lightllm_generated_tokens_total",
                 "lightllm_time_to_first_token_seconds_bucket", "lightllm_inter_token_latency_seconds_bucket",
                 "lightllm_kv_usage_ratio", 'lightllm_step_seconds_count{kind="decode"}',
                 'lightllm_step_batch_size_sum{kind="prefill"}'):  # fmt: skip
        assert name in text
    assert metric(server, "lightllm_generated_tokens_total") > 0
