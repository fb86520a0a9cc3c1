"""benchmarks/gemv.py: its method end to end on tiny shapes (``--dry-run``, the interpreter on a CPU) and the table
from a saved run; the GPU timings are the benchmark's, not a test's."""

import json
import math

import pytest
import torch

from tests.benchmarks.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gemv")


def test_dry_run_times_cublas_and_every_candidate(bench, tmp_path, capsys):
    from lightllm.kernels.linear.small_m_linear import _configs

    out = tmp_path / "gemv.json"
    bench.main(["--dry-run", "--out", str(out)])
    saved = json.loads(out.read_text())
    cells = saved["cells"]
    assert [(c["proj"], c["M"]) for c in cells] == [(p, m) for p in ("qkv", "down", "lm_head") for m in (1, 3)]
    for cell in cells:
        n, k, out_name = bench.DRY_SHAPES["tiny"][cell["proj"]]
        expected = _configs(torch.empty(1, k, dtype=torch.float16), torch.empty(n, k, dtype=torch.float16))
        assert cell["out_dtype"] == ("torch.float32" if out_name else "torch.float16")
        for timing in (cell, cell["warm"]):
            assert [cfg for cfg, _ in timing["configs"]] == expected and timing["cublas_ms"] > 0
            assert all(math.isfinite(ms) and ms > 0 for _, ms in timing["configs"])
    assert len(saved["rows"]) == len(cells)
    table = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("tiny         ") for line in table) == len(cells) + 2  # + a layer sum per M


def test_analyze_prints_a_saved_run(bench, tmp_path, capsys):
    fast = {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}
    slow = {**fast, "SPLIT_K": 4}
    gb = 1e9  # bytes: 1 GB in 0.5 ms is 2 TB/s
    cells = [
        {"shape": "qwen3-8b", "proj": "gate_up", "N": 1, "K": 1, "M": 1, "out_dtype": "torch.bfloat16",
         "weight_bytes": gb, "copies": 2, "cublas_ms": 0.5, "configs": [[fast, 0.4], [slow, 0.6]],
         # one weight (L2-warm): slow looks fastest, and costs 50 % over the cold best (0.6 against 0.4)
         "warm": {"cublas_ms": 0.3, "configs": [[fast, 0.25], [slow, 0.2]]}},
        {"shape": "qwen3-8b", "proj": "down", "N": 1, "K": 1, "M": 1, "out_dtype": "torch.bfloat16",
         "weight_bytes": gb, "copies": 2, "cublas_ms": 0.4, "configs": [[fast, 0.5], [slow, 0.8]]},
        {"shape": "qwen3-8b", "proj": "lm_head", "N": 1, "K": 1, "M": 1, "out_dtype": "torch.float32",
         "weight_bytes": gb, "copies": 2, "cublas_ms": 1.0, "configs": [[fast, 0.8]]},
    ]  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"device": "NVIDIA H200", "dtype": "torch.bfloat16", "cold_bytes": 512 << 20,
                                "gemv_GBs": 4300.0, "cells": cells}))  # fmt: skip
    rows = bench.analyze(json.loads(path.read_text()))
    assert rows[0]["best_cfg"] == fast and rows[0]["best_TBs"] == pytest.approx(2.5)
    assert rows[0]["warm_pick"] == slow and rows[0]["warm_pick_loss_pct"] == pytest.approx(50)
    assert rows[1]["speedup"] == pytest.approx(0.8) and rows[1]["warm_pick"] is None
    # the layer: cuBLAS 0.9 ms; the best of each (0.4 gate_up, 0.4 down: cuBLAS) 0.8 ms; lm_head apart
    (layer,) = bench.layer_sums(rows)
    assert (layer["cublas_ms"], layer["best_ms"], layer["bytes"]) == pytest.approx((0.9, 0.8, 2 * gb))
    bench.main(["--analyze", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert "torch.mv 1 GiB rate 4.30 TB/s" in lines[0]
    assert lines[2].split()[:10] == ["qwen3-8b", "gate_up", "1", "1", "1", "0.5000", "2.00", "0.4000", "2.50", "1.25"]
    assert lines[-1].split() == ["qwen3-8b", "all", "1", "0.9000", "2.22", "0.8000", "2.50", "1.12"]


def test_qwen3_5_layer_sums_are_one_per_layer_kind(bench):
    """Qwen3.5-27B's layers are full attention (qkv, o) or linear attention (in_proj, out_proj), 1:3, each with the
    MLP: one sum per kind and M, never the four attention projections in one "layer"."""
    shape = bench.SHAPES["qwen3.5-27b"]
    ms = {proj: 2**i for i, proj in enumerate(shape)}  # powers of two: each set of projections has its own sum
    rows = [{"shape": "qwen3.5-27b", "proj": proj, "M": m, "cublas_ms": ms[proj] * m, "best_ms": ms[proj] * m / 2,
             "weight_bytes": n * k * 2} for proj, (n, k, _) in shape.items() for m in (1, 4)]  # fmt: skip
    sums = {(s["layer"], s["M"]): s for s in bench.layer_sums(rows)}
    assert sorted(sums) == [("full", 1), ("full", 4), ("linear", 1), ("linear", 4)]
    for kind, projs in (
        ("full", ("qkv", "o", "gate_up", "down")),
        ("linear", ("in_proj", "out_proj", "gate_up", "down")),
    ):
        for m in (1, 4):
            s = sums[(kind, m)]
            assert s["cublas_ms"] == sum(ms[p] * m for p in projs) and s["best_ms"] == s["cublas_ms"] / 2
            assert s["bytes"] == sum(shape[p][0] * shape[p][1] * 2 for p in projs)


def test_bad_arguments(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "17"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--shapes", "qwen9"])
