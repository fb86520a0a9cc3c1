"""The scheduling policy: who is prefilled (and how much of their prompt), who decodes, who is preempted, who is
finished. It only decides; the KV cache is asked through its verbs (``can_allocate``, ``has_free_slot``) and
changed only through the runner's ``add_request`` and ``free`` (broadcast under tensor parallelism).

Prefill first: a prefill step carries at most ``prefill_step_tokens`` prompt tokens: first the next chunk of the
requests being prefilled, then waiting requests, admitted oldest first while request slots and free KV allow (KV
for a request's whole remaining context must be free when it is admitted; it is allocated chunk by chunk). With
the prefix cache a request is admitted with the longest cached prefix of its context (all but its last token) in
its KV row already, and prefills only the rest. For a model with state beside the KV (Qwen3.5) a cached prefix is
usable only up to a state checkpoint; when the cached KV goes at least ``branch_min_tokens`` further (a shared system
prompt whose requests went on past it), a chunked prefill stops a chunk at that *branch* and the runner checkpoints
the state there, so the next request with that prefix reuses all of it. A request that shares at least that many more
tokens with one still being prefilled (``n`` samples of a prompt, a system prompt sent by several clients at once)
waits, keeping its place in line (the requests behind it may be admitted meanwhile), until that one has published
them (Qwen3.5: it stops a chunk where they part), and reads them.
With chunked prefill (the default) the last request of a step gets what is left of the budget and the rest of its
context waits for the next prefill step; in between, the running requests decode one step, so a long prompt never
stalls them for more than one chunk. Its first token is sampled after its last chunk. Without chunking a prompt
longer than the budget is prefilled whole, alone, over the budget.

With ``enable_mixed_chunk`` a prefill step that finds requests running carries their decode tokens too (a
"mixed" step: one forward, each running request a one-token chunk of its own context), so a chunk no longer costs
them a chunk step and a decode step; its prefill part gets the budget less one token per running request, and when
that is under half the budget the steps alternate as without it.

Otherwise every running request decodes; when the KV cache can't hold the next token of each, the newest request
is preempted (a partly prefilled one first): its KV is freed (the prefix cache keeps what it computed, evictable)
and it waits, first in line, to be re-prefilled with what it has generated so far.
"""

import logging
from collections import deque
from typing import Deque, Dict, Iterable, List, Optional, Tuple

from lightllm.common.kv_cache.radix_cache import common_prefix_len
from lightllm.engine.request import Request
from lightllm.engine.runner import Runner

logger = logging.getLogger(__name__)


# A branch checkpoint costs its request one more prefill step (its chunk stops there) and a checkpoint slot; under
# this many tokens past the last checkpoint the next requests' saving is about one step's fixed cost
BRANCH_MIN_TOKENS = 64


