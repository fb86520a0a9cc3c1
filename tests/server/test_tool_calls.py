"""--tool_call_parser: Qwen's <tool_call>{json}</tool_call> taken out of a chat answer, whole and streamed in any
pieces; what is not a well-formed call stays text."""

import json

import pytest
from test_reasoning import every_split

from lightllm.server.tool_calls import ToolCall, ToolCallExtractor, parse_call, split_tool_calls


def extract(pieces):
    """(content, [(name, arguments as an object)]) of ``pieces`` fed one by one; text never holds a tag part
    that belongs to a call."""
    ex = ToolCallExtractor()
    out = [p for piece in pieces for p in ex.add(piece)] + ex.finish()
    calls = [(p.name, json.loads(p.arguments)) for p in out if isinstance(p, ToolCall)]
    return "".join(p for p in out if isinstance(p, str)), calls


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
WEATHER = ("get_weather", {"city": "Paris", "unit": "c"})
TIME = ("now", {})
CASES = {
    "one call": (CALL, "", [WEATHER]),
    "text around": ("Let me check.\n" + CALL + "\n\nDone.", "Let me check.\n\nDone.", [WEATHER]),
    "text around, spaces before only": ("Answer: 42 " + CALL + "Right?", "Answer: 42 Right?", [WEATHER]),
    "text around, no spaces": ("42" + CALL + CALL + "Right?", "42\nRight?", [WEATHER, WEATHER]),
    "spaces after a first call dropped": (CALL + "\n Done.", "Done.", [WEATHER]),
    "two calls": (CALL + "\n" + CALL.replace("get_weather", "now").replace('{"city": "Paris", "unit": "c"}', "{}"),
                  "", [WEATHER, TIME]),
    "no tags": ("just text, 1 < 2 <tool", "just text, 1 < 2 <tool", []),
    "malformed json": ('a <tool_call>{"name": "f", "arguments": {oops}</tool_call> b',
                       'a <tool_call>{"name": "f", "arguments": {oops}</tool_call> b', []),
    "no name": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "unclosed but whole": ('<tool_call>{"name": "now", "arguments": {}}\n', "", [TIME]),
    "unclosed, cut off": ('x <tool_call>{"name": "now", "argu', 'x <tool_call>{"name": "now", "argu', []),
    "arguments as a string": ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', "", [TIME]),
    "trailing spaces kept without calls": ("hi \n", "hi \n", []),
}  # fmt: skip


@pytest.mark.parametrize("text, content, calls", list(CASES.values()), ids=list(CASES))
def test_split_at_every_position(text, content, calls):
    for pieces in every_split(text, three_ways=len(text) < 40):
        assert extract(pieces) == (content, calls), pieces
    whole_content, whole_calls = split_tool_calls(text)
    assert (whole_content, [(c.name, json.loads(c.arguments)) for c in whole_calls]) == (content, calls)


def test_a_call_comes_out_once_its_tag_closes_and_text_is_not_held_longer_than_needed():
    ex = ToolCallExtractor()
    assert ex.add("Sure <tool") == ["Sure"]  # the space waits: a call may follow
    assert ex.add('_call>{"name": "now", ') == []
    [call] = ex.add('"arguments": {"a": 1}}</tool_call>')
    assert (call.name, call.arguments, call.id.startswith("call_")) == ("now", '{"a": 1}', True)
    assert ex.add(" then") == [" then"] and ex.finish() == []  # text on both sides: the space keeps them apart


def test_parse_call_and_openai_shape():
    call = parse_call('{"name": "f", "arguments": {"q": "é"}}')
    assert call.as_openai() == {"id": call.id, "type": "function", "function": {"name": "f", "arguments": '{"q": "é"}'}}
    assert call.as_openai(2)["index"] == 2
    assert [parse_call(b) for b in ("[1]", '{"name": 3}', '{"name": "f", "arguments": [1]}', "")] == [None] * 4


def test_a_tag_nested_past_jsons_depth_stays_text():
    """A model in a loop writes ``[[[[...``: json's RecursionError is "not a call", not a crash of the request."""
    text = "<tool_call>" + "[" * 1200 + "</tool_call>"
    assert parse_call("[" * 1200) is None
    assert parse_call('{"name": "f", "arguments": "' + "[" * 1200 + '"}') is None
    assert split_tool_calls(text) == (text, [])
