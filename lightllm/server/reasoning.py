"""``--reasoning_parser``: the ``<think>...</think>`` convention of Qwen3 and DeepSeek-R1, split off the streamed
text of a chat answer into ``reasoning_content``.

Names as LightLLM (``qwen3``, ``qwen3-thinking``, ``deepseek-r1``) and vLLM (``deepseek_r1``) spell them. They
differ in one thing: where the output starts when it does not open ``<think>`` itself. ``qwen3`` treats such an
answer as content unless the template's generation prompt left a ``<think>`` open (Qwen3's thinking-only templates
end the prompt with it); the others always start inside the reasoning (DeepSeek-R1's template opens it in the prompt).
"""

from typing import Tuple

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# parser name -> whether the answer starts inside the reasoning whatever the prompt says
REASONING_PARSERS = {"qwen3": False, "qwen3-thinking": True, "deepseek-r1": True, "deepseek_r1": True}


def prompt_opens_think(generation_prompt: str) -> bool:
    """Whether a chat template's generation prompt leaves a ``<think>`` open: the answer starts inside the reasoning."""
    return generation_prompt.rfind(THINK_OPEN) > generation_prompt.rfind(THINK_CLOSE)


def prompt_closes_think(text: str) -> bool:
    """Whether ``text`` (a continued message) closed its last ``<think>``: the answer goes on in the content."""
    return text.rfind(THINK_CLOSE) > text.rfind(THINK_OPEN)


def partial_tag_at_end(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag`` (held back: the next delta may
    complete the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One answer's text, delta by delta, as (reasoning, content) deltas. No part of a tag is ever emitted: text
    that could be the start of one is held until the next delta (or :meth:`finish`) shows whether it is. The
    whitespace between ``</think>`` and the answer is dropped (Qwen3 writes a blank line there)."""

    def __init__(self, in_reasoning: bool):
        self._forced = in_reasoning
        self._state = "start"  # start: before the first non-space character; then reasoning, then content
        self._held = ""

    def add(self, delta: str) -> Tuple[str, str]:
        return self._advance(self._held + delta, final=False)

    def finish(self) -> Tuple[str, str]:
        """What is still held back."""
        return self._advance(self._held, final=True)

    def _advance(self, text: str, final: bool) -> Tuple[str, str]:
        self._held = ""
        reasoning = content = ""
        if self._state == "start":
            stripped = text.lstrip()
            if stripped.startswith(THINK_OPEN):
                text, self._state = stripped[len(THINK_OPEN) :], "reasoning"
            elif not final and (not stripped or THINK_OPEN.startswith(stripped)):
                self._held = text  # spaces, or the start of <think>: undecided yet
                return "", ""
            else:
                self._state = "reasoning" if self._forced else "content"
        if self._state == "reasoning":
            end = text.find(THINK_CLOSE)
            if end < 0:
                hold = 0 if final else partial_tag_at_end(text, THINK_CLOSE)
                self._held = text[len(text) - hold :] if hold else ""
                return text[: len(text) - hold], ""
            reasoning, text, self._state = text[:end], text[end + len(THINK_CLOSE) :], "after"
        if self._state == "after":  # drop the spaces before the answer
            text = text.lstrip()
            if not text:
                return reasoning, ""
            self._state = "content"
        content = text
        return reasoning, content
