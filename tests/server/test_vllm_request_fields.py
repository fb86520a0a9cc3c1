"""vLLM's request fields real clients send: the text options (``skip_special_tokens``, ``include_stop_str_in_output``)
and the chat template's (``add_generation_prompt``, ``continue_final_message``) do what vLLM documents; the ones for
what this server does not do (constrained decoding, beam search, prompt logprobs, ...) are a 400 naming them, never
ignored with a 200. And the 400s of bodies that are not what a field takes name the field and what it takes."""

import asyncio
import json

import pytest
from fake_model import Chars, ScriptedRunner, make_scripted_server, post, sse
from fastapi.testclient import TestClient

from lightllm.server import bodies
from lightllm.server.http_server import Server
from lightllm.server.prompts import PromptEncoder
from lightllm.tools.make_tiny_model import _build_tokenizer

ANSWER = "Hi yo\n\nmore"  # ScriptedRunner answers this, one character a token, then EOS (token 0, special)
COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"


@pytest.fixture(scope="module")
def scripted():
    with TestClient(make_scripted_server().app) as c:
        yield c


def texts(client, **extra):
    """The completion's text whole and streamed (the stream's deltas joined), and their finish reasons."""
    body = {"prompt": ANSWER + chr(30), "max_tokens": 20, **extra}
    whole = post(client, COMPLETIONS, body)["choices"][0]
    chunks = [e["choices"][0] for e in sse(client, COMPLETIONS, {**body, "stream": True}) if e["choices"]]
    return (whole["text"], whole["finish_reason"]), ("".join(c["text"] for c in chunks), chunks[-1]["finish_reason"])


