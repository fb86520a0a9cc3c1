"""A chat answer's text as OpenAI's message fields: ``reasoning_content`` (``--reasoning_parser``), ``content`` and
``tool_calls`` (``--tool_call_parser``), whole or as stream deltas. Reasoning is split off first; tool calls are
looked for in the content only."""

from dataclasses import dataclass
from typing import List, Optional

from lightllm.server.reasoning import REASONING_PARSERS, ReasoningSplitter, prompt_closes_think, prompt_opens_think
from lightllm.server.tool_calls import ToolCall, ToolCallExtractor


@dataclass(frozen=True)
class ChatParsing:
    """What one chat request's answers are parsed for."""

    reasoning: bool
    starts_in_reasoning: bool
    tools: bool

    def new_output(self) -> "ChatOutput":
        return ChatOutput(self)


def chat_parsing(reasoning_parser: Optional[str], tool_call_parser: Optional[str], body,
                 generation_prompt: str = "") -> Optional[ChatParsing]:  # fmt: skip
    """The parsing a chat request gets, None for none. Reasoning: with a reasoning parser, unless the request turns
    thinking off (``chat_template_kwargs.enable_thinking`` false). Tools: with a tool-call parser and ``tools``,
    unless ``tool_choice`` is ``"none"``. ``generation_prompt``: what the chat template added after the messages
    (a template may open ``<think>`` there), where :func:`reads_generation_prompt` says it is needed."""
    reasoning = _reasoning(reasoning_parser, body)
    tools = tool_call_parser is not None and bool(body.tools) and body.tool_choice != "none"
    if not reasoning and not tools:
        return None
    if not reasoning:
        starts = False
    elif REASONING_PARSERS[reasoning_parser]:  # inside the reasoning, unless a continued message closed it already
        starts = not (body.continue_final_message and prompt_closes_think(generation_prompt))
    else:
        starts = prompt_opens_think(generation_prompt)
    return ChatParsing(reasoning, starts, tools)


def reads_generation_prompt(reasoning_parser: Optional[str], body) -> bool:
    """Whether :func:`chat_parsing` looks at the chat template's generation prompt: a parser whose answers start in
    the reasoning only where the template opened ``<think>`` (``qwen3``), with thinking on; any parser where the answer
    continues the last message (``continue_final_message``: a prefill may open or close ``<think>``). Only that part
    of the prompt counts: an earlier message that mentions ``<think>`` opens nothing."""
    if not _reasoning(reasoning_parser, body):
        return False
    return not REASONING_PARSERS[reasoning_parser] or bool(body.continue_final_message)


def _reasoning(reasoning_parser: Optional[str], body) -> bool:
    thinking_off = (body.chat_template_kwargs or {}).get("enable_thinking") is False
    return reasoning_parser is not None and not thinking_off


class ChatOutput:
    """One choice's answer, delta by delta (``add``, then ``finish``), as the fields of a stream delta."""

    def __init__(self, parsing: ChatParsing):
        self.parsing = parsing
        self._reasoning = ReasoningSplitter(parsing.starts_in_reasoning) if parsing.reasoning else None
        self._tools = ToolCallExtractor() if parsing.tools else None
        self.calls: List[ToolCall] = []

    def add(self, text: str) -> dict:
        """The delta's fields for ``text`` (none while everything is held back)."""
        return self._fields(*self._reasoning.add(text)) if self._reasoning else self._fields("", text)

    def finish(self) -> dict:
        """The fields of what was still held back, tool calls ended by the answer's end included."""
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._fields(reasoning, content, final=True)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls else reason

    def _fields(self, reasoning: str, content: str, final: bool = False) -> dict:
        fields = {"reasoning_content": reasoning} if reasoning else {}
        if self._tools is None:
            if content:
                fields["content"] = content
            return fields
        pieces = self._tools.add(content)
        if final:
            pieces += self._tools.finish()
        text = "".join(p for p in pieces if isinstance(p, str))
        if text:
            fields["content"] = text
        calls = [p for p in pieces if isinstance(p, ToolCall)]
        if calls:
            fields["tool_calls"] = [c.as_openai(len(self.calls) + i) for i, c in enumerate(calls)]
            self.calls += calls
        return fields

    def message(self, text: str) -> dict:
        """The whole answer as OpenAI's assistant message: with tool parsing, ``content`` null when there is no text;
        ``reasoning_content`` (with a reasoning parser) null when there was none."""
        first, rest = self.add(text), self.finish()
        content = first.get("content", "") + rest.get("content", "")
        message = {"role": "assistant", "content": None if self.parsing.tools and not content else content}
        if self.parsing.reasoning:
            message["reasoning_content"] = first.get("reasoning_content", "") + rest.get("reasoning_content", "")
            message["reasoning_content"] = message["reasoning_content"] or None
        if self.calls:
            message["tool_calls"] = [c.as_openai() for c in self.calls]
        return message


def merge_deltas(first: dict, then: dict) -> dict:
    """Two deltas' fields as one: texts joined, tool calls one after the other."""
    out = dict(first)
    for key, value in then.items():
        out[key] = out[key] + value if key in out else value
    return out
