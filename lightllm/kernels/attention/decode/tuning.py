"""What the decode-attention kernels (Triton GQA decode, MTP diverse, FA3) share about tuning: run-key KV lengths,
the ladder of lengths a search times on, and the representative inputs at those lengths."""

from typing import Optional

import torch

from lightllm.common.autotuner import get_decode_attn_autotune_seq_len

KV_LEN_BUCKET = 512


def round_up_kv_len(kv_len: int, bucket: int = KV_LEN_BUCKET) -> int:
    """KV length rounded up to a multiple of ``bucket`` (at least one bucket), for run keys."""
    return max(1, -(-int(kv_len) // bucket)) * bucket


def decode_attn_tuning_len(launch_max_len: int) -> int:
    """The longest KV length decode attention tunes at: ``LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN``, capped at the
    launch's maximum (a graph captured for ``graph_max_len_in_batch`` never serves longer requests, and timing
    lengths it cannot serve would choose for a grid it never replays)."""
    return min(get_decode_attn_autotune_seq_len(), max(1, int(launch_max_len)))


def decode_attn_run_key_kv_len(launch_max_len: int) -> int:
    """The KV length a run key uses: the tuning length of the launch, inside the tuning scope and outside it
    alike. The graph captured after a warm-up therefore looks up the very entry the warm-up searched or
    confirmed (not one an earlier start stored under the graph's maximum), and an eager batch longer than the
    tuning length maps to the entry tuned for it. Not rounded."""
    return decode_attn_tuning_len(launch_max_len)


LADDER_DIVISORS = (2, 8, 32)  # the tuning length, then 1/2, 1/8 and 1/32 of it


def seq_len_ladder(seq_len: int, divisors=LADDER_DIVISORS) -> list:
    """``seq_len``, then ``seq_len // d`` for each divisor (at least 512, each shorter than the one before)."""
    lens = [seq_len]
    for div in divisors:
        n = max(KV_LEN_BUCKET, seq_len // div)
        if n < lens[-1]:
            lens.append(n)
    return lens


def decode_attn_autotune_seq_lens(launch_max_len: Optional[int] = None, divisors=LADDER_DIVISORS) -> list:
    """KV lengths a decode-attention search times on: the tuning length first (capped at ``launch_max_len``
    when given), then 1/2, 1/8 and 1/32 of it (or ``divisors``), so the config a CUDA graph freezes is checked
    against the shorter lengths it will also serve (see the choice rules in the autotuner's ``choice.py``)."""
    seq_len = get_decode_attn_autotune_seq_len() if launch_max_len is None else decode_attn_tuning_len(launch_max_len)
    return seq_len_ladder(seq_len, divisors)


def inputs_at_lengths(named: dict, lens: list) -> list:
    """A decode launch's named arguments once per KV length in ``lens``: every request of the caller's batch at that
    length, over the existing pool (one token table whose indices wrap modulo the pool's size: no KV is allocated),
    with a fresh ``out``. Launch sizes stay the caller's, so timings see the grid a graph will replay."""
    q, pool = named["q"], named["k_cache"].shape[0]
    batch = q.shape[0]
    table = (torch.arange(batch * lens[0], device=q.device, dtype=torch.int64) % pool).to(torch.int32)
    table = table.view(batch, lens[0])
    slots = torch.arange(batch, device=q.device, dtype=torch.int32)
    return [
        {
            **named,
            "req_to_token": table,
            "b_req_idx": slots,
            "b_seq_len": torch.full((batch,), n, device=q.device, dtype=torch.int32),
            "out": torch.empty_like(named["out"]),
        }
        for n in lens
    ]
