"""A streamed response whose body fails while it is being made ends with an error event (and ``[DONE]`` on the
OpenAI routes), as vLLM's do, not with the connection cut mid-body; the server goes on serving."""

import json

import pytest
from fake_model import make_scripted_server
from fastapi.testclient import TestClient

from lightllm.server import http_server, tool_calls

ERROR = {"message": "internal error (RuntimeError); the server log has the details", "type": "server_error",
         "code": 500}  # fmt: skip


def fail(*args, **kwargs):
    raise RuntimeError("boom")


def events(client, path, body):
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


@pytest.mark.parametrize("route", ["chat", "native"])
def test_a_failing_stream_ends_with_an_error_event(monkeypatch, route):
    server = make_scripted_server(tool_call_parser="hermes")
    if route == "chat":  # fails at the first token, after the role chunk went out
        monkeypatch.setattr(tool_calls.ToolCallExtractor, "add", fail)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "tools": tools}
    else:
        monkeypatch.setattr(http_server, "_token_event", fail)
        path, body = "/generate_stream", {"inputs": "abc\x1e", "parameters": {"max_new_tokens": 8}}
    with TestClient(server.app) as client:
        lines = events(client, path, {**body, "stream": True, "max_tokens": 8} if route == "chat" else body)
        after = client.post("/v1/completions", json={"prompt": "ok\x1e", "max_tokens": 4})  # the server goes on
        assert (after.status_code, after.json()["choices"][0]["text"]) == (200, "ok")
    if route == "chat":
        assert json.loads(lines[0].removeprefix("data:"))["choices"][0]["delta"]["role"] == "assistant"
        assert lines[-1] == "data: [DONE]"
        lines.pop()
    assert json.loads(lines[-1].removeprefix("data:")) == {"error": ERROR}
