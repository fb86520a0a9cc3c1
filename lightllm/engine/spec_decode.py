"""MTP speculative decoding's decode step in the engine: draft, verify, accept, emit.

Each running request gets ``N`` draft tokens from the runner's MTP head, then one main-model forward over its
last token and the drafts gives the target logits at ``N + 1`` positions. Position ``k`` is decided like a plain
decode step (penalties and bias applied, the same greedy choice), in order, while the drafts before it hold:

- greedy: the target's choice is emitted; when it equals draft ``k + 1`` the next position is decided too,
  else the step ends there (the longest agreeing prefix plus one token: output equals MTP off, token for token);
- sampling: draft ``x`` (drawn from the head's distribution ``q``, filtered by the request's temperature, top-k
  and top-p) is accepted with probability ``min(1, p(x) / q(x))`` under the target's filtered ``p``; on a reject
  a token is drawn from ``norm(max(p - q, 0))`` and the step ends; after all ``N`` drafts, one more from ``p``.
  Every emitted token is thereby distributed as plain sampling would draw it.

Each emitted token is checked for EOS, stop token ids and length at once, so a request never emits past its end
inside an accepted run (stop strings: the server and ``LLM`` abort at the first one and ignore what follows).
"""

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from lightllm.common.transfer import host_to_device
from lightllm.engine.request import Event, Request
from lightllm.engine.sampler import SamplingParams, draw_weighted, rows_by_generator, top_logprobs

