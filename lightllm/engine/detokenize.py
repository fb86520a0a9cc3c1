"""Incremental detokenization: the text a growing list of token ids adds, one delta per step; and stop
strings cut on that streamed text.

Decoding every id so far at every step costs O(n) per token, O(n^2) per request, on the thread that also
serves HTTP. Each step here decodes a short window instead: the ids emitted last time (kept as context, since
a token's text can depend on its neighbours) plus the new ones, and emits what the window adds beyond the
text of its already-emitted part. Text ending in an incomplete UTF-8 sequence (U+FFFD) is held back until a
later id completes it, for up to ``MAX_HELD_TOKENS`` ids (then the text before the last few is emitted, so a
stream of stray bytes keeps its window short); :meth:`IncrementalDetokenizer.finish` emits whatever is left.

``tokenizers.decoders.DecodeStream`` (tokenizers 0.23) was tried behind this interface and not adopted: it
has no way to flush, so text ending in an incomplete UTF-8 sequence is never emitted. A full decode ends such
text with U+FFFD, so ``test_random_ids_special_tokens_included`` fails for 10 of its 20 seeds (the streamed
text lacks the final one or two U+FFFD).

:class:`TextStream` puts the two together for one request; the server and ``LLM`` both use it, so stop strings
end a request the same way offline and served.
"""

import functools
import weakref
from typing import Callable, Collection, Dict, FrozenSet, List, Sequence, Tuple

# Per request: their cost per token is O(count x length), paid on the HTTP event loop.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_HELD_TOKENS = 8  # tokens held back for an incomplete character before the text before them is emitted
_UTF8_TAIL_BYTES = 3  # an incomplete UTF-8 character at the end: at most 3 bytes
_MAX_CUT_TRIES = 8  # cut positions tried per token, from the latest one back
# transformers' modules whose ``_decode`` is the Rust backend's decode plus an optional space clean-up (v5, v4)
_GENERIC_DECODE = ("transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast")


