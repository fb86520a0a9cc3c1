"""Logprobs of logits that overflowed (NaN, or -inf everywhere but one token) reach a client as JSON can carry
them: -inf and NaN as -9999.0 (vLLM's floor), never the literals NaN / -Infinity that JavaScript's, Go's and Rust's
parsers refuse, and never a 500 (Starlette's JSONResponse raises on them) that loses the generation."""

import json

import pytest
import torch
from fake_model import VOCAB, FakeRunner, Letters, make_server, sse
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

    def logits_after(self, last_tokens):
        if self.kind == "nan":
            return torch.full((len(last_tokens), VOCAB), float("nan"))
        rows = torch.full((len(last_tokens), VOCAB), float("-inf"))
        rows[:, 3] = 0.0
        return rows


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
    anyway: it does not end the request before min_tokens (vLLM's stop check waits for min_tokens too), and its text
    stays, the same text whole, streamed, and with a stop string."""
    body = {"prompt": "ab", "max_tokens": 5, "min_tokens": 3, "stop_token_ids": list(range(VOCAB))}
    with TestClient(make_server().app) as client:
        r = client.post("/v1/completions", json=body).json()
        with_stop_string = client.post("/v1/completions", json={**body, "stop": ["zzz"]}).json()
        streamed = sse(client, "/v1/completions", {**body, "stream": True})
    assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (3, "stop")
    text = r["choices"][0]["text"]
    assert len(text) == 2 and with_stop_string["choices"][0]["text"] == text  # the third, the stop token, hidden
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == text


def test_stop_strings_wait_for_min_tokens():
    """As vLLM's: a stop string is looked for only in the text after the first min_tokens tokens."""
    base = {"prompt": "ab", "max_tokens": 10, "temperature": 0}
    with TestClient(make_server().app) as client:
        free = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
        r = client.post("/v1/completions", json={**base, "min_tokens": 6, "stop": [free[0]]}).json()
        streamed = sse(client, "/v1/completions", {**base, "min_tokens": 6, "stop": [free[0]], "stream": True})
    text = r["choices"][0]["text"]
    assert r["usage"]["completion_tokens"] >= 6 and text.startswith(free[:6]) and free[0] not in text[6:]
    assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]) == text


class FirstSampleOverflows(FakeRunner):
    """The decode rows of the first request to decode are NaN (its slot's, until it is freed: a later request may
    reuse the slot)."""

    bad = None

    def decode(self, slots, last_tokens):
        rows = super().decode(slots, last_tokens)
        self.bad = min(slots) if self.bad is None else self.bad
        rows[[i for i, slot in enumerate(slots) if slot == self.bad]] = float("nan")
        return rows

    def free(self, slot, last_token=None):
        if slot == self.bad:
            self.bad = -1
        super().free(slot, last_token)


def test_best_of_ranks_on_the_logprobs_the_client_sees():
    server = Server(FirstSampleOverflows(), Letters(), "tiny")
    server.prompts.tokenizer = server.tokenizer
    with TestClient(server.app) as client:
        r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4, "best_of": 2, "temperature": 1.0,
                                                 "logprobs": 0}).json()  # fmt: skip
    assert LOGPROB_FLOOR not in r["choices"][0]["logprobs"]["token_logprobs"]
