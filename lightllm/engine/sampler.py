"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p; logprobs of the chosen token)."""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass
class SamplingParams:
    """Per-request sampling; ``temperature=0`` is greedy. Bad values raise ``ValueError`` naming the field."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    logprobs: bool = False
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens expected a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature expected a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p expected a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k expected a non-negative integer (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed expected an integer, got {self.seed!r}")


def sample(
    logits: torch.Tensor, params: List[SamplingParams], generators: List[Optional[torch.Generator]]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Next token and its logprob (under the unmodified distribution) for each row of float32 ``logits``."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        row = logits[i] / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i]).squeeze(0)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