def _backend(tokenizer):
    """The Rust tokenizer when ``tokenizer.decode`` is its decode and nothing more (a fast tokenizer whose class keeps
    transformers' own ``decode`` and ``_decode``, no space clean-up), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    impl = getattr(type(tokenizer), "_decode", None)
    outer = getattr(type(tokenizer), "decode", None)
    direct = (backend is not None and getattr(impl, "__module__", None) in _GENERIC_DECODE
              and getattr(outer, "__module__", None) in _GENERIC_DECODE + ("transformers.tokenization_utils_base",)
              and not getattr(tokenizer, "clean_up_tokenization_spaces", False))  # fmt: skip
    return backend if direct else None


def decoder(tokenizer, skip_special_tokens: bool) -> Callable[[List[int]], str]:
    """``tokenizer.decode`` for lists of ids, called on the Rust backend directly where that is all it does: the
    same text for a third of the cost (benchmarks/stream_host_cost.py)."""
    backend = _backend(tokenizer)
    return functools.partial((backend or tokenizer).decode, skip_special_tokens=skip_special_tokens)


def pieces_join(tokenizer) -> bool:
    """Whether the text of two ids is the text of one then the other's wherever neither holds an incomplete
    character: a byte-level BPE's decoder (GPT-2's, Qwen's) turns the ids into bytes and decodes them together, so
    complete pieces just join. Not so for others: SentencePiece's drops the space of a text's first word."""
    from tokenizers import decoders

    backend = _backend(tokenizer)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


# tokenizer -> {skip_special_tokens: {token id: its text alone}}, shared by every stream of that tokenizer
_PIECES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _pieces(tokenizer, skip_special_tokens: bool) -> Dict[int, str]:
    """The texts of single ids decoded so far for ``tokenizer`` (a stream's previous token is the next step's
    emitted part, so this is half of a stream's decoding). At most one entry per id the model can emit."""
    try:
        per_tokenizer = _PIECES.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable (or not hashable): a cache of this stream's own
        return {}
    return per_tokenizer.setdefault(skip_special_tokens, {})


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._decode = decoder(tokenizer, skip_special_tokens)
        self._pieces = _pieces(tokenizer, skip_special_tokens)
        self._joins = pieces_join(tokenizer)
        self.ids: List[int] = []
        self._start = 0  # the window starts here: context for the ids after _emitted
        self._emitted = 0  # ids before this have had their text emitted

    def add(self, token_id: int) -> str:
        """The text ``token_id`` completes ('' while it is held back)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """Whatever is still held back, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        ids, start, emitted = self.ids, self._start, self._emitted
        if emitted == len(ids):
            return ""
        if self._joins and len(ids) == emitted + 1 and emitted - start <= 1:
            # a stream that keeps up: one new id after the one emitted last; no decoding where both texts are whole
            new = self._piece(ids[emitted])
            if new and "\ufffd" not in new and (start == emitted or "\ufffd" not in self._piece(ids[start])):
                self._start, self._emitted = emitted, emitted + 1
                return new
        done, window = self._text(start, emitted), self._text(start, len(ids))
        if final or (len(window) > len(done) and not window.endswith("\ufffd")):
            self._start, self._emitted = self._emitted, len(self.ids)
            return window[len(done) :]
        if len(self.ids) - self._emitted <= MAX_HELD_TOKENS:
            return ""
        # Held back for long: a model emitting stray bytes (text that keeps ending in U+FFFD) or tokens with no text
        # (skipped special tokens, ids past the vocabulary). Waiting on would grow the window, and the decoding per
        # token, without bound. Only an incomplete character at the end can still change: at most 3 bytes, so in the
        # last 3 ids that carry text (ids with none can sit between its bytes). The text up to a cut before them is
        # final where it is a prefix of the window's and the ids after the cut decode to the rest of it: a cut inside an
        # invalid byte run (a lead byte's U+FFFD alone looks like the whole run's) would decode the run's continuation
        # bytes apart later, one U+FFFD each. A character straddling the cut moves it a few ids back.
        cut, carrying = len(self.ids), 0  # before the 3rd last id with text (the first one, if fewer; all, if none)
        for i in range(len(self.ids) - 1, self._emitted - 1, -1):
            if self._piece(self.ids[i]):
                cut, carrying = i, carrying + 1
                if carrying == _UTF8_TAIL_BYTES:
                    break
        for cut in range(cut, max(self._emitted, cut - _MAX_CUT_TRIES), -1):
            text = self._decode(self.ids[self._start : cut])
            if text.startswith(done) and window.startswith(text) and text + self._decode(self.ids[cut:]) == window:
                self._start, self._emitted = self._emitted, cut
                return text[len(done) :]
        return ""

    def _text(self, lo: int, hi: int) -> str:
        """The text of ``ids[lo:hi]``; a single id's is decoded once per id of the vocabulary."""
        if hi - lo == 1:
            return self._piece(self.ids[lo])
        return self._decode(self.ids[lo:hi]) if hi > lo else ""

    def _piece(self, token_id: int) -> str:
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self._decode([token_id])
        return text


def check_stop_strings(stops: List[str]) -> None:
    """``ValueError`` naming the limit when there are too many stop strings, or one is empty or too long."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for s in stops:
        if not s:
            raise ValueError("stop: expected non-empty strings")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop: at most {MAX_STOP_CHARS} characters per string, got one of {len(s)}")


class StopStrings:
    """Cuts streamed text at the first stop string. Text that could be the start of one is held back until
    the next delta shows whether it is, so no part of a stop string is ever emitted.

    Matching is incremental: each delta is searched together with what is held back, which is shorter than
    the longest stop string, so the work per delta does not grow with the text streamed so far."""

    def __init__(self, stops: List[str], include: bool = False):
        self.stops = stops
        self.include = include  # the text ends after the stop string found, not before it (vLLM's option)
        self._longest = max((len(s) for s in stops), default=0)
        self._firsts = {s[0] for s in stops}
        self._held = ""
        self.scanned = 0  # characters searched so far

    def cut(self, delta: str, final: bool = False) -> Tuple[str, bool]:
        """What can be emitted now, and whether a stop string was found (the text ends before it)."""
        if not self.stops:
            return delta, False
        text, self._held = self._held + delta, ""
        self.scanned += len(text)
        found = [(i + len(s), i) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if found:
            # the first stop string to be complete (the longest of those ending there), whatever the tokens' split
            end, at = min(found)
            return text[: end if self.include else at], True
        hold = 0 if final else self._partial_at_end(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def _partial_at_end(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of a stop string (it is in the last
        longest - 1 characters, and starts with a stop string's first character)."""
        for i in range(max(0, len(text) - self._longest + 1), len(text)):
            if text[i] in self._firsts:
                tail = text[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                    return len(tail)
        return 0


class TextStream:
    """One request's text as its tokens arrive, cut at its first stop string. ``tokenizer`` None: no text is
    produced (every delta is ''), for a caller that decodes once at the end and has no stop strings.

    ``params`` (``SamplingParams``) chooses the text as vLLM's same-named options do: ``skip_special_tokens`` (a special
    token's text is left out), ``include_stop_str_in_output`` (the stop string found, or the text of the token that
    stopped the request, ends the text; by default neither is in it). ``stop_ids``: the token ids that end the request
    (its end-of-sequence ids unless ``ignore_eos``, and its ``stop_token_ids``): such a token is the request's last
    once it has ``min_tokens`` tokens. Stop strings, as vLLM's, are looked for only in the text of the tokens after
    the first ``min_tokens``."""

    def __init__(self, tokenizer, params, stop_ids: Collection[int] = ()):
        skip = params.skip_special_tokens
        self._detok = IncrementalDetokenizer(tokenizer, skip) if tokenizer is not None else None
        self._stops = StopStrings(list(params.stop), params.include_stop_str_in_output)
        self._stop_ids = () if params.include_stop_str_in_output else stop_ids
        self._min_tokens, self._tokens = params.min_tokens, 0

    def add(self, token_id: int) -> Tuple[str, bool]:
        """The text ``token_id`` adds, and whether a stop string ended it (the request is then over: abort it
        with "stop")."""
        self._tokens += 1
        if self._detok is None:
            return self._stops.cut("")
        if token_id in self._stop_ids and self._tokens >= self._min_tokens:  # it ends the request (scheduler's rule)
            return self._stops.cut("")
        delta = self._detok.add(token_id)
        return (delta, False) if self._tokens <= self._min_tokens else self._stops.cut(delta)

    def finish(self, reason: str) -> Tuple[str, str]:
        """The text still held back, and the finish reason the client sees for the engine's ``reason``."""
        rest, hit = self._stops.cut(self._detok.finish() if self._detok else "", final=True)
        return rest, "stop" if hit else reason


def stop_ids(params, eos_ids: Collection[int]) -> FrozenSet[int]:
    """The token ids that end a request of ``params`` (the scheduler's rule): ``eos_ids`` unless ``ignore_eos``, and
    its ``stop_token_ids``."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))


def final_text(tokenizer, token_ids: Sequence[int], params, eos_ids: Collection[int]) -> str:
    """A whole generation's text decoded at once, as :class:`TextStream` streams it when there are no stop strings."""
    if token_ids and not params.include_stop_str_in_output and token_ids[-1] in stop_ids(params, eos_ids):
        token_ids = token_ids[:-1]
    return tokenizer.decode(list(token_ids), skip_special_tokens=params.skip_special_tokens)
