"""Prompt text to token ids for the HTTP server: checked and bounded before the tokenizer sees it, and
tokenized (chat template included) on a thread of its own, so a long prompt never stalls the event loop
that serves ``/health`` and every running stream; a short one on the loop, where it costs less than the trip."""

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
import logging
import os
from typing import List, Optional, Tuple

from lightllm.engine.tokenizer import load_tokenizer as _load_tokenizer
from lightllm.server.http_guards import BadRequest

logger = logging.getLogger(__name__)

# A text prompt longer than this many characters per token of max_req_total_len is refused before it is
# tokenized. No tokenizer's tokens average that long, so no prompt that would fit is refused.
CHARS_PER_TOKEN = 32
# Prompts up to this many characters (chat: plain messages' roles and text) are tokenized on the event loop: the trip
# to the tokenizer thread and back waits for the GIL and a turn of the loop, both busy under a streaming load, and is
# in the request's time to first token (256 characters: 0.27-0.35 ms p50 and 0.9-1.4 ms p90 with the loop half busy,
# 0.11 ms on the loop; 1024 hold the loop about 0.3 ms; benchmarks/prompt_encode_latency.py, docs/server.md).
INLINE_CHARS = 1024


def load_tokenizer(model_dir: str, mode: str = "fast", chat_template: Optional[str] = None):
    """The engine's :func:`~lightllm.engine.tokenizer.load_tokenizer`, with a start-up warning when the tokenizer
    has no chat template (chat requests then get a 400)."""
    tokenizer = _load_tokenizer(model_dir, mode, chat_template)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("the tokenizer of %s has no chat template: /v1/chat/completions requests get a 400 "
                       "(--chat_template gives one)", model_dir)  # fmt: skip
    return tokenizer


class PromptEncoder:
    def __init__(self, tokenizer, max_req_total_len: int):
        self.tokenizer = tokenizer
        self.max_req_total_len = max_req_total_len
        self.max_chars = CHARS_PER_TOKEN * max_req_total_len
        # One thread: tokenizations queue behind each other (as they did on the loop), never beside it.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightllm-tokenize")

    async def encode(self, text: str, field: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of a text prompt; ``field`` names it in a 400. ``add_special_tokens`` false: without the
        tokenizer's BOS and the like (LightLLM's native parameter; Qwen's tokenizers add none)."""
        self._check(field, text)
        encode = self.tokenizer.encode
        if not add_special_tokens:
            encode = functools.partial(encode, add_special_tokens=False)
        if len(text) <= INLINE_CHARS:
            return encode(text)
        return await self._off_loop(encode, text)

    async def encode_chat(self, messages: List[dict], options: Optional[dict] = None) -> List[int]:
        """Token ids of ``messages`` rendered by the model's chat template (generation prompt added unless ``options``
        say ``add_generation_prompt`` false); ``options``: more keyword arguments for the template (``tools``,
        ``enable_thinking``, ``continue_final_message``, ...)."""
        return await self._chat(messages, options, self._render)

    async def encode_chat_answering(
        self, messages: List[dict], options: Optional[dict] = None
    ) -> Tuple[List[int], str]:
        """``encode_chat``'s ids, and the text the template adds after the messages for the answer (its generation
        prompt, where a template may open ``<think>``): the prompt rendered with it past where it stops agreeing with
        the prompt rendered without it. With ``continue_final_message`` the answer continues the last message, so
        that text is the last message as rendered (its opening and the prefill, which may open or close ``<think>``)."""
        return await self._chat(messages, options, self._render_answering)

    async def _chat(self, messages: List[dict], options: Optional[dict], render):
        """``render(messages, options)`` once the messages are checked: on the loop for short plain ones, else on
        the tokenizer's thread."""
        for i, m in enumerate(messages):
            for key in ("role", "content", "name"):
                if key in m:
                    self._check(f"messages.{i}.{key}", m[key])
            for key in ("tool_calls", "tool_call_id", "reasoning_content"):  # the template renders them too
                if key in m:
                    self._check_unicode(f"messages.{i}.{key}", m[key])
        for key, value in (options or {}).items():
            self._check_unicode(key if key == "tools" else f"chat_template_kwargs.{key}", value)
        chars = sum(len(m["role"]) + len(m["content"]) for m in messages)
        self._check_length("messages", chars)
        # tools, tool calls and reasoning render at lengths the messages' text does not show
        plain = not (options or {}).get("tools") and all(set(m) <= {"role", "content", "name"} for m in messages)
        if plain and chars <= INLINE_CHARS:
            return render(messages, options or {})
        return await self._off_loop(render, messages, options or {})

    def _render(self, messages: List[dict], options: dict) -> List[int]:
        return self.tokenizer.encode(self._text(messages, options, True))

    def _render_answering(self, messages: List[dict], options: dict) -> Tuple[List[int], str]:
        text = self._text(messages, options, True)
        if options.get("continue_final_message"):  # the answer goes on in the last message: its opening and text so far
            rest = {key: value for key, value in options.items() if key != "continue_final_message"}
            before = self._text(messages[:-1], rest, False) if len(messages) > 1 else ""
        else:
            before = self._text(messages, options, False)
        common = len(before) if text.startswith(before) else len(os.path.commonprefix([text, before]))
        return self.tokenizer.encode(text), text[common:]

    def _text(self, messages: List[dict], options: dict, generation_prompt: bool) -> str:
        """``generation_prompt``: the answer's turn opened, unless ``options`` turn it off (``add_generation_prompt``
        false, ``continue_final_message``)."""
        kwargs = dict(options, add_generation_prompt=generation_prompt and options.get("add_generation_prompt", True))
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # a template that rejects these messages
            raise BadRequest(f"messages: the model's chat template could not render them ({e})") from e

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _check(self, field: str, text: str) -> None:
        self._check_length(field, len(text))
        self._check_unicode(field, text)

    def _check_unicode(self, field: str, value) -> None:
        """400 for a lone surrogate in ``value``: a string, or the strings (keys too) of JSON lists and objects."""
        if isinstance(value, dict):
            for key, item in value.items():
                self._check_unicode(field, key)
                self._check_unicode(f"{field}.{key}", item)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                self._check_unicode(f"{field}.{i}", item)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:  # JSON can carry one ("\ud800"); no tokenizer can encode it
                raise BadRequest(f"{field}: expected valid Unicode text, got a lone surrogate "
                                 f"U+{ord(value[e.start]):04X} at character {e.start}") from None  # fmt: skip

    def _check_length(self, field: str, chars: int) -> None:
        if chars > self.max_chars:
            raise BadRequest(
                f"{field}: {chars} characters, more than the {self.max_chars} a prompt may have "
                f"({CHARS_PER_TOKEN} per token of max_req_total_len {self.max_req_total_len})"
            )
