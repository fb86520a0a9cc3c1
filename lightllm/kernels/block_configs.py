"""Tuning candidates and untuned defaults of the kernels tiled alike: one program per row walking its ``N``
columns in ``BLOCK_N`` chunks (RMSNorm, add + RMSNorm), or ``BLOCK_H`` heads of a row per program (gates,
gated RMSNorm, q/k norm + RoPE). Kernels of one tiling thus search the same space."""

import functools

from lightllm.kernels.launch_math import next_power_of_2

_MAX_BLOCK_N = 16384  # the whole row in one chunk up to here; longer rows loop


def row_chunk_configs(n: int) -> list:
    """Chunk widths 256, 1024, 4096 and the whole row (each capped at the row), with the warps that fit."""
    full = next_power_of_2(n)
    blocks = sorted({min(b, full) for b in (256, 1024, 4096, full) if b <= _MAX_BLOCK_N})
    return [{"BLOCK_N": b, "num_warps": w} for b in blocks for w in (1, 2, 4, 8, 16) if w * 32 <= b]


@functools.lru_cache(maxsize=None)  # per launch when no tuned config: computed once per size
def row_chunk_default(n: int) -> dict:
    block = min(next_power_of_2(n), _MAX_BLOCK_N)
    return {"BLOCK_N": block, "num_warps": max(1, min(16, block // 256))}


def head_block_configs(heads: int) -> list:
    """1..16 heads per program (no more than the row holds) at 1..8 warps."""
    most = next_power_of_2(heads)
    return [{"BLOCK_H": b, "num_warps": w} for b in (1, 2, 4, 8, 16) if b <= most for w in (1, 2, 4, 8)]


@functools.lru_cache(maxsize=None)  # per launch when no tuned config: computed once per size
def head_block_default(heads: int) -> dict:
    return {"BLOCK_H": min(4, next_power_of_2(heads)), "num_warps": 4}
