"""A fake model and tokenizer for in-process server tests: the next-token distribution depends on the last
token (so sampling, penalties and logprobs mean something), and each token is one letter."""

import atexit
import gc
import json
import os
import signal
import time
from types import SimpleNamespace

import torch

from lightllm.engine.args import EngineArgs
from lightllm.common.kv_cache import KVCacheManager
from lightllm.server.http_server import Server

VOCAB = 16
WEIGHTS = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 2  # row: logits after a token


class FakeRunner:
    def __init__(self):
        self.args = EngineArgs(batch_max_tokens=256, max_req_total_len=64, running_max_req_size=32)
        self.config = SimpleNamespace(eos_token_ids=(), vocab_size=VOCAB)
        self.device = torch.device("cpu")
        self.kv = KVCacheManager(4000, 32, 64, "cpu", prefix_cache=True)  # real bookkeeping, prefix cache on

    def add_request(self, prefix=()):
        return self.kv.add_request(prefix)

    def free(self, slot, last_token=None):
        self.kv.free_request(slot)

    def prefill(self, slots, prompts, publish=(), following=()):
        for slot, prompt in zip(slots, prompts):
            self.kv.extend(slot, len(prompt))
            self.kv.computed(slot, prompt)
        for slot, lasting in publish:
            self.kv.publish(slot, lasting)
        return self.logits_after([p[-1] for p in prompts])

    def decode(self, slots, last_tokens):
        self.kv.extend_each(slots)
        for slot, token in zip(slots, last_tokens):
            self.kv.computed(slot, (token,))
        return self.logits_after(list(last_tokens))

    def logits_after(self, last_tokens):
        """The next-token logits of each row, given its last token."""
        return WEIGHTS[last_tokens].clone()


class Letters:
    """Token i is the letter chr(97 + i); the chat template is the last message's content, its options recorded."""

    eos_token_id = None
    all_special_ids = [15]  # "p"

    def __init__(self):
        self.template_calls = []

    def encode(self, text, add_special_tokens=True):  # it adds none either way
        return [ord(c) - 97 for c in text]

    def decode(self, ids, **kw):
        return "".join(chr(97 + i) for i in ids)

    def apply_chat_template(self, messages, **kw):
        self.template_calls.append((messages, kw))
        return messages[-1]["content"]


def make_server() -> Server:
    """A server over FakeRunner and Letters; the sampling parameters of what it submits land in ``.submitted``."""
    s = Server(FakeRunner(), Letters(), "tiny")
    s.prompts.tokenizer = s.tokenizer
    s.submitted = []
    submit = s.engine.submit
    s.engine.submit = lambda req: (s.submitted.append(req.params), submit(req))
    return s


class ScriptedRunner(FakeRunner):
    """A model that answers with the prompt's text up to its first ``SEP``, one character per step, then EOS (id 0):
    a test writes the model's answer as the user message (``Chars`` renders it before ``SEP``)."""

    def __init__(self):
        super().__init__()
        # its answer reads the whole prompt from its own prefills, so no prefix may come from the cache
        self.args = EngineArgs(batch_max_tokens=1024, max_req_total_len=512, running_max_req_size=32,
                               disable_dynamic_prompt_cache=True)  # fmt: skip
        self.kv = KVCacheManager(4000, 32, 512, "cpu")
        self.config = SimpleNamespace(eos_token_ids=(0,), vocab_size=128)
        self._slots = 0
        self._prompt = {}  # slot -> its prompt ids so far (a prompt may come in chunks)
        self._step = {}  # slot -> how many answer tokens it has produced

    def add_request(self, prefix=()):
        if prefix:
            raise AssertionError(f"ScriptedRunner runs with the prefix cache off, got a prefix of {len(prefix)}")
        self._slots += 1
        return self._slots

    def free(self, slot, last_token=None):  # its slots hold no KV
        self._prompt.pop(slot, None)
        self._step.pop(slot, None)

    def prefill(self, slots, prompts, publish=(), following=()):
        for slot, ids in zip(slots, prompts):
            self._prompt[slot] = self._prompt.get(slot, []) + list(ids)
            self._step[slot] = 0
        return torch.stack([self._next(slot) for slot in slots])

    def decode(self, slots, last_tokens):
        for slot in slots:
            self._step[slot] += 1
        return torch.stack([self._next(slot) for slot in slots])

    def _next(self, slot):
        prompt = self._prompt[slot]
        answer = prompt[: prompt.index(Chars.SEP)] if Chars.SEP in prompt else []
        step = self._step[slot]
        logits = torch.full((128,), -1e4)
        logits[answer[step] if step < len(answer) else 0] = 1e4
        return logits


class Chars:
    """Token i is chr(i) (0: EOS, special). The chat template renders the last message, ``SEP``, and a generation
    prompt as Qwen3's: ``<think>\n\n</think>\n\n`` with ``enable_thinking`` false; ``<think>\n`` with
    ``open_think`` true (as Qwen3's thinking-only templates)."""

    SEP = 30
    eos_token_id = 0
    all_special_ids = [0]

    def __init__(self):
        self.template_calls = []

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False, **kw):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))

    def apply_chat_template(self, messages, enable_thinking=True, open_think=False, add_generation_prompt=False, **kw):
        self.template_calls.append((messages, kw))
        prompt = "<think>\n\n</think>\n\n" if not enable_thinking else "<think>\n" if open_think else ""
        return messages[-1]["content"] + chr(self.SEP) + ("assistant:" + prompt if add_generation_prompt else "")


def make_scripted_server(**parsers) -> Server:
    """A server over ScriptedRunner and Chars; ``parsers``: ``reasoning_parser``, ``tool_call_parser``."""
    s = Server(ScriptedRunner(), Chars(), "tiny", **parsers)
    s.prompts.tokenizer = s.tokenizer
    return s


def post(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(client, path, body, done=True):
    """The events of a server-sent-event response; ``done``: it must end with ``data: [DONE]`` (OpenAI's)."""
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    if done:
        assert lines.pop() == "data: [DONE]"
    return [json.loads(line.removeprefix("data:")) for line in lines]


class EngineCrash(BaseException):
    """A failure the engine does not contain (it stands for a CUDA abort or a segfault): it ends the process."""


class CrashingRunner(FakeRunner):
    """FakeRunner whose first decode raises ``EngineCrash``."""

    def decode(self, slots, last_tokens):
        raise EngineCrash("the model crashed")


class KilledRunner(FakeRunner):
    """FakeRunner whose process is SIGKILLed while it builds (as the OOM killer does): no error of its own."""

    def __init__(self):
        os.kill(os.getpid(), signal.SIGKILL)


class CollectingRunner(FakeRunner):
    """FakeRunner whose every decode runs a full garbage collection pass, as allocation does now and then."""

    def decode(self, slots, last_tokens):
        gc.collect()
        return super().decode(slots, last_tokens)


class SlowExitRunner(FakeRunner):
    """FakeRunner whose process takes a second to exit after the engine has closed its pipe (as a GPU process takes
    to tear its CUDA context down): the HTTP process's reader sees the end of the pipe while the engine still runs."""

    def __init__(self):
        super().__init__()
        atexit.register(time.sleep, 1.0)
