"""KV cache bookkeeping for requests: request slots, their tokens and the req_to_token table.

No policy lives here (no admission or preemption): callers ask, the manager counts and refuses with ``KVCacheFull``
when the pool is short. With the prefix cache, slots the tree holds but no request pins count as free: an
allocation evicts them (least recently used first) when the free list runs short.
"""

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from lightllm.common.kv_cache.allocator import ReqSlotAllocator, TokenAllocator, check_count
from lightllm.common.kv_cache.radix_cache import RadixCache
from lightllm.common.kv_cache.req_to_token import MAX_TOKEN_INDEX, ReqToTokenTable


def next_token_keys(tokens: Sequence[int]) -> List[int]:
    """The prefix cache's keys of ``tokens`` when a slot's KV depends on the token after it too (MTP: the head's
    entry at position ``i`` reads ``t_{i + 1}``): one per token but the last, ``(t_i, t_{i+1})`` packed in one int
    (token ids are below 2**31), so two contexts share a slot only where they share the token after it as well."""
    if len(tokens) < 2:
        return []
    ids = np.asarray(tokens, dtype=np.int64)
    return ((ids[:-1] << 32) | ids[1:]).tolist()  # one vectorized pass, not a Python loop over the pairs


class KVCacheManager:
    """Token pool of ``num_tokens`` slots shared by up to ``max_reqs`` requests of at most ``max_len`` tokens.

    The token indices each request holds are also kept on the CPU (one tensor per ``extend``), so freeing a
    request never reads the device table back.

    ``contiguous_slots=True`` gives slot ``r`` the fixed tokens ``r * max_len + [0, max_len)`` instead of
    tokens from the shared pool (``num_tokens`` must be ``max_reqs * max_len``): the layout of KV-cache
    kernels that address a request as one contiguous row (FA3 builds without paged KV, via
    ``cache_batch_idx``). Capacity is then reserved per request.

    ``prefix_cache=True`` keeps finished requests' KV in a ``RadixCache`` (``prefix``): ``add_request(prefix)``
    starts a row with cached slots, ``computed`` records which token ids a row's KV now holds, and
    ``free_request`` hands those to the tree instead of the free list.

    ``state_checkpoints=C`` (with the prefix cache) is for a model with per-request state beside the KV (Qwen3.5's
    linear attention): a finished request leaves a checkpoint of its state after its computed tokens (one of ``C``
    ids, the least recently used given up when all are taken), and a prefix is cached only up to the deepest
    checkpoint on its path. The manager only counts: ``free_request`` and ``publish`` return the checkpoint id the
    caller must copy the row's state into, ``prefix_state`` the one ``add_request``'s prefix starts from.

    ``next_token_keys=True`` (MTP) keys each slot by its token and the one after it (``next_token_keys``): the
    caller books a slot as ``computed`` with that key once the slot's KV is whole, which may lag the row's length.
    ``context_key`` gives a context's key either way.

    ``publish(slot)`` puts a running row's computed tokens into the tree before it ends (the row pins them): after
    each prompt chunk, so a request admitted meanwhile reuses them (and, with checkpoints, the state there: after
    the prompt, a follow-up turn that repeats the prompt but not the answer still starts from it); and where its
    prefill stops at the *branch* (``match_prefix_with_branch``: a shared system prompt that a checkpoint does not
    cover yet), so the requests after it reuse the whole shared prefix.
    """

    def __init__(self, num_tokens: int, max_reqs: int, max_len: int, device="cuda", contiguous_slots: bool = False,
                 prefix_cache: bool = False, state_checkpoints: int = 0, next_token_keys: bool = False):  # fmt: skip
        check_count("KVCacheManager", "num_tokens", num_tokens, 1)
        if num_tokens - 1 > MAX_TOKEN_INDEX:
            raise ValueError(f"KVCacheManager: num_tokens expected <= {MAX_TOKEN_INDEX + 1} (int32), got {num_tokens}")
        self.tokens = TokenAllocator(num_tokens)
        self.slots = ReqSlotAllocator(max_reqs)
        self.req_to_token = ReqToTokenTable(max_reqs, max_len, device)
        self.max_len = max_len
        self.contiguous_slots = contiguous_slots
        if contiguous_slots and num_tokens != max_reqs * max_len:
            raise ValueError(
                f"KVCacheManager: num_tokens expected max_reqs * max_len = {max_reqs * max_len} with "
                f"contiguous_slots, got {num_tokens}"
            )
        if contiguous_slots and prefix_cache:
            raise ValueError("KVCacheManager: prefix_cache expected a shared token pool, got contiguous_slots")
        check_count("KVCacheManager", "state_checkpoints", state_checkpoints, 0)
        if state_checkpoints and not prefix_cache:
            raise ValueError(f"KVCacheManager: state_checkpoints expected 0 without the prefix cache, got "
                             f"{state_checkpoints}")  # fmt: skip
        self._free_states = list(range(state_checkpoints))[::-1]  # checkpoint ids no node holds (pop: lowest first)
        self.stateful = state_checkpoints > 0
        self.next_token_keys = next_token_keys
        self.prefix: Optional[RadixCache] = (
            RadixCache(self.tokens.free, self._free_states.append) if prefix_cache else None
        )
        self._ids: List[List[int]] = [[] for _ in range(max_reqs)]  # token ids whose KV each row holds (prefix cache)
        self._pins: list = [None] * max_reqs  # the tree node each row pinned (add_request, publish)
        # how many leading tokens of each row are the tree's slots, pinned by the row (its prefix, what it published)
        self._num_pinned = [0] * max_reqs
        self._seq_lens = [0] * max_reqs
        # A row's tokens in row order: ``_held`` (chunks, and decode tokens a later chunk came after), then
        # ``_held_decode`` (the decode steps' tokens since the last chunk, one int each)
        self._held: List[List[torch.Tensor]] = [[] for _ in range(max_reqs)]
        self._held_decode: List[List[int]] = [[] for _ in range(max_reqs)]
        self._last_extend = [False] * max_reqs  # whether the row's newest tokens came from ``extend`` (truncate)

    @property
    def table(self) -> torch.Tensor:
        """The int32 ``[max_reqs, max_len]`` req_to_token table."""
        return self.req_to_token.table

    @property
    def num_tokens(self) -> int:
        """The pool's capacity in tokens."""
        return self.tokens.num_tokens

    @property
    def num_free_tokens(self) -> int:
        if self.contiguous_slots:  # capacity left in free slots and behind each request's length
            return self.tokens.num_tokens - sum(self._seq_lens)
        return self.tokens.num_free + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def caching(self) -> bool:
        """Whether the prefix cache is on."""
        return self.prefix is not None

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` more tokens fit in the pool now."""
        return num_tokens <= self.num_free_tokens

    def has_free_slot(self) -> bool:
        return self.slots.num_free > 0

    def usage(self) -> float:
        """Fraction of the pool's tokens in use."""
        return 1 - self.num_free_tokens / self.num_tokens

    def context_key(self, context: Sequence[int]) -> List[int]:
        """The prefix cache's key of a request's context, one entry per slot a hit could cover: all of it but the
        last token (its logits must be computed), each token paired with the next one with ``next_token_keys``.
        ``match_prefix_with_branch`` takes it, and ``add_request`` its first ``cached`` entries."""
        return next_token_keys(context) if self.next_token_keys else list(context[:-1])

    def match_prefix(self, tokens: Sequence[int]) -> Tuple[int, int]:
        """(how many leading ``tokens`` the prefix cache holds, how many of those it could evict now); (0, 0)
        without the cache. Pinning them by ``add_request`` takes the second number out of the free tokens."""
        return self.prefix.match(tokens, self.stateful) if self.prefix else (0, 0)

    def match_prefix_with_branch(self, tokens: Sequence[int]) -> Tuple[int, int, int]:
        """``match_prefix(tokens)`` and, third, the *branch*: with state checkpoints, how many leading ``tokens``
        the tree's KV holds when that is more than the first number (the checkpoints stop short of it), else 0. A
        row whose prefill stops at the branch can leave a checkpoint there (``publish``), which makes the whole
        cached prefix usable to the next request that shares it."""
        if not self.stateful:
            return (*self.match_prefix(tokens), 0)
        cached, evictable, kv = self.prefix.match_with_branch(tokens)
        return cached, evictable, kv if kv > cached else 0

    def add_request(self, prefix: Sequence[int] = ()) -> int:
        """A fresh request slot whose row starts with the cached KV of ``prefix`` (pinned until ``free_request``);
        ``KVCacheFull`` if every slot is taken, ``ValueError`` if the cache does not hold all of ``prefix``."""
        if prefix and self.prefix is None:
            raise ValueError(f"KVCacheManager.add_request: prefix expected empty without the prefix cache, got "
                             f"{len(prefix)} tokens")  # fmt: skip
        if len(prefix) > self.max_len:
            raise ValueError(f"KVCacheManager.add_request: prefix expected <= max_len {self.max_len} tokens, got "
                             f"{len(prefix)}")  # fmt: skip
        slot = self.slots.alloc()
        self._held[slot], self._held_decode[slot], self._pins[slot] = [], [], None
        self._last_extend[slot] = False  # a pinned prefix is never truncated
        self._ids[slot], self._num_pinned[slot] = list(prefix), len(prefix)
        self._seq_lens[slot] = len(prefix)
        if prefix:
            try:
                if self.stateful and self.prefix.match(prefix, stateful=True)[0] != len(prefix):
                    raise ValueError(f"KVCacheManager.add_request: prefix expected to end at a state checkpoint "
                                     f"(match_prefix), got {len(prefix)} tokens")  # fmt: skip
                self._pins[slot], token_idx = self.prefix.pin(prefix)
                if self.stateful:  # a chunk's checkpoint a request starts from has earned its place
                    self._pins[slot].lasting = True
            except ValueError:
                self.slots.free(slot)
                raise
            self.req_to_token.write(slot, 0, token_idx)
            self._held[slot].append(token_idx)
        return slot

    def prefix_state(self, slot: int) -> Optional[int]:
        """The state checkpoint ``slot``'s cached prefix ends at; None without a prefix or without checkpoints.
        Read it right after ``add_request`` and copy it into the row's state then: the tree may give the id to
        another position at the next ``free_request`` (``RadixCache.evict_state``)."""
        self.slots.check_allocated("KVCacheManager.prefix_state", slot)
        pinned = self._pins[slot]
        return pinned.state if self.stateful and pinned is not None else None

    def computed_each(self, slots: Sequence[int], token_ids: Sequence[int]) -> None:
        """``computed(slots[i], (token_ids[i],))`` for each ``i``: a decode step's one token per request."""
        if self.prefix is not None:
            ids = self._ids
            for slot, token in zip(slots, token_ids):
                ids[slot].append(token)

    def computed(self, slot: int, token_ids: Sequence[int]) -> None:
        """The KV of ``token_ids``, the next tokens of ``slot``'s row, is written (its forward ran): they may go to
        the prefix cache when the request ends. A no-op without the cache."""
        if self.prefix is not None:
            self._ids[slot].extend(token_ids)

    def _alloc(self, n: int) -> torch.Tensor:
        short = n - self.tokens.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict(short)
        return self.tokens.alloc(n)

    def extend(self, slot: int, n: int) -> torch.Tensor:
        """Allocate ``n`` tokens for ``slot`` and append them to its row of the table.

        Returns the new token indices (CPU int64 ``[n]``). Raises ``ValueError`` if ``slot`` is not allocated
        or the request would exceed ``max_len``, ``KVCacheFull`` if the pool has fewer than ``n`` free tokens;
        nothing changes in either case.
        """
        return self._extend_rows("KVCacheManager.extend", [slot], [n])

    def _append_chunk(self, slot: int, token_idx: torch.Tensor) -> None:
        """Book ``token_idx`` (already in the table) as the row's next tokens, from an ``extend``."""
        if self._held_decode[slot]:  # a chunk after decode steps (a mixed step): keep the row's order
            self._held[slot].append(torch.tensor(self._held_decode[slot], dtype=torch.int64))
            self._held_decode[slot] = []
        self._held[slot].append(token_idx)
        self._seq_lens[slot] += token_idx.numel()
        self._last_extend[slot] = True

    def extend_many(self, slots: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        """``extend(slots[i], counts[i])`` for every ``i`` (a prefill step's requests): one allocation and one table
        write for the batch instead of one each. Returns the new token indices in that order (CPU int64). The same
        errors as ``extend``, checked for the whole batch before anything changes."""
        return self._extend_rows("KVCacheManager.extend_many", slots, counts)

    def _extend_rows(self, owner: str, slots: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        self.slots.check_allocated_each(owner, slots)
        if len(counts) != len(slots) or len(set(slots)) != len(slots):
            raise ValueError(f"{owner}: distinct slots and one count each expected, got slots {list(slots)} and "
                             f"counts {list(counts)}")  # fmt: skip
        starts = [self._seq_lens[slot] for slot in slots]
        for slot, cur, n in zip(slots, starts, counts):
            check_count(owner, "n", n, 0)
            if cur + n > self.max_len:
                raise ValueError(f"{owner}: n expected <= {self.max_len - cur} (max_len {self.max_len}, slot {slot} "
                                 f"holds {cur}), got {n}")  # fmt: skip
        positions = np.concatenate([np.arange(cur, cur + n) for cur, n in zip(starts, counts)] or [np.empty(0)])
        rows = np.repeat(np.asarray(slots, dtype=np.int64), counts)
        if self.contiguous_slots:  # reserved with the slot: nothing to allocate
            token_idx = torch.from_numpy(rows * self.max_len + positions.astype(np.int64))
        else:
            token_idx = self._alloc(int(sum(counts)))
        if token_idx.numel():
            self.req_to_token.write_points(rows, positions, token_idx)
        for slot, n, part in zip(slots, counts, torch.split(token_idx, list(counts))):
            if n:
                self._append_chunk(slot, part)
        return token_idx

    def extend_each(self, slots: Sequence[int], write_table: bool = True) -> torch.Tensor:
        """One new token for each of ``slots`` (a decode step): one allocation and one table write for the
        whole batch instead of one per request. Same return value and errors as ``extend``. ``write_table=False``:
        the caller writes the device table itself (``table[slot, seq_len - 1] = token``, from its staged copy)."""
        self.slots.check_allocated_each("KVCacheManager.extend_each", slots)
        if len(set(slots)) != len(slots):
            raise ValueError(f"KVCacheManager.extend_each: slots expected distinct, got {list(slots)}")
        seq_lens = self._seq_lens
        positions = [seq_lens[s] for s in slots]
        if positions and max(positions) >= self.max_len:
            full = [s for s, p in zip(slots, positions) if p >= self.max_len]
            raise ValueError(f"KVCacheManager.extend_each: slots {full} already hold max_len {self.max_len} tokens")
        if self.contiguous_slots:
            token_idx = torch.tensor([s * self.max_len + p for s, p in zip(slots, positions)], dtype=torch.int64)
        else:
            token_idx = self._alloc(len(slots))
        if not slots:
            return token_idx
        if write_table:
            self.req_to_token.write_points(slots, positions, token_idx)
        held, last_extend = self._held_decode, self._last_extend
        for s, p, t in zip(slots, positions, token_idx.tolist()):
            held[s].append(t)
            seq_lens[s] = p + 1
            last_extend[s] = False
        return token_idx

    def truncate(self, slot: int, n: int) -> None:
        """Drop the last ``n`` tokens of ``slot``'s row (MTP: the rejected drafts of a verify step), freeing
        their pool slots for reuse. They must come from the row's last ``extend`` (``ValueError`` otherwise, nothing
        changed); the prefix cache, if on, must not have been told they were ``computed``."""
        self._truncate_rows("KVCacheManager.truncate", [slot], [n])

    def truncate_many(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """``truncate(slots[i], counts[i])`` for every ``i`` (an MTP step's rejected drafts): one free of the pool
        for the batch instead of one per request (each is ~10 small CPU tensor ops: 64 requests dropping 3 tokens
        took 6.0 ms one by one and 0.75 ms at once on a busy 2-core CPU). The same errors as ``truncate``, checked
        for the whole batch before anything changes."""
        self._truncate_rows("KVCacheManager.truncate_many", slots, counts)

    def _truncate_rows(self, owner: str, slots: Sequence[int], counts: Sequence[int]) -> None:
        self.slots.check_allocated_each(owner, slots)
        if len(counts) != len(slots) or len(set(slots)) != len(slots):
            raise ValueError(f"{owner}: distinct slots and one count each expected, got slots {list(slots)} and "
                             f"counts {list(counts)}")  # fmt: skip
        tails = []
        for slot, n in zip(slots, counts):
            check_count(owner, "n", n, 0)
            if not n:
                continue
            last = self._held[slot][-1] if self._held[slot] and self._last_extend[slot] else None
            if last is None or len(last) < n:
                raise ValueError(f"{owner}: n expected <= the {0 if last is None else len(last)} tokens of slot "
                                 f"{slot}'s last extend, got {n}")  # fmt: skip
            tails.append((slot, n, last))
        if not tails:
            return
        if not self.contiguous_slots:
            self.tokens.free(torch.cat([last[len(last) - n :] for _, n, last in tails]))
        for slot, n, last in tails:
            self._held[slot][-1] = last[: len(last) - n]
            self._seq_lens[slot] -= n

    def free_request(self, slot: int) -> Optional[int]:
        """Free ``slot`` and every token it holds; with the prefix cache the tree keeps the computed ones (those it
        did not hold already) and the slot's pin is released. With state checkpoints: the id of the checkpoint now
        recorded after the row's computed tokens, which the caller must fill with the row's state before the row
        runs again (None when nothing was computed, the tree has a checkpoint there already, or the row's last
        forward did not return: it may have advanced some layers' state past its computed tokens)."""
        self.slots.check_allocated("KVCacheManager.free_request", slot)
        state = None
        if not self.contiguous_slots:
            token_idx = self._row_tokens(slot)
            if self.prefix is not None:
                token_idx, end = self._release_to_tree(slot, token_idx)
                settled = len(self._ids[slot]) == self._seq_lens[slot]  # else a forward raised after extend
                state = self.prefix.attach_at(end, self._take_state) if self.stateful and settled else None
            if token_idx.numel():
                self.tokens.free(token_idx)
        self._held[slot], self._held_decode[slot], self._ids[slot] = [], [], []
        self._seq_lens[slot] = 0
        self._last_extend[slot] = False
        self.slots.free(slot)
        return state

    def publish(self, slot: int, lasting: bool = True, state_at_computed: Optional[bool] = None) -> Optional[int]:
        """With the prefix cache, while ``slot``'s request runs: its computed tokens go into the tree now (the tree
        takes the pool slots of those it did not hold; for those it did, the row switches to the tree's slots and
        frees its own) and the row pins their whole path until ``free_request``, so a request admitted next reuses
        them; the pool's free count does not change. With state checkpoints: the id of a checkpoint now recorded
        after them, which the caller must fill with the row's state before the row runs again; ``lasting`` False
        for a chunk inside a prompt (its checkpoint is given up before those of prompts' ends, branches and
        requests' ends: ``RadixCache.evict_state``). None without the cache, with nothing computed, when the tree
        has a checkpoint there already or no id can be had, or when the row's state may not be the one after its
        computed tokens: ``state_at_computed`` None takes it to be exactly when they are all the row holds (else a
        forward raised after its extend, or, with ``next_token_keys``, a slot's key waits for the next token);
        True or False is the caller's word (MTP's draft step vouches for the state it has not advanced yet)."""
        self.slots.check_allocated("KVCacheManager.publish", slot)
        ids = self._ids[slot]
        if self.prefix is None or not ids:
            return None
        if state_at_computed is None:
            state_at_computed = len(ids) == self._seq_lens[slot]
        own, pinned = self._num_pinned[slot], self._pins[slot]
        token_idx = self._row_tokens(slot)
        # from the row's pinned node (the end of its first ``own`` tokens): each publish walks its new tokens only
        already, node, tree_slots = self.prefix.insert_after(pinned or self.prefix.root, ids[own:],
                                                             token_idx[own : len(ids)])  # fmt: skip
        self.prefix.pin_node(node)  # before the old pin goes: none of the path turns evictable
        if pinned is not None:
            self.prefix.unpin(pinned)
        self._pins[slot] = node
        if already:
            # The row computed tokens the tree held already (up to a branch): it reads the tree's slots from now
            # on and frees its own, so the pin it adds costs the pool nothing (what it pins was counted free)
            shared = tree_slots[:already]
            self.req_to_token.write(slot, own, shared)
            self._rewrite_row(slot, own, shared)
            self.tokens.free(token_idx[own : own + already])
        self._num_pinned[slot] = len(ids)
        if not (self.stateful and state_at_computed):
            return None
        return self.prefix.attach_at(node, self._take_state, lasting)

    def _rewrite_row(self, slot: int, start: int, token_idx: torch.Tensor) -> None:
        """The row's tokens at positions ``[start, start + len(token_idx))`` become ``token_idx`` (its chunks keep
        their bounds: ``truncate`` reads the last one)."""
        if self._held_decode[slot]:  # decode steps' tokens as one more chunk (the last extend stays what it was)
            self._held[slot].append(torch.tensor(self._held_decode[slot], dtype=torch.int64))
            self._held_decode[slot] = []
        pos, end, chunks = 0, start + token_idx.numel(), self._held[slot]
        for c, chunk in enumerate(chunks):
            a, b = max(start, pos), min(end, pos + chunk.numel())
            if a < b:
                chunks[c] = chunk.clone()  # a chunk may be a view of a whole step's allocation
                chunks[c][a - pos : b - pos] = token_idx[a - start : b - start]
            pos += chunk.numel()

    def _take_state(self) -> Optional[int]:
        """A free checkpoint id or, all taken, the least recently used node's."""
        return self._free_states.pop() if self._free_states else self.prefix.evict_state()

    def _row_tokens(self, slot: int) -> torch.Tensor:
        """The pool slots of the row's tokens, in row order (CPU int64)."""
        held = self._held[slot] + ([torch.tensor(self._held_decode[slot])] if self._held_decode[slot] else [])
        return torch.cat(held) if held else torch.empty(0, dtype=torch.int64)

    def _release_to_tree(self, slot: int, token_idx: torch.Tensor) -> Tuple[torch.Tensor, object]:
        """Insert the row's computed tokens into the tree (from its pinned node) and unpin its path: the slots left
        for the free list (those the tree already held under another slot, and any whose KV was never written), and
        the tree node where the computed tokens end."""
        ids, pinned, cached = self._ids[slot], self._pins[slot], self._num_pinned[slot]
        already, node, _ = self.prefix.insert_after(pinned or self.prefix.root, ids[cached:],
                                                    token_idx[cached : len(ids)])  # fmt: skip
        if pinned is not None:
            self.prefix.unpin(pinned)
            self._pins[slot] = None
        return torch.cat([token_idx[cached : cached + already], token_idx[len(ids) :]]), node

    def seq_len(self, slot: int) -> int:
        self.slots.check_allocated("KVCacheManager.seq_len", slot)
        return self._seq_lens[slot]

    def seq_lens(self, slots: Sequence[int]) -> List[int]:
        """``seq_len`` of each of ``slots``, checked in one pass."""
        self.slots.check_allocated_each("KVCacheManager.seq_lens", slots)
        lens = self._seq_lens
        return [lens[s] for s in slots]
