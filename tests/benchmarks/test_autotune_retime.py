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


def test_an_arm_is_judged_on_the_first_arms_timings(bench):
    """The screened search picked BLOCK_N 64; on the judge's final timings it is 10 % off at the second length,
    where the judge's pick (BLOCK_N 32) is the best; the judge's pick was among the screened search's finalists."""
    judge = _record({-1: [1.0, 0.5]}, [1.0, 0.5], [[0.8, 0.40], [0.78, 0.44], [2.0, 1.0]])
    timings = [[0.9, 0.45], [0.8, 0.4], [2.0, 1.0]]
    screened = _record({-1: [1.0, 0.5], 0: [0.9, 0.45], 1: [0.8, 0.4]}, [1.0, 0.5], timings)
    row = bench.judged(screened, judge)
    assert row["judged_loss_pct"] == pytest.approx(10.0)
    assert row["same_pick"] is False and row["judge_pick_retimed"] is True
    own = bench.judged(judge, judge)
    assert own["same_pick"] and own["judged_loss_pct"] == pytest.approx(100.0 * (0.8 / 0.78 - 1))


def test_judge_pick_not_retimed_and_default_picks(bench):
    judge = _record({}, [1.0], [[1.2], [0.9], [1.5]])
    default_pick = _record({-1: [1.0]}, [1.0], [[1.2], [1.1], [1.5]])
    row = bench.judged(default_pick, judge)
    assert row["judged_loss_pct"] == pytest.approx(100.0 * (1.0 / 0.9 - 1))
    assert not row["same_pick"] and not row["judge_pick_retimed"]  # only the default was re-timed


@pytest.mark.parametrize("text, parsed", [("5:3", (5, 3)), ("15:0", (15, 0))])
def test_parse_arm(bench, text, parsed):
    assert bench.parse_arm(text) == parsed


@pytest.mark.parametrize("text", ["5", "0:3", "5:-1", "a:b", "5:3:1"])
def test_parse_arm_refuses(bench, text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="REPLAYS"):
        bench.parse_arm(text)


def test_arm_summary(bench, capsys):
    rows = [{"arm": arm, "search_s": s, "retime_s": r, "judged_loss_pct": loss, "same_pick": same,
             "judge_pick_retimed": same} for arm, s, r, loss, same in
            [("#0 15:3", 6.0, 0.4, 0.0, True), ("#1 5:3", 4.0, 0.5, 1.0, False), ("#0 15:3", 5.0, 0.3, 0.0, True),
             ("#1 5:3", 3.0, 0.4, 0.0, True)]]  # fmt: skip
    summary = bench.arm_summary(rows)
    assert list(summary) == ["#0 15:3", "#1 5:3"] and bench.arm_label(1, 5, 3) == "#1 5:3"
    want = {"searches": 2, "search_s": 3.5, "retime_s": 0.45, "judged_loss_mean_pct": 0.5, "judged_loss_max_pct": 1.0,
            "same_pick": 1, "judge_pick_retimed": 1}  # fmt: skip
    assert summary["#1 5:3"] == want
    bench.print_arms(rows)
    assert "0.50/1.00%" in capsys.readouterr().out
