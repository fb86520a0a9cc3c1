"""prefix_evict_cost's method on the CPU: the rows it writes and the checks of its flags, not how fast."""

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("prefix_evict_cost")


def test_each_pool_is_filled_then_timed_while_every_request_evicts(bench, tmp_path):
    out = tmp_path / "cost.json"
    bench.main(["--pools", "200", "1000", "--prompt", "40", "--decode", "8", "--repeats", "5", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["pool_tokens"] for r in rows] == [200, 1000]
    for r in rows:
        # the fill stops with less than a request's tokens free, all the others cached
        assert r["cached_requests"] == r["pool_tokens"] // 48 and r["tree_tokens"] > r["pool_tokens"] - 48
        assert 0 < r["median_us"] <= r["p90_us"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pools", "1000", "90", "--prompt", "32"], "--pools expected each >= 2 x (prompt + decode) = 96, got [90]"),
        (["--prompt", "1"], "--prompt expected >= 2 and --decode >= 0, got 1 and 16"),
        (["--repeats", "0"], "--repeats expected a positive integer, got 0"),
    ],
)
def test_bad_flags_name_the_flag(bench, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit):
        bench.main(flags + ["--out", str(tmp_path / "x.json")])
    assert message in capsys.readouterr().err