logger = logging.getLogger(__name__)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution ``sampler.sample_rows`` draws from, per row of ``logits [n, vocab]``: temperature, then
    exactly ``top_k`` most likely tokens, then the smallest most-likely set reaching ``top_p``, renormalized."""
    vocab, dev = logits.shape[-1], logits.device
    temperature = host_to_device([p.temperature for p in params], logits.dtype, dev)
    scaled = logits / temperature[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if all(k == vocab and p.top_p >= 1 for k, p in zip(top_k, params)):
        return torch.softmax(scaled, dim=-1)
    top_p = host_to_device([p.top_p for p in params], logits.dtype, dev)
    ordered, order = scaled.sort(dim=-1, descending=True)
    cut = torch.arange(vocab, device=dev)[None, :] >= host_to_device(top_k, torch.int64, dev)[:, None]
    probs = torch.softmax(ordered.masked_fill(cut, float("-inf")), dim=-1)
    probs = probs.masked_fill(probs.cumsum(-1) - probs > top_p[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def draw_rows(probs: torch.Tensor, generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """One token per row of ``probs [R, vocab]`` (weights; ``sampler``'s exponential-clock draw, which never waits
    for the device, unlike ``torch.multinomial``): rows without a generator together, each seeded row with its own
    generator (a seed's draws do not depend on its neighbours)."""
    if all(g is None for g in generators):
        return draw_weighted(probs, probs, None)
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for rows, generator in rows_by_generator(range(len(generators)), generators):
        where = host_to_device(rows, torch.int64, probs.device)
        picked = probs.index_select(0, where)
        out.index_copy_(0, where, draw_weighted(picked, picked, generator))
    return out


def uniform_rows(n: int, generators: Sequence[Optional[torch.Generator]], device) -> torch.Tensor:
    """``n`` uniforms in [0, 1) on ``device``: one launch for the rows without a generator, one per seeded row."""
    u = torch.rand(n, device=device)
    for i, g in enumerate(generators):
        if g is not None:
            u[i : i + 1] = torch.rand(1, generator=g, device=device)
    return u


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generators: Sequence[Optional[torch.Generator]]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The speculative-sampling rule, row by row on the device (no read): row ``i``'s draft ``drafts[i]`` was drawn
    from ``q[i]``; it is accepted with probability ``min(1, p[i, d] / q[i, d])``, else replaced by a draw from
    ``norm(max(p[i] - q[i], 0))`` (from ``p[i]`` where nothing is left, ``p == q`` up to rounding). Returns
    ``(tokens [R], accepted [R] bool)``; each row's token is distributed as ``p[i]``."""
    at = drafts[:, None]
    u = uniform_rows(p.shape[0], generators, p.device)
    accepted = u * q.gather(1, at).squeeze(1) <= p.gather(1, at).squeeze(1)
    residual = (p - q).clamp_(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    return torch.where(accepted, drafts, draw_rows(residual, generators)), accepted


class DraftChooser:
    """Picks each draft token for the runner (argmax for greedy requests, a draw from ``q`` otherwise) and keeps
    the sampled requests' ``q`` for the acceptance rule."""

    def __init__(self, reqs: Sequence[Request]):
        self.reqs = reqs
        self.sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        self.q: List[torch.Tensor] = []  # per draft step: [len(sampled), vocab]

    def __call__(self, k: int, logits: torch.Tensor) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        if self.sampled:
            where = host_to_device(self.sampled, torch.int64, logits.device)
            probs = filtered_probs(logits.index_select(0, where), [self.reqs[i].params for i in self.sampled])
            self.q.append(probs)
            tokens.index_copy_(0, where, draw_rows(probs, [self.reqs[i].generator for i in self.sampled]))
        return tokens


def _plain(req: Request) -> bool:
    """Nothing changes its logits (penalties, bias, min_tokens) or asks for more than the chosen token's logprob:
    greedy, or sampled with temperature, top-k and top-p only. Its positions do not depend on each other's tokens
    (no penalty counts what was accepted before), so all of them are decided on the device at once."""
    p = req.params
    return not p.processes_logits and not p.top_logprobs and req.sampling_row < 0


@dataclass
class _Outcome:
    events: List[Event] = field(default_factory=list)
    accepted: int = 0  # drafts whose KV stays (the verify's positions after the first)
    reason: Optional[str] = None  # why it ends, None when it goes on


class SpecDecoder:
    """The engine's decode step when the runner serves MTP (``runner.mtp``: ``mtp_runner.MTPRunner``)."""

    def __init__(self, engine):
        self.engine = weakref.proxy(engine)  # the engine holds this object: no cycle to keep its runner alive
        self.mtp = engine.runner.mtp
        self.step_drafts = self.mtp.step

    def step(self, batch: List[Request]) -> List[Request]:
        """One speculative decode step of ``batch``: the requests that go on."""
        eng = self.engine
        slots, last = [r.slot for r in batch], [r.output_ids[-1] for r in batch]
        chooser = DraftChooser(batch)
        # GPU-timed (gpu_timer.py) only when nothing waits for the GPU before the acceptance's one read
        timing = eng._timing and all(_plain(r) for r in batch)
        if timing:
            eng._gpu_timer.start()
        try:
            drafts = self.mtp.draft(slots, last, chooser)
            logits = self.mtp.verify(slots, last, drafts)
        except Exception:
            logger.exception("MTP decode forward of %d requests failed; they end with finish_reason error", len(batch))
            for req in batch:
                eng._finish(req, "error")
            return []
        outcomes = self._decide(batch, drafts, logits, chooser)
        self.mtp.accept(slots, [o.accepted for o in outcomes])
        return self._emit(batch, outcomes)

    def _decide(self, batch, drafts: torch.Tensor, logits: torch.Tensor, chooser: DraftChooser) -> List[_Outcome]:
        """Each request's tokens, events and accepted drafts from the verify's ``logits [B, N + 1, vocab]`` and the
        drafts ``[B, N]`` (on the device). Plain requests (``_plain``: no penalty, bias, min_tokens or top logprobs)
        are decided from one read of the device (all positions' tokens, logprobs and acceptances at once); the others
        position by position (penalties count the tokens accepted before)."""
        outcomes = [_Outcome() for _ in batch]
        plain = [i for i, r in enumerate(batch) if _plain(r)]
        rest = [i for i, r in enumerate(batch) if not _plain(r)]
        if plain:
            self._decide_plain(batch, plain, drafts, logits, chooser, outcomes)
        if rest:
            self._decide_each(batch, rest, drafts.tolist(), logits, chooser, outcomes)
        return outcomes

    def _decide_plain(self, batch, rows: List[int], drafts: torch.Tensor, logits: torch.Tensor,
                      chooser: DraftChooser, outcomes: List[_Outcome]) -> None:  # fmt: skip
        """The plain ``rows``: every position's token (greedy: the argmax, accepted while it equals the next draft;
        sampled: the acceptance rule, and the bonus draw, at every position at once), its logprob (of the model's
        own distribution) and whether it goes on, in one device-to-host read. A sampled position past a rejection
        draws for nothing, which changes no emitted token's distribution."""
        eng, n, T = self.engine, self.step_drafts, self.step_drafts + 1
        try:
            if len(rows) < len(batch):
                where = host_to_device(rows, torch.int64, logits.device)
                logits, drafts = logits.index_select(0, where), drafts.index_select(0, where)
            tokens = logits.argmax(dim=-1)  # [R, T]
            going_on = tokens[:, :n] == drafts  # [R, N]
            sampled = [j for j, i in enumerate(rows) if not batch[i].params.greedy]
            if sampled:
                self._sample_positions(batch, [rows[j] for j in sampled], sampled, drafts, logits, chooser,
                                       tokens, going_on)  # fmt: skip
            # log_softmax at the chosen token without a [R, T, vocab] log-softmax: its logit minus the logsumexp
            lps = logits.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            packed = torch.cat([tokens.double(), lps.double(), going_on.double()], dim=1)
            if self.engine._timing:  # the step's last launch (a no-op unless this step started the timer)
                self.engine._gpu_timer.stop()
            got = packed.tolist()  # one read: token ids (< 2**53) are exact in float64
        except Exception:
            logger.exception("MTP acceptance of %d requests failed; they end with finish_reason error", len(rows))
            for i in rows:
                outcomes[i].reason = "error"
            return
        finish_reason = eng.scheduler.finish_reason
        for i, row in zip(rows, got):
            req, out = batch[i], outcomes[i]
            cached = req.num_cached_tokens or 0
            for k in range(T):
                tok = int(row[k])
                going_on = k < n and row[2 * T + k] > 0
                req.output_ids.append(tok)
                out.events.append(Event("token", tok, row[T + k], cached_tokens=cached, draft=going_on))
                out.reason = finish_reason(req, tok)
                if out.reason is not None or not going_on:
                    break
                out.accepted += 1

    @staticmethod
    def _sample_positions(batch, reqs: List[int], at: List[int], drafts: torch.Tensor, logits: torch.Tensor,
                          chooser: DraftChooser, tokens: torch.Tensor, going_on: torch.Tensor) -> None:  # fmt: skip
        """The sampled plain requests ``batch[reqs[j]]`` (rows ``at[j]`` of ``logits``, ``drafts``, ``tokens`` and
        ``going_on``): at each draft position the acceptance rule (accepted, or the residual's draw), after the last
        the bonus draw from ``p``; into ``tokens`` and ``going_on`` on the device. Position by position, as the
        per-position path draws (one ``[S, vocab]`` distribution live at a time, each seeded request's generator
        drawn in the same order)."""
        dev, n = logits.device, drafts.shape[1]
        where = host_to_device(at, torch.int64, dev)
        params = [batch[i].params for i in reqs]
        generators = [batch[i].generator for i in reqs]
        q_row = {i: row for row, i in enumerate(chooser.sampled)}
        q_where = host_to_device([q_row[i] for i in reqs], torch.int64, dev)
        picked = drafts.index_select(0, where)
        drawn, took = [], []
        for k in range(n + 1):
            p = filtered_probs(logits[:, k].index_select(0, where), params)
            if k < n:
                token, accepted = accept_or_resample(p, chooser.q[k].index_select(0, q_where), picked[:, k], generators)
                drawn.append(token)
                took.append(accepted)
            else:
                drawn.append(draw_rows(p, generators))
        tokens.index_copy_(0, where, torch.stack(drawn, dim=1))
        going_on.index_copy_(0, where, torch.stack(took, dim=1))

    def _decide_each(self, batch, rows: List[int], drafts: List[List[int]], logits: torch.Tensor,
                     chooser: DraftChooser, outcomes: List[_Outcome]) -> None:  # fmt: skip
        """``rows`` position by position: penalties and bias over what was accepted before, the sampling rule."""
        eng, n = self.engine, self.step_drafts
        q_row = {i: row for row, i in enumerate(chooser.sampled)}
        active = list(rows)
        for k in range(n + 1):
            if not active:
                break
            reqs = [batch[i] for i in active]
            raw = logits[:, k].index_select(0, host_to_device(active, torch.int64, logits.device))
            try:
                tokens, going_on = self._position(k, reqs, raw, [drafts[i] for i in active],
                                                  [chooser.q[k][q_row[i]] if i in q_row and k < n else None
                                                   for i in active])  # fmt: skip
            except Exception:
                logger.exception("MTP acceptance of %d requests failed; they end with finish_reason error", len(reqs))
                for i in active:
                    outcomes[i].reason = "error"
                break
            lps = torch.log_softmax(raw, dim=-1).gather(1, host_to_device(tokens, torch.int64, raw.device)[:, None])
            want = max(r.params.top_logprobs for r in reqs)
            tops = top_logprobs(raw, want) if want else None
            still = []
            for j, (i, req, tok, lp) in enumerate(zip(active, reqs, tokens, lps.squeeze(1).tolist())):
                top = None
                if tops is not None and req.params.top_logprobs:
                    top = list(zip(tops[0][j][: req.params.top_logprobs], tops[1][j][: req.params.top_logprobs]))
                req.output_ids.append(tok)
                cached = req.num_cached_tokens or 0
                outcomes[i].events.append(Event("token", tok, lp, top_logprobs=top, cached_tokens=cached,
                                                draft=going_on[j]))  # fmt: skip
                outcomes[i].reason = eng.scheduler.finish_reason(req, tok)
                if outcomes[i].reason is None and going_on[j]:
                    outcomes[i].accepted += 1
                    still.append(i)
            active = still

    def _position(self, k: int, reqs: List[Request], raw: torch.Tensor, drafts, qs) -> Tuple[List[int], List[bool]]:
        """The tokens of verify position ``k`` for ``reqs`` and whether each goes on to position ``k + 1``."""
        proc, n = self.engine.processor, self.step_drafts
        changed = proc.apply(raw, reqs)
        tokens = changed.argmax(dim=-1)
        sampled = [j for j, r in enumerate(reqs) if not r.params.greedy]
        accepted = torch.zeros(len(reqs), dtype=torch.int64, device=tokens.device)
        if sampled:  # every sampled row at once, on the device: the one read below brings tokens and acceptance
            where = host_to_device(sampled, torch.int64, tokens.device)
            p = filtered_probs(changed.index_select(0, where), [reqs[j].params for j in sampled])
            generators = [reqs[j].generator for j in sampled]
            if k < n:
                at = host_to_device([drafts[j][k] for j in sampled], torch.int64, tokens.device)
                drawn, took = accept_or_resample(p, torch.stack([qs[j] for j in sampled]), at, generators)
                accepted.index_copy_(0, where, took.long())
            else:
                drawn = draw_rows(p, generators)
            tokens.index_copy_(0, where, drawn)
        proc.record(reqs, tokens)
        tokens, flags = torch.stack([tokens, accepted]).tolist()
        going_on = [bool(f) for f in flags]
        for j, r in enumerate(reqs):
            if r.params.greedy and k < n:
                going_on[j] = tokens[j] == drafts[j][k]
        return tokens, going_on

    def _emit(self, batch: List[Request], outcomes: List[_Outcome]) -> List[Request]:
        eng, now = self.engine, time.perf_counter()
        observer = eng.observer
        alive = []
        for req, out in zip(batch, outcomes):
            for ev in out.events:
                if observer is not None:
                    first = req.last_token_time is None
                    observer.on_token(first, now - (req.arrival if first else req.last_token_time))
                req.last_token_time = now
                req.emit(ev)
            if out.reason is None:
                alive.append(req)
            else:
                eng._finish(req, out.reason)
        if observer is not None:
            observer.on_spec(len(batch) * self.step_drafts, sum(sum(ev.draft for ev in o.events) for o in outcomes))
        return alive
