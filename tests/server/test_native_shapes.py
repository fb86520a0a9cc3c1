"""``/generate`` and ``/generate_stream`` in LightLLM's request and response shapes (issue 18 item 4): in-process,
over the fake model of ``fake_model.py`` (token i is the letter chr(97 + i); token 15, "p", is special)."""

from types import SimpleNamespace

import pytest
import torch
from fake_model import WEIGHTS, FakeRunner, make_scripted_server, post, sse
from fastapi.testclient import TestClient

from lightllm.server.http_server import Server
from lightllm.tools.make_tiny_model import _build_tokenizer

GENERATE, STREAM = "/generate", "/generate_stream"


def test_generate_answers_in_lightllms_shape_with_details(client):
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 5, "ignore_eos": True, "return_details": True}}
    r = post(client, GENERATE, body)
    text = r["generated_text"][0]
    assert isinstance(r["generated_text"], list) and len(text) == 5
    assert (r["count_output_tokens"], r["finish_reason"], r["prompt_tokens"]) == (5, "length", 3)
    want = torch.log_softmax(WEIGHTS.double(), -1)
    prev = 2
    for detail, letter in zip(r["tokens"], text):
        tok = ord(letter) - 97
        assert (detail["id"], detail["text"], detail["special"]) == (tok, letter, tok == 15)
        assert detail["logprob"] == pytest.approx(want[prev, tok].item(), abs=1e-5)
        prev = tok
    assert "tokens" not in post(client, GENERATE, {**body, "parameters": {"max_new_tokens": 2}})


def test_generate_stream_events_in_lightllms_shape(client):
    body = {"inputs": "abc", "parameters": {"max_new_tokens": 4, "ignore_eos": True, "return_details": True}}
    whole = post(client, GENERATE, body)
    events = sse(client, STREAM, body, done=False)
    *tokens, last = events
    assert [e["token"]["id"] for e in tokens] == [t["id"] for t in whole["tokens"]]
    assert [e["token"]["count_output_tokens"] for e in tokens] == [1, 2, 3, 4]
    for e in tokens:
        assert set(e["token"]) == {"id", "text", "logprob", "special", "count_output_tokens", "prompt_tokens"}
        assert (e["finished"], e["finish_reason"], e["generated_text"], e["details"]) == (False, None, None, None)
    assert last["finished"] is True and last["finish_reason"] == "length" and last["token"]["id"] is None
    assert last["generated_text"] == whole["generated_text"][0]
    assert last["details"] == {"finish_reason": "length", "count_output_tokens": 4, "prompt_tokens": 3}


def test_do_sample_and_stop_sequences(server, client):
    greedy = post(client, GENERATE, {"inputs": "abc", "parameters": {"max_new_tokens": 8, "ignore_eos": True}})
    text = greedy["generated_text"][0]
    # do_sample false is greedy whatever the temperature; true samples at the temperature (1 by default)
    forced = post(
        client,
        GENERATE,
        {
            "inputs": "abc",
            "parameters": {"max_new_tokens": 8, "ignore_eos": True, "do_sample": False, "temperature": 5.0},
        },
    )
    assert forced["generated_text"] == [text] and server.submitted[-1].temperature == 0
    post(client, GENERATE, {"inputs": "abc", "parameters": {"max_new_tokens": 2, "do_sample": True, "seed": 3}})
    assert server.submitted[-1].temperature == 1.0
    stop = text[3]
    cut = post(
        client,
        GENERATE,
        {
            "inputs": "abc",
            "parameters": {"max_new_tokens": 8, "ignore_eos": True, "stop_sequences": [stop], "top_k": -1},
        },
    )
    assert cut["finish_reason"] == "stop" and cut["generated_text"] == [text[: text.index(stop)]]


