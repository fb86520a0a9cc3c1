"""server_start's method on the CPU: each start is timed to a healthy server, which is stopped before the next."""

import json

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("server_start")


def test_times_each_start_and_writes_them(bench, tmp_path, capsys):
    out = tmp_path / "s.json"
    bench.main(["--starts", "1", "--warm-starts", "0", "--tp", "1", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tp"] == 1 and len(row["seconds"]) == 1 and row["seconds"][0] > 0
    assert row["median_s"] == row["seconds"][0]
    assert f"| {bench.REPO} | 1 | " in capsys.readouterr().out and row["repo"] == bench.REPO


def test_bad_counts_are_one_usage_error(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--starts", "0"])
    assert e.value.code == 2 and "--starts and --tp expected positive integers" in capsys.readouterr().err
