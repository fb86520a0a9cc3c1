"""benchmarks/linear_attention.py: arguments, byte counts, pool cycling and its tables from a saved run (the GPU run
itself is a benchmark, not a test)."""

import pytest

from tests.benchmarks.helpers import analyzed_lines, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("linear_attention")


def test_arguments(bench):
    args = bench.parse_args(["--out", "x.json"])
    assert args.out == "x.json" and args.batches == [1, 8, 16, 64, 128] and args.analyze is None
    assert args.shapes == ["hk16-hv48-d128", "hk16-hv32-d128"] and bench.SHAPES["hk16-hv48-d128"] == (16, 48, 128, 128)
    assert bench.parse_args(["--batches", "2", "4", "--shapes", "hk16-hv32-d128"]).batches == [2, 4]
    with pytest.raises(SystemExit):
        bench.parse_args(["--batches", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "hk1"])


def test_state_bytes_and_cold_pools(bench):
    assert bench.state_bytes(64, 48, 128, 128) == 64 * 48 * 128 * 128 * 4 * 2  # fp32 state read + written
    per_pool = bench.state_bytes(1, 48, 128, 128) // 2  # 3 MiB: 342 pools make the 1 GiB cycle
    assert bench.pools_needed(per_pool) == 342 and bench.pools_needed(1 << 31) == 2
    seen = []
    cycle = bench.Cycle(seen.append, ["p0", "p1", "p2"])
    for _ in range(4):
        cycle()
    assert seen == ["p1", "p2", "p0", "p1"]  # consecutive launches never reuse a pool


def test_analyze_prints_a_saved_run(bench, tmp_path, capsys):
    row = {
        "shape": "hk16-hv48-d128", "B": 64, "state_bytes": bench.state_bytes(64, 48, 128, 128),
        "default": {"BV": 32, "num_warps": 4}, "default_ms": 0.2, "tuner": None, "tuner_ms": 0.1,
        "candidates_ms": {'{"BV": 16, "num_warps": 1}': 0.08}, "fla_ms": 0.12,
    }  # fmt: skip
    saved = {
        "device": "NVIDIA H200", "copy_GBs": 4000.0, "state_dtype": "torch.float32", "dtype": "torch.bfloat16",
        "rows": [row, {**row, "B": 1, "fla_ms": None}],
        "conv": [{"B": 64, "C": 10240, "default_block": 512, "ms": {"256": 0.004, "512": 0.003}}],
    }  # fmt: skip
    lines = analyzed_lines(bench, saved, tmp_path, capsys)
    (b64,) = [line for line in lines if line.startswith("hk16-hv48-d128   64")]
    # 0.1 ms for 402.65 MB is 4.03 TB/s, 100.7 % of the copy; fla 1.20x the tuner's time, 1.50x the best
    assert b64.split() == ["hk16-hv48-d128", "64", "200.0", "100.0", "80.0", "120.0", "1.20", "1.50", "4.03", "100.7",
                           "default"]  # fmt: skip
    (b1,) = [line for line in lines if line.startswith("hk16-hv48-d128    1")]
    assert b1.split()[5:8] == ["-", "-", "-"]
    assert any("B= 64 C=10240:" in line and "3.0*" in line and "4.0 " in line for line in lines)
