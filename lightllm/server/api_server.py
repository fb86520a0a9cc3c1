"""HTTP server: ``python -m lightllm.server.api_server [flags]``.

Native ``/generate`` and ``/generate_stream``, OpenAI-compatible ``/v1/completions`` and
``/v1/chat/completions`` (server-sent events ending in ``data: [DONE]`` when streaming), ``/v1/models`` and
``/v1/models/{id}``, ``/health`` and ``/metrics``. Bad requests get a 400 (413 for a body over the size limit,
404 for another model) with a message; the server keeps serving.
"""

import asyncio
import contextlib
import functools
import json
import logging
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Dict, List, Optional, Sequence, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lightllm.engine.detokenize import TextStream, check_stop_strings
from lightllm.engine.engine import Engine, eos_token_ids
from lightllm.engine.model_runner import ModelRunner
from lightllm.engine.request import Event
from lightllm.engine.request import Request as EngineRequest
from lightllm.engine.runner import Runner
from lightllm.engine.sampler import SamplingParams
from lightllm.server.args import ServerArgs, parse_args
from lightllm.server.bodies import ChatRequest, CompletionRequest, GenerateRequest
from lightllm.server.engine_loop import EngineLoop
from lightllm.server.generation_defaults import read_sampling_defaults
from lightllm.server.http_guards import BadRequest, BodyLimit, ModelNotFound, install_error_handlers
from lightllm.server.prompts import PromptEncoder, load_tokenizer
from lightllm.server.serving import bind, serve

logger = logging.getLogger(__name__)
_DISCONNECT_CHECK_S = 0.25  # how often a request checks that its client is still there
TINY_NAME = "lightllm-tiny-qwen3"  # the model id of the built-in tiny model


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge("lightllm_queue_length", "requests waiting for admission", registry=r)
        self.running = Gauge("lightllm_running_batch", "requests decoding", registry=r)
        self.kv_usage = Gauge("lightllm_kv_usage_ratio", "fraction of KV cache tokens in use", registry=r)
        self.generated_tokens = Counter("lightllm_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("lightllm_requests_finished", "finished requests", ["finish_reason"], registry=r)
        self.ttft = Histogram("lightllm_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))  # fmt: skip
        self.itl = Histogram("lightllm_inter_token_latency_seconds", "time between tokens", registry=r,
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))  # fmt: skip
        # Per engine step (kind = prefill or decode): what a throughput number is made of. A decode step's
        # time is the forward, sampling and bookkeeping of one token for every running request.
        self.step_seconds = Histogram("lightllm_step_seconds", "engine step time", ["kind"], registry=r,
                                      buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128,
                                               0.256, 0.512, 1.024, 2.048))  # fmt: skip
        self.step_batch = Histogram("lightllm_step_batch_size", "requests per engine step", ["kind"], registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))  # fmt: skip

    # the engine's StepObserver
    def on_queues(self, waiting: int, running: int, kv_usage: float) -> None:
        self.queue_length.set(waiting)
        self.running.set(running)
        self.kv_usage.set(kv_usage)

    def on_token(self, first: bool, seconds: float) -> None:
        (self.ttft if first else self.itl).observe(seconds)
        self.generated_tokens.inc()

    def on_step(self, kind: str, batch_size: int, seconds: float) -> None:
        self.step_seconds.labels(kind).observe(seconds)
        self.step_batch.labels(kind).observe(batch_size)


# ---- the app -----------------------------------------------------------------------------------------------


