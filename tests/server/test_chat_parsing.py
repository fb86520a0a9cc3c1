"""--reasoning_parser and --tool_call_parser on /v1/chat/completions (issue 18 item 2), whole and streamed, over a
scripted model that answers with the text the test writes, one character per token (so every tag is split
across tokens)."""

import json

import pytest
from fake_model import Chars, make_scripted_server, post, sse
from fastapi.testclient import TestClient

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def client():
    with TestClient(make_scripted_server(reasoning_parser="qwen3", tool_call_parser="qwen25").app) as c:
        yield c


def ask(client, answer, stream=False, **body):
    """The chat response (or its stream chunks) when the model answers ``answer``."""
    body = {"messages": [{"role": "user", "content": answer}], **body}
    return sse(client, CHAT, {**body, "stream": True}) if stream else post(client, CHAT, body)


def joined(chunks, index=0):
    """The streamed deltas of choice ``index``: (reasoning, content, tool calls, finish reason)."""
    reasoning = content = ""
    calls, reason = [], None
    for chunk in chunks:
        for c in chunk["choices"]:
            if c["index"] != index:
                continue
            delta = c["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += delta.get("tool_calls") or []
            reason = c["finish_reason"] or reason
    return reasoning, content, calls, reason


def test_reasoning_is_split_off_whole_and_streamed(client):
    answer = "<think>\nthe user wants 2+2</think>\n\nIt is 4."
    message = ask(client, answer)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("\nthe user wants 2+2", "It is 4.")
    chunks = ask(client, answer, stream=True)
    assert joined(chunks) == ("\nthe user wants 2+2", "It is 4.", [], "stop")
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all("<" not in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)
    first = [d for d in deltas if d.get("reasoning_content")][0]
    last_reasoning = [i for i, d in enumerate(deltas) if d.get("reasoning_content")][-1]
    assert first["reasoning_content"] == "\n" and last_reasoning < len(deltas) - 3  # incremental, not at the end


def test_a_template_that_opens_think_in_the_prompt(client):
    kwargs = {"chat_template_kwargs": {"open_think": True}}
    message = ask(client, "pondering</think>yes", **kwargs)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("pondering", "yes")
    assert joined(ask(client, "pondering</think>yes", stream=True, **kwargs))[:2] == ("pondering", "yes")


def test_a_message_that_mentions_think_opens_nothing(client):
    # The prompt ends with the user's unclosed "<think>" just before the generation prompt: only what the template
    # adds for the answer says whether the answer starts inside the reasoning (the model answers up to SEP).
    question = "What does the <think> tag do?"
    for stream in (False, True):
        reply = ask(client, f"It is a tag.{chr(Chars.SEP)}{question}", stream=stream)
        message = None if stream else reply["choices"][0]["message"]
        fields = joined(reply)[:2] if stream else (message.get("reasoning_content") or "", message["content"])
        assert fields == ("", "It is a tag."), stream


def test_enable_thinking_false_gives_no_reasoning(client):
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    message = ask(client, "<think>x</think>y", **kwargs)["choices"][0]["message"]
    assert message.get("reasoning_content") is None and message["content"] == "<think>x</think>y"
    assert joined(ask(client, "<think>x</think>y", stream=True, **kwargs))[:2] == ("", "<think>x</think>y")


def test_no_think_tag_is_all_content(client):
    message = ask(client, "just an answer")["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (None, "just an answer")


def test_tool_calls_whole(client):
    choice = ask(client, "<think>need weather</think>\n\nChecking.\n" + CALL, tools=TOOLS)["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert (message["reasoning_content"], message["content"]) == ("need weather", "Checking.")
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    only_calls = ask(client, CALL + "\n" + CALL.replace("Paris", "Rome"), tools=TOOLS)["choices"][0]["message"]
    assert only_calls["content"] is None
    cities = [json.loads(c["function"]["arguments"])["city"] for c in only_calls["tool_calls"]]
    assert cities == ["Paris", "Rome"]
    assert len({c["id"] for c in only_calls["tool_calls"]}) == 2


def test_tool_calls_streamed_with_n(client):
    chunks = ask(client, "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"), stream=True, tools=TOOLS, n=2)
    for i in range(2):
        reasoning, content, calls, reason = joined(chunks, i)
        assert (reasoning, content, reason) == ("", "Checking.", "tool_calls")
        assert [c["index"] for c in calls] == [0, 1]
        assert [c["function"]["name"] for c in calls] == ["get_weather"] * 2 and all(c["id"] for c in calls)
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]


@pytest.mark.parametrize("body", [{"tools": TOOLS, "tool_choice": "none"}, {}], ids=["tool_choice none", "no tools"])
def test_without_tools_to_call_the_tags_stay_text(client, body):
    choice = ask(client, CALL, **body)["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (CALL, "stop")
    assert "tool_calls" not in choice["message"]


def test_malformed_call_stays_text(client):
    bad = 'Hm <tool_call>{"name": "get_weather", "arguments": {city}}</tool_call>'
    choice = ask(client, bad, tools=TOOLS)["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (bad, "stop")
    assert joined(ask(client, bad, stream=True, tools=TOOLS)) == ("", bad, [], "stop")


def test_without_the_flags_the_answer_is_text():
    with TestClient(make_scripted_server().app) as c:
        message = ask(c, "<think>r</think>" + CALL, tools=TOOLS)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>r</think>" + CALL}


def test_an_earlier_answer_goes_back_to_the_template_with_its_reasoning_and_calls():
    server = make_scripted_server(reasoning_parser="qwen3", tool_call_parser="qwen25")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    earlier = {"role": "assistant", "content": None, "reasoning_content": "need weather", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    with TestClient(server.app) as c:
        post(c, CHAT, {"messages": [{"role": "user", "content": "weather?"}, earlier, result], "tools": TOOLS})
    messages, options = server.tokenizer.template_calls[-1]
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "need weather",
        "tool_calls": [call],
    }
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"} and options["tools"] == TOOLS
