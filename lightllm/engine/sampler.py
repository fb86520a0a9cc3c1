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
    """Next token and its logprob (under the unmodified distribution) for each row of float32 ``logits``.

    Rows without a seed are sampled together, a fixed number of launches whatever the batch; a seeded row
    is sampled alone with its own generator, so a seed gives the same tokens whoever shares the batch."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    free = [i for i, p in enumerate(params) if p.temperature > 0 and generators[i] is None]
    groups = [(free, None)] if free else []
    groups += [([i], generators[i]) for i, p in enumerate(params) if p.temperature > 0 and generators[i] is not None]
    for rows, generator in groups:
        tokens[rows] = sample_rows(logits[rows], [params[i] for i in rows], generator)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generator=None) -> torch.Tensor:
    """One draw per row of ``logits [n, vocab]`` at its temperature, kept to its ``top_k`` most likely tokens
    (exactly k), then to the smallest most-likely set whose probability reaches ``top_p``."""
    dev, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    scaled = logits / temperature[:, None]
    if all(p.top_k == 0 and p.top_p >= 1 for p in params):
        return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(1)
    top_k = torch.tensor([p.top_k or vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
    ordered, order = scaled.sort(dim=-1, descending=True)
    ordered = ordered.masked_fill(torch.arange(vocab, device=dev)[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p[:, None], 0.0)  # mass before a token > top_p
    picked = torch.multinomial(probs, 1, generator=generator)  # multinomial renormalizes what is left
    return order.gather(1, picked).squeeze(1)
