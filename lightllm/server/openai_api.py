"""OpenAI request fields to engine requests, and engine output to OpenAI's response shapes.

What a body asks that this server cannot do is a 400 that says so (``BadRequest``); the rest becomes sampling
parameters (``sampling_options``), chat template input (``chat_messages``, ``template_options``) and, on the way
back, OpenAI's responses and stream chunks (``OpenAIReply``) with their logprobs objects (``LogprobFormatter``)."""

import bisect
import functools
import json
import math
import re
import time
import uuid
from typing import AsyncIterator, Callable, Collection, Dict, List, Optional, Sequence, Tuple

from lightllm.engine.detokenize import IncrementalDetokenizer
from lightllm.server.bodies import ChatRequest, CompletionRequest
from lightllm.server.chat_output import ChatParsing, merge_deltas
from lightllm.server.http_guards import BadRequest

json_str = json.encoder.encode_basestring_ascii  # json.dumps of a str (ensure_ascii), in C
LOGPROB_FLOOR = -9999.0  # vLLM's: what a response says for a logprob below it, -inf or NaN (logits that overflowed)


def finite_logprob(logprob: float) -> float:
    """A logprob as JSON can carry it: NaN and Infinity are not JSON (JavaScript's, Go's and Rust's parsers refuse
    them, and Starlette's JSONResponse raises on them), so -inf and NaN become ``LOGPROB_FLOOR`` and +inf 0."""
    logprob = float(logprob)
    if logprob == math.inf:
        return 0.0
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # below it, -inf, or NaN (no comparison holds)


_TEXT_FIELDS = frozenset({"content", "reasoning_content"})  # a chat delta's text fields

# Message roles OpenAI clients send; "developer" (OpenAI's newer name for system) reaches the template as "system",
# which is the role chat templates know (Qwen3's renders no other role in the system slot, and skips unknown ones).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# chat_template_kwargs may not set what the server itself passes to the template.
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "tokenize", "add_generation_prompt", "chat_template",
                            "continue_final_message")  # fmt: skip
# vLLM's fields for what this server does not do: refused by name, since each changes the output and ignoring it (as
# an unknown field is) would answer something else with a 200. (field, what it asks for)
REFUSED_VLLM_FIELDS = (
    ("guided_json", "constrained decoding"),
    ("guided_regex", "constrained decoding"),
    ("guided_choice", "constrained decoding"),
    ("guided_grammar", "constrained decoding"),
    ("structured_outputs", "constrained decoding"),
    ("use_beam_search", "beam search"),
    ("prompt_logprobs", "prompt token logprobs"),
    ("allowed_token_ids", "sampling restricted to given tokens"),
    ("bad_words", "banned words"),
    ("logits_processors", "custom logits processors"),
    ("return_tokens_as_token_ids", "logprob tokens as 'token_id:N' strings"),
    ("echo", "a chat answer prefixed with the last message"),  # chat's echo: completions' is a field of its own
)
PROMPT_LOGPROBS_REFUSED = (
    "echo with logprobs: prompt token logprobs are not supported; the prefill keeps the logits of the last prompt "
    "position only (all positions would be prompt_len x vocab floats per request); use echo without logprobs"
)


def check_unsupported(body, chat: bool) -> None:
    """400 for what the body asks that this server does not do, naming the field and the alternative."""
    extra = body.model_extra or {}
    for name, what in REFUSED_VLLM_FIELDS:
        value = extra.get(name)
        if value is not None and value is not False:  # 0 is a value here (prompt_logprobs 0: the prompt's own)
            raise BadRequest(f"{name}: not supported ({what} is not available in this server); leave it out or send "
                             "null")  # fmt: skip
    if body.stream_options is not None and not body.stream:
        raise BadRequest("stream_options: only allowed with stream true")
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        allowed = "'text' is the only type (there is no constrained decoding here)"
        if fmt.type in ("json_object", "json_schema"):
            raise BadRequest(f"response_format: type {fmt.type!r} is not supported; {allowed}")
        raise BadRequest(f"response_format: unknown type {fmt.type!r}; {allowed}")
    if chat:
        _check_chat(body)
    else:
        _check_completion(body)