@pytest.mark.parametrize("parameters, message", [
    ({"do_sample": 1}, "parameters.do_sample: Input should be a valid boolean"),
    ({"top_k": -2}, "parameters.top_k: Input should be greater than or equal to -1"),
    ({"stop_sequences": [""]}, "parameters.stop_sequences: expected non-empty strings"),
    ({"repetition_penalty": 0}, "parameters.repetition_penalty: Input should be greater than 0"),
    ({"min_new_tokens": 5, "max_new_tokens": 2},
     "parameters.min_new_tokens expected an integer in [0, parameters.max_new_tokens 2], got 5"),
    ({"max_new_tokens": 500}, "parameters.max_new_tokens: 500 with a 3-token prompt exceeds max_req_total_len"),
], ids=["do-sample", "top-k", "empty-stop", "repetition", "min-new-tokens", "max-new-tokens"])  # fmt: skip
def test_bad_native_parameters_are_a_400_naming_them(server, client, parameters, message):
    r = client.post(GENERATE, json={"inputs": "abc", "parameters": parameters})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert server.submitted == []


@pytest.fixture
def scripted():
    with TestClient(make_scripted_server().app) as client:
        yield client


def test_a_stop_sequence_that_is_a_special_tokens_text_stops_on_it(scripted):
    """As LightLLM's (stop sequences matched as token ids): with special tokens skipped from the text, a text match
    never saw it and the request ran on to max_new_tokens. (Chars: id 0, "\\x00", is the special token.)"""
    body = {"inputs": "ab\x00cd\x1e", "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    assert post(scripted, GENERATE, body)["finish_reason"] == "length"
    r = post(scripted, GENERATE, {**body, "parameters": {**body["parameters"], "stop_sequences": ["\x00"]}})
    assert (r["finish_reason"], r["count_output_tokens"], r["generated_text"]) == ("stop", 3, ["ab"])


def test_min_new_tokens_counts_the_eos_as_lightllm_does(scripted):
    """The answer "ab" then EOS: with min_new_tokens 3 the EOS may be the third token (LightLLM holds EOS back while
    fewer than min_new_tokens - 1 tokens exist); 4 holds it back once."""
    body = {"inputs": "ab\x1e", "parameters": {"max_new_tokens": 6, "min_new_tokens": 3}}
    r = post(scripted, GENERATE, body)
    assert (r["finish_reason"], r["count_output_tokens"], r["generated_text"]) == ("stop", 3, ["ab"])
    r = post(scripted, GENERATE, {**body, "parameters": {**body["parameters"], "min_new_tokens": 4}})
    assert r["count_output_tokens"] > 3


def test_add_special_tokens_is_accepted(scripted):
    """LightLLM's benchmark client sends it (false); a tokenizer without a BOS (Qwen's) gives the same ids."""
    body = {"inputs": "ab\x1e", "parameters": {"max_new_tokens": 4, "add_special_tokens": False}}
    assert post(scripted, GENERATE, body)["generated_text"] == ["ab"]


def test_a_stop_sequence_of_an_added_special_token_stops_on_it():
    """The tiny model's tokenizer marks <|im_start|> special (skipped from the text) without listing it in
    all_special_ids: a native stop sequence of its text still stops on it, and details call it special."""
    tok = _build_tokenizer(512, 4096)
    letter, im_start = tok.encode("hi")[0], tok.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in tok.all_special_ids

    class Alternating(FakeRunner):  # a letter, <|im_start|>, a letter, ...
        def __init__(self):
            super().__init__()
            self.config = SimpleNamespace(eos_token_ids=(), vocab_size=len(tok))

        def logits_after(self, last_tokens):
            rows = torch.full((len(last_tokens), len(tok)), -1e4)
            rows[range(len(last_tokens)), [im_start if t == letter else letter for t in last_tokens]] = 1e4
            return rows

    with TestClient(Server(Alternating(), tok, "tiny").app) as client:
        r = post(client, GENERATE, {"inputs": "hi", "parameters": {"max_new_tokens": 8, "return_details": True,
                                                                   "stop_sequences": ["<|im_start|>"]}})  # fmt: skip
    assert (r["finish_reason"], r["count_output_tokens"]) == ("stop", 2)
    assert [t["special"] for t in r["tokens"]] == [False, True]
