"""The load generator of ``serve_load.py`` and ``host_overhead.py``: a fixed request schedule sent to a running
server, at most ``concurrency`` requests in flight, with what the client saw (tokens/s, time to first token,
inter-token latency) and what the server did (its step histograms from /metrics).

A client that cannot keep up measures itself: a stream it reads late shows its tokens late (inter-token latency
shrinks to the gaps between reads of a backlog) and its next request goes out late (the engine's batch falls below
the concurrency). One Python process can fall behind a 64-stream load of a fast model, so ``client_procs`` splits the
schedule over that many processes (request i goes to process i mod ``client_procs``, each with its share of the
concurrency) and every load reports the busiest client process's CPU share (``client_cpu_pct``) and the engine's busy
share of the wall time (``engine_busy_pct``); a client near 100 % flags a measurement of the client. The server's
HTTP and engine processes' CPU shares (``http_cpu_pct``, ``engine_cpu_pct``) say the same of the server's host side.
"""

import asyncio
import contextlib
import gc
import json
import math
import multiprocessing
import random
import time

import httpx

from lightllm.common import proc as procs

SPEC_COUNTERS = {"lightllm_spec_decode_num_draft_tokens": "draft_tokens",
                 "lightllm_spec_decode_num_accepted_tokens": "accepted_tokens"}  # fmt: skip
TTFT_FAMILY = "lightllm_time_to_first_token_seconds"
MESSAGE_FAMILY = "lightllm_engine_message_delay_seconds"  # the engine process -> HTTP process hop of each step
GC_FAMILY = "lightllm_gc_pause_seconds"  # the garbage collector's passes in the server's processes
GC_LONG_S = "0.01"  # a pass longer than this bound (10 ms) is a stall a client can see
# the server's processes' CPU time (prometheus_client's process collectors): their busy share of a core over a load
CPU_COUNTERS = {"process_cpu_seconds": "http_cpu_pct", "lightllm_engine_process_cpu_seconds": "engine_cpu_pct"}
_START_MARGIN_S = 0.2  # client processes are told to start this far ahead, so they start together
_START_TIMEOUT_S = 120.0  # for every client process to import this module (a busy CI machine included)
_POLL_S = 0.05  # how often a split load looks whether its client processes are done


