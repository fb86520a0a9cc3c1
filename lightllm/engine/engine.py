"""The engine: ``step()`` takes new and aborted requests, lets the scheduler decide, runs the runner, samples and
emits each request's events. No threads here: ``LLM`` calls ``step()`` in the caller's thread, the server from
its engine-loop thread. ``submit``, ``abort`` and ``abort_all`` may be called from any thread.

A prefill step may carry only a chunk of a long prompt (chunked prefill): the request's first token is sampled after
its last chunk; until then it holds its KV slot and emits nothing.

Decode steps overlap (unless ``disable_overlap_schedule``): a plain decode step's draws are launched and copied
to the host without waiting, and the next ``step()`` launches the following decode step from those draws still on
the device before it reads them, so the host's share of a step (reading, emitting, finishing, scheduling, staging)
runs while the GPU computes the next one. A request that ends on the token just read (a stop token) had one more
token computed that is dropped; one that ends by length is left out of the next step. Anything else (new or
aborted requests, a prefill chunk, a full KV cache, MTP) reads the step first and goes on as without overlap.

Every submitted request gets exactly one "finish" event. A failure that belongs to one request (its sampling)
ends only that request with "error"; its neighbours in the step go on. A failed model forward ends the requests
of that step with "error" (a prefill's new batch, or the decoding batch) and nothing else: requests still
waiting, and the running ones during a failed prefill, go on. Anything else that raises (a bug) propagates: the
caller then ends every request with ``fail_all``.
"""

import dataclasses
import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Collection, Dict, Iterable, List, Optional, Protocol, Sequence, Set, Tuple

import torch

from lightllm.common.kv_cache import KVCacheFull
from lightllm.common.transfer import HostCopy, host_to_device
from lightllm.engine.gpu_timer import step_gpu_timer
from lightllm.engine.logits_processor import LogitsProcessor
from lightllm.engine.request import Event, Request
from lightllm.engine.runner import AheadDecoder, Runner
from lightllm.engine.sampler import SamplingParams, sample, top_logprobs_launch
from lightllm.engine.scheduler import Scheduler
from lightllm.engine.spec_decode import SpecDecoder

logger = logging.getLogger(__name__)


class StepObserver(Protocol):
    """What the engine reports as it goes (the server's metrics implement it)."""

    def on_queues(self, waiting: int, running: int, kv_usage: float) -> None: ...

    def on_token(self, first: bool, seconds: float) -> None: ...  # since arrival (first) or the previous token

    # Optional: a step's tokens in one call, seconds since arrival for first tokens and since the previous token for
    # the others; an observer without it gets ``on_token`` per token.
    def on_tokens(self, first: Sequence[float], later: Sequence[float]) -> None: ...

    def on_step(self, kind: str, batch_size: int, seconds: float) -> None: ...

    def on_spec(self, drafts: int, accepted: int) -> None: ...  # MTP: drafts proposed and accepted in one step

    # Optional, CUDA only: the GPU seconds of every ``GPU_TIME_EVERY``-th step (of those, the ones that sampled
    # tokens: forward and sampling, ``gpu_timer.py``); with MTP, of its decode steps those whose requests are all
    # plain (no penalty, bias, min_tokens or top logprobs: the others wait for the GPU per verify position).
    def on_step_gpu(self, kind: str, seconds: float) -> None: ...


def eos_token_ids(config, tokenizer, extra: Iterable[int] = ()) -> Set[int]:
    """The ids that end a request (unless it ignores EOS): the model config's, the tokenizer's and ``extra``
    (the server's ``--eos_id``)."""
    eos = set(config.eos_token_ids) | set(extra)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


# Steps per GPU-timed step: a timed step pays two event records and a read of their time, kept off most steps
GPU_TIME_EVERY = 8

# A step's sampled tokens in one call: (requests, token ids, logprobs, top logprobs or None per request).
TokenSink = Callable[[List[Request], List[int], List[float], List[Optional[list]]], None]


