"""serve_load's plan and its reading of the tuned files (the GPU run itself is a benchmark, not a test)."""

import importlib.util
import os

import pytest
import torch

from lightllm.common.autotuner import AutotuneKernelType, autotune_warmup, set_bench_func
from lightllm.kernels.attention.decode import flash_decode, gqa_decode_attention

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", os.path.join(REPO, "benchmarks", "serve_load.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("control", [False, True])
def test_start_order_tunes_first_then_rotates(serve_load, control):
    modes = ["on", "off"] + (["off_b"] if control else [])
    orders = [serve_load.start_order(rep, control) for rep in range(len(modes))]
    assert orders[0][0] == "on"  # the start that tunes comes before any start that copies its files
    assert all(sorted(o) == sorted(modes) for o in orders)
    for position in range(len(modes)):  # over len(modes) repeats every mode starts once at every position
        assert sorted(o[position] for o in orders) == sorted(modes)


def test_per_step_attention_reads_what_a_search_wrote(serve_load, monkeypatch, isolated_autotune):
    """A real decode-attention search (interpreter, stubbed timer: the default takes 2 ms, every candidate
    1 ms) writes its config file; the benchmark reads tuned and default time per graph batch back from it."""
    monkeypatch.setenv("LIGHTLLM_TRITON_AUTOTUNE_LEVEL", "1")
    monkeypatch.setenv("LIGHTLLM_DECODE_ATTN_AUTOTUNE_SEQ_LEN", "1024")
    tuned = flash_decode._launch_gqa_flash_decode
    tuned.clear_cache()
    monkeypatch.setattr(tuned, "configs_gen_func", lambda q, block_seq: [{"BLOCK_N": 16, "num_warps": 2,
                                                                          "num_stages": 1, "WAVES": 1}])  # fmt: skip
    calls = []

    def bench(run_fn):
        run_fn()
        calls.append(run_fn)
        return 2.0 if len(calls) <= 2 else 1.0  # two lengths (1024, 512): the default is timed first

    set_bench_func(bench)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g)
    k, v = torch.randn(512, 2, 64, generator=g), torch.randn(512, 2, 64, generator=g)
    r2t = torch.arange(3 * 8, dtype=torch.int32).view(3, 8)
    with autotune_warmup(AutotuneKernelType.DECODE_ATTENTION):
        gqa_decode_attention(q, k, v, r2t, torch.tensor([0, 2], dtype=torch.int32),
                             torch.tensor([3, 8], dtype=torch.int32), 2048, block_seq=64)  # fmt: skip
    tuned.clear_cache()
    assert len(calls) == 4
    timings = serve_load.decode_attention_timings(isolated_autotune)
    assert timings == {("gqa_flash_decode", 2): (1.0, 2.0)}
    assert serve_load.per_step_attention(timings, 2, layers=4) == {"tuned_ms": 4.0, "default_ms": 8.0, "layers": 4}
    assert serve_load.per_step_attention(timings, 16, layers=4) is None  # no graph of that batch was tuned


def test_runs_end_to_end_on_the_tiny_model(tmp_path):
    """The whole method on the CPU at tp 2: servers started in order, every request whole, an A/A pair, the
    ranks' config agreement read from each start's log, JSON written."""
    import json
    import subprocess
    import sys

    out = tmp_path / "out.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "serve_load.py"), "--tiny", "--tp", "2", "--requests", "3",
           "--concurrency", "2", "--repeats", "1", "--control", "--workloads", "short", "--out", str(out),
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "LIGHTLLM_AUTOTUNE_CONFIG_DIR": str(tmp_path / "unused")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(s["mode"], s["repeat"]) for s in result["startups"]] == [("on", 0), ("off", 0), ("off_b", 0)]
    assert all(s["ranks"]["agree"] and s["ranks"]["ranks"] == 2 for s in result["startups"])
    (row,) = result["rows"]
    assert row["concurrency"] == 2 and result["control"] is True
    for mode in ("on", "off", "off_b"):
        (run,) = row[mode]["runs"]
        assert run["all_complete_finite"] and run["output_tokens"] == 3 * 256
        # from the server's step histograms: each request's first token comes from its prefill, the rest
        # from decode steps, and every step of the load is counted once
        assert round(run["prefill_batch"] * run["prefill_steps"]) == 3
        assert round(run["decode_batch"] * run["decode_steps"]) == 3 * 255
        assert run["decode_step_ms"] > 0 and 1 <= run["decode_batch"] <= 2
    assert sorted(p.name for p in (tmp_path / "logs").glob("*.log")) == [
        "server_tp2_short_off0.log", "server_tp2_short_off_b0.log", "server_tp2_short_on0.log"]  # fmt: skip
    assert "off_b vs off" in done.stdout and row["on"]["decode_step_ms"] > 0
