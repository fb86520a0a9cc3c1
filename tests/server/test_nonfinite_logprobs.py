"""Logprobs of logits that overflowed (NaN, or -inf everywhere but one token) reach a client as JSON can carry
them: -inf and NaN as -9999.0 (vLLM's floor), never the literals NaN / -Infinity that JavaScript's, Go's and Rust's
parsers refuse, and never a 500 (Starlette's JSONResponse raises on them) that loses the generation."""

import json

import pytest
import torch
from fake_model import VOCAB, FakeRunner, Letters, make_server
from fastapi.testclient import TestClient

from lightllm.server.http_server import Server
from lightllm.server.openai_api import LOGPROB_FLOOR, finite_logprob


def strict(text):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


class OverflowingRunner(FakeRunner):
    """Logits of every row: all NaN, or one token possible (its logprob 0, every other -inf)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def _rows(self, n):
        if self.kind == "nan":
            return torch.full((n, VOCAB), float("nan"))
        rows = torch.full((n, VOCAB), float("-inf"))
        rows[:, 3] = 0.0
        return rows

    def prefill(self, slots, prompts, publish=(), following=()):
        super().prefill(slots, prompts, publish, following)
        return self._rows(len(slots))

    def decode(self, slots, last_tokens):
        super().decode(slots, last_tokens)
        return self._rows(len(slots))


CHAT = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 3}
COMPLETION = {"prompt": "ab", "max_tokens": 2, "logprobs": 3}
NATIVE = {"inputs": "ab", "parameters": {"max_new_tokens": 2, "logprobs": True, "return_details": True}}
ROUTES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION), ("/generate", NATIVE)]


@pytest.mark.parametrize("kind", ["nan", "one token"])
def test_non_finite_logprobs_are_json_whole_and_streamed(kind):
    server = Server(OverflowingRunner(kind), Letters(), "tiny")
    server.prompts.tokenizer = server.tokenizer
    numbers = []
    with TestClient(server.app) as client:
        for path, body in ROUTES:
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text
            numbers.append(strict(r.text))
            native = path == "/generate"
            streamed = client.post(
                path + "_stream" if native else path, json=body if native else {**body, "stream": True}
            )
            lines = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
            assert streamed.status_code == 200 and len(lines) >= 3
            assert all(strict(line) for line in lines if line != "[DONE]")
    chat, completion, native = numbers
    top = chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    expected = LOGPROB_FLOOR if kind == "nan" else 0.0
    assert chat["choices"][0]["logprobs"]["content"][0]["logprob"] == expected
    assert completion["choices"][0]["logprobs"]["token_logprobs"] == [expected] * 2
    assert native["logprobs"] == [expected] * 2 and [t["logprob"] for t in native["tokens"]] == [expected] * 2
    if kind == "one token":
        assert [t["logprob"] for t in top[1:]] == [LOGPROB_FLOOR] * 2  # the impossible alternatives


def test_finite_logprob():
    values = (-0.5, -1e5, float("-inf"), float("nan"), float("inf"), 0.0)
    assert [finite_logprob(x) for x in values] == [-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR, LOGPROB_FLOOR, 0.0, 0.0]


def test_min_tokens_holds_when_every_token_is_a_stop_token():
    """The stop tokens are banned before min_tokens; with every token one, the row has nothing left and yields one
    anyway: it does not end the request before min_tokens (vLLM's stop check waits for min_tokens too)."""
    with TestClient(make_server().app) as client:
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 5, "min_tokens": 3,
                                                 "stop_token_ids": list(range(VOCAB))})  # fmt: skip
    assert (r.status_code, r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (
        200, 3, "stop")  # fmt: skip
