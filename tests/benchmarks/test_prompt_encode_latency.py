"""benchmarks/prompt_encode_latency.py runs on the CPU: both paths timed at every length and loop load it is given,
written and printed; bad values are one line."""

import json

from tests.benchmarks.helpers import run_benchmark


def run(*args):
    return run_benchmark("prompt_encode_latency", *args)


def test_both_paths_are_timed_at_every_length_and_load(tmp_path):
    out = tmp_path / "out.json"
    done = run("--chars", "64", "512", "--slices-ms", "0", "0.2", "--reps", "5", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["chars"], r["slice_ms"]) for r in result["rows"]] == [(64, 0.0), (64, 0.2), (512, 0.0), (512, 0.2)]
    for r in result["rows"]:
        assert r["tokens"] > 0
        assert all(0 < r[f"{path}_p50_us"] <= r[f"{path}_p90_us"] for path in ("inline", "thread"))
    assert f"{result['rows'][-1]['thread_p50_us']:10.0f}" in done.stdout


def test_bad_values_are_one_line():
    done = run("--reps", "0")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "--chars and --reps expected positive counts, got [256, 1024, 4096] and 0"
    )
    done = run("--slices-ms", "-1")
    assert done.returncode == 2 and "--slices-ms expected milliseconds >= 0, got [-1.0]" in done.stderr
