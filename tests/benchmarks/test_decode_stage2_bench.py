"""benchmarks/decode_stage2.py: stage 2 at every tile against the float64 merge, under the interpreter."""

import pytest
import torch

from lightllm.kernels.attention.decode import stage2
from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("decode_stage2")


@pytest.mark.parametrize("length", [40, 200, 1000])
def test_every_tile_merges_the_used_splits(bench, length):
    """B=2 of 24/4 d256 over a 1024-token grid (4 interpreter SMs, WAVES 8: 4 splits of 8 blocks); a 40-token
    request uses 2 of them, a 1000-token one all 4 (tile 2: in tiles). Every tile's output is checked inside
    ``time_tiles``."""
    torch.manual_seed(length)
    row = bench.time_tiles("hq24-hk4-d256", 2, 1024, length, 32, 8, (1, 2, 4), device="cpu")
    assert row["splits"] == 4 and row["used"] == {40: 2, 200: 4, 1000: 4}[length]
    assert sorted(row["ms"]) == [1, 2, 4]
    assert stage2._split_tile == 16  # every tile was put back
