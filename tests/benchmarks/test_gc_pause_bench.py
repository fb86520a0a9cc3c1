"""benchmarks/gc_pause.py builds the engine's runner, serves through it and times full collector passes over the
same heap frozen and whole; what the passes take is the benchmark's to report, not a test's."""

import json
import os
import sys

from lightllm.common import proc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "gc_pause.py")
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_times_passes_over_the_served_heap_frozen_and_whole(tmp_path):
    out = tmp_path / "gc.json"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--requests", "3", "--prompt", "8", "--output", "4",
           "--passes", "2", "--out", str(out)]  # fmt: skip
    done = proc.run(cmd, timeout=proc.HANG_TIMEOUT_S, cwd=REPO, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["tokens"] == 3 * 4
    assert res["frozen_objects"] > 10000  # torch, the model and the engine's runner
    assert res["walked_frozen"] < res["frozen_objects"] <= res["walked_whole"]  # frozen: serving's objects alone
    assert len(res["pass_ms_frozen"]) == len(res["pass_ms_whole"]) == 2
    assert all(ms >= 0 for ms in res["pass_ms_frozen"] + res["pass_ms_whole"])
    assert "frozen (now)" in done.stdout and "whole (before)" in done.stdout


def test_a_pass_count_below_one_is_refused_naming_it(tmp_path):
    done = proc.run([sys.executable, SCRIPT, "--passes", "0", "--out", str(tmp_path / "x.json")],
                    timeout=proc.HANG_TIMEOUT_S, cwd=REPO, env=ENV)  # fmt: skip
    assert done.returncode == 2 and "--passes" in done.stderr and not (tmp_path / "x.json").exists()
