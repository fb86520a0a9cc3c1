"""Offline API: ``LLM(model_dir, **engine options).generate(prompts, SamplingParams(...))``."""

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from lightllm.engine.args import EngineArgs
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.sampler import SamplingParams, sample

Prompt = Union[str, Sequence[int]]


@dataclass
class RequestOutput:
    prompt_token_ids: List[int]
    token_ids: List[int] = field(default_factory=list)
    text: str = ""
    logprobs: Optional[List[float]] = None  # of the chosen tokens, when asked for
    finish_reason: str = ""


@dataclass
class _Request:
    index: int
    prompt: List[int]
    params: SamplingParams
    generator: Optional[torch.Generator]
    out: RequestOutput
    slot: int = -1


class LLM:
    """Batch generation with the same engine the server runs: continuous batching of prefills and decodes."""

    def __init__(self, model_dir: Optional[str] = None, **engine_options):
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_options) - names)
        if unknown:
            raise TypeError(f"LLM: unknown engine option(s) {unknown}; allowed: {sorted(names - {'model_dir'})}")
        self.runner = ModelRunner(EngineArgs(model_dir=model_dir, **engine_options))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.runner.model_dir)
        self.eos_token_ids = set(self.runner.config.eos_token_ids)

    def generate(
        self, prompts: Union[Prompt, Sequence[Prompt]], sampling_params: Optional[SamplingParams] = None
    ) -> List[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        args = self.runner.args
        waiting = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) + params.max_new_tokens > args.max_req_total_len:
                raise ValueError(f"prompt {i}: {len(ids)} tokens + max_new_tokens {params.max_new_tokens} exceed "
                                 f"max_req_total_len {args.max_req_total_len}")  # fmt: skip
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            out = RequestOutput(prompt_token_ids=ids, logprobs=[] if params.logprobs else None)
            waiting.append(_Request(i, ids, params, gen, out))
        results = [r.out for r in waiting]
        running: List[_Request] = []
        while waiting or running:
            batch, budget = [], args.batch_max_tokens
            while waiting and len(running) + len(batch) < args.running_max_req_size:
                if batch and len(waiting[0].prompt) > budget:
                    break
                req = waiting.pop(0)
                budget -= len(req.prompt)
                batch.append(req)
            if batch:
                for r in batch:
                    r.slot = self.runner.kv.add_request()
                logits = self.runner.prefill([r.slot for r in batch], [r.prompt for r in batch])
                running += self._advance(batch, logits)
                continue
            logits = self.runner.decode([r.slot for r in running], [r.out.token_ids[-1] for r in running])
            running = self._advance(running, logits)
        for out in results:
            out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return results

    def _advance(self, reqs: List[_Request], logits: torch.Tensor) -> List[_Request]:
        """Sample one token for each request; free and drop the finished ones."""
        tokens, logprobs = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        alive = []
        for r, tok, lp in zip(reqs, tokens.tolist(), logprobs.tolist()):
            r.out.token_ids.append(tok)
            if r.out.logprobs is not None:
                r.out.logprobs.append(lp)
            p = r.params
            if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                r.out.finish_reason = "stop"
            elif len(r.out.token_ids) >= p.max_new_tokens:
                r.out.finish_reason = "length"
            else:
                alive.append(r)
                continue
            self.runner.free(r.slot)
        return alive