def request_schedule(seed: int, n: int, prompt_len: int, vocab: int, rate: float = 0.0):
    """A fixed schedule, the same for every server and run given the seed: ``n`` arrival offsets in seconds
    (Poisson at ``rate`` requests/s; ``rate`` 0: all at once, the concurrency limit alone paces them) and prompts."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab // 8, vocab) for _ in range(prompt_len)] for _ in range(n)]
    arrivals, t = [], 0.0
    for _ in range(n):
        arrivals.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return arrivals, prompts


def percentile(values, q):
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def auto_client_procs(concurrency: int) -> int:
    """Client processes for a load: one per 4 streams, at most 8. On the H200 (4-layer 8B-shaped model) one process
    reading 16 streams was 86-99 % busy at concurrency 16 and 32 at about 800 decode steps/s
    (serve_load_aa_short_conc3_h200.json), and one reading 8 streams 85-88 % busy at the overlapped engine's 1100
    (serve_load_aa_overlap_short_h200.json)."""
    return max(1, min(8, math.ceil(concurrency / 4)))


async def sse_events(response):
    """(arrival time, event) for each server-sent ``data:`` event of ``response``, parsed from the raw bytes: the
    events of one network read share its arrival time, which is when this client could have shown them."""
    buf = b""
    async for data in response.aiter_bytes():
        now = time.perf_counter()
        buf += data
        *events, buf = buf.split(b"\n\n")
        for event in events:
            if event.startswith(b"data:") and event[5:].strip() != b"[DONE]":
                yield now, json.loads(event[5:])


def token_gaps(arrivals):
    """Inter-token gaps from the tokens' arrival times. The tokens of one network read share the interval since the
    read before: each gets an equal part of it (as SGLang's bench_serving does), so a stream read in bursts (a client
    behind a backlog, or several steps' tokens in one server write) reports its mean gap over the burst, not zeros.
    The first read's further tokens have no interval before them: no gap."""
    reads = []  # [arrival time, tokens]
    for t in arrivals:
        if reads and reads[-1][0] == t:
            reads[-1][1] += 1
        else:
            reads.append([t, 1])
    return [(b - a) / n for (a, _), (b, n) in zip(reads, reads[1:]) for _ in range(n)]


async def _one(client, base, prompt, out_len, stream, api="native"):
    """One request: (tokens, all logprobs finite, seconds to its first token, the gaps between its tokens, seconds to
    its response headers: a stream's handler submits it to the engine just before it sends them). ``api``: "native"
    (/generate_stream or /generate, with logprobs) or "completions" (OpenAI's /v1/completions with the prompt's token
    ids, as OpenAI clients stream; no logprobs: the check is then vacuous)."""
    if api == "completions":
        body = {"prompt": prompt, "max_tokens": out_len, "ignore_eos": True, "stream": stream}
        route = "/v1/completions"
    else:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": out_len, "ignore_eos": True, "logprobs": True}}
        route = "/generate_stream" if stream else "/generate"
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(base + route, json=body)
        r.raise_for_status()
        data = r.json()
        if api == "completions":
            return data["usage"]["completion_tokens"], True, None, [], None
        return len(data["token_ids"]), all(math.isfinite(x) for x in data["logprobs"]), None, [], None
    times, finite = [], True
    async with client.stream("POST", base + route, json=body) as r:
        headers = time.perf_counter() - t0
        r.raise_for_status()
        async for now, event in sse_events(r):
            if api == "completions":  # a token's chunk has no finish reason; the last one (no token) has
                if event["choices"] and event["choices"][0]["finish_reason"] is None:
                    times.append(now)
                continue
            token = event["token"]
            if token["id"] is not None:
                times.append(now)
                finite = finite and math.isfinite(token["logprob"])
    return len(times), finite, (times[0] - t0 if times else None), token_gaps(times), headers


async def open_connections(client, base, n):
    """``n`` concurrent ``/health`` requests before the clock starts: the HTTP stack's first request in a process
    imports its lazily loaded modules (its async backend), and each new connection adds its set-up, both counted as
    time to first token of whichever request came first. A client in service keeps its connections open; so does
    this one (``n`` is the pool's keep-alive size)."""
    responses = await asyncio.gather(*(client.get(base + "/health") for _ in range(n)))
    for r in responses:
        r.raise_for_status()


@contextlib.contextmanager
def collector_paused():
    """No garbage collector pass while a load is measured: a full one stops this client for milliseconds (more as
    its results grow), and the tokens it would have read meanwhile count as the server's latency. What the load
    leaves in reference cycles waits for the pass after it (a load is bounded: a few thousand requests)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


async def _shard(base, arrivals, prompts, concurrency, out_len, stream, api, start_at):
    """This process's share of a load: its requests at their offsets from the wall-clock time ``start_at`` (or from
    when its connections are open, if later). Returns the per-request results, its CPU seconds and when (wall clock)
    its clock started and its last request ended."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=procs.HANG_TIMEOUT_S, limits=limits) as client:
        await open_connections(client, base, concurrency)
        with collector_paused():  # its first pass runs before the clock starts
            await asyncio.sleep(max(0.0, start_at - time.time()))
            t0, cpu0, started = time.perf_counter(), time.process_time(), time.time()

            async def scheduled(at, prompt):
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                async with sem:
                    return await _one(client, base, prompt, out_len, stream, api)

            results = await asyncio.gather(*(scheduled(at, p) for at, p in zip(arrivals, prompts)))
            cpu, seconds = time.process_time() - cpu0, time.perf_counter() - t0
    return {"results": results, "cpu_s": cpu, "busy_s": seconds, "start": started, "end": time.time()}


def _shard_main(args):
    return asyncio.run(_shard(*args))


def _ready(barrier, base):
    """A client process's initializer: it has imported this module (and httpx) and made one request (what the HTTP
    stack imports at its first, see :func:`open_connections`) once every process passes."""

    async def first_request():
        async with httpx.AsyncClient(timeout=procs.HANG_TIMEOUT_S) as client:
            await open_connections(client, base, 1)

    # a server that does not answer: the shard's own open_connections raises it through pool.map (raised here, the
    # pool would replace this process again and again, each one failing, while the load waits out the barrier)
    with contextlib.suppress(Exception):
        asyncio.run(first_request())
    barrier.wait(_START_TIMEOUT_S)


