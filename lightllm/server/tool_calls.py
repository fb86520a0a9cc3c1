"""``--tool_call_parser``: Qwen's hermes-style tool calls, ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, taken out of the streamed answer text as OpenAI ``tool_calls``.

``qwen25`` is LightLLM's name for this format, ``hermes`` vLLM's (which Qwen's documentation names for Qwen2.5
and Qwen3). A tag whose inside is not a JSON object with a string ``name`` (and an object ``arguments``) stays
text: the client sees what the model wrote, not an error."""

import json
import uuid
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

from lightllm.server.reasoning import partial_tag_at_end

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_CALL_PARSERS = ("qwen25", "hermes")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's function.arguments)
    id: str = ""

    def __post_init__(self):
        self.id = self.id or "call_" + uuid.uuid4().hex[:24]

    def as_openai(self, index: Optional[int] = None) -> dict:
        """OpenAI's tool call object; with ``index``, the stream delta form."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def parse_call(body: str) -> Optional[ToolCall]:
    """The call inside one ``<tool_call>`` tag, or None when it is not a well-formed call."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: a model in a loop nests [[[[ past json's depth
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallExtractor:
    """One answer's content, delta by delta, as a list of pieces: text (``str``) and calls (``ToolCall``). A call
    is emitted whole once its tag closes; text that could start a tag is held until it is known not to. The spaces
    around calls are dropped (Qwen writes a newline before and after each tag), except that text on both sides of
    calls stays apart: by the spaces written after the calls, else those before them, else a newline. An answer
    without calls keeps all of its text."""

    def __init__(self):
        self._held = ""  # text outside a tag that may start one
        self._spaces = ""  # trailing spaces of the text so far: emitted once more text follows
        self._after_call = False  # the spaces that follow a call separate it from text, if text came before it
        self._gap = ""  # the spaces held before the calls since the last text
        self._wrote_text = False
        self._inside: Optional[str] = None  # the text of an open tag
        self.calls = 0

    def add(self, delta: str) -> List[Union[str, ToolCall]]:
        return self._advance(delta, final=False)

    def finish(self) -> List[Union[str, ToolCall]]:
        """What is still held; an unclosed tag is a call if its inside parses (the answer stopped right after the
        JSON), else text."""
        return self._advance("", final=True)

    def _advance(self, delta: str, final: bool) -> List[Union[str, ToolCall]]:
        out: List[Union[str, ToolCall]] = []
        text, self._held = self._held + delta, ""
        while text:
            if self._inside is not None:
                self._inside += text
                end = self._inside.find(CALL_CLOSE)
                if end < 0:
                    break
                body, text, self._inside = self._inside[:end], self._inside[end + len(CALL_CLOSE) :], None
                self._close(body, out, closed=True)
                continue
            start = text.find(CALL_OPEN)
            if start < 0:
                hold = 0 if final else partial_tag_at_end(text, CALL_OPEN)
                self._text(text[: len(text) - hold], out)
                self._held = text[len(text) - hold :]
                break
            self._text(text[:start], out)
            self._inside, text = "", text[start + len(CALL_OPEN) :]
        if final:
            if self._inside is not None:
                body, self._inside = self._inside, None
                self._close(body, out, closed=False)
            if self._spaces and not self.calls:
                out.append(self._spaces)
            self._spaces = ""
        return out

    def _text(self, text: str, out: list) -> None:
        body = text.rstrip()
        if body and self._after_call:
            spaces = self._spaces + text[: len(text) - len(text.lstrip())]
            text, body = text.lstrip(), body.lstrip()
            self._spaces = (spaces or self._gap or "\n") if self._wrote_text else ""
            self._after_call = False
        if body:
            out.append(self._spaces + body)
            self._spaces, self._wrote_text = "", True
        self._spaces += text[len(body) :]

    def _close(self, body: str, out: list, closed: bool) -> None:
        call = parse_call(body)
        if call is None:  # stays text, tags included
            self._text(CALL_OPEN + body + (CALL_CLOSE if closed else ""), out)
            return
        if not self._after_call:
            self._gap = self._spaces
        self._spaces, self._after_call = "", True
        self.calls += 1
        out.append(call)


def split_tool_calls(text: str) -> Tuple[str, List[ToolCall]]:
    """A whole answer's content (outside the calls) and its calls."""
    ex = ToolCallExtractor()
    pieces = ex.add(text) + ex.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]