def _check_chat(body: ChatRequest) -> None:
    if body.top_logprobs and not body.logprobs:
        raise BadRequest(f"top_logprobs: {body.top_logprobs} needs logprobs true")
    _check_functions("tools", body.tools or [], _TOOL_FIELDS, type_required=True)
    choice = body.tool_choice
    if choice is not None and choice not in ("auto", "none"):
        shown = choice if isinstance(choice, str) else "a named function"
        raise BadRequest(f"tool_choice: {shown!r} is not supported (forcing a call needs constrained decoding, which "
                         "this server does not have); use 'auto' or 'none'")  # fmt: skip
    if (body.model_extra or {}).get("chat_template") is not None:  # vLLM's default refuses it too (untrusted Jinja)
        raise BadRequest("chat_template: a request's own chat template is not supported; the server renders with the "
                         "model's template or the one --chat_template names; leave it out or send null")  # fmt: skip
    for key in sorted(set(body.chat_template_kwargs or {}) & set(RESERVED_TEMPLATE_KWARGS)):
        own = " (send it as the request's own field)" if key in type(body).model_fields else ""
        raise BadRequest(f"chat_template_kwargs: {key!r} is set by the server; it may not be passed{own}")
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise BadRequest("continue_final_message: true needs add_generation_prompt false (the answer continues the "
                             "last message instead of opening a new one)")  # fmt: skip
        if body.messages[-1].role != "assistant":
            raise BadRequest(f"continue_final_message: the last message must be the assistant's to continue, got role "
                             f"{body.messages[-1].role!r}")  # fmt: skip


# The optional fields of a function entry's "function" object: (key, allowed types, what the message says)
_TOOL_FIELDS = (("description", str, "a string"), ("parameters", dict, "a JSON Schema object"))
_CALL_FIELDS = (("arguments", (str, dict), "a JSON string or an object"),)


def _check_functions(where: str, entries: List[dict], fields: tuple, type_required: bool) -> None:
    """OpenAI's function entries, ``{"type": "function", "function": {"name", ...}}``: the request's ``tools`` and an
    earlier answer's ``tool_calls`` (whose ``type`` may be left out). The template renders each one's name and
    ``fields``, so an entry without a name, or with a field of another type, is a 400 naming it, as OpenAI answers."""
    for j, entry in enumerate(entries):
        kind = entry.get("type") if type_required else entry.get("type", "function")
        if kind != "function":
            raise BadRequest(f"{where}.{j}.type: expected 'function', got {kind!r}")
        fn = entry.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"{where}.{j}.function: expected an object with a name, got {fn!r}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"{where}.{j}.function.name: expected a non-empty string, got {fn.get('name')!r}")
        for key, types, what in fields:
            if fn.get(key) is not None and not isinstance(fn[key], types):
                raise BadRequest(f"{where}.{j}.function.{key}: expected {what}, got {fn[key]!r}")


def _check_completion(body: CompletionRequest) -> None:
    if body.suffix:
        raise BadRequest("suffix: not supported (no fill-in-the-middle); leave it out or send null")
    n, best_of = body.n or 1, body.best_of
    if best_of is not None and best_of < n:
        raise BadRequest(f"best_of: {best_of} is less than n {n}; best_of must be >= n")
    if best_of is not None and best_of > n and body.stream:
        raise BadRequest(f"best_of: {best_of} > n {n} cannot be streamed (the best are known only at the end)")
    if body.echo and body.logprobs is not None:
        raise BadRequest(PROMPT_LOGPROBS_REFUSED)
    if isinstance(body.prompt, list) and not body.prompt:
        raise BadRequest("prompt: expected a string, token ids, or a non-empty list of either")


def prompt_list(prompt) -> Tuple[list, bool]:
    """The prompts of a completions body (each a string or token ids), and whether the body held a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt], False
    return list(prompt), True


def chat_messages(body: ChatRequest) -> List[dict]:
    """The messages as the chat template takes them: text parts joined; ``name``, tool fields and an earlier
    answer's ``reasoning_content`` kept."""
    out = []
    for i, m in enumerate(body.messages):
        if m.role not in CHAT_ROLES:
            raise BadRequest(f"messages.{i}.role: {m.role!r} is not one of {', '.join(CHAT_ROLES)}")
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise BadRequest(f"messages.{i}.content.{j}.type: {part.type!r} is not supported; this server "
                                     "takes text parts only")  # fmt: skip
                if part.text is None:
                    raise BadRequest(f"messages.{i}.content.{j}.text: expected a string in a text part")
                texts.append(part.text)
            content = "\n".join(texts)
        _check_functions(f"messages.{i}.tool_calls", m.tool_calls or [], _CALL_FIELDS, type_required=False)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        out.append(message)
    return out


