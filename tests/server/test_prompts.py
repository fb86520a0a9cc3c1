"""Prompts are tokenized on a thread of their own: the event loop serving /health and every stream keeps
running while a long prompt is tokenized."""

import asyncio
import json
import threading

import pytest

from lightllm.server.http_guards import BadRequest
from lightllm.server.prompts import CHARS_PER_TOKEN, INLINE_CHARS, PromptEncoder


class BlockingTokenizer:
    """Each call records its thread and waits until the test lets it finish, as a long prompt would."""

    def __init__(self):
        self.release = threading.Event()
        self.threads = []

    def _work(self, result):
        self.threads.append(threading.current_thread())
        if not self.release.wait(60):  # only when the loop is blocked: then the test fails, it does not hang
            raise AssertionError("the event loop did not run while the prompt was being tokenized")
        return result

    def encode(self, text):
        return self._work([1] * len(text))

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return self._work("".join(m["content"] for m in messages))


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_tokenization_runs_beside_the_event_loop(chat):
    tok = BlockingTokenizer()
    prompts = PromptEncoder(tok, max_req_total_len=64)

    async def other_work():  # stands for /health and the other streams: it runs while the tokenizer works
        while not tok.threads:
            await asyncio.sleep(0.01)
        tok.release.set()

    text = "a" * (INLINE_CHARS + 1)  # past what is tokenized on the loop

    async def main():
        work = prompts.encode_chat([{"role": "user", "content": text}]) if chat else prompts.encode(text, "prompt")
        ids, _ = await asyncio.gather(work, other_work())
        return ids, threading.current_thread()

    ids, loop_thread = asyncio.run(main())
    assert ids == [1] * len(text)
    assert tok.threads and all(t is not loop_thread and t.name.startswith("lightllm-tokenize") for t in tok.threads)


class RecordingTokenizer:
    """Encodes one id per character and records the thread each call ran on."""

    def __init__(self):
        self.threads = []

    def encode(self, text):
        self.threads.append(threading.current_thread())
        return [1] * len(text)

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **options):
        self.threads.append(threading.current_thread())
        return "".join(m["content"] for m in messages) + "".join(map(str, options.values()))


@pytest.mark.parametrize(
    "call, on_loop",
    [
        (lambda p: p.encode("a" * INLINE_CHARS, "prompt"), True),
        (lambda p: p.encode("a" * (INLINE_CHARS + 1), "prompt"), False),
        (lambda p: p.encode_chat([{"role": "user", "content": "hi"}]), True),
        (lambda p: p.encode_chat([{"role": "user", "content": "a" * INLINE_CHARS}]), False),  # role counts too
        (lambda p: p.encode_chat([{"role": "user", "content": "hi"}], {"tools": [TOOL_PLAIN]}), False),
        (lambda p: p.encode_chat([{"role": "assistant", "content": "", "tool_calls": [CALL_PLAIN]}]), False),
    ],
    ids=["short-text", "long-text", "short-chat", "long-chat", "chat-with-tools", "chat-with-tool-calls"],
)
def test_a_short_prompt_is_tokenized_on_the_event_loop_and_a_long_one_beside_it(call, on_loop):
    """Up to INLINE_CHARS of plain text the trip to the tokenizer thread and back (one to two turns of a busy loop,
    all in the request's time to first token) costs more than tokenizing; past it, or with tools, tool calls or
    reasoning (rendered at lengths the messages' text does not show), the tokenizer thread takes it."""
    tok = RecordingTokenizer()
    prompts = PromptEncoder(tok, max_req_total_len=4096)

    async def main():
        await call(prompts)
        return threading.current_thread()

    loop_thread = asyncio.run(main())
    assert tok.threads and all((t is loop_thread) == on_loop for t in tok.threads)


