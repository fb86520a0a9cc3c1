"""The OpenAI routes take the fields real clients send (issue 18 item 1): in-process, over a fake model whose
next-token distribution depends on the last token, and a one-letter-per-token tokenizer."""

import json
import logging
import math
from types import SimpleNamespace

import pytest
import torch
from fake_model import WEIGHTS, post, sse

from lightllm.server.openai_api import OpenAIReply


def events(client, path, body):
    return sse(client, path, body)


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "abc"}]


def test_what_real_clients_send_is_accepted(server, client, caplog):
    """Every field of issue 18's list that once got 400 "Extra inputs are not permitted"; an unknown field is
    ignored and logged once per name at debug level."""
    caplog.set_level(logging.DEBUG, logger="lightllm.server.bodies")
    parts = [{"type": "text", "text": "be"}, {"type": "text", "text": "ok"}]
    chat = {"messages": [{"role": "system", "content": parts}, {"role": "user", "name": "ann", "content": "abc"}],
            "max_tokens": 3, "temperature": None, "presence_penalty": 0, "frequency_penalty": 0.5, "logit_bias": {},
            "response_format": {"type": "text"}, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto", "parallel_tool_calls": False, "top_logprobs": 0, "logprobs": False,
            "chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True, "min_tokens": 1,
            "repetition_penalty": 1.1, "stop_token_ids": [2], "stream": False, "n": 1, "user": "u",
            "some_future_field": {"x": 1}}  # fmt: skip
    for _ in range(2):
        assert post(client, CHAT, chat)["choices"][0]["finish_reason"] in ("length", "stop")
    messages, options = server.tokenizer.template_calls[-1]
    assert messages == [{"role": "system", "content": "be\nok"}, {"role": "user", "content": "abc", "name": "ann"}]
    assert options == {"enable_thinking": False, "tools": chat["tools"], "tokenize": False,
                       "add_generation_prompt": True}  # fmt: skip
    p = server.submitted[-1]
    assert (p.temperature, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1.0, 0, 0.5, 1.1)
    assert (p.ignore_eos, p.min_tokens, p.stop_token_ids) == (True, 1, (2,))
    completion = {"prompt": "abc", "max_tokens": 2, "echo": False, "best_of": 1, "suffix": None, "logprobs": None,
                  "logit_bias": {"3": -100}, "top_k": -1, "stream_options": None}  # fmt: skip
    post(client, COMPLETIONS, completion)
    assert server.submitted[-1].logit_bias == {3: -100} and server.submitted[-1].top_k == 0
    ignored = [r.message for r in caplog.records if "some_future_field" in r.message]
    assert ignored == ["ChatRequest: field 'some_future_field' is not used by this server; ignored"]


def test_a_developer_message_reaches_the_template_as_the_system_message(server, client):
    """OpenAI's newer name for the system role: chat templates (Qwen3's) know "system" and skip a role they do not."""
    post(client, CHAT, {"messages": [{"role": "developer", "content": "be brief"}, *MSGS], "max_tokens": 1})
    messages, _ = server.tokenizer.template_calls[-1]
    assert messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abc"}]


