"""Batch metadata of one forward, built once per step and read by every layer."""

import itertools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from lightllm.common.transfer import host_to_device, tensor_to_device


def packed_positions(starts: Sequence[int], counts: Sequence[int]) -> np.ndarray:
    """``starts[i] .. starts[i] + counts[i] - 1`` for every ``i``, one run after another (int64)."""
    return np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n in zip(starts, counts)])


@dataclass
class InferState:
    """What attention needs to know about the batch, so a model's forward takes only ``(input_ids, state)``.

    Prefill packs each request's new tokens one after another (``b_q_start``/``b_q_len``); decode has
    ``q_len`` new tokens per request (1, or more for MTP verify). ``b_seq_len`` counts every KV token of
    the request after this step. A chunked prefill continues requests whose first ``b_prefix_len`` tokens are
    already in the KV pool (and, for linear attention, in the request's state slot): ``b_seq_len`` = prefix + new;
    ``max_prefix_len`` (a host int) is 0 when no request of the batch has a prefix, so layers pick the plain
    path without reading a device tensor (a prefill graph with a prefix sets it, and ``max_len_in_batch``, to the
    longest it serves). ``max_len_in_batch`` is the real longest request;
    ``graph_max_len`` is set while running a captured decode graph (or capturing one) and sizes kernel
    launches instead, so a graph replays at any real length up to it. Kernels key their configs by the
    launch length (``launch_max_len``): the real one eagerly, the graph's inside a graph.
    ``attn_plan`` is the attention backend's plan of this step (argument checks, page table, tuned config),
    set by ``plan_prefill``/``plan_decode`` at the forward's start, before any layer, and run by every layer.
    """

    is_prefill: bool
    b_req_idx: torch.Tensor  # int32 [batch]: request slot (row of req_to_token)
    req_to_token: torch.Tensor  # int32 [max_reqs, max_len]: the KV cache's table, token index per slot and position
    b_seq_len: torch.Tensor  # int32 [batch]
    out_token_idx: torch.Tensor  # int64 [tokens]: pool slots the new tokens' K/V go to
    positions: torch.Tensor  # int64 [tokens]
    max_len_in_batch: int
    b_q_start: Optional[torch.Tensor] = None  # int32 [batch], prefill only
    b_q_len: Optional[torch.Tensor] = None  # int32 [batch], prefill only
    max_q_len: int = 1
    b_prefix_len: Optional[torch.Tensor] = None  # int32 [batch], prefill only: tokens cached before this chunk
    max_prefix_len: int = 0
    q_lens_host: Optional[Sequence[int]] = None  # prefill: ``b_q_len`` on the host, when the builder had it
    q_len: int = 1  # decode: new tokens per request
    # MTP: each request row owns several linear-attention state slots. ``state_idx`` [batch] is the slot a step
    # starts from (None: ``b_req_idx``); a verify step (q_len > 1) writes the state after its token t to slot
    # ``state_dst_idx[b, t]`` (int32 [batch, q_len]).
    state_idx: Optional[torch.Tensor] = None
    state_dst_idx: Optional[torch.Tensor] = None
    # A prefill graph's one request padded to ``max_q_len`` token rows (``engine/prefill_graphs.py``): the rows past
    # its ``b_q_len`` belong to the padding request. Linear attention runs them as a second sequence of their own,
    # from and into the padding request's state slot (``state_idx`` is then [3]: the request's slot, then the
    # padding's twice, the third for an empty sequence its chunked plan adds).
    padded: bool = False
    graph_max_len: Optional[int] = None
    attn_plan: Optional[Any] = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return self.b_req_idx.shape[0]

    @property
    def launch_max_len(self) -> int:
        """Length kernel launches are sized for: the graph's maximum inside a graph, else the real one."""
        return self.graph_max_len if self.graph_max_len is not None else self.max_len_in_batch

    @classmethod
    def packed_prefill(cls, slots: Sequence[int], req_to_token: torch.Tensor, prefix_lens: Sequence[int],
                       new_lens: Sequence[int], out_token_idx: torch.Tensor, device: torch.device,
                       max_position: Optional[int] = None) -> "InferState":  # fmt: skip
        """A prefill of request slots ``slots``, each with ``new_lens[i]`` new tokens packed one request after another
        and placed after its ``prefix_lens[i]`` tokens already in the KV (0: a fresh request); ``out_token_idx`` the
        pool slots the new tokens' K/V go to; rotary positions capped at ``max_position`` when given."""
        # Every small host value goes through pinned memory, non_blocking: a pageable copy would wait for the GPU
        # (this runs for every eager prefill and every MTP catch-up)
        i32, dev = torch.int32, torch.device(device)
        seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
        positions = packed_positions(prefix_lens, new_lens)
        if max_position is not None:
            positions = np.minimum(positions, max_position)
        return cls(
            is_prefill=True,
            b_req_idx=host_to_device(list(slots), i32, dev),
            req_to_token=req_to_token,
            b_seq_len=host_to_device(seq_lens, i32, dev),
            out_token_idx=tensor_to_device(out_token_idx, dev),
            positions=host_to_device(positions, torch.int64, dev),
            max_len_in_batch=max(seq_lens),
            b_q_start=host_to_device([0, *itertools.accumulate(new_lens[:-1])], i32, dev),
            b_q_len=host_to_device(list(new_lens), i32, dev),
            q_lens_host=tuple(new_lens),
            max_q_len=max(new_lens),
            b_prefix_len=host_to_device(list(prefix_lens), i32, dev),
            max_prefix_len=max(prefix_lens),
        )