def template_options(body: ChatRequest) -> dict:
    """Keyword arguments for ``apply_chat_template``: the tools (unless tool_choice is 'none'), the request's
    ``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``) and, where the request turns the answer's turn off
    (``add_generation_prompt`` false, ``continue_final_message``), those flags."""
    options = dict(body.chat_template_kwargs or {})
    if body.tools and body.tool_choice != "none":
        options["tools"] = body.tools
    if body.continue_final_message:  # the answer goes on in the last message: no new turn opened after it
        options.update(continue_final_message=True, add_generation_prompt=False)
    elif body.add_generation_prompt is False:
        options["add_generation_prompt"] = False
    return options


def sampling_options(body, chat: bool, defaults: Dict[str, float]) -> dict:
    """``SamplingParams`` keyword arguments from an OpenAI body (max_new_tokens, stop and seed aside). A field the
    body leaves out or sends as null takes ``defaults`` (generation_config.json), else the engine's default."""
    chosen = {}
    for key, fallback in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0)):
        value = getattr(body, key)
        chosen[key] = defaults.get(key, fallback) if value is None else value
    chosen["top_k"] = max(chosen["top_k"], 0)  # -1: off
    if body.repetition_penalty is None and "repetition_penalty" in defaults:
        chosen["repetition_penalty"] = defaults["repetition_penalty"]
    for key in (
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "include_stop_str_in_output",
    ):
        if getattr(body, key) is not None:
            chosen[key] = getattr(body, key)
    chosen["stop_token_ids"] = list(body.stop_token_ids or ())
    chosen["logit_bias"] = _logit_bias(body.logit_bias)
    if chat:
        chosen["logprobs"] = bool(body.logprobs)
        chosen["top_logprobs"] = body.top_logprobs or 0
    else:
        chosen["logprobs"] = body.logprobs is not None
        chosen["top_logprobs"] = body.logprobs or 0
    return chosen


def _logit_bias(bias: Optional[Dict[str, float]]) -> Dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        if not key.isdigit() or not key.isascii():
            raise BadRequest(f"logit_bias: key {key!r} is not a token id (expected a non-negative integer)")
        out[int(key)] = value
    return out


@functools.lru_cache(maxsize=None)
def _byte_of_char() -> Dict[str, int]:
    """Byte-level BPE's vocabulary alphabet (GPT-2's byte map, the one transformers converts tokenizers with):
    character -> the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TextOffsets:
    """OpenAI's completions ``text_offset``: where each generated token starts in the returned text, in characters
    from ``start`` (an echoed prompt's length), with the text as the stream gives it: a token inside a character split
    over tokens starts where that character does, and one with no text (a skipped special token) where the next text
    does. Adding up each token's own decode instead drifts by the split characters' extra U+FFFDs and the special
    tokens' names. ``skip_special_tokens`` and ``hidden`` (token ids whose text is left out: the request's stop tokens)
    are the text's own rules (``TextStream``'s)."""

    def __init__(self, tokenizer, start: int, skip_special_tokens: bool = True, hidden: Collection[int] = ()):
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._at = start
        self._hidden = hidden

    def next(self, token_id: int) -> int:
        """The offset of ``token_id``, the next generated token."""
        at = self._at
        if token_id not in self._hidden:
            self._at += len(self._detok.add(token_id))
        return at

    @property
    def end(self) -> int:
        """Where the text of the tokens so far ends, uncut by stop strings (a character still incomplete left out)."""
        return self._at


class LogprobFormatter:
    """OpenAI's logprobs objects from the engine's (token id, logprob, top logprobs) per generated token; the text's
    rules (``TextOffsets``) for where each token starts in it."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, hidden: Collection[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens, self.hidden = skip_special_tokens, hidden

    def offsets(self, start: int) -> TextOffsets:
        """Where each next generated token starts in the text, from ``start``."""
        return TextOffsets(self.tokenizer, start, self.skip_special_tokens, self.hidden)

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def raw_bytes(self, token_id: int, text: str) -> List[int]:
        """The token's own bytes (OpenAI's ``bytes``: a client joins a character split over tokens from them). Its
        decoded ``text`` when that is whole; a token holding part of a UTF-8 character decodes to U+FFFD, so its
        bytes come from its vocabulary entry: byte-level BPE's characters (GPT-2's byte map, Qwen's tokenizers) or
        SentencePiece's ``<0xAB>`` byte fallback."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id) if "\ufffd" in text else None
        if not isinstance(piece, str):
            return list(text.encode("utf-8"))
        byte = _BYTE_FALLBACK.fullmatch(piece)
        if byte:
            return [int(byte.group(1), 16)]
        raw = [_byte_of_char().get(char) for char in piece]
        return raw if raw and None not in raw else list(text.encode("utf-8"))

    def chat(self, tokens: Sequence[int], logprobs: Sequence[float], tops: Sequence[Optional[list]]) -> dict:
        """``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
        content = []
        for tok, lp, top in zip(tokens, logprobs, tops):
            entry = self._chat_entry(tok, lp)
            entry["top_logprobs"] = [self._chat_entry(t, v) for t, v in top or ()]
            content.append(entry)
        return {"content": content}

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": self.raw_bytes(token_id, text)}

    def completion(self, tokens: Sequence[int], logprobs: Sequence[float], tops: Sequence[Optional[list]],
                   offset: int) -> dict:  # fmt: skip
        """``{tokens, token_logprobs, top_logprobs, text_offset}``; ``top_logprobs`` maps text to logprob for the
        chosen token and the asked-for alternatives (``top_logprobs[i][tokens[i]] == token_logprobs[i]``; another
        text shared by several tokens has the likeliest one's); ``text_offset`` counts from ``offset`` (an echoed
        prompt)."""
        texts, offsets, top_maps = [], [], []
        positions = self.offsets(offset)
        for tok, lp, top in zip(tokens, logprobs, tops):
            text = self.text(tok)
            offsets.append(positions.next(tok))
            texts.append(text)
            top_map = {}
            for t, v in top or ():  # most likely first: a text shared by several tokens keeps the likeliest's
                top_map.setdefault(self.text(t), finite_logprob(v))
            top_map[text] = finite_logprob(lp)  # the chosen token's own logprob, whatever alternative shares its text
            top_maps.append(top_map)
        return {"tokens": texts, "token_logprobs": [finite_logprob(lp) for lp in logprobs], "top_logprobs": top_maps,
                "text_offset": offsets}  # fmt: skip


