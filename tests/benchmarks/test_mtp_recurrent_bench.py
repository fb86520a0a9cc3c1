"""benchmarks/mtp_recurrent.py: arguments, byte counts and its table from a saved run (the GPU run itself is a
benchmark, not a test)."""

import pytest

from tests.benchmarks.helpers import analyzed_lines, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("mtp_recurrent")


def test_arguments(bench):
    args = bench.parse_args(["--out", "x.json"])
    assert args.out == "x.json" and args.batches == [16, 64, 128] and args.steps == 3 and args.analyze is None
    assert bench.SHAPE == (16, 48, 128, 128)
    assert bench.parse_args(["--batches", "2", "4", "--steps", "1"]).batches == [2, 4]
    for bad in (["--batches", "0"], ["--steps", "0"], ["--steps", "5"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_state_bytes_read_one_write_each_token(bench):
    assert bench.verify_state_bytes(64, 4, 48, 128, 128) == 64 * 48 * 128 * 128 * 4 * 5
    assert bench.verify_state_bytes(1, 2, 48, 128, 128, elem=2) == 48 * 128 * 128 * 2 * 3


def test_analyze_prints_a_saved_run(bench, tmp_path, capsys):
    row = {
        "B": 64, "state_bytes": bench.verify_state_bytes(64, 4, 48, 128, 128), "default": {"BV": 32, "num_warps": 4},
        "default_ms": 0.4, "tuner": {"BV": 16, "num_warps": 1}, "tuner_ms": 0.25,
        "candidates_ms": {'{"BV": 16, "num_warps": 1}': 0.25, '{"BV": 8, "num_warps": 1}': 0.2},
        "sequential": {"BV": 16, "num_warps": 1}, "sequential_ms": 0.5,
    }  # fmt: skip
    saved = {
        "device": "NVIDIA H200", "copy_GBs": 4000.0, "shape": [16, 48, 128, 128], "steps": 3,
        "state_dtype": "torch.float32", "dtype": "torch.bfloat16", "rows": [row],
    }  # fmt: skip
    lines = analyzed_lines(bench, saved, tmp_path, capsys)
    (b64,) = [line for line in lines if line.startswith(" 64")]
    # 1006.6 MB in 0.25 ms is 4.03 TB/s (100.7 % of the copy), in 0.2 ms 5.03; sequential 2.00x the tuner's time
    assert b64.split()[:9] == ["64", "400.0", "250.0", "200.0", "500.0", "2.00", "4.03", "5.03", "100.7"]