class Server:
    def __init__(
        self,
        runner: Runner,
        tokenizer,
        model_name: str,
        on_shutdown=None,
        health_step_timeout_s: float = ServerArgs.health_step_timeout_s,
        max_request_body_bytes: int = ServerArgs.max_request_body_bytes,
        sampling_defaults: Optional[Dict[str, Union[int, float]]] = None,
        extra_eos_ids: Sequence[int] = (),
    ):
        """``sampling_defaults``: what the OpenAI routes use for a sampling field a request leaves out
        (``read_sampling_defaults``); ``extra_eos_ids``: ``--eos_id``."""
        self.runner = runner
        self.on_shutdown = on_shutdown  # after the engine loop stops: tensor-parallel workers
        self.health_step_timeout_s = health_step_timeout_s
        self.tokenizer = tokenizer
        self.prompts = PromptEncoder(tokenizer, runner.args.max_req_total_len)
        self.max_request_body_bytes = max_request_body_bytes
        self.model_name = model_name
        self.created = int(time.time())  # the /v1/models entry's "created": when this server started
        self.sampling_defaults = dict(sampling_defaults or {})
        self.metrics = Metrics()
        self.mailbox = _Mailbox()
        self.engine = Engine(runner, eos_token_ids(runner.config, tokenizer, extra_eos_ids), observer=self.metrics)
        self.loop = EngineLoop(self.engine, after_step=self.mailbox.flush)
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self.mailbox.bind(asyncio.get_running_loop())
            self.loop.start()
            yield
            # Here, not after uvicorn.run returns: uvicorn re-raises SIGTERM/SIGINT once it has shut down,
            # which ends the process before any code after run() executes.
            if not self.loop.stop():
                logger.warning("engine loop still inside a step after 60s; exiting without a clean shutdown")
            elif self.on_shutdown is not None:
                self.on_shutdown()

        app = FastAPI(title="lightllm", lifespan=lifespan)
        app.add_middleware(BodyLimit, limit=self.max_request_body_bytes)
        install_error_handlers(app)

        @app.get("/health")
        async def health():
            problem = self._liveness_problem()
            return JSONResponse({"status": problem or "ok"}, status_code=503 if problem else 200)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            self._check_model(model_id)
            return self._model_card()

        @app.post("/generate")
        async def generate(body: GenerateRequest, request: Request):
            p = body.parameters
            ids, params = await self._prepare("inputs", body.inputs, p.max_new_tokens, p, p.logprobs, p.ignore_eos)
            result = await self._collect(ids, params, request)
            out = {"generated_text": result["text"], "token_ids": result["token_ids"],
                   "finish_reason": result["finish_reason"], "prompt_tokens": len(ids)}  # fmt: skip
            if p.logprobs:
                out["logprobs"] = result["logprobs"]
            return out

        @app.post("/generate_stream")
        async def generate_stream(body: GenerateRequest, request: Request):
            p = body.parameters
            ids, params = await self._prepare("inputs", body.inputs, p.max_new_tokens, p, p.logprobs, p.ignore_eos)

            async def events():
                async for delta, tok, lp, reason in self._stream(ids, params, request):
                    chunk = {"token": {"id": tok, "text": delta, "logprob": lp}, "finish_reason": reason}
                    yield f"data: {json.dumps(chunk)}\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            self._check_model(body.model)
            ids, params = await self._prepare("prompt", body.prompt, body.max_tokens, body,
                                              body.logprobs is not None, False)  # fmt: skip
            return await self._openai(ids, params, request, body.stream, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatRequest, request: Request):
            self._check_model(body.model)
            messages = [m.model_dump() for m in body.messages]
            max_tokens = body.max_completion_tokens or body.max_tokens  # None: the rest of max_req_total_len
            ids, params = await self._prepare("messages", messages, max_tokens, body, body.logprobs, False)
            return await self._openai(ids, params, request, body.stream, chat=True)

        return app

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lightllm",
                "max_model_len": self.runner.args.max_req_total_len}  # fmt: skip

    def _check_model(self, name: Optional[str]) -> None:
        """A request may leave ``model`` out; naming another model is a 404, as OpenAI answers it."""
        if name is not None and name != self.model_name:
            raise ModelNotFound(f"model: {name!r} is not served here; this server serves {self.model_name!r} "
                                "(--model_name)")  # fmt: skip

    def _liveness_problem(self) -> Optional[str]:
        """Why the engine loop is not making progress (None while it is): a thread that ended, or one step
        running longer than ``health_step_timeout_s`` (a hung kernel, a stopped tensor-parallel rank)."""
        if not self.loop.thread.is_alive():
            return "engine loop stopped"
        busy = self.loop.step_in_flight_s()
        if busy is not None and busy > self.health_step_timeout_s:
            return f"engine step running for {busy:.1f}s, over --health_step_timeout_s {self.health_step_timeout_s:g}"
        return None

    # ---- request plumbing ----------------------------------------------------------------------------------

    async def _prepare(self, field: str, prompt, max_tokens: Optional[int], sampling, logprobs, ignore_eos):
        """Token ids and sampling parameters (stop strings included) of a request, or a 400. ``prompt``: text,
        token ids or chat messages (named ``field`` in errors); ``max_tokens`` None: the rest of max_req_total_len."""
        stops = [sampling.stop] if isinstance(sampling.stop, str) else list(sampling.stop or [])
        try:
            check_stop_strings(stops)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        if field == "messages":
            ids = await self.prompts.encode_chat(prompt)
        else:
            ids = await self.prompts.encode(prompt, field) if isinstance(prompt, str) else prompt
        if not ids:
            raise BadRequest(f"{field}: expected at least one token")
        limit = self.runner.args.max_req_total_len
        if len(ids) >= limit:
            raise BadRequest(f"{field}: {len(ids)} tokens, max_req_total_len is {limit}")
        vocab = self.runner.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise BadRequest(f"{field}: token ids expected in [0, {vocab})")
        if max_tokens is None:
            max_tokens = limit - len(ids)
        if max_tokens > limit - len(ids):
            raise BadRequest(
                f"max_tokens: {max_tokens} with a {len(ids)}-token prompt exceeds max_req_total_len {limit}"
            )
        # The OpenAI routes take the model's generation_config.json values for fields a request leaves out; the
        # native route keeps its own documented (greedy) defaults.
        defaults = {} if field == "inputs" else self.sampling_defaults
        chosen = {k: getattr(sampling, k) if k in sampling.model_fields_set else defaults.get(k, getattr(sampling, k))
                  for k in ("temperature", "top_p", "top_k")}  # fmt: skip
        try:  # the bodies already hold these to the engine's ranges; this keeps the two from drifting apart
            params = SamplingParams(max_new_tokens=max_tokens, **chosen, logprobs=logprobs, seed=sampling.seed,
                                    ignore_eos=ignore_eos, stop=stops)  # fmt: skip
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return ids, params

    async def _stream(self, ids, params, request: Request, text: bool = True) -> AsyncIterator[tuple]:
        """(text delta, token id, logprob, finish reason or None) per token; aborts on disconnect or stop string.
        ``text=False`` (a caller that decodes once at the end, with no stop strings) leaves every delta ''.
        Counts the request in lightllm_requests_finished_total once, with the reason the client is given
        ("abort" when it left first, whether it was running or still queued)."""
        events: "asyncio.Queue[Event]" = asyncio.Queue()
        req = EngineRequest(uuid.uuid4().hex, ids, params, functools.partial(self.mailbox.post, events))
        self.engine.submit(req)
        out = TextStream(self.tokenizer if text else None, params.stop)
        finished = False
        loop = asyncio.get_running_loop()
        next_check = loop.time() + _DISCONNECT_CHECK_S
        try:
            while True:
                try:  # a step's events arrive together: take the queued ones without a timer each
                    ev = events.get_nowait() if not events.empty() else await asyncio.wait_for(events.get(), 1.0)
                except asyncio.TimeoutError:
                    ev = None
                if loop.time() >= next_check:  # also while tokens flow: a gone client must not keep decoding
                    next_check = loop.time() + _DISCONNECT_CHECK_S
                    if await request.is_disconnected():
                        return
                if ev is None:
                    continue
                if ev.kind == "finish":
                    finished = True
                    rest, reason = out.finish(ev.finish_reason)
                    self.metrics.finished.labels(reason).inc()
                    yield rest, None, None, reason
                    return
                delta, hit = out.add(ev.token_id)
                if hit:
                    self.engine.abort(req.id, reason="stop")
                    finished = True
                    self.metrics.finished.labels("stop").inc()
                    yield delta, ev.token_id, ev.logprob, None
                    yield "", None, None, "stop"
                    return
                yield delta, ev.token_id, ev.logprob, None
        finally:
            if not finished:  # client gone (or the handler was cancelled): free its KV now
                self.engine.abort(req.id)
                self.metrics.finished.labels("abort").inc()

    async def _collect(self, ids, params, request: Request) -> dict:
        text, token_ids, logprobs, reason = "", [], [], ""
        incremental = bool(params.stop)  # only stop strings need the text while generating
        async for delta, tok, lp, fin in self._stream(ids, params, request, text=incremental):
            text += delta
            if tok is not None:
                token_ids.append(tok)
                logprobs.append(lp)
            if fin:
                reason = fin
        if not incremental:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return {"text": text, "token_ids": token_ids, "logprobs": logprobs, "finish_reason": reason or "abort"}

    async def _openai(self, ids, params, request: Request, stream: bool, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if not stream:
            r = await self._collect(ids, params, request)
            choice = {"index": 0, "finish_reason": r["finish_reason"]}
            if chat:
                choice["message"] = {"role": "assistant", "content": r["text"]}
                if params.logprobs:
                    choice["logprobs"] = {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp}
                                                      for t, lp in zip(r["token_ids"], r["logprobs"])]}  # fmt: skip
            else:
                choice["text"] = r["text"]
                if params.logprobs:
                    choice["logprobs"] = {"tokens": [self.tokenizer.decode([t]) for t in r["token_ids"]],
                                          "token_logprobs": r["logprobs"]}  # fmt: skip
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(r["token_ids"]),
                     "total_tokens": len(ids) + len(r["token_ids"])}  # fmt: skip
            return {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice],
                    "usage": usage}  # fmt: skip

        async def events():
            n_out = 0
            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield _sse(rid, kind + ".chunk", created, self.model_name, first)
            async for delta, tok, lp, fin in self._stream(ids, params, request):
                if tok is not None:
                    n_out += 1
                if fin:
                    tail = {"delta": {"content": delta} if delta else {}} if chat else {"text": delta}
                    choice = {"index": 0, "finish_reason": fin, **tail}
                    usage = {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}
                    yield _sse(rid, kind + ".chunk" if chat else kind, created, self.model_name, choice, usage)
                    break
                choice = {
                    "index": 0,
                    "finish_reason": None,
                    **({"delta": {"content": delta}} if chat else {"text": delta}),
                }
                yield _sse(rid, kind + ".chunk" if chat else kind, created, self.model_name, choice)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _sse(rid, kind, created, model, choice, usage=None) -> str:
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


