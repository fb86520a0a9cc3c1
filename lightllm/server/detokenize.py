"""Incremental detokenization: the text a growing list of token ids adds, one delta per step.

Decoding every id so far at every step costs O(n) per token, O(n^2) per request, on the thread that also
serves HTTP. Each step here decodes a short window instead: the ids emitted last time (kept as context, since
a token's text can depend on its neighbours) plus the new ones, and emits what the window adds beyond the
text of its already-emitted part. Text ending in an incomplete UTF-8 sequence (U+FFFD) is held back until a
later id completes it; :meth:`IncrementalDetokenizer.finish` emits whatever is left.
"""

from typing import List


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
