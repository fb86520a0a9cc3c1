"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, min-p; logprobs of the chosen token and the
most likely alternatives). Penalties, logit bias and min_tokens change the logits before the draw:
``logits_processor.py``."""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from lightllm.common.transfer import host_to_device
from lightllm.engine.detokenize import check_stop_strings

# Below this a temperature is greedy: dividing logits by it would overflow float32 (1e-40 gives inf), and
# well before that the distribution is one-hot anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**63  # torch generators take a 64-bit signed seed; seeds are in [0, MAX_SEED)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_PENALTY = 2.0  # presence / frequency penalties are in [-MAX_PENALTY, MAX_PENALTY], as OpenAI's
MAX_LOGIT_BIAS = 100.0  # a bias is in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI's


@dataclass
class SamplingParams:
    """Per-request sampling; ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) is greedy; a ``top_k``
    of 0 or at least the vocabulary keeps every token; ``min_p`` (0: off) drops the tokens whose probability is below
    ``min_p`` times the most likely one's (after temperature). ``stop``: strings that end the generated text (cut
    before the first one found, finish_reason "stop"). Bad values raise ``ValueError`` naming the field.

    ``presence_penalty`` / ``frequency_penalty`` (OpenAI): subtracted from a token's logit once if the request has
    generated it / once per time it has. ``repetition_penalty`` (Hugging Face): a token in the prompt or generated
    has its logit divided by it when positive, multiplied when negative. ``logit_bias``: token id -> value added
    to its logit. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` cannot be drawn before this many
    tokens.
    ``top_logprobs``: how many most likely tokens (with logprobs) to return per generated token. Token ids are
    checked against a vocabulary by ``check_token_ids``.
    ``skip_special_tokens`` / ``include_stop_str_in_output`` (vLLM's): the text leaves out special tokens' text / ends
    with the stop string found or the stop token's text (by default it ends before either); token ids are unchanged."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    logprobs: bool = False
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
            raise ValueError(f"stop expected a string or a list of strings, got {self.stop!r}")
        check_stop_strings(list(stop))
        self.stop = tuple(stop)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens expected a positive integer, got {self.max_new_tokens!r}")
        if not _number(self.temperature) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature expected a number in [0, 100], got {self.temperature!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p expected a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k expected a non-negative integer (0 = off), got {self.top_k!r}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p expected a number in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED
        ):
            raise ValueError(f"seed expected an integer in [0, 2**63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _number(getattr(self, name)) or not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} expected a number in [-2, 2], got {getattr(self, name)!r}")
        if not _number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty expected a finite number > 0 (1 = off), got {self.repetition_penalty!r}"
            )
        self._check_logit_bias()
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens expected an integer in [0, max_new_tokens {self.max_new_tokens}], "
                             f"got {self.min_tokens!r}")  # fmt: skip
        if not _integer(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs expected an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        for name in ("logprobs", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} expected a bool, got {getattr(self, name)!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_integer(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids expected a list of non-negative integers, got {ids!r}")
        self.stop_token_ids = tuple(ids)

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias expected a dict of token id -> number, got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            if not _integer(token) or token < 0:
                raise ValueError(f"logit_bias expected non-negative integer token ids as keys, got {token!r}")
            if not _number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token}] expected a number in [-100, 100], got {bias!r}")

    def check_token_ids(self, vocab_size: int) -> None:
        """``ValueError`` naming the field for a ``logit_bias`` or ``stop_token_ids`` id outside the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                raise ValueError(f"{name}: token ids expected in [0, {vocab_size}), got {bad[:8]}")

    @property
    def processes_logits(self) -> bool:
        """Whether the logits need work before the draw (``logits_processor``); most requests do not."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sample(
    logits: torch.Tensor,
    params: List[SamplingParams],
    generators: List[Optional[torch.Generator]],
    raw_logits: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Next token and its logprob for each row of float32 ``logits``. The logprob is under the model's own
    distribution (``raw_logits`` when ``logits`` were changed by penalties or bias; vLLM's default too), before
    temperature, top-k and top-p.

    Rows without a seed are sampled together, a fixed number of launches whatever the batch; a seeded row
    is sampled alone with its own generator, so a seed gives the same tokens whoever shares the batch. Nothing
    here waits for the device: row indices and per-row settings go over without a sync (``host_to_device``)."""
    logprobs = torch.log_softmax(logits if raw_logits is None else raw_logits, dim=-1)
    tokens = argmax_rows(logits)
    drawn = [i for i, p in enumerate(params) if not p.greedy]  # most often none: greedy needs only the argmax
    for rows, generator in rows_by_generator(drawn, generators):
        if len(rows) == len(params):  # every row (rows are distinct): no index to send
            tokens = sample_rows(logits, params, generator)
            continue
        where = host_to_device(rows, torch.int64, logits.device)
        drawn = sample_rows(logits.index_select(0, where), [params[i] for i in rows], generator)
        tokens.index_copy_(0, where, drawn)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def rows_by_generator(
    rows: Sequence[int], generators: Sequence[Optional[torch.Generator]]
) -> List[Tuple[List[int], Optional[torch.Generator]]]:
    """``rows`` grouped for drawing: those without a generator together (one set of launches), each seeded row alone
    with its own generator, so a seed's draws do not depend on its neighbours."""
    free = [i for i in rows if generators[i] is None]
    return ([(free, None)] if free else []) + [([i], generators[i]) for i in rows if generators[i] is not None]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64). A float32 or float64 CPU matrix goes through numpy, whose argmax is about ten
    times faster than torch's CPU kernel for a step's rows (2.5 vs 24 us at 64 x 512 on one thread); both take the
    first maximum, and a NaN as the maximum."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(axis=-1).astype("int64", copy=False))
    return x.argmax(dim=-1)


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generator=None) -> torch.Tensor:
    """One draw per row of ``logits [n, vocab]`` from the distribution :func:`filtered_sorted` gives (temperature,
    top-k, top-p, min-p).

    A row whose distribution is not finite (non-finite logits, or logits so large that dividing by the
    temperature overflows) takes its most likely token instead of failing the whole batch's draw."""
    scaled, probs, order = filtered_sorted(logits, params)
    if probs is None:
        return draw_weighted(torch.softmax(scaled, dim=-1), logits, generator)
    return order.gather(1, draw_weighted(probs, scaled, generator)[:, None]).squeeze(1)


def filtered_sorted(logits: torch.Tensor, params: Sequence[SamplingParams]):
    """``(scaled, probs, order)`` of each row of ``logits [n, vocab]``: ``scaled`` the logits over the row's
    temperature; ``probs`` (unnormalized) its probabilities in descending order, kept to the ``top_k`` most likely
    tokens (exactly k), then to the smallest most-likely set whose probability reaches ``top_p``, then to the tokens
    of at least ``min_p`` times the most likely one's probability (zero elsewhere), ``order`` their token ids; both
    None when no row filters (``softmax(scaled)`` is the distribution, no sort needed). With ``probs``, ``scaled``
    is sorted too (the order of ``probs``)."""
    dev, vocab = logits.device, logits.shape[-1]
    temperature = host_to_device([p.temperature for p in params], logits.dtype, dev)
    scaled = logits / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # clamped: never beyond int64
    if all(k == vocab and p.top_p >= 1 and not p.min_p for k, p in zip(top_k, params)):
        return scaled, None, None
    ordered, order = scaled.sort(dim=-1, descending=True)
    cut = torch.arange(vocab, device=dev)[None, :] >= host_to_device(top_k, torch.int64, dev)[:, None]
    probs = torch.softmax(ordered.masked_fill(cut, float("-inf")), dim=-1)
    if any(p.top_p < 1 for p in params):
        top_p = host_to_device([p.top_p for p in params], logits.dtype, dev)
        # a token whose more likely ones already reach top_p goes; rows of top_p 1 keep all (their float32
        # cumulative sum may pass 1 in the tail)
        probs = probs.masked_fill((probs.cumsum(-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1), 0.0)
    if any(p.min_p for p in params):  # relative to the most likely token: the same set before or after top-k/p
        min_p = host_to_device([p.min_p for p in params], logits.dtype, dev)
        probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    return ordered, probs, order


def draw_weighted(probs: torch.Tensor, scores: torch.Tensor, generator) -> torch.Tensor:
    """One index per row of ``probs`` (unnormalized weights), drawn as ``argmax(probs / E)`` with ``E`` i.i.d.
    Exp(1): index i wins with probability ``probs[i] / sum(probs)`` (the first of independent exponential clocks
    with rates ``probs`` rings at i with that probability). Unlike ``torch.multinomial``, whose input check reads
    the device, nothing here waits for it. A row that is not a distribution takes the argmax of ``scores`` (the
    same order as ``probs``)."""
    bad = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
    clocks = torch.empty_like(probs).exponential_(generator=generator)
    # a zero clock (an underflowed draw) would pick its token whatever its weight: the smallest normal float instead
    clocks.clamp_(min=torch.finfo(probs.dtype).tiny)
    picked = (probs / clocks).argmax(dim=-1)
    return torch.where(bad, scores.argmax(dim=-1), picked)


def top_logprobs(raw_logits: torch.Tensor, k: int) -> Tuple[List[List[int]], List[List[float]]]:
    """The ``k`` most likely token ids of each row and their logprobs, under the model's own distribution (the
    one ``sample``'s logprobs are of): two host transfers for the batch."""
    return top_logprobs_read(top_logprobs_launch(raw_logits, k))


def top_logprobs_launch(raw_logits: torch.Tensor, k: int):
    """:func:`top_logprobs`'s device work, launched without waiting for it (``top_logprobs_read`` waits)."""
    return torch.log_softmax(raw_logits, dim=-1).topk(k, dim=-1)


def top_logprobs_read(top) -> Tuple[List[List[int]], List[List[float]]]:
    values, ids = top
    return ids.tolist(), values.tolist()
