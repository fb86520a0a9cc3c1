"""Decode stage 2 (the split merge) against the float64 merge, one split a step and in tiles, under the interpreter."""

import pytest
import torch

from lightllm.kernels.attention.decode import flash_decode, stage2
from lightllm.kernels.attention.decode.reference import merge_splits_ref
from lightllm.kernels.attention.decode.splits import split_token_ranges

SPLITS, BLOCK_N = 40, 16
# empty, one split, 20 used, all 40 with one block each, all 40 with three blocks each, 33 used (a partial last tile)
LENGTHS = [0, 5, 16 * 20, 16 * 40, 16 * 120, 16 * 33 - 3]


@pytest.mark.parametrize("tile", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_stage2_merges_each_requests_used_splits(tile, head_dim):
    """Requests of one launch take different paths at tile 16 (20 used: one at a time; 33 and 40: tiles) and tile 4
    (all but the empty and one-split requests in tiles); every output element is written."""
    gen = torch.Generator().manual_seed(tile * 1000 + head_dim)
    heads = 3
    mid_o = torch.randn(len(LENGTHS), heads, SPLITS, head_dim, generator=gen)
    mid_lse = torch.randn(len(LENGTHS), heads, SPLITS, generator=gen) * 6  # weights spread over ~2^12
    seq = torch.tensor(LENGTHS, dtype=torch.int32)
    used = [sum(1 for start, end in split_token_ranges(n, SPLITS, BLOCK_N) if end > start) for n in LENGTHS]
    assert used == [0, 1, 20, 40, 40, 33]
    out = torch.full((len(LENGTHS), heads, head_dim), float("nan"))
    previous = stage2.set_split_tile(tile)
    try:
        assert stage2.split_tile(SPLITS) == tile
        flash_decode.launch_stage2(mid_o, mid_lse, seq, out, BLOCK_N)
    finally:
        stage2.set_split_tile(previous)
    want = merge_splits_ref(mid_o, mid_lse, used)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert (out[0] == 0).all() and torch.equal(out[1], mid_o[1, :, 0])  # empty: zeros; one split: itself


def test_split_tile_rule_and_setter():
    assert [stage2.split_tile(n) for n in (1, 2, 16, 31, 32, 300)] == [1, 1, 1, 1, 16, 16]
    previous = stage2.set_split_tile(4)
    try:
        assert stage2.split_tile(8) == 4 and stage2.split_tile(7) == 1
    finally:
        stage2.set_split_tile(previous)
    assert stage2.split_tile(32) == 16
    for bad in (0, 3, 2.0, "8"):
        with pytest.raises(ValueError, match="power of two"):
            stage2.set_split_tile(bad)