@pytest.mark.parametrize(
    "extra, text",
    [
        ({}, ANSWER),
        ({"skip_special_tokens": False}, ANSWER),  # EOS's text is left out (vLLM) unless asked for
        ({"skip_special_tokens": False, "include_stop_str_in_output": True}, ANSWER + "\x00"),
        ({"include_stop_str_in_output": True}, ANSWER),  # EOS is special: skipped
        ({"stop": ["yo"]}, "Hi "),
        ({"stop": ["yo"], "include_stop_str_in_output": True}, "Hi yo"),
        ({"stop": ["o", "yo\n"], "include_stop_str_in_output": True}, "Hi yo"),  # the first to be complete
        ({"stop": ["yo", "y"], "include_stop_str_in_output": True}, "Hi y"),
        ({"stop": ["i y", "y"], "include_stop_str_in_output": True}, "Hi y"),  # both end there: the longer
        ({"stop_token_ids": [ord("y")]}, "Hi "),  # the stop token's text is left out (vLLM)
        ({"stop_token_ids": [ord("y")], "include_stop_str_in_output": True}, "Hi y"),
    ],
)
def test_text_options_whole_and_streamed(scripted, extra, text):
    whole, streamed = texts(scripted, **extra)
    assert whole == streamed == (text, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_report_the_stop_token_and_offsets_follow_the_texts_rules(scripted, stream):
    """The stop token's text is left out of the text but the token is the completion's: its logprob is reported (a
    stop string that never matches changes nothing). With special tokens kept, each one's text has its width."""

    def logprobs(**extra):
        body = {"prompt": "ab" + chr(30), "max_tokens": 4, "logprobs": 0, **extra}
        if not stream:
            choice = post(scripted, COMPLETIONS, body)["choices"][0]
            return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
        chunks = [e["choices"][0] for e in sse(scripted, COMPLETIONS, {**body, "stream": True}) if e["choices"]]
        lps = [c["logprobs"] for c in chunks if c["logprobs"]]
        return (
            "".join(c["text"] for c in chunks),
            sum((lp["tokens"] for lp in lps), []),
            sum((lp["text_offset"] for lp in lps), []),
        )

    for stop in [], ["zzz"]:
        assert logprobs(stop_token_ids=[ord("b")], stop=stop) == ("a", ["a", "b"], [0, 1])
        assert logprobs(stop=stop) == ("ab", ["a", "b", "\x00"], [0, 1, 2])  # EOS: special, left out either way
    kept = logprobs(ignore_eos=True, skip_special_tokens=False)
    assert kept == ("ab\x00\x00", ["a", "b", "\x00", "\x00"], [0, 1, 2, 3])
    assert logprobs(ignore_eos=True) == ("ab", ["a", "b", "\x00", "\x00"], [0, 1, 2, 2])


def test_native_generate_keeps_special_tokens_when_asked(scripted):
    body = {"inputs": ANSWER + chr(30), "parameters": {"max_new_tokens": 20, "skip_special_tokens": False}}
    assert post(scripted, GENERATE, body)["generated_text"] == [ANSWER]  # EOS ends it: its text is left out
    body["parameters"]["stop"] = "yo"
    assert post(scripted, GENERATE, body)["generated_text"] == ["Hi "]


def test_offline_and_served_sampling_params_take_the_text_options():
    from lightllm.engine.sampler import SamplingParams

    with pytest.raises(ValueError, match="skip_special_tokens expected a bool, got 0"):
        SamplingParams(skip_special_tokens=0)
    with pytest.raises(ValueError, match="include_stop_str_in_output expected a bool"):
        SamplingParams(include_stop_str_in_output="yes")


def test_continue_final_message_and_add_generation_prompt_reach_the_template(server, client):
    msgs = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "de"}]
    post(client, CHAT, {"messages": msgs, "max_tokens": 1, "continue_final_message": True})
    assert server.tokenizer.template_calls[-1][1] == {"continue_final_message": True, "add_generation_prompt": False,
                                                      "tokenize": False}  # fmt: skip
    post(client, CHAT, {"messages": msgs, "max_tokens": 1, "add_generation_prompt": False})
    assert server.tokenizer.template_calls[-1][1] == {"add_generation_prompt": False, "tokenize": False}
    post(client, CHAT, {"messages": msgs, "max_tokens": 1, "add_generation_prompt": True})
    assert server.tokenizer.template_calls[-1][1] == {"add_generation_prompt": True, "tokenize": False}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message: true needs "
         "add_generation_prompt false (the answer continues the last message instead of opening a new one)"),
        ({"continue_final_message": True, "messages": [{"role": "user", "content": "a"}]}, "continue_final_message: "
         "the last message must be the assistant's to continue, got role 'user'"),
        ({"chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs: 'continue_final_message' "
         "is set by the server; it may not be passed (send it as the request's own field)"),
        ({"chat_template": "{{ messages }}"}, "chat_template: a request's own chat template is not supported; the "
         "server renders with the model's template or the one --chat_template names; leave it out or send null"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs: 'chat_template' is set by the "
         "server; it may not be passed"),  # no hint to send it as a field: that is refused too
    ],
)  # fmt: skip
def test_bad_chat_template_flags_are_a_400(server, client, extra, message):
    msgs = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "de"}]
    r = client.post(CHAT, json={"messages": msgs, "max_tokens": 1, **extra})
    assert (r.status_code, r.json()["error"]["message"]) == (400, message)
    assert server.submitted == []


