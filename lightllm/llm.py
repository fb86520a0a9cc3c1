"""Offline API: ``LLM(model_dir, **engine options).generate(prompts, SamplingParams(...))``.

Runs the server's scheduler in the caller's thread, so offline generation batches, admits and preempts
exactly as serving does.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.sampler import MAX_SEED, SamplingParams
from lightllm.server.scheduler import Event, Scheduler, ServerRequest

Prompt = Union[str, Sequence[int]]


@dataclass
class RequestOutput:
    prompt_token_ids: List[int]
    token_ids: List[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[List[float]] = None  # of the chosen tokens, when asked for
    finish_reason: str = ""


class LLM:
    """Batch generation with the engine the server runs (continuous batching, KV admission, preemption)."""

    def __init__(self, model_dir: Optional[str] = None, **engine_options):
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_options) - names)
        if unknown:
            raise TypeError(f"LLM: unknown engine option(s) {unknown}; allowed: {sorted(names - {'model_dir'})}")
        self.runner = ModelRunner(EngineArgs(model_dir=model_dir, **engine_options))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.runner.model_dir)
        self.scheduler = Scheduler(self.runner, self.runner.config.eos_token_ids)

    def generate(
        self, prompts: Union[Prompt, Sequence[Prompt]], sampling_params: Optional[SamplingParams] = None
    ) -> List[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        limit = self.runner.args.max_req_total_len
        requests, outputs = [], []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) + params.max_new_tokens > limit:
                raise ValueError(f"prompt {i}: {len(ids)} tokens + max_new_tokens {params.max_new_tokens} exceed "
                                 f"max_req_total_len {limit}")  # fmt: skip
            out = RequestOutput(prompt_token_ids=ids, logprobs=[] if params.logprobs else None)
            req = ServerRequest(f"offline-{i}", ids, params, _collector(out))
            if params.seed is not None:
                req.generator = torch.Generator(device=self.runner.device).manual_seed((params.seed + i) % MAX_SEED)
            requests.append(req)
            outputs.append(out)
        for req in requests:
            self.scheduler.submit(req)
        while not all(o.finish_reason for o in outputs):
            self.scheduler.step()
        for out in outputs:
            out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return outputs


def _collector(out: RequestOutput):
    def emit(ev: Event) -> None:
        if ev.kind == "token":
            out.token_ids.append(ev.token_id)
            if out.logprobs is not None:
                out.logprobs.append(ev.logprob)
        else:
            out.finish_reason = ev.finish_reason

    return emit
