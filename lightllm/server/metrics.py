"""The server's Prometheus metrics, every definition in this one place.

``Metrics`` is the engine's ``StepObserver``. With the engine in its own process (``engine_proc``) the engine calls
a recorder there, and each step's calls are replayed here, on the HTTP process that serves ``/metrics``: a new
observer method only needs to be defined on this class.
"""

import bisect
import threading
import time
from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from lightllm.common.gc_heap import GcPauses

# 1 ms to 60 s: a decode step of a small model at batch 1 up to a long prompt's prefill behind a full queue
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# and on to 10 minutes: a whole request, a long generation included
E2E_BUCKETS = LATENCY_BUCKETS + (120, 300, 600)

# 50 us to 100 ms: a hop between processes, from a free core's wake-up to a starved one's time slices
HOP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)

# 0.5 ms to 2 s, doubling: engine steps (and their GPU share)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048)


def cumulative(bounds: Sequence[float], counts: Sequence[int]) -> list:
    """Prometheus' buckets, ``[(le, count at or below it)]`` with +Inf last, from per-bucket ``counts`` (one more
    than ``bounds``: the last is above every bound)."""
    out, acc = [], 0
    for bound, count in zip(list(bounds) + [float("inf")], counts):
        acc += count
        out.append((floatToGoString(bound), acc))
    return out


