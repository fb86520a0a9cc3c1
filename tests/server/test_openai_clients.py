"""Real clients against the served tiny model (issue 18 item 6): the official ``openai`` package and LangChain's
``langchain-openai``, offline (no network: the clients only talk to the local server)."""

import json

import openai
import pytest
from fake_model import make_scripted_server
from fastapi.testclient import TestClient
from langchain_openai import ChatOpenAI, OpenAI
from server_helpers import MODEL

MSGS = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server + "/v1", api_key="none", max_retries=0)


def test_completions_with_a_list_of_prompts_n_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=["hello", "world", [5, 6, 7]], n=2, max_tokens=4,
                                  temperature=0, logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in r.choices] == list(range(6))
    assert r.usage.completion_tokens == 24
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
        assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
        # 3 alternatives and the chosen token; tokens whose text is the same (byte pieces) share a key
        assert all(1 <= len(top) <= 4 and max(top.values()) <= 0 for top in lp.top_logprobs)
    alone = client.completions.create(model=MODEL, prompt="world", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[2].text == r.choices[3].text == alone.choices[0].text  # greedy: each n is the same


def test_completions_stream_with_usage_and_echo(client):
    stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, echo=True,
                                       stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    whole = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0, echo=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert whole.choices[0].text.startswith("hello")
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_n_logprobs_and_penalties(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, n=3, temperature=1.0, seed=4,
                                       logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=0.5,
                                       logit_bias={"17": -100})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) == r.usage.completion_tokens // 3 or c.finish_reason == "stop"
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)


def test_chat_stream_with_logprobs_and_usage(client):
    kwargs = dict(model=MODEL, messages=MSGS, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    # the stream reuses the whole request's prompt KV from the prefix cache: the same tokens, logprobs to rounding
    expected = whole.choices[0].logprobs.content
    assert [t.token for t in streamed] == [t.token for t in expected]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, expected))
    last = chunks[-1]
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)  # fmt: skip
    # the stream's prompt is the whole request's: the prefix cache holds all but its last token by now
    assert last.usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1
    without = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in without)


def test_chat_content_parts_name_and_template_kwargs(client):
    parts = [{"type": "text", "text": "tell me"}, {"type": "text", "text": "a story"}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "name": "ann", "content": parts}],
                                       max_tokens=3, temperature=None, response_format={"type": "text"},
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="response_format: type 'json_object' is not supported"):
        client.chat.completions.create(model=MODEL, messages=MSGS, response_format={"type": "json_object"})


def test_langchain_chat_invoke_and_stream_with_usage(tiny_server):
    chat = ChatOpenAI(base_url=tiny_server + "/v1", api_key="none", model=MODEL, max_tokens=6, temperature=0,
                      stream_usage=True, max_retries=0)  # fmt: skip
    answer = chat.invoke("tell me a story")
    assert answer.usage_metadata["output_tokens"] >= 1
    total = None
    for chunk in chat.stream("tell me a story"):
        total = chunk if total is None else total + chunk
    assert total.content == answer.content and total.usage_metadata == answer.usage_metadata


def test_langchain_completions_with_a_list_of_prompts(tiny_server):
    llm = OpenAI(base_url=tiny_server + "/v1", api_key="none", model=MODEL, max_tokens=4, temperature=0, max_retries=0)
    result = llm.generate(["hello", "world", "again"])
    assert len(result.generations) == 3 and all(len(g) == 1 for g in result.generations)
    assert result.llm_output["token_usage"]["completion_tokens"] >= 3
    assert result.generations[1][0].text == llm.invoke("world")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ANSWER = ('<think>\nThe user asks for the weather.</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>')  # fmt: skip


def test_the_served_parsers_answer_plain_text_as_content(client):
    """The shared server runs with --reasoning_parser qwen3 --tool_call_parser qwen25: an answer that opens no
    <think> and writes no <tool_call> is all content, with reasoning_content null."""
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0, tools=TOOLS)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] is None and message.tool_calls is None
    assert message.content and r.choices[0].finish_reason in ("length", "stop")


@pytest.fixture(scope="module")
def scripted_client():
    """The openai client over an in-process server whose model answers with the user message (no process)."""
    server = make_scripted_server(reasoning_parser="qwen3", tool_call_parser="hermes")
    with TestClient(server.app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0, http_client=http)


def test_openai_client_reads_tool_calls_and_reasoning(scripted_client):
    r = scripted_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ANSWER}],
                                                tools=TOOLS)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert choice.message.model_extra["reasoning_content"] == "\nThe user asks for the weather."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_openai_client_streams_tool_calls_and_reasoning(scripted_client):
    stream = scripted_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ANSWER}],
                                                     tools=TOOLS, stream=True)  # fmt: skip
    reasoning = content = ""
    calls, reasons = {}, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            call = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
            call["arguments"] += tc.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert (reasoning, content) == ("\nThe user asks for the weather.", "Let me look.")
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"} and reasons[-1] == "tool_calls"
