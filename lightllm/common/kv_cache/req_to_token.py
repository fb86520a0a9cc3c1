"""The req_to_token table: (request slot, position) -> token index in the KV pool."""

from typing import Sequence

import numpy as np
import torch

from lightllm.common.kv_cache.allocator import check_count
from lightllm.common.transfer import tensor_to_device

# Token indices are stored as int32, which is what the attention kernels read.
MAX_TOKEN_INDEX = torch.iinfo(torch.int32).max


class ReqToTokenTable:
    """``table``: int32 ``[max_reqs, max_len]`` on ``device``, allocated once; row = request slot.

    Entries past a request's length are stale; the kernels read only ``table[slot, :seq_len]``.
    """

    def __init__(self, max_reqs: int, max_len: int, device="cuda"):
        check_count("ReqToTokenTable", "max_reqs", max_reqs, 1)
        check_count("ReqToTokenTable", "max_len", max_len, 1)
        self.max_reqs = max_reqs
        self.max_len = max_len
        self.table = torch.zeros((max_reqs, max_len), dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        return self.table.device

    def write(self, slot: int, start: int, token_idx: torch.Tensor) -> None:
        """``table[slot, start:start+len(token_idx)] = token_idx`` (bounds checked by the caller), through pinned
        memory: an admission with a cached prefix, or a publish, does not wait for the GPU."""
        self.table[slot, start : start + token_idx.numel()] = tensor_to_device(
            token_idx, self.table.device, torch.int32
        )

    def write_points(self, slots: Sequence[int], positions: Sequence[int], token_idx: torch.Tensor) -> None:
        """``table[slots[i], positions[i]] = token_idx[i]`` for every ``i`` in one indexed write into the flattened
        table (a decode step's new tokens), bounds checked by the caller. The flat indices are built in numpy: one
        small host tensor per step instead of two from ``torch.tensor``."""
        flat = np.asarray(slots, dtype=np.int64) * self.max_len + np.asarray(positions, dtype=np.int64)
        dev = self.table.device
        # pinned, non_blocking copies: from pageable memory each would wait for the GPU (a prefill's, an MTP draft's)
        where = tensor_to_device(torch.from_numpy(flat), dev)
        self.table.view(-1)[where] = tensor_to_device(token_idx, dev, torch.int32)