class StepHistogram:
    """A label-less histogram fed a step's values at once (``observe_many``): one lock and one bucket search per
    value, where ``prometheus_client.Histogram.observe`` takes a lock per bucket and the sum (per-token latencies,
    64 a step at batch 64, on the event loop that streams the tokens). Exposed as that Histogram would be."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self._bounds = [float(b) for b in buckets]
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()  # with the engine on a thread of this process, it observes from that thread
        registry.register(self)

    def observe(self, amount: float) -> None:
        self.observe_many((amount,))

    def observe_many(self, amounts: Sequence[float]) -> None:
        if not amounts:
            return
        bounds, counts = self._bounds, self._counts
        with self._lock:
            for amount in amounts:
                counts[bisect.bisect_left(bounds, amount)] += 1  # the first bound >= amount: Prometheus' "le"
            self._sum += sum(amounts)

    def describe(self) -> Iterable[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterable[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self.name, self.documentation, buckets=cumulative(self._bounds, counts),
                                       sum_value=total)  # fmt: skip
        family.samples.append(Sample(self.name + "_created", {}, self._created))
        return [family]


class GcPauseHistogram:
    """``lightllm_gc_pause_seconds{process, generation}``: the garbage collector's passes in this (HTTP) process,
    from ``own``, and in the engine process, from the cumulative counts its step messages carry (``engine``)."""

    name = "lightllm_gc_pause_seconds"
    documentation = "garbage collector passes (the process stops while one runs), per process and generation"

    def __init__(self, own: GcPauses, registry: CollectorRegistry):
        self.own = own
        self.engine = None  # (counts, sums) as the engine process last sent them; None with the engine on a thread
        registry.register(self)

    def describe(self) -> Iterable[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=["process", "generation"])]

    def collect(self) -> Iterable[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=["process", "generation"])
        for process, snapshot in (("http", self.own.snapshot()), ("engine", self.engine)):
            if snapshot is None:
                continue
            for generation, (counts, total) in enumerate(zip(*snapshot)):
                family.add_metric([process, str(generation)], cumulative(self.own.bounds, counts), total)
        return [family]


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge("lightllm_queue_length", "requests waiting for admission", registry=r)
        self.running = Gauge("lightllm_running_batch", "requests decoding", registry=r)
        self.kv_usage = Gauge("lightllm_kv_usage_ratio", "fraction of KV cache tokens in use", registry=r)
        self.generated_tokens = Counter("lightllm_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("lightllm_requests_finished", "finished requests", ["finish_reason"], registry=r)
        # observed with each lightllm_requests_finished count: from the submission by the HTTP process to the end
        self.e2e = Histogram("lightllm_e2e_request_latency_seconds", "request submission to its end (finish or "
                             "abort)", registry=r, buckets=E2E_BUCKETS)  # fmt: skip
        self.cached_tokens = Counter("lightllm_prompt_cached_tokens", "prompt tokens read from the prefix cache "
                                     "instead of computed", registry=r)  # fmt: skip
        # beside it, the prefix cache's hit rate: both counted at a request's first token
        self.prompt_tokens = Counter("lightllm_prompt_tokens", "prompt tokens of requests that got a first token",
                                     registry=r)  # fmt: skip
        # MTP speculative decoding: draft tokens proposed, and those accepted (emitted as output tokens)
        self.spec_drafts = Counter("lightllm_spec_decode_num_draft_tokens", "MTP draft tokens proposed", registry=r)
        self.spec_accepted = Counter("lightllm_spec_decode_num_accepted_tokens", "MTP draft tokens accepted",
                                     registry=r)  # fmt: skip
        # Observed as each token leaves the engine (sampled): the first from the request's submission by the HTTP
        # process (its prompt rendered and tokenized: that time is not counted), the others from its previous token.
        self.ttft = StepHistogram("lightllm_time_to_first_token_seconds", "request submission to its first token",
                                  LATENCY_BUCKETS, r)  # fmt: skip
        self.itl = StepHistogram("lightllm_inter_token_latency_seconds", "time between a request's tokens",
                                 LATENCY_BUCKETS, r)  # fmt: skip
        # The hop a token takes from the engine process to the HTTP process (engine_proc): the pipe, the reader
        # thread and the event loop's turn. Time to first token ends before it; a client sees both.
        self.engine_message = Histogram("lightllm_engine_message_delay_seconds", "an engine step's message, from "
                                        "its send by the engine process to its handling on the HTTP event loop",
                                        registry=r, buckets=HOP_BUCKETS)  # fmt: skip
        # Per engine step (kind = prefill, decode or mixed): what a throughput number is made of. A decode step's
        # time is the forward, sampling and bookkeeping of one token for every running request.
        self.step_seconds = Histogram("lightllm_step_seconds", "engine step time", ["kind"], registry=r,
                                      buckets=STEP_BUCKETS)  # fmt: skip
        # CUDA only, every 8th step (those that sample tokens; MTP decode steps of plain requests only): the
        # GPU timeline from the forward's launch to the last launch before the tokens are read
        # (engine/gpu_timer.py); the rest of lightllm_step_seconds is the host's.
        self.step_gpu_seconds = Histogram("lightllm_step_gpu_seconds", "GPU time of an engine step (forward and "
                                          "sampling)", ["kind"], registry=r, buckets=STEP_BUCKETS)  # fmt: skip
        self.step_batch = Histogram("lightllm_step_batch_size", "requests per engine step", ["kind"], registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))  # fmt: skip
        # Every HTTP response by its route's path (as declared, e.g. /v1/models/{model_id:path}; "other" for paths no
        # route serves) and status code: refused requests (4xx) and failed ones (5xx) beside the served
        self.http_responses = Counter("lightllm_http_responses", "HTTP responses by route and status code",
                                      ["route", "status"], registry=r)  # fmt: skip
        # This (HTTP) process's CPU time, memory and open files (process_*, read from /proc on Linux): over a load,
        # how close the process that streams every token is to a full core
        ProcessCollector(registry=r)
        # The collector's passes; the server installs ``gc_pauses`` in this process while it serves
        self.gc_pauses = GcPauses()
        self.gc_pause = GcPauseHistogram(self.gc_pauses, r)

    def watch_engine_process(self, pid: int) -> None:
        """Also export the engine process's (``pid``: rank 0 with tensor parallelism) as lightllm_engine_process_*."""
        ProcessCollector(namespace="lightllm_engine", pid=lambda: pid, registry=self.registry)

    # the engine's StepObserver
    def on_queues(self, waiting: int, running: int, kv_usage: float) -> None:
        self.queue_length.set(waiting)
        self.running.set(running)
        self.kv_usage.set(kv_usage)

    def on_token(self, first: bool, seconds: float) -> None:
        (self.ttft if first else self.itl).observe(seconds)
        self.generated_tokens.inc()

    def on_tokens(self, first: Sequence[float], later: Sequence[float]) -> None:
        """A step's tokens at once: ``first`` the first tokens' seconds since arrival, ``later`` the others' since
        their request's previous token."""
        self.ttft.observe_many(first)
        self.itl.observe_many(later)
        self.generated_tokens.inc(len(first) + len(later))

    def on_engine_message(self, sent: float) -> None:
        """A step's message from the engine process, handled now; ``sent`` is its ``time.perf_counter()`` at the
        send (CLOCK_MONOTONIC on Linux: one clock for every process of the host)."""
        self.engine_message.observe(max(0.0, time.perf_counter() - sent))

    def on_step(self, kind: str, batch_size: int, seconds: float) -> None:
        self.step_seconds.labels(kind).observe(seconds)
        self.step_batch.labels(kind).observe(batch_size)

    def on_step_gpu(self, kind: str, seconds: float) -> None:
        self.step_gpu_seconds.labels(kind).observe(seconds)

    def on_gc_pauses(self, counts: Sequence[Sequence[int]], sums: Sequence[float]) -> None:
        """The engine process's collector passes so far (``GcPauses.snapshot``), sent when they changed."""
        self.gc_pause.engine = ([list(c) for c in counts], list(sums))

    def on_spec(self, drafts: int, accepted: int) -> None:
        self.spec_drafts.inc(drafts)
        self.spec_accepted.inc(accepted)


class ResponseCounter:
    """ASGI middleware: counts each HTTP response in ``counter`` (labels ``route`` and ``status``) when it starts,
    so a stream counts once, by the status its client got. A response's route is the declared path the router
    matched, else its own path if one of the app's routes declares it (a 413 refused before routing), else "other"
    (a 404): the label set stays bounded whatever paths clients send. An exception that leaves the app before any
    response started counts as the 500 that Starlette's outermost error middleware then sends."""

    def __init__(self, app, counter: Counter):
        self.app = app
        self.counter = counter
        self.routes = None  # the app's declared paths, read at the first response (every route is declared by then)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        started = False

        def count(status: int) -> None:
            if self.routes is None:
                self.routes = frozenset(route.path for route in scope["app"].routes)  # Starlette sets scope["app"]
            route = getattr(scope.get("route"), "path", None) or scope["path"]
            self.counter.labels(route if route in self.routes else "other", str(status)).inc()

        async def counted(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:
                count(500)
            raise
