"""Split-KV decode attention, stage 2: merge the non-empty splits of stage 1 by their log-sum-exp."""

import triton
import triton.language as tl

from lightllm.kernels.attention.decode.splits import split_tokens
from lightllm.kernels.pdl import pdl_release, pdl_wait

# Stage 2 merges this many splits a step where a request has at least twice as many (merge_splits); set_split_tile
# changes it for benchmarks that compare tiles.
_split_tile = 16


def split_tile(splits: int) -> int:
    """``SPLIT_TILE`` of a launch with ``splits`` splits: the tile when a request can use twice that many, else 1
    (one split a step only: the tiled path would never run)."""
    return _split_tile if splits >= 2 * _split_tile else 1


def set_split_tile(tile: int) -> int:
    """Merge ``tile`` splits a step where a request uses at least twice as many (a power of two; 1: always one
    split a step); returns the previous tile."""
    global _split_tile
    if type(tile) is not int or tile < 1 or tile & (tile - 1):
        raise ValueError(f"stage 2 split tile: expected a power of two >= 1, got {tile!r}")
    previous, _split_tile = _split_tile, tile
    return previous


@triton.jit
def _merge_one_at_a_time(o_ptr, lse_ptr, used, stride_mos, HEAD_DIM: tl.constexpr):
    """One split a step, the running sum rescaled to each new maximum: the least work a split, each step waiting on
    its own loads."""
    d = tl.arange(0, HEAD_DIM)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s in range(0, used):
        lse = tl.load(lse_ptr + s)
        o = tl.load(o_ptr + s * stride_mos + d)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + o * w
        l_i = l_i * alpha + w
        m_i = m_new
    return acc / tl.maximum(l_i, 1e-30)


@triton.jit
def _merge_in_tiles(o_ptr, lse_ptr, used, stride_mos, HEAD_DIM: tl.constexpr, SPLIT_TILE: tl.constexpr):
    """Two passes, ``SPLIT_TILE`` splits a step: the largest log-sum-exp first, then each tile's outputs weighted
    against it into a ``[SPLIT_TILE, HEAD_DIM]`` sum, reduced once at the end, so no step waits on the one before."""
    d = tl.arange(0, HEAD_DIM)
    tile = tl.arange(0, SPLIT_TILE)
    top = tl.full([SPLIT_TILE], float("-inf"), dtype=tl.float32)
    for s0 in range(0, used, SPLIT_TILE):
        s = s0 + tile
        top = tl.maximum(top, tl.load(lse_ptr + s, mask=s < used, other=float("-inf")))
    m = tl.max(top, axis=0)
    tiles = tl.zeros([SPLIT_TILE, HEAD_DIM], dtype=tl.float32)
    weights = tl.zeros([SPLIT_TILE], dtype=tl.float32)
    for s0 in range(0, used, SPLIT_TILE):
        s = s0 + tile
        valid = s < used
        w = tl.exp2(tl.load(lse_ptr + s, mask=valid, other=float("-inf")) - m)  # 0 past ``used``
        o = tl.load(o_ptr + s[:, None] * stride_mos + d[None, :], mask=valid[:, None], other=0.0)
        tiles += o * w[:, None]
        weights += w
    return tl.sum(tiles, axis=0) / tl.maximum(tl.sum(weights, axis=0), 1e-30)


@triton.jit
def merge_splits(o_ptr, lse_ptr, used, stride_mos, HEAD_DIM: tl.constexpr, SPLIT_TILE: tl.constexpr):
    """``sum_s 2^lse_s o_s / sum_s 2^lse_s`` over splits ``0 .. used - 1`` (zeros when ``used`` is 0): split ``s``'s
    partial output at ``o_ptr + s * stride_mos`` (``HEAD_DIM`` floats), its base-2 log-sum-exp at ``lse_ptr + s``.

    A request using at least ``2 * SPLIT_TILE`` splits is merged in tiles, any other one split a step. On the H200
    (benchmarks/results/decode_stage2_h200.json) one split a step costs about 60 ns a split (17.5 µs for 256 at
    d256); tiles of 16 took 0.54-0.94x its time from 32 splits up, but 1.04-1.15x with 16-17, and at B=64 with 2-5
    splits tiles of 2-4 took up to 2x."""
    if SPLIT_TILE == 1:  # a constexpr branch: a launch of tile 1 compiles the loop alone
        out = _merge_one_at_a_time(o_ptr, lse_ptr, used, stride_mos, HEAD_DIM)
    elif used >= 2 * SPLIT_TILE:
        out = _merge_in_tiles(o_ptr, lse_ptr, used, stride_mos, HEAD_DIM, SPLIT_TILE)
    else:
        out = _merge_one_at_a_time(o_ptr, lse_ptr, used, stride_mos, HEAD_DIM)
    return tl.where(used > 0, out, 0.0)


@triton.jit
def decode_stage2_kernel(
    mid_o,
    mid_lse,
    b_seq_len,
    Out,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    SPLITS,
    block_n,  # stage 1's BLOCK_N: a plain int, so stage 2 compiles once for every stage-1 config
    min_blocks,  # stage 1's MIN_BLOCKS
    HEAD_DIM: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py
):
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(b_seq_len + b)
    per_split = split_tokens(seq_len, SPLITS, block_n, min_blocks)
    used = tl.cdiv(seq_len, per_split)  # stage 1's splits with work (splits.py); 0 for an empty request
    o_ptr = mid_o + b.to(tl.int64) * stride_mob + h * stride_moh
    out = merge_splits(o_ptr, mid_lse + b * stride_mlb + h * stride_mlh, used, stride_mos, HEAD_DIM, SPLIT_TILE)
    pdl_release(USE_PDL)
    d = tl.arange(0, HEAD_DIM)
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))
