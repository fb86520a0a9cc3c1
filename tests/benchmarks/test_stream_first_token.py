"""benchmarks/stream_first_token.py runs on the CPU, times every probe it sends and writes what it prints; bad counts
are one line."""

import json

from tests.benchmarks.helpers import run_benchmark


def run(*args):
    return run_benchmark("stream_first_token", *args)


def test_every_probe_gets_its_headers_and_its_first_token(tmp_path):
    out = tmp_path / "out.json"
    done = run("--background", "2", "--probes", "6", "--settle-s", "0.2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    (only,) = result["runs"]
    assert only["probes"] == only["with_first_token"] == 6
    for key in ("headers_ms", "first_token_ms"):
        assert 0 < only[key]["p50"] <= only[key]["p99"] and result["median"][key] == {
            q: only[key][q] for q in ("p50", "mean", "p99")
        }
    # a request's headers come before its first token
    assert only["headers_ms"]["p50"] <= only["first_token_ms"]["p50"]
    assert f"{result['median']['first_token_ms']['p50']:7.2f}" in done.stdout


def test_bad_counts_are_one_line():
    done = run("--probes", "0")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "--probes expected a positive count, got 0"
    )