class Scheduler:
    def __init__(self, runner: Runner, eos_token_ids: Iterable[int]):
        self.runner = runner
        self.args = runner.args
        self.eos = set(eos_token_ids)
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.prefilling: List[Request] = []  # admitted, holding a slot, part of their context still to prefill
        # admitted by the prefill step under way, or whose last chunk it ran, and in no other list (until
        # ``update``): a step that raises before then must still leave them to ``fail_all``, or their slots and
        # prefix pins are never released and they never finish
        self.admitted: List[Request] = []
        self.chunked = not self.args.disable_chunked_prefill
        self.mixed = self.args.enable_mixed_chunk  # normalize refused it without chunking or with MTP
        self.step_tokens = self.args.prefill_step_tokens
        self.decode_tokens = self.args.spec_tokens  # KV tokens a decode step takes per request (MTP: N + 1)
        self.branch_min_tokens = BRANCH_MIN_TOKENS
        self.last_step = "idle"  # the kind of the last step scheduled: a chunk is followed by a decode step
        if not self.chunked and self.args.batch_max_tokens < self.args.max_req_total_len:
            logger.info("batch_max_tokens %d < max_req_total_len %d: with --disable_chunked_prefill a longer prompt "
                        "is prefilled alone and whole, over the budget, in one step", self.args.batch_max_tokens,
                        self.args.max_req_total_len)  # fmt: skip

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def requests(self) -> List[Request]:
        """Every request it holds: running, admitted by the step under way, being prefilled, waiting."""
        return self.running + self.admitted + self.prefilling + list(self.waiting)

    def remove(self, reasons: Dict[str, str]) -> List[Tuple[Request, str]]:
        """Take the requests named in ``reasons`` out, running ones first: (request, reason) for each found."""
        gone = [r for r in self.requests() if r.id in reasons]
        self.running = [r for r in self.running if r.id not in reasons]
        self.admitted = [r for r in self.admitted if r.id not in reasons]
        self.prefilling = [r for r in self.prefilling if r.id not in reasons]
        self.waiting = deque(r for r in self.waiting if r.id not in reasons)
        return [(r, reasons[r.id]) for r in gone]

    def remove_all(self) -> List[Request]:
        gone = self.requests()
        self.running, self.admitted, self.prefilling, self.waiting = [], [], [], deque()
        return gone

    def schedule(self) -> Tuple[str, List[Request]]:
        """("prefill", the requests of this prefill step, each with a slot and its ``chunk_end``), ("mixed", the
        running requests, each with a one-token chunk, then such a prefill batch), ("decode", the running requests)
        or ("idle", []). The prefill batch joins ``running`` at ``update``, once sampled."""
        if self.mixed and self.running and 2 * len(self.running) <= self.step_tokens:
            batch = self._prefill_batch(self.step_tokens - len(self.running))
            if batch:
                for req in self.running:  # the last token's KV is what the step adds
                    req.chunk_end = req.context_len
                    req.prefilled = req.chunk_end - 1
                self.last_step = "mixed"
                return "mixed", self.running + batch
        elif not (self.prefilling and self.running and self.last_step == "prefill"):  # else: decode between chunks
            batch = self._prefill_batch(self.step_tokens)
            if batch:
                self.last_step = "prefill"
                return "prefill", batch
        while self.running and not self.runner.kv.can_allocate(len(self.running) * self.decode_tokens):
            self._preempt(self.prefilling.pop() if self.prefilling else self.running.pop())
        if not self.running and self.prefilling:  # its next chunk does not fit and nothing else will free KV
            self._preempt(self.prefilling.pop())
            return self.schedule()
        self.last_step = "decode" if self.running else "idle"
        return ("decode", list(self.running)) if self.running else ("idle", [])

    def prefilled(self, batch: List[Request]) -> List[Request]:
        """After a prefill step ran: each request's prefill has reached its ``chunk_end``; the requests whose whole
        context is now in (to be sampled) are returned, the rest stay being prefilled."""
        for req in batch:
            req.prefilled = req.chunk_end
            if req.prefilled == req.context_len:  # a waiting request no longer compares its key with this one's
                req.key, req.key_of = None, -1
        partial = {id(r) for r in self.prefilling}
        self.prefilling += [r for r in batch if id(r) not in partial]
        self.prefilling = [r for r in self.prefilling if r.prefilled < r.context_len]
        done = [r for r in batch if r.prefilled == r.context_len]
        running = {id(r) for r in self.running}  # a mixed step's decode rows
        # Until ``update``: admitted now or by an earlier step (a last chunk), in no other list meanwhile
        self.admitted = [r for r in done if id(r) not in running]
        return done

    def update(self, kind: str, alive: List[Request]) -> None:
        """After a step of ``kind``: ``alive`` are its sampled requests that go on (a mixed step's hold every
        running request's)."""
        self.running = self.running + alive if kind == "prefill" else alive
        self.admitted = []

    def mixed_step_failed(self, batch: List[Request]) -> List[Request]:
        """A mixed step's forward raised: its running requests are preempted (their next token's KV slot is freed
        with the rest; the prefix cache keeps what earlier steps computed) and wait, first in line, to be
        re-prefilled; its prefill requests are returned, to fail."""
        running = {id(r) for r in self.running}
        for req in reversed(self.running):  # appendleft: the oldest ends up first
            self._preempt(req, "a mixed step failed")
        self.running = []
        return [r for r in batch if id(r) not in running]

    def finish_reason(self, req: Request, token_id: int) -> Optional[str]:
        """Why ``req`` ends with ``token_id`` just appended, or None when it goes on."""
        p = req.params
        stops = (token_id in self.eos and not p.ignore_eos) or token_id in p.stop_token_ids
        # before min_tokens never: the logits processor bans stop tokens then, but a row with every token banned (or
        # not finite) still yields one (vLLM's stop check also waits for min_tokens)
        if stops and len(req.output_ids) >= p.min_tokens:
            return "stop"
        return "length" if self.ends_by_length(req, len(req.output_ids)) else None

    def ends_by_length(self, req: Request, generated: int) -> bool:
        """Whether ``req`` ends once it has ``generated`` tokens: its ``max_new_tokens``, or ``max_req_total_len``
        (counted, not ``len(req.context)``: that builds the whole list, every token)."""
        return generated >= req.params.max_new_tokens or len(req.prompt_ids) + generated >= self.args.max_req_total_len

    def release(self, req: Request) -> None:
        """Free ``req``'s KV slot, if it holds one (its prefill starts over if it is admitted again)."""
        self.prefilling = [r for r in self.prefilling if r is not req]
        self.admitted = [r for r in self.admitted if r is not req]
        req.prefilled = req.chunk_end = 0
        req.key, req.key_of = None, -1
        if req.slot >= 0:
            slot, req.slot = req.slot, -1
            self.runner.free(slot, req.output_ids[-1] if req.output_ids else None)

    def can_admit(self) -> bool:
        """Whether a prefill step would admit the first waiting request now (a request slot and the KV for its
        context are free), without admitting it: overlapped decode reads the step in flight first only then."""
        holding = len(self.running) + len(self.prefilling)
        if not self.waiting or holding >= self.args.running_max_req_size:
            return False
        return self._fits(self.waiting[0], self._planned()) is not None

    def _planned(self) -> int:
        """KV already promised: the running requests' next tokens, the rest of each partly prefilled context."""
        return len(self.running) * self.decode_tokens + sum(
            r.context_len - r.prefilled + self.decode_tokens for r in self.prefilling
        )

    def _fits(self, req: Request, planned: int) -> Optional[Tuple[int, int, int]]:
        """(tokens of ``req``'s context the prefix cache holds, tokens left to compute, the branch: where a state
        checkpoint would extend the hit, 0 when none would) when a request slot and the KV for its whole context are
        free beside the ``planned`` tokens; else None."""
        kv = self.runner.kv
        if not kv.has_free_slot():  # first: the match below walks the whole context
            return None
        # the prefix cache's longest hit, one token short of the whole context: its logits are needed
        cached, evictable, branch = kv.match_prefix_with_branch(self._context_key(req))
        need = req.context_len - cached
        # pinning the hit takes its evictable tokens out of the free ones
        if not kv.can_allocate(planned + need + self.decode_tokens + evictable):
            return None
        return cached, need, branch

    def _context_key(self, req: Request) -> list:
        """``kv.context_key`` of ``req``'s context, kept while its context does not change: a request that waits for
        room is matched again at every step, and building a key walks the whole context."""
        if req.key_of != req.context_len:
            req.key, req.key_of = self.runner.kv.context_key(req.context), req.context_len
        return req.key

    def _prefill_batch(self, budget: int) -> List[Request]:
        batch, kv = [], self.runner.kv
        planned = self._planned()
        chunks = 0
        for req in self.prefilling:  # oldest first; their KV was free at admission, decodes may have taken it
            n = min(req.context_len - req.prefilled, budget)
            if req.prefilled < req.branch:  # the chunk stops at the branch: the runner checkpoints the state there
                n = min(n, req.branch - req.prefilled)
            if n <= 0 or not kv.can_allocate(len(self.running) * self.decode_tokens + chunks + n):
                break
            chunks += n
            req.chunk_end = req.prefilled + n
            budget -= n
            batch.append(req)
        holding = len(self.running) + len(self.prefilling)  # request slots in use
        passed = []  # waiting for a sibling in flight (``_wait_for_sibling``): they keep their place in line
        try:
            while self.waiting and budget > 0 and holding < self.args.running_max_req_size:
                req = self.waiting[0]
                fit = self._fits(req, planned)
                if fit is None:
                    break
                cached, need, branch = fit
                if not self.chunked and batch and need > budget:
                    break
                if self._wait_for_sibling(req, cached, batch):
                    passed.append(self.waiting.popleft())  # the requests behind it may be admitted meanwhile
                    continue
                req.slot = self.runner.add_request(self._context_key(req)[:cached])
                self.waiting.popleft()  # only once it holds a slot: a runner that raises leaves it for fail_all
                self.admitted.append(req)
                if req.num_cached_tokens is None:  # the first admission's hit is what the client's prompt saved
                    req.num_cached_tokens = min(cached, len(req.prompt_ids))
                req.prefilled = cached
                req.chunk_end = cached + (need if not self.chunked else min(need, budget))
                # chunked only: without it a prompt is prefilled whole, never left partly done for a checkpoint
                req.branch = branch if self.chunked and branch - cached >= self.branch_min_tokens else 0
                if req.branch:
                    req.chunk_end = min(req.chunk_end, req.branch)
                budget -= req.chunk_end - cached
                planned += need + self.decode_tokens
                batch.append(req)
                holding += 1
        finally:
            self.waiting.extendleft(reversed(passed))
        return batch

    def _wait_for_sibling(self, req: Request, cached: int, batch: List[Request]) -> bool:
        """Whether waiting ``req`` shares at least ``branch_min_tokens`` more of its prefix-cache key with a request
        still being prefilled (or admitted by this step) than the cache holds, before that one has computed them:
        ``n`` samples of one prompt, or a system prompt sent by several clients at once. Prefilling them together
        would compute the shared tokens once each; waiting, it reads them from the cache once that request
        publishes them (the same or the next prefill step). A model with state checkpoints (Qwen3.5) needs one where
        they part: that request's chunk stops there (its branch), this step's shortened if it would go past."""
        kv = self.runner.kv
        if not kv.caching or (kv.stateful and not self.chunked):  # nothing to read, or no chunk can stop there
            return False
        key, need = self._context_key(req), cached + self.branch_min_tokens
        if len(key) < need:
            return False
        in_batch = {id(r) for r in batch}
        for other in self.prefilling + [r for r in batch if r.slot >= 0]:
            if other.key is None or other.key_of != other.context_len:  # its key is kept while it prefills
                continue
            shared = common_prefix_len(key, other.key)
            if shared < need or other.prefilled >= shared:  # too little to gain, or computed (and published) already
                continue
            if kv.stateful:  # asked again each step it waits: a nearer branch is moved on once passed
                if not other.prefilled < other.branch <= shared:
                    other.branch = shared
                if id(other) in in_batch and other.chunk_end > other.branch:
                    other.chunk_end = other.branch
            return True
        return False

    def _preempt(self, req: Request, why: str = "KV cache full") -> None:
        logger.info("%s: preempting request %s (%d tokens), it will be re-prefilled", why, req.id,
                    req.context_len)  # fmt: skip
        self.release(req)
        self.waiting.appendleft(req)
