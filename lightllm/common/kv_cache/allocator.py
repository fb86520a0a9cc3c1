"""Bookkeeping of the KV pool: which token slots and which request slots are in use.

Only counting and handing out; deciding *who* gets memory (admission, preemption) is the scheduler's job.
Every check runs before any state changes, so a rejected call never corrupts the accounting.
"""

from typing import Sequence, Union

import numpy as np
import torch

IndexLike = Union[torch.Tensor, Sequence[int]]


class KVCacheFull(RuntimeError):
    """An allocator holds fewer free entries than were asked for."""


def check_count(owner: str, name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, else ``ValueError`` naming ``owner`` and ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}: {name} expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} expected an int >= {minimum}, got {value}")
    return value


class TokenAllocator:
    """Hands out token slots ``0 .. num_tokens-1`` of the KV pool.

    Free slots live in an int64 stack (``_free[:num_free]``, top at the end), so ``alloc`` and ``free`` are
    O(n) slices with no per-token Python loop. A boolean in-use mask rejects double and foreign frees. Both are numpy
    arrays: a step allocates tens of slots, where a torch op's dispatch costs more than its work (a request's
    bookkeeping in a full pool: 0.62 -> 0.45 ms, ``benchmarks/prefix_evict_cost.py``); callers get and give torch
    tensors.
    """

    def __init__(self, num_tokens: int):
        check_count("TokenAllocator", "num_tokens", num_tokens, 1)
        self.num_tokens = num_tokens
        # Reversed so that the first allocations come out as 0, 1, 2, ...
        self._free = np.arange(num_tokens - 1, -1, -1, dtype=np.int64)
        self._num_free = num_tokens
        self._in_use = np.zeros(num_tokens, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_tokens - self._num_free

    def can_alloc(self, n: int) -> bool:
        return check_count("TokenAllocator.can_alloc", "n", n, 0) <= self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` distinct free token indices as a CPU int64 tensor ``[n]``; raises ``KVCacheFull`` if short."""
        check_count("TokenAllocator.alloc", "n", n, 0)
        if n > self._num_free:
            raise KVCacheFull(
                f"TokenAllocator.alloc: asked for {n} tokens, only {self._num_free} of {self.num_tokens} are free"
            )
        top = self._num_free
        indices = self._free[top - n : top][::-1].copy()  # a copy: later pushes must not alias the result
        self._num_free = top - n
        self._in_use[indices] = True
        return torch.from_numpy(indices)

    def free(self, indices: IndexLike) -> None:
        """Return token indices (1-D, any device, any integer dtype) to the pool.

        Raises ``ValueError`` (and changes nothing) if an index is out of range, repeated in the call, or
        not currently allocated.
        """
        idx = _as_index_tensor("TokenAllocator.free", indices).numpy()
        if idx.size == 0:
            return
        ordered = np.sort(idx)
        lo, hi = int(ordered[0]), int(ordered[-1])
        if lo < 0 or hi >= self.num_tokens:
            raise ValueError(
                f"TokenAllocator.free: indices expected values in [0, {self.num_tokens}), got range [{lo}, {hi}]"
            )
        not_used = idx[~self._in_use[idx]]
        if not_used.size:
            raise ValueError(
                f"TokenAllocator.free: indices expected allocated tokens, got {not_used.size} that are free "
                f"(double free or never allocated), e.g. {not_used[:4].tolist()}"
            )
        if (ordered[1:] == ordered[:-1]).any():
            raise ValueError("TokenAllocator.free: indices expected distinct values, got repeats (double free)")
        top = self._num_free
        self._free[top : top + idx.size] = idx[::-1]  # freed in order, reallocated in the same order
        self._num_free = top + idx.size
        self._in_use[idx] = False


class ReqSlotAllocator:
    """Hands out request slots (rows of the req_to_token table) ``0 .. max_reqs-1``."""

    def __init__(self, max_reqs: int):
        check_count("ReqSlotAllocator", "max_reqs", max_reqs, 1)
        self.max_reqs = max_reqs
        self._free = list(range(max_reqs - 1, -1, -1))
        self._in_use = [False] * max_reqs

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.max_reqs - len(self._free)

    def alloc(self) -> int:
        """A free request slot; raises ``KVCacheFull`` when all ``max_reqs`` are in use."""
        if not self._free:
            raise KVCacheFull(f"ReqSlotAllocator.alloc: asked for 1 request slot, 0 of {self.max_reqs} are free")
        slot = self._free.pop()
        self._in_use[slot] = True
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot``; ``ValueError`` if it is out of range or not allocated."""
        self.check_allocated("ReqSlotAllocator.free", slot)
        self._in_use[slot] = False
        self._free.append(slot)

    def check_allocated_each(self, owner: str, slots: Sequence[int]) -> None:
        """``check_allocated`` for every slot, with one pass over a batch of valid ones (a decode step's); the first
        bad slot gets the same error."""
        if slots and set(map(type, slots)) == {int} and min(slots) >= 0 and max(slots) < self.max_reqs:
            in_use = self._in_use
            if all([in_use[s] for s in slots]):
                return
        for slot in slots:
            self.check_allocated(owner, slot)

    def check_allocated(self, owner: str, slot: int) -> None:
        check_count(owner, "slot", slot, 0)
        if slot >= self.max_reqs:
            raise ValueError(f"{owner}: slot expected a value in [0, {self.max_reqs}), got {slot}")
        if not self._in_use[slot]:
            raise ValueError(f"{owner}: slot expected an allocated request slot, got free slot {slot}")


def _as_index_tensor(owner: str, indices: IndexLike) -> torch.Tensor:
    if not isinstance(indices, torch.Tensor):
        values = list(indices)
        indices = torch.as_tensor(values) if values else torch.empty(0, dtype=torch.int64)
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        raise ValueError(f"{owner}: indices expected an integer tensor, got dtype {indices.dtype}")
    if indices.dim() != 1:
        raise ValueError(f"{owner}: indices expected a 1-D tensor, got shape {tuple(indices.shape)}")
    return indices.to(device="cpu", dtype=torch.int64)
