"""How split-KV decode shares a request's KV among its split programs (plain, INT8/INT4 and MTP diverse stage 1) and
which splits stage 2 merges.

A launch runs ``splits`` programs per (request, KV head): :func:`num_splits`, from the batch, the SM count and the
longest length the launch serves (a graph's maximum when captured), never the real lengths, so a captured graph
replays at any length up to its maximum. A request of ``L`` tokens is cut into ``BLOCK_N``-token blocks (the tile
stage 1 steps by) and each split takes ``ceil(ceil(L / BLOCK_N) / splits)`` consecutive blocks: split ``s`` covers
tokens ``[s * T, min((s + 1) * T, L))`` with ``T`` that many blocks' tokens. The splits with work are the first
``ceil(L / T)``: stage 2 merges exactly those. Because the share is counted in blocks, not in fixed chunks, a short
request in a grid sized for a long one still spreads over up to ``ceil(L / BLOCK_N)`` splits.
:func:`split_token_ranges` states the same in plain Python (the tests' oracle).
"""

from functools import lru_cache

import torch
import triton
import triton.language as tl

from lightllm.kernels.launch_math import cdiv


@triton.jit
def split_tokens(seq_len, splits, block_n):
    """Tokens per split of a request of ``seq_len`` tokens (0 for an empty request), a multiple of ``block_n``."""
    return tl.cdiv(tl.cdiv(seq_len, block_n), splits) * block_n


@lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: keep grids small
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch: int, kv_heads: int, max_len_in_batch: int, block_n: int, waves: int, device) -> int:
    """Split programs per (request, KV head): about ``waves`` programs per SM, and no more than the longest request
    the launch serves gives work to (its blocks, rounded down so that at that length every split has some)."""
    max_blocks = max(1, cdiv(max_len_in_batch, block_n))
    want = min(cdiv(waves * _num_sms(device), max(1, batch * kv_heads)), max_blocks)
    return cdiv(max_blocks, cdiv(max_blocks, want))


def split_token_ranges(seq_len: int, splits: int, block_n: int) -> list:
    """``[(start, end), ...]``, split ``s``'s tokens of a request of ``seq_len`` tokens (``start == end``: no work),
    as stage 1 assigns them."""
    per_split = cdiv(cdiv(seq_len, block_n), splits) * block_n
    return [(min(s * per_split, seq_len), min((s + 1) * per_split, seq_len)) for s in range(splits)]
