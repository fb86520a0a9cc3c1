"""The HTTP server (``Server``: its FastAPI app and the request handlers' plumbing); ``api_server`` is the command
that starts it.

Native ``/generate`` and ``/generate_stream``, OpenAI-compatible ``/v1/completions`` and
``/v1/chat/completions`` (server-sent events ending in ``data: [DONE]`` when streaming), ``/v1/models`` and
``/v1/models/{id}``, ``/health`` and ``/metrics``. Bad requests get a 400 (413 for a body over the size limit,
404 for another model) with a message; the server keeps serving.

This process serves HTTP, tokenizes, renders chat templates, detokenizes and streams; the engine (scheduler,
model, sampling) runs in a process of its own (``engine_proc``), and with ``--tp`` its workers are its children.
"""

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import re
import threading
import time
import uuid
from typing import AsyncIterator, Dict, List, Optional, Sequence, Set, Tuple, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lightllm.common.gc_heap import freeze_startup_heap
from lightllm.engine.detokenize import TextStream, final_text, stop_ids
from lightllm.engine.engine import Engine, eos_token_ids
from lightllm.engine.request import Event
from lightllm.engine.request import Request as EngineRequest
from lightllm.engine.runner import Runner
from lightllm.engine.sampler import MAX_SEED, SamplingParams
from lightllm.server.args import ServerArgs
from lightllm.server.bodies import ChatRequest, CompletionRequest, GenerateRequest
from lightllm.server.chat_output import chat_parsing, reads_generation_prompt
from lightllm.server.engine_loop import IDLE_WAIT_S, EngineLoop
from lightllm.server.engine_proc import EngineProcess
from lightllm.server.metrics import Metrics, ResponseCounter
from lightllm.server.http_guards import BadRequest, BodyLimit, ModelNotFound, install_error_handlers
from lightllm.server.openai_api import (
    OpenAIReply,
    chat_messages,
    check_unsupported,
    finite_logprob,
    json_str,
    prompt_list,
    sampling_options,
    template_options,
)
from lightllm.server.prompts import PromptEncoder

logger = logging.getLogger(__name__)
_DISCONNECT_CHECK_S = 0.25  # how often a request checks that its client is still there
_DRAIN_EVENTS = 128  # a handler that waits for its finish still takes its events this often (see _Inbox)
TINY_NAME = "lightllm-tiny-qwen3"  # the model id of the built-in tiny model
MAX_SEQUENCES = 256  # prompts x samples (n, or best_of) of one OpenAI request: each is an engine request
# /generate's names of the engine fields it sets, so a 400 names what the client sent
_NATIVE_FIELDS = {"max_tokens": "parameters.max_new_tokens", "min_tokens": "parameters.min_new_tokens",
                  **{f: f"parameters.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "seed",
                                                    "presence_penalty", "frequency_penalty",
                                                    "repetition_penalty")}}  # fmt: skip


# ---- the app -----------------------------------------------------------------------------------------------


