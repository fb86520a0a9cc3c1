"""Incremental detokenization: the text a growing list of token ids adds, one delta per step; and stop
strings cut on that streamed text.

Decoding every id so far at every step costs O(n) per token, O(n^2) per request, on the thread that also
serves HTTP. Each step here decodes a short window instead: the ids emitted last time (kept as context, since
a token's text can depend on its neighbours) plus the new ones, and emits what the window adds beyond the
text of its already-emitted part. Text ending in an incomplete UTF-8 sequence (U+FFFD) is held back until a
later id completes it; :meth:`IncrementalDetokenizer.finish` emits whatever is left.
"""

from typing import List, Tuple


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
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

    def _decode(self, ids: List[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _advance(self, final: bool) -> str:
        if self._emitted == len(self.ids):
            return ""
        done = self._decode(self.ids[self._start : self._emitted])
        window = self._decode(self.ids[self._start :])
        if not final and (len(window) <= len(done) or window.endswith("\ufffd")):
            return ""
        self._start, self._emitted = self._emitted, len(self.ids)
        return window[len(done) :]


class StopStrings:
    """Cuts streamed text at the first stop string. Text that could be the start of one is held back until
    the next delta shows whether it is, so no part of a stop string is ever emitted."""

    def __init__(self, stops: List[str]):
        self.stops = stops
        self._held = ""

    def cut(self, delta: str, final: bool = False) -> Tuple[str, bool]:
        """What can be emitted now, and whether a stop string was found (the text ends before it)."""
        if not self.stops:
            return delta, False
        text, self._held = self._held + delta, ""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            return text[: min(found)], True
        hold = 0 if final else max(self._prefix_at_end(text, s) for s in self.stops)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    @staticmethod
    def _prefix_at_end(text: str, stop: str) -> int:
        """Length of the longest proper prefix of ``stop`` that ``text`` ends with."""
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                return k
        return 0
