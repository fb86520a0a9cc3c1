"""benchmarks/autotune_retime.py: a search record's row (no GPU)."""

import math

import pytest

from lightllm.common.autotuner.tuner import SearchRecord
from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("autotune_retime")


def _record(first_pass, default_ms, timings, rule="minimax_loss"):
    configs = [{"BLOCK_N": n} for n in (32, 64, 128)]
    chosen = None  # the row recomputes both picks from the times
    return SearchRecord({"g": 4}, (8, 32768), rule, default_ms, list(zip(configs, timings)), chosen, default_ms, 2.0,
                        first_pass, 0.25)  # fmt: skip


def test_a_slow_first_default_moved_the_pick(bench):
    """The default's first time (1.2 ms) made BLOCK_N 32 (1.1 ms) look best; kept at 1.0 ms it wins, and a single
    pass would have frozen a config 10 % off."""
    first = {-1: [1.2, 0.6], 0: [1.1, 0.55], 1: [1.3, 0.7]}
    record = _record(first, [1.0, 0.5], [[1.1, 0.55], [1.25, 0.7], [2.0, 1.0]])
    row = bench.summarize(record)
    assert row["default_first_pct"] == pytest.approx(20.0)
    assert row["finalists_first_pct"] == pytest.approx(4.0)  # 1.3 over 1.25
    assert (row["one_pass_pick"], row["pick"]) == ('{"BLOCK_N":32}', "default")
    assert row["one_pass_loss_pct"] == pytest.approx(10.0) and row["loss_pct"] == 0.0
    assert (row["search_s"], row["retime_s"]) == (2.0, 0.25)


def test_nothing_retimed_and_failed_candidates(bench):
    """A search whose budget ran out re-timed nothing; a candidate that failed stays out of the best."""
    record = _record({}, [1.0], [[0.8], [math.inf], [0.9]])
    row = bench.summarize(record)
    assert row["default_first_pct"] is None and row["finalists_first_pct"] is None
    assert row["one_pass_pick"] == row["pick"] == '{"BLOCK_N":32}' and row["loss_pct"] == 0.0
    bench.print_row({"kind": "int8", "shape": "hq32-hk8-d128", "B": 8, "repeat": 0, **row})
