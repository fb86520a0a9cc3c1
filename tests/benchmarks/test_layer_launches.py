"""benchmarks/layer_launches.py counts what one eager Qwen3 layer (or each Qwen3.5 layer kind) launches through the
attention backend's GPU path (not mocked) and records it: a Qwen3 decode layer is 4 GEMMs, 6 Triton launches and one
view, with no KV write launch and no per-layer indexing of the pool or transposes of the weights."""

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


def test_counts_each_qwen3_5_layer_kind_apart(tmp_path):
    """``--model qwen3.5``: a gated DeltaNet decode layer is 4 GEMMs and 6 Triton launches (conv update, delta rule,
    gated norm, two add + norm, SiLU * up); a gated attention one 4 GEMMs and 7 (q/k norm + partial rotary writing the
    KV cache too, attention's two stages, the output gate, two add + norm, SiLU * up). Neither transposes a weight
    nor indexes the KV pool or the state pools per layer (no ``t`` or ``select`` view)."""
    out = tmp_path / "runs.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "layer_launches.py"), "--model", "qwen3.5", "--label",
           "smoke", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)  # the benchmark runs Triton's own (compiled-kernel) launch path
    done = proc.run(cmd, timeout=proc.HANG_TIMEOUT_S, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out.read_text())
    assert (run["label"], run["model"]) == ("smoke", "qwen3.5")
    decode = run["per_layer"]["decode"]
    shared = {"torch mm.default": 4, "triton _add_rmsnorm_kernel": 2, "triton _silu_mul_kernel": 1}
    linear = {"triton _conv1d_update_kernel": 1, "triton _gated_delta_decode_kernel": 1,
              "triton _gated_rmsnorm_kernel": 1, "view slice.Tensor": 7, "view view.default": 5}  # fmt: skip
    assert decode["linear_attention"] == {"total": 10, **shared, **linear}
    full = {name: n for name, n in decode["full_attention"].items() if not name.startswith("view ")}
    assert full == {"total": 11, **shared, "triton _qk_norm_rope_kernel": 1, "triton _sigmoid_gate_mul_kernel": 1,
                    "triton decode_stage1_kernel": 1, "triton decode_stage2_kernel": 1}  # fmt: skip
    for phase in ("decode", "prefill"):  # (prefill's torch conv selects its taps: not a pool index)
        for kind, row in run["per_layer"][phase].items():
            assert not {"view t.default", "triton _write_kv_kernel"} & set(row), (phase, kind)
            assert phase == "prefill" or "view select.int" not in row, kind
