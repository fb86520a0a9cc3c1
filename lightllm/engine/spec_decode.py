"""MTP speculative decoding's decode step in the engine: draft, verify, accept, emit.

Each running request gets ``N`` draft tokens from the runner's MTP head, then one main-model forward over its
last token and the drafts gives the target logits at ``N + 1`` positions. Position ``k`` is decided like a plain
decode step (penalties and bias applied over the tokens before it, the same greedy choice), in order, while the
drafts before it hold (all positions on the device at once, then one read):

- greedy: the target's choice is emitted; when it equals draft ``k + 1`` the next position is decided too,
  else the step ends there (the longest agreeing prefix plus one token: output equals MTP off, token for token);
- sampling: draft ``x`` (drawn from the head's distribution ``q``, filtered by the request's temperature, top-k,
  top-p and min-p) is accepted with probability ``min(1, p(x) / q(x))`` under the target's filtered ``p``; on a reject
  a token is drawn from ``norm(max(p - q, 0))`` and the step ends; after all ``N`` drafts, one more from ``p``.
  Every emitted token is thereby distributed as plain sampling would draw it.

Each emitted token is checked for EOS, stop token ids and length at once, so a request never emits past its end
inside an accepted run; an abort made from a token's emit callback (the server's and ``LLM``'s stop strings) ends
the request there, as it would after a one-token step: none of the run's later tokens is emitted.
"""

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from lightllm.common.transfer import host_to_device
from lightllm.engine.request import Event, Request
from lightllm.engine.sampler import (
    SamplingParams,
    draw_weighted,
    filtered_sorted,
    rows_by_generator,
    top_logprobs_launch,
)

