"""benchmarks/stream_host_cost.py runs on the CPU and writes every number it prints."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_stream_host_cost_writes_its_table(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "stream_host_cost.py"), "--calls", "50", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("decode_transformers_us", "decode_direct_us", "event_json_dumps_us", "event_direct_us"):
        assert result[key] > 0
    rows = result["detokenize"]
    assert len(rows) == 6 and all(r["bounded_us"] > 0 and r["unbounded_us"] > 0 for r in rows)
    assert "unbounded" in done.stdout