def deal(arrivals, prompts, concurrency: int, parts: int):
    """The schedule split over ``parts`` client processes: request i to process i mod ``parts`` (each keeps its
    arrival offsets, in order), the concurrency shared as evenly as it divides. (arrivals, prompts, concurrency)
    per process."""
    shares = [concurrency // parts + (i < concurrency % parts) for i in range(parts)]
    return [(arrivals[i::parts], prompts[i::parts], share) for i, share in enumerate(shares)]


async def load(
    base, n, concurrency, prompt_len, out_len, vocab, seed=0, rate=0.0, stream=False, client_procs=1, api="native"
):
    """``n`` requests of ``request_schedule(seed, ...)`` to /generate_stream (``stream``) or /generate (``api``
    "completions": OpenAI's /v1/completions, see ``_one``), at most ``concurrency`` at a time, from ``client_procs``
    processes: output tokens/s, time to first token and inter-token latency as the client sees them (streaming only),
    the client's and the engine's busy shares, and the server's step statistics over the run."""
    arrivals, prompts = request_schedule(seed, n, prompt_len, vocab, rate)
    client_procs = max(1, min(client_procs, concurrency, n))
    before = await engine_steps(base)
    if client_procs == 1:
        start = time.time()
        shards = [await _shard(base, arrivals, prompts, concurrency, out_len, stream, api, start)]
    else:
        work = [(base, *shard, out_len, stream, api) for shard in deal(arrivals, prompts, concurrency, client_procs)]
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds an event loop
        barrier = ctx.Barrier(client_procs + 1)
        with ctx.Pool(client_procs, initializer=_ready, initargs=(barrier, base)) as pool:
            # all up before the clock starts; a process that cannot start breaks the barrier instead of hanging
            try:
                await asyncio.get_running_loop().run_in_executor(None, barrier.wait, _START_TIMEOUT_S)
            except BaseException:  # cancelled (SIGTERM): free the waiting thread, or asyncio.run waits for it
                barrier.abort()
                raise
            start = time.time() + _START_MARGIN_S
            # polled, not pool.map on a thread: leaving the pool terminates it, and a map waiting on a terminated
            # pool never returns, so asyncio.run's wait for that thread would hang a stopped benchmark for good
            result = pool.map_async(_shard_main, [(*w, start) for w in work], chunksize=1)
            while not result.ready():
                await asyncio.sleep(_POLL_S)
            shards = result.get()
    # from the first clock's start: the connections opened before it are not part of the load
    seconds = max(s["end"] for s in shards) - min(s["start"] for s in shards)
    after = await engine_steps(base)
    steps = step_stats(before, after)
    results = [r for s in shards for r in s["results"]]
    tokens = sum(r[0] for r in results)
    ok = all(count == out_len and finite for count, finite, *_ in results)
    ttft = [r[2] for r in results if r[2] is not None]
    itl = [g for r in results for g in r[3]]
    headers = [r[4] for r in results if r[4] is not None]
    latency = {f"{name}_p{q}_ms": (None if percentile(xs, q) is None else percentile(xs, q) * 1e3)
               for name, xs in (("ttft", ttft), ("itl", itl)) for q in (50, 99)}  # fmt: skip
    latency["ttft_mean_ms"] = sum(ttft) / len(ttft) * 1e3 if ttft else None  # beside the server's server_ttft_mean_ms
    latency["headers_mean_ms"] = sum(headers) / len(headers) * 1e3 if headers else None  # up to the submission
    # every measured request's: pooled over a point's rounds, their percentiles resolve more than a median of each
    # round's (serve_load.py's pooled A/A)
    latency["ttft_samples_ms"] = [round(r[2] * 1e3, 4) for r in results if r[2] is not None]
    busy = sum((steps[f"{k}_step_ms"] or 0.0) * steps[f"{k}_steps"] for k in ("prefill", "decode")) / 1e3
    return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "all_complete_finite": ok,
            **latency, "client_procs": client_procs,
            "client_cpu_pct": max(s["cpu_s"] / s["busy_s"] for s in shards) * 100,
            "engine_busy_pct": busy / seconds * 100, **cpu_shares(before, after, seconds), **steps}  # fmt: skip


async def engine_steps(base):
    """The server's cumulative step histograms, ``{(sample, kind): value}`` for their _count and _sum; MTP's draft
    counters and the processes' CPU seconds, ``{(family, None): value}``; the garbage collector's passes,
    ``{(sample, process): value}`` over every generation (``_short``: those within ``GC_LONG_S``). A client of its
    own: a connection left idle through a load outlives the server's keep-alive, and reusing it as the server closes
    it fails the read."""
    async with httpx.AsyncClient(timeout=procs.HANG_TIMEOUT_S) as client:
        return server_counters((await client.get(base + "/metrics")).text)


