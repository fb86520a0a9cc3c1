"""Batched logit changes before the draw: ``logit_bias``, ``min_tokens`` and the repetition, frequency and
presence penalties, for every request of a step at once, on the logits' device.

Per-request state lives in device tables with one row per request that uses any of these (a row is handed out
at its first draw and returned when it ends; it survives preemption): how often it generated each token
(``counts``, updated by one scatter per step from the drawn tokens, never rebuilt from the token lists), which
tokens its prompt holds, its bias, the tokens ``min_tokens`` holds back, and its settings. A table is made the
first time a request needs it (``rows x vocab`` cells each). A step gathers its rows and runs a few elementwise
ops over ``[rows, vocab]``; a step without such a request costs one attribute check per request and nothing on
the device.
"""

from typing import Dict, Iterable, List, Optional, Sequence

import torch

from lightllm.common.transfer import host_to_device
from lightllm.engine.request import Request

# Columns of the settings table, one row per request.
_REP, _FREQ, _PRES, _MIN, _GENERATED = range(5)


class LogitsProcessor:
    def __init__(self, vocab_size: int, device: torch.device, eos_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_ids = sorted(t for t in eos_ids if 0 <= t < vocab_size)
        self.capacity = 0
        self._free: List[int] = []
        self._tables: Dict[str, torch.Tensor] = {}

    @property
    def rows_in_use(self) -> int:
        return self.capacity - len(self._free)

    def apply(
        self, logits: torch.Tensor, reqs: Sequence[Request], pending: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``logits [len(reqs), vocab]`` changed for the requests that ask for it: a new tensor, or ``logits``
        itself when none does. ``pending [len(reqs), k]`` (optional): token ids each request is taken to have
        generated after what was recorded (MTP: the drafts before a verify position), counted by the penalties and
        ``min_tokens`` as recorded ones are; the tables are not changed."""
        picked = [i for i, r in enumerate(reqs) if r.params.processes_logits]
        if not picked:
            return logits
        for i in picked:
            if reqs[i].sampling_row < 0:
                self._start(reqs[i])
        params = [reqs[i].params for i in picked]
        rows = host_to_device([reqs[i].sampling_row for i in picked], torch.int64, self.device)
        where = host_to_device(picked, torch.int64, logits.device)
        x = logits.index_select(0, where)
        settings = self._tables["settings"].index_select(0, rows)
        ahead = 0 if pending is None else pending.shape[1]
        if any(p.logit_bias for p in params):
            x += self._tables["bias"].index_select(0, rows)
        blocked = self._tables.get("blocked")  # made by the first request with min_tokens and a token to hold back
        if blocked is not None and any(p.min_tokens for p in params):
            early = settings[:, _GENERATED] + ahead < settings[:, _MIN]
            x.masked_fill_(blocked.index_select(0, rows) & early[:, None], float("-inf"))
        repetition = any(p.repetition_penalty != 1 for p in params)
        additive = any(p.frequency_penalty or p.presence_penalty for p in params)
        if repetition or additive:
            counts = self._tables["counts"].index_select(0, rows)
            if ahead:
                ids = pending.index_select(0, where).to(self.device)
                counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=counts.dtype, device=self.device))
            seen = counts > 0
            if repetition:  # positive logits divided by the penalty, negative ones multiplied
                rep = settings[:, _REP, None]
                factor = torch.where(x > 0, rep.reciprocal(), rep)
                x = torch.where(seen | self._tables["in_prompt"].index_select(0, rows), x * factor, x)
            if additive:
                x -= settings[:, _FREQ, None] * counts + settings[:, _PRES, None] * seen
        return logits.index_copy(0, where, x)

    def record(self, reqs: Sequence[Request], tokens: torch.Tensor) -> None:
        """After the draw: ``tokens[i]`` was generated for ``reqs[i]``."""
        picked = [i for i, r in enumerate(reqs) if r.sampling_row >= 0]
        if not picked:
            return
        rows = host_to_device([reqs[i].sampling_row for i in picked], torch.int64, self.device)
        self._count(rows, tokens.index_select(0, host_to_device(picked, torch.int64, tokens.device)).to(self.device))

    def record_many(self, reqs: Sequence[Request], emitted: Sequence[Sequence[int]]) -> None:
        """After a step that can emit several tokens per request (MTP): ``emitted[i]`` were generated for
        ``reqs[i]``, in order."""
        picked = [i for i, r in enumerate(reqs) if r.sampling_row >= 0 and emitted[i]]
        if not picked:
            return
        rows = [reqs[i].sampling_row for i in picked for _ in emitted[i]]
        tokens = [t for i in picked for t in emitted[i]]
        self._count(host_to_device(rows, torch.int64, self.device), host_to_device(tokens, torch.int64, self.device))

    def _count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """One generated token per entry: ``tokens[j]`` for table row ``rows[j]`` (rows may repeat)."""
        ones = torch.ones(rows.shape, dtype=torch.float32, device=self.device)
        self._tables["settings"].index_put_((rows, torch.full_like(rows, _GENERATED)), ones, accumulate=True)
        if "counts" in self._tables:
            self._tables["counts"].index_put_((rows, tokens), ones, accumulate=True)

    def release(self, req: Request) -> None:
        """``req`` has ended: its row is free for another request."""
        if req.sampling_row >= 0:
            self._free.append(req.sampling_row)
            req.sampling_row = -1

    def _start(self, req: Request) -> None:
        """Give ``req`` a row and fill it: its settings, prompt tokens, bias and held-back tokens."""
        if not self._free:
            self._grow(max(8, 2 * self.capacity))
        row = self._free.pop()
        try:
            self._fill(row, req)
        except BaseException:
            # Not the request's until filled: a half-set row would let its one-by-one retry skip the setup and go
            # on without its bias or penalties; this way the retry raises again and the request ends "error".
            self._free.append(row)
            raise
        req.sampling_row = row

    def _fill(self, row: int, req: Request) -> None:
        p = req.params
        for table in self._tables.values():
            table[row] = 0
        settings = [p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_tokens, len(req.output_ids)]
        self._table("settings", torch.float32, 5)[row] = host_to_device(settings, torch.float32, self.device)
        if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty:
            counts = self._table("counts", torch.float32)  # float: used as is by the penalties; exact to 2**24
            in_prompt = self._table("in_prompt", torch.bool)
            in_prompt[row].index_fill_(0, self._ids(req.prompt_ids), True)  # `[row, ids] = True` copies a CPU True
            # A request handed in with tokens already generated (never the engine's: its rows outlive preemption).
            if req.output_ids:  # not bincount, whose size reads the device
                ones = torch.ones(len(req.output_ids), dtype=torch.float32, device=self.device)
                counts[row].index_put_((self._ids(req.output_ids),), ones, accumulate=True)
        if p.logit_bias:
            bias = self._table("bias", torch.float32)
            values = host_to_device([float(v) for v in p.logit_bias.values()], torch.float32, self.device)
            bias[row, self._ids(list(p.logit_bias))] = values
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)  # with ignore_eos, EOS ends nothing
        if p.min_tokens and stops:
            self._table("blocked", torch.bool)[row].index_fill_(0, self._ids(stops), True)

    def _ids(self, ids: List[int]) -> torch.Tensor:  # without a sync: a step's GPU timer may be running
        return host_to_device(list(ids), torch.int64, self.device)

    def _table(self, name: str, dtype: torch.dtype, width: Optional[int] = None) -> torch.Tensor:
        if name not in self._tables:
            self._tables[name] = torch.zeros(self.capacity, width or self.vocab_size, dtype=dtype, device=self.device)
        return self._tables[name]

    def _grow(self, capacity: int) -> None:
        for name, old in self._tables.items():
            new = old.new_zeros(capacity, old.shape[1])
            new[: old.shape[0]] = old
            self._tables[name] = new
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity
