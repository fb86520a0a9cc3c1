"""How split-KV decode shares a request's KV among its split programs (plain, INT8/INT4 and MTP diverse stage 1) and
which splits stage 2 merges.

A launch runs ``splits`` programs per (request, KV head): :func:`num_splits`, from the batch, the SM count and the
longest length the launch serves (a graph's maximum when captured), never the real lengths, so a captured graph
replays at any length up to its maximum. A request of ``L`` tokens is cut into ``BLOCK_N``-token blocks (the tile
stage 1 steps by) and each split takes ``max(ceil(ceil(L / BLOCK_N) / splits), MIN_BLOCKS)`` consecutive blocks:
split ``s`` covers tokens ``[s * T, min((s + 1) * T, L))`` with ``T`` that many blocks' tokens. The splits with work
are the first ``ceil(L / T)``: stage 2 merges exactly those. Because the share is counted in blocks, not in fixed
chunks, a short request in a grid sized for a long one still spreads over up to ``ceil(L / BLOCK_N)`` splits.

``MIN_BLOCKS`` (a config key, 1 by default) is the least work a split takes: a grid sized for a long graph maximum
gives a short request one block per split, and each such program pays its query load and partial write for one
tile; with ``MIN_BLOCKS`` 2 the same grid serves that request with half as many programs of two blocks, and
behaves as before at lengths where every split has that much work anyway. It is decided at run time from the real
length, so one captured graph gets both behaviours. :func:`split_token_ranges` states the same in plain Python (the
tests' oracle).
"""

from functools import lru_cache

import torch
import triton
import triton.language as tl

from lightllm.kernels.launch_math import cdiv


@triton.jit
def split_tokens(seq_len, splits, block_n, min_blocks):
    """Tokens per split of a request of ``seq_len`` tokens, a multiple of ``block_n``: at least ``min_blocks`` blocks
    (an empty request gets a share too, and no split has work: every range starts at or past its end)."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, block_n), splits), min_blocks) * block_n


@lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: keep grids small
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch: int, kv_heads: int, max_len_in_batch: int, block_n: int, waves: int, device) -> int:
    """Split programs per (request, KV head): about ``waves`` programs per SM, and no more than the longest request
    the launch serves gives work to (its blocks, rounded down so that at that length every split has some)."""
    return splits_for_sms(batch, kv_heads, max_len_in_batch, block_n, waves, _num_sms(device))


def splits_for_sms(batch: int, kv_heads: int, max_len_in_batch: int, block_n: int, waves: int, sms: int) -> int:
    """:func:`num_splits` for a GPU of ``sms`` SMs (benchmarks that reason about another GPU than this one)."""
    max_blocks = max(1, cdiv(max_len_in_batch, block_n))
    want = min(cdiv(waves * sms, max(1, batch * kv_heads)), max_blocks)
    return cdiv(max_blocks, cdiv(max_blocks, want))


def min_blocks(cfg: dict) -> int:
    """A config's ``MIN_BLOCKS`` (1 when absent: configs stored before the key existed)."""
    n = cfg.get("MIN_BLOCKS", 1)
    if type(n) is not int or n < 1:
        raise ValueError(f"decode attention config: MIN_BLOCKS expected an int >= 1, got {n!r}")
    return n


def split_token_ranges(seq_len: int, splits: int, block_n: int, min_blocks: int = 1) -> list:
    """``[(start, end), ...]``, split ``s``'s tokens of a request of ``seq_len`` tokens (``start == end``: no work),
    as stage 1 assigns them."""
    per_split = max(cdiv(cdiv(seq_len, block_n), splits), min_blocks) * block_n
    return [(min(s * per_split, seq_len), min((s + 1) * per_split, seq_len)) for s in range(splits)]