class OpenAIReply:
    """One OpenAI response: its id, its choices and usage, whole or as server-sent events. ``server``: the
    http_server's ``Server`` (its tokenizer, model name, and ``merged_streams`` for streams)."""

    def __init__(self, server, chat: bool, prompts: List[List[int]], n: int, best_of: int, echoes,
                 with_logprobs: bool, parsing: Optional[ChatParsing] = None, stops: bool = False,
                 skip_special_tokens: bool = True, hidden: Collection[int] = ()):  # fmt: skip
        """``skip_special_tokens``, ``hidden``: the text's rules, for the logprobs' offsets (``TextOffsets``)."""
        self.server, self.chat, self.prompts, self.n, self.best_of = server, chat, prompts, n, best_of
        self.with_logprobs = with_logprobs
        self.stops = stops  # the request has stop strings, which may cut the text (see _reported)
        self.parsing = parsing  # chat: reasoning and tool calls taken out of the text (None: the text as it is)
        self.echoes = echoes  # per prompt, the text echoed before the completion (completions with echo)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.logprobs = LogprobFormatter(server.tokenizer, skip_special_tokens, hidden)

    def _echo(self, prompt_index: int) -> str:
        return self.echoes[prompt_index] if self.echoes else ""

    def _usage(self, completion_tokens: int, cached: List[int]) -> dict:
        """``cached``: per sequence, its prompt tokens read from the prefix cache. A prompt counts once in
        ``prompt_tokens``, so its samples' hits count once too: the smallest, what the prompt's first computation
        read (the samples admitted after it read what it computed: docs/engine.md, "Prefix cache")."""
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        per = len(cached) // len(self.prompts)
        hits = sum(min(cached[p * per : (p + 1) * per], default=0) for p in range(len(self.prompts)))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": hits}}  # fmt: skip

    def whole(self, results: List[dict]) -> dict:
        choices = []
        for p in range(len(self.prompts)):
            group = results[p * self.best_of : (p + 1) * self.best_of]
            if self.best_of > self.n:  # the n most likely samples under the model, most likely first
                # on the logprobs the client sees: a sample of overflowed logits (NaN) must not rank first
                group = sorted(group, key=lambda r: sum(map(finite_logprob, r["logprobs"])), reverse=True)[: self.n]
            for r in group:
                choices.append(self._choice(len(choices), p, r))
        usage = self._usage(sum(len(r["token_ids"]) for r in results), [r["cached_tokens"] for r in results])
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.server.model_name,
                "choices": choices, "usage": usage}  # fmt: skip

    def _reported(self, r: dict) -> int:
        """How many of ``r``'s tokens its logprobs report: all, unless a stop string cut the text; then those that
        start before the cut (the stop string's own tokens are not in the text)."""
        if not self.stops or r["finish_reason"] != "stop":
            return len(r["token_ids"])
        positions = self.logprobs.offsets(0)
        starts = [positions.next(t) for t in r["token_ids"]]
        if len(r["text"]) >= positions.end:  # ended otherwise (EOS): nothing was cut
            return len(starts)
        return bisect.bisect_left(starts, len(r["text"]))

    def _choice(self, index: int, prompt_index: int, r: dict) -> dict:
        lps = None
        if self.with_logprobs:
            k = self._reported(r)
            r = {**r, "token_ids": r["token_ids"][:k], "logprobs": r["logprobs"][:k],
                 "top_logprobs": r["top_logprobs"][:k]}  # fmt: skip
        if self.chat:
            if self.with_logprobs:
                lps = self.logprobs.chat(r["token_ids"], r["logprobs"], r["top_logprobs"])
            if self.parsing is None:
                message, reason = {"role": "assistant", "content": r["text"]}, r["finish_reason"]
            else:
                out = self.parsing.new_output()
                message = out.message(r["text"])
                reason = out.finish_reason(r["finish_reason"])
            return {"index": index, "message": message, "logprobs": lps, "finish_reason": reason}
        echo = self._echo(prompt_index)
        if self.with_logprobs:
            lps = self.logprobs.completion(r["token_ids"], r["logprobs"], r["top_logprobs"], len(echo))
        return {"index": index, "text": echo + r["text"], "logprobs": lps, "finish_reason": r["finish_reason"]}

    async def stream(self, seqs: List[tuple], request, include_usage: bool, submitted=None,
                     continuous: bool = False) -> AsyncIterator[str]:  # fmt: skip
        """Server-sent events: per choice, a first chunk (chat: the role; completions with echo: the prompt), one
        chunk per token (with its logprobs when asked; with stop strings a token's come once some of its text is sent,
        never for the tokens a stop string cut off), a last one with the finish reason; with ``include_usage`` a
        final chunk with no choices and the usage; then ``[DONE]``. best_of equals n here. ``continuous`` (vLLM's
        ``continuous_usage_stats``): every chunk of a choice also has that choice's usage so far.
        ("Chunk" is OpenAI's name for one event; the events of tokens ready together share one write.)"""
        kind = self.kind + ".chunk" if self.chat else self.kind
        produced, cached = [0] * len(seqs), [[] for _ in seqs]
        # With stop strings a token's logprobs wait until some of its text is sent: text held back as the possible
        # start of a stop string may turn out to be one, and then its tokens are cut off with it, not reported.
        waits = self.with_logprobs and self.stops
        sent = [len(self._echo(i // self.n)) for i in range(len(seqs))]  # where the text sent so far ends
        waiting: List[List[tuple]] = [[] for _ in seqs]  # (offset, event) of the tokens whose logprobs wait
        positions = [self.logprobs.offsets(sent[i])
                     for i in range(len(seqs))] if self.with_logprobs and (waits or not self.chat) else []  # fmt: skip

        def event(choice: dict) -> str:  # one choice's chunk (with its usage so far, where asked)
            usage = self._choice_usage(choice["index"], produced) if continuous else None
            return self._sse(kind, [choice], usage=usage)

        for i in range(len(seqs)):
            if self.chat:
                yield event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})  # fmt: skip
            elif self.echoes:
                yield event({"index": i, "text": self._echo(i // self.n), "logprobs": None, "finish_reason": None})
        outputs = [self.parsing.new_output() for _ in seqs] if self.parsing else None
        plain = self._plain_chunk(kind) if not continuous else self._usage_chunk(event)
        async for ready in self.server.merged_streams(seqs, request, cached, submitted):
            chunk = []  # what is ready together goes out in one write (see Server._stream)
            for i, (delta, ev, fin) in ready:
                lps = None
                if ev is not None:
                    produced[i] += 1
                    if self.with_logprobs:
                        waiting[i].append((positions[i].next(ev.token_id) if positions else 0, ev))
                sent[i] += len(delta)
                if waiting[i]:
                    due = len(waiting[i])
                    if waits and (not fin or sent[i] < positions[i].end):  # a finish sending less: a stop string cut
                        due = bisect.bisect_left([at for at, _ in waiting[i]], sent[i])
                    lps = self._token_logprobs(waiting[i][:due]) if due else None
                    waiting[i] = [] if fin else waiting[i][due:]
                if outputs:
                    fields = outputs[i].add(delta)
                    if fin:
                        fields = merge_deltas(fields, outputs[i].finish())
                        fin = outputs[i].finish_reason(fin)
                    elif not fields and lps is None:
                        continue  # all held back (a tag may be starting): nothing to send yet
                    elif fin is None and lps is None and len(fields) == 1 and _TEXT_FIELDS.intersection(fields):
                        field, text = next(iter(fields.items()))
                        chunk.append(plain(i, text, field))
                        continue
                    choice = {"index": i, "delta": fields}
                elif fin is None and lps is None:
                    chunk.append(plain(i, delta))
                    continue
                elif self.chat:
                    choice = {"index": i, "delta": {"content": delta} if delta or not fin else {}}
                else:
                    choice = {"index": i, "text": delta}
                chunk.append(event({**choice, "logprobs": lps, "finish_reason": fin}))
            if chunk:
                yield "".join(chunk)
        if include_usage:
            yield self._sse(kind, [], usage=self._usage(sum(produced), [sum(c) for c in cached]))
        yield "data: [DONE]\n\n"

    def _token_logprobs(self, tokens: List[tuple]) -> dict:
        """The logprobs object of ``tokens``, (offset, event) each."""
        ids = [ev.token_id for _, ev in tokens]
        lps = [ev.logprob for _, ev in tokens]
        tops = [ev.top_logprobs for _, ev in tokens]
        if self.chat:
            return self.logprobs.chat(ids, lps, tops)
        parts = [self.logprobs.completion([t], [lp], [top], at) for t, lp, top, (at, _) in zip(ids, lps, tops, tokens)]
        return {key: [x for p in parts for x in p[key]] for key in parts[0]}

    def _choice_usage(self, i: int, produced: List[int]) -> dict:
        """Choice ``i``'s usage so far (``produced``: tokens per choice), as vLLM's continuous usage stats give it."""
        prompt_tokens = len(self.prompts[i // self.n])
        return {"prompt_tokens": prompt_tokens, "completion_tokens": produced[i],
                "total_tokens": prompt_tokens + produced[i]}  # fmt: skip

    def _usage_chunk(self, event: Callable[[dict], str]) -> Callable[..., str]:
        """``_plain_chunk``'s signature, each event made by ``event`` (which adds the usage)."""
        if not self.chat:
            return lambda i, delta: event({"index": i, "text": delta, "logprobs": None, "finish_reason": None})
        return lambda i, delta, field="content": event({"index": i, "delta": {field: delta}, "logprobs": None,
                                                        "finish_reason": None})  # fmt: skip

    def _plain_chunk(self, kind: str) -> Callable[..., str]:
        """``(choice index, text delta[, chat delta field]) -> event`` of a token without logprobs that does not finish
        its choice (the hot path: one per token), formatted directly: ``_sse``'s text for that choice, character for
        character. ``field`` (chat): "content", or "reasoning_content" (one of ``_TEXT_FIELDS``)."""
        pre = self._sse_head(kind) + '{"index": '
        post = ', "logprobs": null, "finish_reason": null}]}\n\n'
        if not self.chat:
            return lambda i, delta: f'{pre}{int(i)}, "text": {json_str(delta)}{post}'
        mids = {field: f', "delta": {{"{field}": ' for field in _TEXT_FIELDS}
        return lambda i, delta, field="content": f"{pre}{int(i)}{mids[field]}{json_str(delta)}}}{post}"

    def _sse_head(self, kind: str) -> str:
        """An event's text up to its choices' first one: ``_sse``'s, ``json.dumps``'s formatting."""
        return (f'data: {{"id": {json.dumps(self.id)}, "object": {json.dumps(kind)}, "created": {int(self.created)}, '
                f'"model": {json.dumps(self.server.model_name)}, "choices": [')  # fmt: skip

    def _sse(self, kind: str, choices: list, usage: Optional[dict] = None) -> str:
        """``data: `` and the JSON of {id, object, created, model, choices, usage (when given)}."""
        text = self._sse_head(kind) + json.dumps(choices)[1:]  # the head opened the list
        if usage is not None:
            text += ', "usage": ' + json.dumps(usage)
        return text + "}\n\n"
