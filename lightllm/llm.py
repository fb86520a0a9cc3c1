"""Offline API: ``LLM(model_dir, **engine options).generate(prompts, SamplingParams(...))``; MTP speculative
decoding with ``LLM(model_dir, mtp_mode="eagle_with_att", mtp_step=N)``.

Runs the server's ``Engine`` in the caller's thread, so offline generation batches, admits, preempts and ends
requests (EOS, stop token ids, stop strings, length) exactly as serving does. Seeds: prompt ``i`` of a list is
sampled with ``seed + i``, so a single prompt with seed ``s`` gives the tokens the server gives for seed ``s``.
"""

import dataclasses
import itertools
import operator
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

from lightllm.common import envs
from lightllm.engine.args import EngineArgs
from lightllm.engine.detokenize import TextStream, final_text, stop_ids
from lightllm.engine.engine import Engine, eos_token_ids
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Event, Request
from lightllm.engine.sampler import MAX_SEED, SamplingParams
from lightllm.engine.tokenizer import load_tokenizer
from lightllm.models.registry import read_model_config
from lightllm.tools.make_tiny_model import default_model_dir

Prompt = Union[str, Sequence[int]]


@dataclass
class RequestOutput:
    prompt_token_ids: List[int]
    token_ids: List[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[List[float]] = None  # of the chosen tokens, when asked for
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None  # per token, with SamplingParams.top_logprobs
    finish_reason: str = ""
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed
    num_accepted_draft_tokens: int = 0  # MTP: tokens of this output that came from accepted drafts


class LLM:
    """Batch generation with the engine the server runs (continuous batching, KV admission, preemption)."""

    def __init__(self, model_dir: Optional[str] = None, **engine_options):
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_options) - names)
        if unknown:
            raise TypeError(f"LLM: unknown engine option(s) {unknown}; allowed: {sorted(names - {'model_dir'})}")
        args = EngineArgs(model_dir=model_dir, **engine_options)
        # In the server's order: options, variables and the folder's config.json checked first (ModelRunner checks
        # the options again, on the real arguments), then the tokenizer, before the model loads (a folder without
        # one fails in seconds, not after the load, warm-up and graph capture).
        dataclasses.replace(args).normalize()
        envs.validate_all()
        folder = args.model_dir or str(default_model_dir())
        read_model_config(folder)
        self.tokenizer = load_tokenizer(folder)
        self.runner = ModelRunner(args)
        self.eos_ids = eos_token_ids(self.runner.config, self.tokenizer)
        self.engine = Engine(self.runner, self.eos_ids)
        self._requests = itertools.count()  # ids unique across calls: a stop string's abort may outlive its call

    def generate(
        self, prompts: Union[Prompt, Sequence[Prompt]], sampling_params: Optional[SamplingParams] = None
    ) -> List[RequestOutput]:
        prompts = _prompt_list(prompts)
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params expected a SamplingParams or None, got {type(sampling_params).__name__}")
        # a copy, checked anew: fields set after construction (params.stop = "ab") are checked and normalized too
        params = dataclasses.replace(sampling_params or SamplingParams())
        params.check_token_ids(self.runner.config.vocab_size)
        limit, vocab = self.runner.args.max_req_total_len, self.runner.config.vocab_size
        requests, outputs = [], []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else [operator.index(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < vocab]  # the server's 400: an embedding lookup outside it fails
            if bad:
                raise ValueError(f"prompt {i}: token ids expected in [0, {vocab}), got {bad[:8]}")
            if len(ids) + params.max_new_tokens > limit:
                raise ValueError(f"prompt {i}: {len(ids)} tokens + max_new_tokens {params.max_new_tokens} exceed "
                                 f"max_req_total_len {limit}")  # fmt: skip
            own = params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % MAX_SEED)
            out = RequestOutput(prompt_token_ids=ids, logprobs=[] if params.logprobs else None,
                                top_logprobs=[] if params.top_logprobs else None)  # fmt: skip
            request_id = f"offline-{next(self._requests)}"
            requests.append(Request(request_id, ids, own, self._collector(request_id, out, params)))
            outputs.append(out)
        for req in requests:
            self.engine.submit(req)
        try:
            while self.engine.has_unfinished():  # a request ended by a stop string is still freed
                self.engine.step()
        except BaseException:  # the step's requests would hold their KV slots for good
            self.engine.fail_all()
            raise
        if not params.stop:  # without stop strings the text is decoded once, as the server does
            for out in outputs:
                out.text = final_text(self.tokenizer, out.token_ids, params, self.eos_ids)
        return outputs

    def _collector(self, request_id: str, out: RequestOutput, params: SamplingParams):
        """The request's ``emit``: collects tokens and, with stop strings, the text, ending the request at the
        first stop string as the server does."""
        text = TextStream(self.tokenizer if params.stop else None, params, stop_ids(params, self.eos_ids))

        def emit(ev: Event) -> None:
            out.num_cached_tokens = ev.cached_tokens  # every event carries it
            if out.finish_reason:  # ended by a stop string: nothing after it counts
                return
            if ev.kind == "finish":
                rest, out.finish_reason = text.finish(ev.finish_reason)
                out.text += rest
                return
            out.token_ids.append(ev.token_id)
            out.num_accepted_draft_tokens += ev.draft
            if out.logprobs is not None:
                out.logprobs.append(ev.logprob)
            if out.top_logprobs is not None:
                out.top_logprobs.append(ev.top_logprobs)
            delta, hit = text.add(ev.token_id)
            out.text += delta
            if hit:
                self.engine.abort(request_id, reason="stop")
                out.finish_reason = "stop"

        return emit


def _prompt_list(prompts) -> list:
    """``generate``'s prompts as a list: a text, a list of token ids, or a list (or tuple) of those; anything else (a
    tensor, an array, bytes, floats, bools) is a ValueError naming what it got."""
    if isinstance(prompts, str) or _token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts expected a string, a list of token ids or a list of those, got "
                         f"{type(prompts).__name__} (a tensor or array: .tolist())")  # fmt: skip
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and not _token_ids(p):
            raise ValueError(f"prompt {i} expected a string or a non-empty list of int token ids, got "
                             f"{_shown(p)}")  # fmt: skip
    return list(prompts)


def _token_ids(value) -> bool:
    """A non-empty list or tuple of integers (numpy's too), none of them a bool."""
    return isinstance(value, (list, tuple)) and bool(value) and all(_is_token_id(t) for t in value)


def _is_token_id(value) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)  # int and numpy integers; not float, str or numpy's bool
    except TypeError:
        return False
    return True


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