class Server:
    def __init__(
        self,
        runner: Union[Runner, EngineProcess],
        tokenizer,
        model_name: str,
        health_step_timeout_s: float = ServerArgs.health_step_timeout_s,
        max_request_body_bytes: int = ServerArgs.max_request_body_bytes,
        sampling_defaults: Optional[Dict[str, Union[int, float]]] = None,
        extra_eos_ids: Sequence[int] = (),
        reasoning_parser: Optional[str] = None,
        tool_call_parser: Optional[str] = None,
    ):
        """``runner``: an ``EngineProcess`` (the server: the engine in a process of its own, ready), or a runner
        whose engine then runs on a thread of this process (tests over fake runners). ``sampling_defaults``: what
        the OpenAI routes use for a sampling field a request leaves out (``read_sampling_defaults``);
        ``extra_eos_ids``: ``--eos_id`` (an ``EngineProcess`` is given them too; here they say which token ends text);
        ``reasoning_parser``, ``tool_call_parser``: the flags of those names (None: chat answers stay plain text)."""
        self.runner = runner
        self.health_step_timeout_s = health_step_timeout_s
        self.tokenizer = tokenizer
        self.prompts = PromptEncoder(tokenizer, runner.args.max_req_total_len)
        self.max_request_body_bytes = max_request_body_bytes
        self.model_name = model_name
        self.created = int(time.time())  # the /v1/models entry's "created": when this server started
        self.sampling_defaults = dict(sampling_defaults or {})
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser
        # what skip_special_tokens skips: the named special tokens and every added token marked special (the chat
        # tokens of a tokenizer that does not list them, e.g. the tiny model's <|im_start|>)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ())) | {
            i for i, token in added.items() if getattr(token, "special", False)
        }
        # a native stop sequence that is a special token's text stops on that token, as LightLLM's (which matches
        # stop sequences as token ids) does: the text match never sees it when special tokens are skipped
        self._special_by_text = {tokenizer.decode([i]): i for i in sorted(self._special_ids)}
        self.eos_ids = eos_token_ids(runner.config, tokenizer, extra_eos_ids)  # the engine's: which token ends text
        self.metrics = Metrics()
        self._waiting: Set[_Inbox] = set()  # the inboxes a handler waits on now: the ticker wakes them
        if isinstance(runner, EngineProcess):  # the server's layout: the engine in a process of its own
            runner.observer = self.metrics
            self.metrics.watch_engine_process(runner.process.pid)
            self.engine = self.loop = self.mailbox = runner
            self._emitter = lambda events: events.put_nowait  # delivered on the event loop, a step at a time
        else:  # in-process, on a thread of this process (tests over fake runners)
            self.mailbox = _Mailbox()
            self.engine = Engine(runner, self.eos_ids, observer=self.metrics)
            self.loop = EngineLoop(self.engine, after_step=self.mailbox.flush)
            self._emitter = lambda events: functools.partial(self.mailbox.post, events)
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            loop = asyncio.get_running_loop()
            self.mailbox.bind(loop)
            self.loop.start()
            ticker = _Ticker(loop, _DISCONNECT_CHECK_S, self._waiting)
            # What start-up built (modules, the app, the tokenizer: ~250 K objects) is never garbage: kept out of
            # the collector's passes (its time in this process at batch 64: 0.10 -> 0.02 ms a decode step).
            freeze_startup_heap()
            self.metrics.gc_pauses.install()
            yield
            ticker.stop()
            self.metrics.gc_pauses.remove()
            gc.unfreeze()
            # Here, not after uvicorn.run returns: uvicorn re-raises SIGTERM/SIGINT once it has shut down,
            # which ends the process before any code after run() executes.
            if not self.loop.stop():
                logger.warning("engine loop still inside a step after 60s; exiting without a clean shutdown")

        app = FastAPI(title="lightllm", lifespan=lifespan)
        app.add_middleware(BodyLimit, limit=self.max_request_body_bytes)
        # outermost (added last): it also counts BodyLimit's refusals
        app.add_middleware(ResponseCounter, counter=self.metrics.http_responses)
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
            ids, params = await self._native(body)
            result = await self._collect(ids, params, request)
            tokens = result["token_ids"]
            out = {"generated_text": [result["text"]], "count_output_tokens": len(tokens),  # LightLLM's shape
                   "finish_reason": result["finish_reason"], "prompt_tokens": len(ids),
                   "token_ids": tokens}  # fmt: skip
            if body.parameters.logprobs:
                out["logprobs"] = [finite_logprob(lp) for lp in result["logprobs"]]
            if body.parameters.return_details:
                out["tokens"] = [self._token_details(t, lp) for t, lp in zip(tokens, result["logprobs"])]
            return JSONResponse(out)  # plain JSON types already: skips FastAPI's walk over every token and logprob

        @app.post("/generate_stream")
        async def generate_stream(body: GenerateRequest, request: Request):
            ids, params = await self._native(body)
            sub = self._submit(ids, params)
            return _SubmittedStream(self._native_events(ids, params, body.parameters, request, sub), [sub], done=False)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self._openai(body, request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatRequest, request: Request):
            return await self._openai(body, request, chat=True)

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
        """Why the engine loop is not making progress (None while it is): a thread or process that ended, one step
        running longer than ``health_step_timeout_s`` (a hung kernel, a stopped tensor-parallel rank), or a loop
        that has gone that long between two steps (stopped, deadlocked outside a step; an idle loop steps every
        50 ms)."""
        if not self.loop.is_alive():
            return self.loop.exit_reason()
        bound = self.health_step_timeout_s
        busy = self.loop.step_in_flight_s()
        if busy is not None and busy > bound:
            return f"engine step running for {busy:.1f}s, over --health_step_timeout_s {bound:g}"
        idle = self.loop.between_steps_s() if busy is None else None
        if idle is not None and idle > bound + IDLE_WAIT_S:  # an idle loop's wait is no hang, even past a tiny bound
            return f"engine loop has not run a step for {idle:.1f}s, over --health_step_timeout_s {bound:g}"
        return None

    # ---- request plumbing ----------------------------------------------------------------------------------

    async def _native(self, body: GenerateRequest) -> Tuple[List[int], SamplingParams]:
        p = body.parameters
        ids = await self._encode("inputs", body.inputs, add_special_tokens=p.add_special_tokens)
        if p.do_sample is False:
            temperature = 0.0
        else:
            temperature = p.temperature if p.temperature is not None else (1.0 if p.do_sample else 0.0)
        stops = [x for s in (p.stop, p.stop_sequences) for x in ([s] if isinstance(s, str) else s or [])]
        both = p.stop is not None and p.stop_sequences is not None
        fields = {**_NATIVE_FIELDS, "stop": "parameters.stop and stop_sequences together" if both else (
            "parameters.stop" if p.stop is not None else "parameters.stop_sequences")}  # fmt: skip
        special_stops = [self._special_by_text[s] for s in stops if s in self._special_by_text]
        options = dict(temperature=temperature, top_p=p.top_p, top_k=max(p.top_k, 0), min_p=p.min_p,
                       ignore_eos=p.ignore_eos, logprobs=p.logprobs or p.return_details,
                       presence_penalty=p.presence_penalty,
                       frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                       min_tokens=p.min_new_tokens, skip_special_tokens=p.skip_special_tokens,
                       stop_token_ids=special_stops)  # fmt: skip
        params = self._params(ids, p.max_new_tokens, stops, p.seed, options, fields)  # checks min_new_tokens
        # LightLLM's min_new_tokens counts the EOS: it may be the last of them (the engine's min_tokens comes before)
        return ids, dataclasses.replace(params, min_tokens=max(p.min_new_tokens - 1, 0))

    def _token_details(self, token_id: int, logprob: float) -> dict:
        """LightLLM's per-token details: id, its text alone, logprob, and whether it is a special token."""
        special = token_id in self._special_ids
        text, logprob = self.tokenizer.decode([token_id]), finite_logprob(logprob)
        return {"id": token_id, "text": text, "logprob": logprob, "special": special}

    async def _native_events(self, ids, params, p, request: Request,
                             submitted: Optional["_Submitted"] = None) -> AsyncIterator[str]:  # fmt: skip
        """``/generate_stream`` in LightLLM's shape: one event per token, ``finished`` false; then one with
        ``token.id`` null, the held-back text, ``finished`` true, the finish reason and the whole
        ``generated_text`` (and ``details`` with ``return_details``). The events of the tokens that are ready
        together go out as one chunk (see ``_stream``)."""
        text, count = "", 0
        async for ready in self._stream(ids, params, request, submitted=submitted):
            chunk = []
            for delta, ev, reason in ready:
                text += delta
                count += ev is not None
                if reason is None:  # a token's event: the hot path, one per token
                    special = ev.token_id in self._special_ids
                    chunk.append(_token_event(ev.token_id, delta, ev.logprob, special, count, len(ids)))
                    continue
                # the finish: no token, the held-back text, the whole text and the reason
                token = {"id": None, "text": delta, "logprob": None, "special": False, "count_output_tokens": count,
                         "prompt_tokens": len(ids)}  # fmt: skip
                details = None
                if p.return_details:
                    details = {"finish_reason": reason, "count_output_tokens": count, "prompt_tokens": len(ids)}
                event = {"token": token, "generated_text": text, "finished": True, "finish_reason": reason,
                         "details": details}  # fmt: skip
                chunk.append(f"data: {json.dumps(event)}\n\n")
            yield "".join(chunk)

    async def _encode(self, field: str, prompt, template_options: Optional[dict] = None,
                      keep: Optional[int] = None, add_special_tokens: bool = True) -> List[int]:  # fmt: skip
        """Token ids of a prompt (text, token ids, or chat messages rendered with ``template_options``), checked
        against the vocabulary and max_req_total_len (its last ``keep`` tokens, where given); ``field`` names it in a
        400."""
        if field == "messages":
            ids = await self.prompts.encode_chat(prompt, template_options or {})
        elif isinstance(prompt, str):
            ids = await self.prompts.encode(prompt, field, add_special_tokens)
        else:
            ids = list(prompt)
        return self._checked(field, ids, keep)

    def _checked(self, field: str, ids: List[int], keep: Optional[int] = None) -> List[int]:
        """``ids`` of a prompt (its last ``keep``: vLLM's ``truncate_prompt_tokens``), or a 400 naming ``field``:
        empty, too long, or out of the vocabulary."""
        if not ids:
            raise BadRequest(f"{field}: expected at least one token")
        if keep is not None:
            ids = ids[-keep:]
        limit = self.runner.args.max_req_total_len
        if len(ids) >= limit:
            raise BadRequest(f"{field}: {len(ids)} tokens, max_req_total_len is {limit}")
        vocab = self.runner.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise BadRequest(f"{field}: token ids expected in [0, {vocab})")
        return ids

    def _params(self, ids: List[int], max_tokens: Optional[int], stop, seed, options: dict,
                fields: Optional[Dict[str, str]] = None) -> SamplingParams:  # fmt: skip
        """The engine's sampling parameters for a prompt of ``ids``, or a 400 naming the field. ``max_tokens``
        None: the rest of max_req_total_len. ``fields``: the body's name of an engine field where it differs
        (``max_tokens`` -> ``parameters.max_new_tokens``), so the 400 names what the client sent."""
        fields = fields or {}
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        limit = self.runner.args.max_req_total_len
        if max_tokens is None:
            max_tokens = limit - len(ids)
        if max_tokens > limit - len(ids):
            raise BadRequest(f"{fields.get('max_tokens', 'max_tokens')}: {max_tokens} with a {len(ids)}-token prompt "
                             f"exceeds max_req_total_len {limit}")  # fmt: skip
        try:  # the bodies already hold most fields to the engine's ranges; this keeps the two from drifting apart
            params = SamplingParams(max_new_tokens=max_tokens, stop=stops, seed=seed, **options)
            params.check_token_ids(self.runner.config.vocab_size)
        except ValueError as e:
            raise BadRequest(_body_names(str(e), fields)) from None
        return params

    def _submit(self, ids, params, each_token: bool = True) -> "_Submitted":
        """Submit one engine request now; ``_stream`` then follows it. A streamed response submits its requests in
        its handler, before the response object is returned: Starlette starts the body in a task of its own after
        the headers, one or more turns of a busy event loop later, all of them in the time to first token."""
        events = _Inbox(each_token=each_token, waiting=self._waiting)
        req = EngineRequest(uuid.uuid4().hex, ids, params, self._emitter(events))
        self.engine.submit(req)
        return _Submitted(self, req.id, events)

    async def _stream(self, ids, params, request: Request, text: bool = True, cached: Optional[list] = None,
                      submitted: Optional["_Submitted"] = None) -> AsyncIterator[List[tuple]]:  # fmt: skip
        """Per wake-up, the tokens that are ready: a non-empty list of (text delta, token event or None, finish
        reason or None), one per token, the finish last; aborts on disconnect or stop string. Handing over what is
        ready together (a step's MTP tokens, or several steps' when this process falls behind under load) lets a
        stream write it in one chunk: one send per wake-up, not per token, so a busy process catches up instead of
        starving the engine of requests.
        ``text=False`` (a caller that decodes once at the end, with no stop strings) leaves every delta ''.
        ``cached``: gets the request's prompt tokens read from the prefix cache appended, with its first event.
        ``submitted``: the request ``_submit`` already sent (else it is submitted here).
        Counts the request in lightllm_requests_finished_total once, with the reason the client is given
        ("abort" when it left first, whether it was running or still queued)."""
        submitted = submitted or self._submit(ids, params, each_token=text)
        events = submitted.events
        out = TextStream(self.tokenizer if text else None, params, stop_ids(params, self.eos_ids))
        first = True
        loop = asyncio.get_running_loop()
        next_check = loop.time() + _DISCONNECT_CHECK_S
        try:
            while True:
                evs = await events.get_all()
                if not evs or loop.time() >= next_check:  # also while tokens flow: a gone client must not decode on
                    next_check = loop.time() + _DISCONNECT_CHECK_S
                    if await request.is_disconnected():
                        return
                if not evs:
                    continue
                if first:  # every event carries the admission's hit: count it once
                    first = False
                    self.metrics.cached_tokens.inc(evs[0].cached_tokens)
                    self.metrics.prompt_tokens.inc(len(ids))
                    if cached is not None:
                        cached.append(evs[0].cached_tokens)
                ready = []
                for ev in evs:
                    if ev.kind == "finish":
                        rest, reason = out.finish(ev.finish_reason)
                        submitted.end(reason)
                        ready.append((rest, None, reason))
                        yield ready
                        return
                    delta, hit = out.add(ev.token_id)
                    ready.append((delta, ev, None))
                    if hit:
                        submitted.abort("stop")
                        ready.append(("", None, "stop"))
                        yield ready
                        return
                yield ready
        finally:
            submitted.abort()  # client gone (or the handler was cancelled): free its KV now; nothing once it ended

    async def _collect(self, ids, params, request: Request) -> dict:
        text, token_ids, logprobs, tops, reason, cached = "", [], [], [], "", []
        incremental = bool(params.stop)  # only stop strings need the text while generating
        async for ready in self._stream(ids, params, request, text=incremental, cached=cached):
            for delta, ev, fin in ready:
                text += delta
                if ev is not None:
                    token_ids.append(ev.token_id)
                    logprobs.append(ev.logprob)
                    tops.append(ev.top_logprobs)
                if fin:
                    reason = fin
        if not incremental:
            text = final_text(self.tokenizer, token_ids, params, self.eos_ids)
        return {"text": text, "token_ids": token_ids, "logprobs": logprobs, "top_logprobs": tops,
                "finish_reason": reason or "abort", "cached_tokens": sum(cached)}  # fmt: skip

    async def merged_streams(
        self,
        seqs: Sequence[tuple],
        request: Request,
        cached: Optional[List[list]] = None,
        submitted: Optional[Sequence["_Submitted"]] = None,
    ) -> AsyncIterator[List[tuple]]:
        """For every ``(ids, params)`` of ``seqs``, generated side by side: per wake-up, a non-empty list of (index
        into ``seqs``, one of the tuples ``_stream`` yields), everything that is ready, in the order it arrived.
        Leaving early (the client went) cancels every one of them, which aborts them in the engine. ``cached``:
        one list per sequence, for ``_stream``'s ``cached``; ``submitted``: the requests ``_submit`` already sent,
        one per sequence."""
        if len(seqs) == 1:  # the usual request: its one stream directly, no task and queue between
            (ids, params), sub = seqs[0], submitted[0] if submitted else None
            async with contextlib.aclosing(self._stream(ids, params, request, cached=cached[0] if cached else None,
                                                        submitted=sub)) as events:  # fmt: skip
                async for ready in events:
                    yield [(0, item) for item in ready]
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, ids, params):
            try:
                async for ready in self._stream(ids, params, request, cached=cached[i] if cached else None,
                                                submitted=submitted[i] if submitted else None):  # fmt: skip
                    queue.put_nowait((i, ready))
            except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, ids, params)) for i, (ids, params) in enumerate(seqs)]
        try:
            running = len(tasks)
            while running:
                got = [await queue.get()]
                while not queue.empty():
                    got.append(queue.get_nowait())
                out, error = [], None
                for i, ready in got:
                    if isinstance(ready, Exception):
                        error = error or ready
                    elif ready is None:
                        running -= 1
                    elif error is None:
                        out.extend((i, item) for item in ready)
                if out:
                    yield out  # what arrived before a failure still goes out first
                if error is not None:
                    raise error
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect_all(self, seqs: Sequence[tuple], request: Request) -> List[dict]:
        """``_collect`` of every ``(ids, params)`` side by side; if one fails the others are cancelled (aborted)."""
        tasks = [asyncio.ensure_future(self._collect(ids, params, request)) for ids, params in seqs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _openai(self, body, request: Request, chat: bool):
        """Both OpenAI routes: one engine request per prompt and sample (``n``, or ``best_of`` of which the ``n``
        with the highest cumulative logprob are returned); choices ordered prompt by prompt, ``index`` counting
        across them."""
        self._check_model(body.model)
        check_unsupported(body, chat)
        options = sampling_options(body, chat, self.sampling_defaults)
        items, many = ([None], False) if chat else prompt_list(body.prompt)
        n = body.n or 1
        best_of = n if chat else (body.best_of or n)
        if len(items) * best_of > MAX_SEQUENCES:  # before any tokenizing
            raise BadRequest(f"{'prompt' if many else 'n'}: {len(items)} prompt(s) x {best_of} samples (n or best_of) "
                             f"is more than the {MAX_SEQUENCES} sequences one request may ask for")  # fmt: skip
        generation_prompt = ""  # what the chat template added for the answer, where a reasoning parser reads it
        keep = body.truncate_prompt_tokens
        if chat:
            messages, template = chat_messages(body), template_options(body)
            if reads_generation_prompt(self.reasoning_parser, body):
                ids, generation_prompt = await self.prompts.encode_chat_answering(messages, template)
                prompts = [self._checked("messages", ids, keep)]
            else:
                prompts = [await self._encode("messages", messages, template, keep)]
            max_tokens = body.max_completion_tokens or body.max_tokens
            fields = {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens else None
        else:
            prompts = [
                await self._encode(f"prompt.{i}" if many else "prompt", p, keep=keep) for i, p in enumerate(items)
            ]
            max_tokens, fields = body.max_tokens, None  # null: the rest of max_req_total_len
        seqs = []
        for ids in prompts:
            params = self._params(ids, max_tokens, body.stop, body.seed, options, fields)
            for j in range(best_of):  # each sample its own seed, as LLM.generate gives each prompt its own
                seed = None if body.seed is None else (body.seed + j) % MAX_SEED
                seqs.append((ids, dataclasses.replace(params, seed=seed)))
        echoes = None
        if not chat and body.echo:
            echoes = [p if isinstance(p, str) and keep is None else self.tokenizer.decode(ids)
                      for p, ids in zip(items, prompts)]  # fmt: skip
        parsing = None
        if chat and (self.reasoning_parser or self.tool_call_parser):
            parsing = chat_parsing(self.reasoning_parser, self.tool_call_parser, body, generation_prompt)
        params = seqs[0][1]  # the text's rules are every sample's
        hidden = () if params.include_stop_str_in_output else stop_ids(params, self.eos_ids)
        reply = OpenAIReply(self, chat, prompts, n, best_of, echoes, options["logprobs"], parsing,
                            stops=bool(params.stop), skip_special_tokens=params.skip_special_tokens,
                            hidden=hidden)  # fmt: skip
        if body.stream:
            options = body.stream_options
            include_usage = bool(options and options.include_usage)
            continuous = include_usage and bool(options.continuous_usage_stats)
            subs = [self._submit(ids, params) for ids, params in seqs]
            return _SubmittedStream(reply.stream(seqs, request, include_usage, subs, continuous), subs)
        return reply.whole(await self._collect_all(seqs, request))


def _body_names(message: str, fields: Dict[str, str]) -> str:
    """A ``SamplingParams`` message with the engine's field names (``max_new_tokens``, ...) as the body named them
    (``fields``: engine name -> body name, ``max_tokens`` standing for ``max_new_tokens``), up to the value shown."""
    names = {"max_new_tokens": fields.get("max_tokens", "max_tokens"), **fields}
    head, got, rest = message.partition(", got ")  # what follows "got" is the client's own value
    head = re.sub(r"\b[a-z_]+\b", lambda m: names.get(m.group(), m.group()), head)
    return head + got + rest


def _token_event(token_id: int, text: str, logprob: float, special: bool, count: int, prompt_tokens: int) -> str:
    """``data: json.dumps(event)`` of a ``/generate_stream`` token event (not the last), character for character,
    formatted directly: ``json.dumps`` walking the nested dicts was a quarter of the HTTP process's time under load."""
    logprob = finite_logprob(logprob)
    return (f'data: {{"token": {{"id": {int(token_id)}, "text": {json_str(text)}, "logprob": {logprob!r}, '
            f'"special": {"true" if special else "false"}, "count_output_tokens": {int(count)}, "prompt_tokens": '
            f'{int(prompt_tokens)}}}, "generated_text": null, "finished": false, "finish_reason": null, '
            f'"details": null}}\n\n')  # fmt: skip


class _Submitted:
    """An engine request that is submitted and not yet followed to its end: counted in
    lightllm_requests_finished_total (and lightllm_e2e_request_latency_seconds) exactly once, by ``end`` (its
    finish), or by ``abort`` (the client left, a stop string, or a streamed response that ended before its body ever
    read the request)."""

    def __init__(self, server: "Server", request_id: str, events: "_Inbox"):
        self.server, self.request_id, self.events = server, request_id, events
        self.ended = False
        self.submitted_at = time.perf_counter()

    def end(self, reason: str) -> None:
        if not self.ended:
            self.ended = True
            self.server.metrics.finished.labels(reason).inc()
            self.server.metrics.e2e.observe(time.perf_counter() - self.submitted_at)

    def abort(self, reason: str = "abort") -> None:
        """Abort it in the engine and count it with ``reason``, unless it has ended already."""
        if not self.ended:
            self.server.engine.abort(self.request_id, reason=reason)
            self.end(reason)


class _SubmittedStream(StreamingResponse):
    """A streamed response over requests its handler submitted: whatever way the response ends (its body done,
    the client gone before the body started, a failed send, an error making the body), no request of it is left
    running. ``done``: the body's events end with ``data: [DONE]`` (OpenAI's routes), also after an error."""

    def __init__(self, body: AsyncIterator[str], submitted: Sequence[_Submitted], done: bool = True):
        super().__init__(_ending_in_an_error_event(body, done), media_type="text/event-stream")
        self.submitted = submitted

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for sub in self.submitted:
                sub.abort()


async def _ending_in_an_error_event(body: AsyncIterator[str], done: bool) -> AsyncIterator[str]:
    """``body``'s events; if making one raises, an error event (and ``[DONE]`` where the route ends with it), as
    vLLM's streams end, instead of a connection closed mid-body that clients report as an incomplete read."""
    try:
        async for event in body:
            yield event
    except Exception as e:  # not BaseException: a cancelled task (the client gone) ends as it is
        logger.exception("a streamed response failed; it ends with an error event")
        error = {"message": f"internal error ({type(e).__name__}); the server log has the details",
                 "type": "server_error", "code": 500}  # fmt: skip
        yield f"data: {json.dumps({'error': error})}\n\n" + ("data: [DONE]\n\n" if done else "")


class _Inbox:
    """One request's events on the event loop. ``get_all`` waits for them on a future, entered in ``waiting``: the
    server's ticker wakes an inbox that has waited a whole ``_DISCONNECT_CHECK_S`` (its handler then checks that the
    client is still there), one timer for all of them instead of one armed and cancelled per wait (a streaming request
    waits once per step). Only those: waking every waiting stream at each tick ran all their disconnect checks in one
    burst that held the event loop for tens of milliseconds (docs/server.md, "A regression, found and fixed").
    ``each_token`` False (a handler that needs no text until the end): the finish wakes the handler, and otherwise
    only every ``_DRAIN_EVENTS`` tokens (and the ticker), so that a long generation's events do not pile up as objects
    every garbage collection walks (at batch 64, 3072 tokens each, the collector's time in this process fell from 0.18
    to 0.10 ms a step)."""

    def __init__(self, each_token: bool = True, waiting: Optional[Set["_Inbox"]] = None):
        self._items: List[Event] = []
        self._waiter: Optional[asyncio.Future] = None
        self._since = 0.0  # when the current wait began (the loop's clock)
        self._each_token = each_token
        self._waiting = set() if waiting is None else waiting

    def put_nowait(self, event: Event) -> None:
        items = self._items
        items.append(event)
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._each_token or len(items) >= _DRAIN_EVENTS or event.kind == "finish":
            waiter.set_result(None)

    def wake_if_idle(self, now: float, idle_s: float) -> None:
        """End the current wait, with or without events, if it began ``idle_s`` or more before ``now`` (the ticker)."""
        if self._waiter is not None and not self._waiter.done() and now - self._since >= idle_s:
            self._waiter.set_result(None)

    async def get_all(self) -> List[Event]:
        """Every event there is, waiting to be woken for one (or by the ticker) if there is none yet; [] when woken
        with none."""
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter, self._since = loop.create_future(), loop.time()
            self._waiting.add(self)
            try:
                await self._waiter
            finally:
                self._waiting.discard(self)
                self._waiter = None
        items, self._items = self._items, []
        return items


class _Ticker:
    """Each ``period_s`` seconds, for as long as the server serves, wakes every ``_Inbox`` that has waited that long:
    at most two periods after a request's tokens stop, its handler checks its client."""

    def __init__(self, loop: asyncio.AbstractEventLoop, period_s: float, waiting: Set[_Inbox]):
        self._loop, self._period_s, self._waiting = loop, period_s, waiting
        self._handle = loop.call_later(period_s, self._tick)

    def _tick(self) -> None:
        now = self._loop.time()
        for inbox in list(self._waiting):  # a woken inbox leaves the set when its handler runs, not now
            inbox.wake_if_idle(now, self._period_s)
        self._handle = self._loop.call_later(self._period_s, self._tick)

    def stop(self) -> None:
        self._handle.cancel()


class _Mailbox:
    """Events from the engine thread to the HTTP event loop, handed over once per step: one wake-up of the
    loop (a pipe write and a GIL hand-off) per step, not one per running request."""

    def __init__(self):
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._items: List[tuple] = []
        self._lock = threading.Lock()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def post(self, queue: _Inbox, event: Event) -> None:
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
