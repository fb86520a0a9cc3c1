"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p; logprobs of the chosen token)."""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from lightllm.engine.detokenize import check_stop_strings

# Below this a temperature is greedy: dividing logits by it would overflow float32 (1e-40 gives inf), and
# well before that the distribution is one-hot anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**63  # torch generators take a 64-bit signed seed; seeds are in [0, MAX_SEED)


@dataclass
class SamplingParams:
    """Per-request sampling; ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) is greedy; a ``top_k``
    of 0 or at least the vocabulary keeps every token. ``stop``: strings that end the generated text (cut
    before the first one found, finish_reason "stop"). Bad values raise ``ValueError`` naming the field."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    logprobs: bool = False
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()

    def __post_init__(self):
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
            raise ValueError(f"stop expected a string or a list of strings, got {self.stop!r}")
        check_stop_strings(list(stop))
        self.stop = tuple(stop)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens expected a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature expected a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p expected a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k expected a non-negative integer (0 = off), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED
        ):
            raise ValueError(f"seed expected an integer in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def sample(
    logits: torch.Tensor, params: List[SamplingParams], generators: List[Optional[torch.Generator]]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Next token and its logprob (under the unmodified distribution) for each row of float32 ``logits``.

    Rows without a seed are sampled together, a fixed number of launches whatever the batch; a seeded row
    is sampled alone with its own generator, so a seed gives the same tokens whoever shares the batch."""
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    free = [i for i, p in enumerate(params) if not p.greedy and generators[i] is None]
    groups = [(free, None)] if free else []
    groups += [([i], generators[i]) for i, p in enumerate(params) if not p.greedy and generators[i] is not None]
    for rows, generator in groups:
        tokens[rows] = sample_rows(logits[rows], [params[i] for i in rows], generator)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generator=None) -> torch.Tensor:
    """One draw per row of ``logits [n, vocab]`` at its temperature, kept to its ``top_k`` most likely tokens
    (exactly k), then to the smallest most-likely set whose probability reaches ``top_p``.

    A row whose distribution is not finite (non-finite logits, or logits so large that dividing by the
    temperature overflows) takes its most likely token instead of failing the whole batch's draw."""
    dev, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    scaled = logits / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # clamped: never beyond int64
    if all(k == vocab and p.top_p >= 1 for k, p in zip(top_k, params)):
        return _draw(torch.softmax(scaled, dim=-1), logits, generator)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
    ordered, order = scaled.sort(dim=-1, descending=True)
    cut = torch.arange(vocab, device=dev)[None, :] >= torch.tensor(top_k, device=dev)[:, None]
    probs = torch.softmax(ordered.masked_fill(cut, float("-inf")), dim=-1)
    probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p[:, None], 0.0)  # mass before a token > top_p
    return order.gather(1, _draw(probs, ordered, generator)[:, None]).squeeze(1)


def _draw(probs: torch.Tensor, scores: torch.Tensor, generator) -> torch.Tensor:
    """One index per row of ``probs`` (renormalized by multinomial); a row that is not a distribution takes
    the argmax of ``scores`` (the same order as ``probs``) instead of making multinomial raise for all rows."""
    bad = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
    safe = probs.masked_fill(bad[:, None], 1.0)  # any valid row: it is overridden below
    picked = torch.multinomial(safe, 1, generator=generator).squeeze(1)
    return torch.where(bad, scores.argmax(dim=-1), picked)