class _Mailbox:
    """Events from the engine thread to the HTTP event loop, handed over once per step: one wake-up of the
    loop (a pipe write and a GIL hand-off) per step, not one per running request."""

    def __init__(self):
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._items: List[tuple] = []
        self._lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def post(self, queue: "asyncio.Queue[Event]", event: Event) -> None:
        with self._lock:
            self._items.append((queue, event))

    def flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_deliver, items)


def _deliver(items) -> None:
    for queue, event in items:
        queue.put_nowait(event)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server_args, engine_args = parse_args(argv)
    try:  # before the model loads: a taken port is reported in a second, not after the warm-up
        sock = bind(server_args.host, server_args.port)
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    from lightllm.tools.make_tiny_model import default_model_dir

    model_dir = engine_args.model_dir or str(default_model_dir())
    try:  # still before the model loads: a bad file or tokenizer mode is one line, not a traceback later
        sampling_defaults = read_sampling_defaults(model_dir)
        tokenizer = load_tokenizer(model_dir, server_args.tokenizer_mode, server_args.chat_template)
    except ValueError as e:
        sock.close()
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    if server_args.tp > 1:
        from lightllm.server.tp import start_tp

        runner = start_tp(engine_args, server_args.tp, step_timeout_s=server_args.tp_step_timeout_s,
                          port=server_args.nccl_port)  # fmt: skip
    else:
        runner = ModelRunner(engine_args)
    stop = runner.stop if server_args.tp > 1 else None
    model_name = server_args.model_name or (
        Path(engine_args.model_dir).resolve().name if engine_args.model_dir else TINY_NAME
    )
    logger.info("serving model %r", model_name)
    server = Server(runner, tokenizer, model_name=model_name, on_shutdown=stop,
                    health_step_timeout_s=server_args.health_step_timeout_s,
                    max_request_body_bytes=server_args.max_request_body_bytes, sampling_defaults=sampling_defaults,
                    extra_eos_ids=server_args.eos_id)  # fmt: skip
    try:
        serve(server.app, sock, read_timeout_s=server_args.request_read_timeout_s,
              drain_s=server_args.shutdown_drain_s, abort_rest=server.engine.abort_all)  # fmt: skip
    finally:  # uvicorn returned without a shutdown; stop is idempotent
        if stop is not None and not server.loop.thread.is_alive():  # never while a step may broadcast
            stop()


if __name__ == "__main__":
    main()
