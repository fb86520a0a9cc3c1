"""host_overhead's method on the CPU (the tiny model, the forward taken out): both HTTP stacks serve every request
whole and the HTTP process's CPU is counted per token; how much it is, is the benchmark's to say, not the test's."""

import json

from tests.benchmarks.helpers import run_benchmark


def test_both_http_stacks_stream_every_token_at_a_gpu_steps_pace(tmp_path):
    out = tmp_path / "ho.json"
    done = run_benchmark("host_overhead", "--stream", "--step-ms", "1", "--concurrency", "2", "--requests", "4",
                         "--output", "16", "--http", "server", "h11", "--repeats", "1", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["step_ms"] == 1.0 and result["http"] == ["server", "h11"]
    assert [r["http"] for r in result["runs"]] == ["server", "h11"]
    for run in result["runs"]:
        assert run["all_complete_finite"] and run["output_tokens"] == 4 * 16
        # a 1 ms sleep per forward: no decode step is shorter
        assert run["decode_step_ms"] >= 1.0 and run["http_cpu_us_per_token"] > 0
    assert [m["http"] for m in result["median"]] == ["server", "h11"]
    assert "HTTP us/token" in done.stdout


def test_openai_completions_streams_are_counted_token_by_token(tmp_path):
    out = tmp_path / "ho.json"
    done = run_benchmark("host_overhead", "--stream", "--api", "completions", "--concurrency", "2", "--requests", "4",
                         "--output", "16", "--repeats", "1", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["api"] == "completions" and [r["api"] for r in result["runs"]] == ["completions"]
    run = result["runs"][0]
    # every token's chunk reached the client as one (ignore_eos: all 16 of each), each with its own arrival time
    assert run["all_complete_finite"] and run["output_tokens"] == 4 * 16 and run["ttft_mean_ms"] > 0
    assert "/v1/completions" in done.stdout
