"""benchmarks/sampling_step.py runs on the CPU (README lists it with --device cpu): every case timed at every batch,
printed and written."""

import json

from tests.benchmarks.helpers import run_benchmark


def test_every_case_is_timed_at_every_batch(tmp_path):
    out = tmp_path / "out.json"
    done = run_benchmark("sampling_step", "--device", "cpu", "--vocab", "64", "--batches", "1", "3", "--prompt_len",
                         "8", "--steps", "2", "--threads", "1", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        times = [row[f"{case}_ms"] for case in ("plain", "penalties", "penalties+bias+min_tokens")]
        assert all(t > 0 for t in times), row
        assert f"batch {row['batch']} plain_ms {row['plain_ms']}" in done.stdout
