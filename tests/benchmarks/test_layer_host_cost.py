"""benchmarks/layer_host_cost.py runs both ways (Triton's launch path down to a stand-in kernel with the attention
backend's GPU path; or no-op launches and attention), for Qwen3 and for Qwen3.5 (each layer kind apart), and records
its runs; the timings themselves are the benchmark's, not a test's."""

import json
import math
import os
import sys

import pytest

from lightllm.common import proc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "method",
    [[], ["--launches", "noop", "--attention", "noop"], ["--model", "qwen3.5"]],
    ids=["driver", "noop", "qwen3.5"],
)
def test_runs_and_records(tmp_path, method):
    out = tmp_path / "runs.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "layer_host_cost.py"), "--number", "2", "--repeats", "1",
           "--prompt-len", "16", "--label", "smoke", "--note", "test", "--out", str(out), *method]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)  # the benchmark runs Triton's own (compiled-kernel) launch path
    done = proc.run(cmd, timeout=proc.HANG_TIMEOUT_S, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out.read_text())
    launches, attention = ("noop", "noop") if "noop" in method else ("driver", "kernels")
    assert (run["label"], run["note"], run["launches"], run["attention"]) == ("smoke", "test", launches, attention)
    for phase in ("decode", "prefill"):
        # Qwen3.5: a row per layer kind (its layers after the kind's first)
        rows = run["results"][phase].values() if "qwen3.5" in method else [run["results"][phase]]
        assert len(rows) == (2 if "qwen3.5" in method else 1), run
        assert all(math.isfinite(v) for row in rows for v in row.values()), run
    if "qwen3.5" in method:
        assert run["model"] == "qwen3.5" and set(run["results"]["decode"]) == {"linear_attention", "full_attention"}