def test_a_body_sent_without_a_json_content_type_is_a_400_that_names_the_header(server, client):
    """curl -d sends a form's Content-Type: FastAPI does not parse that as JSON, so the 400 says which was sent."""
    r = client.post(CHAT, content=b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
                    headers={"content-type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("body: expected a JSON object with Content-Type: application/json, got "
                                            "Content-Type 'application/x-www-form-urlencoded'")  # fmt: skip
    assert server.submitted == []


def test_tool_choice_none_leaves_the_tools_out_of_the_template(server, client):
    tools = [{"type": "function", "function": {"name": "f"}}]
    post(client, CHAT, {"messages": MSGS, "max_tokens": 1, "tools": tools, "tool_choice": "none"})
    assert "tools" not in server.tokenizer.template_calls[-1][1]


@pytest.mark.parametrize("path, body, message", [
    (CHAT, {"response_format": {"type": "json_object"}},
     "response_format: type 'json_object' is not supported; 'text' is the only type (there is no constrained"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {}}}, "type 'json_schema' is not supported"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type: 'image_url' is not supported; this server takes text parts only"),
    (CHAT, {"tool_choice": "required"}, "tool_choice: 'required' is not supported (forcing a call needs constrained"),
    (CHAT, {"tools": [{"type": "function"}]}, "tools.0.function: expected an object with a name, got None"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {}}]},
     "tools.1.function.name: expected a non-empty string, got None"),
    (CHAT, {"tools": [{"function": {"name": "f"}}]}, "tools.0.type: expected 'function', got None"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools.0.function.parameters: expected a JSON Schema object, got 'x'"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs: 3 needs logprobs true"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs: Input should be less than or equal to 20"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options: only allowed with stream true"),
    (CHAT, {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs: 'tokenize' is set by the server"),
    (CHAT, {"presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2"),
    (CHAT, {"frequency_penalty": -3}, "frequency_penalty: Input should be greater than or equal to -2"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty: Input should be greater than 0"),
    (CHAT, {"logit_bias": {"99": 1}}, "logit_bias: token ids expected in [0, 16), got [99]"),
    (CHAT, {"logit_bias": {"a": 1}}, "logit_bias: key 'a' is not a token id"),
    (CHAT, {"logit_bias": {"3": 101}}, "logit_bias[3] expected a number in [-100, 100], got 101"),
    (CHAT, {"stop_token_ids": [16]}, "stop_token_ids: token ids expected in [0, 16), got [16]"),
    (CHAT, {"min_tokens": 9, "max_tokens": 4}, "min_tokens expected an integer in [0, max_tokens 4], got 9"),
    (CHAT, {"max_completion_tokens": 500}, "max_completion_tokens: 500 with a 3-token prompt exceeds max_req_total"),
    (CHAT, {"messages": [{"role": "bogus", "content": "x"}]},
     "messages.0.role: 'bogus' is not one of system, developer, user, assistant, tool, function"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "messages.1.tool_calls.0.function: expected an object with a name, got None"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages.0.tool_calls.0.function.name: expected a non-empty string, got None"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]},
     "messages.0.tool_calls.0.function.arguments: expected a JSON string or an object, got 3"),
    (CHAT, {"n": 0}, "n: Input should be greater than or equal to 1"),
    (CHAT, {"temperature": "1"}, "temperature: Input should be a valid number"),
    (CHAT, {"temperature": math.nan}, "temperature: Input should be a finite number"),
    (COMPLETIONS, {"repetition_penalty": math.inf}, "repetition_penalty: Input should be a finite number"),
    (COMPLETIONS, {"logit_bias": {"3": -math.inf}}, "logit_bias.3: Input should be a finite number"),
    (COMPLETIONS, {"suffix": "tail"}, "suffix: not supported (no fill-in-the-middle)"),
    (COMPLETIONS, {"n": 3, "best_of": 2}, "best_of: 2 is less than n 3; best_of must be >= n"),
    (COMPLETIONS, {"best_of": 2, "stream": True}, "best_of: 2 > n 1 cannot be streamed"),
    (COMPLETIONS, {"echo": True, "logprobs": 1}, "echo with logprobs: prompt token logprobs are not supported; the"),
    (COMPLETIONS, {"logprobs": 21}, "logprobs: Input should be less than or equal to 20"),
    (COMPLETIONS, {"prompt": []}, "prompt: expected a string, token ids, or a non-empty list of either"),
    (COMPLETIONS, {"prompt": ["ab", "c" * 70]}, "prompt.1: 70 tokens, max_req_total_len is 64"),
    (COMPLETIONS, {"prompt": [[1, 2], [99]]}, "prompt.1: token ids expected in [0, 16)"),
    (COMPLETIONS, {"prompt": ["a"] * 3, "n": 100}, "prompt: 3 prompt(s) x 100 samples (n or best_of) is more than"),
], ids=["json_object", "json_schema", "image-part", "tool-required", "tool-no-function",
        "tool-no-name", "tool-no-type", "tool-parameters", "top-without-logprobs", "top-21",
        "stream-options", "template-kwargs", "presence", "frequency", "repetition", "bias-id", "bias-key",
        "bias-value", "stop-id", "min-tokens", "max-completion-tokens", "role", "call-no-function", "call-no-name",
        "call-arguments", "n-0", "temperature-str", "temperature-nan", "penalty-inf", "bias-inf", "suffix",
        "best-of-lt-n", "best-of-stream", "echo-logprobs", "logprobs-21", "no-prompts", "long-prompt", "bad-id",
        "too-many"])  # fmt: skip
def test_what_this_server_cannot_do_is_a_400_that_says_so(server, client, path, body, message):
    base = {"messages": MSGS, "max_tokens": 2} if path == CHAT else {"prompt": "abc", "max_tokens": 2}
    # json.dumps writes NaN and Infinity, which the server's JSON parser reads; httpx's json= refuses them
    r = client.post(path, content=json.dumps({**base, **body}), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"], r.text
    assert server.submitted == []


def test_stream_usage_only_with_include_usage_and_in_its_own_chunk(client):
    for path, base in ((CHAT, {"messages": MSGS}), (COMPLETIONS, {"prompt": "abc"})):
        body = {**base, "max_tokens": 4, "stream": True, "ignore_eos": True}
        plain = events(client, path, body)
        assert all("usage" not in e for e in plain)
        with_usage = events(client, path, {**body, "stream_options": {"include_usage": True}})
        *chunks, last = with_usage
        assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                           "total_tokens": 7,
                                                           "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and all("usage" not in e for e in chunks)


def test_n_and_list_prompts_give_one_choice_per_prompt_and_sample_in_order(server, client):
    body = {"prompt": ["ab", [3, 4, 5]], "n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 9, "ignore_eos": True}
    r = post(client, COMPLETIONS, body)
    assert [c["index"] for c in r["choices"]] == list(range(6))
    usage = dict(r["usage"])
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert usage == {"prompt_tokens": 5, "completion_tokens": 24, "total_tokens": 29}
    # a prompt counts its samples' smallest hit once: what its first computation read (nothing, these are new)
    assert cached == 0
    # choice p * n + j is prompt p with seed 9 + j: the same text as that request alone
    for p, prompt in enumerate(body["prompt"]):
        for j in range(3):
            alone = post(client, COMPLETIONS, {**body, "prompt": prompt, "n": 1, "seed": 9 + j})
            assert r["choices"][p * 3 + j]["text"] == alone["choices"][0]["text"]
    assert len({c["text"] for c in r["choices"][:3]}) > 1, "the samples of one prompt differ"
    streamed = events(client, COMPLETIONS, {**body, "stream": True})
    texts = {}
    for e in streamed:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(6)] == [c["text"] for c in r["choices"]]
    chat = post(client, CHAT, {"messages": MSGS, "n": 2, "max_tokens": 3, "temperature": 1.0, "seed": 1})
    assert [c["index"] for c in chat["choices"]] == [0, 1]


def test_usage_counts_each_prompt_s_smallest_hit_among_its_samples():
    """n > 1 with unequal hits: each prompt counts once in prompt_tokens, so its hits count once too, the smallest of
    its samples' (what its first computation read; the later samples read what that one computed). The reply alone,
    without a server."""
    reply = OpenAIReply(SimpleNamespace(tokenizer=None, model_name="m"), False, [[1, 2, 3, 4], [5, 6, 7]], 3, 3, None,
                        False)  # fmt: skip
    usage = reply._usage(12, [0, 3, 3, 2, 1, 2])
    assert usage == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19,
                     "prompt_tokens_details": {"cached_tokens": 1}}  # fmt: skip


def cumulative(client, prompt, seed):
    r = post(client, COMPLETIONS, {"prompt": prompt, "max_tokens": 5, "temperature": 1.0, "seed": seed,
                                   "logprobs": 0, "ignore_eos": True})  # fmt: skip
    return sum(r["choices"][0]["logprobs"]["token_logprobs"]), r["choices"][0]["text"]


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(client):
    samples = sorted((cumulative(client, "ab", 20 + j) for j in range(6)), reverse=True)
    assert len({text for _, text in samples}) > 2
    r = post(client, COMPLETIONS, {"prompt": "ab", "max_tokens": 5, "temperature": 1.0, "seed": 20, "n": 2,
                                   "best_of": 6, "ignore_eos": True})  # fmt: skip
    assert [c["text"] for c in r["choices"]] == [text for _, text in samples[:2]]
    assert r["usage"]["completion_tokens"] == 30  # every sample generated counts


def test_logprobs_and_top_logprobs_whole_and_streamed(client):
    want = torch.log_softmax(WEIGHTS.double(), -1)
    chat = post(client, CHAT, {"messages": MSGS, "max_tokens": 3, "temperature": 0, "logprobs": True,
                               "top_logprobs": 2, "ignore_eos": True})  # fmt: skip
    content = chat["choices"][0]["logprobs"]["content"]
    text = chat["choices"][0]["message"]["content"]
    prev = 2  # the prompt's last token ("c")
    for entry, letter in zip(content, text):
        tok = ord(letter) - 97
        assert entry["token"] == letter and entry["bytes"] == [ord(letter)]
        assert entry["logprob"] == pytest.approx(want[prev, tok].item(), abs=1e-5)
        top = want[prev].topk(2)
        assert [e["token"] for e in entry["top_logprobs"]] == [chr(97 + i) for i in top.indices.tolist()]
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-5)
        prev = tok
    streamed = events(client, CHAT, {"messages": MSGS, "max_tokens": 3, "temperature": 0, "logprobs": True,
                                     "top_logprobs": 2, "stream": True, "ignore_eos": True})  # fmt: skip
    assert [e for c in streamed for e in (c["choices"][0]["logprobs"] or {"content": []})["content"]] == content
    comp = post(client, COMPLETIONS, {"prompt": "no", "max_tokens": 3, "temperature": 0, "logprobs": 2,
                                      "echo": False, "ignore_eos": True})["choices"][0]  # fmt: skip
    lp = comp["logprobs"]
    assert lp["tokens"] == list(comp["text"]) and lp["text_offset"] == [0, 1, 2]
    for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == chosen and len(top) == 2  # greedy: the chosen token is the most likely
    streamed = events(client, COMPLETIONS, {"prompt": "no", "max_tokens": 3, "temperature": 0, "logprobs": 2,
                                            "stream": True, "ignore_eos": True})  # fmt: skip
    blocks = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["logprobs"]]
    assert [b["tokens"][0] for b in blocks] == lp["tokens"] and [b["text_offset"][0] for b in blocks] == [0, 1, 2]


