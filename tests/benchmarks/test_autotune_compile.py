"""benchmarks/autotune_compile.py: each cell's process gets an empty Triton cache and its thread count; a failed
cell names itself; bad arguments stop it (no GPU)."""

import argparse
import json
import os
import subprocess

import pytest

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("autotune_compile")


_ROW = {"seconds": 17.2, "compile_seconds": 9.7, "kernels": 23, "timed": 56, "candidates": 56,
        "pick": '{"BLOCK_N":64}', "pick_ms": 0.27, "default_ms": 0.29}  # fmt: skip


def test_each_cell_runs_in_a_fresh_process_with_an_empty_triton_cache(bench, monkeypatch, capsys):
    seen = []

    def fake_run(cmd, env, capture_output, text, timeout):
        seen.append((cmd, env))
        assert os.path.isdir(env["TRITON_CACHE_DIR"]) and not os.listdir(env["TRITON_CACHE_DIR"])
        out = json.dumps({"cold": _ROW, "warm": {**_ROW, "seconds": 6.3}})
        return subprocess.CompletedProcess(cmd, 0, stdout="a log line\n" + out + "\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    args = argparse.Namespace(graph_len=32768, group=8, budget=300.0, cell_timeout=100.0)
    rows = [bench.run_cell("int8", "hq32-hk8-d128", 8, threads, args) for threads in (1, 8)]
    assert [env["LIGHTLLM_AUTOTUNE_COMPILE_THREADS"] for _, env in seen] == ["1", "8"]
    assert {env["LIGHTLLM_AUTOTUNE_MAX_SECONDS_PER_SEARCH"] for _, env in seen} == {"300.0"}
    assert seen[0][1]["TRITON_CACHE_DIR"] != seen[1][1]["TRITON_CACHE_DIR"]  # one cache per cell, removed after
    assert not os.path.exists(seen[0][1]["TRITON_CACHE_DIR"])
    assert seen[0][0][-6:] == ["--child", "int8", "hq32-hk8-d128", "8", "32768", "8"]
    assert rows[1]["warm"]["seconds"] == 6.3
    bench.print_row({"kind": "int8", "shape": "hq32-hk8-d128", "B": 8, "threads": 8, **rows[1]})
    line = capsys.readouterr().out
    assert "17.20" in line and "9.70" in line and "56/56" in line and "6.30" in line


def test_a_failed_cell_names_itself(bench, monkeypatch):
    monkeypatch.setattr(
        bench.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="boom")
    )
    args = argparse.Namespace(graph_len=4096, group=8, budget=30.0, cell_timeout=10.0)
    with pytest.raises(RuntimeError, match="int4 hq24-hk4-d256 B=2 threads=4 failed:\nboom"):
        bench.run_cell("int4", "hq24-hk4-d256", 2, 4, args)


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--batches", "0"], ["--budget", "0"]])
def test_bad_arguments_stop_it(bench, argv):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
