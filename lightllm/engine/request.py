"""What goes into the engine (a ``Request``) and what comes out of it (``Event``s through the request's ``emit``)."""

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from lightllm.engine.sampler import SamplingParams


@dataclass
class Event:
    kind: str  # "token" | "finish"
    token_id: int = -1
    logprob: float = 0.0
    finish_reason: str = ""  # "stop" | "length" | "abort" | "error", or the reason an abort gave
    top_logprobs: Optional[List[Tuple[int, float]]] = None  # (token id, logprob), most likely first, when asked
    cached_tokens: int = 0  # prompt tokens its admission read from the prefix cache instead of computing them
    draft: bool = False  # MTP: the token is a draft the verify step accepted


@dataclass
class Request:
    """One generation. ``emit`` is called on the engine's thread: once per token, then once with "finish"."""

    id: str
    prompt_ids: List[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    output_ids: List[int] = field(default_factory=list)
    slot: int = -1  # its KV slot while it holds one
    prefilled: int = 0  # tokens of its context in the KV cache (chunked prefill: the chunks done so far)
    chunk_end: int = 0  # how far the prefill step it is scheduled in goes
    branch: int = 0  # set at admission: where its prefill stops a chunk for a state checkpoint (0: nowhere)
    num_cached_tokens: Optional[int] = None  # prompt tokens the prefix cache held at its first admission
    generator: Optional[torch.Generator] = None  # from params.seed, made by the engine on submit
    sampling_row: int = -1  # its row of the logits processor's tables while it holds one
    arrival: float = field(default_factory=time.perf_counter)
    last_token_time: Optional[float] = None
    finished: bool = False  # its finish event was emitted (set first: a callback that raises does not undo it)
    key: Optional[List[int]] = field(default=None, repr=False)  # the prefix cache's key of its context (scheduler)
    key_of: int = -1  # the context length ``key`` is of

    @property
    def context(self) -> List[int]:
        """What a (re-)prefill must process: the prompt and everything generated so far."""
        return self.prompt_ids + self.output_ids

    @property
    def context_len(self) -> int:
        """``len(context)``, without building it."""
        return len(self.prompt_ids) + len(self.output_ids)

    def context_slice(self, start: int, end: int) -> List[int]:
        """``context[start:end]``, without building the whole context (a running request's is as long as it got)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]