def test_echo_puts_the_prompt_before_the_completion(client):
    for prompt, text in (("abc", "abc"), ([0, 1, 2], "abc")):
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "ignore_eos": True}
        plain = post(client, COMPLETIONS, {**body, "echo": False})["choices"][0]["text"]
        assert post(client, COMPLETIONS, body)["choices"][0]["text"] == text + plain
        streamed = events(client, COMPLETIONS, {**body, "stream": True})
        assert "".join(c["choices"][0]["text"] for c in streamed) == text + plain


def test_penalties_and_bias_reach_the_draw(client):
    body = {"prompt": "a", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = post(client, COMPLETIONS, body)["choices"][0]["text"]
    assert len(set(plain)) < len(plain), "greedy repeats itself on this model"
    fresh = post(client, COMPLETIONS, {**body, "frequency_penalty": 2.0, "presence_penalty": 2.0,
                                       "repetition_penalty": 50.0})["choices"][0]["text"]  # fmt: skip
    assert len(set(fresh)) == len(fresh) == 12 and "a" not in fresh
    forced = post(client, COMPLETIONS, {**body, "logit_bias": {"7": 100}})["choices"][0]["text"]
    assert forced == "h" * 12


def test_usage_reports_the_prompt_tokens_read_from_the_prefix_cache(client):
    """The second identical prompt reuses all but its last token (computed for its logits), whole or streamed, and
    /metrics counts them beside all the prompt tokens (the hit rate)."""
    body = {"prompt": "abcdef", "max_tokens": 2, "ignore_eos": True}
    assert post(client, COMPLETIONS, body)["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert post(client, COMPLETIONS, body)["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    last = events(client, COMPLETIONS, {**body, "stream": True, "stream_options": {"include_usage": True}})[-1]
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    metrics = client.get("/metrics").text
    assert "lightllm_prompt_cached_tokens_total 10.0" in metrics and "lightllm_prompt_tokens_total 18.0" in metrics