logger = logging.getLogger(__name__)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution ``sampler.sample_rows`` draws from, per row of ``logits [n, vocab]``: temperature, then
    top-k, top-p and min-p (``sampler.filtered_sorted``), renormalized, in token order. A row that is not a
    distribution (non-finite logits) is all on the token ``sample_rows`` takes for it, its most likely one, so
    acceptance, resampling and the bonus draw agree with plain sampling there too."""
    scaled, probs, order = filtered_sorted(logits, params)
    if probs is None:
        probs, fallback = torch.softmax(scaled, dim=-1), logits.argmax(dim=-1)
    else:
        fallback = order.gather(1, scaled.argmax(dim=-1, keepdim=True)).squeeze(1)
        probs = torch.zeros_like(probs).scatter_(1, order, probs / probs.sum(dim=-1, keepdim=True))
    bad = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
    one_hot = torch.zeros_like(probs).scatter_(1, fallback[:, None], 1.0)
    return torch.where(bad[:, None], one_hot, probs)


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
    accepted = u * q.gather(1, at).squeeze(1) < p.gather(1, at).squeeze(1)  # not <=: u may be 0, p(d) may be 0
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

    def row(self, i: int) -> "DraftChooser":
        """The chooser of request ``i`` alone, with the ``q`` it drew its drafts from."""
        one = DraftChooser([self.reqs[i]])
        if one.sampled:
            at = self.sampled.index(i)
            one.q = [q[at : at + 1] for q in self.q]
        return one

    def __call__(self, k: int, logits: torch.Tensor) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        if self.sampled:
            where = host_to_device(self.sampled, torch.int64, logits.device)
            probs = filtered_probs(logits.index_select(0, where), [self.reqs[i].params for i in self.sampled])
            self.q.append(probs)
            tokens.index_copy_(0, where, draw_rows(probs, [self.reqs[i].generator for i in self.sampled]))
        return tokens


class ProcessedLogits:
    """The verify's ``logits [B, T, vocab]`` as the requests choose from them: ``logits`` itself, except the rows of
    requests with penalties, bias or ``min_tokens`` (``rows``), whose every position is ``changed [P, T, vocab]``.
    Only those rows are copied: a batch with one penalised request does not pay a copy of the whole batch's logits."""

    def __init__(self, logits: torch.Tensor, rows: Sequence[int] = (), changed: Optional[torch.Tensor] = None,
                 where: Optional[torch.Tensor] = None):  # fmt: skip
        self.logits, self.rows, self.changed = logits, list(rows), changed
        if where is None and self.rows:  # ``rows`` on the device (the caller may have staged them already)
            where = host_to_device(self.rows, torch.int64, logits.device)
        self._where = where

    def argmax(self) -> torch.Tensor:
        """``[B, T]``: each position's most likely token after processing."""
        tokens = self.logits.argmax(dim=-1)
        if self.rows:
            tokens.index_copy_(0, self._where, self.changed.argmax(dim=-1))
        return tokens

    def at(self, k: int, rows: Sequence[int]) -> torch.Tensor:
        """``[len(rows), vocab]``: position ``k`` of batch rows ``rows``, processed."""
        dev = self.logits.device
        out = self.logits[:, k].index_select(0, host_to_device(list(rows), torch.int64, dev))
        mine = {r: j for j, r in enumerate(self.rows)}
        both = [(i, mine[r]) for i, r in enumerate(rows) if r in mine]
        if both:
            at, src = host_to_device([i for i, _ in both], torch.int64, dev), [j for _, j in both]
            out.index_copy_(0, at, self.changed[:, k].index_select(0, host_to_device(src, torch.int64, dev)))
        return out


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
        if eng._timing:  # nothing waits for the GPU before the acceptance's one read (gpu_timer.py)
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

    def warm_up(self, reqs: List[Request], vocab: int) -> None:
        """Choose drafts for ``reqs`` and run the verify's acceptance on random logits, reading nothing back into the
        requests (``Engine.warm_up_sampling``: the first launch of each kernel loads its module)."""
        dev, n, chooser = self.engine.runner.device, self.step_drafts, DraftChooser(reqs)
        drafts = torch.stack([chooser(k, torch.randn(len(reqs), vocab, device=dev)) for k in range(n)], dim=1)
        self._read(reqs, drafts, torch.randn(len(reqs), n + 1, vocab, device=dev), chooser, 2)

    def _decide(self, batch, drafts: torch.Tensor, logits: torch.Tensor, chooser: DraftChooser) -> List[_Outcome]:
        """Each request's tokens, events and accepted drafts from the verify's ``logits [B, N + 1, vocab]`` and the
        drafts ``[B, N]`` (on the device), in one device-to-host read. A request reaches verify position ``k`` only
        when drafts ``1..k`` were accepted, so position ``k`` is decided on the device as if they were: penalties
        count them and ``min_tokens`` counts ``k`` more tokens; a position past a rejection is decided for nothing
        (a sampled one draws for nothing, which changes no emitted token's distribution). Greedy: the argmax,
        going on while it equals the next draft; sampled: the acceptance rule, and the bonus draw. Logprobs and top
        logprobs are of the model's own distribution. The processor then records what was emitted. If the batch's
        read raises, each request is decided alone (seeded generators put back first): only a request whose own
        read fails ends with "error"."""
        eng, n, T = self.engine, self.step_drafts, self.step_drafts + 1
        outcomes = [_Outcome() for _ in batch]
        want = max(r.params.top_logprobs for r in batch)
        seeded = [(r.generator, r.generator.get_state()) for r in batch if r.generator is not None]
        try:
            got = self._read(batch, drafts, logits, chooser, want)
        except Exception:
            if len(batch) == 1:
                logger.exception("MTP acceptance of request %s failed; it ends with finish_reason error", batch[0].id)
                got = [None]
            else:
                logger.exception("MTP acceptance of %d requests failed; deciding them one by one", len(batch))
                # as the plain sampler does: only the requests that cause the failure lose their step, and a seeded
                # request draws from where the failed batch found its generator
                for generator, state in seeded:
                    generator.set_state(state)
                got = [self._read_one(batch, i, drafts, logits, chooser, want) for i in range(len(batch))]
        finish_reason, top_at = eng.scheduler.finish_reason, 2 * T + n
        emitted = []
        for req, out, row in zip(batch, outcomes, got):
            if row is None:  # its own acceptance failed: it ends, its neighbours go on
                out.reason = "error"
                emitted.append([])
                continue
            cached, top = req.num_cached_tokens or 0, None
            for k in range(T):
                tok = int(row[k])
                going = k < n and row[2 * T + k] > 0
                if req.params.top_logprobs:
                    ids = row[top_at + k * want : top_at + k * want + req.params.top_logprobs]
                    values = row[top_at + (T + k) * want : top_at + (T + k) * want + req.params.top_logprobs]
                    top = [(int(t), v) for t, v in zip(ids, values)]
                req.output_ids.append(tok)
                out.events.append(Event("token", tok, row[T + k], top_logprobs=top, cached_tokens=cached, draft=going))
                out.reason = finish_reason(req, tok)
                if out.reason is not None or not going:
                    break
                out.accepted += 1
            emitted.append([ev.token_id for ev in out.events])
        eng.processor.record_many(batch, emitted)
        return outcomes

    def _read(self, batch, drafts: torch.Tensor, logits: torch.Tensor, chooser: DraftChooser, want: int) -> list:
        """The device part of ``_decide``, one read: per request a row of floats, its ``T`` tokens, their ``T``
        logprobs, the ``N`` going-on flags, then (when a request of ``batch`` asks) ``T * want`` top ids and
        ``T * want`` top values."""
        eng, n = self.engine, self.step_drafts
        processed = self._processed(batch, drafts, logits)
        tokens = processed.argmax()  # [B, T]
        going_on = tokens[:, :n] == drafts  # [B, N]
        sampled = [i for i, r in enumerate(batch) if not r.params.greedy]
        if sampled:
            self._sample_positions(batch, sampled, drafts, processed, chooser, tokens, going_on)
        # log_softmax at the chosen token without a [B, T, vocab] log-softmax: its logit minus the logsumexp
        lps = logits.gather(-1, tokens[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        parts = [tokens.double(), lps.double(), going_on.double()]
        if want and any(r.params.top_logprobs for r in batch):
            parts += self._top_logprobs(batch, logits, want)
        packed = torch.cat(parts, dim=1)
        if eng._timing:  # the step's last launch
            eng._gpu_timer.stop()
        return packed.tolist()  # one read: token ids (< 2**53) are exact in float64

    def _read_one(self, batch, i: int, drafts, logits, chooser: DraftChooser, want: int) -> Optional[list]:
        """``_read`` of ``batch[i]`` alone (its row, with the batch's ``want``), None when it fails."""
        try:
            return self._read([batch[i]], drafts[i : i + 1], logits[i : i + 1], chooser.row(i), want)[0]
        except Exception:
            logger.exception("MTP acceptance of request %s failed; it ends with finish_reason error", batch[i].id)
            return None

    def _processed(self, batch, drafts: torch.Tensor, logits: torch.Tensor) -> ProcessedLogits:
        """``logits`` with each request's penalties, bias and ``min_tokens`` applied at every verify position,
        position ``k`` as if the ``k`` drafts before it were generated."""
        rows = [i for i, r in enumerate(batch) if r.params.processes_logits]
        if not rows:
            return ProcessedLogits(logits)
        proc, reqs = self.engine.processor, [batch[i] for i in rows]
        where = host_to_device(rows, torch.int64, logits.device)
        picked, pending = logits.index_select(0, where), drafts.index_select(0, where)
        changed = [proc.apply(picked[:, k], reqs, pending=pending[:, :k]) for k in range(logits.shape[1])]
        return ProcessedLogits(logits, rows, torch.stack(changed, dim=1), where)

    @staticmethod
    def _top_logprobs(batch, logits: torch.Tensor, want: int) -> List[torch.Tensor]:
        """``[ids, values]``, each ``[B, T * want]`` float64: every position's ``want`` most likely tokens for the
        requests that ask (zeros for the others; the log-softmax runs over their rows only)."""
        rows = [i for i, r in enumerate(batch) if r.params.top_logprobs]
        where = host_to_device(rows, torch.int64, logits.device)
        values, ids = top_logprobs_launch(logits.index_select(0, where), want)  # [W, T, want]
        shape = (logits.shape[0], logits.shape[1] * want)
        out_ids = torch.zeros(shape, dtype=torch.float64, device=logits.device)
        out_values = torch.zeros(shape, dtype=torch.float64, device=logits.device)
        out_ids.index_copy_(0, where, ids.flatten(1).double())
        out_values.index_copy_(0, where, values.flatten(1).double())
        return [out_ids, out_values]

    @staticmethod
    def _sample_positions(batch, rows: List[int], drafts: torch.Tensor, logits: ProcessedLogits,
                          chooser: DraftChooser, tokens: torch.Tensor, going_on: torch.Tensor) -> None:  # fmt: skip
        """The sampled requests ``batch[i]`` for ``i`` in ``rows`` (their rows of ``logits``, ``drafts``, ``tokens``
        and ``going_on``): at each draft position the acceptance rule (accepted, or the residual's draw),
        after the last the bonus draw from ``p``; into ``tokens`` and ``going_on`` on the device. Position by
        position (one ``[S, vocab]`` distribution live at a time, each seeded request's generator drawn in position
        order)."""
        dev, n = drafts.device, drafts.shape[1]
        where = host_to_device(rows, torch.int64, dev)
        params = [batch[i].params for i in rows]
        generators = [batch[i].generator for i in rows]
        q_row = {i: row for row, i in enumerate(chooser.sampled)}
        q_where = host_to_device([q_row[i] for i in rows], torch.int64, dev)
        picked = drafts.index_select(0, where)
        drawn, took = [], []
        for k in range(n + 1):
            p = filtered_probs(logits.at(k, rows), params)
            if k < n:
                token, accepted = accept_or_resample(p, chooser.q[k].index_select(0, q_where), picked[:, k], generators)
                drawn.append(token)
                took.append(accepted)
            else:
                drawn.append(draw_rows(p, generators))
        tokens.index_copy_(0, where, torch.stack(drawn, dim=1))
        going_on.index_copy_(0, where, torch.stack(took, dim=1))

    def _emit(self, batch: List[Request], outcomes: List[_Outcome]) -> List[Request]:
        eng, now = self.engine, time.perf_counter()
        observer = eng.observer
        alive = []
        for req, out in zip(batch, outcomes):
            reason = out.reason
            for ev in out.events:
                if observer is not None:
                    first = req.last_token_time is None
                    observer.on_token(first, now - (req.arrival if first else req.last_token_time))
                req.last_token_time = now
                req.emit(ev)
                aborted = eng.take_abort(req.id) if ev is not out.events[-1] else None
                if aborted is not None:
                    reason = aborted
                    break
            if reason is None:
                alive.append(req)
            else:
                eng._finish(req, reason)
        if observer is not None:
            observer.on_spec(len(batch) * self.step_drafts, sum(sum(ev.draft for ev in o.events) for o in outcomes))
        return alive
