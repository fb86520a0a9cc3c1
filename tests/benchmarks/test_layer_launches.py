"""benchmarks/layer_launches.py counts what one eager Qwen3 layer launches through the attention backend's GPU path
(not mocked) and records it: a decode layer is 4 GEMMs, 6 Triton launches and one view, with no KV write launch and
no per-layer indexing of the pool or transposes of the weights."""

import json
import os
import sys

from lightllm.common import proc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_counts_and_records_a_layers_launches(tmp_path):
    out = tmp_path / "runs.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "layer_launches.py"), "--label", "smoke", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)  # the benchmark runs Triton's own (compiled-kernel) launch path
    done = proc.run(cmd, timeout=proc.HANG_TIMEOUT_S, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out.read_text())
    assert run["label"] == "smoke"
    triton = {"_add_rmsnorm_kernel": 2, "_qk_norm_rope_kernel": 1, "_silu_mul_kernel": 1}
    decode = {"torch mm.default": 4, "view view.default": 1, "triton decode_stage1_kernel": 1,
              "triton decode_stage2_kernel": 1, **{f"triton {k}": n for k, n in triton.items()}}  # fmt: skip
    assert run["per_layer"]["decode"] == {"total": 10, **decode}
    prefill = run["per_layer"]["prefill"]
    assert prefill["total"] == 9 and "triton _write_kv_kernel" not in prefill
