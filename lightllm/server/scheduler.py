"""Continuous batching on one thread that owns the model runner.

Each step: take new and aborted requests, admit waiting ones while request slots, the prefill token
budget and free KV allow (prefill first), else decode every running request. When the KV cache can't
hold the next token of every running request the newest one is preempted: its KV is freed and it waits
to be re-prefilled with what it has generated so far. Results go back through each request's ``emit``
callback (thread-safe on the HTTP side); every submitted request gets exactly one "finish" event.

A failure that belongs to one request (its sampling) ends only that request with "error"; its neighbours in
the step go on. A failure of the step itself (the model forward) fails the requests in it.
"""

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

from lightllm.common.kv_cache import KVCacheFull
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.sampler import SamplingParams, sample

logger = logging.getLogger(__name__)


@dataclass
class Event:
    kind: str  # "token" | "finish"
    token_id: int = -1
    logprob: float = 0.0
    finish_reason: str = ""


@dataclass
class ServerRequest:
    id: str
    prompt_ids: List[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    output_ids: List[int] = field(default_factory=list)
    slot: int = -1
    generator: Optional[torch.Generator] = None
    arrival: float = field(default_factory=time.perf_counter)
    last_token_time: Optional[float] = None

    @property
    def context(self) -> List[int]:
        """What a (re-)prefill must process: the prompt and everything generated so far."""
        return self.prompt_ids + self.output_ids


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        eos_token_ids,
        metrics=None,
        after_step: Optional[Callable[[], None]] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.runner = runner
        self.after_step = after_step  # called on the scheduler thread after every step: deliver its events
        self.args = runner.args
        self.clock = clock  # times the step in flight, for /health
        self._step_started: Optional[float] = None
        self._closing = threading.Event()
        if self.args.batch_max_tokens < self.args.max_req_total_len:
            logger.info("batch_max_tokens %d < max_req_total_len %d: a longer prompt is prefilled alone and whole, "
                        "over the budget, in one step (there is no chunked prefill yet)", self.args.batch_max_tokens,
                        self.args.max_req_total_len)  # fmt: skip
        self.eos = set(eos_token_ids)
        self.metrics = metrics
        self._inbox: "queue.Queue[ServerRequest]" = queue.Queue()
        self._aborts: "queue.Queue[Tuple[str, str]]" = queue.Queue()
        self.waiting: Deque[ServerRequest] = deque()
        self.running: List[ServerRequest] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="lightllm-scheduler", daemon=True)

    # ---- called from the HTTP side -------------------------------------------------------------------------

    def submit(self, req: ServerRequest) -> None:
        self._inbox.put(req)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End the request with ``reason`` (running or still waiting) and free its KV at the next step boundary
        (milliseconds). The HTTP side ends a request on a stop string with "stop"."""
        self._aborts.put((request_id, reason))

    def abort_all(self) -> None:
        """From the next step boundary on, abort every request, running, waiting or submitted later (shutdown)."""
        self._closing.set()

    def step_in_flight_s(self) -> Optional[float]:
        """How long the loop's current step has run; None between steps."""
        started = self._step_started
        return None if started is None else self.clock() - started

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop after the current step; False when the step is still running after ``timeout`` seconds."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    # ---- the loop ------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = True
            self._step_started = self.clock()
            try:
                busy = self.step()
            except Exception:  # a failing step must not kill the server silently
                logger.exception("scheduler step failed; failing the requests in it")
                for req in self.running + list(self.waiting):
                    self._finish(req, "error")
                self.running, self.waiting = [], deque()
            self._step_started = None
            if self.after_step is not None:  # before any wait: an idle step may still have finished aborts
                self.after_step()
            if not busy:
                self._take_new(block=True)

    def _take_new(self, block: bool) -> None:
        try:
            first = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self.waiting.append(first)
        while True:
            try:
                self.waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break

    def _take_aborts(self) -> Dict[str, str]:
        reasons = {}
        while True:
            try:
                request_id, reason = self._aborts.get_nowait()
            except queue.Empty:
                break
            reasons.setdefault(request_id, reason)
        return reasons

    def _apply_aborts(self, reasons: Dict[str, str]) -> None:
        if self._closing.is_set():  # shutdown: every request left, running or still waiting, hears why
            for req in self.running + list(self.waiting):
                reasons.setdefault(req.id, "abort")
        if not reasons:
            return
        for req in [r for r in self.running if r.id in reasons] + [r for r in self.waiting if r.id in reasons]:
            self._finish(req, reasons[req.id])
        self.running = [r for r in self.running if r.id not in reasons]
        self.waiting = deque(r for r in self.waiting if r.id not in reasons)

    def step(self) -> bool:
        """One prefill or decode step; False when there was nothing to do."""
        aborts = self._take_aborts()  # before the inbox: a request's submit is always seen with its abort
        self._take_new(block=False)
        self._apply_aborts(aborts)
        self._update_gauges()
        batch = self._admit()
        if batch:
            t0 = time.perf_counter()
            try:
                logits = self.runner.prefill([r.slot for r in batch], [r.context for r in batch])
                self.running += self._advance(batch, logits)
            except Exception:  # the batch is in neither running nor waiting: fail it here, free its slots
                for req in batch:
                    if req.slot >= 0:
                        self._finish(req, "error")
                raise
            self._observe_step("prefill", len(batch), t0)
            return True
        if not self.running:
            return False
        while self.running and self.runner.kv.num_free_tokens < len(self.running):
            self._preempt(self.running.pop())
        if self.running:
            t0, size = time.perf_counter(), len(self.running)
            logits = self.runner.decode([r.slot for r in self.running], [r.output_ids[-1] for r in self.running])
            self.running = self._advance(self.running, logits)
            self._observe_step("decode", size, t0)
        return True

    def _observe_step(self, kind: str, size: int, t0: float) -> None:
        if self.metrics is not None:  # _advance synchronized on the sampled tokens: t0..now covers the GPU work
            self.metrics.step_seconds.labels(kind).observe(time.perf_counter() - t0)
            self.metrics.step_batch.labels(kind).observe(size)

    def _admit(self) -> List[ServerRequest]:
        batch, budget = [], self.args.batch_max_tokens
        kv = self.runner.kv
        free = kv.num_free_tokens - len(self.running)  # keep one token per running request for its next step
        while self.waiting and len(self.running) + len(batch) < self.args.running_max_req_size:
            need = len(self.waiting[0].context)
            if (batch and need > budget) or need + 1 > free or kv.num_free_slots == 0:
                break
            req = self.waiting.popleft()
            req.slot = self.runner.add_request()
            budget -= need
            free -= need + 1
            batch.append(req)
        return batch

    def _preempt(self, req: ServerRequest) -> None:
        logger.info("KV cache full: preempting request %s (%d tokens), it will be re-prefilled", req.id,
                    len(req.context))  # fmt: skip
        self.runner.free(req.slot)
        req.slot = -1
        self.waiting.appendleft(req)

    def _advance(self, reqs: List[ServerRequest], logits: torch.Tensor) -> List[ServerRequest]:
        now = time.perf_counter()
        alive = []
        for req, drawn in zip(reqs, self._sample(reqs, logits)):
            if drawn is None:
                self._finish(req, "error")
                continue
            tok, lp = drawn
            if self.metrics is not None:
                if req.last_token_time is None:
                    self.metrics.ttft.observe(now - req.arrival)
                else:
                    self.metrics.itl.observe(now - req.last_token_time)
                self.metrics.generated_tokens.inc()
            req.last_token_time = now
            req.output_ids.append(tok)
            req.emit(Event("token", tok, lp))
            p = req.params
            if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(req, "stop")
            elif len(req.output_ids) >= p.max_new_tokens or len(req.context) >= self.args.max_req_total_len:
                self._finish(req, "length")
            else:
                alive.append(req)
        return alive

    def _sample(self, reqs: List[ServerRequest], logits: torch.Tensor) -> List[Optional[Tuple[int, float]]]:
        """(token, logprob) per request, None for one whose own draw fails. The batch is drawn at once; if that
        raises, each request is drawn alone, so only the requests that cause the failure lose their draw (a
        seeded neighbour may then continue from a generator the failed batch draw already advanced)."""
        try:
            tokens, logprobs = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
            return list(zip(tokens.tolist(), logprobs.tolist()))
        except Exception:
            logger.exception("sampling a batch of %d requests failed; sampling them one by one", len(reqs))
        drawn = []
        for i, req in enumerate(reqs):
            try:
                tokens, logprobs = sample(logits[i : i + 1], [req.params], [req.generator])
                drawn.append((tokens.item(), logprobs.item()))
            except Exception:
                logger.exception("sampling request %s failed; it ends with finish_reason error", req.id)
                drawn.append(None)
        return drawn

    def _finish(self, req: ServerRequest, reason: str) -> None:
        if req.slot >= 0:
            try:
                self.runner.free(req.slot)
            except (ValueError, KVCacheFull):
                logger.exception("freeing request %s", req.id)
            req.slot = -1
        # lightllm_requests_finished_total is counted by the HTTP side: it knows the reason the client sees
        req.emit(Event("finish", finish_reason=reason))

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        kv = self.runner.kv
        self.metrics.queue_length.set(len(self.waiting))
        self.metrics.running.set(len(self.running))
        self.metrics.kv_usage.set(1 - kv.num_free_tokens / kv.num_tokens)