def test_text_is_checked_before_the_tokenizer_sees_it():
    tok = BlockingTokenizer()
    prompts = PromptEncoder(tok, max_req_total_len=64)
    limit = CHARS_PER_TOKEN * 64
    with pytest.raises(BadRequest, match=f"prompt: {limit + 1} characters, more than the {limit} a prompt may have"):
        asyncio.run(prompts.encode("x" * (limit + 1), "prompt"))
    too_long = [{"role": "user", "content": "x" * (limit // 2)}] * 2
    with pytest.raises(BadRequest, match="messages: .* characters, more than the"):
        asyncio.run(prompts.encode_chat(too_long))
    with pytest.raises(BadRequest, match="messages.1.role: expected valid Unicode text, got a lone surrogate U"):
        asyncio.run(prompts.encode_chat([{"role": "user", "content": "a"}, {"role": "\ud83d", "content": "b"}]))
    assert not tok.threads  # refused without tokenizing


CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": "\ud800"}'}}
CALL_PLAIN = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL_PLAIN = {"type": "function", "function": {"name": "f", "description": "d"}}
TOOL = {"type": "function", "function": {"name": "f", "description": "a\ud800"}}
USER = {"role": "user", "content": "a"}


class RenderingTokenizer:
    """Renders every field of the messages and every template option (as Qwen3's template renders tools, tool calls
    and reasoning), and encodes as Hugging Face's fast tokenizers do: a lone surrogate is a TypeError."""

    def __init__(self):
        self.calls = 0

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **options):
        self.calls += 1
        return json.dumps([messages, options], ensure_ascii=False)

    def encode(self, text):
        self.calls += 1
        text.encode("utf-8")  # raises on a lone surrogate, as the real encoders fail on it
        return [1] * len(text)


@pytest.mark.parametrize("message, options, field", [
    ({"role": "assistant", "content": "", "tool_calls": [CALL]}, {}, "messages.0.tool_calls.0.function.arguments"),
    ({"role": "tool", "content": "r", "tool_call_id": "c\udfff"}, {}, "messages.0.tool_call_id"),
    ({"role": "assistant", "content": "a", "reasoning_content": "\ud800"}, {}, "messages.0.reasoning_content"),
    (USER, {"tools": [TOOL]}, "tools.0.function.description"),
    (USER, {"mode": "\ud800"}, "chat_template_kwargs.mode"),
], ids=["tool-call-arguments", "tool-call-id", "reasoning", "tool-description", "template-kwargs"])  # fmt: skip
def test_a_lone_surrogate_anywhere_the_template_renders_is_a_400_naming_it(message, options, field):
    """The template renders tools, tool calls and an earlier answer's reasoning into the prompt text, which the
    tokenizer then cannot encode (a TypeError, a 500): refused before, naming the field."""
    tok = RenderingTokenizer()
    prompts = PromptEncoder(tok, max_req_total_len=4096)
    with pytest.raises(BadRequest, match=f"^{field}: expected valid Unicode text, got a lone surrogate U"):
        asyncio.run(prompts.encode_chat([message], options))
    assert tok.calls == 0  # refused without rendering or tokenizing


def test_the_generation_prompt_is_what_the_template_adds_for_the_answer(tmp_path_factory):
    """A Qwen3-style template: the answer's header, and with thinking off an empty think block; a message that mentions
    ``<think>`` is not part of it. The ids are encode_chat's."""
    from transformers import AutoTokenizer

    from lightllm.tools.make_tiny_model import CHAT_TEMPLATE, make_tiny_qwen3

    tok = AutoTokenizer.from_pretrained(make_tiny_qwen3(tmp_path_factory.mktemp("m"), seed=1))
    tok.chat_template = CHAT_TEMPLATE + (
        "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    )
    prompts = PromptEncoder(tok, max_req_total_len=512)
    messages = [{"role": "user", "content": "What does the <think> tag do?"}]
    ids, added = asyncio.run(prompts.encode_chat_answering(messages))
    assert added == "<|im_start|>assistant\n" and ids == asyncio.run(prompts.encode_chat(messages))
    _, added = asyncio.run(prompts.encode_chat_answering(messages, {"enable_thinking": False}))
    assert added == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