def test_continue_final_message_continues_the_answer_in_a_real_template():
    """The tiny model's Qwen-style template: the prompt ends with the assistant's text, no end of turn after it."""
    prompts = PromptEncoder(_build_tokenizer(512, 4096), 4096)
    msgs = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Sure, "}]
    ids = asyncio.run(prompts.encode_chat(msgs, {"continue_final_message": True, "add_generation_prompt": False}))
    assert prompts.tokenizer.decode(ids).endswith("<|im_start|>assistant\nSure, ")
    new_turn = prompts.tokenizer.decode(asyncio.run(prompts.encode_chat(msgs, {})))
    assert new_turn.endswith("Sure, <|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "path, extra, name",
    [
        (COMPLETIONS, {"guided_json": {"type": "object"}}, "guided_json"),
        (COMPLETIONS, {"guided_choice": ["yes", "no"]}, "guided_choice"),
        (CHAT, {"guided_regex": "a+"}, "guided_regex"),
        (CHAT, {"structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
        (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
        (COMPLETIONS, {"prompt_logprobs": 1}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt_logprobs": 0}, "prompt_logprobs"),  # 0: the prompt tokens' own logprobs
        (CHAT, {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        (COMPLETIONS, {"bad_words": ["x"]}, "bad_words"),
        (CHAT, {"echo": True}, "echo"),
        (CHAT, {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    ],
)  # fmt: skip
def test_vllm_fields_for_what_this_server_does_not_do_are_a_400(server, client, path, extra, name):
    base = {"prompt": "abc"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "abc"}]}
    r = client.post(path, json={**base, "max_tokens": 1, **extra})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{name}: not supported")
    assert server.submitted == []
    off = {k: (False if k == "use_beam_search" else None) for k in extra}
    post(client, path, {**base, "max_tokens": 1, **off})  # left at the default: accepted


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, client):
    long = "abcdefghij" * 10  # 100 tokens: past max_req_total_len (64) whole
    out = post(client, COMPLETIONS, {"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 8, "echo": True})
    assert out["usage"]["prompt_tokens"] == 8 and out["choices"][0]["text"].startswith(long[-8:])
    assert not out["choices"][0]["text"].startswith(long[-9:])
    post(client, CHAT, {"messages": [{"role": "user", "content": long}], "max_tokens": 2, "truncate_prompt_tokens": 5})
    assert server.submitted[-1].max_new_tokens == 2
    r = client.post(COMPLETIONS, json={"prompt": long, "max_tokens": 2, "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("truncate_prompt_tokens: Input should be")
    r = client.post(COMPLETIONS, json={"prompt": long, "max_tokens": 2})
    assert r.status_code == 400 and "max_req_total_len" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_continuous_usage_stats_put_each_choices_usage_in_each_chunk(client, path):
    base = {"prompt": "abc"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "abc"}]}
    body = {**base, "max_tokens": 4, "n": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = sse(client, path, body)
    seen = {0: [], 1: []}
    for e in events[:-1]:
        (choice,) = e["choices"]
        seen[choice["index"]].append(e["usage"])
    for usages in seen.values():
        produced = [u["completion_tokens"] for u in usages]
        assert produced == sorted(produced) and produced[-1] == 4 and produced[0] == (0 if path == CHAT else 1)
        assert all(u["prompt_tokens"] == 3 and u["total_tokens"] == 3 + u["completion_tokens"] for u in usages)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    plain = sse(client, path, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in e for e in plain[:-1])


@pytest.mark.parametrize(
    "raw, message",
    [
        (json.dumps(json.dumps({"prompt": "hi"})), "body: expected a JSON object, got a JSON string (was the body "
         "JSON-encoded twice?)"),
        ("[1, 2]", "body: expected a JSON object, got a JSON array"),
        ("null", "body: expected a JSON object, got null or an empty body"),
        ('{"prompt": "hi", "\\ud800": 1}', "body: holds a string that is not valid Unicode (a lone surrogate escape "
         "such as \\ud800)"),
    ],
)  # fmt: skip
def test_a_json_body_that_is_not_an_object_is_a_400_saying_what_it_is(client, raw, message):
    r = client.post(COMPLETIONS, content=raw.encode(), headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["message"]) == (400, message)


@pytest.mark.parametrize(
    "path, body, message",
    [
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content: expected a string, null, or a "
         'list of text parts ({"type": "text", "text": "..."}), got 5'),
        (CHAT, {"messages": [{"role": "user", "content": [{"text": "Hi"}]}]},
         "messages.0.content.0.type: Field required"),
        (COMPLETIONS, {"prompt": [1, "a"]}, "prompt: expected a string, a list of token ids, or a non-empty list of "
         "strings or token-id lists, got [1, 'a']"),
        (COMPLETIONS, {"prompt": "a", "stop": [1]}, "stop.0: Input should be a valid string"),
        (COMPLETIONS, {"prompt": [[1, 2], [3, [4]]]}, "prompt.1.1: Input should be a valid integer"),
        (COMPLETIONS, {"prompt": "a", "logit_bias": {"list": "x"}}, "logit_bias.list: Input should be a valid number"),
        (CHAT, {"messages": [{"role": "user", "content": "a"}], "tool_choice": 5},
         "tool_choice: expected 'auto', 'none' or an object, got 5"),
        (GENERATE, {"inputs": 3.5}, "inputs: expected a string or a list of token ids, got 3.5"),
        (COMPLETIONS, {"prompt": "a", "min_tokens": 5, "max_tokens": 3},
         "min_tokens expected an integer in [0, max_tokens 3], got 5"),
        (CHAT, {"messages": [{"role": "user", "content": "a"}], "min_tokens": 5, "max_completion_tokens": 3},
         "min_tokens expected an integer in [0, max_completion_tokens 3], got 5"),
        (GENERATE, {"inputs": "a", "parameters": {"stop": ["x"] * 10, "stop_sequences": ["y"] * 10}},
         "parameters.stop and stop_sequences together: at most 16 strings, got 20"),
    ],
)  # fmt: skip
def test_400s_name_the_field_the_client_sent_and_what_it_takes(server, client, path, body, message):
    r = client.post(path, json=body)
    assert (r.status_code, r.json()["error"]["message"]) == (400, message)
    assert server.submitted == []


def test_unknown_field_names_logged_are_bounded(client, monkeypatch):
    """Clients choose unknown names: the once-per-name log keeps at most MAX_IGNORED_LOGGED of them, each cut short."""
    monkeypatch.setattr(bodies, "_ignored_logged", set())
    body = {
        "prompt": "abc",
        "max_tokens": 1,
        **{f"x{i}" + "y" * 1000: 1 for i in range(bodies.MAX_IGNORED_LOGGED + 50)},
    }
    post(client, COMPLETIONS, body)
    post(client, COMPLETIONS, {**body, **{f"z{i}": 1 for i in range(100)}})
    assert len(bodies._ignored_logged) == bodies.MAX_IGNORED_LOGGED
    assert max(len(k) for k in bodies._ignored_logged) <= len("CompletionRequest.") + bodies._NAME_SHOWN


class ChatML(Chars):
    """A Qwen3-like ChatML template over ``Chars``: the first (system) message is the scripted answer, before ``SEP``;
    ``continue_final_message`` leaves the last message open, as transformers renders it."""

    def apply_chat_template(self, messages, add_generation_prompt=False, continue_final_message=False, **kw):
        out = messages[0]["content"] + chr(Chars.SEP)
        for i, m in enumerate(messages[1:]):
            out += f"<|im_start|>{m['role']}\n{m['content']}"
            if not (continue_final_message and i == len(messages) - 2):
                out += "<|im_end|>\n"
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.mark.parametrize(
    "parser, prefill, answer, split",
    [
        ("qwen3", "<think>\nplan", "more</think>\n\nok", ("more", "ok")),  # the prefill opened the reasoning
        ("qwen3", "<think>x</think>\n\nIt is", " 42.", (None, " 42.")),
        ("deepseek-r1", "<think>x</think>\n\nIt is", " 42.", (None, " 42.")),  # the prefill closed it already
        ("qwen3-thinking", "<think>x</think>\n\nIt is", " 42.", (None, " 42.")),
        ("deepseek-r1", "Sure, ", "hmm</think>ok", ("hmm", "ok")),  # nothing closed: as always, inside the reasoning
    ],
)
def test_a_continued_assistant_message_decides_where_the_answer_starts(parser, prefill, answer, split):
    server = Server(ScriptedRunner(), ChatML(), "tiny", reasoning_parser=parser)
    server.prompts.tokenizer = server.tokenizer
    msgs = [{"role": "system", "content": answer}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": prefill}]  # fmt: skip
    body = {"messages": msgs, "max_tokens": 30, "continue_final_message": True}
    with TestClient(server.app) as c:
        message = post(c, CHAT, body)["choices"][0]["message"]
        deltas = [ch["choices"][0]["delta"] for ch in sse(c, CHAT, {**body, "stream": True}) if ch["choices"]]
    assert (message["reasoning_content"], message["content"]) == split
    streamed = ["".join(d.get(key) or "" for d in deltas) for key in ("reasoning_content", "content")]
    assert streamed == [split[0] or "", split[1]]
