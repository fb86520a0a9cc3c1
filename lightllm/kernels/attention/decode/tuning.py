"""What the decode-attention kernels (Triton GQA decode, MTP diverse, FA3) share about tuning: run-key KV lengths,
the ladder of lengths a search times on, and the representative inputs at those lengths."""

import math
from typing import Optional, Sequence, Tuple

import torch

from lightllm.common.autotuner import get_decode_attn_autotune_seq_len
from lightllm.common.autotuner.keys import default_run_key_distance

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

# The KV length buckets decode graphs are captured for, ascending (``EngineArgs.graph_lens()``), set by the engine
# before its captures: () for one graph per batch size (or none). Process-wide like the tuner's caches it keys.
_graph_lens: Tuple[int, ...] = ()


def set_decode_graph_lens(lens: Sequence[int]) -> Tuple[int, ...]:
    """Declare the decode graphs' KV length buckets (ascending; () for one bucket). A launch for a bucket then tunes
    on the lengths its graph serves, above the next smaller bucket, and keys on that floor (``served_floor``), so
    each bucket's graph replays a config chosen for its own range. Returns the previous buckets."""
    global _graph_lens
    lens = tuple(int(n) for n in lens)
    if any(n <= 0 for n in lens) or list(lens) != sorted(set(lens)):
        raise ValueError(f"decode graph KV length buckets expected ascending positive lengths, got {list(lens)}")
    previous, _graph_lens = _graph_lens, lens
    return previous


def served_floor(launch_max_len: int) -> int:
    """The longest KV length a smaller decode graph serves, below a launch for ``launch_max_len``: the next smaller
    bucket, when it lies below the launch's tuning length; else 0 (the launch serves every length up to its own)."""
    floor = max((n for n in _graph_lens if n < launch_max_len), default=0)
    return floor if floor < decode_attn_tuning_len(launch_max_len) else 0


def decode_attn_run_key_lens(launch_max_len: int) -> tuple:
    """The KV-length part of a decode-attention run key: the rounded tuning length, and the served floor where a
    smaller bucket's graph serves the lengths below it (so a config chosen for 8K-32K is not reused for 0-32K)."""
    floor = served_floor(launch_max_len)
    return (round_up_kv_len(decode_attn_run_key_kv_len(launch_max_len)),) + ((floor,) if floor else ())


# A config tuned for a shorter graph never timed the longest lengths a longer graph replays (and a ladder stops at
# its tuning length), so any cached key tuned at or above a launch's length is nearer than every key tuned below it.
_BELOW_PENALTY_OCTAVES = 100.0
_TOKENS_PER_OCTAVE = 1e9  # one octave of tuning length outweighs any served-floor or batch difference


def decode_attn_run_key_distance(run_key: tuple, cached_key: tuple, prefix: int = 1) -> float:
    """The tuner's nearest-key distance for decode-attention run keys ``(*leading parts, tuning length[, floor])``,
    ``prefix`` leading parts (batch; FA3: batch and q_len). The tuning length first: the nearest at or above the
    launch's, in octaves, then the nearest below; then L1 over the served floor (an absent one counts as 0) and the
    leading parts. So a bucketed graph finds its own range's config first, then the nearest other range's (a
    one-graph start's, a shipped file's), never nothing; and a 16K graph takes configs tuned for 32K (timed at 16K
    on their ladder) over ones tuned for 4K (never timed past 4K)."""
    if not (isinstance(run_key, tuple) and isinstance(cached_key, tuple)):  # a hand-edited file's key: never near
        return default_run_key_distance(run_key, cached_key)
    width = max(len(run_key), len(cached_key), prefix + 1)
    run, cached = _padded(run_key, width), _padded(cached_key, width)
    l1 = default_run_key_distance(run, cached)  # inf unless every part is a number
    length, tuned = run[prefix], cached[prefix]
    if not math.isfinite(l1) or length <= 0 or tuned <= 0:
        return l1
    octaves = math.log2(tuned / length)
    length_cost = octaves if octaves >= 0 else _BELOW_PENALTY_OCTAVES - octaves
    return _TOKENS_PER_OCTAVE * length_cost + l1 - abs(tuned - length)


def _padded(key: tuple, width: int) -> tuple:
    return tuple(key) + (0,) * (width - len(key))


def seq_len_ladder(seq_len: int, divisors=LADDER_DIVISORS) -> list:
    """``seq_len``, then ``seq_len // d`` for each divisor (at least 512, each shorter than the one before)."""
    lens = [seq_len]
    for div in divisors:
        n = max(KV_LEN_BUCKET, seq_len // div)
        if n < lens[-1]:
            lens.append(n)
    return lens


def served_ladder(seq_len: int, floor: int, points: int = 4) -> list:
    """Lengths from ``seq_len`` down to ``floor`` (its stand-in: the shortest a graph above it serves is
    ``floor + 1``), geometric, at most ``points`` and at most a factor of 2 apart where that fits."""
    steps = min(points - 1, max(1, math.ceil(math.log2(seq_len / floor))))
    lens = [round(seq_len * (floor / seq_len) ** (i / steps)) for i in range(steps + 1)]
    return sorted(set(lens), reverse=True)


def decode_attn_autotune_seq_lens(launch_max_len: Optional[int] = None, divisors=LADDER_DIVISORS) -> list:
    """KV lengths a decode-attention search times on: the tuning length first (capped at ``launch_max_len``
    when given), then 1/2, 1/8 and 1/32 of it (or ``divisors``), so the config a CUDA graph freezes is checked
    against the shorter lengths it will also serve (see the choice rules in the autotuner's ``choice.py``). Where a
    smaller decode graph serves the lengths up to its bucket (``served_floor``), the ladder spans only the lengths
    this launch serves: ``served_ladder`` from the tuning length down to that bucket."""
    seq_len = get_decode_attn_autotune_seq_len() if launch_max_len is None else decode_attn_tuning_len(launch_max_len)
    floor = 0 if launch_max_len is None else served_floor(launch_max_len)
    if floor:  # as many lengths as the kernel's own ladder (FA3 asks for one more)
        return served_ladder(seq_len, floor, points=len(divisors) + 1)
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
