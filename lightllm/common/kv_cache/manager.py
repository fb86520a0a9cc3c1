"""KV cache bookkeeping for requests: request slots, their tokens and the req_to_token table.

No policy lives here (no admission, preemption or eviction): callers ask, the manager counts and refuses
with ``KVCacheFull`` when the pool is short.
"""

from typing import List, Sequence

import torch

from lightllm.common.kv_cache.allocator import ReqSlotAllocator, TokenAllocator, check_count
from lightllm.common.kv_cache.req_to_token import MAX_TOKEN_INDEX, ReqToTokenTable


class KVCacheManager:
    """Token pool of ``num_tokens`` slots shared by up to ``max_reqs`` requests of at most ``max_len`` tokens.

    The token indices each request holds are also kept on the CPU (one tensor per ``extend``), so freeing a
    request never reads the device table back.

    ``contiguous_slots=True`` gives slot ``r`` the fixed tokens ``r * max_len + [0, max_len)`` instead of
    tokens from the shared pool (``num_tokens`` must be ``max_reqs * max_len``): the layout of KV-cache
    kernels that address a request as one contiguous row (FA3 builds without paged KV, via
    ``cache_batch_idx``). Capacity is then reserved per request.
    """

    def __init__(self, num_tokens: int, max_reqs: int, max_len: int, device="cuda", contiguous_slots: bool = False):
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
        self._seq_lens = [0] * max_reqs
        self._held: List[List[torch.Tensor]] = [[] for _ in range(max_reqs)]
        self._held_decode: List[List[int]] = [[] for _ in range(max_reqs)]  # one token per decode step

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
        return self.tokens.num_free

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

    def add_request(self) -> int:
        """A fresh request slot of length 0; ``KVCacheFull`` if every slot is taken."""
        slot = self.slots.alloc()
        self._seq_lens[slot] = 0
        self._held[slot], self._held_decode[slot] = [], []
        return slot

    def extend(self, slot: int, n: int) -> torch.Tensor:
        """Allocate ``n`` tokens for ``slot`` and append them to its row of the table.

        Returns the new token indices (CPU int64 ``[n]``). Raises ``ValueError`` if ``slot`` is not allocated
        or the request would exceed ``max_len``, ``KVCacheFull`` if the pool has fewer than ``n`` free tokens;
        nothing changes in either case.
        """
        self.slots.check_allocated("KVCacheManager.extend", slot)
        check_count("KVCacheManager.extend", "n", n, 0)
        cur = self._seq_lens[slot]
        if cur + n > self.max_len:
            raise ValueError(
                f"KVCacheManager.extend: n expected <= {self.max_len - cur} (max_len {self.max_len}, "
                f"slot {slot} holds {cur}), got {n}"
            )
        if self.contiguous_slots:  # reserved with the slot: nothing to allocate
            token_idx = torch.arange(cur, cur + n, dtype=torch.int64) + slot * self.max_len
        else:
            token_idx = self.tokens.alloc(n)
        if n:
            self.req_to_token.write(slot, cur, token_idx)
            self._held[slot].append(token_idx)
            self._seq_lens[slot] = cur + n
        return token_idx

    def extend_each(self, slots: Sequence[int]) -> torch.Tensor:
        """One new token for each of ``slots`` (a decode step): one allocation and one table write for the
        whole batch instead of one per request. Same return value and errors as ``extend``."""
        for slot in slots:
            self.slots.check_allocated("KVCacheManager.extend_each", slot)
        if len(set(slots)) != len(slots):
            raise ValueError(f"KVCacheManager.extend_each: slots expected distinct, got {list(slots)}")
        positions = [self._seq_lens[s] for s in slots]
        full = [s for s, p in zip(slots, positions) if p + 1 > self.max_len]
        if full:
            raise ValueError(f"KVCacheManager.extend_each: slots {full} already hold max_len {self.max_len} tokens")
        if self.contiguous_slots:
            token_idx = torch.tensor([s * self.max_len + p for s, p in zip(slots, positions)], dtype=torch.int64)
        else:
            token_idx = self.tokens.alloc(len(slots))
        if not slots:
            return token_idx
        self.req_to_token.write_points(torch.tensor(slots), torch.tensor(positions), token_idx)
        for s, p, t in zip(slots, positions, token_idx.tolist()):
            self._held_decode[s].append(t)
            self._seq_lens[s] = p + 1
        return token_idx

    def free_request(self, slot: int) -> None:
        """Free ``slot`` and every token it holds."""
        self.slots.check_allocated("KVCacheManager.free_request", slot)
        if not self.contiguous_slots:
            held = self._held[slot] + ([torch.tensor(self._held_decode[slot])] if self._held_decode[slot] else [])
            if held:
                self.tokens.free(torch.cat(held))
        self._held[slot], self._held_decode[slot] = [], []
        self._seq_lens[slot] = 0
        self.slots.free(slot)

    def seq_len(self, slot: int) -> int:
        self.slots.check_allocated("KVCacheManager.seq_len", slot)
        return self._seq_lens[slot]
