"""The scheduling policy: who is prefilled, who decodes, who is preempted, who is finished. It only decides;
the KV cache is asked through its verbs (``can_allocate``, ``has_free_slot``) and changed only through the
runner's ``add_request`` and ``free`` (broadcast under tensor parallelism).

Prefill first: waiting requests are admitted, oldest first, while request slots, the prefill token budget and
free KV allow. Otherwise every running request decodes; when the KV cache can't hold the next token of each,
the newest is preempted: its KV is freed and it waits, first in line, to be re-prefilled with what it has
generated so far.
"""

import logging
from collections import deque
from typing import Deque, Dict, Iterable, List, Optional, Tuple

from lightllm.engine.request import Request
from lightllm.engine.runner import Runner

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: Runner, eos_token_ids: Iterable[int]):
        self.runner = runner
        self.args = runner.args
        self.eos = set(eos_token_ids)
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        if self.args.batch_max_tokens < self.args.max_req_total_len:
            logger.info("batch_max_tokens %d < max_req_total_len %d: a longer prompt is prefilled alone and whole, "
                        "over the budget, in one step (there is no chunked prefill yet)", self.args.batch_max_tokens,
                        self.args.max_req_total_len)  # fmt: skip

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, reasons: Dict[str, str]) -> List[Tuple[Request, str]]:
        """Take the requests named in ``reasons`` out, running ones first: (request, reason) for each found."""
        gone = [r for r in self.running if r.id in reasons] + [r for r in self.waiting if r.id in reasons]
        self.running = [r for r in self.running if r.id not in reasons]
        self.waiting = deque(r for r in self.waiting if r.id not in reasons)
        return [(r, reasons[r.id]) for r in gone]

    def remove_all(self) -> List[Request]:
        gone = self.running + list(self.waiting)
        self.running, self.waiting = [], deque()
        return gone

    def schedule(self) -> Tuple[str, List[Request]]:
        """("prefill", newly admitted requests, each given a slot), ("decode", the running requests) or
        ("idle", []). The prefill batch is in neither list until ``update``."""
        batch = self._admit()
        if batch:
            return "prefill", batch
        while self.running and not self.runner.kv.can_allocate(len(self.running)):
            self._preempt(self.running.pop())
        return ("decode", list(self.running)) if self.running else ("idle", [])

    def update(self, kind: str, alive: List[Request]) -> None:
        """After a step of ``kind``: ``alive`` are its requests that go on."""
        self.running = self.running + alive if kind == "prefill" else alive

    def finish_reason(self, req: Request, token_id: int) -> Optional[str]:
        """Why ``req`` ends with ``token_id`` just appended, or None when it goes on."""
        p = req.params
        if (token_id in self.eos and not p.ignore_eos) or token_id in p.stop_token_ids:
            return "stop"
        n = len(req.output_ids)  # not len(req.context): that builds the whole list, every token
        if n >= p.max_new_tokens or len(req.prompt_ids) + n >= self.args.max_req_total_len:
            return "length"
        return None

    def release(self, req: Request) -> None:
        """Free ``req``'s KV slot, if it holds one."""
        if req.slot >= 0:
            slot, req.slot = req.slot, -1
            self.runner.free(slot)

    def _admit(self) -> List[Request]:
        batch, budget = [], self.args.batch_max_tokens
        planned = len(self.running)  # one token per running request for its next step
        kv = self.runner.kv
        while self.waiting and len(self.running) + len(batch) < self.args.running_max_req_size:
            need = len(self.waiting[0].context)
            if (batch and need > budget) or not kv.can_allocate(planned + need + 1) or not kv.has_free_slot():
                break
            req = self.waiting.popleft()
            req.slot = self.runner.add_request()
            budget -= need
            planned += need + 1
            batch.append(req)
        return batch

    def _preempt(self, req: Request) -> None:
        logger.info("KV cache full: preempting request %s (%d tokens), it will be re-prefilled", req.id,
                    len(req.context))  # fmt: skip
        self.release(req)
        self.waiting.appendleft(req)