def server_counters(text):
    """What ``engine_steps`` keeps of a /metrics exposition ``text``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("lightllm_step_seconds", "lightllm_step_gpu_seconds", "lightllm_step_batch_size"):
            out.update({(s.name, s.labels["kind"]): s.value for s in family.samples
                        if s.name.endswith(("_count", "_sum"))})  # fmt: skip
        elif family.name in (TTFT_FAMILY, MESSAGE_FAMILY):
            out.update({(s.name, None): s.value for s in family.samples if s.name.endswith(("_count", "_sum"))})
        elif family.name == GC_FAMILY:  # per process, the generations together
            for s in family.samples:
                kind = s.name[len(GC_FAMILY) :] if s.name.endswith(("_count", "_sum")) else None
                if s.name.endswith("_bucket") and s.labels["le"] == GC_LONG_S:
                    kind = "_short"
                if kind is not None:
                    key = (GC_FAMILY + kind, s.labels["process"])
                    out[key] = out.get(key, 0.0) + s.value
        elif family.name in SPEC_COUNTERS or family.name in CPU_COUNTERS:
            out.update({(family.name, None): s.value for s in family.samples if s.name.endswith("_total")})
    return out


def cpu_shares(before, after, seconds):
    """Each server process's CPU time over a load of ``seconds``, in percent of one core (None where the server
    exports no such counter: not Linux, or the engine on a thread of the HTTP process). Counted from /proc in clock
    ticks (10 ms), so a few-second load reads it to about a percent."""
    out = {}
    for family, name in CPU_COUNTERS.items():
        key = (family, None)
        out[name] = (after[key] - before.get(key, 0.0)) / seconds * 100 if key in after and seconds > 0 else None
    return out


def step_stats(before, after):
    """What one load was made of: steps per kind, their mean time (ms), the GPU's part of it (ms, from the steps the
    server timed on the GPU; None on a CPU) and mean batch (requests); MTP's drafts proposed and accepted and their
    ratio, the acceptance (None without drafts)."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out = {}
    for kind in ("prefill", "decode"):
        n = delta.get(("lightllm_step_seconds_count", kind), 0.0)
        out[f"{kind}_steps"] = int(n)
        out[f"{kind}_step_ms"] = delta[("lightllm_step_seconds_sum", kind)] / n * 1e3 if n else None
        timed = delta.get(("lightllm_step_gpu_seconds_count", kind), 0.0)
        out[f"{kind}_gpu_ms"] = delta[("lightllm_step_gpu_seconds_sum", kind)] / timed * 1e3 if timed else None
        out[f"{kind}_batch"] = delta[("lightllm_step_batch_size_sum", kind)] / n if n else None
    for family, name in SPEC_COUNTERS.items():
        out[name] = int(delta.get((family, None), 0.0))
    # the server's own mean time to first token (from submission; the HTTP hop, rendering and the client are not in
    # it): the client's mean minus this is their share
    first = delta.get((TTFT_FAMILY + "_count", None), 0.0)
    out["server_ttft_mean_ms"] = delta[(TTFT_FAMILY + "_sum", None)] / first * 1e3 if first else None
    # and the hop each step's tokens take to the HTTP process after the engine has them (not in the server's TTFT)
    sent = delta.get((MESSAGE_FAMILY + "_count", None), 0.0)
    out["engine_message_mean_ms"] = delta[(MESSAGE_FAMILY + "_sum", None)] / sent * 1e3 if sent else None
    out["acceptance"] = out["accepted_tokens"] / out["draft_tokens"] if out["draft_tokens"] else None
    # the garbage collector's passes in each server process over the load: their time, and how many took > 10 ms
    # (None for a process the server does not report: the engine on a thread of the HTTP process)
    for process in ("http", "engine"):
        count = (GC_FAMILY + "_count", process)
        known = count in after
        out[f"{process}_gc_ms"] = delta[(GC_FAMILY + "_sum", process)] * 1e3 if known else None
        out[f"{process}_gc_long"] = int(delta[count] - delta[(GC_FAMILY + "_short", process)]) if known else None
    return out