@dataclass
class _Draw:
    """A step's draws, launched: device tensors, and their copy to the host once ``start_copy`` queues it."""

    reqs: List[Request]
    tokens: torch.Tensor  # [len(reqs)] on the device: also the next overlapped step's input tokens
    logprobs: torch.Tensor
    top: Optional[tuple]  # (values, ids) of the top logprobs, when some request asks
    copy: Optional[HostCopy] = None

    def start_copy(self) -> "_Draw":
        """Queue the copy of what the host reads (behind the draw's kernels); once only."""
        if self.copy is None:
            top = () if self.top is None else (self.top[1], self.top[0])  # ids, values
            self.copy = HostCopy(self.tokens, self.logprobs, *top)
        return self


@dataclass
class _Ahead:
    """An overlapped decode step in flight: launched, its draws on their way to the host, not yet read."""

    draw: _Draw
    t0: float  # when its step began
    timed: bool  # its GPU time is measured (read with its draws)


class Engine:
    def __init__(self, runner: Runner, eos_ids: Iterable[int], observer: Optional[StepObserver] = None,
                 emit_tokens: Optional[TokenSink] = None):  # fmt: skip
        """``emit_tokens``: takes each step's sampled tokens in one call instead of one ``emit`` per request (the
        engine process packs them into its step message); finishes still go through each request's ``emit``, a
        request's after its last token."""
        self.runner = runner
        self.scheduler = Scheduler(runner, eos_ids)
        self.processor = LogitsProcessor(runner.config.vocab_size, runner.device, self.scheduler.eos)
        self._emit_tokens = emit_tokens or _emit_each
        self.spec = SpecDecoder(self) if getattr(runner, "mtp", None) is not None else None  # fakes may lack it
        self.set_observer(observer)
        self._gpu_steps = itertools.count()
        self._timing = False  # this step is GPU-timed
        self._inbox: "queue.Queue[Request]" = queue.Queue()
        self._aborts: "queue.Queue[Tuple[str, str]]" = queue.Queue()
        self._held_aborts: Dict[str, str] = {}  # taken from the queue mid-step (take_abort): the next step's
        self._closing = threading.Event()
        # Overlapped decode needs a runner that decodes from device tokens (not fakes) and no MTP
        self.overlap = (self.spec is None and isinstance(runner, AheadDecoder)
                        and not getattr(runner.args, "disable_overlap_schedule", False))  # fmt: skip
        self._ahead: Optional[_Ahead] = None
        self._last_read = 0.0  # when the last overlapped step was read: the next one's step time starts there
        if torch.device(getattr(runner, "device", "cpu")).type == "cuda":
            self.warm_up_sampling()

    def set_observer(self, observer: Optional[StepObserver]) -> None:
        """Report to ``observer`` from the next step on (None: to nobody); between steps, on the stepping thread.
        With ``on_step_gpu``, on a GPU, and a runner that marks its launches (fakes may not), a step GPU timer comes
        with it; an MTP decode step marks its own launches (spec_decode.py)."""
        self.observer = observer
        self._on_tokens = getattr(observer, "on_tokens", None)
        self._on_step_gpu = getattr(observer, "on_step_gpu", None)
        self._gpu_timer = None
        set_hook = getattr(self.runner, "set_launch_hook", None)
        if self._on_step_gpu is not None and set_hook is not None:
            self._gpu_timer = step_gpu_timer(self.runner.device)
        if set_hook is not None:
            set_hook(None if self._gpu_timer is None else _weak_hook(self))

    # ---- any thread ----------------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Queue ``req`` for the next step; a seeded one gets its own generator (the same seed gives the same
        tokens whoever shares the batch, offline or served)."""
        if req.params.seed is not None and req.generator is None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(req.params.seed)
        self._inbox.put(req)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End the request with ``reason`` (running or still waiting) and free its KV at the next step boundary.
        The server and ``LLM`` end a request on a stop string with "stop"."""
        self._aborts.put((request_id, reason))

    def abort_all(self) -> None:
        """From the next step boundary on, abort every request, running, waiting or submitted later (shutdown)."""
        self._closing.set()

    def wait_for_request(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a request is submitted (an idle loop's wait)."""
        try:
            self.scheduler.add(self._inbox.get(timeout=timeout))
        except queue.Empty:
            pass

    # ---- the stepping thread -------------------------------------------------------------------------------

    def step(self) -> bool:
        """One prefill or decode step; False when there was nothing to do."""
        aborts = self._take_aborts()  # before the inbox: a request's submit is always seen with its abort
        self._take_new()
        read = self._ahead is not None  # a step in flight is work done, even when nothing follows it
        if read:
            follow = self._follow_up(aborts)
            if follow is not None:
                self._decode_ahead(*follow)
                return True
            self._abort_all_at_shutdown(aborts)  # the tokens in flight were computed past it, as an abort's are
            self._read_ahead(aborted=aborts)
            # an abort (and a submit) made while the step was read, from an emit callback, is seen before the next
            # forward, as a synchronous step sees one made in its emits before the next step() call
            for request_id, reason in self._take_aborts().items():
                aborts.setdefault(request_id, reason)
            self._take_new()
        self._abort_all_at_shutdown(aborts)
        for req, reason in self.scheduler.remove(aborts):
            self._finish(req, reason)
        self._observe_queues()
        kind, batch = self.scheduler.schedule()
        if kind == "idle":
            return read
        t0 = time.perf_counter()
        self._timing = self._next_timed()
        if kind == "decode" and self.spec is not None:  # MTP: draft, verify, accept (spec_decode.py)
            self.scheduler.update(kind, self.spec.step(batch))
            self._report_step(kind, len(batch), t0, self._timing)
            return True
        try:
            if kind == "decode":
                logits = self.runner.decode([r.slot for r in batch], [r.output_ids[-1] for r in batch])
            else:  # prefill, or mixed: a running request's chunk is its last token
                chunks = [r.context_slice(r.prefilled, r.chunk_end) for r in batch]
                # the prefix cache takes each prompt chunk as it is computed, while the request runs (a mixed step's
                # decode tokens wait for their request's end); a prompt's end and a branch keep a lasting checkpoint
                decoding = {id(r) for r in self.scheduler.running} if kind == "mixed" else ()
                publish = [(r.slot, r.chunk_end in (r.context_len, r.branch)) for r in batch if id(r) not in decoding]
                if self.spec is None:
                    logits = self.runner.prefill([r.slot for r in batch], chunks, publish)
                else:  # the MTP head's KV at a chunk's last position reads the token after it
                    following = [r.context_slice(r.chunk_end, r.chunk_end + 1)[0] if r.chunk_end < r.context_len
                                 else None for r in batch]  # fmt: skip
                    logits = self.runner.prefill([r.slot for r in batch], chunks, publish, following)
        except Exception:  # e.g. out of memory on one long prompt: only the requests of this forward fail
            failed = self.scheduler.mixed_step_failed(batch) if kind == "mixed" else batch
            logger.exception(
                "%s forward of %d requests failed; %d end with finish_reason error%s",
                kind,
                len(batch),
                len(failed),
                ", the running ones wait to be re-prefilled" if kind == "mixed" else "",
            )
            for req in failed:
                self._finish(req, "error")
            self.scheduler.update(kind, [])
            return True
        if kind == "decode" and self.overlap:
            draw = self._launch_draw(batch, logits)
            if draw is not None:  # read at the next step, after the next decode step is launched
                self._ahead = _Ahead(draw, t0, self._timing)
                return True
        sampled = batch
        if kind != "decode":  # only the requests whose whole context is in now draw a token
            sampled = self.scheduler.prefilled(batch)
            if len(sampled) < len(batch):
                done = {id(r) for r in sampled}
                keep = [i for i, r in enumerate(batch) if id(r) in done]  # no sync: list indexing would wait
                logits = logits.index_select(0, host_to_device(keep, torch.int64, logits.device))
        alive = self._postprocess(sampled, logits) if sampled else []
        self.scheduler.update(kind, alive)
        self._report_step(kind, len(batch), t0, self._timing)  # _postprocess read the draws: t0..now holds the GPU work
        return True

    # ---- overlapped decode --------------------------------------------------------------------------------

    def _follow_up(self, aborts: dict) -> Optional[Tuple[List[Request], List[int]]]:
        """The next decode step of the step in flight, when it may be launched before that step is read: (its
        requests, each one's row in the step in flight); None when that step must be read first."""
        sched = self.scheduler
        if not self.overlap or aborts or self._closing.is_set() or sched.prefilling:  # overlap may be switched off
            return None
        if sched.can_admit():
            return None  # a waiting request would be admitted: its prefill needs the step read
        batch, rows = [], []
        for i, req in enumerate(self._ahead.draw.reqs):  # ended at the last read, or ending with the token in flight
            if req.slot >= 0 and not sched.ends_by_length(req, len(req.output_ids) + 1):
                batch.append(req)
                rows.append(i)
        if not batch or not self.runner.kv.can_allocate(len(batch)):
            return None  # nothing goes on (every request ends by length), or the scheduler must preempt
        return batch, rows

    def _decode_ahead(self, batch: List[Request], rows: List[int]) -> None:
        """Launch ``batch``'s decode step from the draws of the step in flight, then read that step: its host work
        runs while the GPU computes this one."""
        self._observe_queues()
        t0 = time.perf_counter()
        self._timing = self._next_timed()
        slots = [r.slot for r in batch]
        try:
            logits = self.runner.decode_ahead(slots, rows, self._ahead.draw.tokens)
        except Exception:
            logger.exception("decode forward of %d requests failed; they end with finish_reason error", len(batch))
            self._read_ahead()
            for req in batch:
                if req.slot >= 0:  # not ended by the step just read
                    self._finish(req, "error")
            self.scheduler.update("decode", [])
            return
        draw = self._launch_draw(batch, logits)
        self._read_ahead(inputs=(slots, rows))
        if draw is None:  # the batch draw raised: drawn synchronously, one by one where need be
            keep = [i for i, r in enumerate(batch) if r.slot >= 0]  # not ended by the step just read
            if len(keep) < len(batch):
                logits = logits.index_select(0, host_to_device(keep, torch.int64, logits.device))
            alive = [batch[i] for i in keep]
            self.scheduler.update("decode", self._postprocess(alive, logits) if alive else [])
            self._report_step("decode", len(batch), t0, self._timing)
            return
        self._ahead = _Ahead(draw, t0, self._timing)

    def _read_ahead(self, inputs: Optional[Tuple[List[int], List[int]]] = None, aborted: Collection[str] = ()) -> None:
        """Read the step in flight and go on as a synchronous step would after its draw: emit, finish, update the
        scheduler. ``inputs``: (slots, rows) of the decode step launched from its draws, whose input tokens are
        now known (booked before any request ends, so an ended request's KV row holds them). The tokens of the
        requests named in ``aborted`` are dropped (a synchronous step would not have computed them); they stay
        running for the abort to end."""
        ahead, self._ahead = self._ahead, None
        tokens, logprobs, tops = self._read_draw(ahead.draw)
        if inputs is not None:
            slots, rows = inputs
            self.runner.inputs_known(slots, [tokens[i] for i in rows])
        reqs = ahead.draw.reqs
        # requests that ended at the step before (their slot freed) or are being aborted: their tokens are dropped
        live = [i for i, r in enumerate(reqs) if r.slot >= 0 and r.id not in aborted]
        if len(live) < len(reqs):
            reqs, tokens, logprobs, tops = ([x[i] for i in live] for x in (reqs, tokens, logprobs, tops))
        alive = self._consume(reqs, tokens, logprobs, tops, [], time.perf_counter())
        if aborted:
            alive += [r for r in ahead.draw.reqs if r.slot >= 0 and r.id in aborted]
        self.scheduler.update("decode", alive)
        self._report_step("decode", len(ahead.draw.reqs), max(ahead.t0, self._last_read), ahead.timed)
        self._last_read = time.perf_counter()

    # ---- observing -----------------------------------------------------------------------------------------

    def _observe_queues(self) -> None:
        if self.observer is not None:
            sched = self.scheduler
            self.observer.on_queues(
                len(sched.waiting), len(sched.running) + len(sched.prefilling), self.runner.kv.usage()
            )

    def _next_timed(self) -> bool:
        """Whether the step about to launch is GPU-timed: every ``GPU_TIME_EVERY``-th, with a timer, but not one
        launched while a timed step is in flight (the timer times one step at a time)."""
        if self._gpu_timer is None or next(self._gpu_steps) % GPU_TIME_EVERY:
            return False
        return self._ahead is None or not self._ahead.timed

    def _report_step(self, kind: str, batch_size: int, t0: float, timed: bool) -> None:
        """A read step's seconds since ``t0`` and, when it was timed, its GPU seconds (none for a chunk that sampled
        nothing, or an MTP step that did not mark its launches)."""
        if self.observer is not None:
            self.observer.on_step(kind, batch_size, time.perf_counter() - t0)
        if timed:
            gpu_seconds = self._gpu_timer.seconds()
            if gpu_seconds is not None:
                self._on_step_gpu(kind, gpu_seconds)

    def _mark_launch(self) -> None:
        """The runner's launch hook: a timed step's GPU timer starts as its forward is launched."""
        if self._timing:
            self._gpu_timer.start()

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests() or not self._inbox.empty())

    def fail_all(self) -> None:
        """After a failed step: every request it holds ends with "error" (a step in flight is dropped)."""
        self._ahead = None
        for req in self.scheduler.remove_all():
            self._finish(req, "error")

    def _take_new(self) -> None:
        while True:
            try:
                self.scheduler.add(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _abort_all_at_shutdown(self, aborts: dict) -> None:
        """After ``abort_all``: every request left, running or still waiting, is in ``aborts`` (its own reason kept)."""
        if self._closing.is_set():
            for req in self.scheduler.requests():
                aborts.setdefault(req.id, "abort")

    def take_abort(self, request_id: str) -> Optional[str]:
        """Take an abort of ``request_id`` made since this step took its aborts (from an emit callback, say): its
        reason, or None. The other aborts it finds are applied at the next step boundary. Called per emitted token
        of an MTP run: an unlocked look at the queue skips the locked drain when none was made; one landing just
        after it is taken at the next step boundary, as any abort is."""
        if self._aborts.queue:
            self._held_aborts = self._take_aborts()
        return self._held_aborts.pop(request_id, None)

    def _take_aborts(self) -> dict:
        reasons, self._held_aborts = self._held_aborts, {}
        while True:
            try:
                request_id, reason = self._aborts.get_nowait()
            except queue.Empty:
                return reasons
            reasons.setdefault(request_id, reason)

    def _postprocess(self, reqs: List[Request], logits: torch.Tensor) -> List[Request]:
        """Append each request's sampled token, emit the step's tokens, finish the requests that end: those that go
        on. Per-request work is plain Python over lists: one host transfer per step, none per request."""
        now = time.perf_counter()
        tokens, logprobs, tops = self._sample(reqs, logits)
        failed = []
        if None in tokens:  # some request's own draw failed: it ends with "error", the others go on
            failed = [r for r, t in zip(reqs, tokens) if t is None]
            keep = [i for i, t in enumerate(tokens) if t is not None]
            reqs, tokens, logprobs, tops = ([x[i] for i in keep] for x in (reqs, tokens, logprobs, tops))
        return self._consume(reqs, tokens, logprobs, tops, failed, now)

    def _consume(self, reqs: List[Request], tokens: List[int], logprobs: List[float], tops: List[Optional[list]],
                 failed: List[Request], now: float) -> List[Request]:  # fmt: skip
        """Append each request's read token, emit them, finish the requests that end (and ``failed``, whose draw
        failed, with "error"): those that go on."""
        if self.observer is not None:
            self._observe_tokens(reqs, now)
        finish_reason, reasons = self.scheduler.finish_reason, []
        for req, tok in zip(reqs, tokens):
            req.last_token_time = now
            req.output_ids.append(tok)
            reasons.append(finish_reason(req, tok))
        if reqs:  # before any finish: a request's token comes first
            self._emit_tokens(reqs, tokens, logprobs, tops)
        alive = []
        for req, reason in zip(reqs, reasons):
            if reason is None:
                alive.append(req)
            else:
                self._finish(req, reason)
        for req in failed:
            self._finish(req, "error")
        return alive

    def _observe_tokens(self, reqs: List[Request], now: float) -> None:
        """Time to first token or since the previous token, for each request's new token (before ``now`` is
        recorded as its last token time)."""
        if self._on_tokens is None:
            for req in reqs:
                first = req.last_token_time is None
                self.observer.on_token(first, now - (req.arrival if first else req.last_token_time))
            return
        first = [now - r.arrival for r in reqs if r.last_token_time is None]
        later = [now - r.last_token_time for r in reqs if r.last_token_time is not None]
        self._on_tokens(first, later)

    def _sample(self, reqs: List[Request], logits: torch.Tensor) -> Tuple[list, List[float], List[Optional[list]]]:
        """(tokens, logprobs, top logprobs or None) per request; a request whose own draw fails gets token None.
        The batch is drawn at once; if that raises, each request is drawn alone, so only the requests that cause
        the failure lose their draw; seeded generators are first put back where the failed batch draw found them,
        so a seed's tokens do not depend on a neighbour's failure."""
        seeded = [(r.generator, r.generator.get_state()) for r in reqs if r.generator is not None]
        try:
            return self._draw(reqs, logits)
        except Exception:
            logger.exception("sampling a batch of %d requests failed; sampling them one by one", len(reqs))
        for generator, state in seeded:
            generator.set_state(state)
        tokens, logprobs, tops = [], [], []
        for i, req in enumerate(reqs):
            try:
                tok, lp, top = self._draw([req], logits[i : i + 1])
            except Exception:
                logger.exception("sampling request %s failed; it ends with finish_reason error", req.id)
                tok, lp, top = [None], [0.0], [None]
            tokens += tok
            logprobs += lp
            tops += top
        return tokens, logprobs, tops

    def _draw(self, reqs: List[Request], logits: torch.Tensor) -> Tuple[List[int], List[float], List[Optional[list]]]:
        """Penalties and bias (only for the requests that ask), the draw, and the top logprobs (only when asked):
        tokens, logprobs and top logprobs (or None) per request."""
        return self._read_draw(self._launch(reqs, logits))

    def _launch(self, reqs: List[Request], logits: torch.Tensor) -> _Draw:
        """``_draw``'s device work, queued: nothing waits for the device."""
        params = [r.params for r in reqs]
        changed = self.processor.apply(logits, reqs)
        generators = [r.generator for r in reqs]
        if changed is logits:
            tokens, logprobs = sample(logits, params, generators)
        else:
            tokens, logprobs = sample(changed, params, generators, raw_logits=logits)
        k = max([p.top_logprobs for p in params])
        top = top_logprobs_launch(logits, k) if k else None
        self.processor.record(reqs, tokens)
        if self._timing:  # the step's last launch: the host reads its results next
            self._gpu_timer.stop()
        return _Draw(reqs, tokens, logprobs, top)

    def _launch_draw(self, reqs: List[Request], logits: torch.Tensor) -> Optional[_Draw]:
        """An overlapped step's draw, launched and its copy to the host started; None when the batch draw raised
        (seeded generators put back where it found them, for ``_sample``'s one-by-one draws)."""
        seeded = [(r.generator, r.generator.get_state()) for r in reqs if r.generator is not None]
        try:
            draw = self._launch(reqs, logits)
        except Exception:
            for generator, state in seeded:
                generator.set_state(state)
            return None
        return draw.start_copy()

    def _read_draw(self, draw: _Draw) -> Tuple[List[int], List[float], List[Optional[list]]]:
        """Tokens, logprobs and top logprobs (or None) per request of a launched draw (waits for the device)."""
        tokens, logprobs, *top = draw.start_copy().copy.lists()
        tops = [None] * len(draw.reqs)
        if top:
            ids, values = top
            tops = [list(zip(i[: p.top_logprobs], v[: p.top_logprobs])) if p.top_logprobs else None
                    for i, v, p in zip(ids, values, (r.params for r in draw.reqs))]  # fmt: skip
        return tokens, logprobs, tops

    def warm_up_sampling(self) -> None:
        """Draw once from random logits, greedily and with every sampling option (temperature, top-k, top-p, min-p,
        penalties, bias, ``min_tokens``, a seed, top logprobs; with MTP the drafts' choice and the verify's acceptance
        too), leaving no trace. CUDA loads a kernel's module at its first launch, and the runner's warm-up draws
        nothing: on an H100 a first 1-token request took 31 ms to its first token, its second send 1 ms
        (docs/engine.md, "Start-up")."""
        vocab, dev = self.runner.config.vocab_size, self.runner.device
        options = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01, presence_penalty=0.1,
                                 frequency_penalty=0.1, repetition_penalty=1.1, logit_bias={vocab - 1: 1.0},
                                 min_tokens=2, top_logprobs=2)  # fmt: skip
        params = (SamplingParams(), options, dataclasses.replace(options, seed=0))
        reqs = [Request(f"warm-up-{i}", [0, vocab - 1], p, _ignore) for i, p in enumerate(params)]
        reqs[2].generator = torch.Generator(device=dev).manual_seed(0)
        logits = torch.randn(len(reqs), vocab, device=dev)
        try:
            self._draw(reqs[:1], logits[:1])  # greedy alone: the argmax, no penalty
            self._draw(reqs, logits)
            if self.spec is not None:
                self.spec.warm_up(reqs, vocab)
        finally:
            for req in reqs:
                self.processor.release(req)

    def _finish(self, req: Request, reason: str) -> None:
        if req.finished:  # a step that raised after finishing it leaves it to fail_all too: one finish per request
            return
        req.finished = True
        try:
            self.processor.release(req)
            try:
                self.scheduler.release(req)
            except (ValueError, KVCacheFull):
                logger.exception("freeing request %s", req.id)
        finally:  # anything else (a device error saving its state) fails the step, and fail_all skips it: end it now
            req.emit(Event("finish", finish_reason=reason, cached_tokens=req.num_cached_tokens or 0))


def _weak_hook(engine: Engine) -> Callable[[], None]:
    """``engine``'s launch hook for its runner, holding the engine weakly: the runner keeps the hook, and a cycle
    back to the engine would keep both (and the GPU memory) alive after the last reference to the engine goes."""
    ref = weakref.ref(engine)

    def hook() -> None:
        live = ref()
        if live is not None:
            live._mark_launch()

    return hook


def _emit_each(reqs: List[Request], tokens: List[int], logprobs: List[float], tops: List[Optional[list]]) -> None:
    """The default ``TokenSink``: a token event through each request's own ``emit``."""
    for req, tok, lp, top in zip(reqs, tokens, logprobs, tops):
        req.emit(Event("token", tok, lp, top_logprobs=top, cached_tokens=req.num_cached_tokens or 0))


def _ignore(_event: Event) -> None:
    """The emit of ``warm_up_sampling``'s requests: they are never submitted."""
